"""Find the layers of any Flax NNX model and trace its training program with them marked.

A *layer* is a top-level submodule of the model (containers such as ``nnx.List``, ``nnx.Dict``
and ``nnx.Sequential`` are opened one level), and each block of a *layer stack*: a submodule
whose parameters all carry a leading ``layers`` axis (created with ``nnx.vmap`` and
``transform_metadata={nnx.PARTITION_NAME: "layers"}``) and that the model runs block by block
(``scan`` or a Python loop over slices).

While the model is traced, the ``__call__`` of each layer's class is wrapped so that the
outermost matching call runs inside ``jax.named_scope("jaxmp.L<i>")`` and records the call's
abstract inputs. The scope survives into every equation of the jaxpr, forward and backward
(``transpose(...)``), which is how :mod:`jaxmp.cost` attributes FLOPs and saved activations to
layers without knowing anything about the model's code.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
from flax import nnx

from jaxmp.cost.flops import _sub_jaxprs, iter_eqn
from jaxmp.loss import call_loss
from jaxmp.sharding import names_of

SCOPE = "jaxmp.L"
_SCOPE_RE = re.compile(r"jaxmp\.L(\d+)\b")
_CONTAINERS = tuple(c for c in (getattr(nnx, "List", None), getattr(nnx, "Dict", None),
                                getattr(nnx, "Sequential", None)) if c is not None)


@dataclass
class LayerSpec:
    """One layer (or one layer stack) of the model, found before tracing."""

    index: int
    name: str  # attribute path, e.g. "blocks" or "layers/3"
    module: Any  # the submodule on the abstract model
    stack: int = 0  # number of blocks when this is a layer stack, else 0


@dataclass
class LayerCall:
    """The first call of a layer seen while tracing: enough to re-run that layer alone."""

    graphdef: Any
    params: Any  # abstract nnx.State of the called module's Params (one block's for stacks)
    rest: Any  # its other variables (RNG streams, statistics)
    args: tuple
    kwargs: dict
    outputs: Any  # abstract outputs


@dataclass
class Recording:
    specs: list[LayerSpec]
    calls: dict[int, LayerCall] = field(default_factory=dict)
    depth: int = 0


def scope_index(name_stack: str) -> int | None:
    """The layer index a name stack belongs to, or None for code outside any layer."""
    m = _SCOPE_RE.search(name_stack)
    return int(m.group(1)) if m else None


def _abstract(tree: Any) -> Any:
    def one(x: Any) -> Any:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
        return x

    return jax.tree.map(one, tree)


def _param_names(module: Any) -> list[tuple[str | None, ...] | None]:
    leaves = jax.tree.leaves(nnx.state(module, nnx.Param),
                             is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [names_of(v)[0] for v in leaves]


def _stack_length(module: Any) -> int:
    """Blocks in a layer stack (every Param's first logical axis is "layers"), else 0."""
    names = _param_names(module)
    if not names or not all(n and n[0] == "layers" for n in names):
        return 0
    leaves = jax.tree.leaves(nnx.state(module, nnx.Param))
    lengths = {int(x.shape[0]) for x in leaves}
    return lengths.pop() if len(lengths) == 1 else 0


def find_layers(model: Any) -> list[LayerSpec]:
    """The model's layers in attribute order (execution order is fixed later by tracing)."""
    specs: list[LayerSpec] = []

    def visit(node: Any, prefix: str) -> None:
        for key, child in nnx.iter_children(node):
            if not isinstance(child, nnx.Module):
                continue
            name = f"{prefix}{key}"
            if isinstance(child, _CONTAINERS):
                visit(child, name + "/")
            else:
                specs.append(LayerSpec(len(specs), name, child, _stack_length(child)))

    visit(model, "")
    return specs


def _resolve(model: Any, name: str) -> Any:
    node = model
    for part in name.split("/"):
        node = node[int(part)] if part.isdigit() and not hasattr(node, part) else \
            getattr(node, part) if hasattr(node, part) else node[part]
    return node


@contextlib.contextmanager
def _patched_calls(classes: set[type], wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replace each class's ``__call__`` with ``wrap(__call__)`` while inside; restore after."""
    saved: dict[type, Any] = {}
    try:
        for cls in classes:
            saved[cls] = cls.__dict__.get("__call__")
            cls.__call__ = wrap(cls.__call__)
        yield
    finally:
        for cls, orig in saved.items():
            if orig is None:
                del cls.__call__
            else:
                cls.__call__ = orig


@contextlib.contextmanager
def around_layers(model: Any, around: Callable[[Callable, tuple, dict], Any]) -> Iterator[None]:
    """While inside, each outermost call of one of ``model``'s top-level layers (layer stacks
    excepted) runs as ``around(call, args, kwargs)`` instead of ``call(*args, **kwargs)``.

    ``model`` is the instance that will run (e.g. a merged copy being traced); the layers'
    classes are patched for the duration only.
    """
    specs = [s for s in find_layers(model) if not s.stack]
    live = {id(_resolve(model, s.name)) for s in specs}
    classes = {type(s.module) for s in specs}
    depth = [0]

    def wrap(orig: Callable) -> Callable:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if depth[0] or id(self) not in live:
                return orig(self, *args, **kwargs)
            depth[0] += 1
            try:
                return around(lambda *a, **k: orig(self, *a, **k), args, kwargs)
            finally:
                depth[0] -= 1

        return call

    with _patched_calls(classes, wrap):
        yield


@contextlib.contextmanager
def recording(model: Any, specs: list[LayerSpec], rec: Recording) -> Iterator[None]:
    """Wrap the layer classes' ``__call__`` while ``model`` (a merged, traced copy) runs."""
    live = {id(_resolve(model, s.name)): s for s in specs if not s.stack}
    stacks: dict[type, list[tuple[LayerSpec, list]]] = {}
    for s in specs:
        if s.stack:  # a block of the stack has the stack's parameter shapes minus the first dim
            shapes = [tuple(x.shape[1:]) for x in jax.tree.leaves(nnx.state(s.module, nnx.Param))]
            stacks.setdefault(type(s.module), []).append((s, shapes))
    stack_objs = {id(_resolve(model, s.name)) for s in specs if s.stack}
    classes = {type(s.module) for s in specs}

    def match(obj: Any) -> LayerSpec | None:
        if id(obj) in live:
            return live[id(obj)]
        candidates = stacks.get(type(obj), [])
        if not candidates or id(obj) in stack_objs:
            return None
        if len(candidates) == 1:
            return candidates[0][0]
        shapes = [tuple(x.shape) for x in jax.tree.leaves(nnx.state(obj, nnx.Param))]
        return next((s for s, want in candidates if want == shapes), None)

    def wrap(orig: Callable) -> Callable:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            spec = match(self) if rec.depth == 0 else None
            if spec is None:
                return orig(self, *args, **kwargs)
            rec.depth += 1
            try:
                with jax.named_scope(f"{SCOPE}{spec.index}"):
                    out = orig(self, *args, **kwargs)
                if spec.index not in rec.calls:
                    graphdef, params, rest = nnx.split(self, nnx.Param, ...)
                    rec.calls[spec.index] = LayerCall(graphdef, _abstract(params), _abstract(rest),
                                                      _abstract(args), _abstract(kwargs),
                                                      _abstract(out))
                return out
            finally:
                rec.depth -= 1

        return call

    with _patched_calls(classes, wrap):
        yield


def scalar_loss(out: Any) -> Any:
    """``loss`` or ``(loss, aux)`` → the scalar; any other output → the sum of its floats."""
    if isinstance(out, tuple) and len(out) == 2 and getattr(out[0], "ndim", None) == 0:
        return out[0]
    if getattr(out, "ndim", None) == 0:
        return out
    floats = [x for x in jax.tree.leaves(out) if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)]
    return sum(x.astype("float32").sum() for x in floats)


def _loss_of(model: Any, specs: list[LayerSpec], rec: Recording,
             loss_fn: Callable | None) -> tuple[Callable, Any]:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_of(p: Any, b: Any) -> Any:
        m = nnx.merge(graphdef, p, rest)
        with recording(m, specs, rec):
            out = call_loss(loss_fn, m, b) if loss_fn is not None else m(b)
        return scalar_loss(out)

    return loss_of, params


def trace_training(model: Any, batch: Any, loss_fn: Callable | None) -> tuple[Any, Recording]:
    """The jaxpr of ``value_and_grad(loss)`` over the params, layers scoped and recorded."""
    rec = Recording(find_layers(model))
    loss_of, params = _loss_of(model, rec.specs, rec, loss_fn)
    return jax.make_jaxpr(jax.value_and_grad(loss_of))(params, batch), rec


def trace_residuals(model: Any, batch: Any, loss_fn: Callable | None) -> Any:
    """A jaxpr whose outputs are the arrays the backward pass keeps (the VJP residuals)."""
    rec = Recording(find_layers(model))
    loss_of, params = _loss_of(model, rec.specs, rec, loss_fn)

    def residuals(p: Any, b: Any) -> list:
        return jax.tree.leaves(jax.vjp(lambda q: loss_of(q, b), p)[1])

    return jax.make_jaxpr(residuals)(params, batch)


def _origin(eqn: Any, k: int, stack: str) -> str | None:
    """Name stack of the equation that really produced output ``k`` of ``eqn`` (None: an input)."""
    own = str(eqn.source_info.name_stack)
    full = f"{stack}/{own}" if stack and own else (stack or own)
    subs = [j for j, _, kind in _sub_jaxprs(eqn) if kind in ("scan", "call")]
    if not subs:
        return full
    sub = subs[0]
    if k >= len(sub.outvars):
        return full
    var = sub.outvars[k]
    for e in sub.eqns:
        if var in e.outvars:
            return _origin(e, e.outvars.index(var), full)
    return None  # passed through (e.g. a scan carry: a layer's input, counted by that layer)


def root_residuals(jaxpr: Any) -> list[tuple[Any, str, int]]:
    """(aval, "pre"|"post", output index) of residuals produced outside every layer."""
    eqns = jaxpr.jaxpr.eqns
    first = next((i for i, e in enumerate(eqns)
                  if any(scope_index(x.name_stack) is not None for x in iter_eqn(e))), len(eqns))
    producers = {v: (i, e) for i, e in enumerate(eqns) for v in e.outvars}
    out = []
    for idx, var in enumerate(jaxpr.jaxpr.outvars):
        if isinstance(var, jax.extend.core.Literal) or var not in producers:
            continue  # a parameter or a batch input
        pos, eqn = producers[var]
        stack = _origin(eqn, eqn.outvars.index(var), "")
        if stack is not None and scope_index(stack) is None:
            out.append((var.aval, "pre" if pos < first else "post", idx))
    return out
