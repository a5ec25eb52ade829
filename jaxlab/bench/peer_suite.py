"""Suite ``peer``: jaxlab side by side with Hugging Face transformers' GPT-2 (PyTorch
eager, CPU), same shapes, in one benchmark run.

jaxlab runs its GPT-2-like variant (GELU MLP of ``d_mlp``, learned positions, tied
embeddings), so both sides do the same FLOPs per token; records say which variant ran.
The peer runs under ``bench.peer_python`` (a Python with torch + transformers) via
``jaxlab/bench/peers/hf_gpt2.py``, one process for the whole suite (``PeerSession``); its
raw per-repetition timings become ordinary records. The two sides' repetitions alternate
(peer, jaxlab, peer, jaxlab, ...), so every ratio compares medians taken under the same
machine conditions, and each pair's own ratio is recorded beside it (``pair_ratios``).

    jaxlab bench peer --config bench-small --set bench.peer_python=/path/to/venv/bin/python

Beside the float rows, the batch-1 cached case runs once more with int8 weights
(``inference.weights = "int8"``, quantized from the same float weights) against a fresh
run of the peer's float32 case: the row labelled "int8 vs HF float32", and the read
ceiling recomputed for the int8 step's bytes.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.peer_session import PeerSession
from jaxlab.bench.record import Record
from jaxlab.bench.stats import median
from jaxlab.bench.suites import suite
from jaxlab.bench.timing import describe_error
from jaxlab.config import JaxlabConfig


def gpt2_like(cfg: JaxlabConfig) -> JaxlabConfig:
    """The GPT-2-like variant of ``cfg``, its weights float (the int8 row sets its own)."""
    out = cfg.model_copy(deep=True)
    out.model.mlp = "gelu"
    out.model.positions = "learned"
    out.model.tie_embeddings = True
    out.model.dropout_rate = 0.0
    out.inference.weights = "float"
    out.inference.activations = "float"
    return out


def with_int8_weights(cfg: JaxlabConfig, activations: str) -> JaxlabConfig:
    """``cfg`` with ``inference.weights = "int8"`` (and the given activations)."""
    out = cfg.model_copy(deep=True)
    out.inference.weights = "int8"
    out.inference.activations = "int8" if activations == "int8" else "float"
    return out


#: What the int8 row is called in records and reports: jaxlab's int8 weights against the
#: peer's float32 ones, the same model and work on both sides.
INT8_LABEL = "int8 vs HF float32"


#: Untimed pause on each side of a peer repetition, so that neither side's worker threads
#: (OpenMP's in torch, XLA's pool) are still spinning down when the other's timed call starts.
SETTLE_S = 0.05

#: Untimed calls each side makes right before each of its timed ones. The other side's turn
#: has just filled the caches with its own data; without this, every jaxlab batch-1 call
#: would start by re-reading its weights from DRAM, which a steady generation loop never
#: pays (the cost is in docs/performance.md).
WARM_EACH = 1


def peer_script() -> Path:
    from jaxlab.bench.peers import hf_gpt2

    return Path(hf_gpt2.__file__)


class PeerTurns:
    """``before=`` hook that runs one timed peer repetition of ``key`` ahead of each of
    jaxlab's calls, so the two sides' samples alternate: peer, jaxlab, peer, jaxlab, ...

    A peer failure is kept (``error``) and ends the peer's turns; jaxlab's side goes on.
    """

    def __init__(
        self,
        peer: PeerSession,
        key: str,
        warm: int = 0,
        sleep: Callable[[float], Any] = time.sleep,
    ):
        self.peer, self.key, self.warm, self.sleep = peer, key, warm, sleep
        self.samples: list[float] = []
        self.error: str | None = None

    def __call__(self) -> None:
        if self.error is not None:
            return
        self.sleep(SETTLE_S)
        try:
            self.samples.append(self.peer.time(self.key, warm=self.warm))
        except Exception as e:
            self.error = describe_error(e)
        self.sleep(SETTLE_S)

    def paired(self, n: int) -> list[float]:
        """The peer samples beside jaxlab's ``n`` timed calls: the last ``n`` (the earlier
        ones ran beside its warm-up calls)."""
        return self.samples[-n:] if n > 0 else []


#: Reads of the weight buffer per timed peer repetition of the ``read`` case: a sample
#: holds many, so it times a steady stream of reads rather than one call's start-up (read
#: times in docs/performance.md).
READS_PER_SAMPLE = 32


def read_ceiling(
    read_s: float, weight_bytes: int, peer_tokens_per_s: float, jaxlab_tokens_per_s: float
) -> dict[str, float]:
    """What one streaming read of a decode step's weights per generated token allows.

    At batch 1 every generated token costs at least one read of the step's weights
    (prefill reads them once for the first token, each decode step once more), so no
    implementation whose step reads them from memory generates faster than
    ``1 / read_s`` tokens/s on this machine. ``ceiling_over_peer`` is the largest
    batch-1 ratio over the peer that such an implementation could reach here.
    """
    ceiling = 1.0 / read_s
    return {
        "read_gb_per_s": weight_bytes / read_s / 1e9,
        "ceiling_tokens_per_s": ceiling,
        "ceiling_over_peer": ceiling / peer_tokens_per_s,
        "peer_tokens_per_s": peer_tokens_per_s,
        "jaxlab_tokens_per_s": jaxlab_tokens_per_s,
        "jaxlab_share_of_ceiling": jaxlab_tokens_per_s / ceiling,
    }


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


@suite(
    "peer",
    needs_peak=True,
    default=False,
    new_shapes=True,
    description="side by side with HF transformers GPT-2 (PyTorch eager): train and generate",
)
def peer_suite(ctx: BenchContext) -> Iterator[Record]:
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
    with PeerSession(python, peer_script()) as peer:
        yield from _side_by_side(ctx, peer)


def _speedup(
    ctx: BenchContext, metric: str, case: dict[str, Any], ours: Record, theirs: Record
) -> Record | None:
    """jaxlab's tokens/s over the peer's (ratio of medians), with each pair's own ratio:
    the peer's seconds over jaxlab's for the same work, in turn. None unless both are ok."""
    if ours.status != "ok" or theirs.status != "ok":
        return None
    mine, peer = ours.derived["tokens_per_s"], theirs.derived["tokens_per_s"]
    pairs = [t / o for o, t in zip(ours.samples, theirs.samples, strict=False) if o > 0]
    return ctx.record(
        metric,
        "x",
        [mine / peer],
        better="higher",
        case=case,
        derived={
            "jaxlab_tokens_per_s": mine,
            "peer_tokens_per_s": peer,
            "interleaved": theirs.derived["interleaved"],
            "pair_ratios": pairs,
        },
    )


def _peer_record(
    ctx: BenchContext,
    peer: PeerSession,
    key: str,
    spec: dict[str, Any],
    metric: str,
    case: dict[str, Any],
    work: float,
    run_ours: Callable[[Callable[[], None] | None, int], Record] | None,
    warm: int,
) -> tuple[Record | None, Record]:
    """Prepare the peer's case, then measure jaxlab's (``run_ours(before, warm_each)``) with
    one peer repetition ahead of each of its calls; without ``run_ours`` the peer runs
    alone. Each side makes ``warm`` untimed calls right before each timed one. Returns
    ``(ours, theirs)``; ``work`` is tokens per repetition (the same on both sides)."""
    ctx.status(f"peer prepare {key}")
    try:
        info = peer.prepare(key, spec)
    except Exception as e:
        ours = run_ours(None, 0) if run_ours else None
        return ours, ctx.failure(metric, e, case=case)
    turns = PeerTurns(peer, key, warm=warm)
    if run_ours is not None:
        ours = run_ours(turns, warm)
        samples = turns.paired(len(ours.samples))
    else:
        ours = None
        for _ in range(ctx.repeats(quick_cap=3)):  # as many as generation_record takes
            turns()
        samples = turns.samples
    if not samples and turns.error is None:
        turns.error = "no peer repetition was paired: jaxlab's side failed before timing one"
    try:
        peer.drop(key)
    except Exception as e:
        turns.error = turns.error or describe_error(e)
    derived: dict[str, Any] = {"peer": info.get("peer")}
    if "threads" in info:
        derived["threads"] = info["threads"]
    derived["interleaved"] = ours is not None
    derived["warm_each"] = warm
    if turns.error is None and samples:
        derived["tokens_per_s"] = work / median(samples)
    theirs = ctx.record(metric, "s", samples, case=case, derived=derived, error=turns.error)
    return ours, theirs


def _side_by_side(ctx: BenchContext, peer: PeerSession) -> Iterator[Record]:
    from jaxlab.bench.infer_suites import generation_record
    from jaxlab.bench.model_suites import train_record
    from jaxlab.infer.engine import Engine

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

    # ---- training: same batch x seq_len, AdamW, f32; one step of each side in turn
    b, t = cfg.train.batch_size, cfg.data.seq_len
    ours, theirs = _peer_record(
        ctx,
        peer,
        "train",
        {
            "task": "train",
            **shape,
            "batch_size": b,
            "seq_len": t,
            "warmup": ctx.warmup(quick_cap=1) or 1,
        },
        "step_time",
        {"batch_size": b, "seq_len": t, "side": "hf-gpt2 (torch eager)"},
        b * t,
        lambda before, warm: train_record(ctx, cfg, b, 1, before=before, warm_each=warm),
        WARM_EACH,
    )
    assert ours is not None
    yield ours
    yield theirs
    ratio = _speedup(
        ctx,
        "train_speedup_vs_peer",
        {"batch_size": b, "seq_len": t, "variant": "gpt2-like"},
        ours,
        theirs,
    )
    if ratio is not None:
        yield ratio

    # ---- generation: 32-token prompt, 128 new tokens, greedy; one call of each in turn
    cap = cfg.inference.max_len or m.max_seq_len
    prompt, new = min(32, cap // 4), min(128 if not ctx.quick else 32, cap // 2)
    engine = Engine.from_config(cfg, seed=0)
    ours_by: dict[tuple[int, bool], Record] = {}
    theirs_by: dict[tuple[int, bool], Record] = {}
    for batch, kv in ((1, True), (8, True), (1, False), (8, False)):
        case = {
            "batch": batch,
            "prompt_len": prompt,
            "new_tokens": new,
            "kv_cache": kv,
            "side": "hf-gpt2 generate()",
        }
        spec = {
            "task": "generate",
            **shape,
            "batch_size": batch,
            "prompt_len": prompt,
            "new_tokens": new,
            "use_cache": kv,
            "warmup": 1,
        }

        def run_ours(
            before: Callable[[], None] | None, warm: int, batch: int = batch, kv: bool = kv
        ) -> Record:
            return generation_record(
                ctx,
                engine,
                batch,
                prompt,
                new,
                kv_cache=kv,
                extra={"variant": "gpt2-like"},
                before=before,
                warm_each=warm,
            )

        # jaxlab's naive path is measured at batch 8 only (the cached/naive target)
        mine_runs = not (batch == 1 and not kv)
        mine, rec = _peer_record(
            ctx,
            peer,
            f"generate-b{batch}-{'cache' if kv else 'naive'}",
            spec,
            "generate_s",
            case,
            batch * new,
            run_ours if mine_runs else None,
            # the naive path recomputes the whole prefix, for seconds a call, far beyond any
            # cache: warming it again would double the suite's longest case for nothing
            # (call times in docs/performance.md)
            WARM_EACH if kv else 0,
        )
        if mine is not None:
            ours_by[(batch, kv)] = mine
            yield mine
        theirs_by[(batch, kv)] = rec
        yield rec
        if kv and mine is not None:
            ratio = _speedup(
                ctx,
                "generate_speedup_vs_peer",
                {"batch": batch, "kv_cache": True, "variant": "gpt2-like"},
                mine,
                rec,
            )
            if ratio is not None:
                yield ratio
    yield from _read_ceiling(
        ctx, peer, engine.step_weight_bytes, ours_by.get((1, True)), theirs_by.get((1, True))
    )
    yield from _int8_row(ctx, peer, cfg, shape, prompt, new)
    cached, naive = ours_by.get((8, True)), ours_by.get((8, False))
    if cached and naive and cached.status == "ok" and naive.status == "ok":
        yield ctx.record(
            "cached_over_naive",
            "x",
            [cached.derived["tokens_per_s"] / naive.derived["tokens_per_s"]],
            better="higher",
            case={"batch": 8, "variant": "gpt2-like"},
        )


def _int8_row(
    ctx: BenchContext,
    peer: PeerSession,
    cfg: JaxlabConfig,
    shape: dict[str, Any],
    prompt: int,
    new: int,
) -> Iterator[Record]:
    """The batch-1 cached generation of the same model with int8 weights
    (``inference.weights = "int8"``), interleaved with a fresh run of the peer's float32
    batch-1 case: its ratio is labelled :data:`INT8_LABEL`. Then the read ceiling again,
    for the int8 step's bytes."""
    from jaxlab.bench.infer_suites import generation_record
    from jaxlab.infer.engine import Engine

    engine = Engine.from_config(with_int8_weights(cfg, ctx.config.inference.activations), seed=0)
    case = {
        "batch": 1,
        "prompt_len": prompt,
        "new_tokens": new,
        "kv_cache": True,
        "side": "hf-gpt2 generate()",
        "vs": "jaxlab int8",
    }
    spec = {
        "task": "generate",
        **shape,
        "batch_size": 1,
        "prompt_len": prompt,
        "new_tokens": new,
        "use_cache": True,
        "warmup": 1,
    }

    def run_ours(before: Callable[[], None] | None, warm: int) -> Record:
        return generation_record(
            ctx,
            engine,
            1,
            prompt,
            new,
            kv_cache=True,
            extra={"variant": "gpt2-like"},
            before=before,
            warm_each=warm,
        )

    mine, theirs = _peer_record(
        ctx, peer, "generate-b1-cache-int8", spec, "generate_s", case, new, run_ours, WARM_EACH
    )
    assert mine is not None
    yield mine
    yield theirs
    ratio = _speedup(
        ctx,
        "generate_speedup_vs_peer",
        {"batch": 1, "kv_cache": True, "variant": "gpt2-like", "weights": "int8"},
        mine,
        theirs,
    )
    if ratio is not None:
        yield ratio.model_copy(update={"derived": {**ratio.derived, "label": INT8_LABEL}})
    yield from _read_ceiling(ctx, peer, engine.step_weight_bytes, mine, theirs, weights="int8")


