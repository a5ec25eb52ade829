"""The peer session: real peer processes speaking the real protocol, alternating with us.

CI has no torch (far too big a test dependency), so these run a stand-in peer: a script
whose cases sleep, count, fail or die, served by the same ``protocol.serve`` the Hugging
Face peer uses. The Hugging Face peer itself runs in the last test, when
``PEER_PYTHON_FOR_TESTS`` names a Python that has torch and transformers (not a
``JAXLAB_*`` name: those are config variables, and an unknown one is a config error).
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxlab.bench.context import BenchContext
from jaxlab.bench.peer_session import PeerError, PeerSession
from jaxlab.bench.peer_suite import (
    READS_PER_SAMPLE,
    PeerTurns,
    _read_ceiling,
    peer_script,
    read_ceiling,
)
from jaxlab.bench.record import RECORDS_FILENAME, Environment, RecordWriter
from jaxlab.bench.timing import measure
from jaxlab.config import JaxlabConfig

PROTOCOL_DIR = Path(peer_script()).parent

STAND_IN = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {protocol_dir!r})
    from protocol import serve

    def prepare(spec):
        print("chatter a library might print")  # must not reach the protocol stream
        task = spec["task"]
        if task == "fail":
            raise ValueError("no such model: " + spec["model"])
        if task == "read":  # the suite's read case: a repetition of known length
            spec["s"] = 0.2
        log = spec.get("log")

        def run():
            if task == "die":
                sys.stderr.write("peer fell over\\n")
                sys.stderr.flush()
                os._exit(3)
            if log:
                with open(log, "a") as f:
                    f.write("peer\\n")
            time.sleep(spec.get("s", 0.0))

        return run, {{"task": task}}

    serve(prepare)
    """
)


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    script = tmp_path / "stand_in_peer.py"
    script.write_text(STAND_IN.format(protocol_dir=str(PROTOCOL_DIR)))
    return script


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_prepare_runs_the_warm_up_then_time_runs_one_repetition(stand_in, tmp_path):
    log = tmp_path / "log"
    with PeerSession(sys.executable, stand_in) as peer:
        info = peer.prepare("a", {"task": "sleep", "s": 0.02, "warmup": 2, "log": str(log)})
        assert info == {"task": "sleep"}, "stdout chatter went to stderr, not into the answer"
        assert lines(log) == ["peer"] * 2, "warm-up calls run at prepare"
        samples = [peer.time("a") for _ in range(3)]
        assert lines(log) == ["peer"] * 5
        warmed = peer.time("a", warm=2)
    assert lines(log) == ["peer"] * 8, "two untimed calls, then the timed one"
    assert 0.02 <= warmed < 1.0, "only the last call is timed"
    assert all(0.02 <= s < 1.0 for s in samples), samples


def test_errors_name_the_case_and_the_session_survives_them(stand_in):
    with PeerSession(sys.executable, stand_in) as peer:
        with pytest.raises(PeerError, match=r"time 'missing'.*prepare it first"):
            peer.time("missing")
        with pytest.raises(PeerError, match=r"prepare 'b': ValueError: no such model: gpt-9"):
            peer.prepare("b", {"task": "fail", "model": "gpt-9"})
        peer.prepare("c", {"task": "sleep", "warmup": 0})
        assert peer.time("c") >= 0.0
        peer.drop("c")
        with pytest.raises(PeerError, match="prepare it first"):
            peer.time("c")


def test_a_peer_that_dies_is_a_clear_error_with_its_stderr(stand_in):
    with PeerSession(sys.executable, stand_in) as peer:
        peer.prepare("d", {"task": "die", "warmup": 0})
        with pytest.raises(PeerError, match=r"(?s)exited with code 3; stderr: .*peer fell over"):
            peer.time("d")


def test_a_peer_that_stops_answering_is_killed_after_the_timeout(stand_in):
    with PeerSession(sys.executable, stand_in, timeout_s=0.5) as peer:
        peer.prepare("slow", {"task": "sleep", "s": 30, "warmup": 0})
        t0 = time.perf_counter()
        with pytest.raises(PeerError, match=r"no answer in 0 s \(killed\)|no answer in 1 s"):
            peer.time("slow")
        assert time.perf_counter() - t0 < 10


def test_turns_alternate_with_our_samples_and_pair_only_the_timed_ones(stand_in, tmp_path):
    log = tmp_path / "log"
    with PeerSession(sys.executable, stand_in) as peer:
        peer.prepare("p", {"task": "sleep", "warmup": 0, "log": str(log)})
        turns = PeerTurns(peer, "p", sleep=lambda s: None)

        def ours() -> None:
            with open(log, "a") as f:
                f.write("ours\n")

        samples = measure(ours, warmup=2, repeats=3, sync=lambda x: x, before=turns)
    assert lines(log) == ["peer", "ours"] * 5, "one peer repetition ahead of each of ours"
    assert turns.error is None and len(turns.samples) == 5

    assert len(samples.times_s) == 3
    assert turns.paired(3) == turns.samples[2:], "the last three: beside our timed calls"
    assert turns.paired(0) == []


