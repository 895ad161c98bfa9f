"""Where state reads and writes go.

Contexts form a stack of *frames*, innermost first, held in a `ContextVar` so that every
thread and async task has its own:

- the **world** is the outermost frame: process-wide, guarded by a lock, holding values
  by handle identity and dropping them when a handle is garbage collected;
- a **dictionary frame** (`scope`, `run`, `jaxpr_call` with a `StateDict`) is strict: it
  sees only its own states;
- a **trace frame** (a StatefulFunction being traced) falls through to its parent on the
  first access of a state and turns the value into an input of its jaxpr.

Frames keep their own values and hand them to their parent only when the call that
pushed them succeeds, so a failure needs no rollback.
"""

import abc
import contextlib
import contextvars
import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer

from . import _jax_compat as compat
from ._custom_types import MISSING
from ._errors import (
    LEAKED_TRACER_WRITE,
    RAW_TRANSFORM_READ,
    RAW_TRANSFORM_WRITE,
    StateNotFoundError,
    StateValueError,
    TraceContextError,
)
from ._pretty_print import state_label
from ._shapes import is_key


def to_value(value: Any) -> Any:
    """Converts every leaf of a PyTree to a JAX array (tracers pass unchanged)."""
    return jtu.tree_map(to_array, value)


def to_checked_value(state: Any, value: Any) -> Any:
    """As `to_value`, for a value `state` starts from: a leaf whose value its array
    would not hold raises `StateValueError` (see `_to_checked_array`)."""
    return jtu.tree_map(lambda x: _to_checked_array(state, x), value)


def to_dict_value(state: Any, value: Any) -> Any:
    """As `to_value`, for the value of `state` in a `StateDict`: `jax.ShapeDtypeStruct`
    leaves (those of an abstract dictionary, as `eqstate.transform.eval_shape`
    returns) pass unchanged, and a leaf whose value its array would not hold raises
    `StateValueError` (see `_to_checked_array`)."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return _to_checked_array(state, x)

    return jtu.tree_map(leaf, value)


def to_array(x: Any) -> Any:
    """`x` as a `jax.Array`; a copy if it is not one: on some JAX releases (0.8.0 on
    the CPU) `jnp.asarray` of a NumPy array shares its buffer, which the caller may
    change afterwards."""
    return x if isinstance(x, jax.Array) else jnp.array(x)


# The values whose conversion to an array is checked (JAX arrays and tracers never are).
_CONCRETE = (int, float, complex, np.ndarray, np.generic)


def cast_breaks(value: Any, dtype: Any) -> tuple[Any, Any] | None:
    """What casting `value` (a NumPy array or scalar, or a Python number) to `dtype`
    breaks, if anything: an integer must keep its value (not wrap around), a float must not
    overflow to infinity nor a non-zero become 0. Rounding to the nearest value of a
    float `dtype` (`0.1` to `float32`) breaks nothing: JAX rounds every such write.

    **Returns:**

    `(before, after)` for the first element it breaks, or `None`.
    """
    value = np.asarray(value)
    if value.dtype == dtype:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        cast = value.astype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        # Part by part: `1e-50 + 1j` to complex64 must not lose its real part.
        broken = np.zeros(value.shape, bool)
        for part in (np.real, np.imag):
            given, kept = part(value), part(cast)
            broken |= (np.isfinite(given) & ~np.isfinite(kept)) | (
                (given != 0) & (kept == 0)
            )
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            broken = cast.astype(value.dtype) != value
    if not broken.any():
        return None
    first = tuple(np.argwhere(broken)[0]) if value.ndim else ()
    return value[first], cast[first]


def _refuse_broken_cast(
    state: Any, value: Any, dtype: Any, *, narrowed: bool = False
) -> None:
    """Raises `StateValueError` naming `state` if `value`, a concrete number or NumPy
    array, would be broken (see `cast_breaks`) by storing it as `dtype`; `narrowed`:
    the cast is JAX's narrowing of 64-bit values (64-bit types off)."""
    if not isinstance(value, _CONCRETE):
        return
    broken = cast_breaks(value, dtype)
    if broken is None:
        return
    before, after = broken
    dtype = jnp.dtype(dtype)
    why, fix = "", ""
    if narrowed:
        why = " (64-bit types are off, so JAX converts it to 32 bits)"
        fix = ", or enable 64-bit types (`jax.config.update('jax_enable_x64', True)`)"
    raise StateValueError(
        f"Cannot give {state_label(state)} the value {before} as {dtype}{why}: "
        f"{dtype} cannot hold it (it would become {after}). Write a value that "
        f"{dtype} holds{fix}; if the change is meant, make it yourself, e.g. "
        f"`jnp.asarray(x).astype(jnp.{dtype})`."
    )


