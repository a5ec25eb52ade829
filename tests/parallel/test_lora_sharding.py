"""LoRA under the mesh: adapters trained on a DP x FSDP (and a TP) mesh of simulated devices,
over a sharded frozen base, equal the single-device run."""

from __future__ import annotations

import pytest
from test_parallel_sharding import HERE, assert_close, load, run_meshes


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-sharded")
    run_meshes(out, "1,1,1", devices=1, script=HERE / "lora_sharded_runs.py")
    run_meshes(out, "2,4,1", "2,2,2", devices=8, script=HERE / "lora_sharded_runs.py")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["2x4x1", "2x2x2"])
def test_sharded_lora_matches_single_device(lora_runs, mesh):
    assert_close(lora_runs, "1x1x1", mesh)
    meta, _ = load(lora_runs, mesh)
    # The frozen base really is sharded (FSDP over d_model), not replicated.
    assert any("fsdp" in s for s in meta["base_specs"]), meta["base_specs"]
