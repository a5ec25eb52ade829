"""The one configuration loader every command and library entry point shares.

Precedence, lowest to highest::

    defaults  <  preset or TOML file (with ``extends`` chains)  <  JAXLAB_<SECTION>__<FIELD>
    environment variables (parsed by pydantic-settings)  <  repeated ``--set a.b=value``

Layers are merged as plain dicts first and validated once, so the loader can say which
source set each value (``jaxlab config show --sources``) and which source a bad value
came from.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import UnionType
from typing import Any, Union

import tomli_w
from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from jaxlab.config.schema import JaxlabConfig

ENV_PREFIX = "JAXLAB_"
ENV_DELIMITER = "__"
#: ``JAXLAB_*`` variables that are process switches, not config fields (read elsewhere
#: before any config exists): the env layer leaves them alone instead of rejecting them.
PROCESS_ENV = frozenset({"JAXLAB_XLA_CPU_DEFAULTS"})
DEFAULT_SOURCE = "default"


class ConfigError(Exception):
    """A configuration problem a user must fix; the CLI maps it to exit code 2."""

    def __init__(self, issues: Sequence[str]):
        self.issues = list(issues)
        super().__init__("\n".join(self.issues))


@dataclass
class ResolvedConfig:
    config: JaxlabConfig
    # dotted key -> the source that set it ("default", "preset tiny", a file path, "env NAME", "--set")
    sources: dict[str, str] = field(default_factory=dict)
    origin: str = DEFAULT_SOURCE


class _EnvSchema(BaseSettings, JaxlabConfig):
    """Only used to let pydantic-settings parse ``JAXLAB_*`` variables against the schema."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_DELIMITER,
        case_sensitive=False,
        extra="forbid",
    )


# --------------------------------------------------------------------------- presets


def preset_names() -> list[str]:
    root = resources.files("jaxlab.config") / "presets"
    return sorted(p.name.removesuffix(".toml") for p in root.iterdir() if p.name.endswith(".toml"))


def preset_path(name: str) -> Path:
    return Path(str(resources.files("jaxlab.config") / "presets" / f"{name}.toml"))


def _locate(ref: str, relative_to: Path | None) -> tuple[Path, str]:
    """A config reference is a preset name or a path; return (path, label)."""
    if ref in preset_names():
        return preset_path(ref), f"preset {ref}"
    candidates = [Path(ref)]
    if relative_to is not None and not Path(ref).is_absolute():
        candidates.insert(0, relative_to / ref)
    for c in candidates:
        if c.is_file():
            return c, str(c)
    hint = difflib.get_close_matches(ref, preset_names(), n=1)
    fix = f"did you mean preset '{hint[0]}'?" if hint else f"presets: {', '.join(preset_names())}"
    raise ConfigError([f"{ref}: no such preset or file ({fix})"])


def not_utf8(e: UnicodeDecodeError) -> str:
    """What is wrong with a file that does not decode, for a one-line message."""
    return f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); save it as UTF-8"


def _read_toml(path: Path, label: str) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{label}: malformed TOML: {e}"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"{label}: {not_utf8(e)}"]) from None
    except OSError as e:
        raise ConfigError([f"{label}: cannot read ({e.strerror})"]) from None


def _file_layers(ref: str, relative_to: Path | None = None, seen: tuple[Path, ...] = ()):
    """Yield (label, data) from the root of an ``extends`` chain down to ``ref`` itself."""
    path, label = _locate(ref, relative_to)
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError([f"{label}: extends forms a cycle ({chain})"])
    data = _read_toml(path, label)
    parent = data.pop("extends", None)
    if parent is not None:
        if not isinstance(parent, str):
            raise ConfigError(
                [f"{label}: extends: expected a preset name or path (got {parent!r})"]
            )
        yield from _file_layers(parent, path.parent, (*seen, path))
    yield label, data


# --------------------------------------------------------------------------- layers


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            _deep_merge(base[k], v)
        else:
            base[k] = dict(v) if isinstance(v, Mapping) else v
    return base


