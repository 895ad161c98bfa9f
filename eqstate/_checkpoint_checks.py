"""Checks that both checkpoint backends make before they touch a file: that a checkpoint
is saved or loaded outside JAX transforms."""

from ._errors import CheckpointError
from ._jax_compat import is_top_level


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
