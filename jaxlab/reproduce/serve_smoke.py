"""The serving stage of ``jaxlab reproduce``: a real server, concurrent requests, metrics.

Starts uvicorn on 127.0.0.1 with an ephemeral port (a background thread), waits for
``/ready``, sends concurrent ``/v1/completions`` requests with different seeds, checks that
each answer equals offline generation for the same prompt and seed, and that the request
counters in ``/metrics`` add up to what was sent.
"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from jaxlab.config import JaxlabConfig


class SmokeFailed(Exception):
    pass


def _request(url: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    """``(status, text)`` of a GET, or of a JSON POST when ``body`` is given (stdlib only:
    a handful of blocking requests from a thread pool)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def serve_smoke(run_dir: Path, cfg: JaxlabConfig, *, requests: int = 8) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    from jaxlab.infer.engine import Engine
    from jaxlab.infer.load import load_run
    from jaxlab.infer.offline import generate
    from jaxlab.infer.request import Request
    from jaxlab.infer.sampling import SamplingParams
    from jaxlab.serve import ModelService, ServerThread

    serve_cfg = cfg.model_copy(deep=True)
    serve_cfg.serve.slots = 4
    service = ModelService.from_run_dir(serve_cfg, run_dir)
    prompts = [f"count: {i} {i + 1} {i + 2}" for i in range(requests)]
    bodies = [
        {"prompt": p, "max_tokens": 12, "temperature": 0.8 if i % 2 else 0.0, "seed": i}
        for i, p in enumerate(prompts)
    ]
    with ServerThread(service) as srv:
        srv.wait_ready()
        ready, _ = _request(srv.url + "/ready")

        def one(body: dict[str, Any]) -> tuple[int, str]:
            return _request(srv.url + "/v1/completions", body)

        with concurrent.futures.ThreadPoolExecutor(max_workers=requests) as pool:
            answers = list(pool.map(one, bodies))
        _, metrics_text = _request(srv.url + "/metrics")
    statuses = [status for status, _ in answers]
    if ready != 200 or any(s != 200 for s in statuses):
        raise SmokeFailed(f"/ready {ready}, completions statuses {statuses}")
    texts = [json.loads(text)["choices"][0]["text"] for _, text in answers]

    run = load_run(run_dir, cfg=serve_cfg)
    engine = Engine(run.graphdef, run.params, run.cfg)
    tok = run.tokenizer
    offline = generate(
        engine,
        [
            Request.create(
                tok.encode(b["prompt"]),
                SamplingParams(max_new_tokens=12, temperature=b["temperature"], seed=b["seed"]),
                engine.limits(tok.eot_id),
            )
            for b in bodies
        ],
        tokenizer=tok,
    )
    mismatched = [i for i, (t, r) in enumerate(zip(texts, offline, strict=True)) if t != r.text]
    if mismatched:
        raise SmokeFailed(f"served text differs from offline generate for requests {mismatched}")

    ok_count = 0.0
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == "jaxlab_requests":
            ok_count = sum(
                s.value
                for s in fam.samples
                if s.name == "jaxlab_requests_total" and s.labels.get("status") == "200"
            )
    if ok_count != requests:
        raise SmokeFailed(f"jaxlab_requests_total counted {ok_count} ok requests, sent {requests}")
    return {
        "summary": f"{requests} concurrent completions on {srv.url}: all 200, equal to offline "
        f"generate; /metrics counted {int(ok_count)}",
        "url": srv.url,
        "metrics_text": metrics_text,
    }
