"""The suite registry and the runner that turns suites into a run directory.

Registering a suite (in any module listed in ``BUILTIN_SUITE_MODULES``)::

    from jaxlab.bench.suites import suite

    @suite("decode", needs_peak=True, description="tokens/s of the decode loop")
    def decode_suite(ctx):
        import jax                      # heavy imports inside the function body
        ...
        flops = ...                     # model FLOPs of one call
        yield ctx.bench(
            "decode_step_time", step, case={"batch": 8},
            derive=lambda s: {"tokens_per_s": 8 / s.median_value, **ctx.mfu(flops / s.median_value)},
        )

Suite modules must not import jax at module level: the CLI loads them to list and
complete suite names without starting jax.
"""

from __future__ import annotations

import contextlib
import importlib
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from jaxlab.bench.context import BenchContext, NullReporter, Reporter
from jaxlab.bench.record import RECORDS_FILENAME, Environment, Record, RecordWriter

if TYPE_CHECKING:
    from jaxlab.bench.report import ReportResult
    from jaxlab.config import JaxlabConfig

SuiteFn = Callable[[BenchContext], Iterable[Record]]
#: A suite's check of the resolved config, run before jax starts: raises ``ConfigError``.
CheckFn = Callable[["JaxlabConfig"], None]

# Modules whose import registers suites. Add yours here (one line).
BUILTIN_SUITE_MODULES: tuple[str, ...] = (
    "jaxlab.bench.peak",
    "jaxlab.bench.tokenizer_suite",
    "jaxlab.bench.compile",
    "jaxlab.bench.model_suites",
    "jaxlab.bench.kernel_suites",
    "jaxlab.bench.paged_attention_suite",
    "jaxlab.bench.infer_suites",
    "jaxlab.bench.peer_suite",
    "jaxlab.bench.serve_suite",
    "jaxlab.bench.serve_lora",
    "jaxlab.bench.knobs",
    "jaxlab.bench.lora_suite",
    "jaxlab.bench.speculative",
)
# CLI subcommand names a suite may not take (``peak`` is both, on purpose).
RESERVED_NAMES = frozenset({"run", "compare", "report", "list", "results"})
# Suites `jaxlab bench` without names leaves out (they need a server or are long).
NOT_BY_DEFAULT = frozenset({"serve"})


class UnknownSuiteError(ValueError):
    """A suite name nobody registered; the message lists the known ones."""


@dataclass(frozen=True)
class SuiteSpec:
    name: str
    fn: SuiteFn
    description: str = ""
    needs_peak: bool = False
    default: bool = True
    new_shapes: bool = False
    check: CheckFn | None = None


REGISTRY: dict[str, SuiteSpec] = {}


def suite(
    name: str,
    *,
    description: str = "",
    needs_peak: bool = False,
    default: bool | None = None,
    new_shapes: bool = False,
    check: CheckFn | None = None,
) -> Callable[[SuiteFn], SuiteFn]:
    """Register ``fn`` as suite ``name``.

    ``needs_peak``: the runner measures the ``peak`` suite first in the same run (so
    ``ctx.mfu`` has its denominator). ``default``: part of ``jaxlab bench`` with no names
    (default: yes, except ``serve``). ``new_shapes``: the suite sweeps input shapes (batch
    sizes, lengths, slots) through the same compiled functions, so their recompiles are
    expected: logged at INFO, not warned about (``jaxlab.runtime.compiled``). Records still
    count any compile inside a timed call. ``check``: called with the resolved config
    before jax starts (``jaxlab bench`` turns its ``ConfigError`` into exit 2).
    """
    if not name or name.startswith("-") or name in RESERVED_NAMES:
        raise ValueError(f"invalid suite name {name!r} (reserved: {sorted(RESERVED_NAMES)})")

    def register(fn: SuiteFn) -> SuiteFn:
        existing = REGISTRY.get(name)
        if existing is not None and existing.fn.__qualname__ != fn.__qualname__:
            raise ValueError(f"suite {name!r} is already registered by {existing.fn.__module__}")
        doc = description or (fn.__doc__ or "").strip().split("\n")[0]
        REGISTRY[name] = SuiteSpec(
            name=name,
            fn=fn,
            description=doc,
            needs_peak=needs_peak,
            default=(name not in NOT_BY_DEFAULT) if default is None else default,
            new_shapes=new_shapes,
            check=check,
        )
        return fn

    return register


def load_builtin_suites() -> dict[str, SuiteSpec]:
    for module in BUILTIN_SUITE_MODULES:
        importlib.import_module(module)
    return REGISTRY


def known_suites() -> list[str]:
    return list(load_builtin_suites())


def resolve_suites(names: Sequence[str]) -> list[SuiteSpec]:
    """Names -> specs in run order: ``peak`` first when asked for or needed, no duplicates.

    No names means every default suite.
    """
    registry = load_builtin_suites()
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise UnknownSuiteError(
            f"unknown suite{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"known suites: {', '.join(registry)}"
        )
    chosen = (
        list(dict.fromkeys(names)) if names else [s.name for s in registry.values() if s.default]
    )
    specs = [registry[n] for n in chosen]
    if "peak" in registry and ("peak" in chosen or any(s.needs_peak for s in specs)):
        specs = [registry["peak"], *(s for s in specs if s.name != "peak")]
    return specs


