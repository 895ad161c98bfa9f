"""Checkpoints: `save` and `load` store the values of states in one file, by PyTree path.

File format, version 1
----------------------

A checkpoint is one file. No pickle: every byte is either a fixed-size integer, UTF-8
JSON, or the raw bytes of an array. Integers are little-endian.

| offset       | size     | content                                                |
| ------------ | -------- | ------------------------------------------------------ |
| 0            | 8        | magic bytes `\\x93EQSTATE`                              |
| 8            | 4        | format version, `uint32` (this is version 1)           |
| 12           | 8        | header length `H` in bytes, `uint64`                   |
| 20           | `H`      | header: a UTF-8 JSON object (below)                    |
| 20 + `H`     | 4        | CRC32 of bytes `[0, 20 + H)`, `uint32`                 |
| 24 + `H`     | `D`      | data: the entries' bytes, back to back, in header order |

The file ends right after the data: its size is exactly `24 + H + D`, where `D` is the
sum of the entries' lengths. The header is `{"entries": [entry, ...]}`, each entry an
object with

- `path`: the entry's name, e.g. `"layers.0.bn.running_mean"`, unique in the file;
- `dtype`: a NumPy / `ml_dtypes` dtype name, e.g. `"float32"`, `"bfloat16"`, `"bool"`;
- `shape`: a list of non-negative integers;
- `offset`: where its bytes start, counted from the start of the data section (the
    first entry starts at 0 and each next one where the previous ended);
- `length`: its size in bytes, `prod(shape) * itemsize`;
- `crc32`: the CRC32 of its bytes, an unsigned integer;
- `key_impl` (PRNG keys only): the key implementation, e.g. `"threefry2x32"`. The
    entry then holds `jax.random.key_data` of the keys, and loading restores them with
    `jax.random.wrap_key_data(data, impl=key_impl)`.

An array's bytes are its elements in C order, little-endian. Every byte of the file is
covered by a check: the magic, the version, the header CRC, the entries' CRCs and the
exact file size.
"""

import contextlib
import io
import json
import math
import os
import re
import secrets
import stat
import struct
import sys
import threading
import zlib
from collections.abc import Iterable, Mapping
from typing import Any, cast, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import ml_dtypes  # noqa: F401  # registers the names `bfloat16`, `float8_*` with NumPy
import numpy as np
from jax.core import Tracer
from jaxtyping import PyTree

from ._context import to_value
from ._errors import CheckpointError
from ._multi_process import (
    device_put,
    require_fully_addressable,
    resolve_backend,
    SAVE_FIX,
)
from ._pretty_print import state_label
from ._run import states_of, values_of
from ._state import is_state, State
from ._state_dict import StateDict


_MAGIC = b"\x93EQSTATE"
_VERSION = 1
# magic, version, header length
_PREAMBLE = struct.Struct("<8sIQ")
_CRC = struct.Struct("<I")
_ENTRY_FIELDS = {
    "path": str,
    "dtype": str,
    "shape": list,
    "offset": int,
    "length": int,
    "crc32": int,
}
_LIST_LIMIT = 5

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
    "save": "eqstate.save(path, eqstate.values_of(model), model=model)",
    "load": "eqstate.load(path, model)",
}


class _Leaf(NamedTuple):
    """One array of a state's value, as stored (or expected) in a checkpoint."""

    path: str
    state: State
    dtype: np.dtype  # of the stored bytes: for PRNG keys, of their key data
    shape: tuple[int, ...]
    key_impl: str | None


def _key_text(entry: Any, states: Mapping[State, str]) -> str:
    if isinstance(entry, jtu.GetAttrKey):
        return entry.name
    if isinstance(entry, jtu.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, jtu.DictKey):
        return _state_text(entry.key, states) if is_state(entry.key) else str(entry.key)
    if isinstance(entry, jtu.FlattenedIndexKey):
        return str(entry.key)
    return jtu.keystr((entry,)).lstrip(".")


