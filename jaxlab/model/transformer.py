"""The decoder-only Transformer LM, in both of its modes: over a sequence, and one token per row.

Architecture (pre-norm, no biases)::

    x = embed(tokens) [+ pos_table[positions]]            # f32 residual stream
    for each layer:
        x = x + dropout(attn(rms_norm(x)))                 # RoPE inside attn if "rope"
        x = x + dropout(mlp(rms_norm(x)))
    logits = head(rms_norm(x))                             # f32 [B, T, vocab]

``head`` is ``h @ embed.table^T`` when ``tie_embeddings`` else its own ``[d_model, vocab]``
kernel.

Entry points, all on :class:`Transformer`:

* :meth:`~Transformer.features` / ``__call__``: the sequence forward (training, eval):
  causal self-attention, packed documents kept apart by ``segment_ids``.
* :meth:`~Transformer.prefill`: the same forward over right-padded prompts, which also
  returns every layer's K/V as a decode cache of ``max_len`` slots.
* :meth:`~Transformer.extend` / :meth:`~Transformer.decode`: ``T`` (or one) new tokens per
  row against a cache: their K/V are written at slot = position, then they attend to the
  cache slots at or before their position.

Both cached entry points take either cache: a contiguous one (a tuple of per-layer caches,
:meth:`~Transformer.init_cache`) or a paged one (:class:`~jaxlab.kernels.paged.Pages`: a
pool of pages per layer and one page table, :meth:`~Transformer.init_pages`), where
"slot = position" goes through the table. :meth:`~Transformer.prefill_pages` is prefill's
sequence forward writing into pages.

The attention math and the cache layout belong to the kernel (``model.attention_impl``,
:mod:`jaxlab.kernels`, and its paged counterpart); nothing here depends on which one runs.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from jaxlab.config.schema import ModelConfig, PrecisionConfig
from jaxlab.kernels import NO_SLOT, LayerCache, staged
from jaxlab.kernels.paged import Pages, max_pages_for, no_pages
from jaxlab.kernels.rows import Rows
from jaxlab.model import remat as remat_policies
from jaxlab.model.attention import Attention, Rope, rope_tables
from jaxlab.model.layers import (
    INIT_STD,
    MLP,
    Embedding,
    RMSNorm,
    dense,
    dropout,
    normal_init,
)
from jaxlab.model.lora import Lora
from jaxlab.model.quant import QuantizedKernel

Array = jax.Array
#: A contiguous decode cache: one kernel-layout cache per layer.
Cache = tuple[LayerCache, ...]
#: Every decode cache the cached mode takes.
AnyCache = Cache | Pages
#: The cache type a cached call was given, and returns.
C = TypeVar("C", Cache, Pages)


class Block(nnx.Module):
    """One pre-norm residual block: attention then MLP, dropout on each branch output."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        param_dtype: DTypeLike,
        compute_dtype: DTypeLike,
        rngs: nnx.Rngs,
    ) -> None:
        self.dropout_rate = float(cfg.dropout_rate)
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=param_dtype)
        self.attn = Attention(
            cfg.d_model,
            cfg.n_heads,
            cfg.n_kv_heads,
            n_layers=cfg.n_layers,
            kernel=cfg.attention_impl,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            rngs=rngs,
        )
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=param_dtype)
        self.mlp = MLP(
            cfg.d_model,
            cfg.d_mlp,
            cfg.mlp,
            n_layers=cfg.n_layers,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            rngs=rngs,
        )

    def __call__(
        self,
        x: Array,
        rope: Rope | None,
        segment_ids: Array | None,
        key: Array | None,
        lora: Lora | None = None,
    ) -> tuple[Array, tuple[Array, Array]]:
        """The sequence form: ``(x, this layer's (k, v))``; ``lora``: this layer's adapters."""
        attn_key = mlp_key = None
        if key is not None:
            attn_key, mlp_key = jax.random.split(key)
        a, kv = self.attn(self.attn_norm(x), rope, segment_ids, lora)
        x = x + dropout(a, self.dropout_rate, attn_key)
        x = x + dropout(self.mlp(self.mlp_norm(x), lora), self.dropout_rate, mlp_key)
        return x, kv

    def cached(
        self,
        x: Array,
        rope: Rope | None,
        cache: LayerCache,
        positions: Array,
        rows: Rows,
        lora: Lora | None = None,
    ) -> tuple[Array, LayerCache]:
        """New tokens against a cache (no dropout): ``(x, updated cache)``.

        Only ``rows``' leading rows are computed, in two steps around the cache write, so the
        write stays outside the row switch and updates the donated cache in place; rows not
        computed write nothing and come out as zeros. ``cache`` is one layer's contiguous
        cache or a :class:`~jaxlab.kernels.paged.PagedLayer`; its kernel does the rest.
        """
        attn = self.attn
        kernel = attn.kernel_for(cache)

        def project(r: int, x: Array, rope: Rope | None) -> tuple[Array, Array, Array]:
            rope_r = None if rope is None else (rope[0][:r], rope[1][:r])
            lora_r = None if lora is None else lora.take(r)
            return attn.project(self.attn_norm(x[:r]), rope_r, lora_r)

        def attend_mlp(r: int, x: Array, q: Array, c: LayerCache, pos: Array) -> tuple[Array]:
            lora_r = None if lora is None else lora.take(r)
            y = x[:r] + attn.attend_cache(q[:r], kernel.take_rows(c, r), pos[:r], lora_r)
            return (y + self.mlp(self.mlp_norm(y), lora_r),)

        q, k, v = rows.run(project, x, rope)
        start = jnp.where(rows.computed(), positions[:, 0], NO_SLOT)
        cache = kernel.write(cache, k, v, start)
        (x,) = rows.run(attend_mlp, x, q, cache, positions)
        return x, cache


