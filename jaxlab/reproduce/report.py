"""``report.md`` of a reproduction: the stage table, the loss curve, the benchmark plots.

The loss curve is drawn from the run's ``metrics.jsonl`` (train loss per logged step, eval
loss where it was measured) with matplotlib's Agg renderer, like the benchmark plots
(:mod:`jaxlab.bench.report`). matplotlib is the ``plots`` extra; without it the report
says so in one line and keeps everything else. Nothing here runs a stage.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

LOSS_CURVE = "loss.png"
LOSS_CURVE_MISSING = "loss curve skipped: matplotlib is not installed (pip install 'jaxlab[plots]')"


def loss_points(metrics: Iterable[Mapping[str, Any]]) -> tuple[dict[int, float], dict[int, float]]:
    """(train, eval): step -> loss; a step logged again (after a resume) supersedes."""
    train: dict[int, float] = {}
    evals: dict[int, float] = {}
    for r in metrics:
        if r.get("event") == "step":
            train[int(r["step"])] = float(r["loss"])
        elif r.get("event") == "eval" and "loss" in r:
            evals[int(r["step"])] = float(r["loss"])
    return dict(sorted(train.items())), dict(sorted(evals.items()))


def write_loss_curve(
    metrics: Iterable[Mapping[str, Any]], path: Path, title: str = "loss"
) -> str | None:
    """Draw the loss curve to ``path``; None when drawn, else why not (one line)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return LOSS_CURVE_MISSING
    train, evals = loss_points(metrics)
    if not train:
        return "loss curve skipped: the run logged no step"
    try:
        fig = Figure(figsize=(7, 3.5), layout="constrained")
        ax = fig.subplots()
        ax.plot(list(train), list(train.values()), color="#4C72B0", label="train loss")
        if evals:
            ax.plot(list(evals), list(evals.values()), "o", color="#C44E52", label="eval loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats / token)")
        ax.set_title(title, fontsize=10)
        ax.legend()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    except Exception as e:  # a plot must never fail the report
        return f"loss curve failed: {type(e).__name__}: {e}"
    return None


def _rel(path: str | Path, root: Path) -> str:
    return os.path.relpath(path, root)


def render(doc: Mapping[str, Any], out: Path, *, loss_note: str | None) -> str:
    """The markdown of ``report.md`` in ``out`` from ``Reproduction.to_json()``; every link
    is relative to ``out`` so the directory can move."""
    stages = {s["name"]: s for s in doc["stages"]}
    lines = [
        "# jaxlab reproduce",
        "",
        f"Result: **{'PASS' if doc['ok'] else 'FAIL'}** in {doc['total_s']:.1f} s "
        f"({'quick' if doc['quick'] else 'full'}). Output: `{out}`.",
        "",
        "| stage | status | seconds | what was checked | evidence |",
        "|---|---|---|---|---|",
    ]
    for s in doc["stages"]:
        what = s["summary"] or ""
        if s["error"]:
            what = f"{what} ERROR: {s['error']}".strip()
        ev = "<br>".join(f"`{e}`" for e in s["evidence"])
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.1f} | {what} | {ev} |")

    train = stages.get("train")
    if train is not None and train["status"] == "pass":
        lines += ["", "## Loss curve", ""]
        if loss_note is None:
            lines.append(f"![train and eval loss per step]({LOSS_CURVE})")
        else:
            lines.append(loss_note)

    bench = stages.get("bench")
    if bench is not None and bench["status"] == "pass":
        details = bench.get("details") or {}
        lines += ["", "## Benchmarks", ""]
        summary = details.get("summary")
        if summary:
            lines.append(f"Summary: [{Path(summary).name}]({_rel(summary, out)}).")
        plots = details.get("plots") or []
        if plots:
            lines += ["", "Plots:", ""]
            lines += [f"- [{Path(p).stem}]({_rel(p, out)})" for p in plots]
        for note in details.get("notes") or []:
            lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"
