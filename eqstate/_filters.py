"""The filter language: which states an API applies to.

Every API that takes a filter accepts any of:

- a State subclass: states of that kind *or a subclass of it* (`eqstate.LongTermState`
  also selects `eqstate.ParamState`s; `OfType(kind, exact=True)` selects one kind only).
  A subscripted kind, such as `eqstate.ParamState[Array]`, is the same kind, and a
  union of kinds (`eqstate.ParamState | eqstate.ShortTermState`) selects any of them;
- a handle: that state;
- a string: states with that tag;
- a predicate `(path, state) -> bool`, where `path` is the state's PyTree path where one
  is known (in [`eqstate.states_of`][]) and `()` otherwise. A function that cannot be
  called with these two arguments is refused when the filter is made;
- `...` or `True`: every state; `None` or `False`: no state;
- a tuple or list of filters: states matching any of them.
"""

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, cast

from ._arguments import given, text
from ._state import State


class StateFilter:
    """Base class of the filter objects. A filter is called as `filter(path, state)`."""

    def __call__(self, path: tuple[Any, ...], state: State) -> bool:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class OfType(StateFilter):
    """States whose kind is `kind` or, unless `exact=True`, a subclass of it.

    A bare kind used as a filter means `OfType(kind)`: since [`eqstate.ParamState`][]
    subclasses [`eqstate.LongTermState`][], the filter `eqstate.LongTermState` selects
    parameters too. `OfType(eqstate.LongTermState, exact=True)` selects the running
    statistics alone.

    `kind` may be subscripted (`eqstate.ParamState[Array]` is the kind
    `eqstate.ParamState`) or a union of kinds, which selects states of any of them
    (with `exact=True`, states whose kind is exactly one of them). Anything else,
    `typing.Any` included, is refused with a `TypeError` when the filter is made.

    !!! Example

        ```python
        import eqstate as es
        import eqstate.nn as enn
        from eqstate.filters import OfType

        bn = enn.BatchNorm(3)
        assert es.states_of(bn, es.LongTermState) == (
            bn.running_mean, bn.running_var, bn.weight, bn.bias
        )
        assert es.states_of(bn, OfType(es.LongTermState, exact=True)) == (
            bn.running_mean, bn.running_var
        )
        ```
    """

    # Checked and normalised in `__post_init__`, to a kind or a tuple of kinds.
    kind: Any
    exact: bool = False

    def __post_init__(self):
        kinds = _state_kinds(self.kind)
        object.__setattr__(self, "kind", kinds[0] if len(kinds) == 1 else kinds)

    def __call__(self, path, state):
        if self.exact:
            kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
            return type(state) in kinds
        return isinstance(state, self.kind)


@dataclasses.dataclass(frozen=True)
class WithTag(StateFilter):
    """States whose tag is `tag`."""

    tag: str

    def __post_init__(self):
        text(self.tag, "tag", owner="`WithTag`'s ", none=False)

    def __call__(self, path, state):
        return state.tag == self.tag


@dataclasses.dataclass(frozen=True)
class WithName(StateFilter):
    """States whose name is `name`."""

    name: str

    def __post_init__(self):
        text(self.name, "name", owner="`WithName`'s ", none=False)

    def __call__(self, path, state):
        return state.name == self.name


@dataclasses.dataclass(frozen=True, eq=False)
class Is(StateFilter):
    """Exactly the state `state`."""

    state: State

    def __post_init__(self):
        if not isinstance(self.state, State):
            raise TypeError(
                f"`Is` takes a state handle, {given(self.state)}. To select states "
                "by name, use `WithName`; by kind, the class, such as "
                "`eqstate.ParamState`."
            )

    def __call__(self, path, state):
        return state is self.state

    def __eq__(self, other):
        return isinstance(other, Is) and other.state is self.state

    def __hash__(self):
        return hash((Is, id(self.state)))


@dataclasses.dataclass(frozen=True)
class Everything(StateFilter):
    """Every state."""

    def __call__(self, path, state):
        return True


@dataclasses.dataclass(frozen=True)
class Nothing(StateFilter):
    """No state."""

    def __call__(self, path, state):
        return False


@dataclasses.dataclass(frozen=True)
class AnyOf(StateFilter):
    """States matching at least one of `filters`."""

    filters: tuple[StateFilter, ...]

    def __init__(self, *filters: Any):
        object.__setattr__(self, "filters", tuple(map(to_predicate, filters)))

    def __call__(self, path, state):
        return any(f(path, state) for f in self.filters)


@dataclasses.dataclass(frozen=True)
class AllOf(StateFilter):
    """States matching every one of `filters`."""

    filters: tuple[StateFilter, ...]

    def __init__(self, *filters: Any):
        object.__setattr__(self, "filters", tuple(map(to_predicate, filters)))

    def __call__(self, path, state):
        return all(f(path, state) for f in self.filters)


@dataclasses.dataclass(frozen=True)
class Not(StateFilter):
    """States not matching `filter`. Applied at each path of a state, as every filter
    is: a state found at several paths, matched by `filter` at some of them only, is
    matched by both (see [`eqstate.states_of`][])."""

    filter: StateFilter

    def __init__(self, filter: Any):
        object.__setattr__(self, "filter", to_predicate(filter))

    def __call__(self, path, state):
        return not self.filter(path, state)


