"""Sharded checkpoints on Orbax: every process writes only its own shards.

An eqstate Orbax checkpoint is a directory that Orbax's `CompositeCheckpointHandler`
writes, with two items:

- `state`: a flat dict `{path: array}` saved by Orbax's `PyTreeCheckpointHandler`,
    where `path` is the readable path of the single-file format
    (`layers.0.bn.running_mean`). PRNG keys are stored as their key data. Plain Orbax
    restores it without eqstate. A checkpoint of no arrays (no states, or values
    such as `{}`) has no `state` item: Orbax cannot save an empty PyTree.
- `eqstate`: JSON `{"format": "eqstate-orbax", "version": 2, "entries": [...],
    "entries_crc32": ...}`, one entry per array as in the single-file header
    (`path`, `dtype`, `shape`, `weak_type`, `key_impl` for keys) plus `checksum`: a
    64-bit checksum of the array's bytes, computed on the devices holding it;
    `entries_crc32` is the CRC32 of the entries' JSON (sorted keys, no spaces).
    Orbax and TensorStore check no array bytes (a flipped byte in a chunk loads as
    another value), so eqstate's checksum is what refuses a damaged array.

Orbax's own save replaces a checkpoint already at its path by removing it first:
`save_orbax` writes beside the path and swaps the new checkpoint in, so that a failed
save leaves the old one. `orbax-checkpoint` is imported only when a function here runs.
"""

import contextlib
import functools as ft
import importlib
import json
import os
import shutil
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from ._checkpoint_paths import (
    as_loaded,
    check_entries,
    check_savable,
    Leaf,
    leaves_to_save,
    Target,
    target_sharding,
)
from ._custom_types import PyTree
from ._errors import CheckpointError
from ._multi_process import agree_on_save, exchange
from ._pretty_print import first_and_more
from ._shapes import is_key


_FORMAT = "eqstate-orbax"
_VERSION = 2
_STATE_ITEM = "state"
_META_ITEM = "eqstate"

_MISSING_ORBAX = (
    "{what} needs the optional dependency `orbax-checkpoint`, which is not installed. "
    "Install it with `pip install 'eqstate[orbax]'`. (In a single process, "
    "`eqstate.save` and `eqstate.load` can use the single-file format instead, with "
    "`backend='single-file'`.)"
)


def orbax(what: str) -> Any:
    """The `orbax.checkpoint` module, or an `ImportError` saying how to install it."""
    try:
        ocp = importlib.import_module("orbax.checkpoint")
    except ImportError as e:
        raise ImportError(_MISSING_ORBAX.format(what=what)) from e
    _use_distributed_barriers()
    return ocp


def _use_distributed_barriers() -> None:
    """Makes Orbax synchronise processes through the `jax.distributed` service, as
    its flag `--experimental_orbax_use_distributed_barrier` does, unless a command
    line set that flag. Orbax's default barrier is a computation with collectives on
    every device; run from its background threads while the training loop's steps
    run theirs, the two interleave differently on each process and deadlock (seen
    with JAX 0.10 on CPU, in the first async save of a training run)."""
    from absl import flags

    name = "experimental_orbax_use_distributed_barrier"
    flag = flags.FLAGS[name] if name in flags.FLAGS else None
    if flag is not None and not flag.present:
        flag.value = True
        flag.present = 1


# Checksums ---------------------------------------------------------------------------


