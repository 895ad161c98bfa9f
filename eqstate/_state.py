"""State handles and their kinds."""

from typing import Any, Generic, NoReturn, TypeVar

from jaxtyping import ArrayLike, PyTree

from . import _context
from ._context import current_frame, describe, to_value


_Value = TypeVar("_Value")


class State(Generic[_Value]):
    """A handle that names a piece of state.

    A handle is immutable and hashable by identity, and it is a PyTree *leaf*: it never
    holds a value. Its value lives in the innermost context (the world, a
    [`eqstate.scope`][], or the trace of an eqstate transform), which
    [`eqstate.State.value`][] reads and writes.

    The class is the state's *kind*; subclasses ([`eqstate.ParamState`][],
    [`eqstate.ShortTermState`][], ...) let filters select states by kind. For type
    annotations, `State` is generic in its value: `State[Float[Array, "n"]]`.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        count = es.State(jnp.array(0), name="count")
        count.value = count.value + 1
        assert count.value == 1
        ```
    """

    __slots__ = ("__weakref__", "_expired_in", "_name", "_tag")

    def __init__(
        self,
        value: PyTree[ArrayLike],
        *,
        tag: str | None = None,
        name: str | None = None,
    ):
        """**Arguments:**

        - `value`: the initial value, a PyTree of arrays. Each leaf is converted with
            `jnp.asarray` and registered in the innermost context.
        - `tag`: a free-form label, for [`eqstate.filters.WithTag`][]. (Keyword only
            argument.)
        - `name`: a name shown in messages and printing. (Keyword only argument.)
        """
        object.__setattr__(self, "_tag", tag)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_expired_in", None)
        current_frame().add_new(self, to_value(value))

    @property
    def value(self) -> _Value:
        """The state's value in the innermost context. Assigning to it writes a new
        value, which must keep the PyTree structure, shapes and dtypes of the current
        one."""
        return _context.current_frame().read(self)

    @value.setter
    def value(self, value: _Value) -> None:
        _context.current_frame().write(self, value)

    @property
    def tag(self) -> str | None:
        """The tag given at creation, or `None`."""
        return self._tag

    @property
    def name(self) -> str | None:
        """The name given at creation, or `None`."""
        return self._name

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "value":
            _context.current_frame().write(self, value)
            return
        raise AttributeError(
            f"Cannot set `{name}` on {describe(self)}: handles are immutable. Only "
            "`.value` can be assigned, which writes a new value to the innermost "
            "context."
        )

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"Cannot delete `{name}` of {describe(self)}.")

    def __copy__(self) -> "State[_Value]":
        return self

    def __deepcopy__(self, memo: dict) -> "State[_Value]":
        return self

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            f"Cannot pickle {describe(self)}: a handle is an identity, not a value. "
            "Save values with `eqstate.save` instead."
        )

    def __repr__(self) -> str:
        return describe(self)


class ShortTermState(State[_Value]):
    """State that changes at every step and is reset between sequences: RNN hidden
    states, counters, caches."""

    __slots__ = ()


class LongTermState(State[_Value]):
    """State accumulated across steps and kept for inference: running statistics."""

    __slots__ = ()


class ParamState(LongTermState[_Value]):
    """A trainable parameter."""

    __slots__ = ()


class NonBatchState(State[_Value]):
    """State shared by every lane of a vmap: it is never given a batch axis."""

    __slots__ = ()


class RandomState(State[_Value]):
    """State holding a typed PRNG key (`jax.random.key`). Each sampler of
    `eqstate.random` reads the key and writes back its successor."""

    __slots__ = ()


def fresh_copy(state: State) -> State:
    """A new, unregistered handle of the same kind, tag and name as `state`."""
    cls = type(state)
    fresh = object.__new__(cls)
    for klass in cls.__mro__:
        for slot in getattr(klass, "__slots__", ()):
            if slot != "__weakref__" and hasattr(state, slot):
                object.__setattr__(fresh, slot, getattr(state, slot))
    if hasattr(state, "__dict__"):
        fresh.__dict__.update(state.__dict__)
    object.__setattr__(fresh, "_expired_in", None)
    return fresh


def is_state(x: Any) -> bool:
    """Whether `x` is a state handle."""
    return isinstance(x, State)
