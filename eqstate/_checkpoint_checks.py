"""Checks that both checkpoint backends make before they touch a file: that a checkpoint
is saved or loaded outside JAX transforms, and that every array to save can be read."""

from typing import Any

import jax
from jax.core import Tracer

from ._checkpoint_paths import Leaf
from ._errors import CheckpointError
from ._jax_compat import is_top_level
from ._pretty_print import state_label


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


def check_savable(spec: Leaf, leaf: Any) -> None:
    """Raises `CheckpointError` if `leaf`, the array stored as `spec`, cannot be read:
    a tracer, or an array that has been deleted."""
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
            "(`jnp.copy(x)`) of values that must outlive a donating call."
        )
