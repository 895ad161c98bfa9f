"""Calls to `jax.jit` with arguments and outputs it does not take as they are.

`jax.jit` takes PyTrees of arrays. A call whose arguments hold other leaves (the state
handles of a model, strings, static arguments) is passed *split*: a small integer
*key* standing for the tree structure and those static leaves (a static argument of the
jitted function, so cheap for JAX to hash), and the list of dynamic leaves. An output
holding such leaves comes back as its dynamic leaves and is rebuilt from what the trace
recorded under the key.

Splitting flattens every argument, which costs Python time for an `eqx.Module` (its
flattening runs in Python). A positional argument that is the very object of the
previous call, and whose tree holds no mutable container (only tuples, `None` and
Modules, which are frozen), cannot have changed: its split is reused. One holding
lists or dicts (a model's list of layers) is reused when each of those still holds
the very objects it held then.
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
from .._state import State
from ._leaves import ArrayImpl, dynamic_mask, in_module, is_traced


# Distinct argument structures remembered per jitted function; the least recently
# made is forgotten first (its key is never reused, so JAX's cache entry for it just
# goes unused).
KEYS_KEPT = 256
_ids = itertools.count()
# The part of a bare array argument.
_ARRAY = -1


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


def unwrapped(kwargs: dict) -> dict:
    """`kwargs` with each `Static` replaced by the value it wraps."""
    return {k: v.value if isinstance(v, Static) else v for k, v in kwargs.items()}


class ArgSplitter:
    """Splits calls into `(key, dynamic leaves)` and rebuilds them; see the module
    documentation."""

    def __init__(self, static_positions: Sequence[int], static_names: Sequence[str]):
        self._static_positions = tuple(static_positions)
        self._static_names = tuple(static_names)
        # position -> (argument, part, dynamic leaves, *its lists and dicts as they
        # were: see `_mutable_containers`)
        self._last: dict[int, tuple[Any, int, list, tuple, tuple, list]] = {}
        # One argument's structure, and a call's (the numbers of its arguments').
        self._forgotten = 0  # how many times `_parts` forgot its oldest part
        self._parts = _Numbering(on_forget=self._forget_parts)
        self._keys = _Numbering(on_forget=self._forget_key)
        self._last_call: tuple[list[int] | None, int] = (None, -1)
        # The split of the last call `f(model, *arrays)`, to split the next one fast.
        self.recent: Recent | None = None
        # The same for a call `f(model, x)` whose model holds no lists or dicts but
        # of handles: `JitDispatch` takes it inline.
        self.pair: Recent | None = None
        self._outputs: dict[int, tuple] = {}
        self._frozen: dict[PyTreeDef, bool] = {}
        self._fields: dict[PyTreeDef, list[bool]] = {}  # see `in_module`
        self._lock = threading.Lock()

    def split(self, args: tuple, kwargs: dict, again: bool = True) -> tuple[int, list]:
        """`(key, dynamic leaves)` of a call."""
        recent = self.recent
        if recent is not None and not kwargs and args and args[0] is recent.model:
            found = recent.split(args)
            if found is not None:
                return found
        forgotten = self._forgotten
        static = self._static_of(len(args)) if self._static_positions else ()
        parts: list[int] = []
        dynamic: list[Any] = []
        remembered = self._last
        for i, arg in enumerate(args):
            if type(arg) is ArrayImpl:
                parts.append(_ARRAY)
                dynamic.append(arg)
                continue
            last = remembered.get(i)
            # A negative static position names another argument when the number of
            # arguments changes: a split remembered from a dynamic position is stale.
            if (
                last is not None
                and last[0] is arg
                and i not in static
                and _unchanged_since(*last[3:])
            ):
                parts.append(last[1])
                dynamic.extend(last[2])
                continue
            part, leaves = self._split_one(i, arg, i in static)
            parts.append(part)
            dynamic.extend(leaves)
        if kwargs:
            marked = _Kwargs(
                (k, Static(v) if k in self._static_names else v)
                for k, v in sorted(kwargs.items())
            )
            part, leaves = self._split_tree(marked)
            parts.append(part)
            dynamic.extend(leaves)
        # A call like the last (the usual case) skips numbering its parts.
        last_parts, last_key = self._last_call
        if parts == last_parts:
            key = last_key
        else:
            key = self._keys.number(tuple(parts))
            self._last_call = (parts, key)
        if self._forgotten != forgotten and again:
            # Numbering forgot an old part, maybe one this call reused: split again,
            # now that nothing is remembered from before.
            return self.split(args, kwargs, again=False)
        recent = self.recent = self._recent_call(args, kwargs, key)
        simple = recent is not None and recent.n == 2 and not recent.others
        self.pair = recent if simple else None
        return key, dynamic

    def _recent_call(self, args: tuple, kwargs: dict, key: int) -> "Recent | None":
        """What splits calls like this one again fast, if it is a call
        `f(model, *arrays)` whose model's split is remembered; else `None`."""
        last = self._last.get(0) if args else None
        if kwargs or self._static_positions or last is None or last[0] is not args[0]:
            return None
        if not all(type(arg) is ArrayImpl for arg in args[1:]):
            return None
        model, _, leaves, copies, containers, others = last
        return Recent(len(args), key, model, leaves, copies, containers, others)

    def _forget_key(self, key: int) -> None:
        self._last_call = (None, -1)
        self.recent = self.pair = None
        self._outputs.pop(key, None)

    def _forget_parts(self, part: int) -> None:
        self._forgotten += 1
        self._last.clear()
        self.recent = self.pair = None

    def _static_of(self, n: int) -> set[int]:
        """The static positions of a call with `n` positional arguments."""
        return {i % n for i in self._static_positions if -n <= i < n}

    def _split_one(self, position: int, arg: Any, static: bool) -> tuple[int, list]:
        if static:
            return self._parts.number(("static", Static(arg))), []
        part, leaves = self._split_tree(arg)
        treedef = self._parts.value(part)[0]
        frozen = self._frozen.get(treedef)
        if frozen is None:
            frozen = self._frozen[treedef] = _is_frozen(treedef)
        watched = ((), (), []) if frozen else _mutable_containers(arg)
        if watched is not None:
            copies, containers, others = watched
            self._last[position] = (arg, part, leaves, copies, containers, others)
        return part, leaves

    def _split_tree(self, tree: Any) -> tuple[int, list]:
        leaves, treedef = jtu.tree_flatten(tree)
        fields = self._fields.get(treedef)
        if fields is None:
            fields = self._fields[treedef] = in_module(tree)
        mask = [is_traced(x, f) for x, f in zip(leaves, fields)]
        static = tuple(i for i, traced in enumerate(mask) if not traced)
        dynamic = [x for x, traced in zip(leaves, mask) if traced]
        static_leaves = tuple(leaves[i] for i in static)
        types = tuple(map(type, static_leaves))  # see `Static.__eq__`
        if float in types:  # and the signs of floats: `-0.0 == 0.0`
            types += tuple(
                math.copysign(1.0, x) for x in static_leaves if type(x) is float
            )
        part = (treedef, static, static_leaves, types)
        return self._parts.number(part), dynamic

    def rebuild(self, key: int, dynamic: Sequence[Any]) -> tuple[tuple, dict]:
        """The `(args, kwargs)` of a call split with `key`, with `dynamic` as its
        dynamic leaves (tracers, while tracing)."""
        rest = iter(dynamic)
        trees = []
        for part in self._keys.value(key):
            if part == _ARRAY:
                trees.append(next(rest))
                continue
            spec = self._parts.value(part)
            if spec[0] == "static":
                trees.append(spec[1].value)
                continue
            treedef, static, static_leaves, _ = spec
            full = [next(rest) for _ in range(treedef.num_leaves - len(static))]
            for i, leaf in zip(static, static_leaves):
                full.insert(i, leaf)
            trees.append(jtu.tree_unflatten(treedef, full))
        if trees and isinstance(trees[-1], _Kwargs):
            kwargs = unwrapped(trees.pop())
            return tuple(trees), kwargs
        return tuple(trees), {}

    def leaves_per_argument(self, key: int) -> list[int]:
        """The number of dynamic leaves of each positional argument of a call split
        with `key`."""
        counts = []
        for part in self._keys.value(key):
            spec = None if part == _ARRAY else self._parts.value(part)
            if spec is None:
                counts.append(1)
            elif spec[0] == "static":
                counts.append(0)
            elif (spec[0].node_data() or (None,))[0] is not _Kwargs:
                counts.append(spec[0].num_leaves - len(spec[1]))
        return counts

    def record_output(self, key: int, out: Any) -> list:
        """The dynamic leaves of `out` (while tracing), keeping how to rebuild it under
        `key`. Raises `OutputMismatch` if another trace for `key` built an output of
        another structure."""
        leaves, treedef = jtu.tree_flatten(out)
        mask = dynamic_mask(out)
        record = (
            treedef,
            tuple(i for i, traced in enumerate(mask) if traced),
            tuple(
                (i, x) for i, (x, traced) in enumerate(zip(leaves, mask)) if not traced
            ),
        )
        with self._lock:
            known = self._outputs.setdefault(key, record)
        if known is not record and known != record:
            raise OutputMismatch
        return [x for x, traced in zip(leaves, mask) if traced]

    def output(self, key: int, dynamic: Sequence[Any]) -> Any:
        """The output of a call split with `key`, from its dynamic leaves."""
        treedef, dynamic_index, static = self._outputs[key]
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

    def __init__(self, on_forget: Callable[[int], None] | None = None):
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
                        if self._on_forget is not None:
                            self._on_forget(old)
                    number = self._numbers[value] = next(_ids)
                    self._values[number] = value
        return number

    def value(self, number: int) -> Any:
        return self._values[number]


