"""``jaxlab reproduce``: the whole system, end to end, with evidence left behind.

Stages (each timed, each a pass/fail with evidence paths)::

    devices -> configs -> train -> restore -> resume -> eval -> generate -> bench -> serve

Every check compares real artefacts: the restored checkpoint against the trainer's live
state, a resumed run against an uninterrupted one (bitwise), cached generation against
the naive full-prefix path, and a real server on an ephemeral port against its metrics.
A stage that raises is a failure; later stages that need its output are skipped.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from jaxlab.bench.report import SUMMARY_MD
from jaxlab.config import JaxlabConfig, load_config, preset_names, validate_file
from jaxlab.reproduce.report import LOSS_CURVE, render, write_loss_curve

STAGES = ("devices", "configs", "train", "restore", "resume", "eval", "generate", "bench", "serve")


class StageFailed(Exception):
    """A check inside a stage did not hold."""


@dataclass
class StageResult:
    name: str
    status: str = "pending"  # pending | running | pass | fail | skip
    seconds: float = 0.0
    summary: str = ""
    evidence: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class ReproduceObserver(Protocol):
    """Told about every stage change (the CLI's live table)."""

    def on_stage(self, result: StageResult) -> None:
        return None


class _Silent(ReproduceObserver):
    pass


@dataclass
class Reproduction:
    out_dir: Path
    quick: bool
    results: dict[str, StageResult]
    started: float
    finished: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.status == "pass" for r in self.results.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "out_dir": str(self.out_dir),
            "quick": self.quick,
            "total_s": self.finished - self.started,
            "stages": [
                {
                    "name": r.name,
                    "status": r.status,
                    "seconds": round(r.seconds, 3),
                    "summary": r.summary,
                    "evidence": r.evidence,
                    "details": r.details,
                    "error": r.error,
                }
                for r in self.results.values()
            ],
        }


def _base_config(out: Path, quick: bool) -> JaxlabConfig:
    steps = 40 if quick else 80
    return load_config(
        "tiny",
        [
            f"runtime.artifacts_dir={out / 'artifacts'}",
            f"train.steps={steps}",
            "train.log_every_steps=5",
            f"checkpoint.every_steps={steps // 2}",
            "data.synthetic_docs=1500",
            "tokenizer.train_bytes=200000",
        ],
        environ={},
    )