def _run_block(
    graphdef: nnx.GraphDef[Block],
    state: nnx.State,
    x: Array,
    rope: Rope | None,
    segment_ids: Array | None,
    key: Array | None,
    lora: Lora | None,
) -> tuple[Array, tuple[Array, Array]]:
    """A block as a pure function of its parameters, so ``jax.checkpoint`` can wrap it."""
    return nnx.merge(graphdef, state)(x, rope, segment_ids, key, lora)


class StackedBlocks(nnx.Module):
    """The blocks of a ``model.scan_layers`` model: one :class:`Block` (``stacked``) whose
    every parameter has a leading ``n_layers`` axis, made by stacking the unrolled blocks'
    parameters (so both initialise alike).

    It reads as a list of blocks: ``len``, indexing and iteration give per-layer views
    (each parameter's slice ``i``; a copy outside ``jit``), so code written against a list
    of blocks (the cached modes, caches and kernels per layer) works on it unchanged. The
    sequence forward scans ``stacked`` instead (:meth:`Transformer._sequence`), and the
    inference engine unstacks the parameters once (:func:`unstack_params`).
    """

    def __init__(self, blocks: list[Block]) -> None:
        graphdef, _ = nnx.split(blocks[0])
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.state(b) for b in blocks))
        self.n_layers = len(blocks)
        self.stacked = nnx.merge(graphdef, stacked)

    def __len__(self) -> int:
        return self.n_layers

    def __getitem__(self, i: int) -> Block:
        if not -self.n_layers <= i < self.n_layers:
            raise IndexError(f"layer {i} of {self.n_layers}")
        graphdef, stacked = nnx.split(self.stacked)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))

    def __iter__(self):  # -> Iterator[Block], as inferred
        return (self[i] for i in range(self.n_layers))


