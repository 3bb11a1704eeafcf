"""Regenerate the references generated from the code: docs/config.md (every config key, from
the schema) and docs/cli.md (every command and flag, from the parser).

    python scripts/docs.py

Run it after adding or changing a config key or a command-line flag; tests/test_docs.py fails
until the files match the code.
"""
from __future__ import annotations

import sys
from pathlib import Path

from jaxmp.cli import build_parser
from jaxmp.tools.docs import references

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    for path, text in references(build_parser()).items():
        target = ROOT / path
        if target.is_file() and target.read_text() == text:
            print(f"{path}: up to date")
            continue
        target.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