def test_both_sides_warm_right_before_their_timed_calls(stand_in, tmp_path):
    """After the other side's turn, each side's timed call follows one of its own."""
    log = tmp_path / "log"
    with PeerSession(sys.executable, stand_in) as peer:
        peer.prepare("w", {"task": "sleep", "warmup": 0, "log": str(log)})
        turns = PeerTurns(peer, "w", warm=1, sleep=lambda s: None)

        def ours() -> None:
            with open(log, "a") as f:
                f.write("ours\n")

        measure(ours, warmup=1, repeats=2, sync=lambda x: x, before=turns, warm_each=1)
    per_round = ["peer", "peer", "ours", "ours"]
    assert lines(log) == ["peer", "peer", "ours"] + per_round * 2
    assert len(turns.samples) == 3, "one timed peer sample per turn"


def test_a_failing_peer_ends_its_turns_but_not_ours(stand_in):
    with PeerSession(sys.executable, stand_in) as peer:
        peer.prepare("d", {"task": "die", "warmup": 0})
        turns = PeerTurns(peer, "d", sleep=lambda s: None)
        calls = []
        samples = measure(
            lambda: calls.append(1), warmup=0, repeats=3, sync=lambda x: x, before=turns
        )
    assert samples.ok and len(calls) == 3
    assert turns.samples == [] and "exited with code 3" in (turns.error or "")


def test_read_ceiling_is_one_read_of_the_weights_per_token():
    out = read_ceiling(
        read_s=0.5e-3, weight_bytes=20_000_000, peer_tokens_per_s=400.0, jaxlab_tokens_per_s=1000.0
    )
    assert out["ceiling_tokens_per_s"] == pytest.approx(2000.0)
    assert out["ceiling_over_peer"] == pytest.approx(5.0)
    assert out["read_gb_per_s"] == pytest.approx(40.0)
    assert out["jaxlab_share_of_ceiling"] == pytest.approx(0.5)


def _context(tmp_path: Path, repeats: int) -> BenchContext:
    cfg = JaxlabConfig()
    cfg.bench.repeats = repeats
    env = Environment(
        versions={"jax": "test"},
        devices={"platform": "cpu", "kind": "cpu", "count": 1},
        cpu={"model": "test cpu", "cores": 2},
    )
    writer = RecordWriter(tmp_path / RECORDS_FILENAME)
    return BenchContext(cfg, False, "r", tmp_path, env, writer, suite="peer")


def test_the_read_case_records_seconds_per_read_and_the_batch_1_ceiling(stand_in, tmp_path):
    """The peer times ``READS_PER_SAMPLE`` reads a repetition; the record keeps seconds per
    read, and the ceiling divides by the peer's batch-1 record beside it. The stand-in's
    repetition sleeps 0.2 s, so a sample that was not divided would show."""
    ctx = _context(tmp_path, repeats=3)
    ours = ctx.record("generate_s", "s", [0.1], case={}, derived={"tokens_per_s": 1000.0})
    theirs = ctx.record("generate_s", "s", [0.3], case={}, derived={"tokens_per_s": 400.0})
    with PeerSession(sys.executable, stand_in) as peer:
        read, ceiling = _read_ceiling(ctx, peer, 8_000_000, ours, theirs)
    assert read.metric == "weights_read_s" and read.status == "ok"
    per_sample = 0.2 / READS_PER_SAMPLE
    assert len(read.samples) == 3
    assert all(per_sample <= s < 1.5 * per_sample for s in read.samples)
    assert read.case == {"bytes": 8_000_000, "read": "torch.sum, peer process"}
    per_read = read.stats.median
    assert per_read is not None
    assert read.derived["read_gb_per_s"] == pytest.approx(8e6 / per_read / 1e9)
    assert ceiling.metric == "generate_ceiling_vs_peer" and ceiling.case["batch"] == 1
    assert ceiling.stats.median == pytest.approx(1 / per_read / 400.0)
    assert ceiling.derived["jaxlab_share_of_ceiling"] == pytest.approx(1000.0 * per_read)


