"""A quick matmul-throughput probe, so the training view can report MFU.

The benchmark harness (``jaxlab bench peak``) measures the peak properly and MFU in
benchmark records uses that same-run figure; this probe is the cheap version a training
run takes once at start-up (about half a second on a 2-core CPU).
"""

from __future__ import annotations

import functools
import time


@functools.lru_cache(maxsize=4)
def matmul_peak_gflops(dtype: str = "float32", n: int = 1024, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype=jnp.dtype(dtype))
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype=jnp.dtype(dtype))
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * n**3 / times[len(times) // 2] / 1e9
