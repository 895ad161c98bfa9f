"""Where a checkpoint stores each array of a model: its path, such as
`layers.0.bn.running_mean`. A model's own array (the weight of an `eqx.nn` layer) is
stored under its PyTree path; a state's value under the path where the state sits in
the model, or its name when there is no model, extended by each array's place in the
value when it has several (`opt.mu.0`). Both checkpoint formats name their entries
this way, and rebuild the model and the values from the arrays they read back."""

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any, cast, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer
from jax.sharding import Sharding
from jaxtyping import PyTree

from ._errors import CheckpointError
from ._jax_compat import weakly_typed
from ._pretty_print import first_and_more, state_label
from ._run import states_of
from ._shapes import is_key, key_impl_of
from ._state import is_state, State


_NAMES_NEEDED = (
    "Cannot {verb} {what} without a model: without one, each state's entry in the "
    "file is named after the state, so every state needs a unique, non-None name. "
    "Either pass the model holding the states, which names each entry by the state's "
    "PyTree path:\n"
    "    {example}\n"
    "or name the states when creating them:\n"
    "    w = eqstate.ParamState(jnp.zeros(3), name='w')"
)
_NAMES_EXAMPLES = {
    "save": "eqstate.save(path, model)",
    "load": "eqstate.load(path, model)",
}


class ModelArray(NamedTuple):
    """An array leaf of a model (not a state's value), at `place` among the model's
    leaves (handles count as leaves)."""

    place: int
    path: str


def owner_label(owner: "State | ModelArray") -> str:
    """Names a state, or a model's array, in messages."""
    return (
        f"the array `{owner.path}`"
        if isinstance(owner, ModelArray)
        else (state_label(owner))
    )


class Leaf(NamedTuple):
    """One array of a model's (its own, or of a state's value), as stored (or
    expected) in a checkpoint."""

    path: str
    owner: "State | ModelArray"
    dtype: np.dtype  # of the stored bytes: for PRNG keys, of their key data
    shape: tuple[int, ...]
    key_impl: str | None
    weak_type: bool
    numpy: bool  # a NumPy array, stored and loaded back as one (no JAX conversion)

    @property
    def label(self) -> str:
        return owner_label(self.owner)

    @property
    def where(self) -> str:
        """``w` (ParamState 'w')`, or `the array `linear.weight``."""
        if isinstance(self.owner, ModelArray):
            return self.label
        return f"`{self.path}` ({self.label})"


def _key_text(entry: Any, states: Mapping[Any, str]) -> str:
    if isinstance(entry, jtu.GetAttrKey):
        return entry.name
    if isinstance(entry, jtu.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, jtu.DictKey):
        return _state_text(entry.key, states) if is_state(entry.key) else str(entry.key)
    if isinstance(entry, jtu.FlattenedIndexKey):
        return str(entry.key)
    return jtu.keystr((entry,)).lstrip(".")


def _state_text(state: State, states: Mapping[Any, str]) -> str:
    """A state met inside a value (a StateDict in an optimiser's state) is stored under
    its own path in the model (or its name), which stays the same across runs and
    processes."""
    text = states.get(state, state.name)
    if text is None:
        raise CheckpointError(
            f"A value holds a StateDict entry for {state_label(state)}, which has no "
            "path in the checkpoint: it is not in `model` (or no `model` was given), "
            "and it has no name. Pass `model=` holding it (e.g. the whole model, "
            "when saving only its optimiser state), or give it a `name=`."
        )
    return text


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _path_text(path: tuple, states: Mapping[Any, str] | None = None) -> str:
    """`(GetAttrKey('layers'), SequenceKey(0), DictKey('w'))` -> `layers.0.w`; a
    `DictKey` of a state gives that state's path in `states`, else its name."""
    return _join(*(_key_text(entry, states or {}) for entry in path))


def _labels(states: Iterable[State]) -> str:
    return first_and_more(map(state_label, states))


def state_paths(
    states: tuple[State, ...], model: PyTree | None, verb: str
) -> dict[State, str]:
    """The path under which each of `states` is stored: its PyTree path in `model`
    (the first one, if it sits at several), or its name when there is no model.

    With a model, the result also holds the path of every other state in it: a
    handle met inside a value (an optimiser's moments keyed by parameters) is stored
    under its path in the model, whether or not its own value is saved."""
    if model is not None:
        found = cast(tuple[tuple[tuple, State], ...], states_of(model, with_paths=True))
        paths = {state: _path_text(path) for path, state in found}
        missing = [s for s in states if s not in paths]
        if missing:
            one = len(missing) == 1
            raise CheckpointError(
                f"Cannot {verb} {_labels(missing)}: {'it is' if one else 'they are'} "
                "not in `model`, which gives each state its path in the file. Pass "
                "the model holding every state of the StateDict, or leave the others "
                "out of it, e.g. use `eqstate.values_of(model)`."
            )
        return paths
    named: dict[State, str] = {}
    by_name: dict[str, State] = {}
    for state in states:
        if state.name is None:
            unnamed = [s for s in states if s.name is None]
            raise CheckpointError(
                _NAMES_NEEDED.format(
                    verb=verb, what=_labels(unnamed), example=_NAMES_EXAMPLES[verb]
                )
            )
        if state.name in by_name:
            other = by_name[state.name]
            raise CheckpointError(
                _NAMES_NEEDED.format(
                    verb=verb,
                    example=_NAMES_EXAMPLES[verb],
                    what=f"two states named {state.name!r} ({state_label(other)} and "
                    f"{state_label(state)})",
                )
            )
        by_name[state.name] = state
        named[state] = state.name
    return named


