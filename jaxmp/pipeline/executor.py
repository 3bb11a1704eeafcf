"""The pipeline executor: a model split by layers over the ``stage`` mesh axis, run inside the one
jitted step as a schedule's tick table.

``mesh.stage = P > 1`` runs the model's chunks (:class:`~jaxmp.pipeline.chunk.Chunk`) under
``jax.shard_map`` over ``stage`` only: the other axes (data, fsdp, tensor) stay automatic, so each
stage is still sharded by the rules and XLA inserts their collectives as usual. Every device runs
the same ``lax.scan`` over ticks; ``lax.cond`` on its own row of the tables makes it run only its
own work. One training tick (:class:`_TrainingTicks`) has four phases:

1. **inputs** — the device's row of the schedule's tables (:class:`TickInputs`): which
   (microbatch, chunk) it runs forward and which backward, and the buffer slots they use;
2. **forward** — one chunk on one microbatch; what its backward needs goes into a slot of the
   residual buffer (:mod:`jaxmp.pipeline.residuals`: never a copy of the parameters, cheap ops
   recomputed); GPipe's last chunk also adds its loss;
3. **backward** — from those residuals and the output's cotangent; gradients accumulate in
   float32 (at least: each microbatch's 16-bit gradient added into a float32 sum, as the plain
   accumulation loop sums; a float32 master gets that sum, 16-bit params its cast). With
   1F1B and interleaved the last chunk's forward runs here, fused with its backward and the loss,
   so the logits never wait in a buffer;
4. **shift** — ``ppermute`` moves each forward's output one device on and each backward's input
   cotangent one device back, into the slots the tables name.

Evaluation (:class:`_EvaluationTicks`) runs forwards only, in eval mode, as a fill-drain over the
chunks: no backward, no residuals. Gradients of the stacked blocks stay on their stage; those of
the shared params (embedding, head) are summed over stages, as a tied embedding's two uses need.

Shapes inside the ``shard_map`` (one device): the stack ``[V, Lmax, ...]`` (stored ``[P, V·Lmax,
...]``), each batch array ``[M, R, ...]`` (``M`` microbatches of ``R`` rows), an activation
``A`` = what ``pre`` returns for one microbatch (``[R, seq, embed]`` for the GPT).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxmp import gradsum, sharding
from jaxmp.mesh import shard_map_over
from jaxmp.pipeline.chunk import LAST_CHUNK, Chunk, PipelineSpec, join_stack, split_stack
from jaxmp.pipeline.residuals import stash_layout, stash_policy, vjp_without_params
from jaxmp.pipeline.schedule import Schedule
from jaxmp.pipeline.stages import StageSplit
from jaxmp.pipeline.ticks import (BACKWARD_TICK, FORWARD_TICK, PROGRAM_COLUMNS, STAGE,
                                  DeviceTicks, TickInputs, buffer_slot)



def split_microbatches(x: jax.Array, microbatches: int, mesh: Any, rules: Sequence) -> jax.Array:
    """``[B, ...] -> [M, B/M, ...]``, microbatch j = rows j, j+M, ... (every batch shard works
    on every microbatch), its batch dim sharded by the ``batch`` rule."""
    mb = x.reshape((x.shape[0] // microbatches, microbatches) + x.shape[1:]).swapaxes(0, 1)
    with sharding.activation_sharding(mesh, rules):
        return sharding.constrain(mb, (None, "batch") + (None,) * (x.ndim - 1))


class PipelineExecutor:
    """Runs a model in ``split``'s chunks over ``mesh``'s ``stage`` axis: gradients as
    ``schedule`` orders them (:meth:`grad_fn`), evaluation forward only (:meth:`eval_fn`).
    ``graphdef`` is the whole model's, its stack in the padded stage layout
    (:func:`~jaxmp.pipeline.chunk.to_stages`)."""

    def __init__(self, graphdef: Any, mesh: jax.sharding.Mesh, spec: PipelineSpec,
                 schedule: Schedule, split: StageSplit):
        self.mesh, self.spec, self.schedule, self.split = mesh, spec, schedule, split
        self.program = schedule.program()
        self.tables = TickInputs(*(jnp.asarray(getattr(self.program, column))  # [ticks, P]
                                   for column in PROGRAM_COLUMNS))
        self.blocks_per_chunk = jnp.asarray(split.counts)  # [P, V]
        last = schedule.chunks - 1
        padded = min(split.per_chunk) < split.max_blocks
        self.train_chunk = Chunk(graphdef, spec, split.max_blocks, last, padded=padded)
        self.eval_chunk = Chunk(graphdef, spec, split.max_blocks, last, train=False,
                                padded=padded)

    def grad_fn(self, rules: Sequence, gather: Any = None, wide_grads: bool = False
                ) -> Callable:
        """``(params, rest, batch, key) -> (loss, grads, rest, aux)``: the contract of
        :func:`jaxmp.train.step.make_grad_fn` (token-weighted mean loss). ``gather``: the
        step's :class:`~jaxmp.compression.gather.WeightGather` (fsdp shards cast before they
        are gathered, as the plain step does). Microbatch gradients are summed in float32 (at
        least), as the plain accumulation loop sums them; ``wide_grads`` returns that sum as
        is (master weights update in float32), else in each param's dtype."""

        def grad_fn(params: Any, rest: Any, batch: dict, key: jax.Array | None = None) -> tuple:
            del key  # the blocks draw no randomness under stages; see docs/pipeline.md
            stack_grads, shared_grads, loss_sum, weight_sum = self._on_stages(
                self._train_on_device, (P(STAGE), P(), P(), P()),
                params if gather is None else gather.prepare(params), rest, batch, rules)
            scale = 1.0 / jnp.maximum(weight_sum, 1e-12)
            grads = jax.tree.map(lambda g, p: g * scale if wide_grads else
                                 (g * scale).astype(p.dtype),
                                 join_stack(shared_grads, self.spec.stack, stack_grads), params)
            return loss_sum * scale, grads, rest, {}

        return grad_fn

    def eval_fn(self, rules: Sequence) -> Callable:
        """``(params, rest, batch) -> loss``: the token-weighted mean loss in eval mode, forward
        only (the plain evaluation step's loss)."""

        def evaluate(params: Any, rest: Any, batch: dict) -> jax.Array:
            loss_sum, weight_sum = self._on_stages(self._evaluate_on_device, (P(), P()), params,
                                                   rest, batch, rules)
            return loss_sum / jnp.maximum(weight_sum, 1e-12)

        return evaluate

    def _on_stages(self, on_device: Callable, out_specs: tuple, params: Any, rest: Any,
                   batch: dict, rules: Sequence) -> Any:
        """``on_device(stack [1, V·Lmax, ...], shared, rest, microbatches [M, R, ...])`` on every
        stage. The mesh is the one traced now: inside a data replica's ``shard_map`` (gradient
        compression) the stage ``shard_map`` nests in it."""
        run = shard_map_over(on_device, self.mesh, {STAGE}, (P(STAGE), P(), P(), P()),
                             out_specs)
        stack, shared = split_stack(params, self.spec.stack)
        m = self.schedule.microbatches
        microbatches = jax.tree.map(lambda x: split_microbatches(x, m, self.mesh, rules), batch)
        with sharding.activation_sharding(self.mesh, rules):
            return run(stack, shared, rest, microbatches)

    def _train_on_device(self, stack: Any, shared: Any, rest: Any, microbatches: dict) -> tuple:
        ticks = _TrainingTicks(self, stack, shared, rest, microbatches)
        final = jax.lax.scan(ticks.tick, ticks.start(), jnp.arange(self.program.ticks))[0]
        return ticks.results(final)

    def _evaluate_on_device(self, stack: Any, shared: Any, rest: Any,
                            microbatches: dict) -> tuple:
        ticks = _EvaluationTicks(self, stack, shared, rest, microbatches)
        final = jax.lax.scan(ticks.tick, ticks.start(), jnp.arange(ticks.count))[0]
        return jax.lax.psum(final.loss_sum, STAGE), jax.lax.psum(final.weight_sum, STAGE)


