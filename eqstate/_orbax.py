"""Sharded checkpoints on Orbax: every process writes only its own shards.

An eqstate Orbax checkpoint is a directory that Orbax's `CompositeCheckpointHandler`
writes, with two items:

- `state`: a flat dict `{path: array}` saved by Orbax's `PyTreeCheckpointHandler`,
    where `path` is the readable state path of the single-file format
    (`layers.0.bn.running_mean`). PRNG keys are stored as their key data. Plain Orbax
    restores it without eqstate. A checkpoint of no arrays (no states, or values
    such as `{}`) has no `state` item: Orbax cannot save an empty PyTree.
- `eqstate`: JSON `{"format": "eqstate-orbax", "version": 2, "entries": [...],
    "entries_crc32": ...}`, one entry per array as in the single-file header
    (`path`, `dtype`, `shape`, `weak_type`, `key_impl` for keys) plus `checksum`: a
    64-bit checksum of the array's bytes, computed on the devices, so that a
    corrupted shard is refused on restore as the single-file format refuses a
    corrupted file; `entries_crc32` is the CRC32 of the entries' JSON (sorted keys,
    no spaces). Version 1, still read, had 32-bit checksums (see `_checksum_v1`) and
    no `entries_crc32`.

`orbax-checkpoint` is imported only when one of these functions runs.
"""

import contextlib
import functools as ft
import gc
import importlib
import itertools
import json
import operator
import os
import queue
import shutil
import sys
import threading
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, overload, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jaxtyping import PyTree

from ._checkpoint_checks import check_savable, refuse_under_transforms
from ._checkpoint_match import (
    check_entries,
    leaves_to_save,
    load_target,
    loaded_into,
    Target,
)
from ._checkpoint_paths import Leaf, made_where, target_sharding, values_from_arrays
from ._errors import CheckpointError
from ._multi_process import agree_on_save, device_put, exchange
from ._pretty_print import first_and_more
from ._shapes import is_key
from ._state import State
from ._state_dict import StateDict


_M = TypeVar("_M")

_FORMAT = "eqstate-orbax"
_VERSION = 2
# Version 1 had 32-bit checksums that two changes could cancel, and no checksum of
# the entries themselves; it is still read.
_READABLE = (1, 2)
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

_GOLDEN = np.uint32(0x9E3779B1)


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


def _checksum_v1(x: jax.Array) -> jax.Array:
    """The checksum of format version 1, kept to verify such checkpoints: the sum of
    `x`'s words, each times an odd weight that depends on its position, modulo
    2**32. A change confined to one word always changes it, but changes in two words
    can cancel out (flipping the top bit of any two words does)."""
    words = _words(x)
    weights = _flat_index(words) * _GOLDEN * np.uint32(2) + np.uint32(1)
    return jnp.sum(words * weights, dtype=jnp.uint32)


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


@ft.partial(jax.jit, static_argnums=0)
def _checksums(version: int, arrays: list[jax.Array]) -> list[jax.Array]:
    checksum = _checksum if version == _VERSION else _checksum_v1
    return [checksum(x) for x in arrays]


def _device_group(x: jax.Array) -> Any:
    return frozenset(x.sharding.device_set) if x.committed else None


def checksums(arrays: list[jax.Array], version: int = _VERSION) -> list[int]:
    """The checksum of each array for checkpoints of format `version`, computed on
    the devices holding it: one compiled call per set of devices (a single call for
    a model placed on one mesh)."""
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(arrays):
        groups.setdefault(_device_group(x), []).append(i)
    out: list[int] = [0] * len(arrays)
    for indices in groups.values():
        # Each result is a replicated scalar, which every process can read.
        values = _checksums(version, [arrays[i] for i in indices])
        for i, value in zip(indices, values):
            out[i] = _as_int(np.asarray(value))
    return out


def _as_int(checksum: np.ndarray) -> int:
    """A checksum as one Python int: version 2's two halves, high half first."""
    if checksum.ndim == 0:
        return int(checksum)
    high, low = (int(h) for h in checksum)
    return high << 32 | low


# Saving ------------------------------------------------------------------------------


