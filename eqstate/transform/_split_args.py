"""A call's arguments as `jit` hands them to `jax.jit`: a *key* and dynamic leaves.

`jax.jit` takes PyTrees of arrays, and hashes and compares its static arguments at
each call. `jit` passes every call *split* instead: its key, a tuple of small
integers that stand for each argument's tree structure and static leaves (handles,
strings, static arguments, a Module's Python `bool`), which selects a `jax.jit` made
with those bound; and the list of the dynamic leaves (arrays and Python scalars,
traced as `jax.jit` traces them). An output holding static leaves comes back as its
dynamic leaves and is rebuilt from what its trace recorded.

Splitting flattens each argument in Python, which costs time for an `eqx.Module`.
A positional argument that is the very object of the previous call at that position,
and whose tree holds no mutable container (only tuples, `None` and Modules, which are
frozen), cannot have changed: its split is reused. One holding lists or dicts (a
model's list of layers) is reused when each of those still holds the very objects it
held then.
"""

import dataclasses
import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from operator import is_
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from .._custom_types import PyTreeDef
from .._jax_compat import is_top_level
from .._state import State
from ._leaves import ArrayImpl, dynamic_mask, in_module, is_traced


# Distinct argument structures remembered per jitted function; the least recently
# made is forgotten first (its number is never reused).
KEYS_KEPT = 256
_ids = itertools.count()
# The part of a bare array argument.
_ARRAY = -1


class _ArrayKeys(dict):
    """The keys of calls of `n` arrays alone, by `n`."""

    def __missing__(self, n: int) -> tuple:
        key = self[n] = (_ARRAY,) * n
        return key


ARRAY_KEYS = _ArrayKeys()


class OutputMismatch(Exception):
    """Two traces for one key built outputs of different structures (the structure
    depends on the arguments' shapes): such calls cannot be rebuilt from the key."""


class Static:
    """A static value (an argument in `static_argnums`, a non-array leaf riding in a
    tree structure): hashed by value, equal only to the very same value (see
    `same_static`)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return hash(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and same_static(self.value, other.value)

    def __repr__(self) -> str:
        return f"Static({self.value!r})"


def same_static(a: Any, b: Any) -> bool:
    """Whether two static values are the same: equal, of one type (`1 == 1.0 ==
    True`, which `jax.jit` keys apart) and, for floats, of one sign (`-0.0 == 0.0`).
    An object is the same as itself, even a NaN (as in JAX's own comparisons)."""
    if a is b:
        return True
    if type(a) is not type(b) or not a == b:
        return False
    return not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b)


def typed_static(value: Any) -> tuple:
    """A static value for a cache key, told apart from others as `same_static` tells
    them: with its type and, for a float, its sign."""
    if isinstance(value, float):
        return (type(value), value, math.copysign(1.0, value))
    return (type(value), value)


