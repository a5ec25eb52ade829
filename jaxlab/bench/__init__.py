"""The benchmark harness that refuses to lie.

* :mod:`~jaxlab.bench.timing` — ``measure``: untimed warm-up, ``block_until_ready`` on every
  result, raw samples kept, failures recorded;
* :mod:`~jaxlab.bench.stats` — median & co., tails withheld below 20 samples;
* :mod:`~jaxlab.bench.compile` — trace / lower / compile timed apart (AOT API);
* :mod:`~jaxlab.bench.record` — the validated record schema, append-only JSON Lines;
* :mod:`~jaxlab.bench.suites` — ``@suite`` registry and ``run_bench``;
* :mod:`~jaxlab.bench.context` — what a suite gets, including MFU against the same-run peak;
* :mod:`~jaxlab.bench.report`, :mod:`~jaxlab.bench.compare` — summaries, plots, comparisons.

Nothing here imports jax at import time (see docs/benchmarking.md).
"""

from jaxlab.bench.compare import Comparison, compare
from jaxlab.bench.context import BenchContext, mfu
from jaxlab.bench.peak import peak_gflops
from jaxlab.bench.record import (
    SCHEMA_VERSION,
    Environment,
    Record,
    RecordError,
    load_records,
    validate_record,
)
from jaxlab.bench.stats import Stats, summarize
from jaxlab.bench.suites import UnknownSuiteError, known_suites, resolve_suites, run_bench, suite
from jaxlab.bench.timing import Samples, measure

__all__ = [
    "SCHEMA_VERSION",
    "BenchContext",
    "Comparison",
    "Environment",
    "Record",
    "RecordError",
    "Samples",
    "Stats",
    "UnknownSuiteError",
    "compare",
    "known_suites",
    "load_records",
    "measure",
    "mfu",
    "peak_gflops",
    "resolve_suites",
    "run_bench",
    "suite",
    "summarize",
    "validate_record",
]
