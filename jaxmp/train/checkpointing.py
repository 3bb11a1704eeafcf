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

import contextlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
from jax.experimental import multihost_utils
import numpy as np

from jaxmp import sharding
from jaxmp._util.arrays import tree_bytes
from jaxmp._util.fmt import fmt_bytes
from jaxmp._util.log import say
from jaxmp.checkpoint import checksum
from jaxmp.checkpoint import records as tree
from jaxmp.checkpoint import store
from jaxmp.config import CheckpointConfig, TrainerConfig, config_to_toml
from jaxmp.errors import CheckpointError, CheckpointWriteError
from jaxmp.train.guard import NonFiniteError


def _all_agree(ok: bool) -> bool:
    """True when every process says ok (one tiny all-gather; free on one process)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array([ok]))))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


PARAMS_ONLY = {"params_only": True}  # what _load returns as the data state of such a checkpoint


@dataclass(frozen=True)
class Resumed:
    """What a resume restores: the train state and the data iterator's state (or None)."""

    state: Any
    data_state: dict | None
    step: int


class TrainCheckpointer:
    """Checkpoints of one run directory for a state with ``layout`` (see :mod:`jaxmp.train.state`)."""

    def __init__(self, run_dir: str | Path, config: TrainerConfig, layout: Any,
                 path_rules: Sequence | None = None, rules: Sequence | None = None,
                 before_save: Callable[[Any], None] | None = None,
                 from_params: Callable[[Any], Any] | None = None):
        """``before_save(state)`` runs before every save and may raise to refuse it (the
        non-finite guard does, for a latched state). ``from_params(params)`` makes a fresh
        state around given params: with it, a checkpoint holding only the model's params
        (``jaxmp ckpt import``) starts the run instead of being refused."""
        self.cfg: CheckpointConfig = config.checkpoint
        self.before_save = before_save
        self.from_params = from_params
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
        self.pending: int | None = None  # the step whose (async) write may still be running
        self.failed = False
        self.state_bytes = tree_bytes(layout.abstract)
        # finite? and checksum of every array, compiled now (see checksum.ArrayStats)
        self.stats = checksum.ArrayStats([jax.ShapeDtypeStruct(
            jax.eval_shape(tree.stored_value, e.value).shape,
            jax.eval_shape(tree.stored_value, e.value).dtype, sharding=self.shardings[e.path])
            for e in abstract]) if self.enabled else None

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
        if data_state is PARAMS_ONLY:
            say(f"jaxmp: starting from the params of checkpoint step {step} in {self.dir} "
                f"(fresh optimizer state)")
            return Resumed(state, None, int(state.step))
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
        if problem and self._params_only(meta["arrays"]):
            return self._load_params(step_dir, meta["arrays"]), PARAMS_ONLY
        if problem:  # the user's config changed: an error, not damage to fall back from
            raise CheckpointError(f"checkpoint {step_dir} does not fit the configured model: "
                                  f"{problem}")
        stored = meta["arrays"]
        moved = {p for p in self.expected if tree.needs_conversion(stored[p], self.expected[p])}
        placed = {**self.shardings, **tree.shardings_on(
            {p: stored[p] for p in moved}, self.layout.mesh,
            self.rules if self.rules is not None else sharding.DEFAULT_RULES)}
        flat = tree.flat_paths(store.restore_arrays(step_dir, tree.target(stored, placed), stored))
        for p in moved:  # e.g. a run resumed with other pipeline stages, or without them
            flat[p] = tree.convert(flat[p], stored[p], self.expected[p], self.shardings[p])
        state = tree.rebuild(self.layout.abstract, tree.rewrap(flat, meta["arrays"]),
                             self.path_rules)
        return state, store.read_json(step_dir, "data", missing_ok=True)

    def _params_only(self, stored: dict[str, Any]) -> bool:
        """Does the checkpoint hold exactly the model's params (plain layout, any dtype)?"""
        params = {p: tree.plain_record(r) for p, r in self.expected.items()
                  if p.startswith("params/")}
        return self.from_params is not None and set(stored) == set(params) and all(
            stored[p].get("rows") is None and stored[p]["shape"] == params[p]["shape"]
            for p in params)

    def _load_params(self, step_dir: Path, stored: dict[str, Any]) -> Any:
        placed = tree.shardings_on(stored, self.layout.mesh, self.rules if self.rules is not None
                                   else sharding.DEFAULT_RULES)
        flat = tree.flat_paths(store.restore_arrays(step_dir, tree.target(stored, placed),
                                                    stored))
        return self.from_params(tree.nest(flat)["params"])

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
        if self.before_save is not None:
            self.before_save(state)
        self._open()
        if step in self.manager.all_steps():  # e.g. a state set by hand over an old run dir
            say(f"jaxmp: warning: checkpoint step {step} already exists in {self.dir}; "
                f"not overwriting it")
            self.last_saved = step
            return False
        self._check_space(step)
        items = tree.entries(state, self.path_rules)
        finite, sums = self.stats([tree.stored_value(e.value) for e in items])
        bad = [e.path for e, ok in zip(items, finite) if not ok]
        if bad:  # e.g. an update that overflowed: never write NaN/inf
            raise NonFiniteError(
                f"the state after step {step} holds non-finite values (in {bad[0]}"
                f"{f' and {len(bad) - 1} more arrays' if len(bad) > 1 else ''}); it was not "
                f"saved. Lower optimizer.lr")
        meta = store.make_meta(step, items, sums)
        get_state = getattr(data_iter, "get_state", None)
        with self._writing(step):  # also reports a failure of the previous async write
            self.manager.save(step, force=True, args=store.save_args(
                tree.to_pure(items), meta, self._run_info(), get_state() if get_state else None))
        self.last_saved = self.pending = step
        return True

    def _check_space(self, step: int) -> None:
        """Refuse a save the disk cannot hold, before writing anything. The run dir is shared
        storage, so every process sees the same free space and refuses alike; a pending
        async save is still waited for by :meth:`close`."""
        where = next(p for p in (self.dir, *self.dir.parents) if p.exists())
        free = shutil.disk_usage(where).free
        if free < self.state_bytes:
            raise CheckpointWriteError(
                f"not enough disk space to save checkpoint step {step} in {self.dir}: it needs "
                f"about {fmt_bytes(self.state_bytes)}, {fmt_bytes(free)} are free; "
                f"{self._newest()}")

    @contextlib.contextmanager
    def _writing(self, step: int | None) -> Iterator[None]:
        """Turn a failed write (disk full, quota, I/O error) into one clear error and remove
        the partial save it left."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - Orbax / TensorStore raise many types
            self.failed = True
            failed_step, cause = store.write_failure(e)
            if jax.process_index() == 0:
                store.remove_partial(self.dir)
            raise CheckpointWriteError(
                f"saving checkpoint step {failed_step or self.pending or step} in {self.dir} "
                f"failed: {cause}; the partial save was removed, {self._newest()}") from None

    def _newest(self) -> str:
        steps = store.complete_steps(self.dir)
        return f"the newest complete checkpoint is step {steps[-1]}" if steps else \
            "there is no complete checkpoint yet"

    def _run_info(self) -> dict[str, Any]:
        plan = None
        if jax.process_index() == 0 and self.plan_path.is_file():
            plan = json.loads(self.plan_path.read_text())
        return {"config_toml": self.config_toml, "plan": plan}

    def close(self) -> None:
        """Wait for a pending async save to be committed, then release the manager (after a
        failed write: release it without waiting, the failure is already reported)."""
        manager, self.manager = self.manager, None
        if manager is None:
            return
        if self.failed:
            with contextlib.suppress(Exception):
                manager.close()
            return
        with self._writing(self.pending):
            manager.wait_until_finished()
        manager.close()


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