class ArgSplitter:
    """Splits calls into `(key, dynamic leaves)`; see the module documentation."""

    def __init__(self, static_positions: Sequence[int], static_names: Sequence[str]):
        self._static_positions = tuple(static_positions)
        self.no_static_below = _first_static(static_positions)
        self._static_names = frozenset(static_names)
        # position -> (argument, part, dynamic leaves, its lists and dicts as they
        # were, or `None` for a frozen tree: see `_mutable_containers`)
        self._last: dict[int, tuple[Any, int, list, tuple | None]] = {}
        # The part of keyword arguments that are all static, by their names, types
        # and values (see `_static_kwargs`).
        self._kwargs: dict[tuple, int] = {}
        # The first argument of the last call that had one remembered (see `_last`):
        # `(argument, its lists and dicts, part, dynamic leaves)`.
        self._recent: tuple | None = None
        self._parts = _Numbering(on_forget=self._forget)
        self._frozen: dict[PyTreeDef, bool] = {}
        self._fields: dict[PyTreeDef, list[bool]] = {}  # see `in_module`

    def _forget(self) -> None:
        """Forgets what refers to parts (one was forgotten)."""
        self._last.clear()
        self._kwargs.clear()
        self._recent = None

    def split(self, args: tuple, kwargs: dict) -> tuple[tuple, Sequence[Any]]:
        """`(key, dynamic leaves)` of a call. Raises `TypeError` for an unhashable
        static value."""
        if len(args) <= self.no_static_below:
            # The usual calls, split without a loop over parts: `f(model, *arrays)`
            # with the model of the last such call, and `f(*arrays)` with static
            # keyword arguments alone (`train=True`).
            recent = self._recent
            if recent is not None and args and args[0] is recent[0] and not kwargs:
                rest = args[1:]
                for arg in rest:
                    if type(arg) is not ArrayImpl:
                        break
                else:
                    watched = recent[1]  # `_unchanged`, inlined for handles alone
                    if watched is None or (
                        watched[0] == watched[1]
                        and (not watched[2] or _unchanged(watched))
                    ):
                        return (recent[2], *ARRAY_KEYS[len(rest)]), recent[3] + rest
            for arg in args:
                if type(arg) is not ArrayImpl:
                    break
            else:
                key = ARRAY_KEYS[len(args)]
                if not kwargs:
                    return key, args
                part = self._static_kwargs(kwargs)
                if part is not None:
                    return (*key, part), args
        static = self._static_of(len(args)) if self._static_positions else ()
        parts: list[int] = []
        dynamic: list[Any] = []
        remembered = self._last
        for i, arg in enumerate(args):
            if i in static:
                parts.append(self._parts.number((None, Static(arg))))
                continue
            if type(arg) is ArrayImpl:
                parts.append(_ARRAY)
                dynamic.append(arg)
                continue
            last = remembered.get(i)
            if (
                last is None
                or last[0] is not arg
                or (last[3] is not None and not _unchanged(last[3]))
            ):
                again = last is not None and last[0] is arg
                last = self._split_remembered(i, arg, again)
            parts.append(last[1])
            dynamic.extend(last[2])
            if i == 0 and remembered.get(0) is last and last[3] is not _UNWATCHED:
                self._recent = (arg, last[3], last[1], tuple(last[2]))
        if kwargs:
            part = self._static_kwargs(kwargs)
            if part is None:
                names = self._static_names
                marked = _Kwargs(
                    (k, Static(v) if k in names else v)
                    for k, v in sorted(kwargs.items())
                )
                part, leaves = self._split_tree(marked)
                dynamic.extend(leaves)
            parts.append(part)
        return tuple(parts), dynamic

    def _static_kwargs(self, kwargs: dict) -> int | None:
        """The part of keyword arguments that are all static (a `train` flag), found
        without flattening them (made on a miss); `None` for others."""
        if not self._static_names.issuperset(kwargs):
            return None
        values = tuple(kwargs.values())
        types = tuple(map(type, values))
        if float in types:  # and the signs of floats: `-0.0 == 0.0`
            types += tuple(math.copysign(1.0, v) for v in values if type(v) is float)
        seen = (tuple(kwargs), types, values)
        part = self._kwargs.get(seen)
        if part is None:
            marked = _Kwargs((k, Static(v)) for k, v in sorted(kwargs.items()))
            part = self._split_tree(marked)[0]
            if len(self._kwargs) >= KEYS_KEPT:
                self._kwargs.clear()
            self._kwargs[seen] = part
        return part

    def specs(self, key: tuple) -> tuple:
        """What each part of `key` stands for, to rebuild its calls (`rebuild`).
        Raises `KeyError` if a part was forgotten since the call was split."""
        return tuple(None if p == _ARRAY else self._parts.value(p) for p in key)

    def _static_of(self, n: int) -> set[int]:
        """The static positions of a call with `n` positional arguments."""
        return {i % n for i in self._static_positions if -n <= i < n}

    def _split_remembered(self, position: int, arg: Any, again: bool) -> tuple:
        """The split of a positional argument, remembered for the next call at top
        level. Its lists and dicts are watched (`_mutable_containers`, a walk of the
        whole argument) only when it is passed `again`: a training loop passes a new
        model at every call, an evaluation loop the same one."""
        part, leaves = self._split_tree(arg)
        treedef = self._parts.value(part)[0]
        frozen = self._frozen.get(treedef)
        if frozen is None:
            frozen = self._frozen[treedef] = _is_frozen(treedef)
        if frozen:
            watched = None
        else:
            watched = _mutable_containers(arg) if again else _UNWATCHED
        split = (arg, part, leaves, watched)
        # Inside a trace the argument holds tracers, which must not outlive it.
        if (frozen or watched is not None) and is_top_level():
            self._last[position] = split
        return split

    def _split_tree(self, tree: Any) -> tuple[int, list]:
        leaves, treedef = jtu.tree_flatten(tree)
        fields = self._fields.get(treedef)
        if fields is None:
            fields = self._fields[treedef] = in_module(tree)
        # `type(x) is ArrayImpl` first: `isinstance(x, jax.Array)` costs ~0.3 us.
        mask = [type(x) is ArrayImpl or is_traced(x, f) for x, f in zip(leaves, fields)]
        if False not in mask:  # an optimiser's state, a model of arrays alone
            return self._parts.number((treedef, (), (), ())), leaves
        static = tuple(i for i, traced in enumerate(mask) if not traced)
        dynamic = [x for x, traced in zip(leaves, mask) if traced]
        static_leaves = tuple(leaves[i] for i in static)
        types = tuple(map(type, static_leaves))  # see `Static.__eq__`
        if float in types:  # and the signs of floats: `-0.0 == 0.0`
            types += tuple(
                math.copysign(1.0, x) for x in static_leaves if type(x) is float
            )
        return self._parts.number((treedef, static, static_leaves, types)), dynamic