def target_sharding(leaf: Any) -> Sharding | None:
    """Where a value loaded for `leaf`, the target's current value, is placed: on the
    sharding of a committed array, or of a `jax.ShapeDtypeStruct` that has one. Other
    values give None and are not placed: placing them would tie them to a device,
    and jitted functions would compile again."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding
        return sharding if isinstance(sharding, Sharding) else None
    if isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer) and leaf.committed:
        return leaf.sharding
    return None


def made_where(leaf: Any) -> contextlib.AbstractContextManager:
    """Where a value loaded for `leaf` is made when `target_sharding` does not place
    it: on the device of an uncommitted array (one made under `jax.default_device`,
    say), as `jax.default_device` makes it, so that it stays uncommitted."""
    if isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer):
        devices = leaf.devices()
        if not leaf.committed and len(devices) == 1:
            return jax.default_device(next(iter(devices)))
    return contextlib.nullcontext()


def stored_leaves(
    paths: Mapping[Any, str], values: Mapping[Any, PyTree]
) -> list[tuple[Leaf, Any]]:
    """Every array of every value with the path it is stored under, in order; a value
    with several leaves gets one entry per leaf (`opt.mu.0`).

    **Arguments:**

    - `paths`: the path of each key of `values` (a state, or a `ModelArray`), and of
        the states keying StateDicts inside the values.
    - `values`: the value of each state, and each array of the model.
    """
    out: list[tuple[Leaf, Any]] = []
    seen: dict[str, Any] = {}
    for owner, value in values.items():
        base = paths[owner]
        for subpath, leaf in jtu.tree_leaves_with_path(value):
            path = _join(base, _path_text(subpath, paths))
            if path in seen:
                raise CheckpointError(
                    f"Two arrays would be stored under the same path `{path}` (of "
                    f"{owner_label(seen[path])} and {owner_label(owner)}). Paths join "
                    "PyTree keys with dots, so e.g. a dict key 'a.b' and a nested "
                    "key 'a' -> 'b' collide: rename one of them."
                )
            numpy = isinstance(leaf, np.ndarray | np.generic)
            if is_key(leaf):
                impl, data = key_impl_of(leaf)
                dtype, shape, key = np.dtype(data.dtype), data.shape, str(impl)
            else:
                dtype, shape, key = np.dtype(leaf.dtype), tuple(leaf.shape), None
            weak = key is None and bool(getattr(leaf, "weak_type", False))
            seen[path] = owner
            out.append((Leaf(path, owner, dtype, shape, key, weak, numpy), leaf))
    return out


def is_loadable_array(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def model_arrays(
    model: PyTree, is_array: Any = eqx.is_array
) -> tuple[dict[ModelArray, Any], list[Any], Any]:
    """The array leaves of `model` (not the values of its states), each keyed by its
    place and path; and the model's leaves (handles among them) and structure, to
    rebuild it with other arrays."""
    with_paths, treedef = jtu.tree_flatten_with_path(model, is_leaf=is_state)
    arrays = {
        ModelArray(i, _path_text(path)): leaf
        for i, (path, leaf) in enumerate(with_paths)
        if is_array(leaf)
    }
    return arrays, [leaf for _, leaf in with_paths], treedef


_STATES_ALONE = (
    "Cannot save the states alone from `model`: it also holds {count}, {paths}, which "
    "the checkpoint would leave out, so a model loaded from it would keep the arrays "
    "it was built with. Nothing was written. Save the whole model, its arrays and "
    "its states' values together:\n"
    "    eqstate.save(path, model)\n"
    "    model = eqstate.load(path, model)\n"
    "or, to save chosen states alone on purpose, pass the model without its arrays "
    "(its handles keep their paths):\n"
    "    eqstate.save(path, states, model=eqx.filter(model, eqstate.is_state))"
)


def refuse_model_arrays(model: PyTree) -> None:
    """Raises `CheckpointError` if `model`, passed to give the paths of states saved
    alone, holds arrays of its own: saving would leave them out, silently."""
    arrays, _, _ = model_arrays(model)
    if arrays:
        count = "an array" if len(arrays) == 1 else f"{len(arrays)} arrays"
        paths = first_and_more(f"`{a.path}`" for a in arrays)
        raise CheckpointError(_STATES_ALONE.format(count=count, paths=paths))


def values_from_arrays(
    expected: Mapping[Any, PyTree],
    specs: list[tuple[Leaf, Any]],
    arrays: list[Any],
    entries: Mapping[str, Mapping[str, Any]],
) -> dict[Any, PyTree]:
    """The values of `expected`, made of `arrays`.

    **Arguments:**

    - `expected`: the target's current values (of states, and of a model's arrays),
        which give each value's structure.
    - `specs`: the arrays of `expected` as `stored_leaves` lists them.
    - `arrays`: one loaded array for each of `specs`, in the same order.
    - `entries`: the checkpoint's entries by path, which say whether each array was
        weakly typed when saved.

    **Returns:**

    A dict from each key of `expected` to its value rebuilt from `arrays`.
    """
    loaded: dict[Any, list[Any]] = {owner: [] for owner in expected}
    for (spec, leaf), array in zip(specs, arrays, strict=True):
        # Checkpoints written before entries recorded `weak_type` take the target's.
        weak = entries[spec.path].get("weak_type", spec.weak_type)
        if spec.numpy:
            array = np.asarray(array)[() if isinstance(leaf, np.generic) else ...]
        elif weak is True and spec.key_impl is None:
            with made_where(leaf):
                array = weakly_typed(array)
        loaded[spec.owner].append(array)
    return {
        owner: jtu.tree_unflatten(jtu.tree_structure(expected[owner]), leaves)
        for owner, leaves in loaded.items()
    }
