"""A server's gauges over time: a thread that scrapes ``/metrics`` at a fixed interval, the
series it keeps, and the plot of pages in use and the running batch.

:class:`GaugeSampler` reads a server the way an operator's scraper does, over HTTP, so it
works for any server that exports the gauges; it keeps only unlabelled gauge samples.
A sample costs the server one ``/metrics`` render: a few hundred microseconds every
``interval_s``, the same for every server a case compares. The plot
(:func:`write_timeline_plot`) follows :func:`jaxlab.reproduce.report.write_loss_curve`:
matplotlib's Agg renderer, and one line saying why not when matplotlib is missing. It is
drawn by the report (:func:`jaxlab.bench.report.write_plots`) from the series a record
carries in ``derived["timeline"]``, so ``jaxlab bench report`` can draw it again.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

RUNNING = "jaxlab_num_requests_running"
WAITING = "jaxlab_num_requests_waiting"
PAGES_USED = "jaxlab_kv_cache_pages_used"
PAGES_TOTAL = "jaxlab_kv_cache_pages_total"
KV_USAGE = "jaxlab_kv_cache_usage_ratio"
#: A counter, read like a gauge: its growth over a run is the run's preemptions.
PREEMPTIONS = "jaxlab_num_preemptions_total"
GAUGES = (RUNNING, WAITING, PAGES_USED, PAGES_TOTAL, KV_USAGE, PREEMPTIONS)


def timeline_plot_path(suite: str) -> str:
    """Where the report draws a suite's timeline, relative to the run directory."""
    return f"plots/{suite}-timeline.png"


TIMELINE_MISSING = (
    "timeline plot skipped: matplotlib is not installed (pip install 'jaxlab[plots]'); "
    "the series is in the record's derived['timeline']"
)


def parse_gauges(text: str, names: Sequence[str]) -> dict[str, float]:
    """The values of the unlabelled samples ``names`` in Prometheus text ``text``."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(" ")
        if name in wanted:
            try:
                out[name] = float(rest.split()[0])
            except (IndexError, ValueError):
                continue
    return out


def _get_metrics(
    conn: http.client.HTTPConnection, path: str, names: Sequence[str]
) -> dict[str, float]:
    conn.request("GET", path)
    resp = conn.getresponse()
    body = resp.read().decode()
    if resp.status != 200:
        raise OSError(f"GET {path}: {resp.status}")
    return parse_gauges(body, names)


def _endpoint(url: str) -> tuple[str, int, str]:
    """(host, port, path of /metrics) of a server's base ``url``."""
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80, parts.path.rstrip("/") + "/metrics"


def scrape(url: str, names: Sequence[str] = GAUGES) -> dict[str, float]:
    """One read of ``<url>/metrics``: the values of ``names`` it has. Raises OSError."""
    host, port, path = _endpoint(url)
    conn = http.client.HTTPConnection(host, port, timeout=5.0)
    try:
        return _get_metrics(conn, path, names)
    except http.client.HTTPException as e:
        raise OSError(f"GET {path}: {e}") from None
    finally:
        conn.close()