class _Training(NamedTuple):
    """The scan carry of one device's training ticks; every buffer has a spare last slot."""

    activations: jax.Array  # [act_slots + 1, *A]: chunk inputs waiting for their forward
    residuals: list  # per residual leaf [res_slots + 1, ...]: forwards kept for backwards
    cotangents: jax.Array  # [ct_slots + 1, *A]: output cotangents waiting for their backward
    stack_grads: Any  # [V, Lmax, ...], like the device's stack
    shared_grads: Any  # like the shared params
    loss_sum: jax.Array  # Σ loss · weight over the last chunks run here
    weight_sum: jax.Array


class _TrainingTicks(DeviceTicks):
    """One device's run of the schedule's tables: forward, backward and shift per tick."""

    def __init__(self, executor: PipelineExecutor, stack: Any, shared: Any, rest: Any,
                 microbatches: dict):
        super().__init__(executor, executor.train_chunk, stack, shared, rest, microbatches)
        self.program, self.schedule = executor.program, executor.schedule
        self.policy = stash_policy(executor.spec.remat)
        one = jnp.int32(1)
        self.stash = stash_layout(self.forward_for_backward, self.params(0),
                                  self.zero_activation, self.microbatch(0), one, one)

    def start(self) -> _Training:
        program, zero = self.program, self.zero_activation
        return _Training(
            activations=jnp.zeros((program.act_slots + 1,) + zero.shape, zero.dtype),
            residuals=self.stash.empty(program.res_slots + 1),
            cotangents=jnp.zeros((program.ct_slots + 1,) + zero.shape, zero.dtype),
            stack_grads=self.like_params(jax.tree.map(gradsum.accumulator, self.stack),
                                         (None,)),
            shared_grads=self.like_shared(jax.tree.map(gradsum.accumulator, self.shared)),
            loss_sum=jnp.float32(0), weight_sum=jnp.float32(0))

    def tick(self, state: _Training, t: jax.Array) -> tuple[_Training, None]:
        inputs = self.inputs(t)
        state, output = self.forward(state, inputs)
        state, input_cotangent = self.backward(state, inputs)
        return self.shift(state, inputs, output, input_cotangent), None

    def inputs(self, t: jax.Array) -> TickInputs:
        """Phase 1: this device's row of the tables at tick ``t``."""
        return TickInputs(*(table[t, self.device] for table in self.executor.tables))

    def forward_for_backward(self, params: tuple, x: jax.Array, microbatch: dict,
                             chunk: jax.Array, n_blocks: jax.Array) -> tuple:
        """``((y, loss·weight, weight), vjp)`` of a chunk whose backward runs later: ``vjp``'s
        leaves are what it keeps (the stash policy's choice, no parameters)."""
        forward = jax.checkpoint(
            lambda params, x: self.chunk.forward(params, x, microbatch, self.rest, chunk,
                                                 n_blocks, with_loss=not self.schedule.folds_last),
            policy=self.policy)
        return vjp_without_params(forward, params, x)

    def forward(self, state: _Training, inputs: TickInputs) -> tuple[_Training, jax.Array]:
        """Phase 2: the forward of (``forward_microbatch``, ``forward_chunk``), if any: its
        output ``A`` (zeros without one); its residuals go to ``forward_stash_slot`` (an idle
        tick writes zeros to the spare slot). Buffers are written outside the tick's
        conditionals: a buffer a ``lax.cond`` updates is copied by XLA (GPU-compiled, the stash
        was held twice), one it only reads is not."""

        def run(x: jax.Array) -> tuple:
            local = inputs.forward_chunk
            (y, loss, weight), vjp = self.forward_for_backward(
                self.params(local), x, self.microbatch(inputs.forward_microbatch),
                self.global_chunk(local), self.n_blocks(local))
            kept = jax.tree.leaves(vjp)
            self.stash.check(kept)
            return y, loss, weight, kept

        def idle(x: jax.Array) -> tuple:
            zero = jnp.float32(0)
            return self.zero_activation, zero, zero, [jnp.zeros(a.shape, a.dtype)
                                                      for a in self.stash.avals]

        x = state.activations[buffer_slot(inputs.forward_input_slot, self.program.act_slots)]
        with jax.named_scope(FORWARD_TICK):
            y, loss, weight, kept = jax.lax.cond(inputs.forward_microbatch >= 0, run, idle, x)
        index = buffer_slot(inputs.forward_stash_slot, self.program.res_slots)
        residuals = [buffer.at[index].set(leaf) for buffer, leaf in zip(state.residuals, kept)]
        return state._replace(residuals=residuals, loss_sum=state.loss_sum + loss,
                              weight_sum=state.weight_sum + weight), y

    def backward(self, state: _Training, inputs: TickInputs) -> tuple[_Training, jax.Array]:
        """Phase 3: the backward of (``backward_microbatch``, ``backward_chunk``), if any: the
        gradients accumulate (outside the conditional, see :meth:`forward`); returns its
        input's cotangent ``A`` (zeros without one)."""
        local = inputs.backward_chunk

        def run(state: _Training) -> tuple:
            params = self.params(local)
            if self.schedule.folds_last:
                with jax.named_scope(LAST_CHUNK):
                    grads, x_cotangent, loss, weight = jax.lax.cond(
                        self.global_chunk(local) == self.chunk.last_chunk,
                        self._fused_last_backward, self._stashed_backward, state, inputs, params)
            else:
                grads, x_cotangent, loss, weight = self._stashed_backward(state, inputs, params)
            shared_grads, chunk_grads = grads
            return (self.like_shared(shared_grads), self.like_params(chunk_grads), loss, weight,
                    x_cotangent)

        def idle(state: _Training) -> tuple:
            chunk = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), self.stack)
            zero = jnp.float32(0)
            return (self.like_shared(jax.tree.map(jnp.zeros_like, self.shared)),
                    self.like_params(chunk),
                    zero, zero, self.zero_activation)

        with jax.named_scope(BACKWARD_TICK):
            shared_grads, chunk_grads, loss, weight, x_cotangent = jax.lax.cond(
                inputs.backward_microbatch >= 0, run, idle, state)
        return state._replace(
            stack_grads=jax.tree.map(lambda acc, g: acc.at[local].add(g.astype(acc.dtype)),
                                     state.stack_grads, chunk_grads),
            shared_grads=jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype),
                                      state.shared_grads, shared_grads),
            loss_sum=state.loss_sum + loss, weight_sum=state.weight_sum + weight), x_cotangent

    def _stashed_backward(self, state: _Training, inputs: TickInputs, params: tuple) -> tuple:
        """``(grads of params, cotangent of x A, 0, 0)`` from the residuals in
        ``backward_stash_slot`` and the output's cotangent in ``backward_cotangent_slot`` — or,
        for GPipe's last chunk, the loss's seed 1."""
        program = self.program
        kept = [buffer[buffer_slot(inputs.backward_stash_slot, program.res_slots)]
                for buffer in state.residuals]
        is_last = self.global_chunk(inputs.backward_chunk) == self.chunk.last_chunk
        output_cotangent = jnp.where(is_last, 0, state.cotangents[
            buffer_slot(inputs.backward_cotangent_slot, program.ct_slots)])
        seed = jnp.where(is_last, 1.0, 0.0).astype(jnp.float32)
        grads, x_cotangent = self.stash.vjp(kept, params)((output_cotangent, seed, jnp.float32(0)))
        return grads, x_cotangent, jnp.float32(0), jnp.float32(0)

    def _fused_last_backward(self, state: _Training, inputs: TickInputs, params: tuple) -> tuple:
        """``(grads of params, cotangent of x A, loss · weight, weight)``: the last chunk's
        forward, loss and backward at once, on the input waiting in ``backward_input_slot``."""
        local = inputs.backward_chunk
        x = state.activations[buffer_slot(inputs.backward_input_slot, self.program.act_slots)]
        microbatch = self.microbatch(inputs.backward_microbatch)
        (loss, weight), vjp = jax.vjp(
            lambda params, x: self.chunk.forward(params, x, microbatch, self.rest,
                                                 self.global_chunk(local),
                                                 self.n_blocks(local))[1:], params, x)
        grads, x_cotangent = vjp((jnp.float32(1), jnp.float32(0)))
        return grads, x_cotangent, loss, weight

    def shift(self, state: _Training, inputs: TickInputs, output: jax.Array,
              input_cotangent: jax.Array) -> _Training:
        """Phase 4: outputs one device on, input cotangents one device back, into the slots
        the tables name for what arrives."""
        program = self.program
        arrived = self.send(output, +1)
        activations = state.activations.at[
            buffer_slot(inputs.arriving_activation_slot, program.act_slots)].set(arrived)
        returned = self.send(input_cotangent, -1)
        cotangents = state.cotangents.at[
            buffer_slot(inputs.arriving_cotangent_slot, program.ct_slots)].set(returned)
        return state._replace(activations=activations, cotangents=cotangents)

    def results(self, state: _Training) -> tuple:
        """``(stack grads [1, V·Lmax, ...], shared grads, loss sum, weight sum)``, the last three
        summed over stages."""
        stack_grads = jax.tree.map(lambda g: g.reshape((1, -1) + g.shape[2:]), state.stack_grads)
        return (stack_grads, _sum_over_stages(state.shared_grads, self.executor.mesh),
                jax.lax.psum(state.loss_sum, STAGE), jax.lax.psum(state.weight_sum, STAGE))



