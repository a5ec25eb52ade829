"""The ``lora`` suite through the CLI: a full fine-tuning record and a LoRA one, with exact
optimizer-state bytes (AdamW's two f32 moments per trained value, plus its counters)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli

from jaxlab.bench.record import load_records
from jaxlab.config import load_config
from jaxlab.model import param_count

pytestmark = pytest.mark.slow


def test_lora_suite_counts_the_optimizer_state_exactly(tmp_path):
    r = run_cli("bench", "lora", "--quick", "-c", "tiny", "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    records = [x for x in load_records(Path(r.json()["out_dir"])) if x.suite == "lora"]
    assert [x.case["case"] for x in records] == ["full", "lora-qv"]
    assert all(x.status == "ok" for x in records)
    full, lora = (x.derived for x in records)
    model = load_config("tiny", [], environ={}).model
    assert full["trainable_params"] == param_count(model)
    # q and v adapters, rank 8, per layer: (d_model + out) * 8 each.
    d, qw, vw = model.d_model, model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    assert lora["trainable_params"] == model.n_layers * 8 * ((d + qw) + (d + vw))
    for rec in (full, lora):
        moments = 2 * 4 * rec["trainable_params"]
        assert moments <= rec["optimizer_state_bytes"] <= moments + 64
    assert (
        lora["optimizer_state_saving"]
        == full["optimizer_state_bytes"] / lora["optimizer_state_bytes"]
    )
    assert lora["frozen_param_bytes"] == 4 * param_count(model) and lora["step_time_ratio"] > 0