def _state_text(state: State, states: Mapping[State, str]) -> str:
    """A state met inside a value (a StateDict in an optimiser's state) is stored under
    its own path (or name), which stays the same across runs and processes."""
    text = states.get(state, state.name)
    if text is None:
        raise CheckpointError(
            f"A value holds a StateDict entry for {state_label(state)}, which has no "
            "path here: it is neither among the states saved (pass `model=` holding "
            "it, or save its value too) nor named. Give it a `name=`, or save the "
            "model's states with `model=`."
        )
    return text


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _path_text(path: tuple, states: Mapping[State, str] | None = None) -> str:
    """`(GetAttrKey('layers'), SequenceKey(0), DictKey('w'))` -> `layers.0.w`; a
    `DictKey` of a state gives that state's path in `states`, else its name."""
    return _join(*(_key_text(entry, states or {}) for entry in path))


def _names(items: Iterable[str], limit: int = _LIST_LIMIT) -> str:
    items = list(items)
    shown = ", ".join(f"`{item}`" for item in items[:limit])
    more = len(items) - limit
    return shown + (f" and {more} more" if more > 0 else "")


def _labels(states: Iterable[State], limit: int = _LIST_LIMIT) -> str:
    states = list(states)
    shown = ", ".join(state_label(s) for s in states[:limit])
    more = len(states) - limit
    return shown + (f" and {more} more" if more > 0 else "")


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _describe(dtype: Any, shape: tuple[int, ...], key_impl: str | None) -> str:
    if key_impl is not None:
        return f"a {key_impl} PRNG key (key data of shape {shape}, dtype {dtype})"
    return f"shape {shape} and dtype {dtype}"


def _state_paths(
    states: tuple[State, ...], model: PyTree | None, verb: str
) -> dict[State, str]:
    """The path under which each state is stored: its PyTree path in `model` (the
    first one, if it sits at several), or its name when there is no model."""
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
        return {s: paths[s] for s in states}
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


def _leaves(
    paths: Mapping[State, str], values: Mapping[State, PyTree]
) -> list[tuple[_Leaf, Any]]:
    """Every array of every state's value with the path it is stored under, in order;
    a value with several leaves gets one entry per leaf (`opt.mu.0`)."""
    out: list[tuple[_Leaf, Any]] = []
    seen: dict[str, State] = {}
    for state, base in paths.items():
        for subpath, leaf in jtu.tree_leaves_with_path(values[state]):
            path = _join(base, _path_text(subpath, paths))
            if path in seen:
                raise CheckpointError(
                    f"Two arrays would be stored under the same path `{path}` (of "
                    f"{state_label(seen[path])} and {state_label(state)}). Paths join "
                    "PyTree keys with dots, so e.g. a dict key 'a.b' and a nested "
                    "key 'a' -> 'b' collide: rename one of them."
                )
            if _is_key(leaf):
                impl = str(jax.random.key_impl(leaf))
                data = jax.eval_shape(jax.random.key_data, leaf)
                spec = _Leaf(path, state, np.dtype(data.dtype), data.shape, impl)
            else:
                spec = _Leaf(path, state, np.dtype(leaf.dtype), tuple(leaf.shape), None)
            seen[path] = state
            out.append((spec, leaf))
    return out


def _little_endian(array: np.ndarray) -> np.ndarray:
    if sys.byteorder == "big" and array.dtype.itemsize > 1:
        return array.byteswap()
    return array


def _host_bytes(spec: _Leaf, leaf: Any) -> memoryview:
    if isinstance(leaf, Tracer):
        raise CheckpointError(
            f"Cannot save `{spec.path}` ({state_label(spec.state)}): its value is a "
            "JAX tracer. `eqstate.save` writes a file, so call it outside `jax.jit`, "
            "`jax.vmap` and eqstate transforms, on concrete values."
        )
    require_fully_addressable(
        leaf, f"`{spec.path}` ({state_label(spec.state)})", "save", SAVE_FIX
    )
    if spec.key_impl is not None:
        leaf = jax.random.key_data(leaf)
    array = np.ascontiguousarray(_little_endian(np.asarray(leaf)))
    # A view as bytes: NumPy cannot export `ml_dtypes` types (bfloat16) as a buffer.
    return array.reshape(-1).view(np.uint8).data


