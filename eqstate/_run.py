"""Running code against explicit state dictionaries: world, scope, run,
make_with_states, states_of."""

import functools as ft
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, overload, ParamSpec, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu

from . import _context, _jax_compat as compat
from ._arguments import flag
from ._custom_types import Filter, MISSING, PyTree
from ._errors import (
    note_frozen_module,
    RAW_TRANSFORM_READ,
    StateNotFoundError,
    StateValueError,
    TraceContextError,
)
from ._filters import to_predicate
from ._pretty_print import first_and_more, state_label, value_summary
from ._shapes import is_key
from ._state import is_state, ParamState, RandomState, State
from ._state_dict import state_dict_of, StateDict
from ._static_fields import refuse_static_handles
from ._write_checks import (
    check_write,
    refuse_leaked_tracers,
    to_new_value,
    to_value,
)


_P = ParamSpec("_P")
_T = TypeVar("_T")


def world() -> StateDict:
    """An immutable snapshot of the world: every live state created at top level, with
    its current value, in creation order.

    Reading a value of `world()` follows the rules of `state.value`: inside an eqstate
    transform it is a read of that transform (the value is an input of its trace, and
    the state is listed in `get_read_states`), and inside a JAX transform that stages
    out a computation (`jax.jit`, `eqx.filter_jit`, ...) calling `world()` raises
    [`eqstate.TraceContextError`][], since its values would be baked in as constants.
    A snapshot taken outside a transform and closed over is a plain value, like any
    array. Inside a transform or a scope, the dictionaries made from it (`filter`,
    `split`, `set`, `update`, `|`) read a state only when its value is looked up, as
    `world()` itself does: `world().split(ParamState)` inside `vmap` reads no random
    key (reading one there would split it per member and advance it).

    The *set* of states listed is read when a function is traced, like any Python
    global: a kept trace (of [`eqstate.transform.jit`][], a `StatefulFunction`, ...)
    of a function iterating over `world()` goes on using the states that existed
    when it was traced, and ignores states created since (eager code sees them). To
    use the current set, pass the states in (the model, or `values_of(model)`), or
    call the function's `clear_cache()` after creating states.

    Inside [`eqstate.scope`][] or [`eqstate.run`][], the values are the scope's, as
    `state.value` reads them, in eager code and under a transform alike (compiling a
    function does not change what it reads): a world state the scope's dictionary
    lacks is listed, but looking it up raises [`eqstate.StateNotFoundError`][]. The
    states created inside the scope are not the world's; they are in its `states`.

    A state stays listed until its handle is garbage collected. A handle caught in a
    reference cycle outlives the last reference to it until Python's cycle collector
    runs, so the world may still list states of models the program has dropped. To
    work with one model's states, take them from the model with
    [`eqstate.states_of`][] or [`eqstate.values_of`][], not with a world-wide filter
    such as `world().filter(ParamState)`.

    **Returns:**

    A [`eqstate.StateDict`][]. Later writes do not change it, whether to the world
    or, when it is taken inside a transform (a lane of
    [`eqstate.transform.vmap_new_states`][] included), to the transform's values.
    """
    frame = _context.current_frame()
    if isinstance(frame, _context.DictFrame) and frame.ended:
        raise _context.scope_ended("`eqstate.world()`")
    eager = frame is _context.WORLD or (
        isinstance(frame, _context.DictFrame) and frame.eager
    )
    if eager and not (compat.is_top_level() or compat.evaluates_at_once()):
        raise TraceContextError(RAW_TRANSFORM_READ.format(label="`eqstate.world()`"))
    if frame is _context.WORLD:
        return state_dict_of(dict(_context.WORLD.snapshot()))
    states = [state for state, _ in _context.WORLD.snapshot()]
    original = getattr(frame, "original", None)
    held: dict | None = getattr(frame, "values", None)
    if original is not None and held is not None:
        # A trace, or a lane of `vmap_new_states`: the values it holds now are taken
        # now; the others are read when looked up, as they were before any later
        # write (a trace's inputs; a lane's keys as first read).
        known = {s: held[s] for s in states if s in held}
        return state_dict_of(_ReadThrough(frame, states, known, original))
    # Outside any trace (a scope, eager control flow) the values are taken now, so
    # that later writes leave the snapshot as it was; a world state outside a scope
    # raises when it is looked up. Under a trace, values taken now would be baked in.
    known = {}
    if frame.snapshots_at_once and not _under_a_trace(frame):
        known = {s: v for s in states if (v := frame.peek(s)) is not MISSING}
    return state_dict_of(_ReadThrough(frame, states, known, frame.read))


