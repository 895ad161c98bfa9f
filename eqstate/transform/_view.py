"""Views: frames that show a discovery trace the calling frame's values, changed (a
lane's slice of a mapped state, a device's shard)."""

from .. import _context, _jax_compat as compat


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


_READ_ONLY = "A view is only read through; write to the frame it views."
