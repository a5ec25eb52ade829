"""LoRA adapters served over HTTP: one real server with two adapters on the tiny base.

A request names its adapter with ``model``; concurrent requests for different adapters
share batched steps and each gets what it gets alone; ``/v1/models`` lists the adapters;
an unknown model is a 404; the per-model counters carry the adapter; mixing adapters
compiles nothing after warm-up; and the CLI's ``--adapter`` mistakes are usage errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jax
import pytest
from conftest import run_cli, tiny_run_dir

from jaxlab.serve import ModelService, ServerThread
from jaxlab.tokenizer import byte_tokenizer

OVERRIDES = [
    "tokenizer.kind=byte",
    "model.vocab_size=258",
    "inference.prefill_buckets=[32,64]",
    "inference.max_len=64",
    "inference.stream_chunk_tokens=4",
    "serve.slots=4",
    "serve.decode_groups=1",
    "serve.prefill_chunk_tokens=0",
    'serve.adapters={alpha="unused", beta="unused"}',
]
PROMPT = "the quick brown fox jumps over it"  # 33 bytes: two pages of 16 can be cached


def _adapter(cfg: Any, rank: int, targets: tuple[str, ...], seed: int) -> Any:
    from jaxlab.model import lora

    w = lora.init_weights(cfg.model, rank, targets, jax.random.PRNGKey(seed))
    key = jax.random.PRNGKey(seed + 100)
    return {
        n: {"a": p["a"], "b": 0.5 * jax.random.normal(jax.random.fold_in(key, i), p["b"].shape)}
        for i, (n, p) in enumerate(w.items())
    }


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    from jaxlab.config import load_config
    from jaxlab.infer.engine import Engine
    from jaxlab.model import lora, make_model, split_model

    cfg = load_config("tiny", OVERRIDES, environ={})
    graphdef, params = split_model(make_model(cfg.model, cfg.train.precision, seed=0))
    stacked = lora.stack(
        cfg.model,
        [(_adapter(cfg, 4, ("q", "v"), 1), 2.0), (_adapter(cfg, 8, ("o", "mlp"), 2), 2.0)],
    )
    engine = Engine(graphdef, params, cfg, adapters=stacked)
    srv = ServerThread(ModelService.from_engine(engine, byte_tokenizer(), cfg)).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def complete(srv: ServerThread, model: str | None, prompt: str = PROMPT) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    if model is not None:
        body["model"] = model
    r = httpx.post(srv.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_lists_the_base_and_each_adapter(server: ServerThread) -> None:
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["jaxlab", "alpha", "beta"]
    assert [m.get("parent") for m in data] == [None, "jaxlab", "jaxlab"]


def test_an_unknown_model_is_an_openai_shaped_404(server: ServerThread) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "model": "gamma"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "'alpha'" in err["message"] and "'beta'" in err["message"]


def test_mixed_adapters_batched_equal_each_alone_and_use_the_prefix_cache_per_adapter(
    server: ServerThread,
) -> None:
    svc = server.service
    assert svc.scheduler is not None
    warmed = dict(svc.scheduler.compiles_after_warmup or {})
    # Alone, one at a time; the repeats of one adapter hit its own prefix pages only.
    alone = {m: complete(server, m) for m in ("alpha", "beta", "jaxlab")}
    again = {m: complete(server, m) for m in ("alpha", "beta", "jaxlab")}
    for m in alone:
        assert alone[m]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, m
        assert again[m]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32, m
        assert again[m]["choices"][0]["text"] == alone[m]["choices"][0]["text"], m
    texts = {m: alone[m]["choices"][0]["text"] for m in alone}
    assert len(set(texts.values())) == 3  # each adapter answers its own way
    # Together: a dozen requests over three models share the batched steps.
    models = ["alpha", "beta", None, "beta"] * 3
    with ThreadPoolExecutor(len(models)) as pool:
        mixed = list(pool.map(lambda m: complete(server, m), models))
    for m, doc in zip(models, mixed, strict=True):
        assert doc["model"] == (m or "jaxlab")
        assert doc["choices"][0]["text"] == texts[m or "jaxlab"], m
    assert svc.scheduler.engine.compiles == warmed  # adapter ids are data: no compile


def test_the_per_model_counters_carry_the_adapter(server: ServerThread) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    complete(server, "beta")
    text = httpx.get(server.url + "/metrics").text
    samples = {
        (s.name, s.labels.get("model")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("jaxlab_model_")
    }
    for model in ("jaxlab", "alpha", "beta"):
        assert ("jaxlab_model_requests_total", model) in samples
    assert samples[("jaxlab_model_requests_total", "beta")] >= 1
    assert samples[("jaxlab_model_generation_tokens_total", "beta")] >= 12
    assert samples[("jaxlab_model_prompt_tokens_total", "beta")] >= len(PROMPT)


def test_the_cli_refuses_bad_adapters_with_exit_2(tmp_path: Path, tmp_path_factory) -> None:
    """Malformed ``--adapter``, a directory that is not a LoRA run, and a LoRA run whose
    recorded base is another checkpoint (its metadata: what the CLI checks before it
    loads anything): each exit 2, one line naming the problem, no traceback."""
    base = tiny_run_dir(tmp_path_factory)
    lora_run = tmp_path / "lora"
    lora_run.mkdir()
    config = (base / "config.toml").read_text()
    extra = f'\n[train.lora]\nrank = 4\n\n[train]\ninit_from = "{base}"\n'
    lora_cfg = config.replace("[train]\n", f'[train]\ninit_from = "{base}"\n', 1)
    assert lora_cfg != config, extra
    (lora_run / "config.toml").write_text(lora_cfg + "\n[train.lora]\nrank = 4\n")
    (lora_run / "base.json").write_text(
        json.dumps({"run_dir": str(base), "step": 30, "params_sha256": "0" * 64})
    )
    cases = {
        "nameonly": "expected NAME=LORA_RUN_DIR",
        f"x={base}": "not a LoRA run",
        f"tuned={lora_run}": "0" * 64,
    }
    for option, needle in cases.items():
        r = run_cli("serve", "--run-dir", str(base), "--port", "0", "--adapter", option)
        assert r.returncode == 2, (option, r.stderr)
        assert needle in r.stderr and "Traceback" not in r.stderr, (option, r.stderr)
