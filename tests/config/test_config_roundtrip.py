"""Any valid config survives TOML: config -> TOML -> load == original."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlab.config import JaxlabConfig, from_toml, to_toml


@st.composite
def valid_configs(draw) -> JaxlabConfig:
    n_kv = draw(st.sampled_from([1, 2, 4]))
    n_heads = n_kv * draw(st.integers(1, 4))
    head_dim = 2 * draw(st.integers(1, 16))
    max_seq = draw(st.integers(8, 1024))
    accum = draw(st.integers(1, 4))
    tok_kind = draw(st.sampled_from(["byte", "bpe"]))
    tok_vocab = draw(st.integers(258, 5000))
    vocab = max(tok_vocab, 258) + draw(st.integers(0, 100))
    data = {
        "runtime": {
            "seed": draw(st.integers(0, 2**31)),
            "platform": draw(st.sampled_from(["auto", "cpu"])),
        },
        "model": {
            "vocab_size": vocab,
            "n_layers": draw(st.integers(1, 8)),
            "d_model": n_heads * head_dim,
            "n_heads": n_heads,
            "n_kv_heads": n_kv,
            "d_mlp": draw(st.integers(1, 4096)),
            "max_seq_len": max_seq,
            "mlp": draw(st.sampled_from(["swiglu", "gelu"])),
            "positions": draw(st.sampled_from(["rope", "learned"])),
            "rope_theta": draw(st.floats(1.0, 1e6, allow_nan=False)),
            "tie_embeddings": draw(st.booleans()),
            "dropout_rate": draw(st.floats(0.0, 0.9)),
        },
        "tokenizer": {"kind": tok_kind, "vocab_size": tok_vocab},
        "data": {
            "seq_len": draw(st.integers(2, max_seq)),
            "paths": draw(st.lists(st.text("abc/*._", min_size=1, max_size=8), max_size=3)),
        },
        "train": {
            "steps": draw(st.integers(1, 10_000)),
            "batch_size": accum * draw(st.integers(1, 8)),
            "grad_accum_steps": accum,
            "optimizer": {
                "learning_rate": draw(st.floats(1e-6, 1.0)),
                "clip_norm": draw(st.sampled_from([0.0, 0.5, 1.0])),
            },
            "schedule": {"kind": draw(st.sampled_from(["cosine", "linear", "constant"]))},
            "precision": {"compute_dtype": draw(st.sampled_from(["float32", "bfloat16"]))},
        },
        "parallel": {"data": 1, "fsdp": 1, "tensor": draw(st.sampled_from([1, 2, -1]))},
        "serve": {
            "slots": draw(st.integers(1, 64)),
            "api_key": draw(st.none() | st.text("xyz0", min_size=1)),
        },
    }
    return JaxlabConfig.model_validate(data)


@settings(max_examples=60, deadline=None)
@given(valid_configs())
def test_toml_round_trip(cfg: JaxlabConfig):
    back = from_toml(to_toml(cfg, secrets=True))
    assert back == cfg
