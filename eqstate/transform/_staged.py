"""Top-level calls of the loops, the conditionals and `shard_map`, compiled once per
program.

Called eagerly, `jax.lax.scan` (like `cond` and the other loops) compiles its body on
each call unless it is the very same Python function as before, and then JAX reuses
the first trace, with the globals it read then; eager `jax.shard_map` compiles on
every call. eqstate reruns a function's Python on every top-level call, so that a
changed global is seen, and the loop it builds is a new function each time. `staged`
keeps that freshness without recompiling: it traces the whole call to a jaxpr, and
calls a compiled function kept for jaxprs of the same *structure* (`jaxpr_key`),
with the jaxpr's constants (arrays closed over, the states' values) passed as
arguments.

Two jaxprs with one key compute the same function of their inputs and constants: the
key holds every equation's primitive, the wiring of its variables, their types, its
literal values, its parameters and its context (e.g. `jax.threefry_partitionable`).
Nested jaxprs count by their keys, and their constants by value, or by identity for
JAX arrays, which cannot change. A NumPy array (a literal or a nested constant)
counts by its value at the call, and the kept jaxpr holds a copy of it, so that no
later change in place of the array reaches a kept program when `jax.jit` traces or
lowers it again. A parameter that is not a jaxpr or a plain value (a number, a
string, a dtype, an enum, a sharding, a tuple of those) counts by identity (e.g. the
function of a `jax.pure_callback`), so that an unknown object can only make a key
differ. The key leaves out the differentiation rules of `jax.custom_jvp` and
`jax.custom_vjp` functions: the compiled function only evaluates, and at top level
nothing differentiates it. A jaxpr with effects (`jax.debug.print`, `io_callback`)
is evaluated as JAX would, compiling each call.
"""

import enum
import functools as ft
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.tree_util as jtu
import numpy as np
from jax.core import ShapedArray

from .. import _jax_compat as compat
from ._eager import jit_disabled
from ._equinox_errors import EQUINOX_ERRORS


compat.hide_from_tracebacks(__file__)


# Compiled functions kept, the least recently used forgotten first.
PROGRAMS_KEPT = 64
_programs: OrderedDict[tuple, Callable] = OrderedDict()
# The objects whose identities the kept keys hold, kept alive with them so that no id
# is reused while its key is.
_held: dict[tuple, list] = {}
_lock = threading.Lock()

# The primitives of `jax.custom_jvp` / `jax.custom_vjp` calls: their parameters that
# are neither jaxprs nor plain values are the differentiation rules (functions,
# thunks), which do not change what evaluating the call computes.
_CUSTOM_CALLS = frozenset(
    {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
)
_PLAIN = (bool, int, str, bytes, type(None), np.dtype, enum.Enum)
# Values that cannot change in place.
_UNCHANGING = (bool, int, float, complex, np.generic, jax.Array)


def staged(fn: Callable, *args: Any) -> Any:
    """`fn(*args)`, for a function of arrays (PyTrees of them) that JAX can trace:
    at top level compiled once per jaxpr structure (see the module documentation),
    elsewhere called as it is."""
    if not compat.is_top_level() or jit_disabled():
        return fn(*args)
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    leaves = jtu.tree_leaves(args)
    with EQUINOX_ERRORS:
        if closed.effects:
            out = jex_core.jaxpr_as_fun(closed)(*leaves)
        else:
            out = _compiled(closed.jaxpr)(closed.consts, leaves)
    return jtu.tree_unflatten(jtu.tree_structure(shapes), out)


def _compiled(jaxpr: jex_core.Jaxpr) -> Callable:
    """The compiled function for jaxprs with the structure of `jaxpr`."""
    held: list = []
    key = jaxpr_key(jaxpr, held)
    with _lock:
        fn = _programs.get(key)
        if fn is not None:
            _programs.move_to_end(key)
            return fn
        if len(_programs) >= PROGRAMS_KEPT:
            old, _ = _programs.popitem(last=False)
            _held.pop(old, None)
        program = ft.partial(eqstate_program, own_copies(jaxpr))
        fn = _programs[key] = jax.jit(program)
        _held[key] = held
    return fn


def eqstate_program(jaxpr: jex_core.Jaxpr, constants: list, inputs: list) -> list:
    """`jaxpr` evaluated (JAX's errors about a top-level call name this function and
    its arguments)."""
    return jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, constants))(*inputs)


def jaxpr_key(jaxpr: jex_core.Jaxpr, held: list) -> tuple:
    """A hashable key equal for two jaxprs only if they compute the same function of
    their constants and inputs; objects counted by identity are added to `held`."""
    numbers: dict[Any, int] = {}

    def bound(var: Any) -> Any:
        numbers[var] = len(numbers)
        return var.aval

    def used(var: Any) -> Any:
        if isinstance(var, jex_core.Literal):
            return ("literal", var.aval, *_literal(var.val, held))
        return numbers[var]

    inputs = (
        len(jaxpr.constvars),
        tuple(bound(v) for v in (*jaxpr.constvars, *jaxpr.invars)),
    )
    eqns = []
    for eqn in jaxpr.eqns:
        ins = tuple(used(v) for v in eqn.invars)
        outs = tuple(bound(v) for v in eqn.outvars)
        # The context the equation runs in (e.g. `jax.threefry_partitionable`):
        # compared by value, or interned (one object per value) and so by identity.
        context = getattr(eqn, "ctx", None)
        primitive = _held_id(eqn.primitive, held)
        eqns.append((primitive, ins, outs, _params(eqn, held), context))
    return inputs, tuple(eqns), tuple(used(v) for v in jaxpr.outvars)


