"""Suite ``attention``: the attention kernels alone, forward and forward + backward, at
the configured model's attention shape.

The shape is the config's: ``train.batch_size`` rows of ``data.seq_len`` tokens,
``model.n_heads`` query heads over ``model.n_kv_heads`` kv heads of ``model.head_dim``,
inputs in ``train.precision.compute_dtype``, causal, with packed documents (segment ids of
random document lengths, as the data pipeline packs them; without --quick also with no
segment ids). Each kernel is compiled with the ahead-of-time API, compile seconds
recorded apart, then timed as usual (warm-up, ``block_until_ready``, raw samples):

* ``fwd_time``: ``attend(q, k, v, segment_ids)``;
* ``fwd_bwd_time``: the output and its VJP for ``q, k, v`` with a random cotangent,
  what a train step asks of attention.

Kernels: jaxlab's ``reference``, ``xla`` and ``pallas`` (``xla_cpu`` too on the CPU;
without --quick ``pallas`` at several tile sizes), and, on TPU only, the kernels that
ship inside jax: ``jax.experimental.pallas.ops.tpu`` ``flash_attention`` and
``splash_attention``, at their default block sizes and at 512 (they do not run on the CPU,
so the suite leaves them out there and says so). Every record carries the largest
difference of its output (and of its gradients) from the ``reference`` kernel's, so a fast
wrong kernel is visible.

FLOPs count the useful causal work, half the square: ``2 B H T^2 D`` for the forward's two
matmuls, ``6 B H T^2 D`` with the backward's four (recomputation not counted).

    jaxlab bench attention --config bench-small --set runtime.platform=tpu

(``--set`` the model shape to measure another: ``docs/kernels.md`` has the tpu-small one.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.stats import Stats
from jaxlab.bench.suites import suite

AttendFn = Callable[[Any, Any, Any, Any], Any]

#: Tile sizes (q, k) of the ``pallas`` kernel tried besides its defaults (not with --quick).
PALLAS_SWEEP = ((256, 256), (512, 1024), (1024, 1024))
#: Block size given to jax's own kernels besides their defaults (128).
PEER_BLOCK = 512


def attention_flops(b: int, t: int, h: int, d: int, *, backward: bool) -> int:
    """Useful causal matmul FLOPs (module docstring)."""
    return (6 if backward else 2) * b * h * t * t * d


def packed_segments(b: int, t: int, seed: int) -> Any:
    """Segment ids ``[B, T]`` of documents of random lengths (1/8 to 1/2 of a row)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = np.zeros((b, t), np.int32)
    for row in range(b):
        start, doc = 0, 0
        while start < t:
            length = int(rng.integers(max(t // 8, 1), max(t // 2, 2)))
            ids[row, start : start + length] = doc
            start, doc = start + length, doc + 1
    return ids


def jax_flash(block: int | None) -> AttendFn:
    """jax's Pallas TPU ``flash_attention``: head-major, kv heads repeated to the query
    heads (it has no grouping), ``block`` on every tile (None: its defaults)."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    def attend(q, k, v, seg):
        _, t, h, d = q.shape
        g = h // k.shape[2]
        qh, kh, vh = (
            jnp.repeat(x, r, axis=2).transpose(0, 2, 1, 3) for x, r in ((q, 1), (k, g), (v, g))
        )
        sizes = None
        if block is not None:
            bq = min(block, t)
            sizes = fa.BlockSizes(
                block_q=bq,
                block_k_major=bq,
                block_k=bq,
                block_b=1,
                block_q_major_dkv=bq,
                block_k_major_dkv=bq,
                block_k_dkv=bq,
                block_q_dkv=bq,
                block_k_major_dq=bq,
                block_k_dq=bq,
                block_q_dq=bq,
            )
        ids = None if seg is None else fa.SegmentIds(q=seg, kv=seg)
        out = fa.flash_attention(
            qh, kh, vh, segment_ids=ids, causal=True, sm_scale=1 / math.sqrt(d), block_sizes=sizes
        )
        return out.transpose(0, 2, 1, 3)

    return attend


def jax_splash(h: int, t: int, block: int | None) -> AttendFn:
    """jax's Pallas TPU ``splash_attention`` (grouped heads natively), one row at a time
    under ``vmap``; it does not scale the logits, so ``q`` is scaled first."""
    import jax
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.MultiHeadMask([sa.CausalMask((t, t)) for _ in range(h)])
    sizes = None
    if block is not None:
        bq = min(block, t)
        sizes = sa.BlockSizes(
            block_q=bq,
            block_kv=bq,
            block_kv_compute=bq,
            block_q_dkv=bq,
            block_kv_dkv=bq,
            block_kv_dkv_compute=bq,
            block_q_dq=bq,
            block_kv_dq=bq,
        )
    kernel = sa.make_splash_mha_single_device(mask, block_sizes=sizes)

    def one_row(q, k, v, seg) -> Any:  # [H, T, D], [K, T, D], [K, T, D], [T]
        ids = None if seg is None else sa.SegmentIds(q=seg, kv=seg)
        return kernel(q, k, v, segment_ids=ids)

    def attend(q, k, v, seg):
        d = q.shape[-1]
        qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q * (1 / math.sqrt(d)), k, v))
        axes = (0, 0, 0, None if seg is None else 0)
        return jax.vmap(one_row, in_axes=axes)(qh, kh, vh, seg).transpose(0, 2, 1, 3)

    return attend


def candidates(backend: str, quick: bool, h: int, t: int) -> list[tuple[dict[str, Any], AttendFn]]:
    """``(case fields, attend)`` of every kernel measured on ``backend``."""
    from jaxlab import kernels
    from jaxlab.kernels.flash_plan import BlockSizes, plans
    from jaxlab.kernels.pallas import Pallas

    names = ["reference", "xla", *(["xla_cpu"] if backend == "cpu" else [])]
    out: list[tuple[dict[str, Any], AttendFn]] = [
        ({"kernel": n, "blocks": "-"}, kernels.KERNELS[n].attend) for n in names
    ]
    seen = set()
    for sizes in [BlockSizes(), *([] if quick else [BlockSizes(*b) for b in PALLAS_SWEEP])]:
        fwd, bwd = plans(t, sizes)  # the tiles that run: clamped to short sequences
        label = f"{fwd.bq}x{fwd.bk}" + ("" if bwd == fwd else f" bwd {bwd.bq}x{bwd.bk}")
        if label not in seen:
            seen.add(label)
            out.append(({"kernel": "pallas", "blocks": label}, Pallas(sizes).attend))
    if backend == "tpu":
        for block in (None, PEER_BLOCK):
            label = "default" if block is None else f"{min(block, t)}x{min(block, t)}"
            out.append(({"kernel": "jax_flash", "blocks": label}, jax_flash(block)))
            out.append(({"kernel": "jax_splash", "blocks": label}, jax_splash(h, t, block)))
    return out


def _max_diff(a: Any, b: Any) -> float:
    import jax
    import jax.numpy as jnp

    diffs = jax.tree.map(
        lambda x, y: jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))), a, b
    )
    return float(max(jax.tree.leaves(diffs)))


@suite(
    "attention",
    needs_peak=True,
    default=False,
    description="attention kernels alone: forward and forward+backward at the model's shape",
)
def attention_suite(ctx: BenchContext) -> Iterator[Record]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    cfg = ctx.config
    m = cfg.model
    b, t, h, kv, d = cfg.train.batch_size, cfg.data.seq_len, m.n_heads, m.n_kv_heads, m.head_dim
    dtype = cfg.train.precision.compute_dtype
    backend = jax.default_backend()
    rng = np.random.default_rng(cfg.runtime.seed)

    def normal(*shape: int) -> Any:
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)

    q, k, v, ct = normal(b, t, h, d), normal(b, t, kv, d), normal(b, t, kv, d), normal(b, t, h, d)
    if backend != "tpu":
        ctx.status(f"jax's TPU flash/splash kernels left out: they need a TPU, not {backend}")
    shape = {"batch": b, "seq_len": t, "heads": h, "kv_heads": kv, "head_dim": d, "dtype": dtype}
    segment_cases = ["packed"] if ctx.quick else ["packed", "none"]
    for segments in segment_cases:
        seg = None if segments == "none" else jnp.asarray(packed_segments(b, t, cfg.runtime.seed))
        want: dict[str, Any] = {}
        for fields, attend in candidates(backend, ctx.quick, h, t):
            case = {**fields, **shape, "segments": segments}
            for metric, backward in (("fwd_time", False), ("fwd_bwd_time", True)):
                yield _measure(ctx, metric, case, attend, (q, k, v, seg, ct), backward, want)


def _measure(
    ctx: BenchContext,
    metric: str,
    case: dict[str, Any],
    attend: AttendFn,
    args: tuple[Any, ...],
    backward: bool,
    want: dict[str, Any],
) -> Record:
    """One kernel's record: compile timed apart, then the steady state. ``want`` holds the
    reference kernel's results per metric (the first kernel measured is the reference)."""
    import jax

    q, k, v, seg, ct = args

    def fwd(q, k, v, seg, ct):
        return attend(q, k, v, seg)

    def fwd_bwd(q, k, v, seg, ct):
        out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
        return out, pullback(ct)

    ctx.status(f"compiling {metric} {case['kernel']} {case['blocks']}")
    try:
        t0 = time.perf_counter()
        compiled = jax.jit(fwd_bwd if backward else fwd).lower(q, k, v, seg, ct).compile()
        compile_s = time.perf_counter() - t0
        result = jax.block_until_ready(compiled(q, k, v, seg, ct))
    except Exception as e:
        return ctx.failure(metric, e, case=case)
    if case["kernel"] == "reference":
        want[metric] = result
    diff = _max_diff(result, want[metric]) if metric in want else None
    del result
    flops = attention_flops(
        case["batch"], case["seq_len"], case["heads"], case["head_dim"], backward=backward
    )
    dtype = str(case["dtype"])

    def derive(s: Stats) -> dict[str, Any]:
        per_s = flops / s.median_value
        return {
            "compile_s": compile_s,
            "attention_flops": flops,
            "tflops": per_s / 1e12,
            "max_abs_diff_vs_reference": diff,
            **ctx.mfu(per_s, dtype=dtype),
        }

    return ctx.bench(metric, lambda: compiled(q, k, v, seg, ct), case=case, derive=derive)
