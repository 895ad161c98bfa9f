"""Frames that run part of a loop or a conditional directly, without tracing it: the
eager form of the control flow under `jax.disable_jit()`, and the read-only frame of a
loop condition."""

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from .. import _context, _jax_compat as compat
from .._custom_types import MISSING
from .._errors import NewStateError
from .._pretty_print import state_label
from .._state import lock_keys
from .._write_checks import check_write, refuse_leaked_tracers


compat.hide_from_tracebacks(__file__)


_CREATES_STATES = (
    "{where} creates states ({label}). States cannot be created inside it, because "
    "each call or iteration would create another set. Create them before, outside "
    "the transformed function."
)

_CONDITION_WRITES = (
    "{where} writes {label}. The condition may read states but not write them: move "
    "the write into `body_fun`."
)


def jit_disabled() -> bool:
    """Whether `jax.disable_jit()` is in effect: control flow then runs eagerly, as
    `jax.lax.scan`, `jax.lax.cond` and the others do."""
    # A config value set by a context manager, so read as an attribute (pyright
    # does not know the attribute).
    return bool(getattr(jax.config, "jax_disable_jit"))  # noqa: B009


class _GuardFrame(_context.Frame):
    """Runs code directly against its parent frame: reads fall through (recorded by
    the parent as usual), writes are kept here and handed to the parent only by
    `commit_to_parent`, so that a failure leaves the parent as it was. States cannot be
    created here; with `read_only`, they cannot be written either."""

    __slots__ = ("eager", "parent", "read_only", "values", "where")
    snapshots_at_once = True

    def __init__(self, parent: _context.Frame, where: str, read_only: bool):
        self.parent = parent
        self.where = where
        self.read_only = read_only
        self.values: dict[Any, Any] = {}
        self.jax_trace = compat.current_trace()
        self.eager = compat.is_top_level()

    def read(self, state):
        value = self.values.get(state, MISSING)
        if value is MISSING:
            # A key read here is written back by `commit_to_parent`, at the end.
            lock_keys(self.parent, (state,))
            return self.parent.read(state)
        return value

    def fetch(self, state):
        value = self.values.get(state, MISSING)
        return self.parent.fetch(state) if value is MISSING else value

    def _check_writable(self, state: Any) -> None:
        if self.read_only:
            raise ValueError(
                _CONDITION_WRITES.format(where=self.where, label=state_label(state))
            )
        self.check_trace(state)

    def write(self, state, value):
        self._check_writable(state)
        refuse_leaked_tracers(state, value, self.eager)
        self.values[state] = check_write(state, self.fetch(state), value)

    def commit(self, updates, new=()):
        if new:
            self.add_new(*new[0])
        for state in updates:
            self._check_writable(state)
        self.values.update(updates)

    def add_new(self, state, value):
        raise NewStateError(
            _CREATES_STATES.format(where=self.where, label=state_label(state))
        )

    def peek(self, state):
        value = self.values.get(state, MISSING)
        return self.parent.peek(state) if value is MISSING else value

    def commit_to_parent(self) -> None:
        if self.values:
            self.parent.commit(dict(self.values))


@contextlib.contextmanager
def guarded(where: str, *, read_only: bool = False) -> Iterator[_GuardFrame]:
    """Runs the `with` block in a `_GuardFrame` over the current frame. Its writes
    reach the current frame only if the block succeeds (never with `read_only`).

    **Arguments:**

    - `where`: the code that runs, in messages, e.g. "the body of `scan`".
    - `read_only`: refuse writes (`ValueError`), as a loop condition must.
    """
    frame = _GuardFrame(_context.current_frame(), where, read_only)
    token = _context.enter(frame)
    try:
        yield frame
    finally:
        _context.leave(token)
    frame.commit_to_parent()