def _to_checked_array(state: Any, x: Any) -> Any:
    """`x` as a JAX array, or `StateValueError` naming `state` if the array would not
    hold its value: a NumPy `int64` that becomes `int32` (64-bit types off), a Python
    int too large for JAX's integers. A JAX array or tracer passes unchecked; a leaf
    JAX cannot make an array of raises JAX's `TypeError`."""
    if isinstance(x, jax.Array):
        return x
    try:
        # NumPy warns of a value that the narrowing breaks, refused just below.
        with np.errstate(over="ignore", invalid="ignore"):
            array = jnp.array(x)
    except OverflowError as error:
        raise StateValueError(
            f"Cannot give {state_label(state)} the value {x!r}: {error}. Convert it "
            "first to an array of a dtype that holds it (e.g. `jnp.array(x, "
            "jnp.uint32)` or `jnp.array(x, jnp.float32)`), or enable 64-bit types "
            "(`jax.config.update('jax_enable_x64', True)`)."
        ) from None
    _refuse_broken_cast(state, x, array.dtype, narrowed=True)
    return array


def has_tracer(value: Any) -> bool:
    """Whether a leaf of the PyTree `value` is a tracer (of any transform)."""
    return any(isinstance(x, Tracer) for x in jtu.tree_leaves(value))


def refuse_leaked_tracers(state: Any, value: Any, eager: bool) -> None:
    """Raises `TraceContextError` naming `state` if `value` holds a tracer that
    cannot belong here: any tracer in `eager` code, else one whose trace has ended."""
    for x in jtu.tree_leaves(value):
        if isinstance(x, Tracer) and (eager or compat.is_dead_tracer(x)):
            raise TraceContextError(
                LEAKED_TRACER_WRITE.format(label=state_label(state))
            )


def _refuse_deleted(state: Any, x: Any) -> None:
    if isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.is_deleted():
        raise StateValueError(
            f"Cannot give {state_label(state)} an array that has been deleted (its "
            "buffer was donated to a computation, or deleted by hand). Keep a copy "
            "(`jnp.copy(x)`) of values that must outlive a donating call."
        )


def _promotion_keeps(dtype: Any, new: Any) -> bool:
    """Whether the configured dtype promotion of `dtype` with `new` gives `dtype` (under
    `jax_numpy_dtype_promotion="strict"`, a weak float and an int do not promote)."""
    try:
        return jnp.result_type(dtype, new) == dtype
    except (ValueError, TypeError):  # TypePromotionError is a ValueError; keys raise
        return False


def is_weak(x: Any) -> bool:
    """Whether `x` (an array, tracer or `jax.ShapeDtypeStruct`) is weakly typed."""
    return getattr(getattr(x, "aval", x), "weak_type", False)


def _cast_leaf(state: Any, old: Any, new: Any) -> Any:
    _refuse_deleted(state, new)
    if isinstance(new, Tracer) and compat.is_dead_tracer(new):
        raise TraceContextError(LEAKED_TRACER_WRITE.format(label=state_label(state)))
    if isinstance(old, jax.ShapeDtypeStruct):
        return _check_abstract_leaf(state, old, new)
    if not isinstance(old, jax.Array):
        # A StateDict made by `jax.tree.map` or `jax.device_get` may hold Python
        # scalars or NumPy arrays: check against the array that `old` stands for.
        old = to_array(old)
    if type(new) is int and _beyond_default_int(new) and _scalar_number(old):
        # Too large for JAX's default integer (int32 with 64-bit types off), but maybe
        # not for the state: `3_000_000_000` for a uint32 state, `2**40` for float32.
        if not _fits(new, old.dtype):
            raise StateValueError(
                f"Cannot give {state_label(state)} the value {new}: its dtype, "
                f"{old.dtype}, cannot hold it. Write a value that {old.dtype} holds."
            )
        converted = jnp.asarray(new, old.dtype)
        return compat.weakly_typed(converted) if is_weak(old) else converted
    given, new = new, _array_to_write(state, new)
    weak = is_weak(new)
    if new.shape == old.shape and new.dtype == old.dtype:
        # A Python scalar written to a strongly typed state leaves it strong: the
        # state's values promote alike whichever number was written (`3.0` or `3`).
        return new.astype(new.dtype) if weak and not is_weak(old) else new
    # A weakly typed value (a Python scalar) may take the state's dtype if JAX's own
    # promotion would keep that dtype: `count.value = 0` works for a float state.
    if new.shape == old.shape and weak and _promotion_keeps(old.dtype, new):
        # Weakly typed in, weakly typed out: `x.value = 3` on a state made from
        # `1.0` keeps it promoting as a Python float does, as `x.value = 3.0` would.
        # `300` for a uint8 state, also as an array made from it (`StateDict({u: 300})`).
        _refuse_broken_cast(state, _on_host(given), old.dtype)
        converted = new.astype(old.dtype)
        return compat.weakly_typed(converted) if is_weak(old) else converted
    raise _mismatch(state, old, new)


