"""Typed config sections: each field is type- and range-checked when a section is built.

The generic part of configuration: any frozen dataclass deriving from :class:`Section` gets the
same one-line ``ConfigError`` messages, whether the value came from a TOML file, a ``--set``
override or Python. The trainer's sections and the GPT recipe's sections are both built on it,
and so can a research project's own ``[model]`` section. Stdlib only (no jax).
"""

import ast
import dataclasses
import inspect
import io
import math
import operator
import textwrap
import tokenize
import types
from dataclasses import field
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

from jaxmp.errors import ConfigError

_BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"),
           "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def show(value: Any) -> str:
    """repr() kept to one short line, for error messages."""
    text = repr(list(value) if isinstance(value, tuple) else value)
    return text if len(text) <= 80 else text[:77] + "..."


def require(ok: bool, key: str, why: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}, got {show(value)}")


def describe(tp: Any) -> str:
    simple = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    if tp in simple:
        return simple[tp]
    if get_origin(tp) is tuple:
        return "a list of " + describe(get_args(tp)[0]).split(" ", 1)[1] + "s"
    if get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in get_args(tp))
    return " or ".join(describe(t) for t in get_args(tp))  # a union


def coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the field type; return it normalised (int→float, list→tuple).

    Strict on purpose: ``train.steps=1.5`` or ``=true`` is a typo, not something to round.
    """
    origin, is_num = get_origin(tp), isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (Union, types.UnionType):
        for member in get_args(tp):
            try:
                return coerce(key, member, value)
            except ConfigError:
                pass
    elif origin is Literal:
        if isinstance(value, str) and value in get_args(tp):
            return value
        if isinstance(value, str) and len(get_args(tp)) > 1:
            choices = ", ".join(repr(a) for a in get_args(tp))
            raise ConfigError(f"{key}: must be one of {choices}, got {show(value)}")
    elif origin is tuple and isinstance(value, (list, tuple)):
        return tuple(coerce(f"{key}[{i}]", get_args(tp)[0], v) for i, v in enumerate(value))
    elif tp is float and is_num:
        require(math.isfinite(value), key, "expected a finite number", value)
        return float(value)
    elif (tp is int and is_num and isinstance(value, int)) or (tp in (bool, str)
                                                                and isinstance(value, tp)):
        return value
    raise ConfigError(f"{key}: expected {describe(tp)}, got {show(value)}")


def describe_bounds(bounds: Any) -> str:
    """A field's range bounds in words: ``{"ge": 1, "lt": 1}`` → ``">= 1 and < 1"``."""
    return " and ".join(f"{_BOUNDS[op][1]} {b}" for op, b in bounds.items())


def bounded(default: Any, **bounds: float) -> Any:
    """A field with range bounds (ge/gt/le/lt) that ``Section`` checks at construction."""
    return field(default=default, metadata=bounds)


class Section:
    """Base of every section: type- and range-check each field at construction.

    Checking in ``__post_init__`` (not only in the loader) gives Python users who build a config
    by hand (``Config(train=TrainConfig(steps=0))``) the same errors as TOML users.
    """

    section: ClassVar[str]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            key = f"{self.section}.{f.name}"
            value = coerce(key, f.type, getattr(self, f.name))
            if f.metadata and not all(_BOUNDS[op][0](value, b) for op, b in f.metadata.items()):
                raise ConfigError(f"{key}: must be {describe_bounds(f.metadata)}, "
                                  f"got {show(value)}")
            object.__setattr__(self, f.name, value)
        self._validate()

    def _validate(self) -> None:
        """Constraints between fields of one section (ranges are in the field metadata)."""


def field_docs(section: type) -> dict[str, str]:
    """Each field's meaning, read from the section's source: the comment lines right above the
    field, then the comment on its own line(s). The schema stays plain dataclass code, and the
    generated reference (docs/config.md) cannot drift from it. A field without one maps to ""."""
    source = textwrap.dedent(inspect.getsource(section))
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, on a line of its own)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            alone = not tok.line[:tok.start[1]].strip()
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), alone)
    names = [f.name for f in dataclasses.fields(section)]
    docs = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id in names):
            continue
        above, line = [], node.lineno - 1
        while line in comments and comments[line][1]:
            above.insert(0, comments[line][0])
            line -= 1
        after = [comments[n][0] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                 if n in comments and not comments[n][1]]
        docs[node.target.id] = " ".join(above + after)
    return {name: docs.get(name, "") for name in names}