def _words(x: jax.Array) -> jax.Array:
    """The bytes of every element of `x` as `uint32` words (exact, no rounding)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size >= 4:
        # 8-byte elements become a trailing axis of two words.
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    narrow = {2: jnp.uint16, 1: jnp.uint8}[size]
    return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)


def _flat_index(words: jax.Array) -> jax.Array:
    """The row-major position of each element of `words` modulo 2**32, in an array
    of its shape and sharding: the `iota` of `words.reshape(-1)`, without that
    reshape. On a mesh with Explicit axes JAX refuses a reshape that merges a
    sharded axis into an unsharded one, and on any mesh it would move the data."""
    sharding = jax.typeof(words).sharding
    index = jnp.zeros(words.shape, jnp.uint32, out_sharding=sharding)
    stride = 1
    for axis in reversed(range(words.ndim)):
        along = jax.lax.broadcasted_iota(
            jnp.uint32, words.shape, axis, out_sharding=sharding
        )
        index = index + along * np.uint32(stride % 2**32)
        stride *= words.shape[axis]
    return index


_SEEDS = (np.uint32(0x243F6A88), np.uint32(0x85A308D3))


def _mixed(h: jax.Array) -> jax.Array:
    """A bijection of `uint32` words that spreads each input bit over every output
    bit (MurmurHash3's finaliser)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _checksum(x: jax.Array) -> jax.Array:
    """A 64-bit checksum of `x`'s bytes, as two `uint32` halves: for each half, the
    sum modulo 2**32 of a hash of each word and its row-major position, with a
    seed of its own. Integer addition is exact in any order, so the sum is the same
    however `x` is sharded. Each word's hash is a bijection of the word, so a change
    confined to one word always changes both halves; changes in several words cancel
    out only by chance (about 2**-64), not by a pattern such as two sign flips."""
    words = _words(x)
    index = _flat_index(words)
    halves = []
    for seed in _SEEDS:
        hashes = _mixed(words + _mixed(index ^ seed))
        halves.append(jnp.sum(hashes, dtype=jnp.uint32))
    return jnp.stack(halves)


@jax.jit
def _checksums(arrays: list[jax.Array]) -> list[jax.Array]:
    return [_checksum(x) for x in arrays]


def _device_group(x: jax.Array) -> Any:
    return frozenset(x.sharding.device_set) if x.committed else None


def checksums(arrays: list[jax.Array]) -> list[int]:
    """The checksum of each array, computed on the devices holding it (one compiled
    call per set of devices: a single call for a model placed on one mesh), as a
    Python int: the two halves, high half first."""
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(arrays):
        groups.setdefault(_device_group(x), []).append(i)
    out: list[int] = [0] * len(arrays)
    for indices in groups.values():
        # Each result is a replicated pair, which every process can read.
        for i, value in zip(indices, _checksums([arrays[i] for i in indices])):
            high, low = np.asarray(value).tolist()
            out[i] = high << 32 | low
    return out


# Saving ------------------------------------------------------------------------------


def _stored_array(spec: Leaf, leaf: Any) -> Any:
    check_savable(spec, leaf)
    return jax.random.key_data(leaf) if spec.key_impl is not None else leaf


def save_args(
    ocp: Any, where: str, step: int | None, prepare: Callable[[], list]
) -> Any:
    """Orbax's save arguments for the arrays `prepare()` returns, with their paths,
    once every process has agreed to make this same save: a refusal in one process
    (by `prepare`, or of what Orbax cannot save) is a refusal in all, and processes
    saving different things raise, before any collective."""
    try:
        leaves = prepare()
        arrays = [_stored_array(spec, leaf) for spec, leaf in leaves]
        _refuse_what_orbax_cannot_save(leaves)
        _refuse_paths_orbax_merges(leaves)
        refusal = None
    except Exception as error:  # Every process must learn of it, whatever it is.
        leaves, arrays, refusal = [], [], error
    described = [(spec.path, spec.shape, spec.dtype.name) for spec, _ in leaves]
    agree_on_save(where, step, described, refusal)
    sums = checksums([jnp.asarray(x) for x in arrays])
    _refuse_values_that_differ_across_processes(where, leaves, arrays, sums)
    entries: list[dict[str, Any]] = []
    tree: dict[str, Any] = {}
    for (spec, _), array, checksum in zip(leaves, arrays, sums):
        entry: dict[str, Any] = {
            "path": spec.path,
            "dtype": spec.dtype.name,
            "shape": list(spec.shape),
            "weak_type": spec.weak_type,
            "checksum": checksum,
        }
        if spec.key_impl is not None:
            entry["key_impl"] = spec.key_impl
        entries.append(entry)
        if spec.numpy or (jax.process_count() > 1 and _is_process_local(array)):
            # A process-local value is the same on every process (they run the same
            # program): Orbax saves NumPy arrays from the first process only. (It
            # has no type for NumPy scalars.)
            array = np.asarray(array)
        tree[spec.path] = array
    meta = {
        "format": _FORMAT,
        "version": _VERSION,
        "entries": entries,
        "entries_crc32": _entries_crc32(entries),
    }
    items = {_META_ITEM: ocp.args.JsonSave(meta)}
    if tree:
        # Orbax refuses an empty PyTree only once it has removed the checkpoint it
        # replaces: a checkpoint of no arrays (no states, or values such as `{}`)
        # has no `state` item.
        items[_STATE_ITEM] = ocp.args.PyTreeSave(tree)
    return ocp.args.Composite(**items)


def _is_process_local(x: Any) -> bool:
    return not isinstance(x, jax.Array) or x.is_fully_addressable


def _refuse_values_that_differ_across_processes(
    where: str, leaves: list, arrays: list[Any], sums: list[int]
) -> None:
    """Raises `CheckpointError` if an array has another value in some process, by its
    checksum: the checkpoint would keep process 0's, and every other process would
    load it as its own. Either each process holds it apart (a random state seeded by
    rank, a data loader's position), or it is one array across the processes whose
    copies differ (such a value written by a jitted step: JAX takes a value each
    process holds apart as one that every process holds alike). The checksum of one
    array across the processes is computed by them together, and is the same in each
    unless their copies differ. Every process publishes its checksums, and all raise
    alike."""
    every = exchange(sums, f"save a checkpoint to {where!r}")
    differs = [
        i for i, checksum in enumerate(sums) if any(o[i] != checksum for o in every)
    ]
    if not differs:
        return
    spec, _ = leaves[differs[0]]
    if _is_process_local(arrays[differs[0]]):
        how = "each holds its own (not one array across them)"
    else:
        how = (
            "it is one array across them, but their copies differ (a jitted step "
            "wrote it from values that differed: JAX takes a value each process "
            "holds apart as one they all hold alike)"
        )
    raise CheckpointError(
        f"The value at {spec.path!r} differs between processes: {how}, and a "
        "checkpoint keeps one value per state, process 0's, which every process "
        "would load. Give every process the same value (seed a `RandomState` alike "
        "in every process), or hold one value per process in an array across them "
        "(`jax.make_array_from_process_local_data`). Nothing was written."
    )


def _bits(dtype: np.dtype) -> int:
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.finfo(dtype).bits
    return dtype.itemsize * 8


def _has_tensorstore_type(dtype: np.dtype) -> bool:
    """Whether TensorStore, which writes Orbax's arrays, has a type for `dtype`."""
    try:
        importlib.import_module("tensorstore").dtype(dtype.name)
    except (TypeError, ValueError):
        return False
    return True


def _refuse_what_orbax_cannot_save(leaves: list[tuple[Leaf, Any]]) -> None:
    """Raises `CheckpointError`, before anything is written or removed, for an array
    with no elements, of a dtype narrower than a byte (`int4`, `float4_e2m1fn`) or
    of one TensorStore has no type for (`float8_e4m3`): Orbax cannot save those."""
    convert = "convert the value first, e.g. to `int8` or `bfloat16`"
    for spec, _ in leaves:
        if 0 in spec.shape:
            why, fix = "arrays with no elements", "leave the empty state out"
        elif (bits := _bits(spec.dtype)) < 8:
            why = f"dtypes narrower than a byte ({spec.dtype} has {bits} bits)"
            fix = convert
        elif not _has_tensorstore_type(spec.dtype):
            why = f"{spec.dtype}, for which TensorStore has no type"
            fix = convert
        else:
            continue
        raise CheckpointError(
            f"Cannot save entry `{spec.path}` (shape {tuple(spec.shape)}, dtype "
            f"{spec.dtype}) of {spec.label} with the Orbax backend: "
            f"Orbax cannot save {why}. Nothing was written or removed. Save with "
            f"`backend='single-file'`, which stores it bit for bit, or {fix}."
        )


def _refuse_paths_orbax_merges(leaves: list[tuple[Leaf, Any]]) -> None:
    """Raises `CheckpointError`, before anything is written or removed, for two
    entries whose paths differ only by a trailing `/` (dict keys `'x'` and `'x/'`):
    Orbax stores both under the path without it, one array over the other."""
    seen: dict[str, Leaf] = {}
    for spec, _ in leaves:
        stored = spec.path[:-1] if spec.path.endswith("/") else spec.path
        other = seen.setdefault(stored, spec)
        if other is not spec:
            raise CheckpointError(
                f"Cannot save entries `{other.path}` (of {other.label}) "
                f"and `{spec.path}` (of {spec.label}) with the Orbax "
                f"backend: Orbax drops a path's trailing '/', so it would store both "
                f"under `{stored}`, one over the other. Nothing was written or "
                "removed. Rename one of the keys, or save with "
                "`backend='single-file'`, which keeps them apart."
            )


_NOT_A_CHECKPOINT = (
    "Cannot save {checkpoint} to {path!r}: it is {what}, not an Orbax checkpoint. "
    "Orbax replaces what is at the path whole, so saving would delete it. Nothing "
    "was written or removed. {fix}."
)
_FILE_FIX = (
    "Save to a new path, or with `backend='single-file'` to replace a single-file "
    "checkpoint"
)
_DIRECTORY_FIX = (
    "Save to a new path, e.g. a subdirectory `os.path.join(path, 'checkpoint')`, or "
    "keep a series of checkpoints in the directory with "
    "`eqstate.CheckpointManager(path)`"
)
# Orbax writes this file into every checkpoint it commits.
CHECKPOINT_FILE = "_CHECKPOINT_METADATA"


def refuse_to_replace(
    path: str,
    checkpoint: str = "an Orbax checkpoint",
    fixes: tuple[str, str] = (_FILE_FIX, _DIRECTORY_FIX),
) -> None:
    """Raises `CheckpointError` if `path` holds something that is not an Orbax
    checkpoint (or an empty directory), which Orbax would remove before writing.

    **Arguments:**

    - `path`: where Orbax is about to write.
    - `checkpoint`: what is being saved, for the message.
    - `fixes`: what to do instead when `path` is a file, and when it is a directory.
    """
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        what = "a file" if os.path.exists(path) else "a broken symlink"
        raise CheckpointError(
            _NOT_A_CHECKPOINT.format(
                checkpoint=checkpoint, path=path, what=what, fix=fixes[0]
            )
        )
    held = sorted(os.listdir(path))
    if held and not os.path.isfile(os.path.join(path, CHECKPOINT_FILE)):
        shown = first_and_more(repr(name) for name in held)
        raise CheckpointError(
            _NOT_A_CHECKPOINT.format(
                checkpoint=checkpoint,
                path=path,
                what=f"a directory holding {shown}",
                fix=fixes[1],
            )
        )


# Orbax numbers each save from one counter shared by the whole process, and the
# save's later steps read the number back: two saves started at once from two
# threads write into each other's temporary directories, fail, and leave the paths
# they replaced empty. Every Orbax save eqstate starts holds this lock until Orbax's
# call returns. A save in the background goes on in Orbax's threads without it
# (they took the save's number when it started), so waiting for one while holding
# the lock, as a manager's next save does, cannot deadlock.
SAVING = threading.Lock()


@contextlib.contextmanager
def orbax_write_errors(where: str) -> Iterator[None]:
    """Turns an `OSError` of Orbax's into `CheckpointError`."""
    try:
        yield
    except OSError as e:
        raise CheckpointError(
            f"Cannot save a checkpoint to {where!r}: Orbax failed to write it "
            f"({type(e).__name__}: {e}). Check that the directory is writable and "
            "the disk has space."
        ) from e


# A save writes the new checkpoint here, beside `path`, and moves the checkpoint it
# replaces here while it swaps the two (Orbax removes a directory before it writes
# one in its place, so a failed save would lose it).
_STAGING = ".eqstate-saving"
_REPLACED = ".eqstate-replaced"


def save_orbax(path: str, model_or_states: PyTree, model: PyTree | None) -> None:
    """`eqstate.save(path, model_or_states, model=model, backend='orbax')`."""
    ocp = orbax("Saving a checkpoint with the Orbax backend")

    def prepare() -> list:
        refuse_to_replace(path)
        return leaves_to_save(model_or_states, model)

    with SAVING:
        args = save_args(ocp, path, None, prepare)
        # Through a symlink, the directory it leads to is replaced and the link stays.
        target = os.path.realpath(path)
        with orbax_write_errors(path):
            _write_and_swap_in(ocp, target, args)


def _write_and_swap_in(ocp: Any, target: str, args: Any) -> None:
    """Writes the checkpoint at `target + _STAGING`, then process 0 moves it to
    `target`, replacing what is there. Until the new one is in place, the old one is
    at `target` or, between the two renames, at `target + _REPLACED`. Every process
    then waits for the others (a failure in one is a failure in all), also after a
    failure of its own, so that none waits for it in vain."""
    failure: Exception | None = None
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            checkpointer.save(target + _STAGING, args=args, force=True)
        if jax.process_index() == 0:
            replaced = target + _REPLACED
            if os.path.lexists(target):
                if os.path.lexists(replaced):
                    shutil.rmtree(replaced)
                os.rename(target, replaced)
            os.rename(target + _STAGING, target)
            if os.path.lexists(replaced):
                shutil.rmtree(replaced)
    except Exception as error:  # Every process must learn of it, whatever it is.
        failure = error
    failed = exchange(failure is not None, f"save a checkpoint to {target!r}")
    if failure is not None:
        raise failure
    if any(failed):
        raise CheckpointError(
            f"Cannot save a checkpoint to {target!r}: process {failed.index(True)} "
            "failed to write it (see its error). Check that every process can write "
            "there and the disk has space."
        )


# Loading -----------------------------------------------------------------------------


def _is_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("path"), str)
        and isinstance(entry.get("dtype"), str)
        and isinstance(entry.get("shape"), list)
    )