class Transformer(nnx.Module):
    """Decoder-only Transformer language model (see module docstring and ``docs/model.md``).

    Args:
      cfg: model shape, variant and attention kernel.
      precision: ``param_dtype`` (storage) and ``compute_dtype`` (matmul inputs).
      rngs: parameter initialisation keys (``rngs.params()`` is drawn per tensor).
      remat: the activation checkpointing policy of each block (``train.remat``, see
        :mod:`jaxlab.model.remat`; ``True``/``False`` = ``"full"``/``"none"``): recompute
        activations in the backward pass to trade FLOPs for memory. Can also be changed
        later via the ``remat`` attribute (before ``nnx.split``).

    With ``cfg.scan_layers`` the blocks are a :class:`StackedBlocks` and the sequence
    forward runs them as one ``lax.scan``: XLA compiles one block instead of ``n_layers``,
    for the same function.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        precision: PrecisionConfig,
        *,
        rngs: nnx.Rngs,
        remat: bool | str = False,
    ) -> None:
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model={cfg.d_model} must be divisible by n_heads={cfg.n_heads}")
        if cfg.positions == "rope" and cfg.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim (got {cfg.head_dim})")
        param_dtype = jnp.dtype(precision.param_dtype)
        compute_dtype = jnp.dtype(precision.compute_dtype)
        # Plain hashable attributes (not the pydantic config) so the graphdef stays hashable.
        self.positions_kind = cfg.positions
        self.head_dim = cfg.head_dim
        self.rope_theta = float(cfg.rope_theta)
        self.tie_embeddings = cfg.tie_embeddings
        self.param_dtype = param_dtype
        self.compute_dtype = compute_dtype
        self.remat = remat_policies.normalize(remat)

        self.embed = Embedding(cfg.vocab_size, cfg.d_model, param_dtype=param_dtype, rngs=rngs)
        self.pos_embed = (
            Embedding(cfg.max_seq_len, cfg.d_model, param_dtype=param_dtype, rngs=rngs)
            if cfg.positions == "learned"
            else None
        )
        blocks = [
            Block(cfg, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs)
            for _ in range(cfg.n_layers)
        ]
        self.blocks: nnx.List[Block] | StackedBlocks = (
            StackedBlocks(blocks) if cfg.scan_layers else nnx.List(blocks)
        )
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=param_dtype)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else nnx.Param(
                normal_init(rngs.params(), (cfg.d_model, cfg.vocab_size), INIT_STD, param_dtype)
            )
        )

    # ------------------------------------------------------------------ pieces

    def embed_inputs(self, tokens: Array, positions: Array) -> tuple[Array, Rope | None]:
        """The first block's input ``x`` (token + learned position embeddings) and the RoPE
        ``(sin, cos)`` tables for ``positions`` (None without RoPE), shared by every layer."""
        x = self.embed(tokens)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        rope = (
            rope_tables(positions, self.head_dim, self.rope_theta)
            if self.positions_kind == "rope"
            else None
        )
        return x, rope

    def head_kernel(self) -> tuple[Array | QuantizedKernel, bool]:
        """``(kernel, vocab_major)`` of the LM head: the ``[V, d]`` embedding table when
        tied (``vocab_major=True``), else the ``[d, V]`` ``lm_head`` (int8 when the
        inference engine quantized it)."""
        if self.lm_head is None:
            return self.embed.table[...], True
        return self.lm_head[...], False

    def logits(self, h: Array, head: Array | QuantizedKernel | None = None) -> Array:
        """The LM head on final-normed features ``[..., d_model]`` -> f32 ``[..., vocab]``.

        ``head``: the head as a ``[d_model, vocab]`` kernel, prepared once by the caller
        (a decoder may keep a transposed copy of a tied table, or an int8 one,
        ``jaxlab.infer``); None reads the model's own.
        """
        if head is not None:
            return dense(h, head, self.compute_dtype, jnp.float32)
        if self.lm_head is None:
            return self.embed.attend(h, self.compute_dtype)
        return dense(h, self.lm_head[...], self.compute_dtype, jnp.float32)

    def init_cache(self, batch: int, max_len: int, dtype: DTypeLike | None = None) -> Cache:
        """An all-zero decode cache (in the kernel's layout), stored in ``dtype`` (default:
        the compute dtype). ``max_len`` must not exceed ``max_seq_len`` for learned positions."""
        dtype = self.compute_dtype if dtype is None else dtype
        return tuple(b.attn.init_cache(batch, max_len, dtype) for b in self.blocks)

    def init_pages(
        self,
        rows: int,
        num_pages: int,
        page_size: int,
        max_len: int,
        dtype: DTypeLike | None = None,
    ) -> Pages:
        """A paged cache: an all-zero pool of ``num_pages`` pages of ``page_size`` tokens per
        layer (in the paged kernel's layout, stored in ``dtype``, default the compute
        dtype), and a table of ``rows`` rows ``ceil(max_len / page_size)`` wide holding no
        page yet (every entry ``NO_PAGE = num_pages``)."""
        dtype = self.compute_dtype if dtype is None else dtype
        pools = tuple(b.attn.init_pool(num_pages, page_size, dtype) for b in self.blocks)
        return Pages(pools, no_pages(rows, max_pages_for(max_len, page_size), num_pages))

    # ------------------------------------------------------------------ sequence mode

    def _sequence(
        self,
        tokens: Array,
        positions: Array,
        segment_ids: Array | None,
        dropout_key: Array | None,
        collect_kv: bool = True,
        lora: Lora | None = None,
    ) -> tuple[Array, list[tuple[Array, Array]]]:
        """Final-normed features and every layer's ``(k, v)`` (with ``collect_kv``; the
        features alone need none, which matters only to the scan)."""
        if tokens.ndim != 2 or positions.shape != tokens.shape:
            raise ValueError(
                f"tokens and positions must both be [B, T] (got {tokens.shape} and "
                f"{positions.shape})"
            )
        x, rope = self.embed_inputs(tokens, positions)
        policy = remat_policies.normalize(self.remat)  # the attribute may be set to a bool
        if isinstance(self.blocks, StackedBlocks):
            x, kvs = self._scan(
                self.blocks, x, rope, segment_ids, dropout_key, policy, collect_kv, lora
            )
            return self.final_norm(x), kvs
        kvs = []
        run = remat_policies.wrap(_run_block, policy, static_argnums=(0,))
        for i, block in enumerate(self.blocks):
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
            lora_i = None if lora is None else lora.layer(i)
            if policy != "none":
                graphdef, state = nnx.split(block)
                x, kv = run(graphdef, state, x, rope, segment_ids, key, lora_i)
            else:
                x, kv = block(x, rope, segment_ids, key, lora_i)
            kvs.append(kv)
        return self.final_norm(x), kvs

    @staticmethod
    def _scan(
        blocks: StackedBlocks,
        x: Array,
        rope: Rope | None,
        segment_ids: Array | None,
        dropout_key: Array | None,
        policy: str,
        collect_kv: bool,
        lora: Lora | None = None,
    ) -> tuple[Array, list[tuple[Array, Array]]]:
        """The blocks as one ``lax.scan`` over the stacked parameters (``scan_layers``):
        ``(x, every layer's (k, v) if collect_kv else [])``. Dropout folds each layer's
        index into the key, as the unrolled loop does; the adapters' layer axis is scanned
        beside the parameters'."""
        graphdef, stacked = nnx.split(blocks.stacked)
        keys = (
            None
            if dropout_key is None
            else jax.vmap(lambda i: jax.random.fold_in(dropout_key, i))(jnp.arange(len(blocks)))
        )
        run = remat_policies.wrap(_run_block, policy, static_argnums=(0,), prevent_cse=False)

        lora_xs = None if lora is None else (jnp.arange(len(blocks)), lora.weights)

        def body(x: Array, xs: tuple[Any, ...]) -> tuple[Array, tuple[Array, Array] | None]:
            state, key, lw = xs
            lora_i = None if lora is None or lw is None else lora.with_layer(lw[1], lw[0])
            x, kv = run(graphdef, state, x, rope, segment_ids, key, lora_i)
            return x, (kv if collect_kv else None)  # unused K/V: no [L, B, T, ...] buffer

        x, stacked_kv = jax.lax.scan(body, x, (stacked, keys, lora_xs))
        if not collect_kv or stacked_kv is None:
            return x, []
        ks, vs = stacked_kv
        return x, [(ks[i], vs[i]) for i in range(len(blocks))]

    def features(
        self,
        tokens: Array,
        positions: Array,
        *,
        segment_ids: Array | None = None,
        dropout_key: Array | None = None,
        lora: Lora | None = None,
    ) -> Array:
        """Final-normed hidden states ``f32[B, T, d_model]``: the LM head's input.

        Args:
          tokens: ``int32[B, T]``.
          positions: ``int32[B, T]``, given by the caller (restarting per packed document).
          segment_ids: ``int32[B, T]`` document ids for packed rows: a token attends to
            earlier-or-same tokens of its own segment.
          dropout_key: PRNG key enabling dropout (rate ``cfg.dropout_rate``); None = off.
          lora: adapters (:class:`~jaxlab.model.lora.Lora`, each row its own); None = the
            base model.

        The training loss uses this with :func:`jaxlab.model.loss.head_cross_entropy`, so
        the ``[B, T, vocab]`` logits are never materialised.
        """
        return self._sequence(
            tokens, positions, segment_ids, dropout_key, collect_kv=False, lora=lora
        )[0]

    def __call__(
        self,
        tokens: Array,
        positions: Array,
        *,
        segment_ids: Array | None = None,
        dropout_key: Array | None = None,
        lora: Lora | None = None,
    ) -> Array:
        """Logits ``f32[B, T, vocab]`` for every input token (:meth:`features` + head)."""
        h = self.features(
            tokens, positions, segment_ids=segment_ids, dropout_key=dropout_key, lora=lora
        )
        return self.logits(h)

    def prefill(
        self, tokens: Array, positions: Array, max_len: int, *, lora: Lora | None = None
    ) -> tuple[Array, Cache]:
        """The sequence forward over right-padded prompts, returning its K/V as a cache.

        ``tokens, positions: int32[B, T]`` with ``positions[b, t] == t``. Returns the
        final-normed hidden states ``f32[B, T, d_model]`` (a caller applies :meth:`logits`
        at each row's last real position) and a cache of ``max_len >= T`` slots holding the
        prompts' K/V in slots ``0 .. T-1``. Padding K/V lies in each row's future, so it is
        never visible, and decoding overwrites it. ``lora``: per-row adapters, as in
        :meth:`features`.
        """
        h, kvs = self._sequence(tokens, positions, None, None, lora=lora)
        cache = tuple(
            block.attn.kernel.fill(k, v, max_len)
            for block, (k, v) in zip(self.blocks, kvs, strict=True)
        )
        return h, cache

    def prefill_pages(
        self, tokens: Array, positions: Array, cache: Pages, *, lora: Lora | None = None
    ) -> tuple[Array, Pages]:
        """:meth:`prefill` into a paged cache: the sequence forward over right-padded prompts
        that start at position 0 (``positions[b, t] == t``), its K/V written through
        ``cache.table`` (row ``b`` of the table is prompt ``b``'s pages; positions without
        a page are dropped). Returns the hidden states and the cache with its pools
        updated (in place when donated). ``lora``: per-row adapters."""
        self._check_depth(cache)
        h, kvs = self._sequence(tokens, positions, None, None, lora=lora)
        start = jnp.zeros((tokens.shape[0],), jnp.int32)
        pools = tuple(
            block.attn.paged_kernel.write(cache.layer(i), k, v, start).pool
            for i, (block, (k, v)) in enumerate(zip(self.blocks, kvs, strict=True))
        )
        return h, Pages(pools, cache.table)

    # ------------------------------------------------------------------ cached mode

    def stage_pages(self, pages: Pages, max_len: int) -> Cache:
        """A contiguous cache of ``max_len`` slots (each layer in its kernel's layout)
        holding every row's pages (:mod:`jaxlab.kernels.staged`): decode against it as
        against any contiguous cache, then put what it wrote into the pages
        (:meth:`staged_writes`, :meth:`write_pages`)."""
        self._check_depth(pages)
        return tuple(
            staged.stage(block.attn.kernel, pages.layer(i), max_len)
            for i, block in enumerate(self.blocks)
        )

    def staged_writes(
        self, cache: Cache, start: Array, end: Array, steps: int
    ) -> tuple[tuple[Array, ...], tuple[Array, ...], Array]:
        """What a decode call against a staged ``cache`` wrote, per layer: ``(k, v [B, steps,
        K, D] per layer, positions [B, steps])``, positions ``start[b] .. end[b] - 1``
        (others ``NO_SLOT``). :meth:`write_pages` puts them into the pages."""
        out = [
            staged.written(block.attn.kernel, layer, start, end, steps)
            for block, layer in zip(self.blocks, cache, strict=True)
        ]
        return tuple(k for k, _, _ in out), tuple(v for _, v, _ in out), out[0][2]

    def write_pages(
        self, pages: Pages, k: tuple[Array, ...], v: tuple[Array, ...], positions: Array
    ) -> Pages:
        """``pages`` with each layer's ``k, v [B, T, K, D]`` written at ``positions [B, T]``
        through the table (``>= NO_SLOT``: dropped); one scatter per buffer."""
        pools = tuple(
            block.attn.paged_kernel.write_at(pages.layer(i), ki, vi, positions).pool
            for i, (block, ki, vi) in enumerate(zip(self.blocks, k, v, strict=True))
        )
        return Pages(pools, pages.table)

    def _check_depth(self, cache: AnyCache) -> None:
        depth = len(cache.pools) if isinstance(cache, Pages) else len(cache)
        if depth != len(self.blocks):
            raise ValueError(f"cache has {depth} layers, model has {len(self.blocks)}")

    def extend(
        self,
        tokens: Array,
        positions: Array,
        cache: C,
        *,
        rows: Rows | None = None,
        lora: Lora | None = None,
    ) -> tuple[Array, C]:
        """``T`` new tokens per row against ``cache``: ``(f32[B, T, d_model], new cache)``.

        ``positions [B, T]`` are consecutive per row; token ``(b, t)`` is written to slot
        ``positions[b, t]`` and attends to slots ``<= positions[b, t]`` (its own included);
        with a paged cache, "slot" means the position's place in the row's pages.
        ``rows`` (:class:`~jaxlab.kernels.rows.Rows`) limits the work to leading rows; the
        others write nothing and come out as zeros. ``lora``: per-row adapters (``ids [B]``
        over the full batch; ``rows`` slices them too). Jit with the cache donated so the
        writes happen in place.
        """
        self._check_depth(cache)
        rows = rows or Rows.all(tokens.shape[0])
        x, rope = self.embed_inputs(tokens, positions)
        if isinstance(cache, Pages):
            layers: list[LayerCache] = [cache.layer(i) for i in range(len(self.blocks))]
        else:
            layers = list(cache)
        new = []
        for i, (block, layer) in enumerate(zip(self.blocks, layers, strict=True)):
            lora_i = None if lora is None else lora.layer(i)
            x, layer = block.cached(x, rope, layer, positions, rows, lora_i)
            new.append(layer)
        h = self.final_norm(x)
        if isinstance(cache, Pages):
            return h, Pages(tuple(layer.pool for layer in new), cache.table)
        return h, tuple(new)

    def decode(
        self,
        tokens: Array,
        pos: Array,
        cache: C,
        *,
        rows: Rows | None = None,
        lora: Lora | None = None,
    ) -> tuple[Array, C]:
        """One new token per row (``tokens, pos: int32[B]``): :meth:`extend` with ``T = 1``.

        Returns final-normed ``f32[B, d_model]``; :meth:`logits` gives the next-token
        logits, so a caller can run the head on fewer rows (``rows``).
        """
        h, cache = self.extend(tokens[:, None], pos[:, None], cache, rows=rows, lora=lora)
        return h[:, 0], cache


def make_model(
    cfg: ModelConfig, precision: PrecisionConfig, seed: int, *, remat: bool | str = False
) -> Transformer:
    """Build a :class:`Transformer` with parameters initialised from ``seed``."""
    return Transformer(cfg, precision, rngs=nnx.Rngs(params=seed), remat=remat)


def is_stacked(params: nnx.State) -> bool:
    """Whether ``params`` are a ``scan_layers`` model's (stacked blocks)."""
    return "stacked" in params["blocks"]


def unstack_params(
    cfg: ModelConfig, precision: PrecisionConfig, params: nnx.State
) -> tuple[nnx.GraphDef[Transformer], nnx.State]:
    """A ``scan_layers`` model's ``params`` as the unrolled model's ``(graphdef, params)``:
    layer ``i``'s block gets slice ``i`` of every stacked parameter (a copy, made once).
    The inference engine decodes with these, so a step reads each layer's weights as
    they are, never through a slice."""
    flat = cfg.model_copy(update={"scan_layers": False})
    graphdef, template = split_model(nnx.eval_shape(lambda: make_model(flat, precision, 0)))
    pure = nnx.to_pure_dict(params)
    stacked = pure["blocks"]["stacked"]
    pure["blocks"] = {i: jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(cfg.n_layers)}
    nnx.replace_by_pure_dict(template, pure)
    return graphdef, template


def split_model(model: Transformer) -> tuple[nnx.GraphDef[Transformer], nnx.State]:
    """``(graphdef, params)``: the static structure and the ``nnx.Param`` state (all of it).

    The model holds no state other than parameters, so ``params`` is complete and
    ``nnx.merge(graphdef, params)`` rebuilds an equivalent module.
    """
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def apply(
    graphdef: nnx.GraphDef[Transformer],
    params: nnx.State,
    tokens: Array,
    positions: Array,
    **kwargs: Any,
) -> Array:
    """Pure functional forward: ``merge(graphdef, params)(tokens, positions, **kwargs)``.

    ``kwargs`` are the keyword arguments of :meth:`Transformer.__call__` (``segment_ids``,
    ``dropout_key``). ``graphdef`` is static: close over it (or mark it static) when jitting.
    """
    return nnx.merge(graphdef, params)(tokens, positions, **kwargs)


__all__ = ["AnyCache", "Block", "Cache", "Transformer", "apply", "make_model", "split_model"]