def _beyond_default_int(number: int) -> bool:
    """Whether JAX's default integer type (int32 with 64-bit types off) cannot hold
    `number`."""
    default = jnp.iinfo(jax.dtypes.canonicalize_dtype(jnp.int64))
    return not default.min <= number <= default.max


def _scalar_number(x: Any) -> bool:
    dtype = x.dtype
    return x.shape == () and (
        jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
    )


def _fits(number: int, dtype: Any) -> bool:
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return int(info.min) <= number <= int(info.max)
    return abs(number) <= float(jnp.finfo(dtype).max)


def _on_host(x: Any) -> Any:
    """`x` as a NumPy array if it is a JAX array (not a tracer) that this process
    holds whole, so that `_refuse_broken_cast` checks it; else `x`."""
    if (
        isinstance(x, jax.Array)
        and not isinstance(x, Tracer)
        and x.is_fully_addressable
    ):
        return np.asarray(x)
    return x


def _array_to_write(state: Any, new: Any) -> Any:
    try:
        return _to_checked_array(state, new)
    except TypeError:
        raise StateValueError(
            f"Cannot write {new!r} (a {type(new).__name__}) to {state_label(state)}: "
            "a state's value is a PyTree of arrays, and JAX cannot make an array of "
            "it. Write an array, or a Python or NumPy number."
        ) from None


def _check_abstract_leaf(state: Any, old: jax.ShapeDtypeStruct, new: Any) -> Any:
    """`new` for a leaf of an abstract StateDict (a `jax.ShapeDtypeStruct`), which
    it must match in shape and dtype."""
    if not isinstance(new, jax.ShapeDtypeStruct):
        # As a write to a value of that type: a Python scalar takes its dtype.
        stand_in = jnp.zeros(old.shape, old.dtype)
        if old.weak_type:
            stand_in = compat.weakly_typed(stand_in)
        return _cast_leaf(state, stand_in, new)
    if new.shape == old.shape and new.dtype == old.dtype:
        return old  # the type it had, weak or strong
    raise _mismatch(state, old, new)


def _mismatch(state: Any, old: Any, new: Any) -> StateValueError:
    return StateValueError(
        f"Cannot write a value of shape {tuple(new.shape)} and dtype {new.dtype} to "
        f"{state_label(state)} (shape {tuple(old.shape)}, dtype {old.dtype}). A write "
        f"must keep the structure, shape and dtype of the current value."
        f"{_write_hint(old, new)}"
    )


def _write_hint(old: Any, new: Any) -> str:
    """What to do about a write of `new` that does not fit `old`."""
    if is_key(old):
        if is_key(new):
            return " Keys of another PRNG implementation cannot replace this one."
        return " Write a key (`jax.random.key(3)`), or reseed it: `state.seed(3)`."
    extra = new.shape[: max(len(new.shape) - len(old.shape), 0)]
    if extra and new.shape[len(extra) :] == old.shape:
        # A batch axis, or axes the caller forgot to reduce: the hint names both.
        return (
            f" The value has extra leading axes {extra}: reduce or index them away "
            "first (e.g. `value.sum(axis=0)`), or, if they are batch axes (one value "
            "per member of an ensemble), create the state inside "
            "`eqstate.transform.vmap_new_states` so that it has them too."
        )
    if new.shape != old.shape:
        return ""
    return f" Convert it first, e.g. `value.astype({old.dtype})`."


# Messages of the layers above for a write that changes a value's structure, given
# `(label, old, new)`, or "" (`_training` explains an optimiser state of the other
# training style).
STRUCTURE_HINTS: list[Callable[[str, Any, Any], str]] = []


def check_write(state: Any, old: Any, new: Any) -> Any:
    """Returns `new` as a PyTree of arrays shaped like `old`, or raises `StateValueError`
    naming `state`."""
    new_leaves, new_def = jtu.tree_flatten(new)
    old_leaves, old_def = jtu.tree_flatten(old)
    if new_def != old_def:
        label = state_label(state)
        hints = [m for hint in STRUCTURE_HINTS if (m := hint(label, old, new))]
        raise StateValueError(
            hints[0]
            if hints
            else f"Cannot write a value with PyTree structure {new_def} to {label}, "
            f"whose value has structure {old_def}. A write must keep the structure, "
            "shape and dtype of the current value."
        )
    leaves = [_cast_leaf(state, o, n) for o, n in zip(old_leaves, new_leaves)]
    return jtu.tree_unflatten(old_def, leaves)


