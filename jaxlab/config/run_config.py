"""A trained run's config with only the sections a command may change overridden.

``jaxlab serve`` and ``jaxlab generate`` run a checkpoint, so the model, tokenizer and
training sections must be the run's own (they must match the weights), while the sections
that say how to run it (``inference.*``, ``runtime.*``, and for the server ``serve.*``) take,
lowest to highest: the run's ``config.toml``, ``JAXLAB_<SECTION>__<FIELD>`` environment
variables, then ``--set section.field=value``. An override of any other section is a
:class:`ConfigError` naming it. Import-light: no jax.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from jaxlab.config.loader import ConfigError, resolve_config
from jaxlab.config.schema import JaxlabConfig


def run_config(
    run_dir: str | Path,
    overrides: Sequence[str],
    sections: Sequence[str],
    command: str,
    *,
    environ: Mapping[str, str] | None = None,
) -> JaxlabConfig:
    """``run_dir``'s config with ``sections`` taken from the environment and ``overrides``.

    ``command`` names the command in errors (``"jaxlab serve"``). ``environ`` defaults to
    this process's environment. Raises :class:`ConfigError`.
    """
    config_path = Path(run_dir) / "config.toml"
    if not config_path.is_file():
        raise ConfigError([f"{run_dir}: not a run directory (no config.toml)"])
    allowed = ", ".join(s + ".*" for s in sections)
    bad = [o for o in overrides if o.partition("=")[0].strip().split(".")[0] not in sections]
    if bad:
        raise ConfigError(
            [
                f"--set {o}: {command} only overrides {allowed}"
                " (the model, tokenizer and training sections come from the run)"
                for o in bad
            ]
        )
    stored = resolve_config(config_path, (), environ={}).config
    resolved = resolve_config(config_path, overrides, environ).config
    data = stored.model_dump()
    for section in sections:
        data[section] = getattr(resolved, section).model_dump()
    try:
        return JaxlabConfig.model_validate(data)
    except ValueError as e:
        raise ConfigError([f"{command} config: {line}" for line in str(e).splitlines()]) from None


__all__ = ["run_config"]
