"""StateDict: an immutable mapping from state handles to their values."""

import collections
import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TYPE_CHECKING

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import wadler_lindig as wl
from jaxtyping import ArrayLike

from ._custom_types import Filter, MISSING, PyTree
from ._errors import StateNotFoundError, StateValueError
from ._filters import to_predicate
from ._placement import device_put_apart
from ._pretty_print import (
    first_and_more,
    handle_number,
    numberless_label,
    state_dict_doc,
    state_label,
    state_text_with_number,
    value_summary,
)
from ._shapes import is_key
from ._state import creation_order, RandomState, State
from ._state_rule import per_state_rule
from ._write_checks import check_write, is_weak, to_dict_value


# A leaf of a value: an array, or its type alone in an abstract dictionary.
_Leaf = ArrayLike | jax.ShapeDtypeStruct


if TYPE_CHECKING:
    _MappingBase = Mapping[State, PyTree]
else:
    # At run time a plain `Mapping`: runtime type checkers (beartype) then check a
    # StateDict by its class, without sampling its values, which inside a transform
    # would read states (see `eqstate.world`).
    _MappingBase = Mapping


class StateDict(_MappingBase):
    """An immutable mapping from states to their values.

    It is a PyTree whose children are the values (the ordered tuple of handles is the
    static part), so it passes through `jax.jit`, `eqx.filter_jit`, optax and
    checkpoints unchanged. Iteration follows insertion order; a dictionary rebuilt from
    its leaves (out of `jax.jit`, `jax.tree.map` or optax) iterates in the creation
    order of its states instead, as JAX sorts a `dict`'s keys, so that gradients and
    parameters share one tree structure. (A handle made as a copy of another, by
    [`eqstate.clone`][] or [`eqstate.member`][], counts as created right after the
    handle it copies.) Look values up by handle, not by position. Every operation
    returns a new dictionary.

    Its key paths (`jax.tree_util.tree_flatten_with_path`) hold a `DictKey` of each
    handle, printed without the handle's number: `[ParamState 'w']`, or `[unnamed
    ParamState, entry 0]`. They name the arguments and results of compiled programs,
    which are then the same in every process of a multi-process program, even where
    one process has made more handles than another.

    Equality is identity: two dictionaries with the same states and values compare
    unequal (`==` elementwise on arrays has no single truth value). To compare
    contents, use `eqx.tree_equal(a, b)`, which is `True` when both hold the same
    states with equal values.

    Being immutable, it is its own `copy.copy`. `copy.deepcopy` of it (or of an
    optimiser's state holding it) returns a `StateDict` keyed by the same handles,
    holding deep copies of the values: the states themselves are not copied. To copy
    a model with fresh states, and a `StateDict` of them keyed by the new handles,
    use [`eqstate.clone`][] on the two together.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.zeros(3), name="w")
        n = es.ShortTermState(jnp.array(0), name="n")
        states = es.StateDict({w: jnp.ones(3), n: jnp.array(5)})
        params, rest = states.split(es.ParamState)
        assert params.states == (w,) and rest.states == (n,)
        ```
    """

    __slots__ = ("_canonical", "_values")

    def __init__(
        self,
        values: Mapping[State, PyTree[_Leaf]]
        | Iterable[tuple[State, PyTree[_Leaf]]]
        | PyTree = (),
    ):
        """**Arguments:**

        - `values`: the contents, a mapping (or iterable of pairs) from handles to
            PyTrees of arrays. Each leaf is converted with `jnp.array` (NumPy arrays
            are copied; a value the array cannot hold, such as a NumPy `int64`
            beyond `int32` with 64-bit types off, raises `StateValueError`, and so
            does a value of a `RandomState` that is not made of typed PRNG keys,
            such as a legacy `uint32[2]` key), except `jax.ShapeDtypeStruct`s, kept
            as they are: an abstract dictionary (as
            `eqstate.transform.eval_shape` returns) can be split, merged and rebuilt
            like any other. (Typed to also accept what
            optax returns, e.g. `optax.apply_updates(params, updates)`: a
            `StateDict` at run time, declared as a PyTree of arrays.)
        """
        contents = {}
        for state, value in _pairs(values):
            _check_key(state)
            contents[state] = _dict_value(state, value)
        object.__setattr__(self, "_values", contents)
        object.__setattr__(self, "_canonical", None)

    def __copy__(self) -> "StateDict":
        return self  # Immutable: a copy would be the same.

    def __deepcopy__(self, memo: dict) -> "StateDict":
        # The keys name the states, as a reference would: deep-copying a handle raises
        # (it cannot choose a context for the copy's value).
        return state_dict_of(
            {s: copy.deepcopy(v, memo) for s, v in self._values.items()}
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("StateDict is immutable; use `.set` or `.update`.")

    def __getitem__(self, state: State) -> PyTree:
        try:
            return self._values[state]
        except StateNotFoundError:
            raise  # A view of the world read through a strict scope says why.
        except KeyError:
            if not isinstance(state, State):
                held = _summarise_states(self._values)
                raise StateNotFoundError(_not_a_handle(state, held)) from None
            raise StateNotFoundError(self._missing(state)) from None

    def _missing(self, state: State) -> str:
        label, *held = _labels([state, *self._values])
        summary = first_and_more(held) if held else "no states"
        return f"{label} is not in this StateDict, which holds {summary}."

    def __contains__(self, state: object) -> bool:
        return state in self._values

    def get(self, state: State, default: Any = None) -> Any:  # type: ignore[override]
        """The value of `state`, or `default` if the dictionary does not list it. A
        state listed but not readable (a world state that a scope lacks, looked up in
        `eqstate.world()` inside the scope) raises, as `[]` does."""
        return self[state] if state in self._values else default

    def __iter__(self) -> Iterator[State]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    # Equality is identity: comparing values elementwise has no single truth value.
    __eq__ = object.__eq__

    @property
    def states(self) -> tuple[State, ...]:
        """The handles, in insertion order."""
        return tuple(self._values)

    def set(self, state: State, value: PyTree[_Leaf]) -> "StateDict":
        """Returns a copy with `state` holding `value`.

        The value is checked like a write: it must keep the PyTree structure, shapes
        and dtypes of the current value (`StateValueError` otherwise). `state` must
        already be in the dictionary (`StateNotFoundError` otherwise); use
        [`eqstate.StateDict.update`][] to add states.
        """
        if isinstance(state, State) and state not in self._values:
            raise StateNotFoundError(
                f"{self._missing(state)} `set` replaces the value of a state the "
                "dictionary holds; to add a state, use `.update({state: value})` "
                "(or `|`)."
            )
        checked = _checked_write(state, self[state], value)
        values = self._values
        if type(values) is dict:
            return state_dict_of({**values, state: checked})
        sources = _sources(values)
        sources[state] = {state: checked}
        return state_dict_of(_Lazy(sources))

    def update(self, other: Mapping[State, PyTree[_Leaf]] | PyTree) -> "StateDict":
        """Returns a copy with the entries of `other` added. Values of states already
        present are checked like writes; new states are added at the end.

        `other` is a mapping from handles to values, typically another `StateDict`.
        It is typed as any PyTree so that what optax returns (a `StateDict` at run
        time, declared as a PyTree of arrays) type-checks without a cast."""
        other = _as_mapping(other, "StateDict.update")
        if type(self._values) is not dict or _is_lazy(other):
            return self._lazy_update(other)
        values = dict(self._values)
        for state, value in other.items():
            _check_key(state)
            old = values.get(state, MISSING)
            if old is MISSING:
                values[state] = _dict_value(state, value)
            else:
                values[state] = _checked_write(state, old, value)
        return state_dict_of(values)

    def _lazy_update(self, other: Mapping) -> "StateDict":
        """`update` where either side reads its values lazily (a view of the world
        inside a scope or a transform): only the values of states in both are read
        now (to check the write); the others are read when looked up, as the views'
        are. Reading every state would be a read of every state by the transform."""
        sources = _sources(self._values)
        if isinstance(other, StateDict):
            theirs = _sources(other._values)
        else:
            theirs = dict.fromkeys(other, other)
        for state, source in theirs.items():
            _check_key(state)
            if state in sources:
                value = _checked_write(state, sources[state][state], source[state])
                sources[state] = {state: value}
            elif isinstance(other, StateDict):
                sources[state] = source
            else:
                sources[state] = {state: _dict_value(state, source[state])}
        return state_dict_of(_Lazy(sources))

    def __or__(self, other: Mapping[State, PyTree[_Leaf]] | PyTree) -> "StateDict":
        if not isinstance(other, Mapping):
            return NotImplemented
        return self.update(other)

    def __ror__(self, other: Mapping[State, PyTree[_Leaf]] | PyTree) -> "StateDict":
        # `params | rest` where `params` came from optax (typed as a PyTree), or a dict.
        if not isinstance(other, Mapping):
            return NotImplemented
        return StateDict.merge(other, self)

    def filter(self, *filters: Filter) -> "StateDict":
        """The states matching any of `filters` (see [`eqstate.filters`][]); every
        state if none is given, as in [`eqstate.states_of`][]."""
        if not filters:
            return self
        predicates = [to_predicate(f) for f in filters]
        return self._part(
            [s for s in self._values if any(p((), s) for p in predicates)]
        )

    def split(self, *filters: Filter) -> tuple["StateDict", ...]:
        """Splits into one dictionary per filter, plus one with the states no filter
        matched. A state goes to the first filter it matches, so the parts are disjoint
        and `StateDict.merge(*parts)` gives back a dictionary with the same states and
        values as this one."""
        predicates = [to_predicate(f) for f in filters]
        parts: list[list[State]] = [[] for _ in range(len(filters) + 1)]
        for state in self._values:
            index = next(
                (i for i, p in enumerate(predicates) if p((), state)), len(filters)
            )
            parts[index].append(state)
        return tuple(self._part(part) for part in parts)

    def _part(self, states: list[State]) -> "StateDict":
        """The dictionary of `states` (some of this one's). A lazy view stays lazy:
        inside a transform, a view of the world reads each value only when it is
        looked up, and the transform reads only the states used."""
        values = self._values
        if type(values) is dict:
            return state_dict_of({s: values[s] for s in states})
        sources = _sources(values)
        return state_dict_of(_Lazy({s: sources[s] for s in states}))

    @staticmethod
    def merge(*state_dicts: Mapping[State, PyTree[_Leaf]] | PyTree) -> "StateDict":
        """Joins dictionaries (or mappings from handles to values); a state present in
        several takes its value from the last one (checked like a write)."""
        merged = StateDict()
        for sd in state_dicts:
            merged = merged.update(_as_mapping(sd, "StateDict.merge"))
        return merged

    def with_sharding(self, shardings: Any) -> "StateDict":
        """Places the values on devices with `jax.device_put`. A placed value shares
        no device buffer with the value it was placed from, unless it is that very
        array (already placed so), so donating it leaves the other readable.

        **Arguments:**

        - `shardings`: one `jax.sharding.Sharding` for every state; or a mapping
            `{filter: Sharding}` (each state takes the sharding of the first filter it
            matches; states matching none stay where they are); or a function
            `(state, value) -> Sharding | None` (`None`: leave it).

        **Returns:**

        A new `StateDict` whose values are placed accordingly.

        !!! Example

            ```python
            import eqstate as es
            import jax
            import jax.numpy as jnp
            from jax.sharding import NamedSharding, PartitionSpec as P

            mesh = jax.make_mesh((len(jax.devices()),), ("x",))
            w = es.ParamState(jnp.zeros((len(jax.devices()) * 2, 3)))
            sd = es.world().filter(w).with_sharding({w: NamedSharding(mesh, P("x"))})
            assert sd[w].sharding.spec == P("x")
            ```
        """
        sharding_of = sharding_rule(shardings)
        placed = {}
        for state, value in self._values.items():
            sharding = sharding_of(state, value)
            placed[state] = (
                value if sharding is None else _placed(state, value, sharding)
            )
        return state_dict_of(placed)

    def __pdoc__(self, **kwargs: Any) -> Any:
        # A lazy view (`world()` inside a scope or a transform) is printed from what
        # it can see without reading: printing must not change what a trace reads.
        peek = getattr(self._values, "peek_items", None)
        return state_dict_doc(
            self._values.items() if peek is None else peek(), **kwargs
        )

    def __repr__(self) -> str:
        return wl.pformat(self)


def state_dict_of(values: Mapping) -> StateDict:
    """A `StateDict` holding `values` itself, neither copied nor converted. Private to
    eqstate: for mappings that eqstate built and that nothing changes afterwards.

    **Arguments:**

    - `values`: a mapping from handles to values. Its leaves may be tracers or JAX's
        placeholder objects (as when unflattening), which `StateDict(values)` would
        try to convert. A mapping that reads its values lazily (a view of the world
        inside a transform) stays lazy.

    **Returns:**

    The `StateDict`, which owns `values` from now on.
    """
    sd = object.__new__(StateDict)
    object.__setattr__(sd, "_values", values)
    object.__setattr__(sd, "_canonical", None)
    return sd


class _Lazy(Mapping):
    """The values of a dictionary derived from a lazy one (a view of the world inside
    a scope or a transform): each looked up, when asked for, in the mapping it comes
    from (a view, which reads it through its context once, or a dict of values set or
    added since)."""

    __slots__ = ("_sources",)

    def __init__(self, sources: dict[State, Mapping]):
        self._sources = sources

    def __getitem__(self, state: State) -> Any:
        return self._sources[state][state]

    def __iter__(self) -> Iterator[State]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def __contains__(self, state: object) -> bool:
        return state in self._sources

    def peek_items(self) -> Iterator[tuple[State, Any]]:
        """`(state, value)` pairs without reading any view (see `__pdoc__`)."""
        peeked: dict[int, dict] = {}
        for state, source in self._sources.items():
            peek = getattr(source, "peek_items", None)
            if peek is None:
                yield state, source[state]
                continue
            if id(source) not in peeked:
                peeked[id(source)] = dict(peek())
            yield state, peeked[id(source)].get(state, MISSING)


def _is_lazy(mapping: Mapping) -> bool:
    return isinstance(mapping, StateDict) and type(mapping._values) is not dict


def _sources(values: Mapping) -> dict[State, Mapping]:
    """Each state of `values` with the mapping to look its value up in."""
    if isinstance(values, _Lazy):
        return dict(values._sources)
    return dict.fromkeys(values, values)


def _checked_write(state: State, old: Any, value: Any) -> Any:
    """`check_write`, which also takes an abstract value (of `jax.ShapeDtypeStruct`s,
    as `eqstate.transform.eval_shape` returns) in place of a concrete one of its
    shapes and dtypes: kept abstract, as a concrete value replaces an abstract one."""
    if _is_abstract(value) and not _is_abstract(old):
        check_write(state, jtu.tree_map(_abstract_leaf, old), value)
        return value
    return check_write(state, old, value)


def _is_abstract(value: Any) -> bool:
    leaves = jtu.tree_leaves(value)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def _abstract_leaf(x: Any) -> jax.ShapeDtypeStruct:
    x = jnp.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=is_weak(x))


