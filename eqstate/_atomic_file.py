"""Writing a checkpoint file atomically: a reader sees either the previous file or the
whole new one. Temporary files that killed saves left behind are removed by the next
save to the same path."""

import contextlib
import errno
import hashlib
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterable

from ._errors import CheckpointError


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
