"""Suite ``peer``: jaxlab side by side with Hugging Face transformers' GPT-2 (PyTorch
eager, CPU), same shapes, in one benchmark run.

jaxlab runs its GPT-2-like variant (GELU MLP of ``d_mlp``, learned positions, tied
embeddings), so both sides do the same FLOPs per token; records say which variant ran.
The peer runs under ``bench.peer_python`` (a Python with torch + transformers) via
``jaxlab/bench/peers/hf_gpt2.py``; its raw per-repetition timings become ordinary records.
Ratios are computed from medians measured in this same run.

    jaxlab bench peer --config bench-small --set bench.peer_python=/path/to/venv/bin/python
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.suites import suite
from jaxlab.config import JaxlabConfig


def gpt2_like(cfg: JaxlabConfig) -> JaxlabConfig:
    out = cfg.model_copy(deep=True)
    out.model.mlp = "gelu"
    out.model.positions = "learned"
    out.model.tie_embeddings = True
    out.model.dropout_rate = 0.0
    return out


def run_peer(python: str, spec: dict[str, Any], timeout_s: float = 1800) -> dict[str, Any]:
    from jaxlab.bench.peers import hf_gpt2

    proc = subprocess.run(
        [python, str(Path(hf_gpt2.__file__)), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"peer exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


PEER_INSTALL = "python -m venv peer && peer/bin/pip install torch==2.13.0 transformers"


def peer_problem(python: str) -> str | None:
    """Why ``python`` cannot run the peer (None when it can): checked once, up front, so a
    wrong ``bench.peer_python`` is one clear failure rather than a traceback per case."""
    fix = f"point bench.peer_python at a Python with both ({PEER_INSTALL})"
    try:
        proc = subprocess.run(
            [python, "-c", "import torch, transformers"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except OSError as e:
        return f"bench.peer_python = {python!r} cannot be run ({e.strerror or e}); {fix}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return (
            f"bench.peer_python = {python!r} cannot import torch and transformers ({last}); {fix}"
        )
    return None


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


@suite(
    "peer",
    needs_peak=True,
    default=False,
    description="side by side with HF transformers GPT-2 (PyTorch eager): train and generate",
)
def peer_suite(ctx: BenchContext) -> Iterator[Record]:
    from jaxlab.bench.infer_suites import generation_record
    from jaxlab.bench.model_suites import train_record
    from jaxlab.infer.engine import Engine

    python = ctx.config.bench.peer_python
    shape_case = {"peer": "hf-gpt2"}
    if not python:
        yield ctx.failure(
            "peer",
            "bench.peer_python is not set: point it at a Python with "
            f"torch and transformers ({PEER_INSTALL})",
            case=shape_case,
        )
        return
    problem = peer_problem(python)
    if problem:
        yield ctx.failure("peer", problem, case=shape_case)
        return
    cfg = gpt2_like(ctx.config)
    m = cfg.model
    shape = {
        "vocab_size": m.vocab_size,
        "max_seq_len": m.max_seq_len,
        "d_model": m.d_model,
        "n_layers": m.n_layers,
        "n_heads": m.n_heads,
        "d_mlp": m.d_mlp,
    }
    reps = ctx.repeats(quick_cap=3)

    # ---- training: same batch x seq_len, AdamW, f32
    b, t = cfg.train.batch_size, cfg.data.seq_len
    ours = train_record(ctx, cfg, b, 1)
    yield ours
    case = {"batch_size": b, "seq_len": t, "side": "hf-gpt2 (torch eager)"}
    ctx.status(f"peer train {case}")
    try:
        res = run_peer(
            python,
            {
                "task": "train",
                **shape,
                "batch_size": b,
                "seq_len": t,
                "repeats": reps,
                "warmup": ctx.warmup(quick_cap=1) or 1,
            },
        )
        theirs = ctx.record(
            "step_time",
            "s",
            res["samples_s"],
            case=case,
            derived={
                "tokens_per_s": b * t / _median(res["samples_s"]),
                "peer": res["peer"],
                "threads": res["threads"],
            },
        )
    except Exception as e:
        theirs = ctx.failure("step_time", e, case=case)
    yield theirs
    if ours.status == "ok" and theirs.status == "ok":
        ratio = ours.derived["tokens_per_s"] / theirs.derived["tokens_per_s"]
        yield ctx.record(
            "train_speedup_vs_peer",
            "x",
            [ratio],
            better="higher",
            case={"batch_size": b, "seq_len": t, "variant": "gpt2-like"},
            derived={
                "jaxlab_tokens_per_s": ours.derived["tokens_per_s"],
                "peer_tokens_per_s": theirs.derived["tokens_per_s"],
            },
        )

    # ---- generation: 32-token prompt, 128 new tokens, greedy
    cap = cfg.inference.max_len or m.max_seq_len
    prompt, new = min(32, cap // 4), min(128 if not ctx.quick else 32, cap // 2)
    engine = Engine.from_config(cfg, seed=0)
    ours_by: dict[tuple[int, bool], Record] = {}
    for batch, kv in ((1, True), (8, True), (8, False)):
        ours_by[(batch, kv)] = rec = generation_record(
            ctx, engine, batch, prompt, new, kv_cache=kv, extra={"variant": "gpt2-like"}
        )
        yield rec
    for batch, kv in ((1, True), (8, True), (1, False), (8, False)):
        case = {
            "batch": batch,
            "prompt_len": prompt,
            "new_tokens": new,
            "kv_cache": kv,
            "side": "hf-gpt2 generate()",
        }
        ctx.status(f"peer generate {case}")
        try:
            res = run_peer(
                python,
                {
                    "task": "generate",
                    **shape,
                    "batch_size": batch,
                    "prompt_len": prompt,
                    "new_tokens": new,
                    "use_cache": kv,
                    "repeats": reps,
                    "warmup": 1,
                },
            )
            rec = ctx.record(
                "generate_s",
                "s",
                res["samples_s"],
                case=case,
                derived={
                    "tokens_per_s": batch * new / _median(res["samples_s"]),
                    "peer": res["peer"],
                },
            )
        except Exception as e:
            rec = ctx.failure("generate_s", e, case=case)
        yield rec
        mine = ours_by.get((batch, True))
        if kv and mine is not None and mine.status == "ok" and rec.status == "ok":
            r = mine.derived["tokens_per_s"] / rec.derived["tokens_per_s"]
            yield ctx.record(
                "generate_speedup_vs_peer",
                "x",
                [r],
                better="higher",
                case={"batch": batch, "kv_cache": True, "variant": "gpt2-like"},
                derived={
                    "jaxlab_tokens_per_s": mine.derived["tokens_per_s"],
                    "peer_tokens_per_s": rec.derived["tokens_per_s"],
                },
            )
    cached, naive = ours_by[(8, True)], ours_by[(8, False)]
    if cached.status == "ok" and naive.status == "ok":
        yield ctx.record(
            "cached_over_naive",
            "x",
            [cached.derived["tokens_per_s"] / naive.derived["tokens_per_s"]],
            better="higher",
            case={"batch": 8, "variant": "gpt2-like"},
        )
