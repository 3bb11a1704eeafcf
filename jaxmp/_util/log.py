"""Messages for the person running the job: one line on stderr, from process 0 only."""

from __future__ import annotations

import sys

import jax


def say(text: str) -> None:
    """Print ``text`` on stderr (flushed) on process 0; other processes stay quiet."""
    if jax.process_index() == 0:
        print(text, file=sys.stderr, flush=True)