def _dict_value(state: State, value: Any) -> Any:
    """`value` with its leaves as JAX arrays, or `StateValueError` naming `state`."""
    try:
        converted = to_dict_value(state, value)
    except TypeError as error:
        raise StateValueError(
            f"Cannot hold {value!r} (a {type(value).__name__}) for "
            f"{state_label(state)} in a StateDict: its values are PyTrees of arrays, "
            f"and JAX cannot make an array of every leaf ({error}). To keep other "
            "leaves by state (labels for `optax.multi_transform`, say), build the "
            "whole dictionary with `jax.tree.map` over one of arrays, e.g. "
            "`jax.tree.map(lambda v: 'adam', params)`: `StateDict(...)`, `set`, "
            "`update` and `|` take only values JAX can make arrays of."
        ) from None
    leaves = jtu.tree_leaves(converted)
    if isinstance(state, RandomState) and not (leaves and all(map(is_key, leaves))):
        # Else a draw would take a legacy `uint32[2]` key for a batch of two keys.
        raise StateValueError(
            f"{state_label(state)} holds typed PRNG keys, but this StateDict gives it "
            f"{value_summary(converted)}. Give it a key from `jax.random.key` (a "
            "legacy `uint32[2]` key from `jax.random.PRNGKey` converts with "
            "`jax.random.wrap_key_data`)."
        )
    return converted


