"""Loading and writing configs: TOML file + ``section.key=value`` overrides → a typed config.

Generic over the *schema* (a :class:`~jaxmp.config.sections.TrainerConfig` subclass): every
mistake in a file or a ``--set`` surfaces as one :class:`ConfigError` line naming the key, so
the CLI can print it and exit 2 before any device work starts. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from jaxmp.config.fields import ConfigError, coerce, require, show
from jaxmp.config.sections import RENAMED, TrainerConfig, section_types

C = TypeVar("C", bound=TrainerConfig)


def _fields(schema: type) -> dict[str, dict[str, Any]]:
    return {s: {f.name: f.type for f in dataclasses.fields(cls)}
            for s, cls in section_types(schema).items()}


def _check_section(schema: type, section: str, where: str = "") -> None:
    sections = section_types(schema)
    if section not in sections:
        close = difflib.get_close_matches(section, list(sections), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"sections: {', '.join(sections)}"
        raise ConfigError(f"unknown config section '{section}'{where} ({hint})")


_WARNED: set[str] = set()


def _renamed(section: str, key: str, value: Any) -> tuple[str, str, Any]:
    """A renamed key's new name and value, after one deprecation line (once per process)."""
    old = f"{section}.{key}"
    new, values = RENAMED[old]
    if old not in _WARNED:
        _WARNED.add(old)
        print(f"jaxmp: config key '{old}' is deprecated: use '{new}'", file=sys.stderr,
              flush=True)
    section, _, key = new.partition(".")
    return section, key, values.get(value, value) if isinstance(value, str) else value


def _set(schema: type, raw: dict[str, dict[str, Any]], section: str, key: str,
         value: Any) -> None:
    """Type-check one value into ``raw``; an unknown key gets the likeliest intended name."""
    fields = _fields(schema)
    if f"{section}.{key}" in RENAMED and key not in fields.get(section, {}):
        section, key, value = _renamed(section, key, value)
    types_ = fields[section]
    if key not in types_:
        everywhere = [f"{s}.{k}" for s in fields for k in fields[s]]
        guess = ([f"{section}.{k}" for k in difflib.get_close_matches(key, list(types_), n=1)]
                 or [name for name in everywhere if name.endswith("." + key)]  # wrong section
                 or difflib.get_close_matches(f"{section}.{key}", everywhere, n=1))
        hint = f" (did you mean '{guess[0]}'?)" if guess else ""
        raise ConfigError(f"unknown config key '{section}.{key}'{hint}")
    raw.setdefault(section, {})[key] = coerce(f"{section}.{key}", types_[key], value)


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {' '.join(str(exc).split())}") from None
    except (OSError, UnicodeDecodeError) as exc:  # unreadable, or not UTF-8 text
        raise ConfigError(f"{path}: cannot read: {' '.join(str(exc).split())}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split ``"section.key=value"``; the value is TOML if it parses, else a bare string.

    The bare-string fallback lets shells pass ``model.activation=swiglu`` or
    ``data.source=/data/tokens.bin`` without nested quoting.
    """
    lhs, eq, rhs = text.partition("=")
    section, dot, key = lhs.strip().partition(".")
    if not (eq and dot and section and key.strip()):
        raise ConfigError(f"malformed override {show(text)}: expected section.key=value")
    try:
        parsed = tomllib.loads(f"v = {rhs}")
        value = parsed["v"] if len(parsed) == 1 else rhs.strip()  # "1\nw = 2" is no value
    except tomllib.TOMLDecodeError:
        value = rhs.strip()
    return section, key.strip(), value


def _build(schema: type[C], raw: Mapping[str, Mapping[str, Any]]) -> C:
    return schema(**{name: cls(**raw.get(name, {}))
                     for name, cls in section_types(schema).items()})


def load(schema: type[C], path: str | os.PathLike | None = None,
         overrides: Sequence[str] = ()) -> C:
    """Defaults of ``schema``, then the file, then each ``section.key=value`` in order."""
    if isinstance(overrides, str):  # a lone string would otherwise iterate per character
        overrides = [overrides]
    raw: dict[str, dict[str, Any]] = {}
    if path is not None:
        path = Path(path)
        for section, table in _read_toml(path).items():
            try:
                _check_section(schema, section)
                require(isinstance(table, dict), section, "expected a [section] table", table)
                for key, value in table.items():
                    _set(schema, raw, section, key, value)
            except ConfigError as exc:
                raise ConfigError(f"{path}: {exc}") from None
    for text in overrides:
        section, key, value = parse_override(text)
        _check_section(schema, section, f" in override {show(text)}")
        _set(schema, raw, section, key, value)
    return _build(schema, raw)


def replace(config: C, **sections: Mapping[str, Any]) -> C:
    """A new, re-validated config with fields changed: ``replace(cfg, train={"steps": 10})``."""
    schema = type(config)
    raw = config_to_dict(config)
    for name, update in sections.items():
        _check_section(schema, name)
        for key, value in update.items():
            _set(schema, raw, name, key, value)
    return _build(schema, raw)


def config_to_dict(config: TrainerConfig) -> dict[str, dict[str, Any]]:
    """``{section: {key: value}}`` with plain TOML/JSON values (tuples become lists)."""
    return {name: {k: list(v) if isinstance(v, tuple) else v
                   for k, v in dataclasses.asdict(getattr(config, name)).items()}
            for name in section_types(type(config))}


def toml_value(value: Any) -> str:
    """A value as TOML writes it (a config.toml line, a default in docs/config.md)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    escape = {"\\": "\\\\", '"': '\\"'}
    return '"' + "".join(escape.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 32 or ord(c) == 127
                                           else c) for c in value) + '"'


def config_to_toml(config: TrainerConfig) -> str:
    """The effective config as TOML (a run directory's config.toml); loads back equal."""
    lines = ["# Effective jaxmp config: defaults, then the config file, then --set overrides."]
    for name, table in config_to_dict(config).items():
        lines += ["", f"[{name}]"] + [f"{k} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"
