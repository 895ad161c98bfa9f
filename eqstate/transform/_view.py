"""Views: frames that show a discovery trace the calling frame's values, changed (a
lane's slice of a mapped state, a device's shard)."""

from .. import _context, _jax_compat as compat
from .._custom_types import MISSING


compat.hide_from_tracebacks(__file__)


class View(_context.Frame):
    """The parent of a discovery trace, showing it the values of `parent` as the
    transform's body will see them. Only read through: the trace keeps its writes and
    new states, and the transform commits them to `parent` itself."""

    __slots__ = ("parent",)

    def __init__(self, parent: _context.Frame):
        self.parent = parent

    def read(self, state):
        return self.fetch(state)

    def write(self, state, value):
        raise NotImplementedError(_READ_ONLY)

    def commit(self, updates, new=()):
        raise NotImplementedError(_READ_ONLY)

    def add_new(self, state, value):
        raise NotImplementedError(_READ_ONLY)


class Overlay(View):
    """The parent of a trace, showing it `values` for some states and the values of
    `parent` for the others: a `jit` plan's body traces the function against the
    states moved to their `state_shardings`, whose types may differ from the values
    in `parent` (explicit mesh axes put the sharding in the type)."""

    passes_nested_on = True  # See `eqstate._context.AnswersNested`.
    __slots__ = ("values",)

    def __init__(self, parent: _context.Frame, values: dict):
        super().__init__(parent)
        self.values = values

    def fetch(self, state):
        value = self.values.get(state, MISSING)
        return self.parent.fetch(state) if value is MISSING else value

    def peek(self, state):
        value = self.values.get(state, MISSING)
        return self.parent.peek(state) if value is MISSING else value


_READ_ONLY = "A view is only read through; write to the frame it views."