def _pairs(values: Any) -> Iterable[tuple[Any, Any]]:
    """The `(handle, value)` pairs that `StateDict(values)` holds."""
    if isinstance(values, Mapping):
        return values.items()
    if isinstance(values, Iterable) and not isinstance(values, (jax.Array, str)):
        return map(_pair, values)
    raise TypeError(
        f"A StateDict is built from a mapping from handles to values, or an iterable "
        f"of `(handle, value)` pairs; got {type(values).__name__}. To take the "
        "current values of some states, use `eqstate.values_of(states)`."
    )


def _pair(item: Any) -> tuple[Any, Any]:
    try:
        state, value = item
    except (TypeError, ValueError):
        hint = (
            " To take the current values of some states, use "
            "`eqstate.values_of(states)`."
            if isinstance(item, State)
            else ""
        )
        raise TypeError(
            "A StateDict is built from a mapping from handles to values, or an "
            f"iterable of `(handle, value)` pairs; got an item {item!r} (a "
            f"{type(item).__name__}), which is not a pair.{hint}"
        ) from None
    return state, value


def _placed(state: State, value: Any, sharding: jax.sharding.Sharding) -> Any:
    try:
        return device_put_apart(value, sharding)
    except (ValueError, AssertionError) as error:  # JAX's, naming no state
        fix = (
            "Give it a sharding that fits its shape (each split dimension divisible "
            "by the devices along it, no more entries than dimensions)."
        )
        if "same on each process" in str(error):
            fix = (
                "A value placed across the processes must be the same in each: give "
                "the state the same value in every process (seed a `RandomState` "
                "alike), or build one array from each process's part with "
                "`jax.make_array_from_process_local_data`."
            )
        raise ValueError(
            f"Cannot place {state_label(state, value)} with {sharding}: "
            f"{error or ''} {fix}"
        ) from error


