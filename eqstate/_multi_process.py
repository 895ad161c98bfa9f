"""What changes when a program runs as several JAX processes (`jax.distributed`): which
checkpoint backend is used, and a clear error where eqstate would fetch a value that
this process holds only part of."""

import os
from typing import Any, Literal, TypeAlias

import jax

from ._errors import CheckpointError
from ._shapes import is_key


Backend: TypeAlias = Literal["single-file", "orbax"]
_BACKENDS = ("single-file", "orbax")

NOT_ADDRESSABLE = (
    "Cannot {verb} {what}: its value is a global array split across the devices of "
    "{processes} processes ({sharding}), and this process holds only its own shards. "
    "{fix}"
)
GATHER_FIX = (
    "To get the whole value on every process, gather it first with "
    "`jax.experimental.multihost_utils.process_allgather(value, tiled=True)`."
)
SAVE_FIX = (
    "Save with the Orbax backend, where every process writes its own shards: "
    "`eqstate.save(path, states, backend='orbax')` (the default when "
    "`jax.process_count() > 1`; it needs `pip install 'eqstate[orbax]'`). " + GATHER_FIX
)


def is_orbax_checkpoint(path: str) -> bool:
    """Whether `path` is a directory written by Orbax (by `eqstate.save` or not)."""
    return os.path.isdir(path) and (
        os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA"))
        or os.path.isdir(os.path.join(path, "eqstate"))
    )


def resolve_backend(backend: str | None, path: str, verb: str) -> Backend:
    """The checkpoint backend to use. By default: Orbax to save from several processes
    (each writes its own shards), and to load a directory that Orbax wrote; the
    single-file format otherwise."""
    if backend is None:
        if verb == "save":
            return "orbax" if jax.process_count() > 1 else "single-file"
        return "orbax" if is_orbax_checkpoint(path) else "single-file"
    if backend not in _BACKENDS:
        raise ValueError(
            f"Unknown checkpoint backend {backend!r}: use 'single-file' (one file, the "
            "default in a single process), 'orbax' (a directory of shards, the default "
            "with several processes), or None to choose automatically."
        )
    return "orbax" if backend == "orbax" else "single-file"


def require_fully_addressable(value: Any, what: str, verb: str, fix: str) -> None:
    """Raises `CheckpointError` if this process cannot fetch the whole of `value`."""
    if (
        isinstance(value, jax.Array)
        and not value.is_fully_addressable
        and not value.is_fully_replicated
    ):
        raise CheckpointError(
            NOT_ADDRESSABLE.format(
                verb=verb,
                what=what,
                processes=jax.process_count(),
                sharding=value.sharding,
                fix=fix,
            )
        )


def _put_leaf(x: Any, sharding: Any) -> Any:
    if isinstance(x, jax.Array) and is_key(x):
        # JAX 0.10 cannot `device_put` a PRNG key array onto devices of other
        # processes; its key data (plain integers) it can.
        data = jax.device_put(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(x, sharding)


def device_put(value: Any, sharding: Any) -> Any:
    """`jax.device_put(value, sharding)` for a PyTree that may hold PRNG keys, which
    also works when `sharding` spans several processes."""
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    return jax.tree_util.tree_map(lambda x: _put_leaf(x, sharding), value)
