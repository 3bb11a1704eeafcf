"""The ``jaxmp`` command: argument parsing and exit codes only; the work is in the library.

jax is imported only after the environment is settled (the platform, ``--simulate-devices``
and the config's XLA flags must be decided before the backend starts), so every sub-command
module imports the library inside its command function. Bad input (:class:`jaxmp.errors.BadInput`)
exits 2 with one line on stderr; runtime failures exit 1 with a clear message.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from jaxmp._util import env
from jaxmp.cli import bench, ckpt, data, plan, report, sample, train
from jaxmp.errors import BadInput, Failure

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxmp", description="A sharded trainer for JAX/Flax.")
    sub = p.add_subparsers(dest="command", required=True)
    for module in (train, plan, bench, ckpt, report, data, sample):
        module.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed its one-line usage error
        return int(e.code or 0) and EXIT_BAD_INPUT
    env.settle_platform()  # CPU when the CUDA plugin has no GPU to use (env.platform_note says)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head` and closed early: not a failure
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (BadInput, FileNotFoundError) as e:
        _say(f"jaxmp: error: {e}")
        return _leave(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        _say("jaxmp: interrupted")
        return _leave(130)
    except Exception as e:  # noqa: BLE001 - a runtime failure: one line, the traceback on request
        if os.environ.get("JAXMP_DEBUG"):
            raise
        peers = _peers()
        lost = peers.failure_line(e) if peers else None
        what = f"{e}" if isinstance(e, Failure) else \
            f"{type(e).__name__}: {e} (set JAXMP_DEBUG=1 for the traceback)"
        _say(f"jaxmp: failed: {lost or what}")
        return _leave(EXIT_FAILURE)


def _say(line: str) -> None:
    """``line`` on stderr in one write: ``print`` writes the text and its newline apart, and a
    library's background thread (Orbax's event loop closing) may write between them."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _peers():
    """:mod:`jaxmp.train.peers` if this process joined a multi-process run, else None (looked
    up, not imported: the CLI never imports jax itself)."""
    peers = sys.modules.get("jaxmp.train.peers")
    return peers if peers is not None and peers.joined() else None


def _leave(code: int) -> int:
    """A failed process of a multi-process run exits at once: a normal exit would wait in
    JAX's shutdown barrier for every process, including one that is gone."""
    peers = _peers()
    if peers is not None:
        peers.leave(code)
    return code
