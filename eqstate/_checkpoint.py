"""Checkpoints: `save` and `load` store the values of states by path, in one file (see
`_checkpoint_file.py` for its format) or, across processes, with Orbax (`_orbax.py`).

A checkpoint's entries are named by `_checkpoint_paths.py` and matched to a target's
states by `_checkpoint_match.py`; both backends share them.
"""

import os
from collections.abc import Mapping
from typing import Any

import jax
from jaxtyping import PyTree

from ._checkpoint_checks import refuse_under_transforms, values_to_save
from ._checkpoint_file import read_array, read_checkpoint, write_checkpoint
from ._checkpoint_match import check_entries, is_state_mapping, load_target
from ._checkpoint_paths import (
    made_where,
    state_paths,
    stored_leaves,
    target_sharding,
    values_from_arrays,
)
from ._multi_process import device_put, resolve_backend
from ._state import State
from ._state_dict import StateDict


_SAVE_FIX = "step(x)\n    eqstate.save(path, eqstate.values_of(model), model=model)"
_LOAD_FIX = "eqstate.assign(eqstate.load(path, model))\n    step(x)"


def _short_repr(x: Any, limit: int = 60) -> str:
    text = repr(x)
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{text} (a {type(x).__name__})"


def _placed_like(leaf: Any, value: jax.Array) -> jax.Array:
    """`value` on the device or sharding of `leaf`, the target's current value (see
    `target_sharding`)."""
    sharding = target_sharding(leaf)
    return value if sharding is None else device_put(value, sharding)


def save(
    path: str | os.PathLike,
    states: Mapping[State, PyTree],
    *,
    model: PyTree | None = None,
    backend: str | None = None,
) -> None:
    """Saves the values of states to a checkpoint file.

    Each array is stored under a readable path. With `model`, a state's path is where
    it sits in the model, with dots between PyTree keys: `layers.0.bn.running_mean`.
    Without `model`, it is the state's `name`. A value with several arrays stores one
    entry per array, its path extended by the array's place in the value:
    `opt.mu.0`. Every dtype round-trips bit for bit, including `bfloat16`, integers,
    booleans and typed PRNG keys. (A NumPy value is saved as the JAX array made of
    it, as a write to a state converts it; with 64-bit types off, one that JAX's
    narrowing to 32 bits breaks, an integer that wraps or a float that becomes
    infinite or zero, is refused.) A value with no arrays (`{}`) has no entries and
    loads back as it was; so does an empty `StateDict`.

    The write is atomic: the file is written next to `path` under a temporary name,
    flushed to disk and renamed onto `path`. If anything fails, the temporary file is
    removed and a checkpoint already at `path` is left as it was; if it succeeds, the
    new file keeps the permissions of the one it replaced. If `path` is a
    symlink, the link stays and the file it leads to is replaced (atomically, the same
    way). A save that was killed cannot remove its temporary file; the next save to
    the same path does. The format (one file, no pickle) is described in the how-to
    guide on checkpoints.

    **Arguments:**

    - `path`: the file to write. Its directory must exist.
    - `states`: the values to save, a [`eqstate.StateDict`][] (or a mapping from
        handles to values), e.g. `eqstate.values_of(model)`.
    - `model`: a PyTree holding the handles, e.g. an `eqx.Module`; it gives each state
        its path, and so do the states keying a `StateDict` inside a value (an
        optimiser's moments), whether or not their own values are saved. A state
        found at several places is stored under the first. If omitted, every state
        must have a unique name. (Keyword only argument.)
    - `backend`: `"single-file"` (this format), `"orbax"` (a directory in which
        every process writes its own shards; needs `eqstate[orbax]`), or `None`:
        Orbax when the program runs as several processes (`jax.process_count() >
        1`), else the single file. Orbax replaces an Orbax checkpoint already at
        `path`, and refuses a path holding anything else. It writes the new
        checkpoint beside `path` (at `path + ".eqstate-saving"`) and process 0 then
        swaps the two directories, so a failed save leaves the old checkpoint in
        place; a save killed between the two renames leaves the old one at
        `path + ".eqstate-replaced"`, which loading `path` points to. Through a
        symlink, the directory it leads to is replaced. (Keyword only argument.)

    **Raises:**

    [`eqstate.CheckpointError`][] if a state is not in `model`, if states lack unique
    names when there is no `model`, if two arrays would get the same path (with the
    Orbax backend, also paths that differ only by a trailing `/`), if a value is
    None or holds something JAX cannot make an array of (text, an arbitrary object,
    a Python int too large for JAX's integers), if a NumPy value
    would be broken by JAX's narrowing of 64-bit types to 32 bits (x64 off: e.g.
    `np.array(2**33)`, `np.array(1e40)`), if a value is a leaked tracer, an array
    that has been deleted (donated to a jitted call) or a `float0` array (the
    gradient of an integer, which holds no data), if the Orbax backend finds a file or a
    directory that is not an Orbax checkpoint at `path`, if the file cannot be
    written (a read-only directory, a full disk: the `OSError` is its cause), or if
    called inside a JAX transform (`jit`, a loop body, `vmap`), which would write
    the file only once, while tracing: save between calls of the compiled step.
    `TypeError` if `states` is not a mapping of states. Nothing is written or
    removed then.

    !!! Example

        ```python
        import os
        import tempfile

        import eqstate as es
        import jax.numpy as jnp

        model = {"w": es.ParamState(jnp.ones(3)), "n": es.ShortTermState(jnp.array(2))}
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "model.eqstate")
            es.save(path, es.values_of(model), model=model)
            loaded = es.load(path, model)
        assert (loaded[model["w"]] == 1).all() and loaded[model["n"]] == 2
        ```
    """
    refuse_under_transforms("save", _SAVE_FIX)
    path = os.fspath(path)
    if not is_state_mapping(states):
        raise TypeError(
            "`eqstate.save(path, states)` takes the values to save as a StateDict (or a "
            f"mapping from handles to values), got {_short_repr(states)}. E.g. "
            "`eqstate.save(path, eqstate.values_of(model), model=model)`."
        )
    if resolve_backend(backend, path, "save") == "orbax":
        from ._orbax import save_orbax

        return save_orbax(path, states, model=model)
    values = values_to_save(states)
    write_checkpoint(
        path, stored_leaves(state_paths(tuple(values), model, "save"), values)
    )


