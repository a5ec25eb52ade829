"""Pure-Python pieces of the server: lifecycle, stop strings, request parsing, config."""

from __future__ import annotations

import gc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxlab.config import ConfigError
from jaxlab.serve.lifecycle import TRANSITIONS, IllegalTransition, Lifecycle, ModelState
from jaxlab.serve.metrics import ServeMetrics
from jaxlab.serve.protocol import ApiError, CompletionBody, GenerateBody, parse_json, validate
from jaxlab.serve.scheduler import (
    admission_sizes,
    decode_groups_for,
    pick_slots,
    split_admission,
)
from jaxlab.tokenizer.detok import Detokenizer as TextAssembler
from jaxlab.tokenizer import byte_tokenizer

S = ModelState


def test_lifecycle_happy_path_and_listeners():
    lc = Lifecycle()
    seen: list[tuple[str, str]] = []
    lc.add_listener(lambda a, b: seen.append((a.value, b.value)))
    for s in (S.LOADING, S.WARMING, S.READY, S.DRAINING, S.STOPPED):
        lc.to(s)
    assert lc.state == S.STOPPED
    assert seen == [
        ("empty", "loading"),
        ("loading", "warming"),
        ("warming", "ready"),
        ("ready", "draining"),
        ("draining", "stopped"),
    ]
    assert [s for s, _ in lc.history] == [
        S.EMPTY,
        S.LOADING,
        S.WARMING,
        S.READY,
        S.DRAINING,
        S.STOPPED,
    ]


@pytest.mark.parametrize(
    "path",
    [
        (S.READY,),  # empty -> ready skips loading and warming
        (S.LOADING, S.READY),  # no warm-up
        (S.LOADING, S.WARMING, S.READY, S.WARMING),  # back
        (S.LOADING, S.WARMING, S.READY, S.STOPPED),  # stop without draining
        (S.LOADING, S.FAILED, S.LOADING),  # failed is terminal
        (S.LOADING, S.WARMING, S.READY, S.DRAINING, S.READY),  # no un-draining
    ],
)
def test_lifecycle_illegal_transitions_raise(path):
    lc = Lifecycle()
    *ok, bad = path
    for s in ok:
        lc.to(s)
    before = lc.state
    with pytest.raises(IllegalTransition, match=f"{before} -> {bad}"):
        lc.to(bad)
    assert lc.state == before


def test_every_state_reaches_a_terminal_state():
    for state in ModelState:
        seen, todo = set(), [state]
        while todo:
            s = todo.pop()
            seen.add(s)
            todo += [n for n in TRANSITIONS[s] if n not in seen]
        assert seen & {S.STOPPED, S.FAILED}, state


def test_model_state_gauge_is_one_hot():
    m = ServeMetrics()
    m.set_state(S.WARMING)
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    values = {s.labels["state"]: s.value for s in fams["jaxlab_model_state"].samples}
    assert values == {s.value: (1.0 if s == S.WARMING else 0.0) for s in ModelState}


# ----------------------------------------------------------------------------- text


def _assemble(text: str, stop: list[str]) -> tuple[list[str], TextAssembler]:
    tok = byte_tokenizer()
    asm = TextAssembler(tok, stop)
    deltas = []
    for t in tok.encode(text):
        deltas.append(asm.feed(t))
        if asm.stopped:
            break
    deltas.append(asm.finish())
    return deltas, asm


def test_text_without_stops_streams_every_byte_and_never_splits_utf8():
    text = "héllo wörld ✓ 🚀 done"
    deltas, asm = _assemble(text, [])
    assert "".join(deltas) == text == asm.text
    assert all("\ufffd" not in d for d in deltas)
    assert not asm.stopped


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("count: 1 2 3 STOP 4 5", ["STOP"], "count: 1 2 3 "),
        ("abcabcabd", ["abd"], "abcabc"),
        ("first\n\nsecond", ["\n\n", "sec"], "first"),
        ("no stop here", ["zzz"], "no stop here"),
        ("ends with a partial ST", ["STOP"], "ends with a partial ST"),
        ("✓✓x✓", ["x✓"], "✓✓"),
    ],
)
def test_stop_strings_truncate_and_streaming_equals_final_text(text, stop, expected):
    deltas, asm = _assemble(text, stop)
    assert asm.text == expected
    assert "".join(deltas) == expected
    assert asm.stopped == (expected != text)


def test_held_back_text_is_released_when_the_stop_does_not_complete():
    tok = byte_tokenizer()
    asm = TextAssembler(tok, ["STOP"])
    out = [asm.feed(t) for t in tok.encode("a ST")]
    assert "".join(out) == "a "  # "ST" might begin "STOP"
    assert asm.feed(tok.encode("x")[0]) == "STx"
    assert asm.finish() == ""


