"""What a suite gets: the resolved config, the run, the peak, and a record factory.

A suite is a function ``(ctx: BenchContext) -> Iterable[Record]``. It builds records with
:meth:`BenchContext.bench` (measure + record), :meth:`BenchContext.record` (from samples it
took itself) or :meth:`BenchContext.failure`, and **yields** each one; the context writes it
to ``records.jsonl`` the moment it is yielded, so a crash later loses nothing already
measured. Every environment field (git, versions, devices, cpu, config hash, run id,
timestamp) is filled by the context, never by the suite.

MFU: :meth:`BenchContext.mfu` divides model FLOPs/s by the matmul peak measured **in this
run** (the ``peak`` suite's record for the matching dtype); if this run has not measured
the peak yet, the context runs the ``peak`` suite first, once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from jaxlab.bench.record import (
    SCHEMA_VERSION,
    CaseValue,
    Environment,
    Record,
    RecordWriter,
    utc_now,
    validate_record,
)
from jaxlab.bench.stats import Stats, summarize
from jaxlab.bench.timing import Samples, block_until_ready, describe_error, measure

if TYPE_CHECKING:
    from jaxlab.config import JaxlabConfig

Better = Literal["lower", "higher"]
Derive = Callable[[Stats], Mapping[str, Any]]


class Reporter(Protocol):
    """Live progress of a run (the CLI draws it on stderr)."""

    def suite_started(self, suite: str) -> None: ...

    def case_started(self, suite: str, text: str) -> None: ...

    def recorded(self, record: Record) -> None: ...


class NullReporter:
    def suite_started(self, suite: str) -> None:
        pass

    def case_started(self, suite: str, text: str) -> None:
        pass

    def recorded(self, record: Record) -> None:
        pass


def mfu(model_flops_per_s: float, peak_gflops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOPs/s over the measured peak (GFLOP/s)."""
    if peak_gflops is None or peak_gflops <= 0 or not math.isfinite(model_flops_per_s):
        return None
    return model_flops_per_s / (peak_gflops * 1e9)


