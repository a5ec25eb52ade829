"""The ``pallas`` kernel: causal flash attention for training, written in Pallas.

This module owns the three Pallas kernels (forward, ``dq``, ``dk``/``dv``) and the custom
VJP that ties them together; :class:`jaxlab.kernels.pallas.Pallas` is the attention kernel
that calls them. Which tiles run is decided beforehand, from shapes alone
(:mod:`jaxlab.kernels.flash_plan`). Decoding does not come here.

The algorithm (``docs/kernels.md`` explains it at length):

* **Forward.** Each grid step is one ``[bq, bk]`` tile of one query head: logits
  ``q k^T / sqrt(D)`` in f32, then the online softmax recurrence over the key tiles of a
  query tile, with a running row max ``m``, row sum ``l`` and unnormalised output ``acc``::

      m' = max(m, rowmax(s));  a = exp(m - m');  p = exp(s - m')
      l' = a l + rowsum(p);    acc' = a acc + p v

  After the last key tile the output is ``acc / l`` and the row's log-sum-exp
  ``m + log l`` is saved for the backward.
* **Backward.** Probabilities are recomputed from the saved log-sum-exp
  (``p = exp(s - lse)``, no max or sum needed), with ``di = rowsum(dO * O)``:
  ``ds = p (dO v^T - di)``, ``dq = ds k / sqrt(D)``, ``dk = ds^T q / sqrt(D)``,
  ``dv = p^T dO``. Two kernels: ``dq`` walks key tiles per query tile, ``dk, dv`` walk
  query tiles (and the ``G`` query heads sharing the kv head) per key tile, each
  accumulating in VMEM and writing once. Fusing them would need ``dq`` summed across key
  tiles that run in different grid steps, and TPU kernels have no atomic adds: it would
  mean writing one partial ``dq`` per key tile and summing them afterwards. Two kernels
  instead compute ``QK^T`` and ``dO V^T`` twice (7 tile matmuls instead of 5) but write
  every gradient once.
* **Grouped KV heads.** Query head ``h`` reads kv head ``h // G`` through the index maps;
  nothing is repeated in memory.
* **Causal skipping.** The grid walks only the tiles on or below the diagonal (the plan's
  tables, scalar-prefetched); the causal mask is computed only on tiles that cross it.
* **Segments.** Segment ids ride along as a lane-replicated column ``[B, T, 128]`` and a
  row ``[B, 1, T]``, so a tile's mask is one compare of two broadcasts.
* **Precision** as in :mod:`jaxlab.kernels.base`: f32 logits, softmax and accumulators,
  matmul inputs in the query dtype, output in the query dtype.
* **CPU.** With no TPU the same kernels run in Pallas interpret mode (``interpret=None``
  picks it from the default backend), which is how CI tests them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import cast

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxlab.kernels.flash_plan import LANES, BlockSizes, FlashPlan, plans
from jaxlab.kernels.masks import MASK_VALUE

Array = jax.Array

#: ``a @ b^T`` for 2-D tiles: contract the last dimension of both.
NT = (((1,), (1,)), ((), ()))
F32 = jnp.float32


@dataclass(frozen=True)
class Static:
    """What the custom VJP closes over: the plans and the head grouping (hashable)."""

    fwd: FlashPlan
    bwd: FlashPlan
    groups: int
    scale: float
    interpret: bool


# ----------------------------------------------------------------------- tile helpers


def lanes_to(x: Array, width: int) -> Array:
    """A lane-replicated ``[n, 128]`` column widened or narrowed to ``[n, width]``."""
    if width == LANES:
        return x
    if width < LANES:
        return x[:, :width]
    return jnp.tile(x, (1, width // LANES))


def tile_mask(
    q_start: Array,
    k_start: Array,
    shape: tuple[int, int],
    causal: bool,
    same_segment: Array | None,
    keys_on_rows: bool = False,
) -> Array | None:
    """Who-sees-whom inside one tile: ``key <= query`` when ``causal`` (the tile crosses the
    diagonal), and ``same_segment`` when given. Rows are queries, or keys when
    ``keys_on_rows`` (the backward's transposed tiles)."""
    mask = same_segment
    if causal:
        rows = lax.broadcasted_iota(jnp.int32, shape, 0)
        cols = lax.broadcasted_iota(jnp.int32, shape, 1)
        if keys_on_rows:
            visible = k_start + rows <= q_start + cols
        else:
            visible = k_start + cols <= q_start + rows
        mask = visible if mask is None else mask & visible
    return mask


def logits(a: Array, b: Array, scale: float) -> Array:
    """``a b^T`` in f32, times ``scale`` unless it was folded into the queries (1.0)."""
    s = lax.dot_general(a, b, NT, preferred_element_type=F32)
    return s if scale == 1.0 else s * scale


def crosses_diagonal(qi: Array, ki: Array, plan: FlashPlan) -> Array:
    """Some key of tile ``(qi, ki)`` comes after some query: the causal mask is needed."""
    return (ki + 1) * plan.bk - 1 > qi * plan.bq


def last_key_block(qi: Array, plan: FlashPlan) -> Array:
    """:meth:`FlashPlan.last_k` of a traced query block: where its accumulation ends."""
    return jnp.minimum(((qi + 1) * plan.bq - 1) // plan.bk, plan.k_blocks - 1)


def on_both_sides(crosses: Array, body) -> None:
    """Run ``body(causal)`` specialised for tiles that cross the diagonal and tiles that
    do not: only the former pay for the causal mask."""
    pl.when(crosses)(lambda: body(True))
    pl.when(jnp.logical_not(crosses))(lambda: body(False))


# --------------------------------------------------------------------------- forward


def _forward_kernel(
    qtab, ktab, q_ref, k_ref, v_ref, *refs, plan: FlashPlan, scale: float, segmented: bool
):
    if segmented:
        qseg_ref, kseg_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr = refs
    else:
        o_ref, lse_ref, m_scr, l_scr, acc_scr = refs
    step = pl.program_id(2)
    qi, ki = qtab[step], ktab[step]
    bq, bk = plan.bq, plan.bk
    d = q_ref.shape[-1]

    @pl.when(ki == 0)
    def _start():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, F32)
        l_scr[...] = jnp.zeros(l_scr.shape, F32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, F32)

    def tile(causal: bool) -> None:
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        s = logits(q, k, scale)  # [bq, bk]
        same = lanes_to(qseg_ref[...], bk) == kseg_ref[...] if segmented else None
        mask = tile_mask(qi * bq, ki * bk, (bq, bk), causal, same)
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        m_prev = m_scr[...]  # [bq, 128], every lane holds the row's value
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - lanes_to(m_next, bk))
        alpha = jnp.exp(m_prev - m_next)
        l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
        m_scr[...] = m_next
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=F32)
        acc_scr[...] = acc_scr[...] * lanes_to(alpha, d) + pv

    on_both_sides(crosses_diagonal(qi, ki, plan), tile)

    @pl.when(ki == last_key_block(qi, plan))
    def _finish():
        row_sum = l_scr[...]
        o_ref[...] = (acc_scr[...] / lanes_to(row_sum, d)).astype(o_ref.dtype)
        # The row's log-sum-exp, lane-replicated [bq, 128], transposed so it is stored as
        # one lane-dense row [1, bq]: 128x fewer bytes than the replicated column.
        lse_ref[...] = jnp.transpose(m_scr[...] + jnp.log(row_sum))[:1, :]


