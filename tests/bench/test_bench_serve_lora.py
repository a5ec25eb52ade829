"""The ``serve-lora`` suite through the CLI, quick, on the tiny preset: the base server's and
the adapter server's load runs both measured without errors, and the ratio the adapters'
record derives is the one of the two measured output rates. Speed is not judged here."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli

from jaxlab.bench.record import load_records
from jaxlab.bench.serve_lora import ADAPTERS, RANK, TARGET_RATIO

#: The quick run's prompts are 16 tokens (``max_len`` / 4): one prefill bucket of 16 and
#: chunks of 16 leave the warm-up one chunk length to compile per server (row counts and
#: chunk starts as served), not two.
SETS = (
    "inference.max_len=64",
    "inference.max_new_tokens=8",
    "inference.prefill_buckets=[16]",
    "serve.prefill_chunk_tokens=16",
    "serve.decode_groups=1",
)


@pytest.mark.slow
def test_serve_lora_suite_measures_both_servers(tmp_path):
    sets = [x for s in SETS for x in ("--set", s)]
    r = run_cli(
        "bench", "serve-lora", "--quick", "-c", "tiny", *sets, "--out", str(tmp_path), "--json",
        timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    records = [x for x in load_records(Path(r.json()["out_dir"])) if x.suite == "serve-lora"]
    assert records and all(x.status == "ok" for x in records), [
        (x.metric, x.error) for x in records
    ]
    e2e = {x.case["model"]: x for x in records if x.metric == "e2e_s"}
    assert set(e2e) == {"base", "adapters"}
    base, lora = e2e["base"].derived, e2e["adapters"].derived
    assert base["errors"] == 0 and lora["errors"] == 0
    assert e2e["adapters"].case["adapters"] == ADAPTERS and e2e["adapters"].case["rank"] == RANK
    assert lora["output_tokens_per_s_base"] == base["output_tokens_per_s"]
    assert lora["lora_to_base"] == lora["output_tokens_per_s"] / base["output_tokens_per_s"]
    (ratio,) = [x for x in records if x.metric == "lora_throughput_ratio"]
    assert ratio.samples == [lora["lora_to_base"]] and ratio.derived["target"] == TARGET_RATIO