def _clean(value: Any) -> Any:
    """JSON-safe derived values: non-finite floats become None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


@dataclass
class BenchContext:
    config: JaxlabConfig
    quick: bool
    run_id: str
    run_dir: Path
    env: Environment
    writer: RecordWriter
    config_hash: str | None = None
    reporter: Reporter = field(default_factory=NullReporter)
    records: list[Record] = field(default_factory=list)
    suite: str = ""
    _peak_attempted: bool = False
    _runner: Callable[[BenchContext, str], list[Record]] | None = None

    # ------------------------------------------------------------------ plan

    @property
    def out_dir(self) -> Path:
        """The run directory (``<out>/<run_id>``): suites may write artefacts here."""
        return self.run_dir

    @property
    def min_samples_for_tails(self) -> int:
        return self.config.bench.min_samples_for_tails

    def repeats(self, *, quick_cap: int = 5) -> int:
        """Timed samples per case: ``bench.repeats``, at most ``quick_cap`` with --quick."""
        r = self.config.bench.repeats
        return min(r, quick_cap) if self.quick else r

    def warmup(self, *, quick_cap: int = 1) -> int:
        """Untimed calls per case: ``bench.warmup``, at most ``quick_cap`` with --quick."""
        w = self.config.bench.warmup
        return min(w, quick_cap) if self.quick else w

    def status(self, text: str) -> None:
        """Tell the live view what is being measured now."""
        self.reporter.case_started(self.suite, text)

    # ------------------------------------------------------------------ records

    def record(
        self,
        metric: str,
        unit: str,
        samples: Samples | Iterable[float],
        *,
        case: Mapping[str, CaseValue],
        derived: Mapping[str, Any] | None = None,
        better: Better = "lower",
        error: str | None = None,
    ) -> Record:
        """A validated record with every environment field filled (not yet written)."""
        if isinstance(samples, Samples):
            error = error or samples.error
            raw = list(samples.times_s)
        else:
            raw = [float(x) for x in samples]
        if error is not None:
            stats = summarize(raw, withheld_reason="measurement failed")
        else:
            stats = summarize(raw, min_samples_for_tails=self.min_samples_for_tails)
        data = {
            "schema_version": SCHEMA_VERSION,
            "suite": self.suite,
            "case": dict(case),
            "metric": metric,
            "unit": unit,
            "samples": raw,
            "stats": stats.model_dump(),
            "status": "failed" if error is not None else "ok",
            "error": error,
            "better": better,
            "run_id": self.run_id,
            "timestamp": utc_now(),
            **self.env.fields(),
            "config_hash": self.config_hash,
            "derived": _clean(dict(derived or {})) if error is None else {},
        }
        return validate_record(data, where=f"{self.suite}/{metric}")

    def failure(
        self, metric: str, error: BaseException | str, *, case: Mapping[str, CaseValue], unit="s"
    ) -> Record:
        """A ``status = "failed"`` record for something that broke outside ``measure``."""
        text = error if isinstance(error, str) else describe_error(error)
        return self.record(metric, unit, [], case=case, error=text)

    def bench(
        self,
        metric: str,
        fn: Callable[[], Any],
        *,
        case: Mapping[str, CaseValue],
        unit: str = "s",
        derive: Derive | None = None,
        warmup: int | None = None,
        repeats: int | None = None,
        sync: Callable[[Any], Any] = block_until_ready,
        before: Callable[[], Any] | None = None,
        warm_each: int = 0,
    ) -> Record:
        """Measure ``fn`` (see :func:`jaxlab.bench.timing.measure`) and build its record.

        ``derive(stats)`` computes the derived figures from the statistics of an ok
        measurement (e.g. ``{"gflops": flops / stats.median_value / 1e9}``); if it raises, the
        record is a failure naming that error.
        """
        from jaxlab.bench.record import case_label

        self.status(f"{metric} {case_label(case)}")
        samples = measure(
            fn,
            warmup=self.warmup() if warmup is None else warmup,
            repeats=self.repeats() if repeats is None else repeats,
            sync=sync,
            before=before,
            warm_each=warm_each,
        )
        derived: Mapping[str, Any] = {}
        if samples.ok and derive is not None:
            stats = summarize(samples.times_s, min_samples_for_tails=self.min_samples_for_tails)
            try:
                derived = derive(stats)
            except Exception as e:
                samples.error = f"computing derived figures: {describe_error(e)}"
        return self.record(metric, unit, samples, case=case, derived=derived)

    def emit(self, record: Record) -> Record:
        """Write one record (append-only) and show it; suites normally just yield."""
        self.writer.write(record)
        self.records.append(record)
        self.reporter.recorded(record)
        return record

    # ------------------------------------------------------------------ peak and MFU

    def peak_gflops(self, dtype: str = "float32") -> float | None:
        """The matmul peak (GFLOP/s) measured in this run, running ``peak`` once if needed."""
        from jaxlab.bench.peak import PEAK_SUITE, peak_gflops

        found = peak_gflops(self.records, dtype)
        if (
            found is None
            and not self._peak_attempted
            and self._runner is not None
            and not any(r.suite == PEAK_SUITE for r in self.records)
        ):
            self._peak_attempted = True
            self._runner(self, PEAK_SUITE)
            found = peak_gflops(self.records, dtype)
        return found

    def mfu(
        self, model_flops_per_s: float, *, dtype: str = "float32", devices: int = 1
    ) -> dict[str, Any]:
        """``{"mfu", "mfu_peak_gflops", "mfu_peak_dtype"}`` for a derived dict.

        ``dtype`` is the compute dtype of the model's matmuls ("float32" or "bfloat16").
        The peak is measured on one device; a step spread over ``devices`` devices is held
        against ``devices`` times it. Without an ok peak record for ``dtype`` in this run,
        ``mfu`` is None and ``mfu_note`` says why.
        """
        peak = self.peak_gflops(dtype)
        total = None if peak is None else peak * devices
        out: dict[str, Any] = {
            "mfu": mfu(model_flops_per_s, total),
            "mfu_peak_gflops": peak,
            "mfu_peak_dtype": dtype,
        }
        if devices != 1:
            out["mfu_devices"] = devices
        if peak is None:
            out["mfu_note"] = f"no ok {dtype} matmul peak record in run {self.run_id}"
        elif out["mfu"] is not None and out["mfu"] > 1.0:
            out["mfu_note"] = (
                "MFU > 1: the peak (a median of few samples) was measured while the machine "
                "was busier; trust neither figure, rerun on a quiet machine"
            )
        return out
