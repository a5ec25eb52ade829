"""Fine-tuning from a base run, in process with real Orbax: full fine-tuning starts from the
base's parameters and records it; LoRA trains only adapters (the base stays bitwise as it
was, the optimizer state holds the adapters alone), lowers the loss, resumes exactly, and
refuses a base that is not its own."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxlab.checkpoint import Checkpointer
from jaxlab.config import JaxlabConfig, load_config
from jaxlab.model import flops_per_token, lora_flops_per_token
from jaxlab.train import base as base_run
from jaxlab.train.adapter import check_base, load_adapter
from jaxlab.train.run_dir import RunDir
from jaxlab.train.trainer import Trainer


def cfg_for(root: Path, *overrides: str) -> JaxlabConfig:
    return load_config(
        "tiny",
        [
            f"runtime.artifacts_dir={root / 'art'}",
            "tokenizer.kind=byte",
            "model.vocab_size=258",
            "data.synthetic_docs=200",
            "data.seq_len=32",
            "train.steps=40",
            "train.log_every_steps=1",
            "train.schedule.warmup_steps=2",
            "checkpoint.every_steps=3",
            *overrides,
        ],
        environ={},
    )


def fine_tune_cfg(root: Path, base: Path, *overrides: str) -> JaxlabConfig:
    """A run from ``base`` on a new data source: one short sentence, over and over."""
    text = root / "task.jsonl"
    if not text.exists():
        text.write_text("".join(f'{{"text": "abc abd abe {i % 3}. "}}\n' for i in range(400)))
    cfg = cfg_for(
        root,
        "data.source=jsonl",
        f"data.paths=[{str(text)!r}]",
        "data.eval_fraction=0.1",
        f"train.init_from={str(base)!r}",
        *overrides,
    )
    ref, base_cfg = base_run.resolve(base)
    return base_run.adopt(cfg, base_cfg, ref)


LORA = ("train.lora.rank=4", "train.optimizer.learning_rate=1e-2")


def trees_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True)
    )


def base_params(base: Path):
    ck = Checkpointer(base / "checkpoints", read_only=True)
    state, _ = ck.restore("latest", None)
    ck.close()
    return state["params"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("base")
    with Trainer(cfg_for(root), root / "run") as t:
        t.run(stop_at=3)
    return root / "run"


def test_full_fine_tuning_starts_from_the_base_and_records_it(base, tmp_path):
    cfg = fine_tune_cfg(tmp_path, base)
    ref, _ = base_run.resolve(base)
    with Trainer(cfg, tmp_path / "ft") as t:
        assert t.step == 0
        assert trees_equal(t.state["params"], base_params(base))
        mu = t.state["opt_state"][1][0].mu  # clip, then AdamW: fresh moments
        assert all(float(np.abs(np.asarray(m)).max()) == 0.0 for m in jax.tree.leaves(mu))
        t.run(stop_at=3)
        assert not trees_equal(t.state["params"], base_params(base))
    assert base_run.read_record(tmp_path / "ft") == ref
    assert ref.run_dir == str(base.absolute()) and ref.step == 3 and len(ref.params_sha256) == 64
    meta = Checkpointer(tmp_path / "ft" / "checkpoints", read_only=True).restore_meta(3)
    assert meta["base"] == ref.to_json()


def test_lora_trains_only_the_adapter_and_lowers_the_loss(base, tmp_path):
    before = base_params(base)
    cfg = fine_tune_cfg(tmp_path, base, *LORA, 'train.lora.targets=["q","v","o","mlp"]')
    with Trainer(cfg, tmp_path / "lora") as t:
        adapter_shapes = {tuple(x.shape) for x in jax.tree.leaves(t.state["params"])}
        # MFU counts the FLOPs a LoRA step does: no gradients for the base's weights.
        adapter = sum(x.size for x in jax.tree.leaves(t.state["params"]))
        want = lora_flops_per_token(cfg.model, cfg.data.seq_len, adapter)
        assert t.flops_per_token == want < flops_per_token(cfg.model, cfg.data.seq_len)
        for x in jax.tree.leaves(t.state["opt_state"]):
            assert x.ndim == 0 or tuple(x.shape) in adapter_shapes  # no base-sized moments
        first = t.evaluate()["loss"]
        t.run(stop_at=30)
        last = t.evaluate()["loss"]
        assert trees_equal(t.base_params, before)  # the frozen base, bitwise
    losses = list(t.run_dir.loss_history().values())
    assert last < first - 0.3, (first, last)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3
    assert trees_equal(base_params(base), before)  # and the base run's checkpoint too
    ck = Checkpointer(tmp_path / "lora" / "checkpoints", read_only=True)
    saved, meta = ck.restore("latest", None)
    ck.close()
    assert set(saved["params"]) == {"q", "v", "o", "mlp_in", "mlp_down"}  # the adapter only
    assert meta["base"]["params_sha256"] == base_run.resolve(base)[0].params_sha256


def test_lora_resume_equals_uninterrupted(base, tmp_path):
    extra = (*LORA, "train.lora.dropout=0.2", "train.grad_accum_steps=2")
    cfg = fine_tune_cfg(tmp_path, base, *extra)
    with Trainer(cfg, tmp_path / "full") as t:
        t.run(stop_at=6)
        full = t.state
    with Trainer(cfg, tmp_path / "split") as t:
        t.run(stop_at=3)
    with Trainer(cfg, tmp_path / "split") as t:
        assert t.restore() == 3
        t.run(stop_at=6)
        assert trees_equal(t.state, full)
    assert RunDir(tmp_path / "split").loss_history() == RunDir(tmp_path / "full").loss_history()


def test_an_adapter_refuses_a_base_that_is_not_its_own(base, tmp_path):
    cfg = fine_tune_cfg(tmp_path, base, *LORA)
    with Trainer(cfg, tmp_path / "lora") as t:
        t.run(stop_at=3)
    adapter = load_adapter(tmp_path / "lora")
    good = base_run.resolve(base)[0].params_sha256
    check_base(adapter, good)
    with pytest.raises(base_run.WrongBase, match=f"{good}.*{'0' * 64}"):
        check_base(adapter, "0" * 64)

    # The base directory now holds another run (another seed): resuming names both hashes.
    other = tmp_path / "other"
    with Trainer(cfg_for(tmp_path, "runtime.seed=7"), other) as t:
        t.run(stop_at=3)
    moved = tmp_path / "moved-base"
    shutil.copytree(base, moved)
    try:
        shutil.rmtree(base)
        shutil.copytree(other, base)
        found = base_run.resolve(base)[0].params_sha256
        with pytest.raises(base_run.WrongBase) as e:
            Trainer(cfg, tmp_path / "lora")
        assert good in str(e.value) and found in str(e.value)
    finally:
        shutil.rmtree(base)
        shutil.copytree(moved, base)