def _fsync_directory(directory: str) -> None:
    # Makes the rename itself durable. Not every platform can open a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# Temporary files are `.{name}.{pid}.{16 hex digits}.tmp`, next to the target `name`
# (`.{name}.{16 hex digits}.tmp` before the pid was added).
_TEMPORARY_ID = re.compile(r"(?:(?P<pid>\d+)\.)?[0-9a-f]{16}")
# Temporaries of saves in progress in this process (another thread may be writing).
_WRITING: set[str] = set()
_WRITING_LOCK = threading.Lock()


def _target_file(path: str) -> str:
    """Where the bytes of a checkpoint saved to `path` go: `path`, or the file its
    symlinks lead to, so that saving keeps the link and replaces what it points to."""
    return os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)


def _process_is_gone(pid: int) -> bool:
    if pid == os.getpid():
        return True  # Its own temporaries in progress are in `_WRITING`.
    if os.name != "posix":
        return False  # No safe way to ask; keep the file.
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # It exists (maybe another user's).
    return False


def _remove_stale_temporaries(target: str) -> None:
    """Removes the temporary files that earlier saves to `target` left behind when
    they were killed (the writing process is gone, so nothing will finish them)."""
    directory, name = os.path.split(target)
    try:
        candidates = os.listdir(directory)
    except OSError:
        return
    prefix, suffix = f".{name}.", ".tmp"
    for candidate in candidates:
        if not (candidate.startswith(prefix) and candidate.endswith(suffix)):
            continue
        match = _TEMPORARY_ID.fullmatch(candidate[len(prefix) : -len(suffix)])
        if match is None:
            continue
        full = os.path.join(directory, candidate)
        with _WRITING_LOCK:
            pid = match["pid"]
            if full in _WRITING or (pid is not None and not _process_is_gone(int(pid))):
                continue
            with contextlib.suppress(OSError):
                os.unlink(full)


