"""The benchmark record: one measurement, with everything needed to judge it later.

A record says what was measured (``suite``, ``case``, ``metric``, ``unit``), the raw
``samples`` and their ``stats``, whether it worked (``status``, ``error``), and where and
when (``run_id``, ``timestamp``, ``git``, ``versions``, ``devices``, ``cpu``,
``config_hash``). ``derived`` holds figures computed from the median (GFLOP/s, MB/s,
tokens/s, MFU ...). ``better`` says which direction is an improvement (time: ``lower``).

Records are appended to ``records.jsonl`` (JSON Lines), one per measurement, and never
rewritten; :func:`load_records` validates every line and names the line and field of any
problem. ``SCHEMA_VERSION`` changes whenever a reader of the old shape would misread the
new one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from jaxlab.bench.stats import Stats
from jaxlab.config.loader import not_utf8

SCHEMA_VERSION = 1
RECORDS_FILENAME = "records.jsonl"

CaseValue = str | int | float | bool | None


class RecordError(ValueError):
    """A record (or a records file) that does not match the schema."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GitInfo(_Strict):
    commit: str | None
    dirty: bool | None


class CpuInfo(_Strict):
    model: str
    cores: int | None
    #: The widest vector extension (``avx512f``, ``avx2``...): two VMs can share a ``model``
    #: ("AMD EPYC") and differ here. None in records written before it was recorded.
    simd: str | None = None


class DeviceInfo(_Strict):
    platform: str
    kind: str
    count: int = Field(ge=0)
    backend: str | None = None


class Record(_Strict):
    schema_version: int
    suite: str = Field(min_length=1)
    case: dict[str, CaseValue]
    metric: str = Field(min_length=1)
    unit: str
    samples: list[float]
    stats: Stats
    status: Literal["ok", "failed"]
    error: str | None = None
    better: Literal["lower", "higher"] = "lower"
    run_id: str = Field(min_length=1)
    timestamp: str
    git: GitInfo
    versions: dict[str, str]
    devices: DeviceInfo
    cpu: CpuInfo
    config_hash: str | None = None
    derived: dict[str, Any] = Field(default_factory=dict)

    @field_validator("schema_version", mode="before")
    @classmethod
    def _version(cls, v: Any) -> Any:
        if v != SCHEMA_VERSION:
            raise ValueError(
                f"this jaxlab reads schema_version {SCHEMA_VERSION} (got {v!r}); the record was "
                "written by a different jaxlab version"
            )
        return v

    @field_validator("timestamp")
    @classmethod
    def _utc_iso(cls, v: str) -> str:
        try:
            ts = datetime.fromisoformat(v)
        except ValueError:
            raise ValueError(f"expected an ISO 8601 timestamp (got {v!r})") from None
        offset = ts.utcoffset()
        if offset is None or offset.total_seconds() != 0:
            raise ValueError(f"expected a UTC timestamp with +00:00 (got {v!r})")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Record:
        if self.status == "failed":
            if not self.error:
                raise ValueError("status is 'failed' but error is empty; say what failed")
            if self.stats.median is not None:
                raise ValueError(
                    "a failed record carries no statistics (stats.median must be null)"
                )
            return self
        if self.error is not None:
            raise ValueError(f"status is 'ok' but error is set ({self.error!r})")
        if not self.samples:
            raise ValueError("status is 'ok' but samples is empty")
        if self.stats.n != len(self.samples):
            raise ValueError(
                f"stats.n ({self.stats.n}) does not match len(samples) ({len(self.samples)})"
            )
        if self.stats.median is None:
            raise ValueError("status is 'ok' but stats.median is null")
        if self.stats.tails_withheld != (self.stats.p90 is None or self.stats.p99 is None):
            raise ValueError("stats.tails_withheld must be true exactly when p90/p99 are null")
        return self

    # ----------------------------------------------------------------- helpers

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def key(self) -> tuple[str, str, str]:
        """Identity across runs: (suite, canonical case JSON, metric)."""
        return (self.suite, case_key(self.case), self.metric)

    def to_json_line(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=False, allow_nan=False)


def case_key(case: Mapping[str, Any]) -> str:
    return json.dumps(dict(case), sort_keys=True, separators=(",", ":"))