class Recent:
    """The split of a call `f(model, *arrays)` whose model's split is remembered:
    the next such call with the same model, unchanged, takes it without flattening
    anything (`split`)."""

    __slots__ = (
        "containers",
        "copies",
        "fast",
        "key",
        "leaves",
        "model",
        "n",
        "others",
    )

    def __init__(
        self,
        n: int,
        key: int,
        model: Any,
        leaves: list,
        copies: tuple,
        containers: tuple,
        others: list,
    ):
        self.n, self.key, self.model, self.leaves = n, key, model, leaves
        # See `_mutable_containers`.
        self.copies, self.containers, self.others = copies, containers, others
        # `(plan, jitted function)` of the last call, for `JitDispatch` to call
        # the next one directly; dropped when its plans change.
        self.fast: tuple | None = None

    def split(self, args: tuple) -> tuple[int, list] | None:
        """`(key, dynamic leaves)` of `args` if it is such a call with this model,
        unchanged; else `None`."""
        if len(args) != self.n:
            return None
        if not _unchanged_since(self.copies, self.containers, self.others):
            return None
        rest = args[1:]
        for arg in rest:
            if type(arg) is not ArrayImpl:
                return None
        return self.key, [*self.leaves, *rest]


def _unchanged_since(copies: tuple, containers: tuple, others: list) -> bool:
    """Whether a remembered argument's lists and dicts (see `_mutable_containers`)
    still hold the very objects they held when it was split."""
    return copies == containers and (not others or _unchanged(others))


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


def _unchanged(others: list[tuple[Any, tuple]]) -> bool:
    """Whether each list and dict still holds the very objects it held."""
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