def _sum_over_stages(tree: Any, mesh: Any) -> Any:
    """``psum`` over stages; on CPU devices 16-bit floats are summed in float32, as XLA:CPU's
    all-reduce promotion would — which aborts on the reducer jax lowers here (its root a
    sharding annotation: "Invalid binary instruction opcode copy")."""
    cpu = mesh.devices.flat[0].platform == "cpu"

    def one(x: jax.Array) -> jax.Array:
        if cpu and x.dtype in (jnp.bfloat16, jnp.float16):
            return jax.lax.psum(x.astype(jnp.float32), STAGE).astype(x.dtype)
        return jax.lax.psum(x, STAGE)

    return jax.tree.map(one, tree)


class _Evaluation(NamedTuple):
    """The scan carry of one device's evaluation ticks."""

    inbox: jax.Array  # [K + 1, *A]: activations from the previous device, slot = pass mod K
    loss_sum: jax.Array
    weight_sum: jax.Array


class _EvaluationTicks(DeviceTicks):
    """Forwards only, in eval mode, as a fill-drain over the chunks. Device ``d`` runs pass
    ``k = t - d`` at tick ``t`` (``0 <= k < V·M``): microbatch ``k mod M`` through its local
    chunk ``k div M``. So microbatch ``i`` reaches chunk ``c = v·P + d`` at tick ``v·M + i + d``:
    one tick after the previous device ran chunk ``c - 1`` on it or, when ``c - 1`` was the last
    device's (``V > 1``, which needs ``M >= P``), ``M - P + 1`` ticks after; arrivals wait in the
    inbox, a ring of ``K = M - P + 1`` slots indexed by the pass that produced them."""

    def __init__(self, executor: PipelineExecutor, stack: Any, shared: Any, rest: Any,
                 microbatches: dict):
        super().__init__(executor, executor.eval_chunk, stack, shared, rest, microbatches)
        self.m = executor.schedule.microbatches
        self.passes = self.virtual * self.m
        self.count = self.passes + self.stages - 1  # ticks
        self.ring = max(1, self.m - self.stages + 1)

    def start(self) -> _Evaluation:
        zero = self.zero_activation
        return _Evaluation(inbox=jnp.zeros((self.ring + 1,) + zero.shape, zero.dtype),
                           loss_sum=jnp.float32(0), weight_sum=jnp.float32(0))

    def tick(self, state: _Evaluation, t: jax.Array) -> tuple[_Evaluation, None]:
        """Inputs (the pass this device runs), forward (with the loss on the last chunk), shift
        (the output to the next device's inbox)."""
        step = t - self.device
        local = step // self.m
        source = jnp.where(self.device == 0, step - self.m, step)  # the pass that fed this one

        def forward(state: _Evaluation) -> tuple[_Evaluation, jax.Array]:
            x = state.inbox[source % self.ring]
            y, loss, weight = self.chunk.forward(self.params(local), x,
                                                 self.microbatch(step % self.m), self.rest,
                                                 self.global_chunk(local), self.n_blocks(local))
            return state._replace(loss_sum=state.loss_sum + loss,
                                  weight_sum=state.weight_sum + weight), y

        state, output = jax.lax.cond((step >= 0) & (step < self.passes), forward,
                                     lambda state: (state, self.zero_activation), state)
        sender = (self.device - 1) % self.stages
        sent = t - sender  # the pass whose output arrives now
        keep = (sent >= 0) & (sent < self.passes) & (
            (sent // self.m) * self.stages + sender < self.chunk.last_chunk)
        inbox = state.inbox.at[jnp.where(keep, sent % self.ring, self.ring)].set(
            self.send(output, +1))
        return state._replace(inbox=inbox), None
