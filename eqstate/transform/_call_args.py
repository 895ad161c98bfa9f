"""A call's arguments as a trace sees them: a hashable cache key, the leaves that are
traced, and what it takes to put the call back together."""

import dataclasses
import inspect
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import jax.tree_util as jtu

from .. import _jax_compat as compat
from .._arguments import given
from ._leaves import in_module, is_traced, signature
from ._split_args import typed_static


@dataclasses.dataclass(frozen=True, slots=True)
class CallArgs:
    """The arguments of one call, split by `ArgParser.parse`: its cache `key`, its
    traced `leaves`, and how to rebuild it (`rebuild`)."""

    key: Hashable
    leaves: list
    _treedef: Any
    _template: list
    _index: list
    _static: list
    _static_kw: tuple

    def rebuild(self, leaves: Sequence[Any]) -> tuple[tuple, dict]:
        """`(args, kwargs)` with the traced leaves replaced by `leaves`."""
        full = list(self._template)
        for i, leaf in zip(self._index, leaves):
            full[i] = leaf
        dyn_args, kwargs = jtu.tree_unflatten(self._treedef, full)
        args = list(dyn_args)
        for i, value in self._static:
            args.insert(i, value)
        return tuple(args), {**kwargs, **dict(self._static_kw)}


class ArgParser:
    """Splits the calls of one function (its static arguments given as in `jax.jit`)
    into `CallArgs`.

    As in `jax.jit`, a static argument may be passed by position or by keyword:
    `static_positions` holds `static_argnums` and the positions of the parameters
    named in `static_argnames`; `static_argnames` holds those names and the names of
    the parameters at `static_argnums`.

    `transformed_argnums`, for a transform of some arguments only (`grad`'s
    `argnums`): Python scalars elsewhere (in the other arguments, and keyword
    arguments) stay static, as a JAX transform passes them to the function as they
    are, so that `range(n)` works. `transformed_axes`, instead, for a transform of
    some leaves only (`vmap`'s `in_axes`): one prefix tree per positional argument,
    whose `None` entries leave their Python scalars static (`transformed_argnums`
    stands for the axes `0` at those positions, `None` elsewhere)."""

    def __init__(
        self,
        fun: Callable,
        name: str,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        transformed_argnums: Sequence[int] | None = None,
        transformed_axes: tuple | None = None,
    ):
        self.name = name
        self.transformed_argnums = transformed_argnums
        self.transformed_axes = transformed_axes
        self.static_argnums = _as_tuple(static_argnums, int, "static_argnums")
        names = _as_tuple(static_argnames, str, "static_argnames")
        params = _parameters(fun)
        if params is not None:
            _check_argnums(self.static_argnums, params, name)
            _check_argnames(names, params, name)
        positions = self.static_argnums + _positions_of(params, names)
        self.static_positions = tuple(dict.fromkeys(positions))
        names += _names_of(params, self.static_argnums)
        self.static_argnames = tuple(dict.fromkeys(names))

    def parse(
        self, args: tuple, kwargs: dict, axis_env: Sequence | None = None
    ) -> CallArgs:
        """Splits a call's arguments into its cache key and its traced leaves: array
        leaves and Python scalars are traced (see `is_traced`), static arguments and
        other leaves are hashed into the key (handles by identity). `axis_env`: the
        named axes the call is traced inside besides those around it."""
        n = len(args)
        static_at: dict[int, Any] = {}
        for i in self.static_positions:
            # Two spellings of one position (`1` and `-1`) make it static once.
            # A position beyond the call's arguments is passed by keyword (then
            # static by its name) or left at its default.
            if -n <= i < n and i % n not in static_at:
                static_at[i % n] = _hashable(args[i], f"static argument {i}", self.name)
        static = sorted(static_at.items())
        static_index = static_at.keys()
        static_kw = tuple(
            (k, _hashable(kwargs[k], f"static argument {k!r}", self.name))
            for k in sorted(kwargs)
            if k in self.static_argnames
        )
        dyn_args = tuple(a for i, a in enumerate(args) if i not in static_index)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, treedef = jtu.tree_flatten((dyn_args, dyn_kwargs))
        fields = in_module((dyn_args, dyn_kwargs))
        mask = [is_traced(x, m) for x, m in zip(leaves, fields)]
        axes = self.transformed_axes
        if self.transformed_argnums is not None:
            wanted = {i % n for i in self.transformed_argnums if -n <= i < n}
            axes = tuple(0 if i in wanted else None for i in range(n))
        if axes is not None:
            transformed = _leaves_under_axes(dyn_args, leaves, axes, n, static_index)
            mask = [
                m and (t or not _is_python_scalar(x))
                for x, m, t in zip(leaves, mask, transformed)
            ]
        sigs, dynamic_index, dynamic, template = [], [], [], []
        for i, (leaf, traced) in enumerate(zip(leaves, mask)):
            if traced:
                sigs.append(signature(leaf))
                dynamic_index.append(i)
                dynamic.append(leaf)
                template.append(None)
            else:
                leaf = _hashable(leaf, "an argument leaf", self.name)
                sigs.append(("static", *typed_static(leaf)))
                template.append(leaf)
        # Static values with their types, as `jax.jit` keys them: `1`, `1.0` and
        # `True` are equal, but may trace differently (dtypes, `is True`); so are
        # `0.0` and `-0.0` (`1 / x`).
        typed = tuple((i, *typed_static(v)) for i, v in static)
        typed_kw = tuple((k, *typed_static(v)) for k, v in static_kw)
        # JAX's configuration and mapped axes too, as `jax.jit` keys its traces: a
        # trace made with 64-bit mode off, or under a `vmap` of another size, is
        # not one for this call.
        key = (typed, typed_kw, treedef, tuple(sigs), compat.trace_context(axis_env))
        return CallArgs(
            key, dynamic, treedef, template, dynamic_index, static, static_kw
        )