def _not_found(state: Any, where: str) -> Exception:
    expired_in = getattr(state, "_expired_in", None)
    if expired_in is not None:
        message, where = expired_in
        return TraceContextError(message.format(label=state_label(state), where=where))
    return StateNotFoundError(f"{state_label(state)} {where}")


_NOT_IN_WORLD = (
    "has no value in the world. It was created inside `eqstate.scope`, "
    "`eqstate.run` or `eqstate.make_with_states`, so its value lives in the StateDict "
    "those return. Pass that dictionary: `eqstate.run(fn, states, *args)` or "
    "`with eqstate.scope(states): ...`."
)

_NOT_IN_DICT = (
    "is not in the StateDict this code runs against (`eqstate.scope`, `eqstate.run` "
    "or `jaxpr_call`), and that dictionary is strict: states outside it are not visible. "
    "Add the state to the dictionary, e.g. `states | eqstate.world().filter(state)`."
)


RAW_TRANSFORM_CREATE = (
    "Cannot create {label} inside a raw JAX transform (`jax.jit`, `jax.vmap`, ...) "
    "nested in an eqstate context: its value would leak out of the trace. Use the "
    "eqstate version of the transform (e.g. `eqstate.transform.vmap_new_states` "
    "instead of `jax.vmap`)."
)


class Frame(abc.ABC):
    """A context that holds state values. Subclasses define where values live.

    A frame made inside a JAX trace keeps it in `jax_trace` and refuses, with
    `check_trace`, writes made from any other trace: a raw JAX transform nested in
    the frame would otherwise store its tracers there. The world has no such trace
    and checks for the top level instead.
    """

    __slots__ = ("jax_trace",)

    # Whether `eqstate.world()` here may take the values at once (outside any trace):
    # frames that hold or pass on plain values. Others (a lane of `vmap_new_states`)
    # decide what a read gives, so a snapshot reads through them.
    snapshots_at_once = False

    @abc.abstractmethod
    def read(self, state: Any) -> Any:
        """`state.value`: the value, recording a read."""

    @abc.abstractmethod
    def write(self, state: Any, value: Any) -> None:
        """`state.value = value`: checks and stores the value, recording a write."""

    @abc.abstractmethod
    def fetch(self, state: Any) -> Any:
        """The value as seen by a child frame importing it (no JAX-trace check)."""

    def read_many(self, states: Sequence[Any]) -> list[Any]:
        """The values of `states`, each read as by `read`."""
        return [self.read(s) for s in states]

    @abc.abstractmethod
    def commit(
        self, updates: dict[Any, Any], new: Sequence[tuple[Any, Any]] = ()
    ) -> None:
        """Stores, all at once, the (already checked) writes of a call that succeeded
        and the states it created."""

    def commit_values(self, states: Sequence[Any], values: Sequence[Any]) -> None:
        """`commit` of `zip(states, values)`, with no new state."""
        self.commit(dict(zip(states, values)))

    @abc.abstractmethod
    def add_new(self, state: Any, value: Any) -> None:
        """Registers a state created while this frame is innermost."""

    @abc.abstractmethod
    def peek(self, state: Any) -> Any:
        """The value without recording anything, or `MISSING`."""

    def nested_new_value(self, state: Any, value: Any) -> Any:
        """The value that `state`, created by a transform traced inside this frame
        (a jitted constructor), starts from: `value`, unless an enclosing frame
        replaces it (a lane of `vmap_new_states` re-keys a random state)."""
        return value

    def nested_mark(self) -> Any:
        """What `rewind_nested` takes to undo what the traces of a nested transform
        made from now on asked of this frame (see `nested_new_value`); `None` if
        nothing here depends on them."""
        return None

    def rewind_nested(self, mark: Any) -> None:
        """Undoes what nested traces asked of this frame since `mark`: the two-pass
        fallback throws away its discovery pass, which must leave nothing behind."""
        del mark  # Nothing here depends on nested traces (see `nested_mark`).

    def differentiates_inside(self) -> bool:
        """Whether a raw JAX differentiation (`jax.grad`, `eqx.filter_grad`, ...) runs
        inside this frame, around the current code: a value read from here is a
        constant to it."""
        trace = getattr(self, "jax_trace", None)  # The world has none.
        return compat.differentiation_inside(trace) is not None

    def check_trace(self, state: Any, *, creates: bool = False) -> None:
        """Raises `TraceContextError` naming `state` unless the current JAX trace is
        the one this frame was made in: a write (or with `creates`, a creation) from
        a raw JAX transform nested in this frame would leak its tracer."""
        if compat.current_trace() is not self.jax_trace:
            message = RAW_TRANSFORM_CREATE if creates else RAW_TRANSFORM_WRITE
            raise TraceContextError(message.format(label=state_label(state)))

    def check_commit_trace(
        self, updates: dict[Any, Any], new: Sequence[tuple[Any, Any]]
    ) -> None:
        """`check_trace` for a `commit`, naming its first write, else its first new
        state."""
        if updates:
            self.check_trace(next(iter(updates)))
        elif new:
            self.check_trace(new[0][0], creates=True)


