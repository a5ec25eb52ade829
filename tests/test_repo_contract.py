"""The repository keeps its promises: README commands, CI entry point, recipes."""

from __future__ import annotations

import re
import tomllib

from conftest import ROOT


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)[:2]


def test_readme_opens_with_two_one_line_commands():
    text = (ROOT / "README.md").read_text()
    first_blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)[:2]
    assert len(first_blocks) == 2
    assert all(block.count("\n") == 1 for block in first_blocks), "each is one line"
    assert text.index("```bash") < 20, "the commands come first"
    install, test = readme_commands()
    assert "jaxlab" in install
    assert "install --force '.[plots]'" in install, "the reviewer's install draws the plots"
    assert "--frozen-lockfile" in test


def test_ci_runs_the_readme_test_command_verbatim():
    _, test = readme_commands()
    assert test in (ROOT / ".ci" / "run").read_text().splitlines()


def test_justfile_has_every_recipe():
    text = (ROOT / "justfile").read_text()
    for recipe in (
        "install",
        "test",
        "test-fast",
        "lint",
        "fmt",
        "typecheck",
        "reproduce",
        "bench",
        "serve",
        "ci",
    ):
        assert re.search(rf"^{re.escape(recipe)}( [^:]*)?:", text, flags=re.M), recipe


def test_pyproject_packaging():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["build-system"]["build-backend"] == "pdm.backend"
    assert meta["project"]["requires-python"] == ">=3.11"
    assert meta["project"]["scripts"]["jaxlab"] == "jaxlab.cli.app:run"
    assert "plots" in meta["project"]["optional-dependencies"]
    assert (ROOT / "pdm.lock").is_file()
