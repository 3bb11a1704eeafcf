"""The generated references: docs/config.md from the config schema, docs/cli.md from the
argparse parser. ``python scripts/docs.py`` writes them; tests/test_docs.py regenerates them in
memory and fails when a file differs, so neither can drift from the code.

The configuration reference takes every key, its type, its bounds and its default from the
dataclasses (:mod:`jaxmp.config.sections`, :mod:`jaxmp.recipes.gpt_config`) and its meaning from
the comment beside the field (:func:`jaxmp.config.fields.field_docs`). The CLI reference walks
the parser ``jaxmp.cli.build_parser()`` returns (passed in: the CLI is the layer above this
one). Stdlib only: no jax.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
from typing import Any, Literal, Union, get_args, get_origin

from jaxmp.config import RENAMED, TrainerConfig, section_types
from jaxmp.config.fields import describe_bounds, field_docs
from jaxmp.config.io import toml_value
from jaxmp.recipes.gpt_config import Config

COMMAND = "python scripts/docs.py"
CONFIG_DOC, CLI_DOC = "docs/config.md", "docs/cli.md"
WIDTH = 100  # usage lines are wrapped at this width, whatever the terminal's


class MissingDoc(ValueError):
    """A config field without a comment: the reference would have an empty meaning."""


def _generated(source: str) -> str:
    return (f"*Generated from {source} by `{COMMAND}`; edit those, not this file "
            f"(tests/test_docs.py checks that it is up to date).*")


def _markdown(docstring: str) -> str:
    """A docstring as Markdown prose: reST roles and double backticks become code spans."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", docstring)
    text = text.replace("``", "`")
    return "\n\n".join(" ".join(p.split()) for p in text.split("\n\n") if p.strip())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def type_name(tp: Any) -> str:
    """A field type for people: ``int``, ``"a"``, ``"b"``, ``int or "auto"``, ``list of int``."""
    if tp in (int, float, bool):
        return tp.__name__
    if tp is str:
        return "string"
    if get_origin(tp) is tuple:
        return f"list of {type_name(get_args(tp)[0])}"
    if get_origin(tp) is Literal:
        return ", ".join(f'`"{a}"`' for a in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(type_name(t) for t in get_args(tp))
    raise TypeError(f"no name for the config type {tp!r}")


def config_keys(schema: type[TrainerConfig] = Config) -> list[dict[str, str]]:
    """Every key of ``schema``: ``{"key", "type", "default", "meaning"}`` (the reference's rows;
    the doc tests check defaults quoted in the docs against these)."""
    rows, missing = [], []
    for name, section in section_types(schema).items():
        docs = field_docs(section)
        for f in dataclasses.fields(section):
            kind = type_name(f.type)
            if f.metadata:
                kind += f" ({describe_bounds(f.metadata)})"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append({"key": f"{name}.{f.name}", "type": kind,
                         "default": toml_value(list(default) if isinstance(default, tuple)
                                               else default),
                         "meaning": docs[f.name]})
            if not docs[f.name]:
                missing.append(f"{name}.{f.name} ({inspect.getsourcefile(section)})")
    if missing:
        raise MissingDoc("config keys without a comment saying what they mean: "
                         + ", ".join(missing) + " — add one on the field's line")
    return rows


def config_reference(schema: type[TrainerConfig] = Config) -> str:
    """docs/config.md: one table per section, then the renamed keys."""
    rows = config_keys(schema)
    sections = section_types(schema)
    recipe = {f.name for f in dataclasses.fields(schema)} - {
        f.name for f in dataclasses.fields(TrainerConfig)}
    out = ["# Configuration reference", "",
           _generated("the config schema (`jaxmp/config/sections.py`, "
                      "`jaxmp/recipes/gpt_config.py`)"), "",
           "A config is a TOML file with one table per section; every key can also be set on "
           "the command line with `--set section.key=value` (after the file, in order). The "
           "defaults are `configs/tiny.toml`. A mistake in a key or a value is one line naming "
           "it and exit code 2. `[model]` and `[data]` belong to the GPT recipe "
           "(`jaxmp.load_config`'s default schema); research code that loads "
           "`jaxmp.TrainerConfig` has the other sections only.", "",
           "Sections: " + " · ".join(f"[`[{s}]`](#{s})" for s in sections), ""]
    for name, section in sections.items():
        out += [f"## {name}", "", f"`[{name}]`" + (" — GPT recipe" if name in recipe else "")
                + ": " + _markdown(inspect.getdoc(section) or ""), "",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{r['key']}` | {_cell(r['type'])} | `{r['default']}` | "
                f"{_cell(r['meaning'])} |" for r in rows if r["key"].startswith(name + ".")]
        out.append("")
    out += ["## Renamed keys", "",
            "Old names keep working: each use prints one deprecation line naming the new key.",
            "", "| old key | new key | values renamed |", "|---|---|---|"]
    for old, (new, values) in RENAMED.items():
        renamed = ", ".join(f"`{a}` → `{b}`" for a, b in values.items())
        out.append(f"| `{old}` | `{new}` | {renamed} |")
    return "\n".join(out) + "\n"


def _subcommands(parser: argparse.ArgumentParser
                 ) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each sub-command, in the order they were added."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            out += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return out


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _argument(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}`"
    takes = action.nargs != 0
    choices = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else ""
    metavar = action.metavar or choices or action.dest.upper()
    return ", ".join(f"`{o}{' ' + metavar if takes else ''}`" for o in action.option_strings)


def _default(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.default in (None, argparse.SUPPRESS) or action.default == []:
        return ""
    return f"`{action.default}`" if action.default != "" else '`""`'


def _command(name: str, parser: argparse.ArgumentParser, summary: str, depth: int) -> list[str]:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    out = [f"{'#' * depth} {parser.prog}", ""]
    about = parser.description or summary
    if about:
        out += [" ".join(about.split()), ""]
    out += ["```", _usage(parser), "```", ""]
    rows = [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
            and a.help != argparse.SUPPRESS]
    if rows:
        out += ["| argument | default | meaning |", "|---|---|---|"]
        out += [f"| {_cell(_argument(a))} | {_cell(_default(a))} | "
                f"{_cell(' '.join(formatter._expand_help(a).split()) if a.help else '')} |"
                for a in rows]
        out.append("")
    for sub_name, help_, sub in _subcommands(parser):
        out += _command(sub_name, sub, help_, depth + 1)
    return out


def cli_reference(parser: argparse.ArgumentParser) -> str:
    """docs/cli.md: every command and sub-command, its usage, each argument's default and help."""
    out = [f"# Command-line reference", "",
           _generated("the argparse parser (`jaxmp/cli/`)"), "",
           " ".join((parser.description or "").split()), "",
           "Exit codes: 0 success, 2 bad input (one line on stderr naming the key, file or "
           "value), 1 runtime failure. `--devices N` means the number of devices used (the "
           "first N present) in every command; `--simulate-devices N` gives the CPU backend N "
           "simulated devices before jax starts.", "",
           "Commands: " + ", ".join(f"`{parser.prog} {n}`" for n, _, _ in
                                    _subcommands(parser)), ""]
    for name, help_, sub in _subcommands(parser):
        out += _command(name, sub, help_, 2)
    return "\n".join(out).rstrip("\n") + "\n"


def references(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``{path relative to the repository: text}`` of every generated reference."""
    return {CONFIG_DOC: config_reference(), CLI_DOC: cli_reference(parser)}
