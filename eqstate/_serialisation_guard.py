"""Refuses to let Equinox's serialisation skip state handles silently.

`eqx.tree_serialise_leaves` saves the array-like leaves of a PyTree and skips every
other leaf. A handle is not array-like, so a module holding handles would be saved
without any state value, and `eqx.tree_deserialise_leaves` would load none. The only
point where a handle sees this happening is Equinox's array-like test
(`hasattr(leaf, "__jax_array__")`), which `State.__jax_array__` routes here.

That test runs leaf by leaf after `eqx.tree_serialise_leaves` has opened its file for
writing, so the refusal cannot keep a file already at that path: Equinox has
truncated it (and written the leaves before the handle). The message says so.
"""

import sys
from typing import Any, NoReturn

from ._pretty_print import state_label


_SERIALISE = (
    "`eqx.tree_serialise_leaves` met {label}. A handle holds no value, so Equinox would "
    "skip it and save none of the values of the states: the file would load back as a "
    "model with its initial states. (Equinox had already opened the file for writing: "
    "a file that was at that path is now truncated.) Save the model with eqstate, "
    "which stores its arrays and its states' values together, by path:\n"
    "    eqstate.save(path, model)\n"
    "    model = eqstate.load(path, model)"
)

_DESERIALISE = (
    "`eqx.tree_deserialise_leaves` met {label} in `like`. A handle holds no value, so "
    "Equinox would load nothing into it and the states would keep the values they have "
    "now. Save and load the model with eqstate, which stores its arrays and its "
    "states' values together, by path:\n"
    "    eqstate.save(path, model)\n"
    "    model = eqstate.load(path, model)"
)

_EQUINOX_CALLERS = {
    "default_serialise_filter_spec": _SERIALISE,
    "default_deserialise_filter_spec": _DESERIALISE,
}


_WRAPPERS = ("eqstate.", "beartype", "jaxtyping")


def refuse_if_serialised(state: Any) -> None:
    """Raises `TypeError` if Equinox's (de)serialisation is asking whether `state` is
    array-like; returns otherwise."""
    # The question comes as `hasattr(leaf, "__jax_array__")` from Equinox's
    # `is_array_like`, called by a default filter spec. Walk up past this package's
    # frames (and those of a runtime type checker wrapping them), expect
    # `is_array_like`, then look at its caller. Any other caller returns at once: JAX
    # asks the same question of every non-array it is given.
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(
        _WRAPPERS
    ):
        frame = frame.f_back
    if frame is None or frame.f_code.co_name != "is_array_like":
        return
    caller = frame.f_back
    if caller is None or not caller.f_globals.get("__name__", "").startswith("equinox"):
        return
    message = _EQUINOX_CALLERS.get(caller.f_code.co_name)
    if message is not None:
        raise TypeError(message.format(label=state_label(state)))


_NOT_AN_ARRAY = "A state handle is not an array: read its value with `.value`."


def not_an_array(state: Any) -> NoReturn:
    """The `AttributeError` that makes `hasattr(handle, "__jax_array__")` false. Its
    message names no state: JAX and Equinox ask this of every non-array leaf, so it
    must be cheap."""
    del state
    raise AttributeError(_NOT_AN_ARRAY)