def _parse_value(raw: str) -> Any:
    """Parse a --set value as a TOML value (numbers, bools, lists, quoted strings), else a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or "." not in key:
            raise ConfigError(
                [f"--set: expected section.field=value (got {item!r}); e.g. --set train.steps=50"]
            )
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError([f"--set: {key}: {p} is set to a value and used as a section"])
        node[leaf] = _parse_value(raw.strip())
    return out


def _env_layer(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse JAXLAB_* variables with pydantic-settings; unknown sections are errors."""
    # Snapshot first: ``environ`` may be os.environ itself, which is swapped out below.
    ours = {
        k: v
        for k, v in environ.items()
        if k.upper().startswith(ENV_PREFIX) and k.upper() not in PROCESS_ENV
    }
    names = {k.upper(): k for k in ours}
    sections = list(JaxlabConfig.model_fields)
    issues = []
    for upper in names:
        section = upper.removeprefix(ENV_PREFIX).split(ENV_DELIMITER)[0].lower()
        if section not in sections:
            hint = difflib.get_close_matches(section, sections, n=1)
            fix = f"did you mean JAXLAB_{hint[0].upper()}__...?" if hint else "not a config section"
            issues.append(f"env {upper}: unknown config section '{section}' ({fix})")
    if issues:
        raise ConfigError(issues)
    if not names:
        return {}, {}
    saved = dict(os.environ)
    try:
        # pydantic-settings reads os.environ; scope it to exactly the mapping we were given.
        os.environ.clear()
        os.environ.update(ours)
        data = EnvSettingsSource(
            _EnvSchema,
            case_sensitive=False,
            env_prefix=ENV_PREFIX,
            env_nested_delimiter=ENV_DELIMITER,
        )()
    except Exception as e:  # pydantic-settings raises SettingsError for undecodable values
        raise ConfigError([f"env: {e}"]) from None
    finally:
        os.environ.clear()
        os.environ.update(saved)
    where = {}
    for key in _flatten(data):
        env_name = ENV_PREFIX + key.replace(".", ENV_DELIMITER).upper()
        where[key] = f"env {env_name}"
    return data, where


# --------------------------------------------------------------------------- errors


def _model_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = JaxlabConfig
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        # An optional section (``train.lora``) is ``Section | None``: its section.
        options = typing.get_args(ann) if typing.get_origin(ann) in (Union, UnionType) else (ann,)
        found = [a for a in options if isinstance(a, type) and issubclass(a, BaseModel)]
        model = found[0] if found else None
    return model


_EXPECT = {
    "greater_than_equal": lambda c: f">= {c['ge']}",
    "greater_than": lambda c: f"> {c['gt']}",
    "less_than_equal": lambda c: f"<= {c['le']}",
    "less_than": lambda c: f"< {c['lt']}",
    "literal_error": lambda c: f"one of {c['expected']}",
    "int_parsing": lambda c: "an integer",
    "int_type": lambda c: "an integer",
    "int_from_float": lambda c: "an integer",
    "float_parsing": lambda c: "a number",
    "float_type": lambda c: "a number",
    "bool_parsing": lambda c: "true or false",
    "bool_type": lambda c: "true or false",
    "string_type": lambda c: "a string",
    "list_type": lambda c: "a list",
    "model_type": lambda c: "a table of fields",
    "dict_type": lambda c: "a table of fields",
}


def _format_errors(err: ValidationError, sources: Mapping[str, str], origin: str) -> list[str]:
    lines = []
    for e in err.errors(include_url=False):
        loc = [str(p) for p in e["loc"]]
        dotted = ".".join(loc)
        where = sources.get(dotted, origin if origin != DEFAULT_SOURCE else "config")
        ctx = e.get("ctx") or {}
        kind = e["type"]
        if kind == "value_error" and not loc:
            # Cross-field rules: one line per rule, each already names its field and fix.
            for line in str(ctx.get("error", e["msg"])).split("\n"):
                named = line.split(":", 1)[0]
                lines.append(f"{sources.get(named, where)}: {line}")
            continue
        if kind == "value_error":
            lines.append(f"{where}: {dotted}: {ctx.get('error', e['msg'])}")
            continue
        if kind == "extra_forbidden":
            parent = _model_at(loc[:-1])
            known = list(parent.model_fields) if parent else []
            hint = difflib.get_close_matches(loc[-1], known, n=1)
            fix = f"did you mean '{hint[0]}'?" if hint else f"known: {', '.join(known)}"
            lines.append(f"{where}: {dotted}: unknown key ({fix})")
            continue
        expect = _EXPECT.get(kind)
        got = e.get("input")
        detail = f"got {got!r}, expected {expect(ctx)}" if expect else f"got {got!r}"
        lines.append(f"{where}: {dotted}: {e['msg']} ({detail})")
    return lines


