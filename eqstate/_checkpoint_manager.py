"""`CheckpointManager`: a directory of numbered Orbax checkpoints of a training run,
saved in the background, and what makes sure that a manager nobody closed still
finishes its saves."""

import functools as ft
import gc
import operator
import os
import queue
import shutil
import sys
import threading
import weakref
from collections.abc import Mapping
from typing import Any, overload, TypeVar

import jax
import numpy as np

from ._checkpoint import refuse_under_transforms
from ._checkpoint_paths import leaves_to_save, load_target, loaded_into
from ._custom_types import PyTree
from ._errors import CheckpointError
from ._multi_process import exchange
from ._orbax import (
    CHECKPOINT_FILE,
    orbax,
    orbax_write_errors,
    refuse_to_replace,
    restore_with,
    save_args,
    SAVING,
)
from ._state import State
from ._state_dict import StateDict


_M = TypeVar("_M")


def _process_0s(step: int | None) -> int | None:
    """Process 0's `step`, in every process."""
    with SAVING:  # Exchanges are met in the order each process makes them.
        return exchange(step, "agree on the latest checkpoint")[0]


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
            if (metadata.path / CHECKPOINT_FILE).is_file()
        )

    def find_step(self, base_path: Any, step: int) -> Any:
        metadata = self._name_format.find_step(base_path, step)
        if not (metadata.path / CHECKPOINT_FILE).is_file():
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
        directory: str | os.PathLike[str],
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

        with SAVING:
            args = save_args(self._ocp, step_path, step, prepare)
            with orbax_write_errors(step_path):
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
        return loaded_into(
            target, *restore_with(lambda a: restore(args=a), where, target)
        )

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
        if os.path.isfile(os.path.join(step_path, CHECKPOINT_FILE)):
            raise CheckpointError(
                f"Cannot save checkpoint {step} in {self.directory!r}: another manager "
                "or program saved that step after this manager was made, and saving "
                "would replace it. Nothing was written or removed. Keep one manager "
                "per directory, or make a new one, which sees every step saved, and "
                "save a later step."
            )
        fix = _STEP_FIX.format(directory=self.directory)
        refuse_to_replace(step_path, f"checkpoint {step}", (fix, fix))

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
