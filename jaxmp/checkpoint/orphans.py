"""Quiet what a failed async save leaves behind, so its one-line error stands alone.

When one array of an async Orbax save fails (disk full, a file-size limit), Orbax closes its
event loop while TensorStore still has the other arrays' writes in flight. They leave two kinds
of noise on stderr, hundreds of tracebacks in all, printed from other threads and at exit while
jaxmp writes its one-line error (which they may split or bury):

- each write completes into ``loop.call_soon_threadsafe`` on the closed loop, and TensorStore
  reports the ``RuntimeError('Event loop is closed')`` as an *unraisable* exception;
- asyncio logs every failed write task nobody awaited any more ("exception was never
  retrieved"), naming the save's temporary directory.

The failure itself is reported by the save that raised it (and its partial directory removed),
so exactly these are dropped; every other unraisable exception or asyncio log record passes.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

TMP_MARK = ".orbax-checkpoint-tmp"  # in every path of a save still being written
_MARK = "_jaxmp_quiets_failed_saves"


def _is_orphaned_callback(unraisable: Any) -> bool:
    """``asyncio``'s ``call_soon_threadsafe`` refusing a closed loop, called from native code."""
    error, tb = unraisable.exc_value, unraisable.exc_traceback
    return (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
            and tb is not None and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"
            and "asyncio" in tb.tb_frame.f_code.co_filename)


class _UnretrievedWriteFailures(logging.Filter):
    """asyncio's report of a write into a partial save that failed with nobody awaiting it."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("exception was never retrieved" in text and TMP_MARK in text)


def quiet_failed_save_leftovers() -> None:
    """Install both filters (once per process; calling again does nothing)."""
    previous = sys.unraisablehook
    if not getattr(previous, _MARK, False):
        def hook(unraisable: Any) -> None:
            if not _is_orphaned_callback(unraisable):
                previous(unraisable)

        setattr(hook, _MARK, True)
        sys.unraisablehook = hook
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _UnretrievedWriteFailures) for f in asyncio_log.filters):
        asyncio_log.addFilter(_UnretrievedWriteFailures())
