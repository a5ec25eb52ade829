"""Speculative decoding's cases: the ``speculative`` suite, and the ``decode`` suite's last
cases when ``bench.speculative_run_dir`` names a trained run. Batch-1 greedy generation
with and without speculation, same model, same prompts, calls alternating.

Two workloads (``docs/speculative.md`` says why these two):

* ``code``: completion of stdlib source. Each prompt is a window of a stdlib file the model
  never trained on (a held-out document of ``data.eval_fraction``); code repeats its own
  names and phrases, so prompt lookup has something to find. It needs a model that has
  learnt code: ``bench.speculative_run_dir`` (a run of ``jaxlab train --config
  bench-small``); without one it is left out (a random-init model copies nothing).
* ``random``: prompts of uniformly random token ids, where lookup finds little; the cost of
  trying (and of switching off) shows.

Each timed sample generates every prompt of the workload once, one request at a time
(batch 1), plainly and then speculating; the records are the two sides' seconds, their
ratio (``speculative_speedup``, with each pair's own ratio) and the acceptance rate. The
speculative tokens are checked against the plain ones: greedy output must be identical.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.stats import median
from jaxlab.bench.suites import suite
from jaxlab.config import ConfigError, JaxlabConfig

#: Prompts per workload (each sample generates all of them).
PROMPTS = 4


def code_prompts(
    tokenizer: Any, eval_fraction: float, count: int, length: int, seed: int = 0
) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from held-out stdlib files (documents that
    ``data.eval_fraction`` kept out of training), each from a different file, starting a
    quarter into the file (past the module docstring and imports)."""
    import numpy as np

    from jaxlab.data.cache import is_eval_document
    from jaxlab.data.sources import stdlib_files

    files = [f for i, f in enumerate(stdlib_files()) if is_eval_document(i, eval_fraction)]
    order = np.random.default_rng(seed).permutation(len(files))
    out: list[list[int]] = []
    for i in order:
        ids = tokenizer.encode(files[i].read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= 4 * length:
            start = len(ids) // 4
            out.append(ids[start : start + length])
        if len(out) == count:
            return out
    raise RuntimeError(f"fewer than {count} held-out stdlib files of {4 * length} tokens")


def random_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(count, length)).tolist()


