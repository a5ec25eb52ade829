"""The real CLI in a subprocess: exit codes, --json shapes, start-up without jax."""

from __future__ import annotations

import re
import sys

from conftest import ROOT, run_cli

HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax")


def imported_modules(stderr: str) -> set[str]:
    """Module names from `python -X importtime` output."""
    names = set()
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", line)
        if m:
            names.add(m.group(1).split(".")[0])
    return names


def assert_no_heavy_imports(*args: str, env: dict[str, str] | None = None) -> None:
    r = run_cli(*args, env=env, python_flags=("-X", "importtime"))
    mods = imported_modules(r.stderr)
    assert "jaxlab" in mods, "importtime output not parsed"
    assert not mods & set(HEAVY), f"{args} imported {sorted(mods & set(HEAVY))}"


def test_help_and_config_commands_never_import_jax():
    assert_no_heavy_imports("--help")
    assert_no_heavy_imports("config", "show", "-c", "tiny")
    assert_no_heavy_imports("config", "validate")


def test_shell_completion_never_imports_jax():
    env = {"_JAXLAB_COMPLETE": "complete_bash", "COMP_WORDS": "jaxlab con", "COMP_CWORD": "1"}
    assert_no_heavy_imports(env=env)
    r = run_cli(env=env)
    assert "config" in r.stdout


def test_help_documents_exit_codes():
    r = run_cli("--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for code in ("0 ok", "1 runtime failure", "2 usage or config error", "130 interrupted"):
        assert code in text


def test_usage_errors_exit_2():
    assert run_cli("no-such-command").returncode == 2
    assert run_cli("devices", "--no-such-flag").returncode == 2
    assert run_cli("--log-level", "LOUD", "config", "show").returncode == 2


def test_config_errors_exit_2_without_traceback(tmp_path):
    r = run_cli("config", "show", "-c", "tiny", "--set", "model.d_model=65")
    assert r.returncode == 2
    assert "model.d_model: must be divisible by model.n_heads" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli("--debug", "config", "show", "-c", "tiny", "--set", "model.d_model=65")
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_config_show_toml_json_and_sources():
    r = run_cli("config", "show", "-c", "tiny", "--set", "train.steps=3")
    assert r.returncode == 0
    import tomllib

    assert tomllib.loads(r.stdout)["train"]["steps"] == 3
    r = run_cli(
        "config", "show", "-c", "tiny", "--sources", "--json", env={"JAXLAB_RUNTIME__SEED": "5"}
    )
    doc = r.json()
    assert doc["config"]["runtime"]["seed"] == 5
    assert doc["sources"]["runtime.seed"] == "env JAXLAB_RUNTIME__SEED"
    assert doc["sources"]["model.d_model"] == "preset tiny"
    r = run_cli("config", "show", "--sources", "-c", "tiny")
    assert re.search(r"model\.d_model\s+= 64\s+# preset tiny", r.stdout)


def test_config_validate_all_shipped_and_bad_files(tmp_path):
    r = run_cli("config", "validate", "--json")
    assert r.returncode == 0, r.stderr
    doc = r.json()
    assert doc["valid"] is True
    assert {"preset tiny", "preset small", "preset bench-tiny", "preset bench-small"} <= set(
        doc["files"]
    )
    assert any(name.endswith(".toml") and "examples" in name for name in doc["files"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nn_heads = 0\n[data]\nseqlen = 3\n")
    r = run_cli("config", "validate", str(bad))
    assert r.returncode == 2
    assert (
        f"{bad}: model.n_heads: Input should be greater than or equal to 1 (got 0, expected >= 1)"
        in r.stderr
    )
    assert f"{bad}: data.seqlen: unknown key (did you mean 'seq_len'?)" in r.stderr


def test_devices_json_shape():
    r = run_cli("devices", "--json")
    assert r.returncode == 0, r.stderr
    doc = r.json()
    for key in (
        "backend",
        "platform",
        "device_kind",
        "device_count",
        "process_index",
        "process_count",
        "local_devices",
        "cpu_cores",
        "xla_flags",
        "versions",
    ):
        assert key in doc
    assert doc["platform"] == "cpu"
    for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "python"):
        assert pkg in doc["versions"]
    r = run_cli("devices")
    assert r.returncode == 0 and "device count" in r.stderr


def test_python_dash_m_and_console_script_agree():
    import shutil
    import subprocess

    exe = shutil.which("jaxlab", path=str(ROOT / ".venv" / "bin")) or shutil.which("jaxlab")
    if exe is None:  # pragma: no cover - the console script is installed by `pdm install`
        exe = str(ROOT / ".venv" / "bin" / "jaxlab")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert out.stdout == run_cli("--help").stdout
    assert sys.executable
