"""The config ``jaxlab serve`` runs with: the run's own, with serving sections overridable.

The model, tokenizer and training sections come from the run directory (they must match
the checkpoint). ``serve.*``, ``inference.*`` and ``runtime.*`` take, lowest to highest:
the run's ``config.toml``, ``JAXLAB_<SECTION>__<FIELD>`` environment variables (e.g.
``JAXLAB_SERVE__API_KEY``), ``--set section.field=value``, then the explicit CLI flags
(``--host``, ``--port``, ``--slots``). It only resolves the config: nothing here loads
or serves. Import-light: no jax.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxlab.config import ConfigError, JaxlabConfig
from jaxlab.config.run_config import run_config

#: Sections a ``jaxlab serve`` override may touch.
SERVE_SECTIONS = ("serve", "inference", "runtime")


def serve_config(
    run_dir: str | Path,
    overrides: Sequence[str] = (),
    *,
    environ: Mapping[str, str] | None = None,
    **serve_fields: Any,
) -> JaxlabConfig:
    """The resolved serving config of ``run_dir`` (see the module docstring).

    ``serve_fields`` (e.g. ``host="0.0.0.0", port=0, slots=8``) override ``serve.*`` last;
    ``None`` values are ignored, and a mapping (``adapters``) is merged over the config's.
    Raises :class:`~jaxlab.config.ConfigError`.
    """
    cfg = run_config(run_dir, overrides, SERVE_SECTIONS, "jaxlab serve", environ=environ)
    data = cfg.model_dump()
    for key, value in serve_fields.items():
        if isinstance(value, Mapping) and isinstance(data["serve"].get(key), Mapping):
            data["serve"][key] = {**data["serve"][key], **value}
        elif value is not None:
            data["serve"][key] = value
    try:
        return JaxlabConfig.model_validate(data)
    except ValueError as e:
        raise ConfigError([f"serve config: {line}" for line in str(e).splitlines()]) from None


__all__ = ["SERVE_SECTIONS", "serve_config"]