def _stored_array(spec: Leaf, leaf: Any) -> Any:
    check_savable(spec, leaf)
    return jax.random.key_data(leaf) if spec.key_impl is not None else leaf


def _save_args(
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


def _process_0s(step: int | None) -> int | None:
    """Process 0's `step` (a non-negative integer or `None`), in every process."""
    if jax.process_count() == 1:
        return step
    from jax.experimental import multihost_utils

    # Two int32 words: 64-bit types may be off.
    words = divmod(0 if step is None else step + 1, 2**30)
    high, low = np.asarray(
        multihost_utils.broadcast_one_to_all(np.array(words, np.int32))
    ).tolist()
    agreed = high * 2**30 + low
    return None if agreed == 0 else agreed - 1


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
_CHECKPOINT_FILE = "_CHECKPOINT_METADATA"


def _refuse_to_replace(
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
    if held and not os.path.isfile(os.path.join(path, _CHECKPOINT_FILE)):
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
_SAVING = threading.Lock()


@contextlib.contextmanager
def _orbax_write_errors(where: str) -> Iterator[None]:
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
_SWAPS = itertools.count()


def save_orbax(path: str, model_or_states: PyTree, model: PyTree | None) -> None:
    """`eqstate.save(path, model_or_states, model=model, backend='orbax')`."""
    ocp = orbax("Saving a checkpoint with the Orbax backend")
    with _SAVING:
        # Numbered in the order in which saves take the lock (saves from several
        # threads), and before anything can fail: a save that fails in some
        # processes only still takes its number there. So later saves' barriers
        # keep matching across processes.
        number = next(_SWAPS)

        def prepare() -> list:
            _refuse_to_replace(path)
            return leaves_to_save(model_or_states, model)

        args = _save_args(ocp, path, None, prepare)
        # Through a symlink, the directory it leads to is replaced and the link stays.
        target = os.path.realpath(path)
        with _orbax_write_errors(path):
            with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
                checkpointer.save(target + _STAGING, args=args, force=True)
            _swap_in(ocp, target, number)


def _swap_in(ocp: Any, target: str, number: int) -> None:
    """Moves the checkpoint written at `target + _STAGING` to `target`, replacing
    what is there (process 0 alone, the others waiting for it). Until the new one is
    in place, the old one is at `target` or, for the two renames between, at
    `target + _REPLACED`."""
    try:
        if ocp.multihost.is_primary_host(0):
            replaced = target + _REPLACED
            if os.path.lexists(target):
                if os.path.lexists(replaced):
                    shutil.rmtree(replaced)
                os.rename(target, replaced)
            os.rename(target + _STAGING, target)
            if os.path.lexists(replaced):
                shutil.rmtree(replaced)
    finally:
        # Reached by process 0 also when a rename fails, so that no process waits
        # for it until the barrier times out.
        ocp.multihost.sync_global_processes(f"eqstate_save_swap_{number}")


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


def _check_meta(where: str, meta: Any) -> tuple[list[dict[str, Any]], int]:
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
    if type(version) is not int or version not in _READABLE:
        raise CheckpointError(
            f"{where!r} has eqstate's Orbax format version {version}, but this "
            f"version of eqstate reads only versions {', '.join(map(str, _READABLE))}."
            " Load it with the eqstate release that wrote it."
        )
    entries = meta["entries"]
    # Every entry eqstate wrote has a checksum (a bit flipped in its key name would
    # otherwise skip verifying that array); version 2 also has one of the entries.
    if not all(type(entry.get("checksum")) is int for entry in entries) or (
        version >= 2 and meta.get("entries_crc32") != _entries_crc32(entries)
    ):
        raise CheckpointError(
            f"The checkpoint {where!r} is corrupted: its `eqstate` item, which "
            "describes each array, does not match its checksums. Its files were "
            "changed after they were written (a disk or transfer error); copy it "
            "again or use an earlier checkpoint."
        )
    return entries, version


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


def _value(spec: Leaf, leaf: Any, stored: Any) -> Any:
    if spec.numpy:
        return stored
    with made_where(leaf):
        value = jnp.asarray(stored)
        if spec.key_impl is not None:
            value = jax.random.wrap_key_data(value, impl=spec.key_impl)
    if isinstance(stored, np.ndarray) and (sharding := target_sharding(leaf)):
        # As in the single-file format: only values tied to devices are placed.
        value = device_put(value, sharding)
    return value


def _verify(
    where: str,
    specs: list[tuple[Leaf, Any]],
    stored: dict,
    by_path: dict,
    version: int,
) -> None:
    paths = [spec.path for spec, _ in specs]
    arrays = [jnp.asarray(stored[path]) for path in paths]
    for path, found in zip(paths, checksums(arrays, version)):
        entry = by_path[path]
        if found != entry["checksum"]:
            raise CheckpointError(
                f"The checkpoint {where!r} is corrupted: the values of entry `{path}` "
                f"(shape {tuple(entry['shape'])}, dtype {entry['dtype']}) do not match "
                "their checksum. Its files were changed after they were written (a "
                "disk or transfer error); copy it again or use an earlier checkpoint."
            )


def restore_with(restore: Any, where: str, target: Target) -> dict[Any, PyTree]:
    """The values of `target.expected`, read through `restore(args)`, an Orbax
    restore call of one checkpoint: reads eqstate's entries, checks them against the
    target, restores each array onto the target's sharding, and verifies the
    checksums."""
    ocp = orbax("Loading an Orbax checkpoint")
    expected, specs = target.expected, target.specs
    try:
        meta = restore(ocp.args.Composite(**{_META_ITEM: ocp.args.JsonRestore()}))
    except (KeyError, FileNotFoundError, ValueError):
        meta = {_META_ITEM: None}  # not an eqstate checkpoint: refused just below
    entries, version = _check_meta(where, meta[_META_ITEM])
    by_path = check_entries(where, target.name, [spec for spec, _ in specs], entries)
    if not specs:  # Nothing to read: a checkpoint of no arrays has no `state` item.
        return values_from_arrays(expected, [], [], by_path)
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
    _verify(where, specs, stored, by_path, version)
    arrays = [_value(spec, leaf, stored[spec.path]) for spec, leaf in specs]
    return values_from_arrays(expected, specs, arrays, by_path)


def load_orbax(path: str, target: Target) -> dict[Any, PyTree]:
    """`eqstate.load(path, ..., backend='orbax')`: the values of `target.expected`."""
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


# A series of checkpoints ---------------------------------------------------------------


def _as_step(step: Any, directory: str) -> int:
    """`step` as a Python int (NumPy and 0-d JAX integers count); else `CheckpointError`:
    Orbax would write a directory named `1.5` that a reopened manager does not list."""
    try:
        number = operator.index(step)
    except TypeError:
        number = None
    if number is None or isinstance(step, bool) or number < 0:
        raise CheckpointError(
            f"Checkpoint steps in {directory!r} are non-negative integers, got "
            f"{step!r} (a {type(step).__name__}). Pass the training step, e.g. "
            "`int(step)`."
        )
    return number


# The closers of managers that may have saves in flight when the program ends (see
# `_finish_saves`). Each `weakref.finalize` also runs when its manager is dropped, so
# that a manager a function made and forgot to close finishes its saves then, while
# Python can still start the threads Orbax needs (from 3.12 on it cannot at exit).
_UNCLOSED: "set[weakref.finalize]" = set()
# The Orbax managers of this process, and their directories: a manager's first save
# removes no unfinished save while another of them is writing one there.
_ORBAX_MANAGERS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
# Managers the garbage collector dropped, waiting for `_close_queued` to close them
# (see `_close_dropped`); `None` tells that thread to stop.
_DROPPED: "queue.SimpleQueue[tuple[Any, str] | None]" = queue.SimpleQueue()
_CLOSER: list[threading.Thread] = []
_CLOSER_STARTING = threading.Lock()
_FINISH_REGISTERED = threading.Lock()
# Whether this thread is collecting garbage (see `_note_collection`).
_COLLECTING = threading.local()


def _note_collection(phase: str, info: dict) -> None:
    _COLLECTING.now = phase == "start"


def _close_dropped(manager: Any, directory: str) -> None:
    """Waits for the saves of a manager nobody closed, then closes it; says on stderr
    if its last checkpoint may be lost.

    A manager in a reference cycle is dropped by the garbage collector, which runs
    in whichever thread allocates, possibly one of Orbax's own that the save needs,
    or one holding a lock of `threading`'s that starting a thread takes: waiting or
    starting a thread there could wait forever. The manager is queued instead, for
    a thread started with the first manager."""
    if getattr(_COLLECTING, "now", False):
        _DROPPED.put((manager, directory))  # Safe inside a collection: no lock.
    else:
        _close_now(manager, directory)


def _close_now(manager: Any, directory: str) -> None:
    try:
        manager.close()
    except Exception as error:
        _report_incomplete(directory, error)


def _close_queued() -> None:
    while (dropped := _DROPPED.get()) is not None:
        _close_now(*dropped)


def _start_closer_thread() -> None:
    """Starts the thread closing the managers the garbage collector drops, unless it
    runs. It is a daemon: `_finish_saves` waits for its work when the program ends."""
    with _CLOSER_STARTING:
        if _CLOSER and _CLOSER[0].is_alive():
            return
        closer = threading.Thread(
            target=_close_queued,
            name="eqstate: closing dropped checkpoint managers",
            daemon=True,
        )
        closer.start()
        _CLOSER[:] = [closer]


def _report_incomplete(directory: str, error: BaseException) -> None:
    print(
        f"eqstate: the checkpoint being saved in {directory!r} when its manager was "
        f"dropped or the program ended may be incomplete: {error!r}. Call `close()` "
        "(or use a `with` block) once training is done.",
        file=sys.stderr,
    )


def _finish_saves() -> None:
    """Closes every manager not yet closed, each in turn even if one fails, and waits
    for those being closed: a program that ends without `close()` must not lose the
    checkpoint its last `save` reported."""
    closers = list(_UNCLOSED)
    for closer in closers:
        closer()
    _UNCLOSED.difference_update(closers)
    _DROPPED.put(None)
    for thread in _CLOSER:
        thread.join()
    # Dropped after the thread stopped (or in a child process, which has no thread).
    while not _DROPPED.empty():
        if (dropped := _DROPPED.get()) is not None:
            _close_now(*dropped)


def _finish_saves_at_exit() -> None:
    """Registers `_finish_saves` to run when the main thread ends, once. It must run
    before `concurrent.futures` stops taking work (Orbax's background saves submit
    more), so it uses the hook that module uses, where there is one: a plain
    `atexit` handler runs too late."""
    if not _FINISH_REGISTERED.acquire(blocking=False):
        return
    gc.callbacks.append(_note_collection)
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - depends on the Python release
        import atexit

        atexit.register(_finish_saves)
    else:
        register(_finish_saves)


_STEP_FIX = (
    "Move it out of {directory!r}, whose entries named by numbers are checkpoints, "
    "or save another step"
)


class _CheckpointsOnly:
    """An Orbax `NameFormat` that lists as steps only the directories that are Orbax
    checkpoints: a user's directory `1/` or file `5` in the manager's directory is no
    step, so the manager neither loads it nor deletes it under `max_to_keep`."""

    def __init__(self, name_format: Any):
        self._name_format = name_format

    def build_name(self, step: int) -> str:
        return self._name_format.build_name(step)

    def find_all(self, base_path: Any) -> Any:
        return (
            metadata
            for metadata in self._name_format.find_all(base_path)
            if (metadata.path / _CHECKPOINT_FILE).is_file()
        )

    def find_step(self, base_path: Any, step: int) -> Any:
        metadata = self._name_format.find_step(base_path, step)
        if not (metadata.path / _CHECKPOINT_FILE).is_file():
            raise ValueError(f"{metadata.path} is not a checkpoint.")
        return metadata


class CheckpointManager:
    """A directory of numbered checkpoints of a training run, written with Orbax: it
    keeps the last few, saves in the background while training goes on, and finds
    the latest one to resume from.

    Every process of a multi-process program (`jax.distributed`) creates the manager
    with the same directory and calls `save` and `load` together; each process then
    writes and reads only its own shards. Checkpoints store each array under its
    readable state path, as [`eqstate.save`][] does, and `load` refuses a
    checkpoint that does not match the target with the same errors as
    [`eqstate.load`][], or whose bytes changed since they were written. A checkpoint
    loads onto any mesh and any number of processes: each array goes where the
    target's value is placed.

    Needs `orbax-checkpoint` (`pip install 'eqstate[orbax]'`).

    !!! Example

        ```python
        import tempfile

        import eqstate as es
        import jax.numpy as jnp

        model = {"w": es.ParamState(jnp.zeros(3)), "b": jnp.zeros(2)}
        with tempfile.TemporaryDirectory() as directory:
            with es.CheckpointManager(directory, max_to_keep=2) as manager:
                for step in range(1, 5):
                    model["w"].value = model["w"].value + 1
                    manager.save(step, model)
                manager.wait_until_finished()
                assert manager.steps() == (3, 4)

            # Later, perhaps in a new process: resume from the latest checkpoint.
            fresh = {"w": es.ParamState(jnp.zeros(3)), "b": jnp.ones(2)}
            with es.CheckpointManager(directory) as manager:
                fresh = manager.load(fresh)
                assert manager.latest_step() == 4
            assert (fresh["w"].value == 4).all() and (fresh["b"] == 0).all()
        ```
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | np.integer | None = None,
        async_save: bool = True,
    ):
        """**Arguments:**

        - `directory`: where the checkpoints go, one subdirectory per step. It is
            created if missing. Only subdirectories that are checkpoints count as
            steps: others, even named by a number, are neither loaded nor deleted.
            What a save that never finished (a crash) left is removed at this
            manager's first save (or a later one, while another manager of this
            program is writing there), not before: a manager that only reads never
            touches a save another program is writing.
            With several processes, every process must see it (a shared file
            system, or a bucket Orbax can write).
        - `max_to_keep`: keep only the last this many checkpoints (a positive
            `int`), deleting older ones after each save; `None` keeps all. (Keyword
            only argument.)
        - `async_save`: save in the background: `save` returns once the values are
            copied off the devices, and the files are written while the program
            goes on. Call `close()` (or use a `with` block) once training is done.
            A manager dropped without it (say, the local of a function that
            returned) waits for its saves and closes then; one in a reference cycle
            is closed by a background thread of eqstate's once the garbage
            collector drops it. One whose saves are still being written when the
            program ends is waited for then on Python 3.11; from Python 3.12 on,
            Python refuses the threads Orbax then needs, so its last save may be
            lost (eqstate says so on stderr) and Orbax's waiting threads may hold
            the program's exit up for minutes. (Keyword only argument.)

        **Raises:**

        [`eqstate.CheckpointError`][] if `directory` is a file, or cannot be created
        or read.
        """
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool)
            or not isinstance(max_to_keep, (int, np.integer))
            or max_to_keep < 1
        ):
            raise ValueError(
                f"`max_to_keep` must be a positive number of checkpoints (an int), or "
                f"None to keep all; got {max_to_keep!r}."
            )
        ocp = orbax("`eqstate.CheckpointManager`")
        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.lexists(self.directory) and not os.path.isdir(self.directory):
            what = "a file" if os.path.exists(self.directory) else "a broken symlink"
            raise CheckpointError(
                f"Cannot keep checkpoints in {self.directory!r}: it is {what}, not a "
                "directory. Pass the path of a directory, which is created if "
                "missing; a single checkpoint file is written with "
                "`eqstate.save(path, states)`."
            )
        self._name_format = _CheckpointsOnly(ocp.step.standard_name_format())
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if max_to_keep is None else int(max_to_keep),
            enable_async_checkpointing=async_save,
            create=True,
            # Orbax would remove unfinished saves in a background thread, racing
            # with saves other managers are writing; `save` removes them instead.
            cleanup_tmp_directories=False,
            step_name_format=self._name_format,
        )
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        except OSError as e:
            raise CheckpointError(
                f"Cannot keep checkpoints in {self.directory!r}: creating or reading "
                f"it failed ({type(e).__name__}: {e}). Pass a directory this program "
                "can create and write, on a file system with space."
            ) from e
        _ORBAX_MANAGERS[self._manager] = os.path.realpath(self.directory)
        self._closed = False
        self._unfinished_saves_removed = False
        self._closer = weakref.finalize(
            self, _close_dropped, self._manager, self.directory
        )
        self._closer.atexit = async_save  # Only saves in the background can be lost.
        _start_closer_thread()
        if async_save:
            _UNCLOSED.difference_update([c for c in list(_UNCLOSED) if not c.alive])
            _UNCLOSED.add(self._closer)
            _finish_saves_at_exit()

    def save(
        self,
        step: int | np.integer | jax.Array,
        model_or_states: PyTree,
        *,
        model: PyTree | None = None,
    ) -> None:
        """Saves a model (its arrays and its states' values), or the values of a
        `StateDict`, as checkpoint `step`.

        **Arguments:**

        - `step`: the checkpoint's number, a non-negative integer (a NumPy or 0-d
            JAX integer too), e.g. the training step; higher than every step saved
            before.
        - `model_or_states`, `model`: as in [`eqstate.save`][]: a model, saved
            whole; or a `StateDict` of values, and a PyTree holding their handles
            (and no arrays) that gives each state its path (else state names).
            (`model` is a keyword only argument.)

        **Raises:**

        [`eqstate.CheckpointError`][] as [`eqstate.save`][] does (inside a JAX
        transform too), if `step` is not a non-negative integer higher than the
        latest step saved, if the directory holds a file, a directory that is
        not a checkpoint, or a checkpoint another manager saved, under the name of
        `step` (saving would delete it), or if the manager is closed. Nothing is
        written or removed then.
        """
        refuse_under_transforms(
            "save",
            "step(x)\n    manager.save(n, model)",
        )
        self._refuse_if_closed("save")
        step = _as_step(step, self.directory)
        step_path = os.path.join(self.directory, self._name_format.build_name(step))

        def prepare() -> list:
            self._refuse_to_overwrite(step, step_path)
            return leaves_to_save(model_or_states, model)

        with _SAVING:
            args = _save_args(self._ocp, step_path, step, prepare)
            with _orbax_write_errors(step_path):
                self._remove_unfinished_saves()
                self._manager.save(step, args=args, force=True)

    @overload
    def load(
        self,
        model_or_states: Mapping[State, PyTree],
        *,
        step: int | np.integer | jax.Array | None = None,
        model: PyTree | None = None,
    ) -> StateDict: ...

    @overload
    def load(
        self,
        model_or_states: _M,
        *,
        step: int | np.integer | jax.Array | None = None,
    ) -> _M: ...

    def load(
        self,
        model_or_states: Any,
        *,
        step: int | np.integer | jax.Array | None = None,
        model: PyTree | None = None,
    ) -> Any:
        """Loads checkpoint `step` (by default the latest) into the target.

        **Arguments:**

        - `model_or_states`, `model`: the target, as in [`eqstate.load`][]: a model,
            or a `StateDict`. Its current values give the expected shapes and
            dtypes, and the sharding each loaded array gets. (`model` is a keyword
            only argument.)
        - `step`: which checkpoint; `None` for the latest: in a program of several
            processes, the latest that process 0 sees, in every process (another
            program may save while they look). (Keyword only argument.)

        **Returns:**

        As [`eqstate.load`][]: the model with its arrays loaded, its states'
        values written (`model = manager.load(model)`); or, for a `StateDict`, a
        [`eqstate.StateDict`][] of the loaded values, with nothing written.

        **Raises:**

        [`eqstate.CheckpointError`][] if there is no such checkpoint or the manager
        is closed, or as [`eqstate.load`][] does (inside a JAX transform too).
        """
        refuse_under_transforms("load", "model = manager.load(model)\n    step(x)")
        self._refuse_if_closed("load")
        self._manager.wait_until_finished()
        steps = self.steps()
        if step is None:
            # Another program may save meanwhile: every process loads the step that
            # process 0 sees as the latest (it may be new to the others' listing).
            latest = _process_0s(steps[-1] if steps else None)
            if latest is None:
                raise CheckpointError(
                    f"No checkpoint in {self.directory!r} yet. Check "
                    "`manager.latest_step() is not None` before loading, and start "
                    "from scratch otherwise."
                )
            step = latest
            if step not in steps:  # Saved since this process listed the directory.
                self._reread_steps()
        else:
            step = _as_step(step, self.directory)
            if step not in steps:
                raise CheckpointError(
                    f"No checkpoint {step} in {self.directory!r}; it holds steps "
                    f"{list(steps)}."
                )
        target = load_target(model_or_states, model)
        restore = ft.partial(self._manager.restore, step)
        where = os.path.join(self.directory, str(step))
        values = restore_with(lambda args: restore(args=args), where, target)
        return loaded_into(target, values)

    def latest_step(self) -> int | None:
        """The highest step saved (or being saved), or `None` if there is none. Steps
        other managers or programs saved or removed count too."""
        self._reread_steps()
        return self._manager.latest_step()

    def steps(self) -> tuple[int, ...]:
        """Every step kept, in increasing order, as the directory now holds them."""
        self._reread_steps()
        return tuple(sorted(self._manager.all_steps()))

    def _reread_steps(self) -> None:
        """Lists the steps in the directory again (another manager or program may
        have saved or removed some since), unless a save of this manager's is being
        written, which Orbax would then leave out."""
        if not self._closed and not self._manager.is_saving_in_progress():
            self._manager.reload()

    def is_saving(self) -> bool:
        """Whether a save is still being written in the background."""
        return self._manager.is_saving_in_progress()

    def wait_until_finished(self) -> None:
        """Blocks until every save has been written and committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the saves in flight, then releases the manager's resources.
        Call it (or use a `with` block) before the program ends: see `async_save`.
        A closed manager refuses to save or load; closing it again is harmless.

        **Raises:**

        What Orbax raises if a save in the background failed; the manager is
        closed all the same."""
        try:
            self._manager.close()
        finally:
            self._closed = True
            self._closer.detach()
            _UNCLOSED.discard(self._closer)

    def _remove_unfinished_saves(self) -> None:
        """Removes what saves that never finished (a crash) left in the directory.

        Done at the first save, not when the manager is made: a manager made only
        to read would otherwise remove the save another program is writing. Put
        off to a later save while another manager of this process writes one there.
        """
        here = _ORBAX_MANAGERS[self._manager]  # its real path: through any symlink
        if self._unfinished_saves_removed or any(
            other is not self._manager
            and where == here
            and other.is_saving_in_progress()
            for other, where in list(_ORBAX_MANAGERS.items())
        ):
            return
        self._manager.wait_until_finished()  # as Orbax's `save` does next
        if jax.process_index() == 0:
            for name in self._ocp.step.tmp_checkpoints(self.directory):
                shutil.rmtree(os.path.join(self.directory, name))
        self._unfinished_saves_removed = True

    def _refuse_to_overwrite(self, step: int, step_path: str) -> None:
        """Raises `CheckpointError` unless `step` is higher than every step saved and
        its path holds nothing that saving would delete."""
        latest = self._manager.latest_step()
        if latest is not None and step <= latest:
            raise CheckpointError(
                f"Cannot save checkpoint {step} in {self.directory!r}: it already "
                f"holds step {latest}, and steps must increase. Pass the training "
                "step, or resume from the latest checkpoint with `load` first."
            )
        if os.path.isfile(os.path.join(step_path, _CHECKPOINT_FILE)):
            raise CheckpointError(
                f"Cannot save checkpoint {step} in {self.directory!r}: another manager "
                "or program saved that step after this manager was made, and saving "
                "would replace it. Nothing was written or removed. Keep one manager "
                "per directory, or make a new one, which sees every step saved, and "
                "save a later step."
            )
        fix = _STEP_FIX.format(directory=self.directory)
        _refuse_to_replace(step_path, f"checkpoint {step}", (fix, fix))

    def _refuse_if_closed(self, what: str) -> None:
        if self._closed:
            raise CheckpointError(
                f"Cannot {what} with the checkpoint manager of {self.directory!r}: it "
                "is closed. Make a new `eqstate.CheckpointManager` for the directory."
            )

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
