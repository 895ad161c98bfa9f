"""Matching a checkpoint's entries to the states of the target it is loaded into, and
the messages that say how they differ. Both checkpoint formats check entries this
way."""

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from ._checkpoint_paths import Leaf, state_paths
from ._errors import CheckpointError
from ._pretty_print import first_and_more, state_label
from ._run import values_of
from ._state import is_state, State
from ._state_dict import StateDict


def is_state_mapping(x: Any) -> bool:
    """Whether `x` is a mapping whose keys are all states (a target, or values to save)."""
    return isinstance(x, Mapping) and all(is_state(s) for s in x)


def load_target(
    model_or_states: PyTree, model: PyTree | None
) -> tuple[StateDict, dict[State, str], str]:
    """The target's expected values, the path of each of its states, and its name in
    messages."""
    if is_state_mapping(model_or_states):
        expected = (
            model_or_states
            if isinstance(model_or_states, StateDict)
            else StateDict(model_or_states)
        )
        name = (
            "the StateDict" if model is None else "the StateDict (paths from `model`)"
        )
        return expected, state_paths(expected.states, model, "load"), name
    if model is not None:
        raise TypeError(
            "`eqstate.load` takes `model=` only when its target is a StateDict, which "
            "then says which states to load and `model` gives their paths. To load "
            "every state of a model, call `eqstate.load(path, model)`."
        )
    expected = values_of(model_or_states)
    return expected, state_paths(expected.states, model_or_states, "load"), "the model"


def _array_summary(dtype: Any, shape: tuple[int, ...], key_impl: str | None) -> str:
    if key_impl is not None:
        return f"a {key_impl} PRNG key (key data of shape {shape}, dtype {dtype})"
    return f"shape {shape} and dtype {dtype}"


def _mismatch(path: str, target: str, needed: list, extra: list) -> CheckpointError:
    lines = [f"The checkpoint {path!r} does not match {target}."]
    if needed:
        missing = (f"`{spec.path}` (for {state_label(spec.state)})" for spec in needed)
        lines.append(f"It has no entry {first_and_more(missing)}.")
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
        held = _held_as(spec.dtype)
        if found != (spec.dtype.name, spec.shape, spec.key_impl):
            problems.append(
                f"`{spec.path}` holds {_array_summary(*found)}, but "
                f"{state_label(spec.state)} expects "
                f"{_array_summary(spec.dtype.name, spec.shape, spec.key_impl)}"
            )
            stored = entry["dtype"]
            narrowed |= stored in _64_BIT and _held_as(stored) == held
        elif held != spec.dtype:
            problems.append(
                f"`{spec.path}` holds {spec.dtype.name}, which JAX holds as {held.name} "
                f"while 64-bit types are off: {state_label(spec.state)} would get "
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