def case_label(case: Mapping[str, Any]) -> str:
    """``k=v k=v`` in the order the suite wrote them (for tables)."""
    return " ".join(f"{k}={v}" for k, v in case.items()) or "-"


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _format_validation(err: ValidationError) -> str:
    parts = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(p) for p in e["loc"]) or "record"
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def validate_record(data: Any, *, where: str = "record") -> Record:
    """Validate one record (a dict or a Record); raise :class:`RecordError` naming the field."""
    if isinstance(data, Record):
        data = data.model_dump(mode="json")
    if not isinstance(data, dict):
        raise RecordError(f"{where}: expected a JSON object (got {type(data).__name__})")
    try:
        return Record.model_validate(data)
    except ValidationError as e:
        raise RecordError(f"{where}: invalid record: {_format_validation(e)}") from None


def records_path(path: str | Path) -> Path:
    """A run directory or a records.jsonl path -> the records.jsonl path."""
    p = Path(path)
    return p / RECORDS_FILENAME if p.is_dir() else p


def load_records(path: str | Path) -> list[Record]:
    """Every record of a run directory or records.jsonl file, validated line by line."""
    p = records_path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecordError(f"{p}: no such records file") from None
    except UnicodeDecodeError as e:
        raise RecordError(f"{p}: {not_utf8(e)}") from None
    except OSError as e:
        raise RecordError(f"{p}: cannot read ({e.strerror})") from None
    out = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecordError(f"{p}:{lineno}: not JSON ({e.msg})") from None
        out.append(validate_record(data, where=f"{p}:{lineno}"))
    return out


class RecordWriter:
    """Append-only JSON Lines writer: one line per record, flushed and synced as written."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()  # an empty run still has its (empty) records file
        self.count = 0

    def write(self, record: Record) -> None:
        line = validate_record(record).to_json_line()
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.count += 1


# --------------------------------------------------------------------------- environment


@dataclass
class Environment:
    """Where records are measured: filled once per run, copied into every record."""

    git: dict[str, Any] = field(default_factory=lambda: {"commit": None, "dirty": None})
    versions: dict[str, str] = field(default_factory=dict)
    devices: dict[str, Any] = field(
        default_factory=lambda: {"platform": "unknown", "kind": "unknown", "count": 0}
    )
    cpu: dict[str, Any] = field(default_factory=lambda: {"model": "unknown", "cores": None})

    @classmethod
    def capture(cls) -> Environment:
        """The real environment (imports jax to read the device inventory)."""
        import jaxlab
        from jaxlab.runtime import cpu_model, cpu_simd, device_inventory, git_state, versions

        inv = device_inventory()
        return cls(
            git=git_state(Path(jaxlab.__file__).resolve().parent),
            versions=versions(),
            devices={
                "platform": inv["platform"],
                "kind": inv["device_kind"],
                "count": inv["device_count"],
                "backend": inv["backend"],
            },
            cpu={"model": cpu_model(), "cores": os.cpu_count(), "simd": cpu_simd()},
        )

    def fields(self) -> dict[str, Any]:
        return {
            "git": self.git,
            "versions": self.versions,
            "devices": self.devices,
            "cpu": self.cpu,
        }


def cpu_label(cpu: CpuInfo) -> str:
    """The CPU's model with its widest vector extension where recorded: ``AMD EPYC (avx2)``."""
    return f"{cpu.model} ({cpu.simd})" if cpu.simd else cpu.model


def same_machine_warnings(a: Iterable[Record], b: Iterable[Record]) -> list[str]:
    """Environment differences that make a comparison of ``a`` and ``b`` questionable."""
    ra, rb = next(iter(a), None), next(iter(b), None)
    if ra is None or rb is None:
        return []
    out = []
    simd_differs = None not in (ra.cpu.simd, rb.cpu.simd) and ra.cpu.simd != rb.cpu.simd
    if ra.cpu.model != rb.cpu.model or ra.cpu.cores != rb.cpu.cores or simd_differs:
        out.append(
            f"different CPUs ({cpu_label(ra.cpu)}, {ra.cpu.cores} cores vs "
            f"{cpu_label(rb.cpu)}, {rb.cpu.cores} cores): not a valid comparison"
        )
    da, db = ra.devices, rb.devices
    if (da.platform, da.kind, da.count) != (db.platform, db.kind, db.count):
        out.append(
            f"different devices ({da.count}x {da.platform} {da.kind} vs {db.count}x "
            f"{db.platform} {db.kind}): not a valid comparison"
        )
    changed = sorted(
        k for k in set(ra.versions) | set(rb.versions) if ra.versions.get(k) != rb.versions.get(k)
    )
    if changed:
        out.append(
            "different library versions: "
            + ", ".join(f"{k} {ra.versions.get(k)} -> {rb.versions.get(k)}" for k in changed)
        )
    return out
