"""Where a checkpoint stores each array of a model, and how it is matched to a target.

A model's own array (the weight of an `eqx.nn` layer) is stored under its PyTree path,
with dots between keys (`layers.0.linear.weight`); a state's value under the path
where the state sits in the model, or its name when there is no model, extended by
each array's place in the value when it has several (`opt.mu.0`). Loading matches a
checkpoint's entries to the target's arrays by these paths, never by handle. Both
checkpoint formats (`_checkpoint_file.py`, `_orbax.py`) use what is here: the checks
made before a save touches a file, the arrays to save, and the matching and rebuilding
of the target when loading.
"""

import contextlib
from collections.abc import Mapping
from typing import Any, cast, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer
from jax.sharding import Sharding

from ._custom_types import PyTree
from ._errors import CheckpointError
from ._jax_compat import weakly_typed
from ._multi_process import device_put
from ._pretty_print import first_and_more, state_label
from ._run import assign, states_of, values_of
from ._shapes import is_key, key_impl_of
from ._state import is_state, State
from ._state_dict import state_dict_of, StateDict
from ._write_checks import cast_breaks, to_value


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
    if isinstance(owner, ModelArray):
        return f"the array `{owner.path}`"
    return state_label(owner)


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
                f"Cannot {verb} {first_and_more(map(state_label, missing))}: "
                f"{'it is' if one else 'they are'} "
                "not in `model`, which gives each state its path in the file. Pass "
                "the model holding every state of the StateDict, or leave the others "
                "out of it, e.g. use `eqstate.values_of(model)`."
            )
        return paths
    named: dict[State, str] = {}
    by_name: dict[str, State] = {}
    for state in states:
        if state.name is None:
            unnamed = (state_label(s) for s in states if s.name is None)
            raise CheckpointError(
                _NAMES_NEEDED.format(
                    verb=verb,
                    what=first_and_more(unnamed),
                    example=_NAMES_EXAMPLES[verb],
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


def is_state_mapping(x: Any) -> bool:
    """Whether `x` is a mapping whose keys are all states (a target, or values to save)."""
    return isinstance(x, Mapping) and all(is_state(s) for s in x)


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


# Saving ------------------------------------------------------------------------------


def _short_repr(x: Any, limit: int = 60) -> str:
    text = repr(x)
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{text} (a {type(x).__name__})"


# What JAX raises for a leaf it cannot make an array of: text or an arbitrary object
# (TypeError), a Python int too large for its integer dtype (OverflowError), ...
_NOT_AN_ARRAY = (TypeError, OverflowError, ValueError)


def _first_non_array(value: PyTree) -> tuple[str, BaseException | None]:
    """The first leaf of `value` that JAX cannot make an array of, described, and
    the error JAX raised for it."""
    for path, leaf in jtu.tree_leaves_with_path(value):
        try:
            to_value(leaf)
        except _NOT_AN_ARRAY as e:
            where = f" at `{jtu.keystr(path)}`" if path else ""
            return _short_repr(leaf) + where, e
    return "a leaf that is not an array", None


def _narrowed(state: State, value: PyTree, arrays: PyTree) -> None:
    """Raises `CheckpointError` if JAX broke a NumPy leaf or a Python float of
    `value` when making `arrays` of it: with 64-bit types off, it narrows `int64` to
    `int32` (wrapping `2**33 + 5` to `5`) and `float64` (and Python floats) to
    `float32` (`1e40` to `inf`, `1e-50` to `0`). The checkpoint would store another
    value. Rounding to the nearest `float32` (`0.1`) is not refused: it is what a
    write of the value to a state does."""
    flat = zip(jtu.tree_leaves_with_path(value), jtu.tree_leaves(arrays))
    for (path, leaf), array in flat:
        if isinstance(leaf, np.ndarray | np.generic):
            what = f"a NumPy array of dtype {leaf.dtype}"
        elif isinstance(leaf, float | complex):
            what = f"a Python {type(leaf).__name__}"
        else:
            continue
        broken = cast_breaks(leaf, array.dtype)
        if broken is None:
            continue
        before, after = broken
        where = f" at `{jtu.keystr(path)}`" if path else ""
        raise CheckpointError(
            f"Cannot save {state_label(state)}: its value holds {what}{where}, "
            f"which JAX converts to {array.dtype} (64-bit "
            f"types are off), and that changes it: {before} becomes "
            f"{after}. Nothing was written. Enable 64-bit types "
            "(`jax.config.update('jax_enable_x64', True)`), or convert the value "
            "yourself if the change is meant, e.g. "
            f"`jnp.asarray(x, jnp.{array.dtype})`."
        )


def values_to_save(states: Mapping[State, PyTree]) -> dict[State, PyTree]:
    """The values of `states` with every leaf a JAX array; `CheckpointError` naming
    the state for a value that is None (the checkpoint would have no entry for it)
    or that has a leaf JAX cannot make an array of (text, an arbitrary object, a
    Python int too large for JAX's integers), or a NumPy leaf that JAX would change
    when making an array of it."""
    values = {}
    for state, value in states.items():
        what = f"Cannot save {state_label(state)}: its value"
        if value is None:
            raise CheckpointError(
                f"{what} is None, which holds no arrays, so the checkpoint would "
                "have no entry for it and could not restore it. Nothing was written. "
                "Pass the state's value, e.g. `eqstate.values_of(model)`, or leave "
                "the state out of the mapping."
            )
        try:
            # NumPy warns of a 64-bit value that JAX's narrowing overflows, which
            # `_narrowed` refuses just below with the state's name.
            with np.errstate(over="ignore", invalid="ignore"):
                values[state] = to_value(value)
        except _NOT_AN_ARRAY as e:
            leaf, error = _first_non_array(value)
            if isinstance(error or e, OverflowError):
                raise CheckpointError(
                    f"{what} holds {leaf}, which JAX cannot make an array of: "
                    f"{error or e}. Nothing was written. Pass an array of a dtype "
                    "that holds it, e.g. `jnp.array(n, jnp.float32)`, or enable "
                    "64-bit types (`jax.config.update('jax_enable_x64', True)`)."
                ) from e
            raise CheckpointError(
                f"{what} holds {leaf}, which JAX cannot make an array of. Nothing "
                "was written. A checkpoint stores arrays: pass the state's value, "
                "e.g. `eqstate.values_of(model)`."
            ) from e
        _narrowed(state, value, values[state])
    return values


def check_savable(spec: Leaf, leaf: Any) -> None:
    """Raises `CheckpointError` if `leaf`, the array stored as `spec`, cannot be
    stored: a tracer, an array that has been deleted, or a `float0` array."""
    what = f"Cannot save {spec.where}: its value"
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
            "(`jnp.copy(x)`) of values that must outlive a donating call. A thread "
            "saving while another runs a donating call must take turns with it: "
            "copy the values under the lock that call takes, then save the copy."
        )
    if spec.dtype == jax.dtypes.float0:
        raise CheckpointError(
            f"{what} (shape {spec.shape}) has dtype float0, the dtype of the "
            "gradient JAX gives for an integer value (`jax.grad(..., "
            "allow_int=True)`): it holds no data, and a checkpoint cannot store it. "
            "Nothing was written or removed. Leave the state out of the checkpoint "
            "(e.g. save `eqstate.values_of(model)` rather than its gradients)."
        )


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


def leaves_to_save(
    model_or_states: PyTree, model: PyTree | None
) -> list[tuple[Leaf, Any]]:
    """Every array to save, with its path: those of the values of a mapping of
    states, their paths from `model` or their names; or, for a model, its own arrays
    and its states' values, by their paths in it."""
    if is_state_mapping(model_or_states):
        if model is not None:
            refuse_model_arrays(model)
        values = values_to_save(model_or_states)
        return stored_leaves(state_paths(tuple(values), model, "save"), values)
    if model is not None:
        raise TypeError(
            "`eqstate.save` takes `model=` only with a StateDict of the values to "
            "save, to give their paths. To save a whole model, its arrays and its "
            "states' values, call `eqstate.save(path, model)`."
        )
    arrays, _, _ = model_arrays(model_or_states)
    if not arrays and not states_of(model_or_states):
        raise TypeError(
            "`eqstate.save(path, model)` saves the arrays and the states' values a "
            f"model holds, but {_short_repr(model_or_states)} holds neither. Pass "
            "the model (an `eqx.Module`, or any PyTree of arrays and handles), or a "
            "StateDict of the values to save, e.g. `eqstate.values_of(model)`."
        )
    values: dict[Any, PyTree] = values_to_save(values_of(model_or_states))
    paths: dict[Any, str] = state_paths(tuple(values), model_or_states, "save")
    paths.update((array, array.path) for array in arrays)
    values.update(arrays)
    return stored_leaves(paths, values)


# Loading -----------------------------------------------------------------------------


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


def as_loaded(spec: Leaf, leaf: Any, stored: Any) -> Any:
    """`stored`, the array read for `spec` from a checkpoint, as the target's current
    value `leaf` expects it: a NumPy array as such; else a JAX array (a PRNG key
    wrapped again) made where `leaf` is (see `made_where`) and placed on its sharding
    (see `target_sharding`), unless the backend already placed it there."""
    if spec.numpy:
        return stored
    with made_where(leaf):
        value = jnp.asarray(stored)
        if spec.key_impl is not None:
            value = jax.random.wrap_key_data(value, impl=spec.key_impl)
    if isinstance(stored, np.ndarray) and (sharding := target_sharding(leaf)):
        value = device_put(value, sharding)
    return value


class Target(NamedTuple):
    """What a checkpoint is loaded into."""

    name: str  # in messages: "the model", "the StateDict"
    expected: dict[Any, PyTree]  # the current value of each state and model array
    specs: list[tuple[Leaf, Any]]  # every array it expects, with its current value
    model: tuple[list[Any], Any] | None  # a model's leaves and structure; None: a dict


def load_target(model_or_states: PyTree, model: PyTree | None) -> Target:
    """The target of a load: a StateDict (or mapping of states), its states' paths
    taken from `model` or their names; or a model, whose arrays and states' values
    are loaded by their paths in it."""
    if is_state_mapping(model_or_states):
        expected = (
            model_or_states
            if isinstance(model_or_states, StateDict)
            else StateDict(model_or_states)
        )
        name = (
            "the StateDict" if model is None else "the StateDict (paths from `model`)"
        )
        paths = state_paths(expected.states, model, "load")
        return Target(name, dict(expected), stored_leaves(paths, expected), None)
    if model is not None:
        raise TypeError(
            "`eqstate.load` takes `model=` only when its target is a StateDict, which "
            "then says which states to load and `model` gives their paths. To load "
            "a whole model, its arrays and its states, call "
            "`model = eqstate.load(path, model)`."
        )
    arrays, leaves, treedef = model_arrays(model_or_states, is_loadable_array)
    states = values_of(model_or_states)
    paths: dict[Any, str] = state_paths(states.states, model_or_states, "load")
    paths.update((array, array.path) for array in arrays)
    expected = {**states, **arrays}
    return Target(
        "the model", expected, stored_leaves(paths, expected), (leaves, treedef)
    )


def _array_summary(dtype: Any, shape: tuple[int, ...], key_impl: str | None) -> str:
    if key_impl is not None:
        return f"a {key_impl} PRNG key (key data of shape {shape}, dtype {dtype})"
    return f"shape {shape} and dtype {dtype}"


def _mismatch(path: str, target: str, needed: list, extra: list) -> CheckpointError:
    lines = [f"The checkpoint {path!r} does not match {target}."]
    if needed:
        missing = (
            f"`{spec.path}`"
            + ("" if isinstance(spec.owner, ModelArray) else f" (for {spec.label})")
            for spec in needed
        )
        lines.append(f"It has no entry {first_and_more(missing)}.")
    if any(isinstance(spec.owner, ModelArray) for spec in needed):
        lines.append(
            "It lacks arrays of the model (the weights of `eqx.nn` layers, say): it "
            "may hold the states alone, saved with `eqstate.save(path, states, "
            "model=model)`. Load those into the states alone, keeping the model's "
            "arrays: `eqstate.assign(eqstate.load(path, eqstate.values_of(model), "
            "model=model))`."
        )
    if extra:
        held = (f"`{entry['path']}`" for entry in extra)
        lines.append(f"It holds {first_and_more(held)}, which {target} does not have.")
    lines.append(
        "Paths come from where each state sits in the model (or from state names when "
        "loading into a StateDict), so build the model with the structure it had when "
        "it was saved: same layers, field names and state names."
    )
    return CheckpointError("\n".join(lines))


# The dtypes JAX narrows to 32 bits while 64-bit types are off.
_64_BIT = frozenset({"int64", "uint64", "float64", "complex128"})


def _held_as(dtype: Any) -> np.dtype:
    """The dtype JAX holds values of `dtype` as (narrowed while 64-bit types are off)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(dtype)))


def check_entries(
    path: str, target: str, specs: list[Leaf], entries: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Checks that a checkpoint's entries are exactly the arrays the target expects,
    with their shapes and dtypes. Returns the entries by path."""
    by_path = {entry["path"]: entry for entry in entries}
    needed = [spec for spec in specs if spec.path not in by_path]
    wanted = {spec.path for spec in specs}
    extra = [entry for entry in entries if entry["path"] not in wanted]
    if needed or extra:
        raise _mismatch(path, target, needed, extra)

    problems, narrowed = [], False
    for spec in specs:
        entry = by_path[spec.path]
        found = (entry["dtype"], tuple(entry["shape"]), entry.get("key_impl"))
        held = spec.dtype if spec.numpy else _held_as(spec.dtype)
        if found != (spec.dtype.name, spec.shape, spec.key_impl):
            problems.append(
                f"`{spec.path}` holds {_array_summary(*found)}, but "
                f"{spec.label} expects "
                f"{_array_summary(spec.dtype.name, spec.shape, spec.key_impl)}"
            )
            stored = entry["dtype"]
            narrowed |= stored in _64_BIT and _held_as(stored) == held
        elif held != spec.dtype:
            problems.append(
                f"`{spec.path}` holds {spec.dtype.name}, which JAX holds as {held.name} "
                f"while 64-bit types are off: {spec.label} would get "
                "other values"
            )
            narrowed = True
    if problems:
        listed = first_and_more(
            (f"- {problem};" for problem in problems), sep="\n", more="\n- and {} more;"
        )
        fix = (
            "Build the target with the shapes and dtypes it had when it was saved, or "
            "load into such a target and convert the values after loading."
        )
        if narrowed:
            fix = (
                "The checkpoint was saved with 64-bit types on: turn them on before "
                "loading it (`jax.config.update('jax_enable_x64', True)`, at the "
                "program's start)."
            )
        raise CheckpointError(
            f"The checkpoint {path!r} does not match {target}:\n{listed}\n{fix}"
        )
    return by_path


def loaded_into(
    target: Target, arrays: list[Any], entries: Mapping[str, Mapping[str, Any]]
) -> Any:
    """What a load returns, made of `arrays` (one for each of `target.specs`, read
    from the checkpoint's `entries`, by path): a StateDict of the states' values; or,
    for a model, the model with its arrays replaced, its states' values then written
    to the innermost context."""
    loaded: dict[Any, list[Any]] = {owner: [] for owner in target.expected}
    for (spec, leaf), array in zip(target.specs, arrays, strict=True):
        # Checkpoints written before entries recorded `weak_type` take the target's.
        weak = entries[spec.path].get("weak_type", spec.weak_type)
        if spec.numpy:
            array = np.asarray(array)[() if isinstance(leaf, np.generic) else ...]
        elif weak is True and spec.key_impl is None:
            with made_where(leaf):
                array = weakly_typed(array)
        loaded[spec.owner].append(array)
    values = {
        owner: jtu.tree_unflatten(jtu.tree_structure(target.expected[owner]), leaves)
        for owner, leaves in loaded.items()
    }
    states = state_dict_of({s: v for s, v in values.items() if is_state(s)})
    if target.model is None:
        return states
    leaves, treedef = target.model
    leaves = list(leaves)
    for owner, value in values.items():
        if isinstance(owner, ModelArray):
            leaves[owner.place] = value
    assign(states)
    return jtu.tree_unflatten(treedef, leaves)
