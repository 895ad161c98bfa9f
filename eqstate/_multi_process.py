"""What changes when a program runs as several JAX processes (`jax.distributed`): which
checkpoint backend is used, a clear error where eqstate would fetch a value that this
process holds only part of, and the agreement of every process on what a checkpoint
save holds, before the collectives of the save."""

import itertools
import json
import os
from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import jax

from ._errors import CheckpointError
from ._jax_compat import distributed_client
from ._pretty_print import first_and_more
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


# How long a process waits for the others to reach the same save; Orbax's own
# barriers wait as long.
AGREEMENT_TIMEOUT_S = 300
# Agreements are numbered in the order each process reaches them (callers hold the
# lock that orders saves): the n-th of one process meets the n-th of the others.
_ROUNDS = itertools.count()
_SAME_SAVES = (
    "Every process must make the same saves and loads, in the same order: each is "
    "one operation of all the processes together, each reading or writing its own "
    "shards."
)


def exchange(mine: Any, doing: str) -> list[Any]:
    """Every process's `mine` (JSON data), by process index: each process publishes
    its own through the coordination service of `jax.distributed` and waits for the
    others at a barrier, for at most `AGREEMENT_TIMEOUT_S`. `[mine]` in a single
    process, or where the service cannot be reached.

    **Raises:**

    `CheckpointError` if some process did not come within the time, saying that it
    was to `doing` (e.g. "save a checkpoint to '/run/ckpt'").
    """
    client = distributed_client()
    if jax.process_count() == 1 or client is None:
        return [mine]
    number, me = next(_ROUNDS), jax.process_index()
    prefix = f"eqstate/agreement/{number}/"
    client.key_value_set(prefix + str(me), json.dumps(mine))
    try:
        client.wait_at_barrier(prefix, AGREEMENT_TIMEOUT_S * 1000)
    except RuntimeError:  # JAX's error for a barrier that timed out
        raise CheckpointError(_not_reached(client, prefix, doing)) from None
    published = dict(client.key_value_dir_get(prefix))
    if number:  # Every process has read it, or it would not have reached this one.
        client.key_value_delete(f"eqstate/agreement/{number - 1}/{me}")
    return [json.loads(published[prefix + str(i)]) for i in range(jax.process_count())]


def _not_reached(client: Any, prefix: str, doing: str) -> str:
    came = {int(key.rsplit("/", 1)[1]) for key, _ in client.key_value_dir_get(prefix)}
    missing = [str(i) for i in range(jax.process_count()) if i not in came]
    if missing:
        who = "process" + ("es " if len(missing) > 1 else " ") + ", ".join(missing)
        what = f"{who} did not come to it within {AGREEMENT_TIMEOUT_S} s"
    else:
        what = "another process stopped waiting for this one to come to it"
    return (
        f"Cannot {doing}: {what}. {_SAME_SAVES} Nothing was written or removed. The "
        "processes are out of step now, so their later saves are refused too: "
        "restart them."
    )


def _array_text(entry: Sequence[Any]) -> str:
    _, shape, dtype = entry
    return f"shape {tuple(shape)}, dtype {dtype}"


def _what_differs(mine: dict, other: dict, i: int) -> str | None:
    """How process `i`'s save `other` differs from this process's `mine`, or None."""
    if other["step"] != mine["step"]:
        return f"process {i} saves step {other['step']} at the same time"
    if other["path"] != mine["path"]:
        return f"process {i} saves to {other['path']!r} at the same time"
    if other["entries"] == mine["entries"]:
        return None
    mine_by_path = {e[0]: e for e in mine["entries"]}
    other_by_path = {e[0]: e for e in other["entries"]}
    lines = []
    for where, held, missing in (
        (f"process {i}", other_by_path, mine_by_path),
        ("this process", mine_by_path, other_by_path),
    ):
        only = [
            f"`{p}` ({_array_text(e)})" for p, e in held.items() if p not in missing
        ]
        if only:
            lines.append(f"{where} alone saves {first_and_more(only)}")
    changed = [
        f"`{path}` has {_array_text(e)} in process {i}, "
        f"{_array_text(mine_by_path[path])} here"
        for path, e in other_by_path.items()
        if path in mine_by_path and e != mine_by_path[path]
    ]
    if changed:
        lines.append(first_and_more(changed, sep="; ", more="; and {} more"))
    return "the processes save different things: " + "; ".join(lines)


def agree_on_save(
    where: str, step: int | None, entries: list[Any], refusal: Exception | None
) -> None:
    """Makes every process raise, before any collective, unless each is making this
    same save: the same path and step, the same entries (paths, shapes and dtypes),
    and no process refused it. A process that refused raises its own error.

    **Arguments:**

    - `where`: the directory being written.
    - `step`: the step of a `CheckpointManager`'s save, else None.
    - `entries`: `(path, shape, dtype name)` of every array saved.
    - `refusal`: the error this process met while preparing the save, if any.
    """
    mine = {
        "path": os.path.abspath(where),
        "step": step,
        "entries": [[path, list(shape), dtype] for path, shape, dtype in entries],
        "refused": None if refusal is None else type(refusal).__name__,
    }
    every = exchange(mine, f"save a checkpoint to {where!r}")
    if refusal is not None:
        raise refusal
    for i, other in enumerate(every):
        if other["refused"] is not None:
            raise CheckpointError(
                f"Cannot save a checkpoint to {where!r}: process {i} refused to save "
                "there (see its error), so no process saves. Nothing was written or "
                "removed."
            )
    for i, other in enumerate(every):
        differs = _what_differs(mine, other, i)
        if differs is not None:
            raise CheckpointError(
                f"Cannot save a checkpoint to {where!r}: {differs}. {_SAME_SAVES} "
                "Build the model alike in every process: a state that only some "
                "processes hold (a process's own counter, say) has no place in a "
                "checkpoint they save together. Nothing was written or removed."
            )