def _read_ceiling(
    ctx: BenchContext,
    peer: PeerSession,
    weight_bytes: int,
    ours: Record | None,
    theirs: Record | None,
    *,
    weights: str | None = None,
) -> Iterator[Record]:
    """The peer process streams a buffer of the decode step's weight bytes (samples are
    seconds per read, ``READS_PER_SAMPLE`` reads a repetition); with the batch-1 cached
    records beside it, the ceiling that read rate puts on batch-1 generation. ``weights``
    (``"int8"``): the bytes are an int8 step's, and the records say so."""
    marked = {"weights": weights} if weights else {}
    case = {"bytes": weight_bytes, "read": "torch.sum, peer process", **marked}
    spec = {"task": "read", "bytes": weight_bytes, "reads": READS_PER_SAMPLE, "warmup": 1}
    ctx.status("peer read")
    try:
        info = peer.prepare("read", spec)
        samples = [
            peer.time("read", warm=WARM_EACH) / READS_PER_SAMPLE
            for _ in range(ctx.repeats(quick_cap=3))
        ]
        peer.drop("read")
    except Exception as e:
        yield ctx.failure("weights_read_s", e, case=case)
        return
    read_s = median(samples)
    yield ctx.record(
        "weights_read_s",
        "s",
        samples,
        case=case,
        derived={
            "peer": info.get("peer"),
            "threads": info.get("threads"),
            "read_gb_per_s": weight_bytes / read_s / 1e9,
        },
    )
    if ours is None or theirs is None or ours.status != "ok" or theirs.status != "ok":
        return
    derived = read_ceiling(
        read_s, weight_bytes, theirs.derived["tokens_per_s"], ours.derived["tokens_per_s"]
    )
    yield ctx.record(
        "generate_ceiling_vs_peer",
        "x",
        [derived["ceiling_over_peer"]],
        better="higher",
        case={"batch": 1, "kv_cache": True, "variant": "gpt2-like", **marked},
        derived=derived,
    )
