"""The single-file checkpoint format: one file, no pickle, every byte covered by a check
(the magic, the version, the header's CRC32, each entry's CRC32 and the exact size).
The layout is described in the how-to guide on checkpoints, "File format" (version 1).

A file is written atomically: to a temporary file next to its target, flushed and
renamed onto the target, so a reader sees either the previous file or the whole new
one. Temporary files that killed saves left behind are removed by the next save to the
same path.
"""

import contextlib
import errno
import hashlib
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
from collections.abc import Iterable
from typing import Any

import jax
import ml_dtypes  # noqa: F401  # registers the names `bfloat16`, `float8_*` with NumPy
import numpy as np

from ._checkpoint_paths import as_loaded, check_entries, check_savable, Leaf, Target
from ._errors import CheckpointError
from ._multi_process import is_orbax_checkpoint, require_fully_addressable, SAVE_FIX


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


# Writing atomically ---------------------------------------------------------------


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


# Temporary files are `.{stem}.{pid}.{16 hex digits}.tmp`, next to the target `name`
# (`.{name}.{16 hex digits}.tmp` before the pid was added). The stem is `name`, or,
# for a name too long to leave room for the rest within the file system's limit on
# names, its first bytes and a hash of it (see `_temporary_stem`).
_TEMPORARY_ID = re.compile(r"(?:(?P<pid>\d+)\.)?[0-9a-f]{16}")
# The longest file name most file systems allow, in bytes (NAME_MAX on Linux).
_NAME_MAX = 255
# What a temporary name adds to its stem: `.`, `.{pid}.` (up to 10 digits), 16 hex
# digits and `.tmp`.
_TEMPORARY_EXTRA = 1 + 12 + 16 + 4
# Temporaries of saves in progress in this process (another thread may be writing).
_WRITING: set[str] = set()
_WRITING_LOCK = threading.Lock()


def _target_file(path: str) -> str:
    """Where the bytes of a checkpoint saved to `path` go: `path`, or the file its
    symlinks lead to, so that saving keeps the link and replaces what it points to."""
    return os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path)


def _temporary_stem(name: str) -> str:
    """The start of the names of `name`'s temporary files: `name` itself, or, if
    that would make them longer than file systems allow, its first bytes followed
    by `~` and a hash of the whole name (which keeps the stems of two long names
    apart)."""
    raw = os.fsencode(name)
    if len(raw) + _TEMPORARY_EXTRA <= _NAME_MAX:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:16]
    keep = _NAME_MAX - _TEMPORARY_EXTRA - 1 - len(digest)
    return raw[:keep].decode("utf-8", "ignore") + "~" + digest


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
    prefix, suffix = f".{_temporary_stem(name)}.", ".tmp"
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