def _under_a_trace(frame: _context.Frame | None) -> bool:
    while frame is not None:
        if isinstance(frame, _context.TraceFrame):
            return True
        frame = getattr(frame, "parent", None)
    return False


_SNAPSHOT_ENDED = (
    "{label} is looked up in a snapshot of the world taken inside a trace that has "
    "ended, so its value there no longer exists. Take the snapshot outside the "
    "transformed function, or return the values you need from it."
)


def _trace_ended(frame: _context.Frame) -> bool:
    # An ended scope raises its own error when read through.
    return isinstance(frame, _context.TraceFrame) and frame.ended


class _ReadThrough(Mapping):
    """The values of `states`, each read through `frame` when first looked up (unless
    `known` holds it already): the world as seen from inside a scope or an eqstate
    transform."""

    def __init__(
        self,
        frame: _context.Frame,
        states: list[State],
        known: dict[State, Any],
        read: Callable[[State], Any],
    ):
        self._frame = frame
        self._states = dict.fromkeys(states)
        self._read = known
        self._read_one = read

    def __getitem__(self, state: State) -> Any:
        if state not in self._states:
            raise KeyError(state)
        trace = getattr(self._frame, "jax_trace", None)
        under_a_trace = trace is not None and not compat.is_eval_trace(trace)
        if under_a_trace and compat.stages_inside(trace):
            # A value taken already is a read too, as in `Frame.read`. (An eager
            # snapshot closed over is a plain value, like any array.)
            _context.read_from_nested_transform(state, strict=False)
        value = self._read.get(state, MISSING)
        if value is MISSING:
            if _trace_ended(self._frame):
                raise TraceContextError(
                    _SNAPSHOT_ENDED.format(label=state_label(state))
                )
            value = self._read[state] = self._read_one(state)
        return value

    def peek_items(self) -> Iterator[tuple[State, Any]]:
        """`(state, value)` pairs with the values looked up so far, and what the
        frame holds of the others, without reading them (`MISSING` if nothing)."""
        ended = getattr(self._frame, "ended", False)  # A trace or a scope.
        for state in self._states:
            value = self._read.get(state, MISSING)
            if value is MISSING and not ended:
                value = self._frame.peek(state)
            yield state, value

    def __iter__(self) -> Iterator[State]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, state: object) -> bool:
        return state in self._states