class GaugeSampler:
    """Scrape ``<url>/metrics`` every ``interval_s`` seconds on a thread, between
    :meth:`start` and :meth:`stop` (or as a context manager).

    ``t_s[i]`` is the time of sample ``i`` in seconds since :meth:`start`; ``values[name][i]``
    its value (NaN when that scrape failed or lacked the gauge; ``errors`` counts failed
    scrapes). A counter is read by its exported name (``..._total``). Samples are due at fixed times ``i * interval_s``; a late scrape does not
    shift the ones after it.
    """

    def __init__(
        self, url: str, names: Sequence[str] = GAUGES, *, interval_s: float = 0.05
    ) -> None:
        self._host, self._port, self._path = _endpoint(url)
        self.names = tuple(names)
        self.interval_s = interval_s
        self.t_s: list[float] = []
        self.values: dict[str, list[float]] = {n: [] for n in self.names}
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=5.0)
        t0 = time.perf_counter()
        i = 0
        try:
            while not self._stop.is_set():
                t = time.perf_counter() - t0
                try:
                    got = _get_metrics(conn, self._path, self.names)
                except (OSError, http.client.HTTPException):
                    self.errors += 1
                    got = {}
                    conn.close()  # reconnects on the next request
                self.t_s.append(t)
                for n in self.names:
                    self.values[n].append(got.get(n, float("nan")))
                i += 1
                self._stop.wait(max(0.0, t0 + i * self.interval_s - time.perf_counter()))
        finally:
            conn.close()

    def start(self) -> GaugeSampler:
        self._thread = threading.Thread(target=self._run, name="jaxlab-gauges", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)

    def __enter__(self) -> GaugeSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def peak(self, name: str) -> float | None:
        """The largest value of ``name`` seen (None: never read)."""
        seen = [v for v in self.values.get(name, []) if v == v]
        return max(seen) if seen else None

    def mean(self, name: str) -> float | None:
        """The mean over the samples (they are evenly spaced, so a time average)."""
        seen = [v for v in self.values.get(name, []) if v == v]
        return sum(seen) / len(seen) if seen else None

    def growth(self, name: str) -> float | None:
        """Last minus first value read of ``name`` (a counter's increase over the run)."""
        seen = [v for v in self.values.get(name, []) if v == v]
        return seen[-1] - seen[0] if seen else None

    def pages_used(self, num_pages: int | None = None) -> list[float | None]:
        """Pages in use per sample: the pages-used gauge, or for a server without one the
        cache-usage ratio times ``num_pages`` (all None without either)."""
        if any(v == v for v in self.values.get(PAGES_USED, [])):
            return self._col(PAGES_USED)
        if num_pages is None:
            return [None] * len(self.t_s)
        return self._col(KV_USAGE, float(num_pages))

    def _col(self, name: str, scale: float = 1.0) -> list[float | None]:
        return [None if v != v else round(v * scale) for v in self.values.get(name, [])]

    def timeline(self, num_pages: int | None) -> dict[str, Any]:
        """The series as a record's ``derived["timeline"]``: times, the running batch, the
        waiting queue and pages in use (:meth:`pages_used`) out of ``num_pages``."""
        has_gauge = any(v == v for v in self.values.get(PAGES_USED, []))
        return {
            "interval_s": self.interval_s,
            "t_s": [round(t, 4) for t in self.t_s],
            "running": self._col(RUNNING),
            "waiting": self._col(WAITING),
            "pages_used": self.pages_used(num_pages),
            "pages_source": PAGES_USED if has_gauge else f"{KV_USAGE} x num_pages",
            "num_pages": num_pages,
            "scrape_errors": self.errors,
        }


def write_timeline_plot(timeline: Mapping[str, Any], path: Path, title: str) -> str | None:
    """Draw pages in use (top) and the running batch (bottom) against time to ``path``;
    None when drawn, else why not (one line)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return TIMELINE_MISSING
    t = list(timeline.get("t_s") or [])
    if not t:
        return "timeline plot skipped: no samples"
    try:
        fig = Figure(figsize=(8, 5), layout="constrained")
        top, bottom = fig.subplots(2, 1, sharex=True)
        pages = timeline.get("pages_used")
        if pages is not None and any(p is not None for p in pages):
            top.plot(t, _nan(pages), color="#4C72B0", label="pages in use", drawstyle="steps-post")
            if timeline.get("num_pages"):
                top.axhline(timeline["num_pages"], color="#C44E52", ls="--", label="pool")
            top.set_ylabel("KV pages")
            top.legend(loc="lower right", fontsize=8)
        else:
            top.text(
                0.5, 0.5, "no pool size: pages not shown", ha="center", transform=top.transAxes
            )
        steps = {"drawstyle": "steps-post"}  # a gauge holds its value until the next scrape
        bottom.plot(t, _nan(timeline["running"]), color="#55A868", label="running", **steps)
        bottom.plot(
            t, _nan(timeline["waiting"]), color="#8172B2", label="waiting", alpha=0.7, **steps
        )
        bottom.set_ylabel("requests")
        bottom.set_xlabel(f"seconds (a /metrics scrape every {timeline['interval_s']:g} s)")
        bottom.legend(loc="upper right", fontsize=8)
        top.set_title(title, fontsize=8)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    except Exception as e:  # a plot must never fail the report
        return f"timeline plot failed: {type(e).__name__}: {e}"
    return None


def _nan(values: Sequence[float | None]) -> list[float]:
    return [float("nan") if v is None else float(v) for v in values]


__all__ = [
    "GAUGES",
    "KV_USAGE",
    "PAGES_TOTAL",
    "PAGES_USED",
    "PREEMPTIONS",
    "RUNNING",
    "TIMELINE_MISSING",
    "WAITING",
    "GaugeSampler",
    "parse_gauges",
    "scrape",
    "timeline_plot_path",
    "write_timeline_plot",
]