def _not_a_handle(key: Any, held: str) -> str:
    if isinstance(key, str):
        return (
            f"StateDict keys are state handles, not names: {key!r} is a str. Look a "
            "state up by its handle (`states[model.w]`), or select states by name "
            f"with `states.filter(eqstate.filters.WithName({key!r}))` (a string as a "
            f"filter selects by tag). This StateDict holds {held}."
        )
    return (
        f"StateDict keys are state handles, got {key!r} (a {type(key).__name__}). "
        f"This StateDict holds {held}."
    )


def _check_key(state: Any) -> None:
    if not isinstance(state, State):
        raise TypeError(
            f"StateDict keys must be state handles, got {state!r} of type "
            f"{type(state).__name__}."
        )


def _as_mapping(other: Any, where: str) -> Mapping:
    if not isinstance(other, Mapping):
        raise TypeError(
            f"`{where}` takes a StateDict (or a mapping from handles to values), got "
            f"{type(other).__name__}."
        )
    return other


def sharding_rule(rule: Any) -> Callable[[State, Any], jax.sharding.Sharding | None]:
    """`rule` (a sharding, `{filter: sharding}`, or a function) as a function
    `(state, value) -> sharding | None`."""
    return per_state_rule(
        rule,
        jax.sharding.Sharding,
        what="Shardings",
        spelled="jax.sharding.Sharding",
        short="Sharding",
    )