class _Values(dict):
    """Values by `id(state)`. A value registered lazily (`World.add_lazy`) is made on
    its first lookup, however it is looked up (the jit fast path indexes this dict)."""

    __slots__ = ("lazy",)

    def __init__(self):
        super().__init__()
        self.lazy: dict[int, Any] = {}

    def __missing__(self, key: int) -> Any:
        with _LAZY_LOCK:  # Two threads' first lookups make the value once.
            if dict.__contains__(self, key):
                return dict.__getitem__(self, key)
            make = self.lazy.get(key)
            if make is None:
                raise KeyError(key)
            # Made outside any trace it was first looked up in: a world value must
            # be concrete, never a tracer that dies with that trace.
            with jax.ensure_compile_time_eval():
                value = self[key] = to_value(make())
            # Dropped only once made: after a failure (a transfer guard, say) the
            # next lookup tries again.
            del self.lazy[key]
        return value


_LAZY_LOCK = threading.Lock()


class World(Frame):
    """The outermost, process-wide frame."""

    __slots__ = ("__weakref__", "_refs", "_values", "lock")

    def __init__(self):
        # Values by `id(state)`: the jit fast path reads and writes this dict directly.
        self._values = _Values()
        self._refs: dict[int, weakref.ref] = {}
        self.lock = threading.RLock()

    @property
    def by_id(self) -> dict[int, Any]:
        """The values, keyed by `id(state)`. Only for callers that hold the handles
        (so that the ids stay theirs) and have checked `compat.is_top_level()`."""
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def snapshot(self) -> list[tuple[Any, Any]]:
        """The live `(state, value)` pairs, in creation order."""
        pairs = []
        with self.lock:
            # A copy: the garbage collector may drop entries (`_drop_entry`) while
            # this loop allocates, and the lock is re-entrant.
            for key, ref in list(self._refs.items()):
                state = ref()
                if state is not None:
                    pairs.append((state, self._values.get(key, MISSING)))
        # Lazy values are made after the lock is released: a thread making one holds
        # `_LAZY_LOCK`, and a garbage collection there waits for `self.lock`.
        return [(s, self.fetch(s) if v is MISSING else v) for s, v in pairs]

    def read(self, state):
        if not compat.is_top_level() and not compat.evaluates_at_once():
            raise TraceContextError(RAW_TRANSFORM_READ.format(label=state_label(state)))
        try:
            return self._values[id(state)]
        except KeyError:
            raise _not_found(state, _NOT_IN_WORLD) from None

    def read_many(self, states: Sequence[Any]) -> list[Any]:
        """The values of `states`, checked once for a raw JAX transform."""
        if not states:
            return []
        if not compat.is_top_level() and not compat.evaluates_at_once():
            raise TraceContextError(
                RAW_TRANSFORM_READ.format(label=state_label(states[0]))
            )
        values = self._values
        try:
            return [values[id(s)] for s in states]
        except KeyError:
            missing = next(s for s in states if id(s) not in values)
            raise _not_found(missing, _NOT_IN_WORLD) from None

    def fetch(self, state):
        try:
            return self._values[id(state)]
        except KeyError:
            raise _not_found(state, _NOT_IN_WORLD) from None

    def check_trace(self, state, *, creates=False):
        # The world was made outside any trace: only a write at the top level is safe.
        if not compat.is_top_level():
            message = RAW_TRANSFORM_CREATE if creates else RAW_TRANSFORM_WRITE
            raise TraceContextError(message.format(label=state_label(state)))

    def write(self, state, value):
        self.check_trace(state)
        refuse_leaked_tracers(state, value, eager=True)
        value = check_write(state, self.fetch(state), value)
        with self.lock:
            self._values[id(state)] = value

    def commit(self, updates, new=()):
        if not compat.is_top_level():
            state = next(iter(updates)) if updates else new[0][0]
            raise TraceContextError(
                RAW_TRANSFORM_WRITE.format(label=state_label(state))
            )
        for state, value in [*updates.items(), *new]:
            refuse_leaked_tracers(state, value, eager=True)
        with self.lock:
            for state, value in updates.items():
                self._values[id(state)] = value
            for state, value in new:
                self._register(state, value)

    def commit_values(self, states, values):
        if not compat.is_top_level():
            raise TraceContextError(
                RAW_TRANSFORM_WRITE.format(label=state_label(states[0]))
            )
        with self.lock:
            stored = self._values
            for state, value in zip(states, values):
                stored[id(state)] = value

    def add_new(self, state, value):
        if not compat.is_top_level() or has_tracer(value):
            raise TraceContextError(
                f"Cannot create {state_label(state)} inside a JAX transform that "
                "eqstate does not know about: its value would be a tracer leaking out "
                "of the trace. Create states eagerly, inside an eqstate transform "
                "(`eqstate.transform.jit`, `eqstate.transform.vmap_new_states`, ...), "
                "or with `eqstate.make_with_states`."
            )
        with self.lock:
            self._register(state, value)

    def add_lazy(self, state: Any, make: Any) -> None:
        """Registers `state` with the value `make()`, made on its first access. The
        default random state uses this: creating its key at import would start JAX's
        backend, after which `jax.distributed.initialize()` can no longer run."""
        with self.lock:
            self._values.lazy[id(state)] = make
            self._track(state)

    def _register(self, state: Any, value: Any) -> None:
        self._values[id(state)] = value
        self._track(state)

    def _track(self, state: Any) -> None:
        key = id(state)
        drop = functools.partial(_drop_entry, weakref.ref(self), key)
        self._refs[key] = weakref.ref(state, drop)

    def peek(self, state):
        try:
            return self._values[id(state)]
        except KeyError:
            return MISSING