def _scope_value(state: State, value: Any) -> Any:
    """`value` as a scope holds it (JAX arrays), or `StateValueError` for an abstract
    one (a `jax.ShapeDtypeStruct`, as `eqstate.transform.eval_shape` gives)."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jtu.tree_leaves(value)):
        raise StateValueError(
            f"{state_label(state)} has an abstract value ({value_summary(value)}: "
            "shapes and dtypes only, as `eqstate.transform.eval_shape` gives), but a "
            "scope or `eqstate.run` needs values to compute with. Pass arrays, e.g. "
            "`jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)`."
        )
    return to_value(value)


class scope:
    """Runs eager code against an explicit [`eqstate.StateDict`][] instead of the
    world.

    Inside the `with` block, `.value` reads and writes the dictionary's states only
    (reading any other state raises [`eqstate.StateNotFoundError`][]), and states
    created inside are added to it. The world is never touched. When the block exits
    normally, `scope.states` holds the result; if it raises, nothing is kept.

    A scope is entered once: entering it again, inside its block or after it has
    exited, raises `RuntimeError` and leaves `scope.states` as it was. To go on from
    the result, enter a new scope: `eqstate.scope(s.states)`.

    The scope is a context of its thread or task, so code that copies the context
    inside the block (an asyncio task created there, `asyncio.to_thread`,
    `contextvars.copy_context()`) runs in the scope too. Once the block has exited,
    such code can no longer read, write or create states through it: that raises
    [`eqstate.TraceContextError`][], and the result never changes. Await such work
    before the block exits.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.zeros(2))
        with es.scope(es.StateDict({w: jnp.ones(2)})) as s:
            w.value = w.value * 3
        assert (s.states[w] == 3).all() and (w.value == 0).all()
        ```
    """

    def __init__(self, states: StateDict | PyTree):
        """**Arguments:**

        - `states`: the [`eqstate.StateDict`][] to run against. It is typed as any
            PyTree so that what optax returns (`optax.apply_updates(params,
            updates)`, declared as a PyTree of arrays, and a `StateDict` when
            `params` is one) is accepted as it is; anything but a `StateDict` raises
            `TypeError`.
        """
        if not isinstance(states, StateDict):
            raise TypeError(
                f"`eqstate.scope` takes a StateDict, got {type(states).__name__}. Build "
                "one with `eqstate.StateDict({state: value, ...})`."
            )
        self._initial = states
        self._entered = False
        self._frame: _context.DictFrame | None = None
        self._token: Any = None
        self._states: StateDict | None = None

    def __enter__(self) -> "scope":
        if self._entered:
            raise RuntimeError(
                "An `eqstate.scope` cannot be entered twice, even after its block has "
                "exited. To go on from its result, enter a new scope: "
                "`eqstate.scope(s.states)`."
            )
        # A StateDict made by `jax.tree.map` or `jax.device_get` may hold Python
        # scalars or NumPy arrays: values are JAX arrays here, as everywhere.
        values = [(s, _scope_value(s, v)) for s, v in self._initial.items()]
        self._entered = True
        self._frame = _context.DictFrame(values)
        self._token = _context.enter(self._frame)
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        _context.leave(self._token)
        assert self._frame is not None
        if exc_type is None:
            self._states = state_dict_of(dict(self._frame.values))
        else:
            note_frozen_module(exc_value)
        # A task or thread that copied the context inside the block still holds the
        # frame: ending it makes its later uses raise instead of changing the result.
        self._frame.end()
        self._frame = None

    @property
    def states(self) -> StateDict:
        """The resulting dictionary: the given states with the block's writes applied,
        and the states created inside. Available once the block has exited normally;
        reading it earlier, or after the block raised, raises `RuntimeError`."""
        if self._states is None:
            raise RuntimeError(
                "`scope.states` holds the result of the `with eqstate.scope(...)` "
                "block, which is only available once the block has exited normally "
                "(a block that raises keeps nothing). Inside the block, read states "
                "with `.value` or `eqstate.values_of(...)`."
            )
        return self._states


def run(
    fn: Callable[..., _T], states: StateDict | PyTree, *args: Any, **kwargs: Any
) -> tuple[StateDict, _T]:
    """Calls `fn(*args, **kwargs)` against `states` and returns the updated
    dictionary with the output: the functional form of [`eqstate.scope`][].

    It works under `jax.jit` and `eqx.filter_jit` with `states` as a traced argument,
    which is how a stateful `eqx.Module` is used inside a raw JAX transform.

    **Arguments:**

    - `fn`: the function to call. It may read and write the states of `states` and
        create new ones.
    - `states`: the [`eqstate.StateDict`][] to run against. Typed as any PyTree, as
        for [`eqstate.scope`][], so that what optax returns is accepted as it is. (To
        annotate optax's result as a `StateDict` yourself, e.g. as the return type
        of a training step, wrap it: `eqstate.StateDict(new_params)`, which keeps
        JAX arrays as they are.)
    - `*args`, `**kwargs`: passed to `fn`.

    **Returns:**

    `(new_states, out)`: `states` with the writes applied and new states added, and
    the output of `fn`. As with `scope`, code that copied the context inside `fn` (an
    asyncio task it created, say) cannot use the states once `run` has returned.

    !!! Example

        ```python
        import eqstate as es
        import jax
        import jax.numpy as jnp

        count = es.ShortTermState(jnp.array(0))

        def tick(x):
            count.value = count.value + 1
            return x * count.value

        @jax.jit
        def step(states, x):
            return es.run(tick, states, x)

        states, y = step(es.world().filter(count), 2.0)
        assert states[count] == 1 and y == 2.0
        ```
    """
    if not compat.is_top_level() and isinstance(states, StateDict):
        models = {"fn": fn, **{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}
        _warn_if_half_differentiated(states, models)
    with scope(states) as s:
        out = fn(*args, **kwargs)
    return s.states, out


_HALF_DIFFERENTIATED = (
    "`eqstate.run` is differentiated (`jax.grad`, `eqx.filter_grad`, ...) with "
    "respect to part of a model's values only: {missing} get no gradient. "
    "Differentiate the model's arrays and its states' values together "
    "(`eqx.filter_grad` with respect to `(model, states)`), or use "
    "`eqstate.transform.grad(loss, argnums=0, grad_states=eqstate.ParamState)"
    "(model, ...)`, which differentiates both."
)