def _keep_mode(target: str, tmp: str) -> None:
    """Gives `tmp` the permissions of the file `target` it replaces, if there is one:
    a checkpoint made private (`0o600`) or read-only stays so when saved again."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return
    os.chmod(tmp, mode)


def write_atomically(path: str, chunks: Iterable[bytes | memoryview]) -> None:
    """Writes to a temporary file next to the target and renames it onto the target,
    so a reader sees either the previous file or the whole new one, never a partial
    one. The target is `path`, or the file a symlink at `path` leads to; the new file
    keeps the permissions of the one it replaces."""
    target = _target_file(path)
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise CheckpointError(
            f"Cannot save a checkpoint to {path!r}: the directory {directory!r} does "
            "not exist. Create it first, e.g. with `os.makedirs(directory, "
            "exist_ok=True)`."
        )
    if os.path.isdir(target):
        raise CheckpointError(
            f"Cannot save a checkpoint to {path!r}: it is a directory. Pass the path "
            "of a file, e.g. `os.path.join(directory, 'model.eqstate')`; a directory "
            "of numbered checkpoints is written with `eqstate.CheckpointManager`."
        )
    _remove_stale_temporaries(target)
    tmp = os.path.join(
        directory,
        f".{_temporary_stem(os.path.basename(target))}.{os.getpid()}."
        f"{secrets.token_hex(8)}.tmp",
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
            _keep_mode(target, tmp)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        where = repr(path)
        if target != os.path.abspath(path):
            where += f" (a link to {target!r})"
        fix = (
            "Use a shorter file name: the file system limits each name's length."
            if e.errno == errno.ENAMETOOLONG
            else "Check that the directory is writable and the disk has space."
        )
        raise CheckpointError(
            f"Cannot save a checkpoint to {where}: {e.strerror or e}. Nothing was "
            f"written there: a checkpoint already at that path is unchanged. {fix}"
        ) from e
    finally:
        with _WRITING_LOCK:
            _WRITING.discard(tmp)
    _fsync_directory(directory)


# Writing and reading a checkpoint --------------------------------------------------


def _little_endian(array: np.ndarray) -> np.ndarray:
    if sys.byteorder == "big" and array.dtype.itemsize > 1:
        return array.byteswap()
    return array


def _host_bytes(spec: Leaf, leaf: Any) -> memoryview:
    check_savable(spec, leaf)
    require_fully_addressable(leaf, spec.where, "save", SAVE_FIX)
    if spec.key_impl is not None:
        leaf = jax.random.key_data(leaf)
    array = np.ascontiguousarray(_little_endian(np.asarray(leaf)))
    # A view as bytes: NumPy cannot export `ml_dtypes` types (bfloat16) as a buffer.
    return array.reshape(-1).view(np.uint8).data


def write_checkpoint(path: str, leaves: list[tuple[Leaf, Any]]) -> None:
    """Writes the arrays `leaves` (each with where it is stored) to a checkpoint file
    at `path`, atomically. Every array is checked before the file is opened."""
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
            "weak_type": spec.weak_type,
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
    write_atomically(path, [head, _CRC.pack(zlib.crc32(head)), *blobs])


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
        if is_orbax_checkpoint(path):
            raise CheckpointError(
                f"{path!r} is a checkpoint of the Orbax backend, not a single-file "
                "one: load it with `backend='orbax'`, or leave `backend` unset to "
                "pick the backend from the path."
            ) from None
        raise CheckpointError(
            f"{path!r} is a directory, not a checkpoint file. Pass the path of the "
            "file written by `eqstate.save`; a directory of numbered checkpoints "
            "loads with `eqstate.CheckpointManager(directory).load(model)`."
        ) from None
    except OSError as e:
        raise CheckpointError(
            f"Cannot read the checkpoint {path!r}: {e.strerror or e}."
        ) from e


def read_checkpoint(path: str) -> tuple[list[dict[str, Any]], memoryview]:
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


def _truncated(path: str, needed: str, got: int) -> CheckpointError:
    return CheckpointError(
        f"The checkpoint {path!r} is truncated: it has {got} bytes, but {needed}. "
        "It was probably cut short while being copied or downloaded; copy it "
        "again or use an earlier checkpoint."
    )


def _corrupted(path: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"The checkpoint {path!r} is corrupted: {what}. The file was changed after "
        "it was written (a disk or transfer error); copy it again or use an "
        "earlier checkpoint."
    )


def _read_verified(
    path: str, f: io.BufferedReader
) -> tuple[list[dict[str, Any]], memoryview]:
    info = os.fstat(f.fileno())
    # A regular file tells its size up front; a pipe or a device does not.
    size = info.st_size if stat.S_ISREG(info.st_mode) else None
    entries, data_start = _read_header(path, f, size)
    return entries, _read_data(path, f, size, entries, data_start)


def _read_header(
    path: str, f: io.BufferedReader, size: int | None
) -> tuple[list[dict[str, Any]], int]:
    """Reads and checks the preamble and the header of a checkpoint of `size` bytes
    (`None`: unknown). Returns the header's entries and where the data starts."""
    head = _read_up_to(f, _PREAMBLE.size, preallocate=False)
    if head[: len(_MAGIC)] != _MAGIC[: len(head)]:
        raise CheckpointError(
            f"{path!r} is not an eqstate checkpoint: it does not start with the "
            f"magic bytes {_MAGIC!r}. Pass a file written by `eqstate.save`."
        )
    if len(head) < _PREAMBLE.size:
        raise _truncated(
            path, f"its fixed-size start alone is {_PREAMBLE.size}", len(head)
        )
    _, version, header_size = _PREAMBLE.unpack_from(head)
    if version != _VERSION:
        raise CheckpointError(
            f"The checkpoint {path!r} has format version {version}, but this version "
            f"of eqstate reads only version {_VERSION}. Load it with the eqstate "
            "release that wrote it (a newer one, if the version is higher)."
        )
    data_start = _PREAMBLE.size + header_size + _CRC.size
    if size is not None and size < data_start:
        raise _truncated(path, f"its header ends at byte {data_start}", size)
    rest = _read_up_to(f, header_size + _CRC.size, preallocate=size is not None)
    if len(rest) < header_size + _CRC.size:
        raise _truncated(
            path, f"its header ends at byte {data_start}", _PREAMBLE.size + len(rest)
        )
    (header_crc,) = _CRC.unpack_from(rest, header_size)
    if zlib.crc32(rest[:header_size], zlib.crc32(head)) != header_crc:
        raise _corrupted(path, "the checksum of its header does not match")
    return _parse_header(path, bytes(rest[:header_size])), data_start