def _drop_entry(world_ref: weakref.ref, key: int, _: weakref.ref) -> None:
    """Forgets a garbage-collected handle's value (a weakref callback)."""
    world = world_ref()
    if world is not None:
        with world.lock:
            world._values.pop(key, None)
            world._values.lazy.pop(key, None)
            world._refs.pop(key, None)


WORLD = World()
_current: contextvars.ContextVar[Frame] = contextvars.ContextVar(
    "eqstate_frame", default=WORLD
)


# Read on every call of a jitted function, so bound once rather than wrapped.
current_frame: Callable[[], Frame] = _current.get
"""The innermost frame of this thread or task."""


def enter(frame: Frame) -> tuple[contextvars.Token, Any]:
    """Makes `frame` the innermost frame; undo with `leave(token)`.

    A frame made inside a JAX trace (a trace of eqstate's, `run` under a raw
    transform) may be read from raw transforms nested in it, whose traces JAX caches
    by function: while it is innermost, those caches are keyed by an era that a read
    from such a transform ends (see `compat.new_trace_era`), so that a trace holding
    the value read is never reused with a stale value or a dead tracer."""
    era = None
    trace = getattr(frame, "jax_trace", None)
    if trace is not None and not compat.is_eval_trace(trace):
        era = (compat.enter_trace_era(),)
    return _current.set(frame), era


def leave(token: tuple[contextvars.Token, Any]) -> None:
    frame_token, era = token
    _current.reset(frame_token)
    if era is not None:
        compat.leave_trace_era(era[0])


def read_from_nested_transform(state: Any, strict: bool) -> None:
    """Called when a frame is read from inside a raw transform nested in it that
    stages out: refuses it if `strict` (an eager frame), else begins a new era."""
    if strict or not compat.KEEPS_TRACES_APART:
        raise TraceContextError(RAW_TRANSFORM_READ.format(label=state_label(state)))
    compat.new_trace_era()


_SCOPE_ENDED = (
    "Cannot use {label} through an `eqstate.scope` (or `eqstate.run`) that has ended: "
    "its result is final. Code that inherited the scope's context (an asyncio task "
    "created inside the `with` block, `asyncio.to_thread`, `contextvars.copy_context()`, "
    "a thread started with a copied context) can no longer read, write or create states "
    "through it. Finish that work inside the scope (e.g. `await` the task before the "
    "block exits), or give it a scope of its own."
)


def scope_ended(label: str) -> TraceContextError:
    """The error for a use of `label` through an ended `DictFrame`."""
    return TraceContextError(_SCOPE_ENDED.format(label=label))


