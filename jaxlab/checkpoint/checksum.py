"""Checksums of a checkpoint: what each saved array held, and what the metadata said.

An array's checksum is a function of its global value alone: the sum, modulo 2**32, of a
keyed hash of each element's bits and its flat index (two lanes with different keys give
64 bits). Addition modulo 2**32 is associative and commutative, so each device sums its own
shard and the total is the same for every sharding, mesh and process count. It runs on the
devices inside jit: no host copy of the state, nothing that races with an async save, and in
a multi-process run every process gets the same replicated value, so a checkpoint saved on
one mesh verifies when it is restored onto another, and every process reaches the same
verdict. It catches accidental damage (flipped bits, zeroed or truncated data), not
tampering.

The metadata (the ``meta`` item's JSON) carries a sha256 of its own canonical JSON.

This module only computes and compares; the checkpoint manager decides what to record and
when to verify.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SCHEME = "sum32x2-fmix32-v1"

_LANE_KEYS = (0x9E3779B9, 0x7F4A7C15)


def leaf_path(path: tuple[Any, ...]) -> str:
    """``params/blocks/0/attn/kernel``: one spelling for a leaf whether the tree holds dicts,
    lists, named tuples or ``nnx.State`` (Orbax returns plain dicts and lists when restoring
    without a target)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _fmix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection that spreads every input bit over the word."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _as_words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (a trailing axis of 2 for 64-bit dtypes)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size == 4:
        return lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        unsigned = jnp.uint8 if size == 1 else jnp.uint16
        return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    if size == 8:
        return lax.bitcast_convert_type(x, jnp.uint32)
    raise TypeError(f"no checksum for dtype {x.dtype}")


def _array_sums(x: jax.Array) -> jax.Array:
    """uint32[2]: the two lanes of one array's checksum."""
    words = _as_words(x)
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        index = index + lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(
            stride % 2**32
        )
        stride *= words.shape[axis]
    lanes = [
        jnp.sum(_fmix32(_fmix32(index ^ jnp.uint32(key)) ^ words), dtype=jnp.uint32)
        for key in _LANE_KEYS
    ]
    return jnp.stack(lanes)


def _tree_sums(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([_array_sums(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


@functools.cache
def _summer(out_sharding: Any) -> Any:
    if out_sharding is None:
        return jax.jit(_tree_sums)
    return jax.jit(_tree_sums, out_shardings=out_sharding)


def _replicated(leaves: list[Any]) -> Any:
    """A replicated output sharding on the leaves' mesh (every process then holds the sums),
    or None for single-device arrays."""
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return None


def array_checksums(tree: Any) -> dict[str, dict[str, Any]]:
    """``{path: {"shape": [...], "dtype": "float32", "sum": "16 hex digits"}}`` per leaf.

    Every process must call it (a collective in a multi-process run); all get the same."""
    flat = jax.tree_util.tree_leaves_with_path(tree)
    paths = [leaf_path(p) for p, _ in flat]
    leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for _, x in flat]
    sums = _summer(_replicated(leaves))(leaves)
    host = np.asarray(sums if sums.is_fully_addressable else sums.addressable_data(0))
    return {
        path: {
            "shape": list(x.shape),
            "dtype": str(x.dtype),
            "sum": f"{int(row[0]):08x}{int(row[1]):08x}",
        }
        for path, x, row in zip(paths, leaves, host, strict=True)
    }


def structure_of(tree: Any) -> dict[str, tuple[list[int], str]]:
    """``{path: (shape, dtype)}`` of a pytree of arrays or ``ShapeDtypeStruct``s."""
    return {
        leaf_path(p): (list(x.shape), str(x.dtype))
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


def structure_mismatch(
    recorded: Mapping[str, Any], target: Mapping[str, tuple[list[int], str]]
) -> str | None:
    """Why ``target`` (shapes and dtypes) cannot be what was saved, or None if it can."""
    for path, (shape, dtype) in target.items():
        saved = recorded.get(path)
        if saved is None:
            return f"the checkpoint holds no array {path}"
        if list(saved["shape"]) != shape or saved["dtype"] != dtype:
            return (
                f"{path} was saved as {saved['dtype']}{saved['shape']}, "
                f"the restore target expects {dtype}{shape}"
            )
    return None


def checksum_mismatch(recorded: Mapping[str, Any], read: Mapping[str, Any]) -> str | None:
    """A one-line reason when an array read back differs from the one saved, else None."""
    bad = [p for p, v in read.items() if p in recorded and recorded[p]["sum"] != v["sum"]]
    if not bad:
        return None
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    return f"checksum mismatch in {bad[0]}{more}"


def meta_digest(meta: Mapping[str, Any]) -> str:
    """sha256 of the metadata's canonical JSON, without its ``checksums`` entry."""
    body = {k: v for k, v in meta.items() if k != "checksums"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


__all__ = [
    "SCHEME",
    "array_checksums",
    "checksum_mismatch",
    "leaf_path",
    "meta_digest",
    "structure_mismatch",
    "structure_of",
]