def test_no_ceiling_without_an_ok_peer_record_and_a_failed_read_is_kept(stand_in, tmp_path):
    ctx = _context(tmp_path, repeats=2)
    ours = ctx.record("generate_s", "s", [0.1], case={}, derived={"tokens_per_s": 1000.0})
    failed = ctx.failure("generate_s", "peer fell over", case={})
    with PeerSession(sys.executable, stand_in) as peer:
        assert [r.metric for r in _read_ceiling(ctx, peer, 1000, ours, failed)] == [
            "weights_read_s"
        ]
    with PeerSession(sys.executable, stand_in) as peer:
        peer.prepare("x", {"task": "die", "warmup": 0})
        with pytest.raises(PeerError):
            peer.time("x")
        (rec,) = _read_ceiling(ctx, peer, 1000, ours, ours)
    assert rec.status != "ok" and rec.metric == "weights_read_s"


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("PEER_PYTHON_FOR_TESTS"),
    reason="set PEER_PYTHON_FOR_TESTS to a Python with torch and transformers",
)
def test_the_peer_suite_interleaves_with_the_real_hugging_face_peer(tmp_path):
    from conftest import run_cli

    from jaxlab.bench.record import load_records

    python = os.environ["PEER_PYTHON_FOR_TESTS"]
    sets = ["--set", f"bench.peer_python={python}", "--set", "bench.repeats=2"]
    r = run_cli("bench", "peer", "--quick", *sets, "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    (run_dir,) = list(tmp_path.iterdir())
    peer = [rec for rec in load_records(run_dir) if rec.suite == "peer"]
    assert all(rec.status == "ok" for rec in peer), [rec.error for rec in peer]
    theirs = [rec for rec in peer if "side" in rec.case]
    assert len(theirs) == 6 and all(len(rec.samples) == 2 for rec in theirs)
    interleaved = [rec.derived["interleaved"] for rec in theirs]
    assert interleaved == [True, True, True, False, True, True], "all but naive batch 1"
    warm = [rec.derived["warm_each"] for rec in theirs]
    assert warm == [1, 1, 1, 0, 0, 1], "each side re-warms before a timed call, but not naive"
    ratios = [rec for rec in peer if rec.metric.endswith("_speedup_vs_peer")]
    assert len(ratios) == 4
    for rec in ratios:
        assert rec.derived["interleaved"] is True and len(rec.derived["pair_ratios"]) == 2
    (int8,) = [rec for rec in ratios if rec.case.get("weights") == "int8"]
    assert int8.case["batch"] == 1 and int8.derived["label"] == "int8 vs HF float32"
    reads = [rec for rec in peer if rec.metric == "weights_read_s"]
    assert [rec.case.get("weights") for rec in reads] == [None, "int8"]
    int8_bytes, float_bytes = (float(rec.case["bytes"]) for rec in reversed(reads))  # type: ignore[arg-type]
    assert int8_bytes < 0.3 * float_bytes  # int8 values + scales
    for read in reads:
        assert len(read.samples) == 2 and read.derived["read_gb_per_s"] > 0
    ceilings = [rec for rec in peer if rec.metric == "generate_ceiling_vs_peer"]
    assert [rec.case.get("weights") for rec in ceilings] == [None, "int8"]
    for ceiling in ceilings:
        assert (ceiling.stats.median or 0) > 0 and ceiling.derived["jaxlab_share_of_ceiling"] > 0


@pytest.mark.slow
def test_the_int8_row_is_labelled_and_its_ceiling_counts_int8_bytes(stand_in, tmp_path):
    """The int8 row: jaxlab's batch-1 generation with int8 weights interleaved with a fresh
    peer run, their ratio labelled "int8 vs HF float32", and the read ceiling at the int8
    step's bytes (a quarter of float32's, plus the scales)."""
    import jax
    from flax import nnx

    from jaxlab.bench.peer_suite import INT8_LABEL, _int8_row, gpt2_like
    from jaxlab.config import DataConfig, ModelConfig, TokenizerConfig
    from jaxlab.model import make_model, split_model

    ctx = _context(tmp_path, repeats=2)
    model = ModelConfig(vocab_size=258, d_model=32, n_heads=4, n_kv_heads=4, max_seq_len=32)
    cfg = gpt2_like(
        JaxlabConfig(
            model=model, tokenizer=TokenizerConfig(kind="byte"), data=DataConfig(seq_len=32)
        )
    )
    shape = {"vocab_size": 258}
    with PeerSession(sys.executable, stand_in) as peer:
        ours, theirs, ratio, read, ceiling = _int8_row(ctx, peer, cfg, shape, 8, 8)
    assert ours.status == "ok" and ours.case["weights"] == "int8" and ours.case["batch"] == 1
    assert theirs.case["vs"] == "jaxlab int8" and len(theirs.samples) == len(ours.samples) == 2
    assert ratio.metric == "generate_speedup_vs_peer" and ratio.case["weights"] == "int8"
    assert ratio.derived["label"] == INT8_LABEL == "int8 vs HF float32"
    # The float step reads every parameter but the position table (the tied head is the
    # token table), 4 bytes each.
    _, abstract = split_model(nnx.eval_shape(lambda: make_model(cfg.model, cfg.train.precision, 0)))
    float_bytes = 4 * (sum(a.size for a in jax.tree.leaves(abstract)) - 32 * 32)
    assert read.metric == "weights_read_s" and read.case["weights"] == "int8"
    assert float(read.case["bytes"]) < 0.35 * float_bytes  # type: ignore[arg-type]
    assert ceiling.metric == "generate_ceiling_vs_peer" and ceiling.case["weights"] == "int8"
