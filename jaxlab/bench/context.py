"""What a suite gets: the resolved config, the run, the peak, and a record factory.

A suite is a function ``(ctx: BenchContext) -> Iterable[Record]``. It builds records with
:meth:`BenchContext.bench` (measure + record), :meth:`BenchContext.record` (from samples it
took itself) or :meth:`BenchContext.failure`, and **yields** each one; the context writes it
to ``records.jsonl`` the moment it is yielded, so a crash later loses nothing already
measured. Every environment field (git, versions, devices, cpu, config hash, run id,
timestamp) is filled by the context, never by the suite.

MFU: :meth:`BenchContext.mfu` divides model FLOPs/s by two peaks and names each: the
device's datasheet peak for the dtype where one is known (:mod:`jaxlab.runtime.datasheet`),
and the best matmul peak measured **in this run** (the ``peak`` suite's records for the
dtype); the headline ``mfu`` is the datasheet's where there is one. If this run has not
measured the peak yet, the context runs the ``peak`` suite first, once.
:meth:`BenchContext.bandwidth` does the same for bytes moved per second, against the
datasheet's memory bandwidth and the run's best copy.
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
    from jaxlab.runtime.datasheet import Datasheet

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
    """Model FLOPs utilisation: achieved model FLOPs/s over a peak (GFLOP/s)."""
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
    #: ``jaxlab bench --profile``: each measured case also gets one untimed call under
    #: ``jax.profiler`` (:meth:`profile_call`), its trace under ``<run_dir>/profile/``.
    profile: bool = False
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
        if samples.ok and self.profile:
            derived = {**derived, **self.profile_call(fn, metric, sync=sync)}
        return self.record(metric, unit, samples, case=case, derived=derived)

    def profile_call(
        self, fn: Callable[[], Any], metric: str, *, sync: Callable[[Any], Any] = block_until_ready
    ) -> dict[str, Any]:
        """One more call of ``fn``, untimed, under ``jax.profiler`` (``--profile``).

        The trace goes to ``<run_dir>/profile/<NNN>-<suite>-<metric>/`` (``NNN``: the index
        its record will have in ``records.jsonl``); returns ``{"profile": that path,
        relative to the run dir}``, or ``{"profile_error": ...}`` if tracing failed, which
        leaves the measurement (taken before, without the profiler) as it is.
        """
        import jax

        rel = Path("profile") / f"{len(self.records):03d}-{self.suite}-{metric}"
        self.status(f"profiling {metric}")
        try:
            jax.profiler.start_trace(str(self.run_dir / rel), create_perfetto_trace=True)
            try:
                sync(fn())
            finally:
                jax.profiler.stop_trace()
        except Exception as e:
            return {"profile_error": describe_error(e)}
        return {"profile": str(rel)}

    def emit(self, record: Record) -> Record:
        """Write one record (append-only) and show it; suites normally just yield."""
        self.writer.write(record)
        self.records.append(record)
        self.reporter.recorded(record)
        return record

    # ------------------------------------------------------------------ peak and MFU

    def _ensure_peak(self) -> None:
        """Run the ``peak`` suite once in this run if nothing has measured it yet."""
        from jaxlab.bench.peak import PEAK_SUITE

        if (
            not self._peak_attempted
            and self._runner is not None
            and not any(r.suite == PEAK_SUITE for r in self.records)
        ):
            self._peak_attempted = True
            self._runner(self, PEAK_SUITE)

    def peak_gflops(self, dtype: str = "float32") -> float | None:
        """The best matmul peak (GFLOP/s) measured in this run, running ``peak`` once if
        needed."""
        from jaxlab.bench.peak import peak_gflops

        found = peak_gflops(self.records, dtype)
        if found is None:
            self._ensure_peak()
            found = peak_gflops(self.records, dtype)
        return found

    @property
    def datasheet(self) -> Datasheet | None:
        """The datasheet of this run's device kind, or None (every CPU)."""
        from jaxlab.runtime.datasheet import datasheet_for

        return datasheet_for(str(self.env.devices.get("kind")))

    def mfu(
        self, model_flops_per_s: float, *, dtype: str = "float32", devices: int = 1
    ) -> dict[str, Any]:
        """MFU against both denominators, each named, for a derived dict.

        ``dtype`` is the compute dtype of the model's matmuls ("float32" or "bfloat16").
        Keys: ``mfu_datasheet`` over ``datasheet_peak_gflops`` (``datasheet`` names it;
        present only where the device's datasheet gives ``dtype`` a peak), ``mfu_measured``
        over ``measured_peak_gflops`` (``measured_peak`` names the record: the fastest
        ``dtype`` matmul of this run), and the headline ``mfu`` with ``mfu_basis``
        (``"datasheet"`` where there is one, else ``"measured"``), ``mfu_peak_gflops`` (its
        denominator) and ``mfu_peak_dtype``. Peaks are per device; a step spread over
        ``devices`` devices is held against ``devices`` times them. A missing measured peak
        leaves its MFU None and ``mfu_note`` says why.
        """
        from jaxlab.bench.peak import MATMUL_METRIC, best_record, describe_peak

        self.peak_gflops(dtype)  # measures the peak in this run if nothing has yet
        best = best_record(self.records, MATMUL_METRIC, "gflops", dtype)
        measured = None if best is None else float(best.derived["gflops"])
        sheet = self.datasheet
        sheet_peak = None if sheet is None else sheet.matmul_gflops(dtype)
        out: dict[str, Any] = {}
        basis = "measured"
        if sheet is not None and sheet_peak is not None:
            basis = "datasheet"
            out["mfu_datasheet"] = mfu(model_flops_per_s, sheet_peak * devices)
            out["datasheet_peak_gflops"] = sheet_peak
            out["datasheet"] = sheet.describe(dtype)
        out["mfu_measured"] = mfu(
            model_flops_per_s, None if measured is None else measured * devices
        )
        out["measured_peak_gflops"] = measured
        out["measured_peak"] = None if best is None else describe_peak(best)
        out["mfu"] = out[f"mfu_{basis}"]
        out["mfu_basis"] = basis
        out["mfu_peak_gflops"] = sheet_peak if basis == "datasheet" else measured
        out["mfu_peak_dtype"] = dtype
        if devices != 1:
            out["mfu_devices"] = devices
        notes = []
        if measured is None:
            notes.append(f"no ok {dtype} matmul peak record in run {self.run_id}")
        on_measured, on_sheet = out["mfu_measured"], out.get("mfu_datasheet")
        if on_measured is not None and on_measured > 1.0:
            notes.append(
                "MFU > 1 against the measured peak: the peak (a median of few samples) was "
                "measured while the machine was busier; rerun on a quiet machine"
            )
        if on_sheet is not None and on_sheet > 1.0:
            notes.append("MFU > 1 against the datasheet: the FLOP count overstates the work")
        if notes:
            out["mfu_note"] = "; ".join(notes)
        return out

    def bandwidth(self, bytes_per_s: float) -> dict[str, Any]:
        """Achieved memory bandwidth against both denominators, each named.

        ``gb_per_s`` is ``bytes_per_s`` in GB/s; ``bw_util_datasheet`` divides it by the
        datasheet's HBM bandwidth (``datasheet_gb_per_s``, where known), ``bw_util_measured``
        by the fastest memory pass of this run (``measured_gb_per_s``: a copy's read + write
        or a read alone, named by ``measured_bandwidth``), and ``bw_util`` (``bw_util_basis``) is the datasheet's where
        there is one. One device.
        """
        from jaxlab.bench.peak import COPY_METRIC, best_record, describe_peak

        self._ensure_peak()
        gb = bytes_per_s / 1e9
        best = best_record(self.records, COPY_METRIC, "gb_per_s")
        measured = None if best is None else float(best.derived["gb_per_s"])
        sheet = self.datasheet
        out: dict[str, Any] = {"gb_per_s": gb}
        basis = "measured"
        if sheet is not None and sheet.memory_gb_per_s:
            basis = "datasheet"
            out["bw_util_datasheet"] = gb / sheet.memory_gb_per_s
            out["datasheet_gb_per_s"] = sheet.memory_gb_per_s
        out["bw_util_measured"] = None if not measured else gb / measured
        out["measured_gb_per_s"] = measured
        out["measured_bandwidth"] = None if best is None else describe_peak(best)
        out["bw_util"] = out[f"bw_util_{basis}"]
        out["bw_util_basis"] = basis
        if out["bw_util_measured"] is not None and out["bw_util_measured"] > 1.0:
            out["bw_note"] = (
                "faster than the run's measured bandwidth: the bytes fit in a cache the "
                "peak's array does not (a small model on a CPU)"
            )
        return out