def speculative_cases(ctx: BenchContext, random_engine: Any) -> Iterator[Record]:
    """The cases (module docstring): ``bench.speculative_run_dir``'s model for both
    workloads, or ``random_engine`` (random-init) for the random one alone."""
    from jaxlab.infer.speculative import SpeculativeEngine

    bench = ctx.config.bench
    spec_cfg = ctx.config.inference.speculative
    if bench.speculative_run_dir is None:
        engine, tokenizer, weights = random_engine, None, "random-init"
        eval_fraction = ctx.config.data.eval_fraction
    else:
        from jaxlab.infer.engine import Engine
        from jaxlab.infer.load import load_run

        run = load_run(bench.speculative_run_dir)
        engine = Engine(run.graphdef, run.params, run.cfg)
        tokenizer, weights = run.tokenizer, f"{bench.speculative_run_dir}@{run.step}"
        eval_fraction = run.cfg.data.eval_fraction
    methods: list[tuple[str, Any]] = [
        ("ngram", SpeculativeEngine(engine, spec_cfg.model_copy(update={"method": "ngram"})))
    ]
    if bench.speculative_draft_run_dir is not None and tokenizer is not None:
        from jaxlab.infer.speculative import load_draft

        draft_cfg = spec_cfg.model_copy(
            update={"method": "draft", "draft_run_dir": bench.speculative_draft_run_dir}
        )
        draft = load_draft(bench.speculative_draft_run_dir, engine, tokenizer)
        methods.append(("draft", SpeculativeEngine(engine, draft_cfg, draft)))
    cap = engine.max_len
    prompt_len, new = min(128, cap // 2), min(128, cap // 2)
    if ctx.quick:
        new = min(new, 32)
    count = 2 if ctx.quick else PROMPTS
    workloads: dict[str, list[list[int]]] = {}
    if tokenizer is not None:  # code completion needs a model that has learnt code
        workloads["code"] = code_prompts(tokenizer, eval_fraction, count, prompt_len)
    workloads["random"] = random_prompts(engine.vocab_size, count, prompt_len)
    for workload, prompts in workloads.items():
        for method, spec in methods:
            case = {
                "batch": 1,
                "workload": workload,
                "speculative": method,
                "k": spec_cfg.k,
                "prompt_len": prompt_len,
                "new_tokens": new,
                "weights": weights,
            }
            yield from _pair(ctx, engine, spec, prompts, new, case)


def _pair(
    ctx: BenchContext,
    engine: Any,
    spec: Any,
    prompts: list[list[int]],
    new: int,
    case: dict[str, Any],
) -> Iterator[Record]:
    """Plain and speculative generation of ``prompts`` in turn: their records and ratio."""
    from jaxlab.infer import offline
    from jaxlab.infer.request import Request
    from jaxlab.infer.sampling import SamplingParams

    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    requests = [Request.create(p, sp, engine.limits()) for p in prompts]
    ctx.status(f"speculative {case}")

    def run(device: Any) -> tuple[float, list[Any]]:
        t0 = time.perf_counter()
        results = [offline.generate(device, [r])[0] for r in requests]
        return time.perf_counter() - t0, results

    try:
        _, plain = run(engine)  # warm-up: compiles both
        _, fast = run(spec)
        if [r.token_ids for r in fast] != [r.token_ids for r in plain]:
            raise RuntimeError("speculative greedy output differs from plain greedy output")
        before = engine.compiles
        plain_s, spec_s = [], []
        for _ in range(ctx.repeats(quick_cap=3)):
            seconds, _ = run(engine)
            plain_s.append(seconds)
            seconds, fast = run(spec)
            spec_s.append(seconds)
        usage = [r.speculative for r in fast if r.speculative is not None]
        drafted = sum(u.draft_tokens for u in usage)  # every call drafts the same
        accepted = sum(u.accepted_tokens for u in usage)
        switched_off = sum(u.switched_off for u in usage)
        recompiles = {k: v - before.get(k, 0) for k, v in engine.compiles.items()}
    except Exception as e:
        yield ctx.failure("speculative_speedup", e, case=case, unit="x")
        return
    tokens = len(requests) * new
    rate = accepted / drafted if drafted else None
    common = {"recompiles_while_timed": recompiles, "prompts": len(requests)}

    def profiled(device: Any) -> dict[str, Any]:
        """``--profile``: one more untimed call of the first prompt, traced."""
        if not ctx.profile:
            return {}
        return ctx.profile_call(
            lambda: offline.generate(device, requests[:1]), "spec_generate_s", sync=lambda g: g
        )

    yield ctx.record(
        "spec_generate_s",
        "s",
        plain_s,
        case={**case, "speculative": "off"},
        derived={"tokens_per_s": tokens / median(plain_s), **common, **profiled(engine)},
    )
    yield ctx.record(
        "spec_generate_s",
        "s",
        spec_s,
        case=case,
        derived={
            "tokens_per_s": tokens / median(spec_s),
            "acceptance_rate": rate,
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "switched_off_requests": switched_off,
            **common,
            **profiled(spec),
        },
    )
    yield ctx.record(
        "speculative_speedup",
        "x",
        [median(plain_s) / median(spec_s)],
        better="higher",
        case=case,
        derived={
            "pair_ratios": [p / s for p, s in zip(plain_s, spec_s, strict=True)],
            "acceptance_rate": rate,
            "plain_tokens_per_s": tokens / median(plain_s),
            "speculative_tokens_per_s": tokens / median(spec_s),
            "switched_off_requests": switched_off,
        },
    )


def check(cfg: JaxlabConfig) -> None:
    """The run directories the cases load exist (before jax starts: a usage error, exit 2)."""
    b = cfg.bench
    for name, path in (
        ("bench.speculative_run_dir", b.speculative_run_dir),
        ("bench.speculative_draft_run_dir", b.speculative_draft_run_dir),
    ):
        if path is not None and not (Path(path) / "checkpoints").is_dir():
            raise ConfigError(
                [f"{name} = {path!r} is not a run directory with checkpoints (jaxlab train)"]
            )


@suite(
    "speculative",
    default=False,
    new_shapes=True,
    check=check,
    description="batch 1 with and without speculative decoding (the decode suite's last cases)",
)
def speculative_suite(ctx: BenchContext) -> Iterator[Record]:
    from jaxlab.infer.engine import Engine

    yield from speculative_cases(ctx, Engine.from_config(ctx.config, seed=0))


__all__ = ["PROMPTS", "check", "code_prompts", "random_prompts", "speculative_cases"]