@dataclasses.dataclass(frozen=True)
class _Predicate(StateFilter):
    fn: Callable[[tuple, State], bool]

    def __call__(self, path, state):
        return bool(self.fn(path, state))


def _is_union(kind: Any) -> bool:
    origin = typing.get_origin(kind)
    return origin is types.UnionType or origin is typing.Union


def _state_kind(kind: Any) -> type[State]:
    origin = typing.get_origin(kind)
    if isinstance(origin, type):
        kind = origin  # `ParamState[Any]` is the kind `ParamState`
    if not isinstance(kind, type):
        raise TypeError(
            f"{kind!r} (of type {type(kind).__name__}) is not a State kind. `OfType` "
            "takes `eqstate.State` or a subclass of it, such as `eqstate.ParamState`, "
            "or a union of them; to select by tag, handle or predicate, pass that "
            "filter itself instead of `OfType(...)`."
        )
    if not issubclass(kind, State):
        raise TypeError(
            f"{kind.__name__} is not a State kind, so it cannot be used as a filter. "
            "A type filter must be `eqstate.State` or a subclass of it, such as "
            "`eqstate.ParamState`."
        )
    return kind


_KINDS = (
    "`OfType` takes `eqstate.State` or a subclass of it, such as "
    "`eqstate.ParamState` (or a class some kinds derive from), or a union or tuple of "
    "them; to select by tag, handle or predicate, pass that filter itself instead of "
    "`OfType(...)`."
)


def _checkable(kind: type) -> bool:
    """Whether `isinstance(state, kind)` can be asked."""
    if getattr(kind, "_is_protocol", False):
        # Asked directly: `issubclass` may answer from a cache for such a protocol.
        return bool(getattr(kind, "_is_runtime_protocol", False))
    try:
        issubclass(State, kind)
    except TypeError:
        return False
    return True


def _state_kinds(kind: Any) -> tuple[type, ...]:
    """The classes that `kind` names for `OfType`: its origin if subscripted, each
    member if a union or a tuple. A State kind, or a class some kinds derive from (a
    mixin); raises `TypeError` for what is not a class, a builtin one (`int`), or a
    typing form that `isinstance` cannot check (`typing.Any`)."""
    if _is_union(kind) or isinstance(kind, tuple):
        members = typing.get_args(kind) if _is_union(kind) else kind
        return tuple(dict.fromkeys(k for m in members for k in _state_kinds(m)))
    origin = typing.get_origin(kind)
    if isinstance(origin, type):
        kind = origin  # `ParamState[Any]` is the kind `ParamState`
    if not isinstance(kind, type) or (
        kind.__module__ == "builtins" and kind is not object
    ):
        raise TypeError(
            f"{kind!r} (of type {type(kind).__name__}) is not a State kind. {_KINDS}"
        )
    if kind.__module__ in ("typing", "typing_extensions") or not _checkable(kind):
        raise TypeError(
            f"{kind!r} is not a State kind: it is a typing form (such as "
            "`typing.Any`), or a class that `isinstance` cannot check states against "
            f"(a protocol that is not runtime-checkable). {_KINDS} To select every "
            "state, pass `...`."
        )
    return (kind,)


def _check_takes_path_and_state(fn: Callable) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # Some builtins have no signature: call them.
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"The filter `{getattr(fn, '__name__', repr(fn))}{signature}` cannot "
            "be called as `filter(path, state)`. A predicate filter takes the state's "
            "PyTree path and the state, as in `lambda path, state: state.name == 'w'`."
        ) from None


def to_predicate(filter: Any) -> StateFilter:
    """Turns any filter (see the module documentation) into a [`eqstate.filters.StateFilter`][]
    object, called as `filter(path, state) -> bool`.

    **Raises:**

    `TypeError` if `filter` is not a filter, or is a function that cannot be called as
    `filter(path, state)`.
    """
    if isinstance(filter, StateFilter):
        return filter
    if filter is ... or filter is True:
        return Everything()
    if filter is None or filter is False:
        return Nothing()
    if isinstance(filter, State):
        return Is(filter)
    if isinstance(filter, str):
        return WithTag(filter)
    if _is_union(filter):
        return AnyOf(*typing.get_args(filter))  # `ParamState | LongTermState`
    if isinstance(filter, type) or isinstance(typing.get_origin(filter), type):
        return OfType(_state_kind(filter))  # `ParamState[Any]` is `ParamState`
    if isinstance(filter, (tuple, list)):
        return AnyOf(*filter)
    if callable(filter):
        _check_takes_path_and_state(filter)
        return _Predicate(cast(Callable[[tuple, State], bool], filter))
    raise TypeError(
        f"{filter!r} (of type {type(filter).__name__}) is not a filter. A filter is a "
        "State subclass, a handle, a tag string, a predicate `(path, state) -> bool`, "
        "`...` (every state), `None` (no state), or a tuple/list of filters."
    )
