"""What a state may hold, and what a write may change: values made arrays, and a
write checked against the value it replaces (its structure, shapes and dtypes; a
number its dtype cannot hold; a deleted array or a leaked tracer), each refusal
naming the state."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer

from . import _jax_compat as compat
from ._errors import LEAKED_TRACER_WRITE, StateValueError, TraceContextError
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


def to_new_value(state: Any, value: Any) -> Any:
    """`value` as a new value of `state`, of any structure, shape and dtype: each leaf
    made an array as a write makes it, and refused as a write refuses it (an object
    JAX cannot make an array of, a deleted array, a leaked tracer), naming `state`."""

    def leaf(x: Any) -> Any:
        _refuse_deleted(state, x)
        if isinstance(x, Tracer) and compat.is_dead_tracer(x):
            raise TraceContextError(
                LEAKED_TRACER_WRITE.format(label=state_label(state))
            )
        return _array_to_write(state, x)

    return jtu.tree_map(leaf, value)


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
            f"{_NEW_SHAPE_HINT}"
        )
    if new.shape != old.shape:
        return _NEW_SHAPE_HINT
    return f" Convert it first, e.g. `value.astype({old.dtype})`."


_NEW_SHAPE_HINT = (
    " To give the state a value of another shape (a new batch size, say), call "
    "`eqstate.init_states({state: value})` outside transforms."
)


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
            f"shape and dtype of the current value.{_NEW_SHAPE_HINT}"
        )
    leaves = [_cast_leaf(state, o, n) for o, n in zip(old_leaves, new_leaves)]
    return jtu.tree_unflatten(old_def, leaves)
