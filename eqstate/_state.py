"""State handles and their kinds."""

import contextvars
import functools as ft
import itertools
import operator
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Generic, NoReturn, ParamSpec, TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import wadler_lindig as wl
from jaxtyping import ArrayLike
from typing_extensions import TypeVar

from . import _context, _jax_compat as compat
from ._arguments import text
from ._context import current_frame, label_here
from ._custom_types import MISSING, PyTree
from ._errors import (
    BatchAxisError,
    FORGOTTEN_VALUE,
    HANDLE_GIVEN_TO_JAX,
    HandleGivenToJax,
    PARAMETER_IN_RAW_GRAD,
    StateValueError,
)
from ._jax_compat import is_top_level
from ._pretty_print import state_doc, state_label
from ._serialisation_guard import not_an_array, refuse_if_serialised
from ._write_checks import to_checked_value


# A bare `State` holds `Any`, which strict type checkers take as it is.
_Value = TypeVar("_Value", default=Any)
_P = ParamSpec("_P")
_T = TypeVar("_T")

# Handles are numbered as they are created: StateDicts flatten in this order, so two
# dictionaries of the same states have the same tree structure whatever their order.
_CREATION_ORDER = itertools.count()


class State(Generic[_Value]):
    """A handle that names a piece of state.

    A handle is immutable, equal only to itself and hashed by identity, and it is a
    PyTree *leaf*: it never holds a value. It has no truth value either (`if state:`
    raises `TypeError`), and it is no array: operators, indexing and `len` raise
    `TypeError`, and JAX refuses it where it takes an array (an argument of
    `jax.jit`) with [`eqstate.TraceContextError`][]. Read `state.value` for all of
    these. Its value lives in the innermost context
    (the world, a [`eqstate.scope`][], or the trace of an eqstate transform), which
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

    # Its identity only: what other modules know about a handle (the records of the
    # ensembles built of it, the trace it expired with) they keep by handle.
    __slots__ = ("__weakref__", "_name", "_order", "_tag")

    def __init__(
        self,
        value: PyTree[ArrayLike],
        *,
        tag: str | None = None,
        name: str | None = None,
    ):
        """**Arguments:**

        - `value`: the initial value, a PyTree of arrays. Each leaf is converted with
            `jnp.array` (NumPy arrays are copied) and registered in the innermost
            context. A leaf its array cannot hold (a NumPy `int64` beyond `int32`
            with 64-bit types off) raises `StateValueError`, as a write does.
        - `tag`: a free-form label, for [`eqstate.filters.WithTag`][]. (Keyword only
            argument.)
        - `name`: a name shown in messages and printing. (Keyword only argument.)
        """
        text(tag, "tag", owner="A state's ")
        text(name, "name", owner="A state's ")
        object.__setattr__(self, "_tag", tag)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_order", (next(_CREATION_ORDER),))
        try:
            converted = to_checked_value(self, value)
        except TypeError as error:
            raise StateValueError(
                f"Cannot create {state_label(self)} holding {value!r}: a state's "
                "value is a PyTree of arrays, and JAX cannot make an array of every "
                f"leaf ({error}). Keep other objects in a module's fields."
            ) from None
        current_frame().add_new(self, converted)

    @property
    def value(self) -> _Value:
        """The state's value in the innermost context. Assigning to it writes a new
        value, which must keep the PyTree structure, shapes and dtypes of the current
        one. A Python number or NumPy value that the state's dtype cannot hold (`300`
        for a `uint8` state, an `int64` beyond `int32` with 64-bit types off) raises
        `StateValueError` rather than wrap around."""
        return _context.current_frame().read(self)

    # Never runs (`__setattr__` takes `.value = ...`); it exists for type checkers.
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
            f"Cannot set `{name}` on {label_here(self)}: handles are immutable. Only "
            "`.value` can be assigned, which writes a new value to the innermost "
            "context."
        )

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"Cannot delete `{name}` of {label_here(self)}.")

    def __eq__(self, other: object) -> bool:
        # Identity, as by default, but answered here rather than deferred to `other`:
        # `==` on a list of handles then compares them by identity, in C (see
        # `transform._split_args`).
        return self is other

    __hash__ = object.__hash__

    # Handles sort in creation order (see `creation_order`), so that a dict keyed by
    # handles (`es.assign({w: ..., b: ...})`) is a PyTree: JAX sorts dict keys.
    def __lt__(self, other: object) -> bool:
        if not isinstance(other, State):
            _refuse_as_array(self, "`<`", "state.value < x")
        return self._order < other._order

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, State):
            _refuse_as_array(self, "`>`", "state.value > x")
        return self._order > other._order

    # NumPy arrays defer to the handle's operators (below) rather than map them over
    # their elements.
    __array_ufunc__ = None

    def __bool__(self) -> NoReturn:
        # Else `if done:`, with `.value` forgotten, would always be taken.
        raise TypeError(
            f"{label_here(self)} is a handle, not a value, so it has no truth value. "
            "Test its value: `if state.value:` (inside a transform, "
            "`eqstate.transform.cond(state.value, ...)` or `jnp.where`). To test "
            "whether an optional handle was given, use `state is not None`."
        )

    def __copy__(self) -> "State[_Value]":
        return self

    def __deepcopy__(self, memo: dict) -> NoReturn:
        # A deep copy that returned `self` would silently share the state with the
        # original; a copy needs a context to hold its value, which `clone` takes.
        raise TypeError(
            f"Cannot deep-copy {label_here(self)}: a handle is an identity, and a copy "
            "sharing it would share its value with the original. Use "
            "`eqstate.clone(tree)`, which gives fresh handles (same kind, tag and "
            "name) holding copies of the values in the innermost context."
        )

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            f"Cannot pickle {label_here(self)}: a handle is an identity, not a value. "
            "Save values with `eqstate.save` instead."
        )

    if not TYPE_CHECKING:  # Hidden from type checkers: a handle is not array-like.

        @property
        def __jax_array__(self) -> NoReturn:
            # Equinox's serialisation tests leaves with `hasattr(x, "__jax_array__")`
            # and skips those without: refuse there rather than lose the values.
            refuse_if_serialised(self)
            not_an_array(self)

    def __pdoc__(self, **kwargs: Any) -> Any:
        # Equinox's pretty printer (`eqx.tree_pformat`) calls this.
        if kwargs.pop("eqstate_hide_values", False):
            show_id = id(self) in kwargs.pop("eqstate_show_ids", ())
            return state_doc(self, show_id=show_id, **kwargs)
        return state_doc(self, _context.current_frame().peek(self), **kwargs)

    def __repr__(self) -> str:
        return wl.pformat(self)


def _refuse_as_array(state: State, use: str, example: str) -> NoReturn:
    raise TypeError(
        FORGOTTEN_VALUE.format(label=label_here(state), use=use, eg=example)
    )


def _refusal(use: str, example: str) -> Any:
    def refuse(self: State, *args: Any) -> NoReturn:
        _refuse_as_array(self, use, example)

    return refuse


# Forgetting `.value` (`self.w @ x`, `-state`, `state[0]`) would get Python's bare
# "unsupported operand type(s)": every operator on a handle names it instead. They are
# set here, out of type checkers' sight, so that these still flag such a use.
_BINARY = {"add": "+", "sub": "-", "mul": "*", "matmul": "@", "truediv": "/"}
_BINARY |= {"floordiv": "//", "mod": "%", "pow": "**", "lshift": "<<"}
_BINARY |= {"rshift": ">>", "and": "&", "xor": "^", "or": "|"}
for _name, _op in _BINARY.items():
    setattr(State, f"__{_name}__", _refusal(f"`{_op}`", f"state.value {_op} x"))
    setattr(State, f"__r{_name}__", _refusal(f"`{_op}`", f"x {_op} state.value"))
for _name, _op in {"le": "<=", "ge": ">="}.items():
    setattr(State, f"__{_name}__", _refusal(f"`{_op}`", f"state.value {_op} x"))
for _name, _use, _example in (
    ("neg", "`-`", "-state.value"),
    ("pos", "`+`", "+state.value"),
    ("invert", "`~`", "~state.value"),
    ("abs", "`abs`", "abs(state.value)"),
    ("divmod", "`divmod`", "divmod(state.value, x)"),
    ("rdivmod", "`divmod`", "divmod(x, state.value)"),
    ("getitem", "indexing", "state.value[i]"),
    ("len", "`len`", "len(state.value)"),
    ("float", "`float`", "float(state.value)"),
    ("int", "`int`", "int(state.value)"),
    ("complex", "`complex`", "complex(state.value)"),
):
    setattr(State, f"__{_name}__", _refusal(_use, _example))


def _given_to_jax(state: State) -> NoReturn:
    raise HandleGivenToJax(HANDLE_GIVEN_TO_JAX.format(label=label_here(state)))


compat.refuse_as_array(State, _given_to_jax)


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

    def _read(self) -> _Value:
        frame = _context.current_frame()
        value = frame.read(self)
        if not is_top_level() and frame.differentiates_inside():
            _warn_constant_parameter(self, value)
        return value

    # A parameter read inside a raw JAX differentiation gets no gradient: it warns.
    value = property(_read, State.value.fset, doc=State.value.__doc__)  # type: ignore[assignment]


def _warn_constant_parameter(state: ParamState, value: Any) -> None:
    leaves = jax.tree_util.tree_leaves(value)
    if any(jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves):
        warnings.warn(
            PARAMETER_IN_RAW_GRAD.format(label=state_label(state, value)),
            stacklevel=3,
        )


class NonBatchState(State[_Value]):
    """State shared by every lane of a vmap: it is never given a batch axis."""

    __slots__ = ()


# No two calls, in any thread, read the same key of a random state in the world: every
# call that advances one holds this lock from its read of the key until it has written
# the successor back, or failed. A `jit` call of a plan that advances one takes it
# around its read, dispatch and write; the other calls (eager draws, the other
# transforms) from their read to their end (`draws_atomically`, `lock_keys`).
# Re-entrant: such a call may draw eagerly inside (under `jax.disable_jit()`). Never
# taken inside a trace, which may wait for another thread's trace of the same function
# (`FunctionTraces.lookup`) that holds it.
KEY_LOCK = threading.RLock()

# Whether the current top-level call holds `KEY_LOCK` (see `draws_atomically`); `None`
# outside such a call.
_KEYS_HELD: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "eqstate_keys_held", default=None
)


def draws_atomically(call: Callable[_P, _T]) -> Callable[_P, _T]:
    """Decorates a call of eqstate (a transform's, an eager draw) that may advance
    random states of the world: the key lock it takes to read them (`lock_keys`) is
    held until it returns or raises. A call made inside such a call belongs to it."""

    @ft.wraps(call)
    def atomically(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        if _KEYS_HELD.get() is not None:
            return call(*args, **kwargs)
        held = [False]
        token = _KEYS_HELD.set(held)
        try:
            return call(*args, **kwargs)
        finally:
            _KEYS_HELD.reset(token)
            if held[0]:
                KEY_LOCK.release()

    return atomically


class RandomState(State[Any]):
    """State holding a typed PRNG key (`jax.random.key`). Each sampler of
    `eqstate.random` reads the key and writes back its successor, so random numbers
    are ordinary state reads and writes to every transform.

    !!! Example

        ```python
        import eqstate as es

        rng = es.RandomState(42, name="rng")
        k1, k2 = rng.split_key(), rng.split_key()
        assert not (k1 == k2)
        ```
    """

    __slots__ = ()

    def __init__(
        self,
        seed_or_key: int | ArrayLike = 0,
        *,
        tag: str | None = None,
        name: str | None = None,
    ):
        """**Arguments:**

        - `seed_or_key`: an integer seed, or a typed PRNG key (`jax.random.key`).
        - `tag`, `name`: as for [`eqstate.State`][].
        """
        super().__init__(_as_key(seed_or_key), tag=tag, name=name)

    def _read(self) -> Any:
        frame = _context.current_frame()
        key = frame.read(self)
        if frame is _context.WORLD and is_top_level():
            # Waits for the key (8 bytes, the output of a split) first: one whose
            # computation failed is replaced (see `checked_key`), where printing it
            # would hang.
            key = checked_key(self, key, wait=True)
        return key

    value = property(_read, State.value.fset, doc=State.value.__doc__)  # type: ignore[assignment]

    def seed(self, seed_or_key: int | ArrayLike) -> None:
        """Resets the key from an integer seed (making a key of the PRNG
        implementation the state holds) or a typed key."""
        frame = current_frame()
        frame.write(self, _as_key(seed_or_key, jax.random.key_impl(frame.read(self))))

    @draws_atomically
    def split_key(self, n: int | None = None) -> Any:
        """Advances the key and returns a fresh one (or `n` fresh ones, stacked).
        Threads splitting one key get different keys."""
        if n is not None:
            n = _key_count(n)
        frame = current_frame()
        lock_keys(frame, (self,))
        key = frame.read(self)
        _check_single_key(self, key)
        successor, keys = split_and_advance(key, n)
        frame.write(self, successor)
        return keys


def _check_single_key(state: RandomState, key: Any) -> None:
    """Raises `BatchAxisError` if `key` is a batch of keys: a draw splits one key."""
    if jnp.ndim(key) != 0:
        raise BatchAxisError(
            f"{state_label(state, key)} holds a batch of keys of shape "
            f"{jnp.shape(key)}, but a draw splits a single key. Inside "
            "`eqstate.transform.vmap`, declare it in `in_states` (`in_states={0: "
            "state}`) to draw from its own key in each lane (a declared state whose "
            "lanes still hold several keys has more axes than the vmaps mapping it); "
            "elsewhere, draw from one of its keys (`jax.random.split(state.value[i])`)."
        )


def lock_keys(frame: _context.Frame, states: Iterable[State]) -> None:
    """Called by a call that `draws_atomically` just before it reads `states` from
    `frame` to write them back: if `frame` is the world (at top level) and one of
    them is a random state, holds `KEY_LOCK` until the call ends, so that no other
    call reads the key this one advances."""
    if frame is not _context.WORLD or not is_top_level():
        return
    keys = [s for s in states if isinstance(s, RandomState)]
    if not keys:
        return
    held = _KEYS_HELD.get()
    assert held is not None, "a call that advances world keys must draw atomically"
    if not held[0]:
        KEY_LOCK.acquire()
        held[0] = True
    check_keys(keys)


def check_keys(states: Iterable[RandomState]) -> None:
    """Replaces each key of `states` in the world whose computation has ended and
    failed (see `checked_key`). Called at top level, holding `KEY_LOCK`."""
    world = _context.WORLD
    for state in states:
        key = world.peek(state)
        if key is not MISSING:  # (A missing state is named by the read.)
            checked_key(state, key)


# A key made by a computation that failed as it ran (on the CPU, one refused memory,
# which fails after the call has returned, with all its outputs) fails whatever reads
# it. The first call, or read of `.value`, at top level that finds such a key in the
# world replaces it with the last key of its state seen good, folded in with this tag
# plus the number of keys replaced so far: never a key handed out before.
_REPLACED_KEY_TAG = 0x6571_0000
_replaced = itertools.count()


def checked_key(state: RandomState, key: Any, *, wait: bool = False) -> Any:
    """`key`, the value of `state` in the world; or, if its computation failed as it
    ran, a fresh key that replaces it there (see `_REPLACED_KEY_TAG`). Looks at a key
    only once its computation has ended, unless `wait` or no key of `state` has been
    seen good yet: a call never waits for the one before it."""
    good = _context.WORLD.good_keys
    if good.get(id(state)) is key:
        return key
    data = compat.key_buffer(key)
    if not wait and id(state) in good and not data.is_ready():
        return key
    try:
        data.block_until_ready()
    except Exception as error:
        return _replace_failed_key(state, key, error)
    good[id(state)] = key
    return key


def _replace_failed_key(state: RandomState, key: Any, error: Exception) -> Any:
    world = _context.WORLD
    with KEY_LOCK:
        if world.peek(state) is not key:  # Replaced by another thread meanwhile.
            return world.peek(state)
        good = world.good_keys.get(id(state))
        # None seen good (a key written from outside failed), or the last good one
        # was donated to a call since (its buffer is gone): a fixed root instead.
        if good is None or compat.key_buffer(good).is_deleted():
            zero = jax.random.key(0, impl=jax.random.key_impl(key))
            good = jax.random.split(zero, jnp.shape(key))
        tag = _REPLACED_KEY_TAG + next(_replaced)
        flat = jnp.reshape(good, -1)
        fresh = jax.vmap(jax.random.fold_in, (0, None))(flat, tag)
        world.by_id[id(state)] = fresh = jnp.reshape(fresh, jnp.shape(key))
    reason = str(error).strip().splitlines()[0]
    warnings.warn(
        f"{state_label(state)} held a key made by a computation that failed as it "
        f"ran ({reason}): that computation's outputs are lost, with those of every "
        "computation that drew from the key since. The state now holds a fresh key, "
        "folded from its last good key (or a fixed root, if that key was donated "
        "since) with a tag no draw uses, so draws go on. Run the failed computation "
        "again (smaller) for its outputs.",
        RuntimeWarning,
        stacklevel=_outside_eqstate(),
    )
    return fresh


def _outside_eqstate() -> int:
    """The `stacklevel` at which its caller's warning names the innermost frame
    outside eqstate."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    return level


_PACKAGE = os.path.dirname(__file__) + os.sep


def split_and_advance(key: Any, n: int | None) -> tuple[Any, Any]:
    """`(successor of key, one fresh key or n stacked ones)`: the keys of
    `jax.random.split(key, 2 if n is None else n + 1)`, the successor first.

    Where each key of a split depends on its index alone (threefry and rbg keys with
    `jax_threefry_partitionable`, JAX's default), the successor is the same for every
    `n` and comes from a split in two of its own: a split too large for memory, which
    fails after it returns, then leaves the random state usable."""
    if n is not None and _split_by_index(key):
        return _split(key, None)[0], _split(key, n)[1]
    return _split(key, n)


@ft.partial(jax.jit, static_argnums=1)
def _split(key: Any, n: int | None) -> tuple[Any, Any]:
    # Jitted, so that an eager call (and an eager `vmap` in `vmap_new_states`) is one
    # dispatch rather than one per operation: a split and its slices cost 4x more.
    keys = jax.random.split(key, 2 if n is None else n + 1)
    return keys[0], keys[1] if n is None else keys[1:]


def _split_by_index(key: Any) -> bool:
    """Whether each key of `jax.random.split(key, m)` depends on its index alone,
    not on `m`."""
    partitionable = jax.config.jax_threefry_partitionable  # pyright: ignore[reportAttributeAccessIssue]
    return partitionable and jax.random.key_impl(key) in ("threefry2x32", "rbg")


def retag(state: State, tag: str) -> None:
    """Gives `state` another tag (`vmap_new_states(state_tag=...)`, as it creates it)."""
    object.__setattr__(state, "_tag", tag)


def fresh_copy(state: State, *, in_place: bool = True) -> State:
    """A new, unregistered handle of the same kind, tag and name as `state`, placed
    right after it in creation order (`in_place`), or as created now."""
    cls = type(state)
    fresh = object.__new__(cls)
    for klass in cls.__mro__:
        for slot in getattr(klass, "__slots__", ()):
            if slot != "__weakref__" and hasattr(state, slot):
                object.__setattr__(fresh, slot, getattr(state, slot))
    if hasattr(state, "__dict__"):
        fresh.__dict__.update(state.__dict__)
    # Right after the handle it copies (and its earlier copies), so that a `StateDict`
    # holding the copy in its place flattens like one holding the original.
    order = state._order if in_place else ()
    object.__setattr__(fresh, "_order", (*order, next(_CREATION_ORDER)))
    return fresh


def made_as_copy(state: State) -> bool:
    """Whether `state` was made by `fresh_copy` in place of another handle."""
    return len(state._order) > 1


def _key_count(n: Any) -> int:
    try:
        if isinstance(n, bool):
            raise TypeError
        n = operator.index(n)
    except TypeError:
        raise TypeError(
            f"`split_key(n)` takes a non-negative integer `n` (or None for one key), "
            f"got {n!r}."
        ) from None
    if n < 0:
        raise ValueError(f"`split_key(n)` cannot make a negative number of keys ({n}).")
    return n


def _as_key(seed_or_key: Any, impl: Any = None) -> Any:
    """A typed key from `seed_or_key`, an integer seed (making a key of `impl`, by
    default JAX's default implementation) or a typed key."""
    if isinstance(seed_or_key, (str, bytes, bool)) or not (
        isinstance(seed_or_key, (int, np.integer)) or hasattr(seed_or_key, "dtype")
    ):
        raise TypeError(
            "A RandomState holds a typed PRNG key: pass an integer seed or a key from "
            f"`jax.random.key`, got {seed_or_key!r}."
        )
    if isinstance(seed_or_key, (int, np.integer)):
        # A concrete key even inside a trace: one seed is the same in every lane, which
        # lets `vmap_new_states` re-key a state a nested `jit` creates before its draws.
        with jax.ensure_compile_time_eval():
            return jax.random.key(seed_or_key, impl=impl)
    if (
        hasattr(seed_or_key, "dtype")
        and jnp.issubdtype(seed_or_key.dtype, jnp.integer)
        and jnp.ndim(seed_or_key) == 0
    ):
        return jax.random.key(seed_or_key, impl=impl)
    if not jax.dtypes.issubdtype(jnp.result_type(seed_or_key), jax.dtypes.prng_key):
        raise TypeError(
            "A RandomState holds a typed PRNG key: pass an integer seed or a key from "
            f"`jax.random.key`, got {seed_or_key!r}. (Legacy `uint32[2]` keys can be "
            "converted with `jax.random.wrap_key_data`.)"
        )
    return seed_or_key


def lazy_world_state(
    cls: type[State], make_value: Any, *, name: str | None = None
) -> Any:
    """A handle of kind `cls` whose value in the world is `make_value()`, made when
    the state is first accessed rather than now (see `World.add_lazy`)."""
    state = object.__new__(cls)
    object.__setattr__(state, "_tag", None)
    object.__setattr__(state, "_name", name)
    object.__setattr__(state, "_order", (next(_CREATION_ORDER),))
    _context.WORLD.add_lazy(state, make_value)
    return state


def creation_order(state: State) -> tuple[int, ...]:
    """The position of `state` among all handles, in creation order. A copy made in
    place by `fresh_copy` (a clone, a member) sorts right after the handle it
    copies and that handle's earlier copies, before any handle made after that one."""
    return state._order


def is_state(x: Any) -> bool:
    """Whether `x` is a state handle."""
    return isinstance(x, State)