def test_unknown_token_ids_become_replacement_characters():
    tok = byte_tokenizer()
    asm = TextAssembler(tok, [])
    assert asm.feed(tok.n_vocab + 5) == "\ufffd"
    assert asm.feed(ord("a")) == "a"


# ----------------------------------------------------------------------------- protocol


def test_parse_json_and_validate_errors_are_openai_shaped():
    with pytest.raises(ApiError) as e:
        parse_json(b"{not json")
    assert e.value.status == 400 and e.value.code == "invalid_json"
    with pytest.raises(ApiError) as e:
        parse_json(b"[1, 2]")
    assert e.value.status == 400
    with pytest.raises(ApiError) as e:
        validate(GenerateBody, {"prompt": "x", "max_tokens": "5"})
    body = e.value.body()
    assert e.value.status == 422
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == "max_tokens"
    with pytest.raises(ApiError) as e:
        validate(GenerateBody, {"prompt": "x", "temprature": 0.5})
    assert e.value.code == "unknown_field" and e.value.param == "temprature"
    with pytest.raises(ApiError) as e:
        validate(GenerateBody, {})
    assert e.value.code == "missing" and e.value.param == "prompt"


def test_completion_body_accepts_openai_extras_and_refuses_unsupported_features():
    body = validate(CompletionBody, {"model": "m", "prompt": ["one"], "user": "u", "top_k": 3})
    assert body.single_prompt() == "one" and body.top_k == 3
    body.check_supported()
    with pytest.raises(ApiError, match="one prompt per request"):
        validate(CompletionBody, {"prompt": ["a", "b"]}).single_prompt()
    for field, value in (("n", 2), ("echo", True), ("logprobs", 2), ("best_of", 3)):
        with pytest.raises(ApiError) as e:
            validate(CompletionBody, {"prompt": "a", field: value}).check_supported()
        assert e.value.status == 400 and e.value.param == field
    assert validate(CompletionBody, {"prompt": "a", "stop": "x"}).stop_strings() == ("x",)
    with pytest.raises(ApiError, match="at most 4"):
        validate(CompletionBody, {"prompt": "a", "stop": list("abcde")}).stop_strings()
    with pytest.raises(ApiError):
        validate(CompletionBody, {"prompt": "a", "temperature": -1.0})


# ----------------------------------------------------------------------------- config


def test_serve_config_takes_the_run_config_and_only_serving_overrides(tmp_path):
    from jaxlab.config import load_config, to_toml
    from jaxlab.serve.config import serve_config

    cfg = load_config("tiny")
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    out = serve_config(
        tmp_path,
        ["serve.max_queue=3", "inference.stream_chunk_tokens=4"],
        environ={"JAXLAB_SERVE__API_KEY": "sekrit"},
        port=0,
        slots=2,
    )
    assert out.model == cfg.model
    assert (out.serve.max_queue, out.serve.port, out.serve.slots) == (3, 0, 2)
    assert out.inference.stream_chunk_tokens == 4
    assert out.serve.api_key is not None and out.serve.api_key.get_secret_value() == "sekrit"
    with pytest.raises(ConfigError, match="only overrides"):
        serve_config(tmp_path, ["model.d_model=128"])
    with pytest.raises(ConfigError, match="not a run directory"):
        serve_config(tmp_path / "nope")


@pytest.mark.parametrize(
    ("prefill_batch", "sizes"),
    [(1, (1,)), (2, (2, 1)), (4, (4, 2, 1)), (6, (6, 4, 2, 1)), (8, (8, 4, 2, 1))],
)
def test_admission_sizes_are_powers_of_two_and_the_batch(prefill_batch, sizes):
    assert admission_sizes(prefill_batch) == sizes


@given(st.integers(1, 16), st.integers(0, 40))
def test_split_admission_takes_full_groups_then_pads_the_rest_into_one(batch, n):
    sizes = admission_sizes(batch)
    groups = split_admission(n, sizes)
    assert all(g in sizes for g in groups)
    assert groups == sorted(groups, reverse=True)
    # Every request has a row; the only padding is in the last group, and that group is
    # the smallest compiled size that holds what the full groups leave.
    full, rest = divmod(n, batch)
    assert groups[:full] == [batch] * full
    if rest:
        assert groups[full:] == [min(s for s in sizes if s >= rest)]
    else:
        assert groups[full:] == []
    assert sum(groups) >= n


@pytest.mark.parametrize(
    ("n", "groups"),
    [(0, []), (1, [1]), (3, [4]), (5, [8]), (8, [8]), (15, [8, 8]), (17, [8, 8, 1])],
)
def test_split_admission_examples(n, groups):
    assert split_admission(n, admission_sizes(8)) == groups