def _write_atomically(path: str, chunks: Iterable[bytes | memoryview]) -> None:
    """Writes to a temporary file next to the target and renames it onto the target,
    so a reader sees either the previous file or the whole new one, never a partial
    one. The target is `path`, or the file a symlink at `path` leads to."""
    target = _target_file(path)
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise CheckpointError(
            f"Cannot save a checkpoint to {path!r}: the directory {directory!r} does "
            "not exist. Create it first, e.g. with `os.makedirs(directory, "
            "exist_ok=True)`."
        )
    _remove_stale_temporaries(target)
    tmp = os.path.join(
        directory,
        f".{os.path.basename(target)}.{os.getpid()}.{secrets.token_hex(8)}.tmp",
    )
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    with _WRITING_LOCK:
        _WRITING.add(tmp)
    try:
        fd = os.open(tmp, flags, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        where = repr(path)
        if target != os.path.abspath(path):
            where += f" (a link to {target!r})"
        raise CheckpointError(
            f"Cannot save a checkpoint to {where}: {e.strerror or e}. Nothing was "
            "written there: a checkpoint already at that path is unchanged. Check "
            "that the directory is writable and the disk has space."
        ) from e
    finally:
        with _WRITING_LOCK:
            _WRITING.discard(tmp)
    _fsync_directory(directory)


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
    booleans and typed PRNG keys.

    The write is atomic: the file is written next to `path` under a temporary name,
    flushed to disk and renamed onto `path`. If anything fails, the temporary file is
    removed and a checkpoint already at `path` is left as it was. If `path` is a
    symlink, the link stays and the file it leads to is replaced (atomically, the same
    way). A save that was killed cannot remove its temporary file; the next save to
    the same path does. The format (one file, no pickle) is described in the how-to
    guide on checkpoints.

    **Arguments:**

    - `path`: the file to write. Its directory must exist.
    - `states`: the values to save, a [`eqstate.StateDict`][] (or a mapping from
        handles to values), e.g. `eqstate.values_of(model)`.
    - `model`: a PyTree holding the handles, e.g. an `eqx.Module`; it gives each state
        its path. A state found at several places is stored under the first. If
        omitted, every state must have a unique name. (Keyword only argument.)
    - `backend`: `"single-file"` (this format), `"orbax"` (a directory in which
        every process writes its own shards; needs `eqstate[orbax]`), or `None`:
        Orbax when the program runs as several processes (`jax.process_count() >
        1`), else the single file. (Keyword only argument.)

    **Raises:**

    [`eqstate.CheckpointError`][] if a state is not in `model`, if states lack unique
    names when there is no `model`, if two arrays would get the same path, or
    if the file cannot be written (a read-only directory, a full disk: the
    `OSError` is its cause). `TypeError` if `states` is not a mapping of states.

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
    path = os.fspath(path)
    if not _is_state_mapping(states):
        raise TypeError(
            "`eqstate.save(path, states)` takes the values to save as a StateDict (or a "
            f"mapping from handles to values), got {_short_repr(states)}. E.g. "
            "`eqstate.save(path, eqstate.values_of(model), model=model)`."
        )
    if resolve_backend(backend, path, "save") == "orbax":
        from ._orbax import save_orbax

        return save_orbax(path, states, model=model)
    values = {state: to_value(value) for state, value in states.items()}
    leaves = _leaves(_state_paths(tuple(values), model, "save"), values)
    entries, blobs, offset = [], [], 0
    for spec, leaf in leaves:
        blob = _host_bytes(spec, leaf)
        entry: dict[str, Any] = {
            "path": spec.path,
            "dtype": spec.dtype.name,
            "shape": list(spec.shape),
            "offset": offset,
            "length": blob.nbytes,
            "crc32": zlib.crc32(blob),
        }
        if spec.key_impl is not None:
            entry["key_impl"] = spec.key_impl
        entries.append(entry)
        blobs.append(blob)
        offset += blob.nbytes
    header = json.dumps(
        {"entries": entries}, ensure_ascii=False, separators=(",", ":")
    ).encode("utf-8")
    head = _PREAMBLE.pack(_MAGIC, _VERSION, len(header)) + header
    _write_atomically(path, [head, _CRC.pack(zlib.crc32(head)), *blobs])


def _read_up_to(f: io.BufferedReader, n: int, preallocate: bool) -> memoryview:
    """Up to `n` bytes of `f`, fewer only at its end. With `preallocate` (`n` is known
    to fit in the file) one buffer of `n` bytes is filled; otherwise the buffer grows
    only with the bytes that arrive, so a false size claimed by a file cannot make it
    allocate more than the file holds."""
    if preallocate:
        buffer = bytearray(n)
        view, got = memoryview(buffer), 0
        while got < n:
            read = f.readinto(view[got:])
            if not read:
                break
            got += read
        return view[:got]
    buffer = bytearray()
    while len(buffer) < n:
        chunk = f.read(min(n - len(buffer), 1 << 24))
        if not chunk:
            break
        buffer += chunk
    return memoryview(buffer)


def _open_checkpoint(path: str) -> io.BufferedReader:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise CheckpointError(
            f"No checkpoint at {path!r}: the file does not exist. Check the path, or "
            "write one first with `eqstate.save`."
        ) from None
    except IsADirectoryError:
        raise CheckpointError(
            f"{path!r} is a directory, not a checkpoint file. Pass the path of the "
            "file written by `eqstate.save`."
        ) from None
    except OSError as e:
        raise CheckpointError(
            f"Cannot read the checkpoint {path!r}: {e.strerror or e}."
        ) from e


def _read_checkpoint(path: str) -> tuple[list[dict[str, Any]], memoryview]:
    """Reads and verifies a whole checkpoint: its format, header and every entry's
    CRC. Returns the header's entries and the data section. Each part is read only
    once the parts before it have vouched for its size."""
    with _open_checkpoint(path) as f:
        try:
            return _read_verified(path, f)
        except OSError as e:
            raise CheckpointError(
                f"Cannot read the checkpoint {path!r}: {e.strerror or e}."
            ) from e


def _read_verified(
    path: str, f: io.BufferedReader
) -> tuple[list[dict[str, Any]], memoryview]:
    info = os.fstat(f.fileno())
    # A regular file tells its size up front; a pipe or a device does not.
    size = info.st_size if stat.S_ISREG(info.st_mode) else None

    def truncated(needed: str, got: int) -> CheckpointError:
        return CheckpointError(
            f"The checkpoint {path!r} is truncated: it has {got} bytes, but {needed}. "
            "It was probably cut short while being copied or downloaded; copy it "
            "again or use an earlier checkpoint."
        )

    def corrupted(what: str) -> CheckpointError:
        return CheckpointError(
            f"The checkpoint {path!r} is corrupted: {what}. The file was changed after "
            "it was written (a disk or transfer error); copy it again or use an "
            "earlier checkpoint."
        )

    def fits(end: int) -> bool:
        return size is None or size >= end

    head = _read_up_to(f, _PREAMBLE.size, preallocate=False)
    if head[: len(_MAGIC)] != _MAGIC[: len(head)]:
        raise CheckpointError(
            f"{path!r} is not an eqstate checkpoint: it does not start with the "
            f"magic bytes {_MAGIC!r}. Pass a file written by `eqstate.save`."
        )
    if len(head) < _PREAMBLE.size:
        raise truncated(f"its fixed-size start alone is {_PREAMBLE.size}", len(head))
    _, version, header_size = _PREAMBLE.unpack_from(head)
    if version != _VERSION:
        raise CheckpointError(
            f"The checkpoint {path!r} has format version {version}, but this version "
            f"of eqstate reads only version {_VERSION}. Load it with the eqstate "
            "release that wrote it (a newer one, if the version is higher)."
        )
    data_start = _PREAMBLE.size + header_size + _CRC.size
    if not fits(data_start):
        raise truncated(f"its header ends at byte {data_start}", cast(int, size))
    rest = _read_up_to(f, header_size + _CRC.size, preallocate=size is not None)
    if len(rest) < header_size + _CRC.size:
        raise truncated(
            f"its header ends at byte {data_start}", _PREAMBLE.size + len(rest)
        )
    (header_crc,) = _CRC.unpack_from(rest, header_size)
    if zlib.crc32(rest[:header_size], zlib.crc32(head)) != header_crc:
        raise corrupted("the checksum of its header does not match")
    entries = _parse_header(path, bytes(rest[:header_size]))
    data_size = sum(entry["length"] for entry in entries)
    end = data_start + data_size
    if not fits(end):
        raise truncated(
            f"its {len(entries)} entries end at byte {end}", cast(int, size)
        )
    if size is not None and size > end:
        raise corrupted(
            f"it has {size - end} bytes after its last entry, where it should end"
        )
    data = _read_up_to(f, data_size, preallocate=size is not None)
    if len(data) < data_size:
        raise truncated(
            f"its {len(entries)} entries end at byte {end}", data_start + len(data)
        )
    if size is None and f.read(1):
        raise corrupted("it has bytes after its last entry, where it should end")
    for entry in entries:
        blob = data[entry["offset"] : entry["offset"] + entry["length"]]
        if zlib.crc32(blob) != entry["crc32"]:
            raise corrupted(
                f"the bytes of entry `{entry['path']}` (shape "
                f"{tuple(entry['shape'])}, dtype {entry['dtype']}) do not match "
                "their checksum"
            )
    return entries, data


def _parse_header(path: str, raw: bytes) -> list[dict[str, Any]]:
    """Checks that a header, whose checksum matched, describes a valid layout."""

    def malformed(what: str) -> CheckpointError:
        return CheckpointError(
            f"The checkpoint {path!r} has a malformed header: {what}. The file was not "
            "written by `eqstate.save`, or by a faulty writer; write it again with "
            "`eqstate.save`."
        )

    try:
        header = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise malformed("it nests JSON values too deeply to read") from None
    except ValueError as e:  # Not UTF-8, not JSON, or a number too long to convert.
        raise malformed(f"it is not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict) or not isinstance(header.get("entries"), list):
        raise malformed('it is not a JSON object with an "entries" list')
    offset = 0
    paths = set()
    for i, entry in enumerate(header["entries"]):
        if not isinstance(entry, dict):
            raise malformed(f"entry {i} is not a JSON object")
        for field, kind in _ENTRY_FIELDS.items():
            if not isinstance(entry.get(field), kind) or isinstance(
                entry.get(field), bool
            ):
                raise malformed(f"entry {i} has no valid {field!r}")
        name = entry["path"]
        if name in paths:
            raise malformed(f"the path `{name}` appears twice")
        paths.add(name)
        shape = entry["shape"]
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in shape) or (
            any(n < 0 for n in shape)
        ):
            raise malformed(f"entry `{name}` has an invalid shape {shape}")
        if not isinstance(entry.get("key_impl", ""), str):
            raise malformed(f"entry `{name}` has an invalid 'key_impl'")
        try:
            dtype = np.dtype(entry["dtype"])
        except Exception:  # NumPy parses dtype strings with several error types.
            raise malformed(
                f"entry `{name}` has the unknown dtype {entry['dtype']!r}"
            ) from None
        if dtype.hasobject or dtype.fields is not None or dtype.itemsize == 0:
            raise malformed(f"entry `{name}` has the unsupported dtype {dtype}")
        if entry["offset"] != offset:
            raise malformed(
                f"entry `{name}` starts at {entry['offset']}, not right after the "
                f"previous entry ({offset})"
            )
        if entry["length"] != math.prod(shape) * dtype.itemsize:
            raise malformed(
                f"entry `{name}` has {entry['length']} bytes, which does not fit "
                f"shape {tuple(shape)} and dtype {dtype}"
            )
        offset += entry["length"]
    return header["entries"]


def _short_repr(x: Any, limit: int = 60) -> str:
    text = repr(x)
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{text} (a {type(x).__name__})"


def _is_state_mapping(x: Any) -> bool:
    return isinstance(x, Mapping) and all(is_state(s) for s in x)


def _target(
    model_or_states: PyTree, model: PyTree | None
) -> tuple[StateDict, dict[State, str], str]:
    """The target's expected values, the path of each of its states, and its name in
    messages."""
    if _is_state_mapping(model_or_states):
        expected = (
            model_or_states
            if isinstance(model_or_states, StateDict)
            else StateDict(model_or_states)
        )
        name = (
            "the StateDict" if model is None else "the StateDict (paths from `model`)"
        )
        return expected, _state_paths(expected.states, model, "load"), name
    if model is not None:
        raise TypeError(
            "`eqstate.load` takes `model=` only when its target is a StateDict, which "
            "then says which states to load and `model` gives their paths. To load "
            "every state of a model, call `eqstate.load(path, model)`."
        )
    expected = values_of(model_or_states)
    return expected, _state_paths(expected.states, model_or_states, "load"), "the model"


def _mismatch(path: str, target: str, needed: list, extra: list) -> CheckpointError:
    lines = [f"The checkpoint {path!r} does not match {target}."]
    if needed:
        missing = [f"`{spec.path}` (for {state_label(spec.state)})" for spec in needed]
        more = len(missing) - _LIST_LIMIT
        lines.append(
            f"It has no entry {', '.join(missing[:_LIST_LIMIT])}"
            + (f" and {more} more" if more > 0 else "")
            + "."
        )
    if extra:
        lines.append(
            f"It holds {_names(entry['path'] for entry in extra)}, which {target} "
            "does not have."
        )
    lines.append(
        "Paths come from where each state sits in the model (or from state names when "
        "loading into a StateDict), so build the model with the structure it had when "
        "it was saved: same layers, field names and state names."
    )
    return CheckpointError("\n".join(lines))


def _check_entries(
    path: str, target: str, specs: list[_Leaf], entries: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Checks that a checkpoint's entries are exactly the arrays the target expects,
    with their shapes and dtypes. Returns the entries by path."""
    by_path = {entry["path"]: entry for entry in entries}
    needed = [spec for spec in specs if spec.path not in by_path]
    wanted = {spec.path for spec in specs}
    extra = [entry for entry in entries if entry["path"] not in wanted]
    if needed or extra:
        raise _mismatch(path, target, needed, extra)

    problems = []
    for spec in specs:
        entry = by_path[spec.path]
        found = (entry["dtype"], tuple(entry["shape"]), entry.get("key_impl"))
        if found != (spec.dtype.name, spec.shape, spec.key_impl):
            problems.append(
                f"`{spec.path}` holds {_describe(*found)}, but "
                f"{state_label(spec.state)} expects "
                f"{_describe(spec.dtype.name, spec.shape, spec.key_impl)}"
            )
    if problems:
        more = len(problems) - _LIST_LIMIT
        raise CheckpointError(
            "\n".join(
                [
                    f"The checkpoint {path!r} does not match {target}:",
                    *(f"- {problem};" for problem in problems[:_LIST_LIMIT]),
                    *([f"- and {more} more;"] if more > 0 else []),
                    "Build the target with the shapes and dtypes it had when it was "
                    "saved, or load into such a target and convert the values after "
                    "loading.",
                ]
            )
        )
    return by_path


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
        their paths from. This loads a checkpoint saved with
        `save(path, states, model=model)` where `states` is part of the model's
        states, e.g. only its parameters. (Keyword only argument.)
    - `backend`: `"single-file"`, `"orbax"`, or `None` to tell from `path`: a
        directory that Orbax wrote is read with Orbax, each process reading only the
        shards its devices hold. (Keyword only argument.)

    **Returns:**

    A `StateDict` from the target's handles to the loaded values, each placed like the
    target's current value (same device or sharding).

    **Raises:**

    [`eqstate.CheckpointError`][] if the file is missing or unreadable, is not an
    eqstate checkpoint, has an unknown format version, is truncated, malformed or
    corrupted (a checksum does not match), lacks a path the target needs or holds one
    it does not have, or holds an array whose shape or dtype differs from the
    target's. The file is read part by part, each part only once the parts before it
    have vouched for its size, so a large file that is not a checkpoint costs a few
    bytes of reading.

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
    path = os.fspath(path)
    if resolve_backend(backend, path, "load") == "orbax":
        from ._orbax import load_orbax

        return load_orbax(path, model_or_states, model=model)
    expected, paths, target = _target(model_or_states, model)
    specs = _leaves(paths, expected)
    entries, data = _read_checkpoint(path)
    by_path = _check_entries(path, target, [spec for spec, _ in specs], entries)

    loaded: dict[State, list[Any]] = {state: [] for state in expected}
    for spec, leaf in specs:
        entry = by_path[spec.path]
        raw = data[entry["offset"] : entry["offset"] + entry["length"]]
        array = _little_endian(np.frombuffer(raw, dtype=spec.dtype)).reshape(spec.shape)
        value = jnp.asarray(array)
        if spec.key_impl is not None:
            value = jax.random.wrap_key_data(value, impl=spec.key_impl)
        if (
            isinstance(leaf, jax.Array)
            and not isinstance(leaf, Tracer)
            and leaf.committed
        ):
            # Only values tied to devices are placed: placing the others would tie
            # them to a device, and jitted functions would compile again.
            value = device_put(value, leaf.sharding)
        loaded[spec.state].append(value)
    return StateDict._wrap(
        {
            state: jtu.tree_unflatten(jtu.tree_structure(expected[state]), leaves)
            for state, leaves in loaded.items()
        }
    )