def _entries_crc32(entries: Any) -> int:
    """The CRC32 of the entries' canonical JSON, so that a bit flipped in a key name
    or a value of an entry is refused (a `weak_type` flipped by a bit would still
    be valid JSON)."""
    text = json.dumps(entries, sort_keys=True, separators=(",", ":"))
    return zlib.crc32(text.encode())


def _check_meta(where: str, meta: Any) -> list[dict[str, Any]]:
    if (
        not isinstance(meta, dict)
        or meta.get("format") != _FORMAT
        or not isinstance(meta.get("entries"), list)
        or not all(map(_is_entry, meta["entries"]))
    ):
        raise CheckpointError(
            f"{where!r} is an Orbax checkpoint, but not one written by `eqstate.save` "
            "or `eqstate.CheckpointManager`: its `eqstate` item is missing or "
            "malformed. Restore it with Orbax directly, or save it again with eqstate."
        )
    version = meta.get("version")
    if version != _VERSION:
        raise CheckpointError(
            f"{where!r} has eqstate's Orbax format version {version}, but this "
            f"version of eqstate reads only version {_VERSION}. Load it with the "
            "eqstate release that wrote it."
        )
    entries = meta["entries"]
    # Every entry eqstate wrote has a checksum (a bit flipped in its key name would
    # otherwise skip verifying that array), and so do the entries themselves.
    if not all(type(entry.get("checksum")) is int for entry in entries) or (
        meta.get("entries_crc32") != _entries_crc32(entries)
    ):
        raise CheckpointError(
            f"The checkpoint {where!r} is corrupted: its `eqstate` item, which "
            "describes each array, does not match its checksums. Its files were "
            "changed after they were written (a disk or transfer error); copy it "
            "again or use an earlier checkpoint."
        )
    return entries