def _warn_if_half_differentiated(states: StateDict, models: dict[str, Any]) -> None:
    """Under a raw JAX differentiation, warns if a model among `models` has
    floating-point values (its arrays, the values of its `ParamState`s in `states`)
    some of which are differentiated and some not."""
    trace = compat.differentiation_inside(None)
    if trace is None:
        return
    missing, some_traced = [], False
    for name, model in models.items():
        values = []
        for path, x in jtu.tree_leaves_with_path(model, is_leaf=is_state):
            if eqx.is_inexact_array(x):
                values.append((f"`{name}{jtu.keystr(path)}`", [x]))
            elif isinstance(x, ParamState) and x in states:
                leaves = jtu.tree_leaves(eqx.filter(states[x], eqx.is_inexact_array))
                values.append((state_label(x), leaves))
        traced = [any(compat.is_traced_by(x, trace) for x in v) for _, v in values]
        if any(traced):
            some_traced = True
            missing += [n for (n, v), t in zip(values, traced) if v and not t]
    if some_traced and missing:
        warnings.warn(
            _HALF_DIFFERENTIATED.format(missing=first_and_more(missing)), stacklevel=3
        )


def make_with_states(
    ctor: Callable[_P, _T],
) -> Callable[_P, tuple[_T, StateDict]]:
    """Wraps a constructor so that it builds an object without touching the world,
    like `eqx.nn.make_with_state`.

    **Arguments:**

    - `ctor`: builds an object (typically an `eqx.Module` holding handles).

    **Returns:**

    A function taking `ctor`'s arguments and returning `(obj, states)`, where `states`
    is a [`eqstate.StateDict`][] of every state created during the call.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        model, states = es.make_with_states(lambda: es.ParamState(jnp.ones(3)))()
        assert states.states == (model,)
        ```
    """

    @ft.wraps(ctor)
    def build(*args: _P.args, **kwargs: _P.kwargs) -> tuple[_T, StateDict]:
        try:
            states, obj = run(ctor, StateDict(), *args, **kwargs)
        except StateNotFoundError as error:
            raise StateNotFoundError(
                f"{error} Inside `eqstate.make_with_states`, the constructor sees only "
                "the states it creates: pass it what it reads, e.g. an explicit key "
                "rather than a draw from `eqstate.random`."
            ) from None
        return obj, states

    return build


# A JAX key path, as `jax.tree_util.tree_leaves_with_path` gives it.
_KeyPath = tuple[Any, ...]


@overload
def states_of(
    pytree: PyTree, *filters: Filter, with_paths: Literal[False] = False
) -> tuple[State, ...]: ...


@overload
def states_of(
    pytree: PyTree, *filters: Filter, with_paths: Literal[True]
) -> tuple[tuple[_KeyPath, State], ...]: ...


@overload
def states_of(
    pytree: PyTree, *filters: Filter, with_paths: bool
) -> tuple[State, ...] | tuple[tuple[_KeyPath, State], ...]: ...