def _forward(q: Array, k: Array, v: Array, seg: Array | None, st: Static) -> tuple[Array, Array]:
    """``q [B, H, Tp, D]``, ``k, v [B, K, Tp, D]`` -> output ``[B, H, Tp, D]`` and each
    row's log-sum-exp ``[B, H, 1, Tp]`` (f32). Rows of query tiles made only of padding
    are never computed: both hold garbage there."""
    b, h, tp, d = q.shape
    plan, g = st.fwd, st.groups
    qtab, ktab = plan.q_major()
    bq, bk = plan.bq, plan.bk

    in_specs = [
        pl.BlockSpec((None, None, bq, d), lambda b, h, s, qt, kt: (b, h, qt[s], 0)),
        pl.BlockSpec((None, None, bk, d), lambda b, h, s, qt, kt: (b, h // g, kt[s], 0)),
        pl.BlockSpec((None, None, bk, d), lambda b, h, s, qt, kt: (b, h // g, kt[s], 0)),
    ]
    args = [q, k, v]
    if seg is not None:
        in_specs += [
            pl.BlockSpec((None, bq, LANES), lambda b, h, s, qt, kt: (b, qt[s], 0)),
            pl.BlockSpec((None, 1, bk), lambda b, h, s, qt, kt: (b, 0, kt[s])),
        ]
        args += [*segment_layouts(seg)]
    out_specs = [
        pl.BlockSpec((None, None, bq, d), lambda b, h, s, qt, kt: (b, h, qt[s], 0)),
        pl.BlockSpec((None, None, 1, bq), lambda b, h, s, qt, kt: (b, h, 0, qt[s])),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, h, tp, d), q.dtype),
        jax.ShapeDtypeStruct((b, h, 1, tp), F32),
    ]
    steps = len(qtab)
    o, lse = pl.pallas_call(
        functools.partial(_forward_kernel, plan=plan, scale=st.scale, segmented=seg is not None),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, h, steps),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((bq, LANES), F32),
                pltpu.VMEM((bq, LANES), F32),
                pltpu.VMEM((bq, d), F32),
            ],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        cost_estimate=_cost(b * h * steps * bq * bk, d, matmuls=2, q=q, k=k, v=v),
        interpret=st.interpret,
        name="jaxlab_flash_fwd",
    )(jnp.asarray(qtab), jnp.asarray(ktab), *args)
    return o, lse


