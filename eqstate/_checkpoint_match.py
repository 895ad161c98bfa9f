"""What a checkpoint holds: the arrays saved from a model or a StateDict, and the
matching of a checkpoint's entries to the target it is loaded into, with the messages
that say how they differ. Both checkpoint formats use these."""

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from ._checkpoint_checks import values_to_save
from ._checkpoint_paths import (
    is_loadable_array,
    Leaf,
    model_arrays,
    ModelArray,
    refuse_model_arrays,
    state_paths,
    stored_leaves,
)
from ._errors import CheckpointError
from ._pretty_print import first_and_more
from ._run import assign, states_of, values_of
from ._state import is_state
from ._state_dict import state_dict_of, StateDict


def is_state_mapping(x: Any) -> bool:
    """Whether `x` is a mapping whose keys are all states (a target, or values to save)."""
    return isinstance(x, Mapping) and all(is_state(s) for s in x)


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


def _short_repr(x: Any, limit: int = 60) -> str:
    text = repr(x)
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{text} (a {type(x).__name__})"


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


def loaded_into(target: Target, values: Mapping[Any, PyTree]) -> Any:
    """What loading `values` (one for each key of `target.expected`) returns: a
    StateDict of the states' values; or, for a model, the model with its arrays
    replaced, its states' values then written to the innermost context."""
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