class DictFrame(Frame):
    """A strict frame over an explicit dictionary of values.

    A task or thread that copied the context in which the frame is innermost keeps
    it after the `scope` that made it has ended: `end` makes every later use raise.
    """

    __slots__ = ("eager", "ended", "new_states", "values")
    snapshots_at_once = True

    def __init__(self, values: Iterable[tuple[Any, Any]]):
        self.values: dict[Any, Any] = dict(values)
        self.new_states: list[Any] = []
        self.jax_trace = compat.current_trace()
        self.eager = compat.is_top_level()
        self.ended = False

    def end(self) -> None:
        """Refuses every later read, write and creation, and drops the values."""
        self.ended = True
        self.values = {}
        self.new_states = []

    def read(self, state):
        if compat.stages_inside(self.jax_trace):
            # Only a frame made under a trace keys JAX's caches (see `enter`).
            read_from_nested_transform(state, strict=self.eager)
        return self.fetch(state)

    def fetch(self, state):
        try:
            return self.values[state]
        except KeyError:
            if self.ended:
                raise scope_ended(state_label(state)) from None
            raise _not_found(state, _NOT_IN_DICT) from None

    def write(self, state, value):
        # An ended frame holds no value, so `fetch` refuses the write.
        self.check_trace(state)
        refuse_leaked_tracers(state, value, self.eager)
        self.values[state] = check_write(state, self.fetch(state), value)

    def commit(self, updates, new=()):
        if self.ended and (updates or new):
            state = next(iter(updates)) if updates else new[0][0]
            raise scope_ended(state_label(state))
        self.check_commit_trace(updates, new)
        self.values.update(updates)
        for state, value in new:
            self.values[state] = value
            self.new_states.append(state)

    def add_new(self, state, value):
        if self.ended:
            raise scope_ended(state_label(state))
        self.check_trace(state, creates=True)
        refuse_leaked_tracers(state, value, self.eager)
        self.values[state] = value
        self.new_states.append(state)

    def peek(self, state):
        return self.values.get(state, MISSING)


class ParentAnswersNested(Frame):
    """A frame over a `parent` that passes on what nested transforms ask of it
    (`nested_new_value`, `nested_mark`, `rewind_nested`): only a lane of
    `vmap_new_states`, above it, answers them."""

    __slots__ = ()
    parent: Frame

    def nested_new_value(self, state, value):
        return self.parent.nested_new_value(state, value)

    def nested_mark(self):
        return self.parent.nested_mark()

    def rewind_nested(self, mark):
        self.parent.rewind_nested(mark)


class TraceFrame(ParentAnswersNested):
    """The frame of a StatefulFunction while it traces its function.

    On the first access of a state it imports the value from its parent: in single-pass
    mode the value becomes a new input of the jaxpr being traced; in the two-pass
    fallback it comes from `preloaded`, and states missing from there are recorded in
    `missing` (their parent value is used so that the trace can go on).
    """

    __slots__ = (
        "accessed",
        "ended",
        "imported",
        "missing",
        "new_states",
        "parent",
        "preloaded",
        "reads",
        "rule_mapped",
        "values",
        "written",
    )

    def __init__(self, parent: Frame, preloaded: dict[Any, Any] | None):
        self.parent = parent
        self.jax_trace = compat.current_trace()
        self.values: dict[Any, Any] = {}
        self.imported: dict[Any, Any] = {}  # The values from before the trace.
        self.ended = False
        self.accessed: list[Any] = []
        self.written: set[Any] = set()
        # States whose value from before the trace the function looked at.
        self.reads: set[Any] = set()
        self.new_states: list[Any] = []
        self.preloaded = preloaded
        self.missing: list[Any] = []
        # States an inner `vmap` maps per lane, around custom rules (`mapped_in_rules`).
        self.rule_mapped: set[Any] = set()

    def _import(self, state: Any) -> Any:
        if self.preloaded is None:
            outer = self.parent.fetch(state)
            leaves, treedef = jtu.tree_flatten(outer)
            leaves = [compat.new_input(self.jax_trace, x) for x in leaves]
            value = jtu.tree_unflatten(treedef, leaves)
        else:
            value = self.preloaded.get(state, MISSING)
            if value is MISSING:
                # Lent for this read only, never kept: the parent may compute it in an
                # inner trace (a `vmap` lane view), whose tracers must not outlive it.
                if state not in self.missing:
                    self.missing.append(state)
                    self.accessed.append(state)
                return self.parent.fetch(state)
        self.values[state] = self.imported[state] = value
        self.accessed.append(state)
        return value

    def original(self, state: Any) -> Any:
        """The state's value from before this trace (imported now if it was not),
        whatever the function wrote since; read as `read` reads it."""
        self.reads.add(state)
        value = self.imported.get(state, MISSING)
        if value is not MISSING:
            return value
        if state in self.values:  # Created in this trace.
            return self.values[state]
        return self._import(state)

    def current(self, state: Any) -> Any:
        """The state's value in this trace, imported on first access."""
        value = self.values.get(state, MISSING)
        return self._import(state) if value is MISSING else value

    def read(self, state):
        if compat.stages_inside(self.jax_trace):
            read_from_nested_transform(state, strict=False)
        return self.fetch(state)

    def fetch(self, state):
        if state not in self.written:  # After a write, the function sees its own value.
            self.reads.add(state)
        return self.current(state)

    def write(self, state, value):
        self.check_trace(state)
        old = self.current(state)
        self.values[state] = check_write(state, old, value)
        self.written.add(state)

    def commit(self, updates, new=()):
        self.check_commit_trace(updates, new)
        self.values.update(updates)
        self.written.update(updates)
        for state, value in new:
            self.values[state] = value
            self.new_states.append(state)

    def add_new(self, state, value):
        self.check_trace(state, creates=True)
        refuse_leaked_tracers(state, value, eager=False)
        self.values[state] = self.parent.nested_new_value(state, value)
        self.new_states.append(state)

    def peek(self, state):
        value = self.values.get(state, MISSING)
        return self.parent.peek(state) if value is MISSING else value

    def release(self) -> None:
        """Drops the tracers this frame holds, once its trace has ended, so that
        nothing keeps them alive (JAX's leak checker would flag them)."""
        self.values.clear()
        self.imported.clear()
        self.ended = True
        self.preloaded = None
        self.jax_trace = None