def states_of(
    pytree: PyTree, *filters: Filter, with_paths: bool = False
) -> tuple[State, ...] | tuple[tuple[_KeyPath, State], ...]:
    """The handles found in a PyTree, in flattening order, each listed once.

    **Arguments:**

    - `pytree`: any PyTree, e.g. an `eqx.Module` holding handles. Not a
        `StateDict` (`TypeError`): use its `states` or `filter` instead.
    - `*filters`: keep the states matching any of these (see [`eqstate.filters`][]);
        every state if none is given. Predicates receive the state's PyTree path.
        A state found at several paths (a weight tied into two layers) is kept if
        the filters match it at any of them: a path predicate `F` and
        `eqstate.filters.Not(F)` then both keep it. To split states into two
        groups, take one with `F` and the rest as the states not in it.
    - `with_paths`: if `True`, return `(path, state)` pairs, where `path` is a JAX key
        path (`jax.tree_util.keystr(path)` renders it): the first path at which the
        filters match. (Keyword only argument.)

    **Returns:**

    A tuple of handles, or of `(path, handle)` pairs.

    **Raises:**

    `ValueError` if a module in `pytree` keeps a handle in a field marked
    `eqx.field(static=True)`, which flattening skips (and with it every function that
    finds a model's states: `values_of`, checkpoints, `clone`).

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        tree = {"w": es.ParamState(jnp.ones(2)), "n": es.ShortTermState(jnp.array(0))}
        assert es.states_of(tree, es.ParamState) == (tree["w"],)
        ```
    """
    if isinstance(pytree, StateDict):
        raise TypeError(
            "This looks for the handles held by a PyTree (a model: `states_of`, "
            "`values_of`, `trainable`, `clone`, ...), and a StateDict holds none: its "
            "states are its keys. Pass the model, or use the StateDict's `states` or "
            "`filter(...)`."
        )
    flag(with_paths, "with_paths", owner="`states_of`'s ")
    refuse_static_handles(pytree)
    predicates = [to_predicate(f) for f in filters]
    found: dict[State, tuple] = {}
    for path, leaf in jtu.tree_leaves_with_path(pytree, is_leaf=is_state):
        if is_state(leaf) and leaf not in found:
            if not predicates or any(p(path, leaf) for p in predicates):
                found[leaf] = path
    if with_paths:
        return tuple((path, state) for state, path in found.items())
    return tuple(found)


def values_of(pytree: PyTree, *filters: Filter) -> StateDict:
    """The current values of the states found in a PyTree, as a [`eqstate.StateDict`][]:
    `states_of` followed by a read of each state in the innermost context.

    **Arguments:**

    - `pytree`: any PyTree, e.g. a model holding handles.
    - `*filters`: keep the states matching any of these; every state if none.

    **Returns:**

    A `StateDict`, in the order of [`eqstate.states_of`][].

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        model = {"w": es.ParamState(jnp.ones(2)), "n": es.ShortTermState(jnp.array(0))}
        params = es.values_of(model, es.ParamState)
        assert params.states == (model["w"],)
        ```
    """
    states = states_of(pytree, *filters)
    frame = _context.current_frame()
    return state_dict_of(dict(zip(states, frame.read_many(states) if states else [])))


def _read_to_write(frame: _context.Frame, states: list[State]) -> list[Any]:
    """`frame.read_many(states)`, for `assign`. Where the frame refuses the read (inside
    a raw JAX transform), it is refused as the write the caller asked for."""
    try:
        return frame.read_many(states)
    except TraceContextError as error:
        refused = error
    if isinstance(frame, _context.World | _context.DictFrame):
        frame.check_trace(states[0])
    raise refused


_ASSIGN_LOAD = (
    " (`eqstate.load(path, model)` now writes the states itself and returns the model, "
    "its arrays loaded too: `model = eqstate.load(path, model)`.)"
)
_ASSIGN_PAIR = (
    " A pair `(StateDict, arrays)` is shaped like `eqstate.trainable(model)`: apply "
    "such updates to the model with `model = eqstate.apply_updates(model, updates)`."
)


def assign(values: Mapping[State, PyTree] | PyTree) -> None:
    """Writes every value of `values` to its state in the innermost context, as
    `state.value = value` would, all at once: every write is checked before any is
    made, so a bad value leaves every state as it was.

    **Arguments:**

    - `values`: a [`eqstate.StateDict`][] or mapping from handles to new values,
        e.g. parameters updated by an optimiser. It is typed as any PyTree so that
        what optax returns (`optax.apply_updates(params, updates)`, declared as a
        PyTree of arrays, and a `StateDict` when `params` is one) is accepted as it
        is; anything but a mapping from handles raises `TypeError`.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.zeros(2))
        es.assign(es.values_of(w).set(w, jnp.ones(2)))
        assert (w.value == 1).all()
        ```
    """
    pair = _ASSIGN_PAIR if _is_update_pair(values) else ""
    _check_mapping(values, "assign", _ASSIGN_LOAD + pair)
    states = list(values)
    if not states:
        return
    frame = _context.current_frame()
    eager = compat.is_top_level()
    current = _read_to_write(frame, states)
    checked = {}
    for state, old in zip(states, current):
        refuse_leaked_tracers(state, values[state], eager)
        checked[state] = check_write(state, old, values[state])
    frame.commit(checked)


