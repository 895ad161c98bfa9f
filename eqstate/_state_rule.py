"""Rules that give each state a setting: one for every state, `{filter: setting}`, or a
function of the state and its value. Shardings and partition specs are given this way."""

from collections.abc import Callable, Mapping
from typing import Any, cast, TypeVar

from ._filters import to_predicate
from ._state import State


_T = TypeVar("_T")


def per_state_rule(
    rule: Any, kind: type[_T], *, what: str, spelled: str, short: str
) -> Callable[[State, Any], _T | None]:
    """`rule` as a function `(state, value) -> setting | None`.

    **Arguments:**

    - `rule`: one `kind` for every state; a mapping `{filter: kind}`, where each state
        takes the setting of the first filter it matches (`None` if it matches none);
        or a function `(state, value) -> kind | None`, returned as it is.
    - `kind`: the type of a setting, e.g. `jax.sharding.Sharding`.
    - `what`, `spelled`, `short`: how the error message names the settings (plural
        and capitalised, e.g. `"Shardings"`), `kind` (e.g. `"jax.sharding.Sharding"`)
        and one setting in the forms of a rule (e.g. `"Sharding"`). (Keyword only
        arguments.)

    **Returns:**

    A function from a state and its value to the state's setting, or `None`.

    **Raises:**

    `TypeError` if `rule` is none of the three.
    """
    if isinstance(rule, kind):
        return lambda state, value: rule
    if isinstance(rule, Mapping):
        pairs = [(to_predicate(f), setting) for f, setting in rule.items()]
        return lambda state, value: next(
            (setting for p, setting in pairs if p((), state)), None
        )
    if callable(rule):
        return cast(Callable[[State, Any], _T | None], rule)
    raise TypeError(
        f"{what} are given as a `{spelled}`, a mapping `{{filter: {short}}}`, or a "
        f"function `(state, value) -> {short}`; got {rule!r}."
    )