def _first_static(static_positions: Sequence[int]) -> int | float:
    """The number of positional arguments below which a call has none static."""
    if any(i < 0 for i in static_positions):
        return 0
    return min(static_positions, default=math.inf)


def rebuild(specs: tuple, dynamic: Sequence[Any]) -> tuple[tuple, dict]:
    """The `(args, kwargs)` of a call split with a key of these `specs` (see
    `ArgSplitter.specs`), with `dynamic` as its dynamic leaves (tracers, while
    tracing)."""
    rest = iter(dynamic)
    trees = []
    for spec in specs:
        if spec is None:
            trees.append(next(rest))
        elif is_static(spec):
            trees.append(spec[1].value)
        else:
            treedef, static, static_leaves, _ = spec
            full = [next(rest) for _ in range(treedef.num_leaves - len(static))]
            for i, leaf in zip(static, static_leaves):
                full.insert(i, leaf)
            trees.append(jtu.tree_unflatten(treedef, full))
    if trees and isinstance(trees[-1], _Kwargs):
        kwargs = trees.pop()
        return tuple(trees), {
            k: v.value if isinstance(v, Static) else v for k, v in kwargs.items()
        }
    return tuple(trees), {}


def positional_specs(specs: tuple) -> tuple:
    """The specs of the positional arguments among a key's `specs`."""
    if specs and specs[-1] is not None and not is_static(specs[-1]):
        if (specs[-1][0].node_data() or (None,))[0] is _Kwargs:
            return specs[:-1]
    return specs


def is_static(spec: Any) -> bool:
    """Whether an argument split as `spec` is a static argument."""
    return spec is not None and spec[0] is None


def dynamic_count(spec: Any) -> int:
    """The number of dynamic leaves of an argument split as `spec`."""
    if spec is None:
        return 1
    return 0 if is_static(spec) else spec[0].num_leaves - len(spec[1])


def template(spec: Any, dynamic: Any) -> Any:
    """The argument split as `spec`, with `dynamic` in place of each dynamic leaf."""
    if spec is None:
        return dynamic
    if is_static(spec):
        return spec[1].value
    return rebuild((spec,), [dynamic] * dynamic_count(spec))[0][0]


def record_output(known: tuple | None, out: Any) -> tuple[tuple, list]:
    """`(record, dynamic leaves)` of `out` (while tracing): the record rebuilds it
    (`output`). Raises `OutputMismatch` if `known`, the record of another trace for
    the same calls, differs."""
    leaves, treedef = jtu.tree_flatten(out)
    mask = dynamic_mask(out)
    record = (
        treedef,
        tuple(i for i, traced in enumerate(mask) if traced),
        tuple((i, x) for i, (x, traced) in enumerate(zip(leaves, mask)) if not traced),
    )
    if known is not None and known != record:
        raise OutputMismatch
    return record, [x for x, traced in zip(leaves, mask) if traced]