def _summarise_states(values: Mapping) -> str:
    if not values:
        return "no states"
    return first_and_more(_labels(list(values)))


def _labels(states: list[State]) -> list[str]:
    """`state_label` of each of `states`, with the handle's number where two share a
    label (the same layer in two models), so that messages tell them apart."""
    labels = [state_label(s) for s in states]
    shared = {label for label, n in collections.Counter(labels).items() if n > 1}
    return [
        f"{label} {handle_number(s)}" if label in shared else label
        for s, label in zip(states, labels)
    ]


class _Handles(tuple):
    """A `StateDict`'s handles, as its tree structure holds them. Printed with each
    handle's number: JAX's error about two structures keyed by different handles of
    the same name (an optimiser's state made for another copy of a model) then tells
    them apart."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "(" + ", ".join(map(state_text_with_number, self)) + ")"


def _canonical_order(sd: StateDict) -> tuple[_Handles, bool]:
    """The handles in creation order, and whether that differs from the insertion
    order; computed once per (immutable) dictionary."""
    order = sd._canonical
    if order is None:
        states = tuple(sd._values)
        ordered = _Handles(sorted(states, key=creation_order))
        order = (ordered, ordered != states)
        object.__setattr__(sd, "_canonical", order)
    return order


def rekeyed(tree: Any, handles: Mapping[State, State]) -> Any:
    """`tree` with every `StateDict` in it (at any depth, e.g. inside an optimiser's
    state), and every `dict` with a handle among its keys, keyed by `handles[s]` in
    place of each state `s` of `handles`; other keys and every leaf are kept. For
    values moving to new handles (`eqstate.clone`, the fresh handles of states a
    transform created), so that they keep referring to the states they belong
    with."""

    def one(x: Any) -> Any:
        if isinstance(x, StateDict):
            return state_dict_of(
                {handles.get(s, s): rekeyed(v, handles) for s, v in x._values.items()}
            )
        if _keyed_by_handles(x):
            return type(x)(
                (handles.get(k, k) if isinstance(k, State) else k, rekeyed(v, handles))
                for k, v in x.items()
            )
        return x

    return jtu.tree_map(one, tree, is_leaf=_is_keyed_by_handles)


def _keyed_by_handles(x: Any) -> bool:
    """Whether `x` is a `dict` (or `OrderedDict`) with a handle among its keys."""
    return type(x) in _DICTS and any(isinstance(k, State) for k in x)


_DICTS = (dict, collections.OrderedDict)


def _is_keyed_by_handles(x: Any) -> bool:
    return isinstance(x, StateDict) or _keyed_by_handles(x)


class _HandleKey(jtu.DictKey):
    """A `DictKey` of a handle (`.key`), whose text leaves out the handle's number:
    `[ParamState 'w']`, or `[unnamed ParamState, entry 2]` for the third entry of its
    `StateDict`. Key paths name the arguments and results of compiled programs, which
    must be the same in every process (see `numberless_label`)."""

    __slots__ = ("entry",)

    def __init__(self, state: State, entry: int):
        super().__init__(state)
        self.entry = entry

    def __str__(self) -> str:
        label = numberless_label(self.key)
        if label.startswith("unnamed "):
            label += f", entry {self.entry}"
        return f"[{label}]"


# StateDicts flatten in the creation order of their handles, so that dictionaries of
# the same states (e.g. gradients and parameters) have the same tree structure.
def _flatten_with_keys(sd: StateDict):
    values = sd._values
    order, _ = _canonical_order(sd)
    return [(_HandleKey(s, i), values[s]) for i, s in enumerate(order)], order


def _flatten(sd: StateDict):
    values = sd._values
    order, reordered = _canonical_order(sd)
    if not reordered:
        return tuple(values.values()), order
    return tuple(values[s] for s in order), order


def _unflatten(states: tuple, children: Iterable) -> StateDict:
    sd = state_dict_of(dict(zip(states, children)))
    if type(states) is _Handles:
        object.__setattr__(sd, "_canonical", (states, False))  # In creation order.
    return sd


jtu.register_pytree_with_keys(StateDict, _flatten_with_keys, _unflatten, _flatten)
