"""The gauge sampler against a loopback ``/metrics``, and the timeline plot it feeds."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import RECORDS_FILENAME, Environment, RecordWriter
from jaxlab.bench.timeline import (
    KV_USAGE,
    PAGES_USED,
    PREEMPTIONS,
    RUNNING,
    WAITING,
    GaugeSampler,
    parse_gauges,
    scrape,
    write_timeline_plot,
)
from jaxlab.config import JaxlabConfig
from jaxlab.serve.metrics import ServeMetrics


def test_parse_gauges_reads_unlabelled_samples_only():
    m = ServeMetrics()
    m.running.set(7)
    m.waiting.set(2)
    m.kv_usage.set(0.25)
    m.ttft.observe(0.1)
    got = parse_gauges(m.render().decode(), [RUNNING, WAITING, KV_USAGE, "jaxlab_model_state"])
    assert got == {RUNNING: 7.0, WAITING: 2.0, KV_USAGE: 0.25}


class _MetricsServer:
    """A loopback HTTP server whose ``/metrics`` renders a real :class:`ServeMetrics`, less
    the lines of the metrics named in ``hide`` (a server that predates them)."""

    def __init__(self, hide: tuple[str, ...] = ()) -> None:
        self.metrics = ServeMetrics()
        metrics = self.metrics

        def render() -> bytes:
            lines = metrics.render().decode().splitlines(keepends=True)
            return "".join(x for x in lines if not any(h in x for h in hide)).encode()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                body = render() if self.path == "/metrics" else b""
                self.send_response(200 if body else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_sampler_scrapes_the_gauges_at_a_fixed_interval():
    srv = _MetricsServer(hide=(PAGES_USED,))
    try:
        srv.metrics.running.set(3)
        srv.metrics.kv_usage.set(0.5)
        with GaugeSampler(srv.url, interval_s=0.01) as sampler:
            threading.Event().wait(0.1)
            srv.metrics.running.set(12)
            srv.metrics.kv_usage.set(0.75)
            threading.Event().wait(0.1)
    finally:
        srv.close()
    assert sampler.errors == 0 and len(sampler.t_s) >= 5
    assert sampler.t_s == sorted(sampler.t_s)
    assert sampler.peak(RUNNING) == 12.0 and 3.0 < (sampler.mean(RUNNING) or 0) < 12.0
    series = sampler.timeline(num_pages=64)
    assert series["num_pages"] == 64 and series["interval_s"] == 0.01
    assert set(series["pages_used"]) == {32.0, 48.0}, "no pages gauge: usage ratio x pages"
    assert series["pages_source"] == f"{KV_USAGE} x num_pages"
    assert len(series["t_s"]) == len(series["running"]) == len(series["waiting"])
    json.dumps(series)  # a record's derived value
    assert set(sampler.timeline(num_pages=None)["pages_used"]) == {None}


def test_sampler_prefers_the_pages_gauge_and_reads_counter_growth():
    srv = _MetricsServer()
    try:
        srv.metrics.pages_used.set(10)
        srv.metrics.kv_usage.set(0.5)
        with GaugeSampler(srv.url, interval_s=0.01) as sampler:
            threading.Event().wait(0.05)
            srv.metrics.preemptions.inc(3)
            srv.metrics.pages_used.set(20)
            threading.Event().wait(0.05)
    finally:
        srv.close()
    assert set(sampler.pages_used(num_pages=64)) == {10.0, 20.0}
    assert sampler.timeline(64)["pages_source"] == PAGES_USED
    assert sampler.growth(PREEMPTIONS) == 3.0
    assert sampler.growth("jaxlab_absent") is None


def test_sampler_counts_failed_scrapes_and_keeps_going():
    srv = _MetricsServer()
    url = srv.url
    srv.close()
    with GaugeSampler(url, interval_s=0.01) as sampler:
        threading.Event().wait(0.05)
    assert sampler.errors == len(sampler.t_s) >= 2
    assert sampler.peak(RUNNING) is None


def test_timeline_plot_is_drawn_or_says_why_not(tmp_path):
    pytest.importorskip("matplotlib")
    series = {
        "interval_s": 0.05,
        "t_s": [0.0, 0.05, 0.1],
        "running": [0, 40, 64],
        "waiting": [64, 24, 0],
        "num_pages": 256,
        "pages_used": [0, 180, None],
    }
    path = tmp_path / "plots" / "t.png"
    assert write_timeline_plot(series, path, "t") is None
    assert path.stat().st_size > 0
    assert write_timeline_plot({**series, "t_s": []}, path, "t") == (
        "timeline plot skipped: no samples"
    )


def test_the_report_draws_the_timeline_a_record_carries(tmp_path):
    pytest.importorskip("matplotlib")
    from jaxlab.bench.report import write_report

    ctx = BenchContext(
        config=JaxlabConfig(),
        quick=True,
        run_id="run-1",
        run_dir=tmp_path,
        env=Environment(devices={"platform": "cpu", "kind": "cpu", "count": 1}),
        writer=RecordWriter(tmp_path / RECORDS_FILENAME),
    )
    ctx.suite = "serve"
    series = {"interval_s": 0.05, "t_s": [0.0, 0.05], "running": [1, 2], "waiting": [0, 0]}
    rec = ctx.record("pages_in_use", "pages", [3.0, 4.0], case={}, derived={"timeline": series})
    ctx.writer.write(rec)
    result = write_report(tmp_path)
    assert tmp_path / "plots" / "serve-timeline.png" in result.plots


def test_scrape_reads_once_and_raises_when_nobody_answers():
    srv = _MetricsServer()
    try:
        srv.metrics.preemptions.inc(2)
        assert scrape(srv.url, [PREEMPTIONS, RUNNING]) == {PREEMPTIONS: 2.0, RUNNING: 0.0}
    finally:
        srv.close()
    with pytest.raises(OSError):
        scrape(srv.url)