def load(
    path: str | os.PathLike,
    model_or_states: PyTree,
    *,
    model: PyTree | None = None,
    backend: str | None = None,
) -> StateDict:
    """Loads the values of states from a checkpoint written by [`eqstate.save`][].

    Entries are matched to states by path, never by handle, so a checkpoint loads into
    a freshly built model whose handles are new. The file is read and checked whole
    before anything is returned: format, checksums, and that the checkpoint has
    exactly the arrays the target expects, with the shapes and dtypes of the target's
    current values. Nothing is written to the states: pass the result to
    [`eqstate.assign`][], or use it with [`eqstate.run`][].

    **Arguments:**

    - `path`: the checkpoint file.
    - `model_or_states`: the target. Either a PyTree holding handles (a model, whose
        states take their paths from where they sit in it, as when saving with
        `model=`), or a [`eqstate.StateDict`][] (whose states take their paths from
        their names, or from `model`). The target's current values give the expected
        shapes and dtypes.
    - `model`: only with a `StateDict` target: a PyTree holding its states, to take
        their paths from (and those of the states keying a `StateDict` inside a
        value, as when saving). This loads a checkpoint saved with
        `save(path, states, model=model)` where `states` is part of the model's
        states, e.g. only its parameters. (Keyword only argument.)
    - `backend`: `"single-file"`, `"orbax"`, or `None` to tell from `path`: a
        directory that Orbax wrote is read with Orbax, each process reading only the
        shards its devices hold. (Keyword only argument.)

    **Returns:**

    A `StateDict` from the target's handles to the loaded values, each placed like the
    target's current value: on its sharding if it is committed to devices, else
    uncommitted on its device (one made under `jax.default_device`, say, stays on
    that device), so that jitted functions do not compile again. The target may hold abstract
    values (`jax.ShapeDtypeStruct`, as [`eqstate.transform.eval_shape`][] returns),
    typed PRNG keys included: each is loaded onto its `sharding` if it has one.

    **Raises:**

    [`eqstate.CheckpointError`][] if the file is missing or unreadable, is not an
    eqstate checkpoint, has an unknown format version, is truncated, malformed or
    corrupted (a checksum does not match), lacks a path the target needs or holds one
    it does not have, or holds an array whose shape or dtype differs from the
    target's; or if called inside a JAX transform (`jit`, a loop body, `vmap`),
    which would read the file only once, while tracing, and bake its values into
    the compiled function: load before calling the compiled step,
    `eqstate.assign(eqstate.load(path, model))`. The file is read part by part,
    each part only once the parts before it have vouched for its size, so a large
    file that is not a checkpoint costs a few bytes of reading.

    !!! Example

        ```python
        import os
        import tempfile

        import eqstate as es
        import jax.numpy as jnp

        def build():
            return [es.ParamState(jnp.zeros(2)), es.ShortTermState(jnp.array(0))]

        old = build()
        es.assign({old[0]: jnp.array([1.0, 2.0]), old[1]: 7})
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "ckpt.eqstate")
            es.save(path, es.values_of(old), model=old)
            new = build()  # new handles: matched to the file by path
            es.assign(es.load(path, new))
        assert (new[0].value == jnp.array([1.0, 2.0])).all() and new[1].value == 7
        ```
    """
    refuse_under_transforms("load", _LOAD_FIX)
    path = os.fspath(path)
    if resolve_backend(backend, path, "load") == "orbax":
        from ._orbax import load_orbax

        return load_orbax(path, model_or_states, model=model)
    expected, paths, target = load_target(model_or_states, model)
    specs = stored_leaves(paths, expected)
    entries, data = read_checkpoint(path)
    by_path = check_entries(path, target, [spec for spec, _ in specs], entries)

    arrays = []
    for spec, leaf in specs:
        with made_where(leaf):
            arrays.append(
                _placed_like(leaf, read_array(spec, by_path[spec.path], data))
            )
    return values_from_arrays(expected, specs, arrays, by_path)
