"""Checkpoint checksums: a numpy reference, sensitivity to damage, sharding invariance."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import ROOT, clean_env, with_xla_flags
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlab.checkpoint import checksum

M32 = 0xFFFFFFFF


def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h.astype(np.uint64)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def reference_sum(x: np.ndarray) -> str:
    """The checksum written out in numpy, element by element, on one host."""
    if x.dtype == np.bool_:
        words = x.astype(np.uint64)
    else:
        unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
        words = x.view(unsigned).astype(np.uint64)
    index = np.arange(words.size, dtype=np.uint64).reshape(words.shape) & M32
    lanes = [
        int(_fmix32(_fmix32(index ^ key) ^ words).sum() & M32) for key in (0x9E3779B9, 0x7F4A7C15)
    ]
    return f"{lanes[0]:08x}{lanes[1]:08x}"


DTYPES = [np.float32, np.int32, np.uint32, np.uint8, np.bool_, ml_dtypes.bfloat16]


def arrays() -> st.SearchStrategy[np.ndarray]:
    @st.composite
    def build(draw: st.DrawFn) -> np.ndarray:
        shape = tuple(draw(st.lists(st.integers(1, 6), max_size=3)))
        dtype = np.dtype(draw(st.sampled_from(DTYPES)))
        size = int(np.prod(shape))
        raw = draw(st.binary(min_size=size * dtype.itemsize, max_size=size * dtype.itemsize))
        if dtype == np.bool_:
            return (np.frombuffer(raw, np.uint8) & 1).astype(np.bool_).reshape(shape)
        return np.frombuffer(raw, dtype).reshape(shape).copy()

    return build()


@settings(max_examples=40, deadline=None)
@given(arrays())
def test_checksum_matches_the_numpy_reference(x):
    got = checksum.array_checksums({"a": jnp.asarray(x)})["a"]
    assert got == {"shape": list(x.shape), "dtype": str(x.dtype), "sum": reference_sum(x)}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 32 * 16 * 4 - 1), st.integers(0, 7))
def test_any_flipped_bit_changes_the_checksum(byte, bit):
    x = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    damaged = x.copy()
    damaged.view(np.uint8).reshape(-1)[byte] ^= 1 << bit
    sums = checksum.array_checksums({"x": jnp.asarray(x), "y": jnp.asarray(damaged)})
    assert sums["x"]["sum"] != sums["y"]["sum"]


def test_moved_or_zeroed_values_change_the_checksum():
    x = np.arange(1, 65, dtype=np.float32).reshape(8, 8)
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    zeroed = x.copy()
    zeroed[4:] = 0
    sums = checksum.array_checksums(
        {"x": jnp.asarray(x), "s": jnp.asarray(swapped), "z": jnp.asarray(zeroed)}
    )
    assert len({v["sum"] for v in sums.values()}) == 3


def test_leaf_paths_are_spelled_the_same_for_any_container():
    from collections import namedtuple

    Pair = namedtuple("Pair", ["mu", "nu"])
    one = jnp.ones(3)
    a = checksum.array_checksums({"opt": [Pair(one, one * 2)]})
    b = checksum.array_checksums({"opt": {"0": {"mu": one, "nu": one * 2}}})
    assert a == b and sorted(a) == ["opt/0/mu", "opt/0/nu"]


def test_meta_digest_ignores_key_order_and_the_checksum_entry():
    meta = {"config": "x = 1", "step": 3, "tokenizer": {"a": "b"}}
    digest = checksum.meta_digest(meta)
    assert checksum.meta_digest(dict(reversed(list(meta.items())))) == digest
    assert checksum.meta_digest({**meta, "checksums": {"anything": 1}}) == digest
    assert checksum.meta_digest({**meta, "step": 4}) != digest


def test_structure_mismatch_names_the_array_and_both_shapes():
    recorded = checksum.array_checksums({"params": {"w": jnp.zeros((4, 2))}})
    assert checksum.structure_mismatch(recorded, {"params/w": ([4, 2], "float32")}) is None
    why = checksum.structure_mismatch(recorded, {"params/w": ([8, 2], "float32")})
    assert why == "params/w was saved as float32[4, 2], the restore target expects float32[8, 2]"
    why = checksum.structure_mismatch(recorded, {"params/v": ([1], "float32")})
    assert why == "the checkpoint holds no array params/v"


SHARDED = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxlab.checkpoint import checksum

    mesh = jax.make_mesh((2, 2), ("a", "b"))
    x = np.random.default_rng(1).standard_normal((8, 6)).astype(np.float32)
    out = {}
    for spec in (P(), P("a"), P(None, "b"), P("a", "b"), P("b", "a")):
        arr = jax.device_put(x, NamedSharding(mesh, spec))
        out[str(spec)] = checksum.array_checksums({"x": arr})["x"]["sum"]
    out["single"] = checksum.array_checksums({"x": jnp.asarray(x)})["x"]["sum"]
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_checksum_is_the_same_for_every_sharding():
    """Four simulated CPU devices (their own process): one value for every layout."""
    env = clean_env()
    env["XLA_FLAGS"] = with_xla_flags("--xla_force_host_platform_device_count=4")
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    sums = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(set(sums.values())) == 1, sums