class Chain:
    def __init__(self, out_dir: Path, *, quick: bool, observer: ReproduceObserver | None = None):
        self.out = out_dir
        self.quick = quick
        self.observer: ReproduceObserver = observer or _Silent()
        self.cfg = _base_config(out_dir, quick)
        self.results = {name: StageResult(name) for name in STAGES}
        self.ctx: dict[str, Any] = {}
        #: What the report could not show (plots skipped), one line each, for the CLI.
        self.report_notes: list[str] = []

    # ------------------------------------------------------------------ driver

    def run(self) -> Reproduction:
        rep = Reproduction(self.out, self.quick, self.results, time.perf_counter())
        needs = {
            "restore": "train",
            "resume": "train",
            "eval": "train",
            "generate": "train",
            "serve": "train",
        }
        for name in STAGES:
            r = self.results[name]
            dep = needs.get(name)
            if dep and self.results[dep].status != "pass":
                r.status, r.summary = "skip", f"needs stage '{dep}'"
                self.observer.on_stage(r)
                continue
            r.status = "running"
            self.observer.on_stage(r)
            t0 = time.perf_counter()
            try:
                fn: Callable[[StageResult], None] = getattr(self, f"stage_{name}")
                fn(r)
                r.status = "pass"
            except Exception as e:
                r.status = "fail"
                r.error = f"{type(e).__name__}: {e}"
                r.details["traceback"] = traceback.format_exc(limit=6)
            r.seconds = time.perf_counter() - t0
            self.observer.on_stage(r)
        rep.finished = time.perf_counter()
        self.write_report(rep)
        return rep

    # ------------------------------------------------------------------ stages

    def stage_devices(self, r: StageResult) -> None:
        from jaxlab.runtime import device_inventory

        inv = device_inventory()
        path = self.out / "devices.json"
        path.write_text(json.dumps(inv, indent=2))
        r.summary = f"{inv['device_count']} x {inv['platform']} ({inv['cpu_cores']} CPU cores)"
        r.evidence.append(str(path))
        r.details = {"platform": inv["platform"], "device_count": inv["device_count"]}

    def stage_configs(self, r: StageResult) -> None:
        from jaxlab.config import preset_path

        targets = [str(preset_path(n)) for n in preset_names()]
        examples = Path(__file__).resolve().parents[2] / "examples"
        if examples.is_dir():
            targets += [str(p) for p in sorted(examples.rglob("*.toml"))]
        problems = {t: validate_file(t) for t in targets}
        bad = {t: p for t, p in problems.items() if p}
        if bad:
            raise StageFailed("; ".join(i for issues in bad.values() for i in issues))
        r.summary = f"{len(targets)} configs valid"
        r.details = {"validated": targets}

    def stage_train(self, r: StageResult) -> None:
        from jaxlab.train.trainer import Trainer

        run = self.out / "run"
        trainer = Trainer(self.cfg, run)
        summary = trainer.run()
        trainer.close()
        hist = trainer.run_dir.loss_history()
        first, last = hist[min(hist)], hist[max(hist)]
        if not last < first:
            raise StageFailed(f"loss did not fall ({first:.3f} -> {last:.3f})")
        if summary.skipped_steps:
            raise StageFailed(f"{summary.skipped_steps} non-finite steps")
        self.ctx["trainer"] = trainer
        r.summary = (
            f"{summary.steps} steps, loss {first:.3f} -> {last:.3f}, "
            f"{(summary.tokens_per_s or 0):,.0f} tok/s, compile {summary.compile_s:.1f}s"
        )
        r.evidence += [
            str(run / "metrics.jsonl"),
            str(run / "manifest.json"),
            str(run / "checkpoints"),
        ]
        r.details = summary.to_json()

    def stage_restore(self, r: StageResult) -> None:
        import jax
        import numpy as np

        from jaxlab.train.trainer import Trainer

        live = self.ctx["trainer"]
        fresh = Trainer(self.cfg, live.run_dir.path)
        step = fresh.restore("latest")
        fresh.close()
        same = all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(live.state), jax.tree.leaves(fresh.state), strict=True)
        )
        if step != live.step or not same:
            raise StageFailed(f"restored step {step} differs from the saved state")
        r.summary = f"step {step}: params, optimizer state, step and key restore bitwise"
        r.evidence.append(str(live.run_dir.checkpoint_dir / str(step)))

    def stage_resume(self, r: StageResult) -> None:
        import jax
        import numpy as np

        from jaxlab.train.trainer import Trainer

        cfg = self.cfg
        total = cfg.train.steps // 2
        half = total // 2
        a = Trainer(cfg, self.out / "resume-uninterrupted")
        a.run(stop_at=total)
        a.close()
        b = Trainer(cfg, self.out / "resume-interrupted")
        b.run(stop_at=half)
        b.close()
        b2 = Trainer(cfg, self.out / "resume-interrupted")
        b2.restore("latest")
        b2.run(stop_at=total)
        b2.close()
        same = all(
            np.array_equal(np.asarray(x), np.asarray(y))
            for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b2.state), strict=True)
        )
        losses_same = a.run_dir.loss_history() == b2.run_dir.loss_history()
        if not (same and losses_same):
            raise StageFailed("the resumed run differs from the uninterrupted one")
        r.summary = (
            f"train {total} == train {half}, stop, resume to {total} (bitwise, loss history equal)"
        )
        r.evidence += [str(self.out / "resume-uninterrupted"), str(self.out / "resume-interrupted")]

    def stage_eval(self, r: StageResult) -> None:
        ev = self.ctx["trainer"].evaluate()
        if not (ev["tokens"] > 0 and np_isfinite(ev["loss"])):
            raise StageFailed(f"bad eval result {ev}")
        r.summary = (
            f"loss {ev['loss']:.3f}, perplexity {ev['perplexity']:.2f}, accuracy "
            f"{ev['accuracy']:.3f} over {int(ev['tokens'])} real tokens"
        )
        r.details = ev

    def stage_generate(self, r: StageResult) -> None:
        from jaxlab.infer import Engine, Request, SamplingParams, load_run, offline

        run = load_run(self.out / "run")
        engine = Engine(run.graphdef, run.params, run.cfg)
        limits = engine.limits(run.tokenizer.eot_id)
        prompts = ["count: 3 4 5", "the cat sat on", "12+7="]
        sp = SamplingParams(max_new_tokens=24, temperature=0.0)
        reqs = [Request.create(run.tokenizer.encode(p), sp, limits) for p in prompts]
        cached = offline.generate(engine, reqs, kv_cache=True, tokenizer=run.tokenizer)
        naive = offline.generate(engine, reqs, kv_cache=False)
        mismatch = [
            p for p, a, b in zip(prompts, cached, naive, strict=True) if a.token_ids != b.token_ids
        ]
        if mismatch:
            raise StageFailed(f"cached != naive for {mismatch}")
        samples = {p: res.text for p, res in zip(prompts, cached, strict=True)}
        path = self.out / "generations.json"
        path.write_text(json.dumps(samples, indent=2))
        r.summary = f"{len(prompts)} prompts: cached == naive (greedy), compiles {engine.compiles}"
        r.evidence.append(str(path))
        r.details = {"samples": samples, "compiles": engine.compiles}

    def stage_bench(self, r: StageResult) -> None:
        from jaxlab.bench.suites import run_bench

        suites = ["peak", "train", "decode", "kv-cache"]
        run = run_bench(suites, config=self.cfg, quick=True, out=self.out / "benchmarks")
        failed = [rec for rec in run.records if rec.status != "ok"]
        if failed:
            raise StageFailed(f"{len(failed)} benchmark records failed: {failed[0].error}")
        r.summary = f"{len(run.records)} records ({', '.join(suites)}), none failed"
        r.evidence.append(str(run.run_dir))
        report = run.report
        r.details = {
            "run_dir": str(run.run_dir),
            "records": len(run.records),
            "summary": str(run.run_dir / SUMMARY_MD),
            "plots": [str(p) for p in report.plots] if report else [],
            "notes": list(report.notes) if report else [],
        }

    def stage_serve(self, r: StageResult) -> None:
        from jaxlab.reproduce.serve_smoke import serve_smoke

        details = serve_smoke(self.out / "run", self.cfg, requests=8 if self.quick else 16)
        r.summary = details.pop("summary")
        r.details = details
        path = self.out / "serve_metrics.txt"
        path.write_text(details.pop("metrics_text"))
        r.evidence.append(str(path))

    # ------------------------------------------------------------------ report

    def write_report(self, rep: Reproduction) -> None:
        """``report.json``, and ``report.md`` with the loss curve and the benchmark plots."""
        from jaxlab.train.run_dir import RunDir

        loss_note = None
        if self.results["train"].status == "pass":
            loss_note = write_loss_curve(
                RunDir(self.out / "run").read_metrics(),
                self.out / LOSS_CURVE,
                title=f"train stage: preset tiny, {self.cfg.train.steps} steps",
            )
            if loss_note is None:
                self.results["train"].evidence.append(str(self.out / LOSS_CURVE))
        doc = rep.to_json()
        (self.out / "report.json").write_text(json.dumps(doc, indent=2, default=str))
        (self.out / "report.md").write_text(render(doc, self.out, loss_note=loss_note))
        bench_notes = self.results["bench"].details.get("notes") or []
        self.report_notes = [n for n in (loss_note, *bench_notes) if n]


def np_isfinite(x: float) -> bool:
    import math

    return math.isfinite(x)