def output(record: tuple, dynamic: Sequence[Any]) -> Any:
    """The output recorded by `record_output`, from its dynamic leaves."""
    treedef, dynamic_index, static = record
    full: list[Any] = [None] * treedef.num_leaves
    for i, leaf in static:
        full[i] = leaf
    for i, leaf in zip(dynamic_index, dynamic):
        full[i] = leaf
    return jtu.tree_unflatten(treedef, full)


class _Kwargs(dict):
    """The keyword arguments of a call, told apart from a positional dict."""


jtu.register_pytree_node(
    _Kwargs,
    lambda d: (tuple(d.values()), tuple(d)),
    lambda keys, values: _Kwargs(zip(keys, values)),
)


class _Numbering:
    """Numbers hashable values: the same value, the same number, for the last
    `KEYS_KEPT` values."""

    def __init__(self, on_forget: Callable[[], None]):
        self._numbers: OrderedDict[Any, int] = OrderedDict()
        self._values: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._on_forget = on_forget

    def number(self, value: Any) -> int:
        number = self._numbers.get(value)
        if number is None:
            with self._lock:
                number = self._numbers.get(value)
                if number is None:
                    while len(self._numbers) >= KEYS_KEPT:
                        _, old = self._numbers.popitem(last=False)
                        del self._values[old]
                        self._on_forget()
                    number = self._numbers[value] = next(_ids)
                    self._values[number] = value
        return number

    def value(self, number: int) -> Any:
        return self._values[number]


# An argument seen once: its lists and dicts were not watched, so its split is not
# reused (see `ArgSplitter._split_remembered`).
_UNWATCHED: Any = ("unwatched",)


def _is_frozen(treedef: PyTreeDef) -> bool:
    """Whether a tree of this structure cannot change while its root object stays
    the same: its nodes are tuples, `None` and `eqx.Module`s (frozen)."""
    data = treedef.node_data()
    if data is None:
        return True  # a leaf
    kind = data[0]
    if not (kind is tuple or kind is type(None) or issubclass(kind, eqx.Module)):
        return False
    return all(_is_frozen(child) for child in treedef.children())


def _mutable_containers(tree: Any) -> tuple[tuple, tuple, list] | None:
    """The lists and dicts in `tree` as they are now, to tell later whether they
    changed; `None` if the tree has a node that is none of list, dict, tuple, `None`
    or `eqx.Module` (its contents could change unseen).

    Returns `(copies, containers, others)`: copies of the lists and dicts that hold
    only handles and those containers, which are unchanged if `copies == containers`
    (a handle is equal to itself alone, and, on the left of `==`, answers without
    asking the other object: so this compares by identity, in C); and the other lists
    and dicts, each with the objects it holds (see `_unchanged`)."""
    copies, containers, others = [], [], []
    pending = [tree]
    while pending:
        node = pending.pop()
        if type(node) is list or type(node) is dict:
            items = tuple(node.values()) if isinstance(node, dict) else node
            if all(isinstance(x, State) for x in items):
                copies.append(node.copy())
                containers.append(node)
            elif type(node) is list:
                others.append((node, tuple(node)))
            else:
                others.append((node, (tuple(node), items)))
            pending.extend(items)
        elif isinstance(node, tuple):
            pending.extend(node)
        elif isinstance(node, eqx.Module):
            pending.extend(getattr(node, f.name, None) for f in _fields(node))
        elif node is not None and _is_leaf(node):
            continue
        elif node is not None:
            return None
    return tuple(copies), tuple(containers), others


def _is_leaf(node: Any) -> bool:
    """Whether `node` is a leaf. Not an empty container, nor a node with no
    children (a dataclass of metadata only): those can change in place unseen."""
    treedef = jtu.tree_structure(node)
    return treedef.num_nodes == 1 and treedef.num_leaves == 1


def _fields(module: eqx.Module) -> tuple:
    return dataclasses.fields(module)


def _unchanged(watched: tuple) -> bool:
    """Whether a remembered argument's lists and dicts (see `_mutable_containers`)
    still hold the very objects they held when it was split."""
    if watched is _UNWATCHED:
        return False
    copies, containers, others = watched
    if copies != containers:
        return False
    for container, held in others:
        if type(container) is list:
            if len(container) != len(held) or not all(map(is_, container, held)):
                return False
        else:
            keys, values = held
            if len(container) != len(keys) or tuple(container) != keys:
                return False
            if not all(map(is_, container.values(), values)):
                return False
    return True