def _read_data(
    path: str,
    f: io.BufferedReader,
    size: int | None,
    entries: list[dict[str, Any]],
    data_start: int,
) -> memoryview:
    """Reads the data section that `entries` describe, which must end the file, and
    checks every entry's checksum."""
    data_size = sum(entry["length"] for entry in entries)
    end = data_start + data_size
    if size is not None and size < end:
        raise _truncated(path, f"its {len(entries)} entries end at byte {end}", size)
    if size is not None and size > end:
        raise _corrupted(
            path, f"it has {size - end} bytes after its last entry, where it should end"
        )
    data = _read_up_to(f, data_size, preallocate=size is not None)
    if len(data) < data_size:
        raise _truncated(
            path,
            f"its {len(entries)} entries end at byte {end}",
            data_start + len(data),
        )
    if size is None and f.read(1):
        raise _corrupted(path, "it has bytes after its last entry, where it should end")
    for entry in entries:
        blob = data[entry["offset"] : entry["offset"] + entry["length"]]
        if zlib.crc32(blob) != entry["crc32"]:
            raise _corrupted(
                path,
                f"the bytes of entry `{entry['path']}` (shape "
                f"{tuple(entry['shape'])}, dtype {entry['dtype']}) do not match "
                "their checksum",
            )
    return data


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
        if not isinstance(entry.get("weak_type", False), bool):
            raise malformed(f"entry `{name}` has an invalid 'weak_type'")
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


def _read_array(spec: Leaf, entry: dict[str, Any], data: memoryview) -> np.ndarray:
    """The array of a checked `entry` of the data section `data`, in `spec`'s dtype
    and shape (a copy, which does not hold on to the whole file)."""
    raw = data[entry["offset"] : entry["offset"] + entry["length"]]
    array = _little_endian(np.frombuffer(raw, dtype=spec.dtype)).reshape(spec.shape)
    return np.array(array)


def read_into(path: str, target: Target) -> tuple[list[Any], dict[str, Any]]:
    """The arrays of the checkpoint file at `path` for `target.specs` (each made and
    placed as its target value expects), and its entries by path. The whole file is
    read and checked first."""
    entries, data = read_checkpoint(path)
    specs = [spec for spec, _ in target.specs]
    by_path = check_entries(path, target.name, specs, entries)
    arrays = [
        as_loaded(spec, leaf, _read_array(spec, by_path[spec.path], data))
        for spec, leaf in target.specs
    ]
    return arrays, by_path