def _place_directly(leaf: Any) -> bool:
    """Whether a target value's sharding can be handed to Orbax: each process then
    reads only its own shards. Other values are read whole, as NumPy arrays, and
    placed afterwards (see `target_sharding`)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = target_sharding(leaf)
        # Abstract keys: the sharding of their key data is not at hand.
        if sharding is None or is_key(leaf):
            return False
        return not sharding.is_fully_addressable or jax.process_count() == 1
    if not isinstance(leaf, jax.Array) or isinstance(leaf, Tracer):
        return False
    if not leaf.is_fully_addressable:
        return True
    return leaf.committed and jax.process_count() == 1


def _restore_args(ocp: Any, specs: list[tuple[Leaf, Any]]) -> dict[str, Any]:
    args = {}
    for spec, leaf in specs:
        if _place_directly(leaf):
            if isinstance(leaf, jax.ShapeDtypeStruct):
                sharding = leaf.sharding
            elif spec.key_impl is not None:
                sharding = jax.random.key_data(leaf).sharding
            else:
                sharding = leaf.sharding
            args[spec.path] = ocp.ArrayRestoreArgs(
                sharding=sharding, global_shape=spec.shape, dtype=spec.dtype
            )
        else:
            args[spec.path] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=spec.dtype)
    return args


def _verify(where: str, specs: list[tuple[Leaf, Any]], stored: dict, by_path: dict):
    paths = [spec.path for spec, _ in specs]
    arrays = [jnp.asarray(stored[path]) for path in paths]
    for path, found in zip(paths, checksums(arrays)):
        entry = by_path[path]
        if found != entry["checksum"]:
            raise CheckpointError(
                f"The checkpoint {where!r} is corrupted: the values of entry `{path}` "
                f"(shape {tuple(entry['shape'])}, dtype {entry['dtype']}) do not match "
                "their checksum. Its files were changed after they were written (a "
                "disk or transfer error); copy it again or use an earlier checkpoint."
            )


def restore_with(
    restore: Callable[[Any], Any], where: str, target: Target
) -> tuple[list[Any], dict[str, Any]]:
    """The arrays for `target.specs` and eqstate's entries by path, read through
    `restore(args)`, an Orbax restore call of one checkpoint: checks the entries
    against the target, restores each array onto the target's sharding, and
    verifies the checksums."""
    ocp = orbax("Loading an Orbax checkpoint")
    specs = target.specs
    try:
        meta = restore(ocp.args.Composite(**{_META_ITEM: ocp.args.JsonRestore()}))
    except (KeyError, FileNotFoundError, ValueError):
        meta = {_META_ITEM: None}  # not an eqstate checkpoint: refused just below
    entries = _check_meta(where, meta[_META_ITEM])
    by_path = check_entries(where, target.name, [spec for spec, _ in specs], entries)
    if not specs:  # Nothing to read: a checkpoint of no arrays has no `state` item.
        return [], by_path
    args = ocp.args.PyTreeRestore(restore_args=_restore_args(ocp, specs))
    try:
        stored = restore(ocp.args.Composite(**{_STATE_ITEM: args}))[_STATE_ITEM]
    except Exception as e:  # Orbax and TensorStore raise many kinds for bad files.
        raise CheckpointError(
            f"Cannot read the arrays of the checkpoint {where!r}: Orbax failed to "
            f"restore them ({type(e).__name__}: {e}). Its files are damaged or "
            "incomplete (changed or cut short after they were written); copy it "
            "again or use an earlier checkpoint."
        ) from e
    _verify(where, specs, stored, by_path)
    return [as_loaded(spec, leaf, stored[spec.path]) for spec, leaf in specs], by_path


def load_orbax(path: str, target: Target) -> tuple[list[Any], dict[str, Any]]:
    """`eqstate.load(path, ..., backend='orbax')`: the arrays for `target.specs`,
    and the checkpoint's entries by path."""
    ocp = orbax("Loading an Orbax checkpoint")
    if not os.path.isdir(path):
        raise CheckpointError(f"No Orbax checkpoint at {path!r}: " + _why_none(path))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        restore = ft.partial(checkpointer.restore, os.path.abspath(path))
        return restore_with(lambda args: restore(args=args), path, target)


def _why_none(path: str) -> str:
    """Why `path`, which is not a directory, holds no Orbax checkpoint."""
    if os.path.exists(path):
        return "it is a file. Load it with `backend='single-file'` (or no backend)."
    if os.path.isdir(path + _REPLACED):
        return (
            "a save that was replacing the checkpoint there stopped between two "
            f"renames. The checkpoint it replaced is at {path + _REPLACED!r}, the new "
            f"one at {path + _STAGING!r}: rename either to {path!r}."
        )
    return (
        "the directory does not exist. Check the path, or write one first with "
        "`eqstate.save`."
    )
