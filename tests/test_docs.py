"""The docs stay true: the generated references match the code, every repository path the docs
quote exists, every config key they quote exists, and every default they quote is the schema's.
"""
from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

from jaxmp.cli import build_parser
from jaxmp.config import RENAMED
from jaxmp.tools.docs import COMMAND, config_keys, references

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
KEYS = {r["key"]: r for r in config_keys()}
SECTIONS = {k.split(".")[0] for k in KEYS}
# A repository path: a top-level folder, then path characters (globs allowed).
PATH = re.compile(r"(?<![\w/.~-])((?:jaxmp|scripts|docs|examples|configs|tests|\.ci)/[\w./*-]*)")
# A package-relative path as docs/architecture.md writes them: `plan/make.py`, `cli/plan.py`.
PACKAGE_PATH = re.compile(r"`([a-z_]+/[\w/]+\.py)`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
KEY = re.compile(r"(?<![\w./])(%s)\.([a-z_][a-z0-9_]*)\b(?![(./])" % "|".join(sorted(SECTIONS)))
# Not config keys: files and functions whose names start with a section's name.
NOT_KEYS = {"train.bin", "train.py", "data.py", "mesh.py", "pipeline.py", "model.safetensors",
            "checkpoint.restore", "mesh.make_mesh", "data.to_global"}


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("relative", sorted(references(build_parser())))
def test_generated_references_are_up_to_date(relative: str) -> None:
    expected = references(build_parser())[relative]
    path = ROOT / relative
    assert path.is_file() and _text(path) == expected, (
        f"{relative} is out of date with the code: run `{COMMAND}` and commit the result")


def _exists(path: str) -> bool:
    path = path.rstrip(".,:;)")
    if "*" in path:
        return bool(glob.glob(str(ROOT / path)))
    return (ROOT / path).exists()


def test_every_quoted_repository_path_exists() -> None:
    missing = []
    for doc in DOCS:
        text = _text(doc)
        for n, line in enumerate(text.splitlines(), 1):
            where = f"{doc.relative_to(ROOT)}:{n}"
            for path in PATH.findall(line):
                if not _exists(path.split("::")[0]):
                    missing.append(f"{where}: {path}")
            for path in PACKAGE_PATH.findall(line):
                if path.split("/")[0] in {p.name for p in (ROOT / "jaxmp").iterdir()} and \
                        not (ROOT / "jaxmp" / path).exists() and not _exists(path):
                    missing.append(f"{where}: {path} (in jaxmp/)")
            for link in LINK.findall(line):
                if "://" not in link and not (doc.parent / link).exists():
                    missing.append(f"{where}: link {link}")
    assert not missing, "paths quoted in the docs that do not exist:\n" + "\n".join(missing)


def _quoted_keys(text: str) -> list[tuple[int, str]]:
    """``section.key`` names inside code spans and code blocks, with their line numbers."""
    found, in_block = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        spans = [line] if in_block else re.findall(r"`([^`]+)`", line)
        for span in spans:
            if span.startswith("jaxmp: error: unknown"):  # a quoted message about a typo
                continue
            found += [(n, f"{s}.{k}") for s, k in KEY.findall(span)]
    return [(n, key) for n, key in found if key not in NOT_KEYS]


def test_every_quoted_config_key_exists() -> None:
    unknown = [f"{doc.relative_to(ROOT)}:{n}: {key}" for doc in DOCS
               for n, key in _quoted_keys(_text(doc)) if key not in KEYS and key not in RENAMED]
    assert not unknown, ("config keys quoted in the docs that the schema does not have (nor "
                         "RENAMED as an alias):\n" + "\n".join(unknown))


def _plain(value: str) -> str:
    return value.strip().strip("`").strip().strip('"').strip()


def _same(quoted: str, key: str) -> bool:
    a, b = _plain(quoted), _plain(KEYS[key]["default"])
    try:
        return float(a) == float(b)
    except ValueError:
        return a.lower() == b.lower()


def quoted_defaults(text: str) -> list[tuple[int, str, str]]:
    """(line, key, value) for each default the text states: a table's "default" column, a
    ``value (default`` cell, or ``key (default value)`` in prose. A table of bare key names
    takes its section from the heading above it (`` ## Keys (`[compression]`) ``)."""
    out, section, header = [], None, None
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            m = re.search(r"`\[(\w+)\]`", line)
            section, header = (m.group(1) if m else None), None
            continue
        if not line.startswith("|"):
            header = None
            for key, value in re.findall(r"`(\w+\.\w+)` \(default:? `?([^)`,;:]+)`?\)", line):
                if key in KEYS:
                    out.append((n, key, value))
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set(line) <= set("|-: "):
            continue
        name = _plain(cells[0])
        key = name if name in KEYS else f"{section}.{name}" if f"{section}.{name}" in KEYS \
            else None
        if key is None:
            continue
        if "default" in header:
            out.append((n, key, cells[header.index("default")]))
        for cell in cells[1:]:
            m = re.search(r"`([^`]+)` \(default", cell)
            if m:
                out.append((n, key, m.group(1)))
    return out


def test_quoted_defaults_match_the_schema() -> None:
    checked, wrong = 0, []
    for doc in DOCS:
        for n, key, value in quoted_defaults(_text(doc)):
            checked += doc.name != "config.md"  # the generated one agrees by construction
            if not _same(value, key):
                wrong.append(f"{doc.relative_to(ROOT)}:{n}: {key} default {value!r}, the "
                             f"schema says {KEYS[key]['default']}")
    assert not wrong, "defaults quoted in the docs that the schema contradicts:\n" + \
        "\n".join(wrong)
    assert checked >= 9, checked  # compression.md's and pipeline.md's tables, reliability.md


def test_the_default_checker_sees_a_wrong_default() -> None:
    """The checks above are not vacuous: each way of quoting a default is read."""
    doc = ("## Keys (`[compression]`)\n\n| key | default | what |\n|---|---|---|\n"
           "| `gradients` | `\"int8\"` | x |\n\n"
           "| key | values | meaning |\n|---|---|---|\n"
           "| `pipeline.schedule` | `1f1b` (default), `gpipe` | x |\n\n"
           "After `train.max_skipped` (default 7) skips it stops.\n")
    found = quoted_defaults(doc)
    assert [(k, _same(v, k)) for _, k, v in found] == [
        ("compression.gradients", False), ("pipeline.schedule", False),
        ("train.max_skipped", False)]
    assert _quoted_keys("`train.steps=3` and `model.eval()`, `mesh.nope`\n") == [
        (1, "train.steps"), (1, "mesh.nope")]


STUDY = re.compile(r"scripts/measure\.py ([a-z][a-z-]*)")


def test_every_quoted_study_exists(monkeypatch) -> None:
    """`python scripts/measure.py STUDY` in a doc names a study of the driver, and each study
    names a doc that quotes its command."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # as `python scripts/measure.py` runs
    import measure
    quoted = {(doc.relative_to(ROOT).as_posix(), name) for doc in DOCS
              for name in STUDY.findall(_text(doc))}
    unknown = sorted(f"{doc}: {name}" for doc, name in quoted if name not in measure.STUDIES)
    assert not unknown, f"docs quote studies scripts/measure.py does not have: {unknown}"
    unquoted = sorted(f"{name} -> {measure.study(name).DOC}" for name in measure.STUDIES
                      if (measure.study(name).DOC, name) not in quoted)
    assert not unquoted, f"studies whose doc does not quote their command: {unquoted}"


def test_the_driver_lists_its_studies_and_refuses_an_unknown_one(monkeypatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import measure

    assert measure.main([]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in measure.STUDIES)
    assert measure.main(["no-such-study"]) == 2
    assert "unknown study 'no-such-study'" in capsys.readouterr().err
