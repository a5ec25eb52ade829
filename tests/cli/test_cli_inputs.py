"""Bad input through the CLI, by class: every one is exit 2, names what is wrong, and prints
no traceback. Files that are not UTF-8, count-like options out of range (found from the Typer
app itself), sampling values past the server's ranges, and ``JAXLAB_*`` variables that
contradict an existing run."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from conftest import run_cli

from jaxlab.cli.app import app, main
from jaxlab.config import ConfigError, load_config
from jaxlab.train.run_dir import PER_PROCESS_FIELDS, RunDir

NOT_UTF8 = b"[model]\nd_model = 64 # \xff\xfe latin-1, not UTF-8\n"


def config_only_run(path: Path) -> Path:
    """A run directory with its config.toml alone (no checkpoints): enough for every check
    that must happen before anything loads."""
    RunDir(path).create(load_config("tiny", environ={}))
    return path


def assert_usage_error(r: Any, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr[-2000:])


# --------------------------------------------------------------------------- files


def _bad_file_cases(tmp: Path) -> Iterator[tuple[str, list[str], Path]]:
    bad_toml = tmp / "bad.toml"
    bad_toml.write_bytes(NOT_UTF8)
    yield "config show", ["config", "show", "-c", str(bad_toml)], bad_toml
    yield "config validate", ["config", "validate", str(bad_toml)], bad_toml
    yield "train", ["train", "-c", str(bad_toml)], bad_toml
    yield "bench run", ["bench", "run", "peak", "-c", str(bad_toml)], bad_toml
    child = tmp / "child.toml"
    child.write_text('extends = "bad.toml"\n')
    yield "extends chain", ["config", "show", "-c", str(child)], bad_toml.resolve()
    run = config_only_run(tmp / "run")
    (run / "checkpoints" / "1").mkdir(parents=True)  # serve looks for a checkpoint first
    run_cfg = RunDir(run).config_path
    run_cfg.write_bytes(NOT_UTF8)
    for cmd in ("eval", "resume", "serve"):
        yield f"{cmd} run dir", [cmd, "--run-dir", str(run)], run_cfg
    prompt = tmp / "prompt.txt"
    prompt.write_bytes(b"caf\xe9\n")
    yield (
        "generate prompt",
        ["generate", "--run-dir", str(run), "--prompt-file", str(prompt)],
        prompt,
    )
    records = tmp / "bench" / "records.jsonl"
    records.parent.mkdir()
    records.write_bytes(b'{"suite": "\xff"}\n')
    yield "bench compare", ["bench", "compare", str(records), str(records)], records
    yield "bench report", ["bench", "report", str(records.parent)], records


BAD_FILE_CASES = [
    "config show",
    "config validate",
    "train",
    "bench run",
    "extends chain",
    "eval run dir",
    "resume run dir",
    "serve run dir",
    "generate prompt",
    "bench compare",
    "bench report",
]


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_FILE_CASES)
def test_files_that_are_not_utf8_exit_2_naming_the_file(tmp_path, case):
    cases = {name: (args, path) for name, args, path in _bad_file_cases(tmp_path)}
    assert list(cases) == BAD_FILE_CASES
    args, path = cases[case]
    assert_usage_error(run_cli(*args), str(path), "not UTF-8")


# --------------------------------------------------------------------------- options


def _commands() -> Iterator[tuple[list[str], Any]]:
    def walk(cmd: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
        yield path, cmd
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            yield from walk(sub, [*path, name])

    yield from walk(typer.main.get_command(app), [])


def _int_options() -> list[tuple[list[str], Any]]:
    return [
        (path, p)
        for path, cmd in _commands()
        for p in cmd.params
        if getattr(p, "type_descriptor", None) is not None and p.type_descriptor.annotation is int
    ]


def _required(cmd: Any) -> list[str]:
    """Placeholders for the command's required options (a run dir that does not exist)."""
    out = []
    for p in cmd.params:
        if p.required and p.opts[0].startswith("-"):
            out += [p.opts[0], "/nonexistent/jaxlab-run"]
    return out


def _find(path: list[str]) -> Any:
    return dict((tuple(p), c) for p, c in _commands())[tuple(path)]


INT_OPTIONS = _int_options()


def test_count_like_options_are_found_and_every_one_is_bounded():
    """Every integer option of every command is a count, a step, a port or a seed: each has
    a declared lower bound (click checks it before the command body runs)."""
    found = {(" ".join(path), p.opts[-1]) for path, p in INT_OPTIONS}
    for must in (
        ("train", "--steps"),
        ("train", "--processes"),
        ("resume", "--steps"),
        ("eval", "--batches"),
        ("generate", "--max-new-tokens"),
        ("generate", "--top-k"),
        ("serve", "--slots"),
        ("serve", "--port"),
        ("launch", "--processes"),
        ("launch", "--devices-per-process"),
    ):
        assert must in found, must
    unbounded = [(" ".join(path), p.opts[-1]) for path, p in INT_OPTIONS if p.min is None]
    assert not unbounded, f"integer options without a min: {unbounded}"


