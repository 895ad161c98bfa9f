"""The refusal shared by the layers whose states an ensemble stacks."""

from typing import NoReturn

from jaxtyping import Array

from .._pretty_print import state_label
from .._state import State


def refuse_stacked_call(
    layer: str,
    state: State,
    value: Array,
    single: tuple[int, ...],
    *,
    unit: str,
    example: str,
) -> NoReturn:
    """Raises `ValueError` for an ensemble called directly: `layer`'s `state` holds
    `value`, its members' values (each of shape `single`) stacked. `unit` names one
    member ("layer", "cell"); `example` shows a call of it under `vmap`."""
    members = value.shape[: value.ndim - len(single)]
    count = members[0] if len(members) == 1 else members
    raise ValueError(
        f"{layer} is an ensemble of {count} members: its {state_label(state)} has "
        f"shape {value.shape}, a single {unit}'s {single}, so its states are stacked "
        "(as `eqstate.transform.vmap_new_states` builds them) and it cannot be "
        "called directly. Call it inside `eqstate.transform.vmap`, mapping its "
        f"states: {example}. Or take one member, `eqstate.member(ensemble, i)`, and "
        "call it."
    )