@given(st.integers(1, 64), st.integers(1, 16))
def test_auto_decode_groups_split_the_slots_evenly_one_per_core_at_most(slots, cores):
    groups = decode_groups_for(slots, 0, "cpu", cores=cores)
    assert slots % groups == 0 and 1 <= groups <= cores
    # The most groups that do: no larger divisor of slots fits under the core count.
    assert not any(slots % g == 0 for g in range(groups + 1, min(slots, cores) + 1))


@pytest.mark.parametrize(
    ("slots", "requested", "platform", "cores", "groups"),
    [
        (16, 0, "cpu", 2, 2),  # the bench-small server on a 2-core CPU: 2 groups of 8
        (16, 0, "cpu", 1, 1),
        (1, 0, "cpu", 2, 1),  # the 1-slot baseline has nothing to split
        (3, 0, "cpu", 2, 1),  # 3 slots do not split in two
        (12, 0, "cpu", 8, 6),
        (16, 0, "gpu", 8, 1),  # one device runs one program at a time: no groups
        (16, 0, "tpu", 8, 1),
        (16, 4, "cpu", 2, 4),  # an explicit value is taken as it is
        (16, 1, "cpu", 8, 1),
    ],
)
def test_decode_groups_examples(slots, requested, platform, cores, groups):
    assert decode_groups_for(slots, requested, platform, cores=cores) == groups


def test_decode_groups_must_divide_the_slots():
    from jaxlab.config import load_config

    with pytest.raises(ValueError, match="decode_groups=3 must divide slots=16"):
        decode_groups_for(16, 3, "cpu")
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["serve.slots=16", "serve.decode_groups=3"], environ={})
    assert "serve.decode_groups: must divide serve.slots (got 3 and 16)" in str(e.value)
    assert "use a divisor of 16, or 0" in str(e.value)
    assert load_config("tiny", ["serve.slots=16", "serve.decode_groups=4"]).serve.decode_groups == 4


@st.composite
def slot_table(draw: st.DrawFn) -> tuple[list[bool], int, int]:
    rows = draw(st.integers(1, 8))
    busy = draw(
        st.lists(st.booleans(), min_size=rows, max_size=rows * 4).map(
            lambda b: b[: len(b) - len(b) % rows]
        )
    )
    n = draw(st.integers(0, busy.count(False)))
    return busy, rows, n


@given(slot_table())
def test_new_requests_take_the_least_busy_groups_lowest_free_slots(table):
    busy, rows, n = table
    picked = pick_slots(busy, rows, n)
    assert len(set(picked)) == n and not any(busy[s] for s in picked)
    after = list(busy)
    for s in picked:
        after[s] = True
    groups = [range(g, g + rows) for g in range(0, len(busy), rows)]
    load = [sum(after[s] for s in r) for r in groups]
    for g, r in enumerate(groups):
        mine = [s for s in picked if s in r]
        # Within a group, the lowest free slots, lowest first.
        assert mine == [s for s in r if not busy[s]][: len(mine)]
        # Balance: a group that got a request is at most one busier than any group that
        # still has a free slot (else that group would have taken it).
        if mine:
            for h, other in enumerate(groups):
                if not all(after[s] for s in other):
                    assert load[g] <= load[h] + 1, (busy, rows, picked)
    if len(groups) == 1:
        assert picked == [s for s in range(len(busy)) if not busy[s]][:n]


def test_pick_slots_examples():
    free = [False] * 4
    assert pick_slots(free, 2, 3) == [0, 2, 1]  # the scheduler test's three requests
    assert pick_slots([True, False, False, False], 2, 2) == [2, 1]
    assert pick_slots(free, 4, 4) == [0, 1, 2, 3]  # one group: lowest first
    with pytest.raises(ValueError, match="3 slots asked, 2 free"):
        pick_slots([True, False, True, False], 2, 3)


def test_heap_freezes_nest_and_the_last_thaw_unfreezes():
    from jaxlab.serve import service

    assert service._frozen_services == 0, "a server from an earlier test is still running"
    probe = [object()]  # a list: tracked by the collector
    service._freeze_startup_heap()
    service._freeze_startup_heap()
    try:
        assert not any(o is probe for o in gc.get_objects())
        service._thaw_startup_heap()
        assert gc.get_freeze_count() > 0  # one service is still serving
    finally:
        service._thaw_startup_heap()
    assert gc.get_freeze_count() == 0
    assert any(o is probe for o in gc.get_objects())


def test_completions_url_keeps_a_path_prefix():
    from jaxlab.serve.loadgen import completions_url

    assert completions_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1/completions"
    assert completions_url("http://h:1/api/") == "http://h:1/api/v1/completions"
