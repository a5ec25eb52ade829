"""jaxlab.kernels: attention kernels behind one interface, and the platform tricks they use.

Every kernel implements :class:`~jaxlab.kernels.base.AttentionKernel`: sequence attention
(training, prefill) plus the layout of the decode cache it reads. The model picks one by
name (``model.attention_impl``) and calls nothing else, so a new kernel (a Pallas one) is
a new module here, not a change to the model.

=============  ==========================================================================
``reference``  the textbook math over a contiguous ``[B, S, K, D]`` cache: the spec that
               every other kernel is tested against
``xla``        ``jax.nn.dot_product_attention`` over the same cache (default off the CPU)
``xla_cpu``    the reference's math in the layouts XLA:CPU compiles best: grouped
               head-major einsums, causal halves, a blocked kv-head-major cache
               (default on the CPU)
``xla_tpu``    ``xla``'s sequence attention; a lane-dense ``[B, S, K * D]`` decode cache
               read by one-hot-segmented dots, so no TPU tile is padded (default on TPU)
``pallas``     flash attention written in Pallas (online softmax over tiles, causal tiles
               skipped, custom VJP; interpret mode on the CPU); ``xla``'s decode cache
=============  ==========================================================================

A paged cache (:mod:`~jaxlab.kernels.paged`: a pool of pages per layer, a page table per
row) has kernels of its own, :class:`~jaxlab.kernels.base.PagedKernel`; each contiguous
kernel names its paged counterpart (:data:`PAGED_FOR`), so ``model.attention_impl`` still
picks one thing:

===================  ====================================================================
``paged_reference``  every table page gathered into a contiguous cache, then the
                     reference's math: the spec (the paged form of ``reference``)
``paged_xla``        only the visible pages (a ``lax.switch`` over page counts), gathered
                     as whole rows of a kv-head-major pool into grouped dots (the paged
                     form of ``xla``, ``xla_cpu`` and ``xla_tpu``)
``paged_pallas``     a lane-dense pool (``[num_pages, page_size, K * D]``); decode by a
                     Pallas kernel that walks each row's pages through the table,
                     copying only those its position needs (double-buffered DMAs from
                     HBM, every head in one pair of dots, online softmax; interpret mode
                     on the CPU); extend (several tokens per row) by ``paged_xla`` (the
                     paged form of ``pallas``)
===================  ====================================================================

``auto`` is resolved once, when the model is built, from the JAX backend
(:func:`resolve`). Beside the kernels: :mod:`~jaxlab.kernels.masks` (who sees whom),
:mod:`~jaxlab.kernels.reduce` (last-axis reductions, two-stage on XLA:CPU),
:mod:`~jaxlab.kernels.rows` (row buckets for XLA:CPU's decode step) and
:mod:`~jaxlab.kernels.staged` (pages copied into a contiguous cache for one decode call,
XLA:CPU's way of reading them).
"""

from __future__ import annotations

from jaxlab.kernels.base import NO_SLOT, AttentionKernel, LayerCache, PagedKernel
from jaxlab.kernels.paged import PagedReference
from jaxlab.kernels.paged_pallas import PagedPallas
from jaxlab.kernels.paged_xla import PagedXla
from jaxlab.kernels.pallas import Pallas
from jaxlab.kernels.reference import Reference
from jaxlab.kernels.xla import Xla
from jaxlab.kernels.xla_cpu import XlaCpu
from jaxlab.kernels.xla_tpu import XlaTpu

#: Every kernel, by the name ``model.attention_impl`` uses.
KERNELS: dict[str, AttentionKernel] = {
    k.name: k for k in (Reference(), Xla(), XlaCpu(), XlaTpu(), Pallas())
}

#: Every paged kernel, by name.
PAGED_KERNELS: dict[str, PagedKernel] = {
    k.name: k for k in (PagedReference(), PagedXla(), PagedPallas())
}

#: The paged counterpart of each contiguous kernel: the spec pairs with the spec, the
#: Pallas kernel with the Pallas one, every other fast kernel with ``paged_xla``.
PAGED_FOR: dict[str, str] = {
    name: {"reference": "paged_reference", "pallas": "paged_pallas"}.get(name, "paged_xla")
    for name in KERNELS
}

#: What ``auto`` means on each JAX platform; any other platform gets ``xla``. On a TPU the
#: Pallas kernels measured fastest both for training (flash) and for paged decode
#: (``docs/performance.md``, "TPU v5e" sections).
AUTO = {"cpu": "xla_cpu", "tpu": "pallas"}

#: Older configs (before kernels existed) named the grouped einsum ``einsum``.
ALIASES = {"einsum": "xla_cpu"}


def resolve(name: str, platform: str | None = None) -> str:
    """The kernel name that ``name`` means on ``platform`` (default: JAX's default backend)."""
    name = ALIASES.get(name, name)
    if name != "auto":
        if name not in KERNELS:
            raise ValueError(f"unknown attention kernel {name!r}; expected auto or {list(KERNELS)}")
        return name
    if platform is None:
        import jax

        platform = jax.default_backend()
    return AUTO.get(platform, "xla")


def get(name: str) -> AttentionKernel:
    """The kernel called ``name`` (``auto`` resolved on this process's backend)."""
    return KERNELS[resolve(name)]


def get_paged(name: str) -> PagedKernel:
    """The paged counterpart of the kernel called ``name`` (``auto`` resolved)."""
    return PAGED_KERNELS[PAGED_FOR[resolve(name)]]


__all__ = [
    "ALIASES",
    "AUTO",
    "KERNELS",
    "NO_SLOT",
    "PAGED_FOR",
    "PAGED_KERNELS",
    "AttentionKernel",
    "LayerCache",
    "PagedKernel",
    "get",
    "get_paged",
    "resolve",
]
