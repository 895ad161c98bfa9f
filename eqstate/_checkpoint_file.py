"""The single-file checkpoint format: writing a file from arrays and reading it back,
checking every byte.

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
- `weak_type`: whether the array was weakly typed (made from a Python scalar), a
    boolean; loading restores it. Files written before eqstate recorded it lack the
    field: their arrays take the weak type of the target's current values;
- `key_impl` (PRNG keys only): the key implementation, e.g. `"threefry2x32"`. The
    entry then holds `jax.random.key_data` of the keys, and loading restores them with
    `jax.random.wrap_key_data(data, impl=key_impl)`.

An array's bytes are its elements in C order, little-endian. Every byte of the file is
covered by a check: the magic, the version, the header CRC, the entries' CRCs and the
exact file size.
"""

import io
import json
import math
import os
import stat
import struct
import sys
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  # registers the names `bfloat16`, `float8_*` with NumPy
import numpy as np

from ._atomic_file import write_atomically
from ._checkpoint_checks import check_savable
from ._checkpoint_paths import Leaf
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


def read_array(spec: Leaf, entry: dict[str, Any], data: memoryview) -> Any:
    """The array of a checked `entry` of the data section `data`, as `spec` expects it
    (PRNG keys wrapped again, NumPy arrays left as such)."""
    raw = data[entry["offset"] : entry["offset"] + entry["length"]]
    array = _little_endian(np.frombuffer(raw, dtype=spec.dtype)).reshape(spec.shape)
    if spec.numpy:
        return np.array(array)  # a copy, which does not hold on to the whole file
    value = jnp.asarray(array)
    if spec.key_impl is not None:
        value = jax.random.wrap_key_data(value, impl=spec.key_impl)
    return value
