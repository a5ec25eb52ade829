"""``jaxlab config show`` and ``jaxlab config validate`` (never import jax)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from jaxlab.cli.common import EXIT_USAGE, ConfigOpt, JsonOpt, SetOpt, console, emit_json, resolve

app = typer.Typer(help="Inspect and validate configuration.", no_args_is_help=True)


@app.command("show")
def show(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    sources: Annotated[
        bool, typer.Option("--sources", help="Say which source set each value.")
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Print the fully resolved config as TOML (defaults < file < env < --set)."""
    from jaxlab.config import to_dict, to_toml

    resolved = resolve(config, set_)
    if json_:
        doc: dict = {"config": to_dict(resolved.config)}
        if sources:
            doc["sources"] = resolved.sources
        emit_json(doc)
        return
    if not sources:
        sys.stdout.write(to_toml(resolved.config))
        return
    width = max(len(k) for k in resolved.sources)
    flat = _flat(to_dict(resolved.config))
    for key, src in resolved.sources.items():
        sys.stdout.write(f"{key:<{width}} = {flat[key]!r:<24} # {src}\n")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def default_targets() -> list[tuple[str, str]]:
    """Every shipped preset plus every example TOML of a source checkout or the cwd."""
    from jaxlab.config import preset_names, preset_path

    targets = [(f"preset {n}", str(preset_path(n))) for n in preset_names()]
    seen = set()
    for root in (Path.cwd() / "examples", Path(__file__).resolve().parents[2] / "examples"):
        if root.is_dir() and root.resolve() not in seen:
            seen.add(root.resolve())
            targets += [(str(p), str(p)) for p in sorted(root.rglob("*.toml"))]
    return targets


@app.command("validate")
def validate(
    paths: Annotated[
        list[Path] | None, typer.Argument(help="TOML files; none = every preset and example.")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Validate config files; print each problem as `file: field: what is wrong`; exit 2 on any."""
    from jaxlab.config import validate_file

    targets = [(str(p), str(p)) for p in paths] if paths else default_targets()
    results = {label: validate_file(path) for label, path in targets}
    bad = {k: v for k, v in results.items() if v}
    if json_:
        emit_json({"valid": not bad, "files": {k: {"issues": v} for k, v in results.items()}})
    else:
        for label, issues in results.items():
            if issues:
                for issue in issues:
                    # Issues are already prefixed with the file or source they came from.
                    console.print(
                        issue if issue.startswith(label) else f"{label}: {issue}",
                        markup=False,
                        soft_wrap=True,
                    )
            else:
                console.print(f"ok  {label}", markup=False)
        console.print(f"{len(results) - len(bad)} valid, {len(bad)} invalid", markup=False)
    if bad:
        raise typer.Exit(EXIT_USAGE)