# --------------------------------------------------------------------------- entry points


def resolve_config(
    config: str | Path | None = None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> ResolvedConfig:
    """Resolve defaults < file/preset < env < overrides into a validated config."""
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    origin = DEFAULT_SOURCE
    if config is not None:
        for label, data in _file_layers(str(config)):
            _deep_merge(merged, data)
            sources.update(dict.fromkeys(_flatten(data), label))
            origin = label
    env_data, env_where = _env_layer(environ)
    _deep_merge(merged, env_data)
    sources.update(env_where)
    set_data = parse_overrides(overrides)
    _deep_merge(merged, set_data)
    sources.update(dict.fromkeys(_flatten(set_data), "--set"))
    try:
        cfg = JaxlabConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, sources, origin)) from None
    full = {k: sources.get(k, DEFAULT_SOURCE) for k in _flatten(to_dict(cfg, secrets=False))}
    return ResolvedConfig(config=cfg, sources=full, origin=origin)


@dataclass(frozen=True)
class EnvOverride:
    """A field a ``JAXLAB_*`` variable set to something other than a config file's value."""

    key: str  # dotted field name
    variable: str  # the environment variable that set it
    value: Any  # as the variable set it (None: unset)
    stored: Any  # as the file has it (None: unset)


def env_overrides(
    path: str | Path, environ: Mapping[str, str] | None = None
) -> tuple[ResolvedConfig, list[EnvOverride]]:
    """Resolve the config file ``path`` with ``JAXLAB_*`` variables on top, and list each
    field a variable changed from the file's value (a stored config, such as a run
    directory's ``config.toml``, can then refuse them by name)."""
    stored = _flatten(to_dict(resolve_config(path, environ={}).config))
    resolved = resolve_config(path, environ=environ)
    now = _flatten(to_dict(resolved.config))
    changed = []
    for key in sorted(set(stored) | set(now)):
        source = resolved.sources.get(key, "")
        if source.startswith("env ") and stored.get(key) != now.get(key):
            changed.append(
                EnvOverride(key, source.removeprefix("env "), now.get(key), stored.get(key))
            )
    return resolved, changed


def load_config(
    config: str | Path | None = None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> JaxlabConfig:
    return resolve_config(config, overrides, environ).config


def with_overrides(cfg: JaxlabConfig, overrides: Sequence[str], *, label: str) -> JaxlabConfig:
    """``cfg`` with ``section.field=value`` overrides applied (parsed as ``--set`` values)
    and validated as a whole; a problem is a ``ConfigError`` whose lines start with
    ``label`` (e.g. the benchmark variant that asked for it)."""
    try:
        top = parse_overrides(overrides)
    except ConfigError as e:
        raise ConfigError([f"{label}: {issue}" for issue in e.issues]) from None
    merged = _deep_merge(to_dict(cfg, secrets=True), top)
    try:
        return JaxlabConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, dict.fromkeys(_flatten(top), label), label)) from None


def to_dict(cfg: JaxlabConfig, *, secrets: bool = False) -> dict[str, Any]:
    """The config as TOML-able data: None values dropped (TOML has no null)."""
    data = cfg.model_dump(mode="json")
    if secrets and cfg.serve.api_key is not None:
        data["serve"]["api_key"] = cfg.serve.api_key.get_secret_value()

    def strip(d: Any) -> Any:
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if v is not None}
        return d

    return strip(data)


def to_toml(cfg: JaxlabConfig, *, secrets: bool = False) -> str:
    return tomli_w.dumps(to_dict(cfg, secrets=secrets))


def from_toml(text: str) -> JaxlabConfig:
    return JaxlabConfig.model_validate(tomllib.loads(text))


def config_hash(cfg: JaxlabConfig) -> str:
    """A short stable hash of everything that affects results (secrets excluded)."""
    blob = json.dumps(to_dict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def validate_file(path: str | Path) -> list[str]:
    """All problems of one config file (empty list = valid)."""
    try:
        resolve_config(path, environ={})
    except ConfigError as e:
        return e.issues
    return []