def _params(eqn: jex_core.JaxprEqn, held: list) -> tuple:
    """An equation's parameters' part of a key: the rules of a custom derivative
    are left out (and not kept alive)."""
    custom = eqn.primitive.name in _CUSTOM_CALLS
    params = []
    for name, value in sorted(eqn.params.items()):
        mark = len(held)
        param = _param(value, held)
        if custom and _is_identity(param):
            del held[mark:]
            continue
        params.append((name, param))
    return tuple(params)


def _is_identity(key: Any) -> bool:
    return type(key) is tuple and len(key) == 2 and key[0] == "id"


def _literal(value: Any, held: list) -> tuple:
    try:
        array = np.asarray(value)
    except Exception:
        return (_held_id(value, held),)
    if array.dtype == object:
        return (_held_id(value, held),)
    # By value: the kept jaxpr holds a copy of an array that could change in place
    # (`own_copies`).
    return (type(value), array.dtype.str, array.shape, array.tobytes())


def _constant(value: Any, held: list) -> tuple:
    """A constant of a nested jaxpr's part of a key: a JAX array (immutable) by
    identity, anything else (a NumPy array, which can change in place) by value."""
    if isinstance(value, jax.Array):
        # A deleted one: a key of its own, so that JAX, compiling, says it is gone.
        return _held_id(object() if value.is_deleted() else value, held)
    return _literal(value, held)


def own_copies(jaxpr: jex_core.Jaxpr) -> jex_core.Jaxpr:
    """`jaxpr`, with a read-only copy of each NumPy array among its literals and its
    nested jaxprs' constants. A key counts these by value, as they are when it is
    made; the kept jaxpr must hold those values, not arrays that can change in place
    (`jax.jit` traces or lowers it again, e.g. for an input on another device)."""
    eqns = [_eqn_copies(eqn) for eqn in jaxpr.eqns]
    outvars = [_atom_copy(var) for var in jaxpr.outvars]
    changes = {}
    if _changed(eqns, jaxpr.eqns):
        changes["eqns"] = eqns
    if _changed(outvars, jaxpr.outvars):
        changes["outvars"] = outvars
    return jaxpr.replace(**changes) if changes else jaxpr


def _changed(new: Any, old: Any) -> bool:
    return any(a is not b for a, b in zip(new, old))


def _eqn_copies(eqn: jex_core.JaxprEqn) -> jex_core.JaxprEqn:
    invars = [_atom_copy(var) for var in eqn.invars]
    params = {name: _param_copies(value) for name, value in eqn.params.items()}
    if not _changed(invars, eqn.invars) and not _changed(
        params.values(), eqn.params.values()
    ):
        return eqn
    return eqn.replace(invars=invars, params=params)


def _atom_copy(var: Any) -> Any:
    if isinstance(var, jex_core.Literal) and not isinstance(var.val, _UNCHANGING):
        return jex_core.Literal(_array_copy(var.val), var.aval)
    return var


def _array_copy(value: Any) -> Any:
    if isinstance(value, _UNCHANGING):
        return value
    if isinstance(value, np.ndarray):
        copy = value.copy()  # of the same class (JAX's literals subclass it)
    else:
        copy = np.array(value)  # JAX's own wrapper of one, in older releases
    copy.flags.writeable = False
    return copy


def _param_copies(value: Any) -> Any:
    """A parameter with `own_copies` of the jaxprs in it (where `_param` looks)."""
    if isinstance(value, jex_core.ClosedJaxpr):
        jaxpr = own_copies(value.jaxpr)
        consts = [_array_copy(c) for c in value.consts]
        if jaxpr is value.jaxpr and not _changed(consts, value.consts):
            return value
        return value.replace(jaxpr=jaxpr, consts=consts)
    if isinstance(value, jex_core.Jaxpr):
        return own_copies(value)
    if isinstance(value, (tuple, list)):
        items = [_param_copies(v) for v in value]
        if not _changed(items, value):
            return value
        return getattr(value, "_make", type(value))(items)  # a named tuple: `_make`
    return value


def _param(value: Any, held: list) -> Any:
    """A parameter's part of a key (see `jaxpr_key`)."""
    if isinstance(value, jex_core.ClosedJaxpr):
        consts = tuple(_constant(c, held) for c in value.consts)
        return ("closed jaxpr", jaxpr_key(value.jaxpr, held), consts)
    if isinstance(value, jex_core.Jaxpr):
        return ("jaxpr", jaxpr_key(value, held))
    if isinstance(value, np.generic):
        return (type(value), value.dtype.str, value.tobytes())
    if isinstance(value, float):
        # `-0.0 == 0.0`; a NaN is unequal to itself, so never matches: both safe.
        return (type(value), value, math.copysign(1.0, value))
    if isinstance(value, complex):
        return (type(value), _param(value.real, held), _param(value.imag, held))
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_param(v, held) for v in value))
    if isinstance(value, (frozenset, set)):
        return (type(value), frozenset(_param(v, held) for v in value))
    if isinstance(value, (*_PLAIN, *_DESCRIPTIONS)):
        return (type(value), value)
    return _held_id(value, held)


# Compared by what they describe.
_DESCRIPTIONS = (
    ShapedArray,
    jax.sharding.Sharding,
    jax.sharding.Mesh,
    jax.sharding.AbstractMesh,
    jax.sharding.PartitionSpec,
    *compat.FLAT_TREES,
)


def _held_id(value: Any, held: list) -> tuple:
    held.append(value)
    return ("id", id(value))
