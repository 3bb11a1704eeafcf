"""A failed async save's leftovers are dropped, nothing else (jaxmp.checkpoint.orphans)."""
from __future__ import annotations

import asyncio
import logging
import sys
import time

import tensorstore as ts

from jaxmp.checkpoint.orphans import quiet_failed_save_leftovers


def test_only_a_closed_loops_callbacks_and_unretrieved_save_writes_are_dropped(
        monkeypatch, caplog):
    seen: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    monkeypatch.setattr(logging.getLogger("asyncio"), "filters", [])
    quiet_failed_save_leftovers()

    promise, future = ts.Promise.new()  # a TensorStore write still in flight ...
    loop = asyncio.new_event_loop()

    async def wait() -> None:
        await future

    task = loop.create_task(wait())
    loop.run_until_complete(asyncio.sleep(0.01))
    loop.close()  # ... when its event loop is closed (Orbax, after a failed save)
    promise.set_result(1)  # its callback meets the closed loop: an unraisable RuntimeError
    time.sleep(0.1)
    task._log_destroy_pending = False  # the test's own pending task: no "destroyed" report
    sys.unraisablehook(type("U", (), {"exc_value": ValueError("other"), "exc_traceback": None})())
    assert [str(e) for e in seen] == ["other"]

    with caplog.at_level(logging.ERROR):
        log = logging.getLogger("asyncio")
        log.error("Task exception was never retrieved\nfuture: <Task exception=ValueError("
                  "'Error writing /run/checkpoints/2.orbax-checkpoint-tmp/state')>")
        log.error("Task exception was never retrieved\nfuture: <Task exception=KeyError()>")
    assert [r.getMessage().count("KeyError") for r in caplog.records] == [1]
