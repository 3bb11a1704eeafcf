"""The trainer's side of checkpoints: restore-or-init, periodic and final saves.

``Trainer.fit`` calls four things, top to bottom: :meth:`TrainCheckpointer.restore` (the newest
readable complete step, falling back past damaged ones), :func:`resume_iterator` (continue the
data stream where the checkpoint left it), :meth:`TrainCheckpointer.maybe_save` after every step
and :meth:`TrainCheckpointer.close` (wait for the last async write). The files themselves are
:mod:`jaxmp.checkpoint`'s business; signals are :mod:`jaxmp.train.preempt`'s.

Saves are asynchronous by default: ``save`` returns once the arrays are copied to host memory
(so the next step may donate its buffers) and the files are written on a background thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import jax
from jax.experimental import multihost_utils
import numpy as np

from jaxmp import sharding
from jaxmp._util.log import say
from jaxmp.checkpoint import records as tree
from jaxmp.checkpoint import store
from jaxmp.config import CheckpointConfig, TrainerConfig, config_to_toml
from jaxmp.errors import CheckpointError


def _all_agree(ok: bool) -> bool:
    """True when every process says ok (one tiny all-gather; free on one process)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array([ok]))))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


@dataclass(frozen=True)
class Resumed:
    """What a resume restores: the train state and the data iterator's state (or None)."""

    state: Any
    data_state: dict | None
    step: int


