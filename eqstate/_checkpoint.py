"""Checkpoints: `save` and `load` store a model's arrays and its states' values by path,
in one file (`_checkpoint_file.py`) or, across processes, with Orbax (`_orbax.py`).
Both backends name and match entries as `_checkpoint_paths.py` says."""

import os
from collections.abc import Mapping
from typing import Any, overload, TypeVar

from ._checkpoint_file import read_into, write_checkpoint
from ._checkpoint_paths import leaves_to_save, load_target, loaded_into
from ._custom_types import PyTree
from ._errors import CheckpointError
from ._jax_compat import is_top_level
from ._multi_process import resolve_backend
from ._state import State
from ._state_dict import StateDict


_M = TypeVar("_M")

_UNDER_TRANSFORM = (
    "Cannot {verb} a checkpoint inside a JAX transform (`eqstate.transform.jit`, a "
    "loop or `vmap` body, `jax.jit`, ...): the file would be {why}. {what}:\n"
    "    {fix}"
)
_WHY = {
    "load": (
        "read once, while the function is traced, and the values it held then baked "
        "into the compiled function as constants, so later calls would not see a "
        "newer checkpoint",
        "Load outside the transform, before calling the compiled step",
    ),
    "save": (
        "written once, while the function is traced, and never by later calls",
        "Save outside the transform, after calling the compiled step",
    ),
}


def refuse_under_transforms(verb: str, fix: str) -> None:
    """Raises `CheckpointError` unless this runs at the top level of JAX tracing.
    `verb` is `"save"` or `"load"`; `fix` the code to write instead."""
    if not is_top_level():
        why, what = _WHY[verb]
        raise CheckpointError(
            _UNDER_TRANSFORM.format(verb=verb, why=why, what=what, fix=fix)
        )


def save(
    path: str | os.PathLike[str],
    model_or_states: PyTree,
    *,
    model: PyTree | None = None,
    backend: str | None = None,
) -> None:
    """Saves a model, its arrays and the values of its states, to a checkpoint.

    `eqstate.save(path, model)` saves everything the model holds, by path: each of
    its own arrays (the weights of `eqx.nn` layers: every `eqx.is_array` leaf, JAX or
    NumPy) under its PyTree path, with dots between keys (`layers.0.linear.weight`),
    and each state's value under the path where the state sits
    (`layers.0.bn.running_mean`). `eqstate.save(path, states, model=model)` saves the
    values of chosen states alone. A value with several arrays stores one entry per
    array, its path extended by the array's place in the value: `opt.mu.0`. Every
    dtype round-trips bit for bit, including `bfloat16`, integers, booleans and
    typed PRNG keys. (A NumPy value of a state is saved as the JAX array made of it,
    as a write to a state converts it; with 64-bit types off, one that JAX's
    narrowing to 32 bits breaks, an integer that wraps or a float that becomes
    infinite or zero, is refused. A NumPy array of the model is saved as it is.) A
    value with no arrays (`{}`) has no entries and loads back as it was; so does an
    empty `StateDict`.

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
    - `model_or_states`: what to save. A model (an `eqx.Module`, or any PyTree of
        arrays and handles that is not a mapping of states): its arrays and its
        states' values. Or a [`eqstate.StateDict`][] (or a mapping from handles to
        values), e.g. `eqstate.values_of(model, eqstate.ParamState)`: those values
        alone.
    - `model`: only with a `StateDict`: a PyTree holding the handles, which gives
        each state its path, and so do the states keying a `StateDict` inside a
        value (an optimiser's moments), whether or not their own values are saved.
        It must hold no arrays, which the checkpoint would leave out: to save
        chosen states alone on purpose, pass `eqx.filter(model, eqstate.is_state)`.
        A state found at several places is stored under the first. If omitted,
        every state must have a unique name. (Keyword only argument.)
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

    [`eqstate.CheckpointError`][] if `model` holds arrays (saving the states alone
    would leave them out), if a state is not in `model`, if states lack unique
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
    `TypeError` if `model_or_states` holds neither arrays nor states, or if `model`
    is given with a model to save. Nothing is written or removed then.

    !!! Example

        ```python
        import os
        import tempfile

        import equinox as eqx
        import eqstate as es
        import jax.numpy as jnp
        import jax.random as jr

        def build(key):
            return {"linear": eqx.nn.Linear(2, 2, key=key), "n": es.State(jnp.array(0))}

        model = build(jr.key(0))
        model["n"].value = jnp.array(5)
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "model.eqstate")
            es.save(path, model)
            fresh = es.load(path, build(jr.key(1)))  # other weights until loaded
        assert (fresh["linear"].weight == model["linear"].weight).all()
        assert fresh["n"].value == 5
        ```
    """
    refuse_under_transforms("save", "step(x)\n    eqstate.save(path, model)")
    path = os.fspath(path)
    if resolve_backend(backend, path, "save") == "orbax":
        from ._orbax import save_orbax

        return save_orbax(path, model_or_states, model)
    write_checkpoint(path, leaves_to_save(model_or_states, model))