# ------------------------------------------------------------------------- backward


def _dq_kernel(
    qtab,
    ktab,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    di_ref,
    *refs,
    plan: FlashPlan,
    scale: float,
    segmented: bool,
):
    if segmented:
        qseg_ref, kseg_ref, dq_ref, acc_scr = refs
    else:
        dq_ref, acc_scr = refs
    step = pl.program_id(2)
    qi, ki = qtab[step], ktab[step]
    bq, bk = plan.bq, plan.bk

    @pl.when(ki == 0)
    def _start():
        acc_scr[...] = jnp.zeros(acc_scr.shape, F32)

    def tile(causal: bool) -> None:
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s = logits(q, k, scale)  # [bq, bk]
        same = lanes_to(qseg_ref[...], bk) == kseg_ref[...] if segmented else None
        mask = tile_mask(qi * bq, ki * bk, (bq, bk), causal, same)
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        p = jnp.exp(s - jnp.expand_dims(lse_ref[0], -1))  # lse row [1, bq] -> column
        dp = lax.dot_general(do, v, NT, preferred_element_type=F32)
        ds = p * (dp - jnp.expand_dims(di_ref[0], -1))
        acc_scr[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=F32)

    on_both_sides(crosses_diagonal(qi, ki, plan), tile)

    @pl.when(ki == last_key_block(qi, plan))
    def _finish():
        dq_ref[...] = (acc_scr[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    qtab,
    ktab,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    di_ref,
    *refs,
    plan: FlashPlan,
    scale: float,
    segmented: bool,
    groups: int,
):
    if segmented:
        kseg_ref, qseg_ref, dk_ref, dv_ref, dk_scr, dv_scr = refs
    else:
        dk_ref, dv_ref, dk_scr, dv_scr = refs
    step, g = pl.program_id(2), pl.program_id(3)
    qi, ki = qtab[step], ktab[step]
    bq, bk = plan.bq, plan.bk

    @pl.when((qi == ki * bk // bq) & (g == 0))
    def _start():
        dk_scr[...] = jnp.zeros(dk_scr.shape, F32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, F32)

    def tile(causal: bool) -> None:
        # Transposed tiles [bk, bq]: keys on the rows, so the per-query lse and di are
        # rows broadcast down the sublanes, and dk, dv come out of plain matmuls.
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s = logits(k, q, scale)  # [bk, bq]
        same = lanes_to(kseg_ref[...], bq) == qseg_ref[...] if segmented else None
        mask = tile_mask(qi * bq, ki * bk, (bk, bq), causal, same, keys_on_rows=True)
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        p = jnp.exp(s - lse_ref[...])
        dv_scr[...] += jnp.dot(p.astype(do.dtype), do, preferred_element_type=F32)
        dp = lax.dot_general(v, do, NT, preferred_element_type=F32)
        ds = p * (dp - di_ref[...])
        dk_scr[...] += jnp.dot(ds.astype(q.dtype), q, preferred_element_type=F32)

    on_both_sides(crosses_diagonal(qi, ki, plan), tile)

    @pl.when((qi == plan.q_blocks - 1) & (g == groups - 1))
    def _finish():
        dk_ref[...] = (dk_scr[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _backward(
    q: Array, k: Array, v: Array, seg: Array | None, o: Array, lse: Array, do: Array, st: Static
) -> tuple[Array, Array, Array]:
    b, h, tp, d = q.shape
    kv = k.shape[1]
    plan, g = st.bwd, st.groups
    bq, bk = plan.bq, plan.bk
    di = jnp.sum(o.astype(F32) * do.astype(F32), axis=-1)[:, :, None, :]  # [B, H, 1, Tp]
    # Padding rows the forward never computed (its query tiles may be smaller than these)
    # hold garbage: an infinite lse makes their probabilities exactly 0, and di = 0.
    real = jnp.arange(tp) < plan.length
    rows = (jnp.where(real, lse, jnp.inf), jnp.where(real, di, 0.0))
    segs = None if seg is None else segment_layouts(seg)
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))

    # dq: query tile by query tile, over its key tiles.
    qtab, ktab = plan.q_major()
    q_spec = pl.BlockSpec((None, None, bq, d), lambda b, h, s, qt, kt: (b, h, qt[s], 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda b, h, s, qt, kt: (b, h // g, kt[s], 0))
    row_spec = pl.BlockSpec((None, None, 1, bq), lambda b, h, s, qt, kt: (b, h, 0, qt[s]))
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    args = [q, k, v, do, *rows]
    if segs is not None:
        in_specs += [
            pl.BlockSpec((None, bq, LANES), lambda b, h, s, qt, kt: (b, qt[s], 0)),
            pl.BlockSpec((None, 1, bk), lambda b, h, s, qt, kt: (b, 0, kt[s])),
        ]
        args += [*segs]
    steps = len(qtab)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, plan=plan, scale=st.scale, segmented=segs is not None),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, h, steps),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((bq, d), F32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        cost_estimate=_cost(b * h * steps * bq * bk, d, matmuls=3, q=q, k=k, v=v),
        interpret=st.interpret,
        name="jaxlab_flash_dq",
    )(jnp.asarray(qtab), jnp.asarray(ktab), *args)

    # dk, dv: key tile by key tile, over its query tiles and the G heads that read it.
    qtab, ktab = plan.k_major()

    def q_side(b, j, s, g_, qt, kt):
        return (b, j * g + g_, qt[s], 0)

    def row_side(b, j, s, g_, qt, kt):
        return (b, j * g + g_, 0, qt[s])

    def k_side(b, j, s, g_, qt, kt):
        return (b, j, kt[s], 0)

    q_spec = pl.BlockSpec((None, None, bq, d), q_side)
    kv_spec = pl.BlockSpec((None, None, bk, d), k_side)
    row_spec = pl.BlockSpec((None, None, 1, bq), row_side)
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    args = [q, k, v, do, *rows]
    if segs is not None:
        in_specs += [
            pl.BlockSpec((None, bk, LANES), lambda b, j, s, g_, qt, kt: (b, kt[s], 0)),
            pl.BlockSpec((None, 1, bq), lambda b, j, s, g_, qt, kt: (b, 0, qt[s])),
        ]
        args += [*segs]
    steps = len(qtab)
    dk, dv = pl.pallas_call(
        functools.partial(
            _dkv_kernel, plan=plan, scale=st.scale, segmented=segs is not None, groups=g
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kv, steps, g),
            in_specs=in_specs,
            out_specs=[kv_spec, kv_spec],
            scratch_shapes=[pltpu.VMEM((bk, d), F32), pltpu.VMEM((bk, d), F32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")
        ),
        cost_estimate=_cost(b * h * steps * bq * bk, d, matmuls=4, q=q, k=k, v=v),
        interpret=st.interpret,
        name="jaxlab_flash_dkv",
    )(jnp.asarray(qtab), jnp.asarray(ktab), *args)
    return dq, dk, dv


def segment_layouts(seg: Array) -> tuple[Array, Array]:
    """``seg [B, Tp]`` as a lane-replicated column ``[B, Tp, 128]`` (ids down the rows of
    a tile) and a row ``[B, 1, Tp]`` (ids along its lanes)."""
    b, tp = seg.shape
    return jnp.broadcast_to(seg[:, :, None], (b, tp, LANES)), seg[:, None, :]


def _cost(tile_elems: int, d: int, *, matmuls: int, q: Array, k: Array, v: Array):
    """What XLA's scheduler is told a kernel costs: its tile matmuls and exps, and
    roughly one read of each operand."""
    moved = sum(math.prod(x.shape) * x.dtype.itemsize for x in (q, k, v)) * 2
    return pl.CostEstimate(
        flops=2 * d * tile_elems * matmuls, transcendentals=tile_elems, bytes_accessed=moved
    )


# ---------------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q: Array, k: Array, v: Array, seg: Array | None, st: Static) -> Array:
    return _forward(q, k, v, seg, st)[0]


def _flash_fwd(q, k, v, seg, st):
    o, lse = _forward(q, k, v, seg, st)
    return o, (q, k, v, seg, o, lse)


def _flash_bwd(st, residuals, do):
    q, k, v, seg, o, lse = residuals
    dq, dk, dv = _backward(q, k, v, seg, o, lse, do, st)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q: Array,
    k: Array,
    v: Array,
    segment_ids: Array | None = None,
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> Array:
    """Causal self-attention, ``q [B, T, H, D]``, ``k, v [B, T, K, D]`` -> ``[B, T, H, D]``
    (module docstring), differentiable in ``q, k, v``.

    ``segment_ids [B, T]`` (packed documents): a query sees only earlier-or-same keys of
    its own segment. ``T`` need not be a multiple of the tiles: the sequence is padded at
    the end and the padding is never visible to a real token. ``interpret`` defaults to
    Pallas interpret mode on the CPU backend, compiled Mosaic kernels elsewhere.
    """
    b, t, h, d = q.shape
    kv = k.shape[2]
    if k.shape != (b, t, kv, d) or v.shape != k.shape:
        raise ValueError(
            f"flash_attention: k and v must be [B, T, K, D] = {(b, t, kv, d)} for q {q.shape}; "
            f"got k {k.shape}, v {v.shape}"
        )
    if h % kv:
        raise ValueError(f"flash_attention: {h} query heads do not split over {kv} kv heads")
    if segment_ids is not None and segment_ids.shape != (b, t):
        raise ValueError(
            f"flash_attention: segment_ids must be [B, T] = {(b, t)}, got {segment_ids.shape}"
        )
    fwd, bwd = plans(t, block_sizes or BlockSizes())
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    scale = 1.0 / math.sqrt(d)
    if math.frexp(scale)[0] == 0.5:
        # A power of two (D = 16, 64, 256): folded into q exactly, and the kernels skip
        # one multiply per logit. Otherwise q stays as given and the f32 logits are scaled.
        q, scale = q * scale, 1.0
    st = Static(fwd, bwd, h // kv, scale, bool(interpret))
    pad = fwd.padded - t

    def heads_major(x: Array) -> Array:
        x = x.astype(q.dtype).transpose(0, 2, 1, 3)  # [B, heads, T, D]
        return jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else x

    seg = None
    if segment_ids is not None:
        seg = segment_ids.astype(jnp.int32)
        seg = jnp.pad(seg, ((0, 0), (0, pad)), mode="edge") if pad else seg
    out = cast(Array, _flash(heads_major(q), heads_major(k), heads_major(v), seg, st))
    return out[:, :, :t].transpose(0, 2, 1, 3)


__all__ = ["BlockSizes", "flash_attention", "segment_layouts"]