class TrainCheckpointer:
    """Checkpoints of one run directory for a state with ``layout`` (see :mod:`jaxmp.train.state`)."""

    def __init__(self, run_dir: str | Path, config: TrainerConfig, layout: Any,
                 path_rules: Sequence | None = None, rules: Sequence | None = None):
        self.cfg: CheckpointConfig = config.checkpoint
        self.dir = Path(run_dir) / "checkpoints"
        self.layout, self.path_rules, self.rules = layout, path_rules, rules
        self.config_toml = config_to_toml(config)
        self.plan_path = Path(run_dir) / "plan.json"
        abstract = tree.entries(layout.abstract, path_rules)
        self.paths = [e.path for e in abstract]
        self.expected = {e.path: tree.record(e) for e in abstract}
        shardings = jax.tree_util.tree_leaves(layout.shardings)
        if len(shardings) != len(self.paths):  # pragma: no cover - a layout bug, not user input
            raise RuntimeError("layout.shardings does not match layout.abstract")
        self.shardings = dict(zip(self.paths, shardings))
        self.manager = None
        self.last_saved: int | None = None

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    # -- restore ------------------------------------------------------------------------------
    def restore(self) -> Resumed | None:
        """State and data state of the newest readable complete step, or None (fresh run)."""
        if not self.enabled:
            return None
        _barrier("jaxmp_ckpt_restore")  # every process looks before any creates the folder
        exists = self.dir.is_dir()
        if exists and jax.process_index() == 0:
            for info in store.scan(self.dir, sizes=False):  # e.g. "12/" missing its marker
                if info.status == "incomplete" and info.path.name.isdigit():
                    moved = store.set_aside(info.path, "incomplete")
                    say(f"jaxmp: warning: {info.path} is an incomplete save; moved to "
                        f"{moved.name}")
        _barrier("jaxmp_ckpt_scan")
        found = store.latest_readable(self.dir, self._load_agreed, say, self._damaged) \
            if exists else None
        self._open()
        if found is None:
            return None
        step, (state, data_state) = found
        self.last_saved = step
        say(f"jaxmp: resuming from checkpoint step {step} in {self.dir}")
        return Resumed(state, data_state, step)

    def _load_agreed(self, step_dir: Path) -> tuple[Any, dict | None]:
        error, result = None, None
        try:
            result = self._load(step_dir)
        except store.DamagedCheckpoint as e:
            error = e
        if not _all_agree(error is None):
            raise error or store.DamagedCheckpoint(
                f"checkpoint {step_dir} cannot be read on another process")
        return result

    def _load(self, step_dir: Path) -> tuple[Any, dict | None]:
        meta = store.read_meta(step_dir)
        problem = tree.mismatch(meta["arrays"], self.expected)
        if problem:  # the user's config changed: an error, not damage to fall back from
            raise CheckpointError(f"checkpoint {step_dir} does not fit the configured model: "
                                  f"{problem}")
        stored = meta["arrays"]
        moved = {p for p in self.expected if tree.needs_conversion(stored[p], self.expected[p])}
        placed = {**self.shardings, **tree.shardings_on(
            {p: stored[p] for p in moved}, self.layout.mesh,
            self.rules if self.rules is not None else sharding.DEFAULT_RULES)}
        flat = tree.flat_paths(store.restore_arrays(step_dir, tree.target(stored, placed)))
        for p in moved:  # e.g. a run resumed with other pipeline stages, or without them
            flat[p] = tree.convert(flat[p], stored[p], self.expected[p], self.shardings[p])
        state = tree.rebuild(self.layout.abstract, tree.rewrap(flat, meta["arrays"]),
                             self.path_rules)
        return state, store.read_json(step_dir, "data", missing_ok=True)

    def _damaged(self, step_dir: Path) -> None:
        """Move a damaged step aside so this run can save that step again later."""
        _barrier("jaxmp_ckpt_damaged_pre")
        if jax.process_index() == 0:
            moved = store.set_aside(step_dir, "damaged")
            say(f"jaxmp: moved the damaged checkpoint to {moved}")
        _barrier("jaxmp_ckpt_damaged_post")

    # -- save ---------------------------------------------------------------------------------
    def _open(self) -> None:
        if self.enabled and self.manager is None:
            self.manager = store.open_manager(self.dir, keep=self.cfg.keep,
                                              keep_period=self.cfg.keep_period,
                                              async_save=self.cfg.async_save)

    def maybe_save(self, step: int, state: Any, data_iter: Any = None, *,
                   force: bool = False) -> bool:
        """Save ``state`` at ``step`` if it is due (every ``checkpoint.every``) or forced."""
        due = force or (self.cfg.every > 0 and step % self.cfg.every == 0)
        if not self.enabled or not due or step == self.last_saved:
            return False
        self._open()
        if step in self.manager.all_steps():  # e.g. a state set by hand over an old run dir
            say(f"jaxmp: warning: checkpoint step {step} already exists in {self.dir}; "
                f"not overwriting it")
            self.last_saved = step
            return False
        items = tree.entries(state, self.path_rules)
        records = {e.path: tree.record(e) for e in items}
        meta = store.make_meta(step, records, tree.saved_mesh([e.value for e in items]))
        get_state = getattr(data_iter, "get_state", None)
        self.manager.save(step, force=True, args=store.save_args(
            tree.to_pure(items), meta, self._run_info(), get_state() if get_state else None))
        self.last_saved = step
        return True

    def _run_info(self) -> dict[str, Any]:
        plan = None
        if jax.process_index() == 0 and self.plan_path.is_file():
            plan = json.loads(self.plan_path.read_text())
        return {"config_toml": self.config_toml, "plan": plan}

    def close(self) -> None:
        """Wait for a pending async save to be committed, then release the manager."""
        if self.manager is not None:
            self.manager.wait_until_finished()
            self.manager.close()
            self.manager = None


def resume_iterator(data: Iterable, resumed: Resumed | None) -> Iterator:
    """An iterator over ``data`` that continues the stream where ``resumed`` left it.

    Iterators with ``set_state`` (``jaxmp.data.BatchIterator``, Grain) jump straight there,
    from a state that is global (the step), so a different device or process count continues
    the same batches. Anything else is advanced by reading and dropping the consumed batches.
    """
    if resumed is None:
        return iter(data)
    if resumed.data_state is not None and hasattr(data, "set_state"):
        data.set_state(resumed.data_state)
        return iter(data)
    it = iter(data)
    if resumed.data_state is not None and hasattr(it, "set_state"):
        it.set_state(resumed.data_state)
        return it
    if resumed.step:
        say(f"jaxmp: the data iterator has no set_state; skipping {resumed.step} batches to "
            f"continue the stream")
        for _ in range(resumed.step):
            if next(it, None) is None:
                raise RuntimeError(f"the data iterator ran out while skipping {resumed.step} "
                                   f"batches to resume")
    return it