def _is_update_pair(values: Any) -> bool:
    """Whether `values` is shaped like `eqstate.trainable(model)`."""
    return (
        isinstance(values, tuple)
        and len(values) == 2
        and isinstance(values[0], StateDict)
    )


def _check_mapping(values: Any, name: str, hint: str = "") -> None:
    if not isinstance(values, Mapping) or not all(is_state(s) for s in values):
        raise TypeError(
            f"`eqstate.{name}` takes a StateDict or a mapping from state handles to "
            f"new values, got {type(values).__name__} {values!r:.60}. E.g. "
            f"`eqstate.{name}({{w: new_w}})`.{hint}"
        )


_NEW_SHAPE_IN_TRANSFORM = (
    "Cannot give {label} the value {new} inside an eqstate transform: a traced "
    "function keeps the structure and shape of every state it uses, which its trace "
    "takes as inputs. Call `eqstate.init_states` before calling the transformed "
    "function (which traces again for the new shapes): in eager code, or inside "
    "`eqstate.scope` or `eqstate.run`."
)


def init_states(values: Mapping[State, PyTree] | PyTree) -> None:
    """Gives states new values of any structure, shape or dtype, all at once, as
    when they were created: what brainstate's `init_state(batch_size)` and
    `reset_state` do, such as giving a hidden state the batch size of the next
    sequence. A write (`state.value = ...`, [`eqstate.assign`][]) must keep the
    structure, shape and dtype of the current value; this is the separate, explicit
    way to change them.

    A state keeps its structure and shape within a traced function, so this changes
    them only outside eqstate's transforms: in eager code, and inside
    [`eqstate.scope`][] and [`eqstate.run`][] (also under `jax.jit`). Inside a
    transform, values that keep the structure and shape are written as by
    [`eqstate.assign`][], and any other raises [`eqstate.StateValueError`][] with
    nothing written, so that a layer's `init_state` may be called everywhere with
    the batch size it already has.

    **Arguments:**

    - `values`: a [`eqstate.StateDict`][] or mapping from handles to their new
        values (PyTrees of arrays). Each state must have a value in the innermost
        context already; a [`eqstate.RandomState`][] takes typed keys.

    !!! Example

        ```python
        import eqstate as es
        import equinox as eqx
        import jax.numpy as jnp

        class Integrator(eqx.Module):
            h: es.ShortTermState

            def __init__(self, size):
                self.h = es.ShortTermState(jnp.zeros(size))

            def init_state(self, batch_size):
                es.init_states({self.h: jnp.zeros((batch_size, *self.h.value.shape[-1:]))})

            def __call__(self, x):
                self.h.value = self.h.value + x
                return self.h.value

        layer = Integrator(3)
        layer.init_state(8)
        step = es.transform.jit(layer)
        assert step(jnp.ones((8, 3))).shape == (8, 3)
        layer.init_state(2)  # a new batch size: `step` traces again
        assert step(jnp.ones((2, 3))).shape == (2, 3)
        ```
    """
    _check_mapping(values, "init_states")
    states = list(values)
    frame = _context.current_frame()
    if not isinstance(frame, _context.World | _context.DictFrame):
        current = _read_to_write(frame, states)
        for state, old in zip(states, current):
            new = to_new_value(state, values[state])
            if not _same_structure_and_shapes(old, new):
                label, shown = state_label(state, old), value_summary(new)
                raise StateValueError(
                    _NEW_SHAPE_IN_TRANSFORM.format(label=label, new=shown)
                )
        assign(values)
        return
    new = {}
    for state in states:
        frame.fetch(state)  # Raises for a state that has no value here.
        value = to_new_value(state, values[state])
        refuse_leaked_tracers(state, value, compat.is_top_level())
        if isinstance(state, RandomState) and not all(
            map(is_key, jtu.tree_leaves(value))
        ):
            raise StateValueError(
                f"Cannot give {state_label(state)} the value {value_summary(value)}: a "
                "RandomState holds typed PRNG keys (`jax.random.key`)."
            )
        new[state] = value
    frame.commit(new)


def _same_structure_and_shapes(old: PyTree, new: PyTree) -> bool:
    old_leaves, old_def = jtu.tree_flatten(old)
    new_leaves, new_def = jtu.tree_flatten(new)
    shapes = [(o.shape, n.shape) for o, n in zip(old_leaves, new_leaves)]
    return old_def == new_def and all(o == n for o, n in shapes)