@pytest.fixture
def in_process(capsys) -> Iterator[Any]:
    """``main(argv)`` in this process; returns (exit code, stderr)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level  # main() reconfigures logging

    def call(*argv: str) -> tuple[int, str]:
        code = main(list(argv))
        return code, capsys.readouterr().err

    yield call
    root.handlers[:] = handlers
    root.setLevel(level)


def _out_of_range() -> Iterator[Any]:
    for path, p in INT_OPTIONS:
        bad = [p.min - 1] + ([p.max + 1] if p.max is not None else [])
        for value in bad:
            yield pytest.param(path, p.opts, value, id=f"{' '.join(path)} {p.opts[-1]}={value}")


@pytest.mark.parametrize(("path", "opts", "value"), list(_out_of_range()))
def test_every_count_like_option_rejects_out_of_range_values(in_process, path, opts, value):
    code, err = in_process(*path, *_required(_find(path)), opts[-1], str(value))
    assert code == 2, err
    assert "Invalid value for" in err and any(f"'{o}'" in err for o in opts), err  # named


@pytest.mark.parametrize("command", ["resume", "eval"])
@pytest.mark.parametrize("value", ["-1", "x", "1.5", "²"])
def test_checkpoint_step_is_latest_or_a_step_number(in_process, command, value):
    code, err = in_process(command, *_required(_find([command])), "--step", value)
    assert code == 2 and "'--step'" in err and "expected 'latest' or a step number" in err, err


# --------------------------------------------------------------------------- sampling


@pytest.mark.slow
@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--seed", "99999999999", "seed"),
        ("--temperature", "nan", "temperature"),
        ("--top-p", "0", "top_p"),
        ("--top-k", "99999999999", "top_k"),
    ],
)
def test_generate_checks_sampling_with_the_servers_ranges_first(tmp_path, option, value, says):
    """The one request check (``SamplingParams.problem``) runs on the given options before
    any checkpoint loads, so no value reaches an int32 conversion: exit 2 naming the option
    (this run directory has no checkpoint at all)."""
    run = config_only_run(tmp_path / "run")
    r = run_cli("generate", "--run-dir", str(run), "--prompt", "hi", option, value)
    assert_usage_error(r, f"{option}: ", says)


@pytest.mark.slow
def test_generate_without_checkpoints_exits_2(tmp_path):
    run = config_only_run(tmp_path / "run")
    r = run_cli("generate", "--run-dir", str(run), "--prompt", "hi")
    assert_usage_error(r, "no checkpoints to generate from")


# --------------------------------------------------------------------------- env vs a run


@pytest.mark.parametrize("command", ["eval", "resume"])
def test_env_contradicting_a_run_names_field_values_and_variable(tmp_path, command):
    run = config_only_run(tmp_path / "run")
    r = run_cli(command, "--run-dir", str(run), env={"JAXLAB_MODEL__D_MODEL": "128"})
    assert_usage_error(
        r,
        "env JAXLAB_MODEL__D_MODEL: model.d_model = 128",
        "created with model.d_model = 64",
        "unset JAXLAB_MODEL__D_MODEL",
        "jaxlab train --run-dir NEW_DIR",
    )
    assert "jaxlab resume" not in r.stderr  # resuming fails the same way: not a fix


def test_run_config_refuses_only_contradicting_variables(tmp_path, monkeypatch):
    rd = RunDir(config_only_run(tmp_path / "run"))
    for k in [k for k in os.environ if k.startswith("JAXLAB_")]:
        monkeypatch.delenv(k)
    # launch state and a value equal to the stored one are fine
    monkeypatch.setenv("JAXLAB_RUNTIME__DISTRIBUTED__NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXLAB_MODEL__D_MODEL", "64")
    cfg = rd.load_config(env_may_change=PER_PROCESS_FIELDS)
    assert cfg.runtime.distributed.num_processes == 2
    # anything else that differs is named, each variable on its own line
    monkeypatch.setenv("JAXLAB_TRAIN__STEPS", "7")
    monkeypatch.setenv("JAXLAB_DATA__SEQ_LEN", "32")
    with pytest.raises(ConfigError) as e:
        rd.load_config(env_may_change=PER_PROCESS_FIELDS)
    assert [i.split(":")[0] for i in e.value.issues] == [
        "env JAXLAB_DATA__SEQ_LEN",
        "env JAXLAB_TRAIN__STEPS",
    ]
    # without env_may_change, the variables apply (generate, serve)
    assert rd.load_config().train.steps == 7