def _is_python_scalar(x: Any) -> bool:
    return type(x) in (bool, int, float, complex)


def _leaves_under_axes(
    dyn_args: tuple,
    leaves: list,
    axes: tuple,
    n: int,
    static_index: Any,
) -> list[bool]:
    """For each of `leaves` (of `(dyn_args, kwargs)`, flattened), whether `axes` (one
    prefix tree per positional argument of a call with `n` of them, the static ones
    left out of `dyn_args`) gives it an axis rather than `None`."""
    positions = [i for i in range(n) if i not in static_index]
    marks: list[bool] = []
    for i, arg in zip(positions, dyn_args):
        marks += _mapped_leaves(axes[i] if i < len(axes) else None, arg)
    return marks + [False] * (len(leaves) - len(marks))


def _mapped_leaves(axis: Any, arg: Any) -> list[bool]:
    """For each leaf of `arg`, whether the prefix tree `axis` gives it an axis. An
    `axis` that does not fit `arg` marks every leaf (the transform names the
    mismatch)."""
    n_leaves = jtu.tree_structure(arg).num_leaves
    try:
        marked = jtu.tree_map(
            lambda a, sub: [a is not None] * jtu.tree_structure(sub).num_leaves,
            axis,
            arg,
            is_leaf=lambda x: x is None,
        )
    except (ValueError, TypeError):
        return [True] * n_leaves
    marks = jtu.tree_leaves(marked)
    return marks if len(marks) == n_leaves else [True] * n_leaves


def _as_tuple(x: Any, kind: type, what: str) -> tuple:
    """`x`, one `kind` or an iterable of them (a `bool` is no `int` here), as a
    tuple; else `TypeError`."""
    single = isinstance(x, (kind, bool, str)) or not isinstance(x, Iterable)
    items = (x,) if single else tuple(x)
    noun = "an integer" if kind is int else "a string"
    for item in items:
        if not isinstance(item, kind) or isinstance(item, bool):
            raise TypeError(
                f"`{what}` must be {noun} or a sequence of them, {given(item)}."
            )
    return items


_POSITIONAL = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
)


def _parameters(fun: Callable) -> list[inspect.Parameter] | None:
    """The parameters of `fun`, or `None` if it has no signature (some builtins)."""
    try:
        return list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return None


def _check_argnums(
    argnums: tuple[int, ...], params: list[inspect.Parameter], name: str
) -> None:
    """Raises `ValueError` for a number beyond the positional parameters, as
    `jax.jit` does (any number fits a function taking `*args`)."""
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return
    n = sum(p.kind in _POSITIONAL for p in params)
    for i in argnums:
        if not -n <= i < n:
            raise ValueError(
                f"`static_argnums` holds {i}, but {name} takes {n} positional "
                "argument(s). Give the positions of its parameters, counting from 0 "
                "(or from -1 at the end)."
            )


def _check_argnames(
    names: tuple[str, ...], params: list[inspect.Parameter], name: str
) -> None:
    """Raises `ValueError` for a name that is no parameter's, as `jax.jit` does (any
    name fits a function taking `**kwargs`)."""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    var = inspect.Parameter.VAR_POSITIONAL
    known = [p.name for p in params if p.kind is not var]
    for n in names:
        if n not in known:
            raise ValueError(
                f"`static_argnames` holds {n!r}, but {name} has no parameter of that "
                f"name (its parameters: {', '.join(known) or 'none'}). Name one of "
                "them, or leave it out."
            )


def _positions_of(
    params: list[inspect.Parameter] | None, names: tuple[str, ...]
) -> tuple[int, ...]:
    if not names or params is None:
        return ()
    return tuple(
        i for i, p in enumerate(params) if p.kind in _POSITIONAL and p.name in names
    )


def _names_of(
    params: list[inspect.Parameter] | None, argnums: tuple[int, ...]
) -> tuple[str, ...]:
    """The names of the parameters at `argnums` that can be passed by keyword. As in
    `jax.jit`, a negative number names none: it counts from the end of each call's
    positional arguments, whatever their number."""
    if not argnums or params is None:
        return ()
    keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return tuple(
        p.name for i, p in enumerate(params) if p.kind is keyword and i in argnums
    )


def _hashable(x: Any, what: str, where: str) -> Any:
    try:
        hash(x)
    except TypeError:
        raise TypeError(
            f"{where} got an unhashable {what}: {x!r} of type {type(x).__name__}. "
            "Static arguments (and non-array leaves of arguments) are part of the "
            "cache key, so they must be hashable. Make it a tuple or frozen "
            "dataclass, or pass it as an array so that it is traced."
        ) from None
    return x