@overload
def load(
    path: str | os.PathLike[str],
    model_or_states: Mapping[State, PyTree],
    *,
    model: PyTree | None = None,
    backend: str | None = None,
) -> StateDict: ...


@overload
def load(
    path: str | os.PathLike[str], model_or_states: _M, *, backend: str | None = None
) -> _M: ...


def load(
    path: str | os.PathLike[str],
    model_or_states: Any,
    *,
    model: PyTree | None = None,
    backend: str | None = None,
) -> Any:
    """Loads a checkpoint written by [`eqstate.save`][] into a model, or into a
    `StateDict`.

    `model = eqstate.load(path, model)` returns the model with its arrays replaced by
    the checkpoint's and writes its states' values (to the innermost context, as
    `state.value = ...` would), as [`eqstate.apply_updates`][] returns the model and
    writes its states. `eqstate.load(path, states)` with a `StateDict` returns the
    loaded values of its states and writes nothing.

    Entries are matched by path, never by handle, so a checkpoint loads into a
    freshly built model whose handles are new. The file is read and checked whole
    before anything is returned or written: format, checksums, and that the
    checkpoint has exactly the arrays the target expects, with the shapes and
    dtypes of the target's current values.

    **Arguments:**

    - `path`: the checkpoint file.
    - `model_or_states`: the target. Either a model (a PyTree of arrays and
        handles: its arrays and states take their paths from where they sit in it,
        as when it was saved), or a [`eqstate.StateDict`][] (whose states take their
        paths from their names, or from `model`). The target's current values give
        the expected shapes and dtypes.
    - `model`: only with a `StateDict` target: a PyTree holding its states, to take
        their paths from (and those of the states keying a `StateDict` inside a
        value, as when saving). This loads a checkpoint saved with
        `save(path, states, model=model)` where `states` is part of the model's
        states, e.g. only its parameters. (Keyword only argument.)
    - `backend`: `"single-file"`, `"orbax"`, or `None` to tell from `path`: a
        directory that Orbax wrote is read with Orbax, each process reading only the
        shards its devices hold. (Keyword only argument.)

    **Returns:**

    For a model, the model with its arrays loaded (its states' values are written).
    For a `StateDict`, a `StateDict` from its handles to the loaded values. Each
    loaded array is placed like the target's current value: on its sharding if it is
    committed to devices, else uncommitted on its device (one made under
    `jax.default_device`, say, stays on that device), so that jitted functions do
    not compile again; a NumPy array of the model comes back as a NumPy array. The
    target may hold abstract values (`jax.ShapeDtypeStruct`, as
    [`eqstate.transform.eval_shape`][] returns), typed PRNG keys included: each is
    loaded onto its `sharding` if it has one.

    **Raises:**

    [`eqstate.CheckpointError`][] if the file is missing or unreadable, is not an
    eqstate checkpoint, has an unknown format version, is truncated, malformed or
    corrupted (a checksum does not match), lacks a path the target needs (a
    checkpoint of a model's states alone lacks its arrays) or holds one it does not
    have, or holds an array whose shape or dtype differs from the target's; or if
    called inside a JAX transform (`jit`, a loop body, `vmap`), which would read the
    file only once, while tracing, and bake its values into the compiled function:
    load before calling the compiled step, `model = eqstate.load(path, model)`.
    Nothing is written then. The file is read part by part, each part only once the
    parts before it have vouched for its size, so a large file that is not a
    checkpoint costs a few bytes of reading.

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
            es.save(path, old)
            new = es.load(path, build())  # new handles: matched to the file by path
            # Into a StateDict (paths from `model=`): returns values, writes nothing.
            states = es.load(path, es.values_of(new), model=new)
        assert (new[0].value == jnp.array([1.0, 2.0])).all() and new[1].value == 7
        assert states[new[1]] == 7
        ```
    """
    refuse_under_transforms("load", "model = eqstate.load(path, model)\n    step(x)")
    path = os.fspath(path)
    target = load_target(model_or_states, model)
    if resolve_backend(backend, path, "load") == "orbax":
        from ._orbax import load_orbax

        return loaded_into(target, *load_orbax(path, target))
    return loaded_into(target, *read_into(path, target))