_IN_RULE = (
    "{label} is read by a custom differentiation rule (`jax.custom_jvp` or "
    "`jax.custom_vjp`), which JAX runs when it differentiates the function, {why} "
    "Pass the value to the custom function as an argument instead."
)


class RuleFrame(Frame):
    """The frame while a trace is evaluated, for the custom differentiation rules JAX
    runs then: they see the values the function was traced with, for the states it
    reads and does not write (a written state's value depends on where the rule
    runs, which eqstate cannot tell). Anything else raises `TraceContextError`."""

    __slots__ = ("mapped", "values")

    def __init__(self, values: dict[Any, Any], mapped: Iterable[Any] = ()):
        self.values = values
        self.mapped = frozenset(mapped)
        self.jax_trace = None

    def read(self, state):
        if state in self.mapped:
            raise TraceContextError(
                _IN_RULE.format(
                    label=state_label(state),
                    why="but an `eqstate.transform.vmap` inside the function maps it "
                    "(`in_states`), and the rule, run from outside that vmap, would "
                    "see every member's value instead of its own. Differentiate "
                    "inside the vmap (a vmap of grad).",
                )
            )
        value = self.values.get(state, MISSING)
        if value is MISSING:
            raise TraceContextError(
                _IN_RULE.format(
                    label=state_label(state),
                    why="but the function writes it, or does not read it itself.",
                )
            )
        _RULE_READS[0] += 1
        return value

    fetch = read

    def differentiates_inside(self) -> bool:
        return False  # The rules of a differentiation read the traced values.

    def write(self, state, value):
        raise TraceContextError(
            f"Cannot write {state_label(state)} inside a custom differentiation rule "
            "(`jax.custom_jvp` or `jax.custom_vjp`): JAX runs rules when it "
            "differentiates, and their side effects have no place in the result. "
            "Write the state in the function itself."
        )

    def commit(self, updates, new=()):
        self.write(next(iter(updates)) if updates else new[0][0], None)

    def add_new(self, state, value):
        self.write(state, value)

    def peek(self, state):
        return self.values.get(state, MISSING)


# How many times a custom rule has read a state (see `rule_reads`).
_RULE_READS = [0]


def rule_reads() -> int:
    """How many times a custom differentiation rule has read a state so far. JAX
    keeps what a rule computed (the values it read included) with the equations of
    the jaxpr it ran from, and those may be shared by several traces: a trace with
    custom rules made before the latest such read is not evaluated again."""
    return _RULE_READS[0]


@contextlib.contextmanager
def rules_see(values: dict[Any, Any], mapped: Iterable[Any] = ()) -> Iterator[None]:
    """Runs the `with` block in a `RuleFrame` over `values`, in which reading a
    state in `mapped` raises."""
    token = enter(RuleFrame(values, mapped))
    try:
        yield
    finally:
        leave(token)


def mapped_in_rules(states: Iterable[Any]) -> None:
    """Records, in every trace around the current frame, that `states` are mapped per
    lane by a `vmap` whose function has custom rules: when such a trace is
    differentiated, the rules run outside the vmap and would see the whole stacked
    value, so their reads of these states raise instead."""
    frame: Any = current_frame()
    while frame is not None:
        if isinstance(frame, TraceFrame):
            frame.rule_mapped.update(states)
        frame = getattr(frame, "parent", None)


def label_here(state: Any) -> str:
    """`state_label` with the value's summary when the current context knows it."""
    value = current_frame().peek(state)
    return state_label(state) if value is MISSING else state_label(state, value)