# --------------------------------------------------------------------------- running


def new_run_id(now: datetime | None = None) -> str:
    """``YYYYmmddTHHMMSSZ-xxxxxx``: sortable UTC time plus a random suffix."""
    now = now or datetime.now(UTC)
    return f"{now.strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(3)}"


def default_out_dir(cfg: JaxlabConfig) -> Path:
    if cfg.bench.out_dir:
        return Path(cfg.bench.out_dir)
    return Path(cfg.runtime.artifacts_dir) / "benchmarks"


@dataclass
class BenchRun:
    run_id: str
    run_dir: Path
    suites: list[str]
    records: list[Record] = field(default_factory=list)
    report: ReportResult | None = None

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in self.records)


def _shapes_expected(expected: bool) -> contextlib.AbstractContextManager[None]:
    if not expected:
        return contextlib.nullcontext()
    from jaxlab.runtime.compiled import new_shapes_expected  # imports jax

    return new_shapes_expected()


def _run_one(ctx: BenchContext, name: str) -> list[Record]:
    """Run suite ``name`` inside ``ctx``: write each yielded record, record a crash."""
    spec = REGISTRY[name]
    previous, ctx.suite = ctx.suite, name
    start = len(ctx.records)
    ctx.reporter.suite_started(name)
    try:
        with _shapes_expected(spec.new_shapes):
            for rec in spec.fn(ctx):
                if not isinstance(rec, Record):
                    raise TypeError(
                        f"suite {name!r} yielded {type(rec).__name__}, expected a Record"
                    )
                ctx.emit(rec)
    except Exception as e:
        ctx.suite = name
        ctx.emit(ctx.failure("suite_error", e, case={"stage": "suite"}, unit=""))
    finally:
        ctx.suite = previous
    return ctx.records[start:]


RUN_META_FILENAME = "run.json"
RUN_CONFIG_FILENAME = "config.toml"


def write_run_meta(
    run_dir: Path, run_id: str, suites: Sequence[str], quick: bool, config: JaxlabConfig
) -> None:
    """``run.json`` (how the run was started) and ``config.toml`` (the resolved config,
    secrets left out), so a committed record set says what produced it."""
    import json
    import os
    import shlex
    import sys

    from jaxlab.config import to_toml

    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    prog = "jaxlab" if prog in ("__main__.py", "-m") else prog
    argv = [prog, *sys.argv[1:]] if prog else []
    meta = {
        "run_id": run_id,
        "suites": list(suites),
        "quick": quick,
        "command": shlex.join(argv) if argv else None,
        # Read once per process by XLA, so the same for every record of the run.
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
    }
    (run_dir / RUN_META_FILENAME).write_text(json.dumps(meta, indent=2) + "\n")
    (run_dir / RUN_CONFIG_FILENAME).write_text(to_toml(config))


def run_bench(
    names: Sequence[str],
    *,
    config: JaxlabConfig,
    quick: bool = False,
    out: str | Path | None = None,
    env: Environment | None = None,
    reporter: Reporter | None = None,
    run_id: str | None = None,
    config_hash: str | None = None,
    write_report: bool = True,
    profile: bool = False,
) -> BenchRun:
    """Run ``names`` (all default suites if empty) into ``<out>/<run_id>/``.

    Records are appended as they are measured; the summary, CSV and plots are written at
    the end (also after Ctrl-C, for what was measured). ``profile``: every measured case
    also writes a ``jax.profiler`` trace of one untimed call (:meth:`BenchContext.profile_call`).
    """
    from jaxlab.config import config_hash as hash_config

    specs = resolve_suites(names)
    run_id = run_id or new_run_id()
    run_dir = (Path(out) if out is not None else default_out_dir(config)) / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    write_run_meta(run_dir, run_id, [s.name for s in specs], quick, config)
    ctx = BenchContext(
        config=config,
        quick=quick,
        run_id=run_id,
        run_dir=run_dir,
        env=env or Environment.capture(),
        writer=RecordWriter(run_dir / RECORDS_FILENAME),
        config_hash=config_hash or hash_config(config),
        reporter=reporter or NullReporter(),
        profile=profile,
        _runner=_run_one,
    )
    result = BenchRun(run_id=run_id, run_dir=run_dir, suites=[s.name for s in specs])
    try:
        for spec in specs:
            if spec.name == "peak" and any(r.suite == "peak" for r in ctx.records):
                continue  # already measured on demand by an earlier suite
            if spec.name == "peak":
                ctx._peak_attempted = True
            _run_one(ctx, spec.name)
    finally:
        result.records = list(ctx.records)
        if write_report:
            from jaxlab.bench.report import write_report as write

            result.report = write(run_dir, result.records)
    return result
