"""The loader: precedence, extends, env parsing, error messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxlab.config import (
    ConfigError,
    JaxlabConfig,
    config_hash,
    load_config,
    preset_names,
    resolve_config,
    validate_file,
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_presets_ship_with_exact_reference_shapes():
    assert {"tiny", "small", "bench-tiny", "bench-small", "tpu-small", "tpu-medium"} <= set(
        preset_names()
    )
    shapes = {
        "tiny": (512, 2, 64, 4, 4, 256, 64, 8),
        "bench-tiny": (4096, 2, 128, 4, 4, 512, 128, 32),
        "bench-small": (8192, 4, 256, 4, 4, 1024, 256, 16),
        "tpu-small": (32768, 12, 768, 12, 12, 3072, 1024, 16),
        "tpu-medium": (32768, 24, 1024, 16, 16, 4096, 1024, 16),
    }
    for name, want in shapes.items():
        c = load_config(name, environ={})
        m = c.model
        got = (m.vocab_size, m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.d_mlp)
        assert (*got, c.data.seq_len, c.train.batch_size) == want, name


def test_the_tpu_presets_compute_in_bf16_at_their_documented_sizes():
    from jaxlab.model import param_count

    small, medium = load_config("tpu-small", environ={}), load_config("tpu-medium", environ={})
    assert round(param_count(small.model) / 1e6, 1) == 163.6
    assert round(param_count(medium.model) / 1e6, 1) == 469.8
    for c in (small, medium):
        assert c.train.precision.compute_dtype == "bfloat16"
        assert c.model.head_dim == 64 and c.tokenizer.n_vocab == c.model.vocab_size
    # The knobs measured on the chip: Pallas flash for both; a batch of 16 as eight
    # micro-batches of 2 without remat (medium's fits one 16 GB chip that way), the head's
    # cross-entropy in blocks of 4,096 tokens.
    assert small.model.attention_impl == medium.model.attention_impl == "pallas"
    for c in (small, medium):
        assert (c.train.grad_accum_steps, c.train.remat) == (8, "none")
        assert c.train.loss_chunk_tokens == 4096


def test_each_source_beats_the_one_below(tmp_path):
    f = write(tmp_path, "run.toml", 'extends = "tiny"\n[train]\nsteps = 11\nbatch_size = 4\n')
    assert load_config(None, environ={}).train.steps == JaxlabConfig().train.steps
    assert load_config(f, environ={}).train.steps == 11
    env = {"JAXLAB_TRAIN__STEPS": "22"}
    assert load_config(f, environ=env).train.steps == 22
    r = resolve_config(f, ["train.steps=33"], environ=env)
    assert r.config.train.steps == 33
    assert r.sources["train.steps"] == "--set"
    assert r.sources["train.batch_size"] == str(f)
    assert r.sources["model.d_model"] == "preset tiny"  # inherited through extends
    assert r.sources["runtime.seed"] == "default"
    r = resolve_config(f, [], environ=env)
    assert r.sources["train.steps"] == "env JAXLAB_TRAIN__STEPS"


def test_extends_chain_relative_paths_and_cycles(tmp_path):
    write(tmp_path, "base.toml", 'extends = "tiny"\n[model]\nn_layers = 3\n')
    child = write(tmp_path, "child.toml", 'extends = "base.toml"\n[model]\nd_model = 96\n')
    c = load_config(child, environ={})
    assert (c.model.n_layers, c.model.d_model, c.model.vocab_size) == (3, 96, 512)
    a = write(tmp_path, "a.toml", 'extends = "b.toml"\n')
    write(tmp_path, "b.toml", 'extends = "a.toml"\n')
    with pytest.raises(ConfigError, match="cycle"):
        load_config(a, environ={})


def test_env_values_are_parsed_by_type():
    env = {
        "JAXLAB_TRAIN__OPTIMIZER__LEARNING_RATE": "0.0005",
        "JAXLAB_MODEL__TIE_EMBEDDINGS": "true",
        "JAXLAB_DATA__PATHS": '["a.txt", "b/*.txt"]',
        "JAXLAB_RUNTIME__SEED": "7",
        "JAXLAB_SERVE__API_KEY": "s3cret",
    }
    c = load_config("tiny", environ=env)
    assert c.train.optimizer.learning_rate == 0.0005
    assert c.model.tie_embeddings is True
    assert c.data.paths == ["a.txt", "b/*.txt"]
    assert c.runtime.seed == 7
    assert c.serve.api_key is not None and c.serve.api_key.get_secret_value() == "s3cret"


def test_set_values_parse_as_toml_literals():
    c = load_config(
        "tiny",
        ["model.mlp=gelu", "inference.prefill_buckets=[16, 32, 64]", "train.remat=true"],
        environ={},
    )
    assert c.model.mlp == "gelu"
    assert c.inference.prefill_buckets == [16, 32, 64]
    assert c.train.remat == "full"  # a boolean (older configs) names a policy


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.d_model=66"], "model.d_model: must be divisible by model.n_heads (got 66 and 4)"),
        (["model.d_model=12", "model.n_heads=4"], "even head_dim"),
        (["model.n_kv_heads=3"], "model.n_kv_heads: must divide model.n_heads"),
        (["data.seq_len=512"], "data.seq_len: must be <= model.max_seq_len (got 512 > 128)"),
        (["model.vocab_size=300"], "model.vocab_size: smaller than the tokenizer's vocabulary"),
        (
            ["train.grad_accum_steps=3"],
            "train.batch_size: must be divisible by train.grad_accum_steps",
        ),
        (["parallel.data=3"], "divisible by the data-parallel size"),
        (["parallel.data=-1", "parallel.fsdp=-1"], "only one mesh axis may be -1"),
        (["parallel.tensor=0"], "mesh axis tensor must be >= 1 or -1"),
        (["inference.max_len=1000"], "inference.max_len: must be <= model.max_seq_len"),
        (
            ["inference.prefill_buckets=[64, 32]"],
            "inference.prefill_buckets: must be strictly increasing",
        ),
        (
            ["train.steps=0"],
            "train.steps: Input should be greater than or equal to 1 (got 0, expected >= 1)",
        ),
        (["model.mlp=relu"], "expected one of 'swiglu' or 'gelu'"),
        (["tokenizer.vocab_size=100"], "expected >= 258"),
        (
            ["inference.top_k=99999999999"],
            "inference.top_k: top_k must be an integer in [0, 2147483647], 0 = off",
        ),
        (["inference.temperature=0.001"], "temperature must be 0 (greedy) or a number in"),
        (["inference.seed=-1"], "inference.seed: seed must be an integer in [0, 2147483647]"),
    ],
)
def test_every_validation_rule_names_field_and_fix(overrides, needle):
    with pytest.raises(ConfigError) as exc:
        load_config("tiny", overrides, environ={})
    text = "\n".join(exc.value.issues)
    assert needle in text
    # Each line is blamed on the source that set the field it names.
    assert all(line.startswith(("--set: ", "preset tiny: ")) for line in exc.value.issues)


def test_unknown_keys_are_errors_with_suggestions(tmp_path):
    f = write(tmp_path, "typo.toml", "[model]\nd_modle = 64\n[trian]\nsteps = 3\n")
    issues = validate_file(f)
    assert f"{f}: model.d_modle: unknown key (did you mean 'd_model'?)" in issues
    assert any("trian: unknown key (did you mean 'train'?)" in i for i in issues)
    with pytest.raises(ConfigError, match="did you mean JAXLAB_TRAIN__"):
        load_config(None, environ={"JAXLAB_TRIAN__STEPS": "3"})
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, environ={"JAXLAB_TRAIN__STEPZ": "3"})
    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        load_config(None, ["train.optimizer.learning_rat=1"], environ={})


def test_process_switches_are_not_config_fields():
    """``JAXLAB_XLA_CPU_DEFAULTS=0`` (documented opt-out) must not break config loading."""
    from jaxlab.config.loader import PROCESS_ENV
    from jaxlab.runtime.platform import OPT_OUT_ENV

    assert OPT_OUT_ENV in PROCESS_ENV
    cfg = load_config(None, environ={OPT_OUT_ENV: "0", "JAXLAB_TRAIN__STEPS": "3"})
    assert cfg.train.steps == 3


def test_malformed_toml_reports_line_and_column(tmp_path):
    f = write(tmp_path, "bad.toml", "[model]\nd_model = 64\nn_heads = = 4\n")
    (issue,) = validate_file(f)
    assert issue.startswith(f"{f}: malformed TOML:")
    assert "line 3" in issue and "column" in issue


def test_bad_set_syntax_and_missing_file():
    with pytest.raises(ConfigError, match=r"expected section\.field=value"):
        load_config(None, ["steps"], environ={})
    with pytest.raises(ConfigError, match="did you mean preset 'tiny'"):
        load_config("tinyy", environ={})


def test_config_hash_is_stable_and_sensitive():
    a = load_config("tiny", environ={})
    assert config_hash(a) == config_hash(load_config("tiny", environ={}))
    assert config_hash(a) != config_hash(load_config("tiny", ["train.steps=7"], environ={}))


def test_a_file_that_is_not_utf8_names_the_file_and_byte(tmp_path):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes("[train]\nsteps = 3 # café\n".encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        resolve_config(bad, environ={})
    (issue,) = e.value.issues
    assert issue.startswith(f"{bad}: not UTF-8 text (byte 0xe9 at offset ")
    assert validate_file(bad) == [issue]


def test_env_overrides_name_each_changed_field_and_its_variable(tmp_path):
    from jaxlab.config import EnvOverride, env_overrides

    path = write(tmp_path, "run.toml", "[train]\nsteps = 30\n[model]\nd_model = 64\n")
    env = {
        "JAXLAB_TRAIN__STEPS": "30",
        "JAXLAB_MODEL__D_MODEL": "128",
        "JAXLAB_DATA__SEQ_LEN": "32",
    }
    resolved, changed = env_overrides(path, env)
    assert resolved.config.model.d_model == 128
    assert changed == [  # an equal value is no override
        EnvOverride("data.seq_len", "JAXLAB_DATA__SEQ_LEN", 32, 64),
        EnvOverride("model.d_model", "JAXLAB_MODEL__D_MODEL", 128, 64),
    ]
