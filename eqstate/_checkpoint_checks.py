"""Checks that both checkpoint backends make before they touch a file: that a checkpoint
is saved or loaded outside JAX transforms, that every value to save is made of arrays,
and that every array to save can be read."""

from collections.abc import Mapping
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer
from jaxtyping import PyTree

from ._checkpoint_paths import Leaf
from ._context import cast_breaks, to_value
from ._errors import CheckpointError
from ._jax_compat import is_top_level
from ._pretty_print import state_label
from ._state import State


_UNDER_TRANSFORM = (
    "Cannot {verb} a checkpoint inside a JAX transform (`eqstate.transform.jit`, a "
    "loop or `vmap` body, `jax.jit`, ...): {why} {what}:\n"
    "    {fix}"
)
_WHY = {
    "load": (
        "the file would be read once, while the function is traced, and the values it "
        "held then baked into the compiled function as constants, so later calls "
        "would not see a newer checkpoint.",
        "Load outside the transform and assign the values before calling the "
        "compiled step",
    ),
    "save": (
        "the file would be written once, while the function is traced, and never by "
        "later calls.",
        "Save outside the transform, after calling the compiled step",
    ),
}


def refuse_under_transforms(verb: str, fix: str) -> None:
    """Raises `CheckpointError` unless this runs at the top level of JAX tracing.

    **Arguments:**

    - `verb`: `"save"` or `"load"`.
    - `fix`: the code to write instead, shown in the message.
    """
    if not is_top_level():
        why, what = _WHY[verb]
        raise CheckpointError(
            _UNDER_TRANSFORM.format(verb=verb, why=why, what=what, fix=fix)
        )


# What JAX raises for a leaf it cannot make an array of: text or an arbitrary object
# (TypeError), a Python int too large for its integer dtype (OverflowError), ...
_NOT_AN_ARRAY = (TypeError, OverflowError, ValueError)


def _first_non_array(value: PyTree) -> tuple[str, BaseException | None]:
    """The first leaf of `value` that JAX cannot make an array of, described, and
    the error JAX raised for it."""
    for path, leaf in jtu.tree_leaves_with_path(value):
        try:
            to_value(leaf)
        except _NOT_AN_ARRAY as e:
            text = repr(leaf)
            text = text if len(text) <= 60 else text[:57] + "..."
            where = f" at `{jtu.keystr(path)}`" if path else ""
            return f"{text} (a {type(leaf).__name__}){where}", e
    return "a leaf that is not an array", None


def _narrowed(state: State, value: PyTree, arrays: PyTree) -> None:
    """Raises `CheckpointError` if JAX broke a NumPy leaf or a Python float of
    `value` when making `arrays` of it: with 64-bit types off, it narrows `int64` to
    `int32` (wrapping `2**33 + 5` to `5`) and `float64` (and Python floats) to
    `float32` (`1e40` to `inf`, `1e-50` to `0`). The checkpoint would store another
    value. Rounding to the nearest `float32` (`0.1`) is not refused: it is what a
    write of the value to a state does."""
    flat = zip(jtu.tree_leaves_with_path(value), jtu.tree_leaves(arrays))
    for (path, leaf), array in flat:
        if isinstance(leaf, np.ndarray | np.generic):
            what = f"a NumPy array of dtype {leaf.dtype}"
        elif isinstance(leaf, float | complex):
            what = f"a Python {type(leaf).__name__}"
        else:
            continue
        broken = cast_breaks(leaf, array.dtype)
        if broken is None:
            continue
        before, after = broken
        where = f" at `{jtu.keystr(path)}`" if path else ""
        raise CheckpointError(
            f"Cannot save {state_label(state)}: its value holds {what}{where}, "
            f"which JAX converts to {array.dtype} (64-bit "
            f"types are off), and that changes it: {before} becomes "
            f"{after}. Nothing was written. Enable 64-bit types "
            "(`jax.config.update('jax_enable_x64', True)`), or convert the value "
            "yourself if the change is meant, e.g. "
            f"`jnp.asarray(x, jnp.{array.dtype})`."
        )


def values_to_save(states: Mapping[State, PyTree]) -> dict[State, PyTree]:
    """The values of `states` with every leaf a JAX array; `CheckpointError` naming
    the state for a value that is None (the checkpoint would have no entry for it)
    or that has a leaf JAX cannot make an array of (text, an arbitrary object, a
    Python int too large for JAX's integers), or a NumPy leaf that JAX would change
    when making an array of it."""
    values = {}
    for state, value in states.items():
        what = f"Cannot save {state_label(state)}: its value"
        if value is None:
            raise CheckpointError(
                f"{what} is None, which holds no arrays, so the checkpoint would "
                "have no entry for it and could not restore it. Nothing was written. "
                "Pass the state's value, e.g. `eqstate.values_of(model)`, or leave "
                "the state out of the mapping."
            )
        try:
            # NumPy warns of a 64-bit value that JAX's narrowing overflows, which
            # `_narrowed` refuses just below with the state's name.
            with np.errstate(over="ignore", invalid="ignore"):
                values[state] = to_value(value)
        except _NOT_AN_ARRAY as e:
            leaf, error = _first_non_array(value)
            if isinstance(error or e, OverflowError):
                raise CheckpointError(
                    f"{what} holds {leaf}, which JAX cannot make an array of: "
                    f"{error or e}. Nothing was written. Pass an array of a dtype "
                    "that holds it, e.g. `jnp.array(n, jnp.float32)`, or enable "
                    "64-bit types (`jax.config.update('jax_enable_x64', True)`)."
                ) from e
            raise CheckpointError(
                f"{what} holds {leaf}, which JAX cannot make an array of. Nothing "
                "was written. A checkpoint stores arrays: pass the state's value, "
                "e.g. `eqstate.values_of(model)`."
            ) from e
        _narrowed(state, value, values[state])
    return values


def check_savable(spec: Leaf, leaf: Any) -> None:
    """Raises `CheckpointError` if `leaf`, the array stored as `spec`, cannot be
    stored: a tracer, an array that has been deleted, or a `float0` array."""
    what = f"Cannot save `{spec.path}` ({state_label(spec.state)}): its value"
    if isinstance(leaf, Tracer):
        raise CheckpointError(
            f"{what} is a JAX tracer, which leaked out of a `jax.jit`, `jax.vmap`, "
            "... through a Python side effect. Nothing was written. Checkpoints are "
            "written from concrete values: return the values from the function and "
            "save them outside it."
        )
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
        raise CheckpointError(
            f"{what} (shape {spec.shape}, dtype {spec.dtype}) is an array that has "
            "been deleted: its buffer was donated to a computation (`jit` with "
            "`donate_states=True`, `donate_argnums`) or deleted by hand. Nothing was "
            "written. Save the states' current values, e.g. "
            "`eqstate.values_of(model)` taken after the call, or keep a copy "
            "(`jnp.copy(x)`) of values that must outlive a donating call. A thread "
            "saving while another runs a donating call must take turns with it: "
            "copy the values under the lock that call takes, then save the copy."
        )
    if spec.dtype == jax.dtypes.float0:
        raise CheckpointError(
            f"{what} (shape {spec.shape}) has dtype float0, the dtype of the "
            "gradient JAX gives for an integer value (`jax.grad(..., "
            "allow_int=True)`): it holds no data, and a checkpoint cannot store it. "
            "Nothing was written or removed. Leave the state out of the checkpoint "
            "(e.g. save `eqstate.values_of(model)` rather than its gradients)."
        )
