"""Tiny engines shared by the inference tests, and a minimal host loop over the verbs.

Compiles dominate the cost of these tests, so every test draws on a few engines cached at
process level with fixed shapes (batch, bucket, max_len): hypothesis examples vary prompt
contents, lengths, budgets and model weights without recompiling.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from jaxlab.config import DataConfig, InferenceConfig, JaxlabConfig, ModelConfig, TokenizerConfig
from jaxlab.infer import Chunk, Engine, PagePool, Request, SamplingParams
from jaxlab.model import make_model, split_model

VOCAB = 258


def tiny_cfg(
    n_kv_heads: int,
    max_len: int,
    buckets: list[int],
    n_layers: int = 2,
    page_size: int = 16,
    **model: object,
) -> JaxlabConfig:
    return JaxlabConfig(
        model=ModelConfig(
            vocab_size=VOCAB,
            n_layers=n_layers,
            d_model=32,
            n_heads=4,
            n_kv_heads=n_kv_heads,
            d_mlp=64,
            max_seq_len=max_len,
            **model,  # type: ignore[arg-type]
        ),
        tokenizer=TokenizerConfig(kind="byte"),
        data=DataConfig(seq_len=min(64, max_len)),
        inference=InferenceConfig(max_len=max_len, prefill_buckets=buckets, page_size=page_size),
    )


def numpy_params(cfg: JaxlabConfig, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """A random model without a single compile: eager init would compile every op shape."""
    graphdef, abstract = split_model(
        nnx.eval_shape(lambda: make_model(cfg.model, cfg.train.precision, 0))
    )
    rng = np.random.default_rng(seed)

    def leaf(path: tuple, a: jax.ShapeDtypeStruct) -> jax.Array:
        if "scale" in jax.tree_util.keystr(path):  # RMSNorm gains near 1
            x = 1.0 + 0.1 * rng.standard_normal(a.shape)
        else:
            x = 0.08 * rng.standard_normal(a.shape)
        return jax.device_put(x.astype(a.dtype))

    return graphdef, jax.tree_util.tree_map_with_path(leaf, abstract)


def make_engine(cfg: JaxlabConfig, seed: int = 0) -> Engine:
    graphdef, params = numpy_params(cfg, seed)
    return Engine(graphdef, params, cfg)


@functools.cache
def main_engine() -> Engine:
    """GQA (2 kv heads for 4 query heads), 2 layers; the engine most tests share."""
    return make_engine(tiny_cfg(2, 256, [8, 16, 32, 64, 256]))


@functools.cache
def variant_engine(n_kv_heads: int) -> Engine:
    if n_kv_heads == 2:
        return main_engine()
    if n_kv_heads == 1:  # MQA, GPT-2-like variant: learned positions, tied head, GELU
        cfg = tiny_cfg(1, 32, [16, 32], 1, positions="learned", tie_embeddings=True, mlp="gelu")
    else:  # MHA
        cfg = tiny_cfg(n_kv_heads, 32, [16, 32], 1)
    return make_engine(cfg)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def req(prompt: Sequence[int], sampling: SamplingParams, eng: Engine | None = None) -> Request:
    return Request.create(prompt, sampling, (eng or main_engine()).limits())


def scattered_pages(eng: Engine, n_rows: int, seed: int = 0) -> tuple[int, list[list[int]]]:
    """The pool offline generation gives ``n_rows`` rows (``n_rows * max_pages`` pages: the
    same shapes, so the same executables), and ``max_pages`` pages per row, shuffled and
    interleaved across it."""
    num_pages = n_rows * eng.max_pages
    ids = np.random.default_rng(seed).permutation(num_pages)
    return num_pages, [[int(p) for p in ids[r::n_rows]] for r in range(n_rows)]


def prefilled(
    eng: Engine,
    prompts: Sequence[Sequence[int]],
    samplings: Sequence[SamplingParams],
    *,
    bucket: int | None = None,
    params: nnx.State | None = None,
    seed: int = 0,
):
    """A decode state of one row per prompt, prefilled as one batch through shuffled pages
    and inserted: ``(state, first tokens, Prefill)``."""
    num_pages, pages = scattered_pages(eng, len(prompts), seed)
    state = eng.init_decode_state(len(prompts), num_pages)
    chunks = [
        Chunk(p, 0, pages[i], s) for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))
    ]
    state, pre = eng.prefill(state, chunks, bucket=bucket, params=params)
    first = np.asarray(pre.tokens)[: len(prompts)]
    state = eng.insert(pre, state, list(range(len(prompts))))
    return state, first, pre


#: The decode chunk the host loops use: one generate executable per engine and state.
CHUNK = 4


class Host:
    """A minimal continuous-batching host over the engine's verbs: a :class:`PagePool`,
    one decode state, its page table; requests admitted into free slots, their pages
    released when they finish (and lent to the next request).

    Three slots over the default pool by default: the shapes offline generation of three
    requests uses, so most tests share the executables."""

    def __init__(self, eng: Engine, slots: int = 3, *, prefix_caching: bool = False) -> None:
        self.eng = eng
        self.pool = PagePool(eng.pool_pages(slots), eng.page_size, prefix_caching=prefix_caching)
        self.state = eng.init_decode_state(slots, self.pool.num_pages)
        self.table = np.full((slots, eng.max_pages), self.pool.num_pages, np.int32)

    def hold_all_but(self, n_pages: int) -> None:
        """Lend every free page but ``n_pages`` to a sequence that never runs, so the next
        admissions reuse freed pages."""
        spare = self.pool.free - n_pages
        assert spare >= 0
        if spare:
            assert self.pool.admit("held", [0], reserve=spare * self.eng.page_size - 1)

    def start(self, slot: int, request: Request, *, bucket: int | None = None) -> int:
        """Admit ``request`` into ``slot`` (its whole budget's pages up front), prefill it
        and insert it; its first token."""
        got = self.pool.admit(slot, request.prompt_ids, reserve=request.sampling.max_new_tokens)
        assert got is not None
        self.table[slot] = self.pool.num_pages
        self.table[slot, : len(got.pages)] = got.pages
        chunk = Chunk(request.prompt_ids, 0, got.pages, request.sampling)
        self.state, pre = self.eng.prefill(self.state, [chunk], bucket=bucket)
        first = int(np.asarray(pre.tokens)[0])
        self.state = self.eng.insert(pre, self.state, [slot])
        return first

    def step(self, out: dict[int, list[int]]) -> np.ndarray:
        """One decode chunk; each slot's new tokens appended to ``out[slot]``; ``done``."""
        self.state, toks, done = self.eng.generate(self.state, CHUNK)
        toks = np.asarray(toks)
        for slot, got in out.items():
            got += [int(t) for t in toks[:, slot] if t >= 0]
        return np.asarray(done)

    def drain(self, out: dict[int, list[int]]) -> None:
        """Decode until every row is done."""
        while not self.step(out).all():
            pass

    def finish(self, slot: int) -> None:
        self.pool.release(slot)
        self.table[slot] = self.pool.num_pages
        self.state = self.eng.set_table(self.state, self.table)
