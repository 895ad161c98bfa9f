"""Loops: scan, for_loop, while_loop, bounded_while_loop.

The body is traced once to find its states. Written states become part of the loop
carry (with their weak types dropped, so that the carry keeps one type); states only
read are closed over. States cannot be created inside a loop body.

Under `jax.disable_jit()` the loops run their functions directly, iteration by
iteration, as `jax.lax.scan` and `jax.lax.while_loop` do there: `print` and
`float(x)` work inside. Their writes still reach the enclosing context only when the
whole loop succeeds.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _jax_compat as compat
from .._arguments import flag, integer
from .._pretty_print import array_summary, state_label
from .._shapes import shape_dtype
from .._state import draws_atomically, State
from ._common import (
    abstract,
    changed_static,
    changed_type,
    hide_static,
    predicate_axes,
    show_static,
    strong,
    varying_along,
    WeakCarry,
)
from ._conditions import cond
from ._discovery import Discovery
from ._eager import guarded, jit_disabled
from ._equinox_errors import with_equinox_errors
from ._eval_shape import eval_shape
from ._progress_bar import ProgressBar


compat.hide_from_tracebacks(__file__)

# As `jax.lax.scan` and `jax.lax.while_loop` type them.
_Carry = TypeVar("_Carry")
_X = TypeVar("_X")
_Y = TypeVar("_Y")


def loop_length(xs: Any, length: int | None, what: tuple[str, str, str]) -> int:
    """The number of iterations: `length`, and the leading axis of every leaf of
    `xs`, which must agree."""
    sizes = {}
    for path, leaf in jtu.tree_leaves_with_path(xs):
        shape = jnp.shape(leaf)
        name = f"`{what[1]}{jtu.keystr(path)}`"
        if not shape:
            raise ValueError(
                f"{what[0]} iterates over the leading axis of every array in "
                f"`{what[1]}`, but {name} is a scalar (shape ()). Give it a leading "
                "axis, or close over it instead of passing it."
            )
        sizes[name] = shape[0]
    if length is not None:
        sizes["`length`"] = length = integer(length, "length")
    if not sizes:
        raise ValueError(what[2])
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"{k} has {v}" for k, v in sizes.items())
        raise ValueError(
            f"{what[0]} needs one length for every array of `{what[1]}` (their "
            f"leading axis){' and `length`' if length is not None else ''}, but {shown}."
        )
    return next(iter(sizes.values()))


_SCAN = (
    "`scan`",
    "xs",
    "`scan` needs `length` when `xs` has no arrays: pass `length=n` to run the body "
    "n times.",
)
_FOR_LOOP = (
    "`for_loop`",
    "operands",
    "`for_loop` needs operands to iterate over: `for_loop(f, xs)` calls `f(x)` for "
    "each slice `x` of `xs` along its leading axis. To run a body a fixed number of "
    "times, use `for_loop(f, jnp.arange(n))` or `scan(f, init, length=n)`.",
)


def check_loop_options(reverse: Any, unroll: Any, pbar: Any) -> None:
    flag(reverse, "reverse")
    if not isinstance(unroll, bool):
        integer(unroll, "unroll", what="a non-negative integer or a bool")
    if pbar is not None and not isinstance(pbar, ProgressBar):
        raise TypeError(
            "`pbar` must be an `eqstate.transform.ProgressBar` or None, got "
            f"{pbar!r}. E.g. `pbar=eqstate.transform.ProgressBar(freq=10)`."
        )


def slice_of(xs: Any) -> Any:
    """What the body sees of `xs` (with its static leaves hidden): one slice along
    the leading axis, abstractly."""
    return jtu.tree_map(lambda x: shape_dtype(x, x.shape[1:]), abstract(xs))


class _Carried:
    """The states of one or more traced loop functions, split into the written ones
    (carried) and the others (closed over)."""

    def __init__(self, *traced: Discovery):
        values: dict[State, Any] = {}
        for t in traced:
            values.update(zip(t.states, t.values))
        self.values = values
        self.written = tuple(dict.fromkeys(s for t in traced for s in t.written))

    def initial(self) -> list[Any]:
        values = [self.values[s] for s in self.written]
        self.weak = WeakCarry(values)
        return strong(values)

    def values_for(self, traced: Discovery, carried: Sequence[Any]) -> list[Any]:
        current = dict(zip(self.written, self.weak.restored(carried)))
        return [current.get(s, self.values[s]) for s in traced.states]

    def carry_out(self, updates: dict[State, Any], carried: Sequence[Any]) -> list[Any]:
        for i, s in enumerate(self.written):
            if s in updates:
                self.weak.written(i, updates[s])
        return strong([updates.get(s, v) for s, v in zip(self.written, carried)])

    def final(self, carried: Sequence[Any]) -> dict[State, Any]:
        """The written states' new values from the loop's final carry."""
        return dict(zip(self.written, self.weak.restored(carried)))


def scan(
    f: Callable[[_Carry, _X], tuple[_Carry, _Y]],
    init: _Carry,
    xs: _X | None = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    pbar: ProgressBar | None = None,
) -> tuple[_Carry, _Y]:
    """Like `jax.lax.scan`, for a body that reads and writes states.

    The states the body writes are carried through the loop and written back once it
    finishes; the ones it only reads are constants of the loop. Under
    `jax.disable_jit()` the body runs directly, iteration by iteration, as in
    `jax.lax.scan`.

    **Arguments:**

    - `f`: `(carry, x) -> (carry, y)`. It may read and write states, but not create
        them.
    - `init`, `xs`, `length`, `reverse`, `unroll`: as in `jax.lax.scan`.
    - `pbar`: a [`eqstate.transform.ProgressBar`][] to print progress.

    **Returns:**

    `(final_carry, stacked_ys)`, as `jax.lax.scan`.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        total = es.State(jnp.array(0.0))

        def step(carry, x):
            total.value = total.value + x
            return carry + 1, total.value

        n, running = es.transform.scan(step, 0, jnp.arange(4.0))
        assert n == 4 and total.value == 6.0 and (running == jnp.array([0, 1, 3, 6.0])).all()
        ```
    """
    check_loop_options(reverse, unroll, pbar)
    return scan_states(f, init, xs, length, reverse, unroll, pbar, _SCAN)


def _check_pair(out: Any, loop: str = "`scan`") -> tuple[Any, Any]:
    # A list of two, as `jax.lax.scan` takes it.
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            f"The body of {loop} must return a pair `(carry, y)`, got {out!r}."
        )
    return tuple(out)


_STATIC_NUMBER = (
    "`{name}` is a Python number in a field of an `eqx.Module`, which eqstate "
    "treats as static (as `eqx.filter_jit` does): part of the loop's structure, "
    "which cannot change from one iteration to the next. {where} changed it from "
    "{old!r} to {new}. Store it as an array instead, e.g. `jnp.asarray({old!r})`."
)

_STATIC_OTHER = (
    "`{name}` is not an array, so eqstate treats it as static: part of the loop's "
    "structure, which cannot change from one iteration to the next. {where} changed "
    "it from {old} to {new}. Keep it the same in every iteration, or carry an array "
    "instead."
)


def _shown(x: Any) -> str:
    if isinstance(x, jax.Array):
        return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
    return repr(x)


def _check_static_carry(before: Any, after: Any, where: str, name: str) -> None:
    """Raises `TypeError` if a loop body changed a static leaf of its carry (both
    hidden by `hide_static`), which JAX would report as a change of the carry's tree
    structure."""
    changed = changed_static(before, after)
    if changed is None:
        return
    path, old, new = changed
    number = isinstance(old, (bool, int, float, complex))
    message = _STATIC_NUMBER if number else _STATIC_OTHER
    raise TypeError(
        message.format(
            name=name + path,
            where=where,
            old=old if number else _shown(old),
            new=_shown(new),
        )
    )


def _check_carry_types(before: Any, after: Any, where: str, name: str) -> None:
    """Raises `TypeError` if a loop body returned a carry (hidden by `hide_static`) of
    another structure, or an array of another shape or dtype at some place, than the
    carry it was given, naming the place in the user's carry (JAX's own message
    shows it in what eqstate makes of the carry). A weakly typed entry may come back
    in another dtype: JAX promotes it."""
    changed = changed_type(before, after, weak_may_change=True)
    if changed is None:
        return
    path, old, new = changed
    if path is None:
        raise TypeError(
            f"{where} takes `{name}` of structure {old} but returns one of "
            f"structure {new}: a loop's carry must keep its structure."
        )
    raise TypeError(
        f"{where} takes `{name}{path}` as {array_summary(old)} but returns it as "
        f"{array_summary(new)}: a loop's carry must keep its shapes and dtypes. Cast "
        f"or reshape the new value (e.g. `.astype(jnp.{jnp.result_type(old)})`), or "
        "start from a value of its type."
    )


def _ticks(n: int, reverse: bool) -> jax.Array:
    """The iteration count a progress bar sees at each element of a scan: a reversed
    scan runs the last element first."""
    return jnp.arange(n)[::-1] if reverse else jnp.arange(n)


def _scan_eagerly(
    f: Callable,
    init: Any,
    xs: Any,
    n: int,
    reverse: bool,
    pbar: ProgressBar | None,
    loop: str = "`scan`",
) -> tuple[Any, Any]:
    """`scan` under `jax.disable_jit()`: the body runs directly, iteration by
    iteration, as `jax.lax.scan` runs it there."""

    def body(carry, x):
        if pbar is not None:
            x, index = x
            pbar.tick(index, n)
        carry, y = _check_pair(f(show_static(carry), show_static(x)), loop)
        return hide_static(carry), hide_static(y)

    scanned = xs if pbar is None else (xs, _ticks(n, reverse))
    with guarded(f"the body of {loop}"):
        final, ys = jax.lax.scan(body, init, scanned, length=n, reverse=reverse)
    return show_static(final), show_static(ys)


def lax_scan_ticking(
    step: Callable,
    init: Any,
    xs: Any,
    n: int,
    reverse: bool,
    unroll: int | bool,
    pbar: ProgressBar | None,
) -> tuple[Any, Any]:
    """`jax.lax.scan` of a pure `step`, ticking `pbar` every iteration."""

    def body(carry, x):
        if pbar is not None:
            x, index = x
            pbar.tick(index, n)
        return step(carry, x)

    scanned = xs if pbar is None else (xs, _ticks(n, reverse))
    return jax.lax.scan(body, init, scanned, length=n, reverse=reverse, unroll=unroll)


@draws_atomically
def scan_states(
    f: Callable,
    init: Any,
    xs: Any,
    length: int | None,
    reverse: bool,
    unroll: int | bool,
    pbar: ProgressBar | None,
    what: tuple[str, str, str],
    loop: Callable = lax_scan_ticking,
) -> tuple[Any, Any]:
    """`scan` of `f`: traces it, carries the states it writes, and runs `loop` (with
    the signature of `lax_scan_ticking`) on the pure step."""
    # Leaves JAX does not take (the handles of a model in the carry or in `xs`) ride
    # in the tree structure: they are the same at every iteration.
    init, xs = hide_static(init), hide_static(xs)
    n = loop_length(xs, length, what)
    if jit_disabled():
        return _scan_eagerly(f, init, xs, n, reverse, pbar, what[0])
    traced = Discovery(
        f,
        (show_static(init), show_static(slice_of(xs))),
        name=getattr(f, "__name__", "scan body"),
    )
    traced.refuse_new_states(f"the body of {what[0]}")
    carried = _Carried(traced)

    def step(carry, x):
        user_carry, state_values = carry
        out, updates, _ = traced.evaluate(
            carried.values_for(traced, state_values),
            (show_static(user_carry), show_static(x)),
        )
        new_carry, y = _check_pair(out, what[0])
        new_carry, y = hide_static(new_carry), hide_static(y)
        _check_static_carry(user_carry, new_carry, f"The body of {what[0]}", "carry")
        _check_carry_types(user_carry, new_carry, f"The body of {what[0]}", "carry")
        return (new_carry, carried.carry_out(updates, state_values)), y

    (final, state_values), ys = with_equinox_errors(
        lambda carry, xs: loop(step, carry, xs, n, reverse, unroll, pbar),
        (init, carried.initial()),
        xs,
    )
    traced.commit(carried.final(state_values))
    return show_static(final), show_static(ys)


def for_loop(
    f: Callable[..., _Y],
    *operands: Any,
    reverse: bool = False,
    unroll: int | bool = 1,
    pbar: ProgressBar | None = None,
) -> _Y:
    """Calls `f(*xs)` for each slice `xs` of `operands` along their leading axis, and
    stacks the outputs: a loop without a carry, for bodies that update states.

    **Arguments:**

    - `f`: called with one slice of each operand. It may read and write states.
    - `*operands`: arrays (or PyTrees of arrays) with a common leading axis; at
        least one.
    - `reverse`, `unroll`: as in `jax.lax.scan`.
    - `pbar`: a [`eqstate.transform.ProgressBar`][] to print progress.

    **Returns:**

    The outputs of `f`, stacked along a new leading axis.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        h = es.ShortTermState(jnp.array(0.0))

        def step(x):
            h.value = 0.5 * h.value + x
            return h.value

        hs = es.transform.for_loop(step, jnp.ones(3))
        assert (hs == jnp.array([1.0, 1.5, 1.75])).all() and h.value == 1.75
        ```
    """

    def body(carry, xs):
        return carry, f(*xs)

    check_loop_options(reverse, unroll, pbar)
    _, ys = scan_states(body, None, operands, None, reverse, unroll, pbar, _FOR_LOOP)
    return ys


@draws_atomically
def while_loop(
    cond_fun: Callable[[_Carry], Any],
    body_fun: Callable[[_Carry], _Carry],
    init_val: _Carry,
) -> _Carry:
    """Like `jax.lax.while_loop`, for functions that read states; `body_fun` may also
    write them. (Not reverse-mode differentiable, like `jax.lax.while_loop`; see
    [`eqstate.transform.bounded_while_loop`][].) Under `jax.disable_jit()` both
    functions run directly, as in `jax.lax.while_loop`.

    **Arguments:**

    - `cond_fun`: `val -> bool`. It may read states, but not write them.
    - `body_fun`: `val -> val`. It may read and write states.
    - `init_val`: the initial value.

    **Returns:**

    The final value.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        steps = es.State(jnp.array(0))

        def body(x):
            steps.value = steps.value + 1
            return x * 2

        out = es.transform.while_loop(lambda x: x < 100, body, 1)
        assert out == 128 and steps.value == 7
        ```
    """
    if jit_disabled():
        try:
            return _while_eagerly(cond_fun, body_fun, init_val, "while_loop")
        except jax.errors.ConcretizationTypeError:
            pass  # A transform around the loop needs it compiled, as in JAX.
    hidden = hide_static(init_val)
    traced_cond = Discovery(
        cond_fun, (init_val,), name=getattr(cond_fun, "__name__", "cond_fun")
    )
    traced_body = Discovery(
        body_fun, (init_val,), name=getattr(body_fun, "__name__", "body_fun")
    )
    if traced_cond.written:
        raise ValueError(
            f"`cond_fun` of `while_loop` writes {state_label(traced_cond.written[0])}. The "
            "condition may read states but not write them: move the write into "
            "`body_fun`."
        )
    traced_cond.refuse_new_states("`cond_fun` of `while_loop`")
    traced_body.refuse_new_states("`body_fun` of `while_loop`")
    carried = _Carried(traced_cond, traced_body)
    predicate_varies: list[frozenset] = []  # along which mesh axes (`shard_map`)

    def loop_cond(carry):
        val, state_values = carry
        out, _, _ = traced_cond.evaluate(
            carried.values_for(traced_cond, state_values), (show_static(val),)
        )
        predicate_varies.append(predicate_axes(out))
        return out

    def loop_body(carry):
        val, state_values = carry
        out, updates, _ = traced_body.evaluate(
            carried.values_for(traced_body, state_values), (show_static(val),)
        )
        out = hide_static(out)
        _check_static_carry(val, out, "`body_fun` of `while_loop`", "val")
        _check_carry_types(val, out, "`body_fun` of `while_loop`", "val")
        return out, carried.carry_out(updates, state_values)

    final, state_values = with_equinox_errors(
        lambda carry: jax.lax.while_loop(loop_cond, loop_body, carry),
        (hidden, carried.initial()),
    )
    if predicate_varies:  # the number of steps may differ between devices
        final, state_values = varying_along((final, state_values), predicate_varies[-1])
    traced_body.commit(carried.final(state_values))
    return show_static(final)


def _condition(cond_fun: Callable, val: Any, loop: str) -> Any:
    """`cond_fun(val)`, refusing writes to states."""
    with guarded(f"`cond_fun` of `{loop}`", read_only=True):
        return cond_fun(val)


def _as_arrays(val: Any) -> Any:
    """`val` with its Python scalars made arrays, as a compiled loop returns them."""
    return show_static(jtu.tree_map(jnp.asarray, hide_static(val)))


def _while_eagerly(
    cond_fun: Callable, body_fun: Callable, init_val: Any, loop: str
) -> Any:
    """`while_loop` under `jax.disable_jit()`: both functions run directly, as
    `jax.lax.while_loop` runs them there."""

    with guarded(f"`body_fun` of `{loop}`"):
        val = _as_arrays(init_val)
        while _condition(cond_fun, val, loop):
            val = _as_arrays(body_fun(val))
    return val


def _promote_leaf(x: Any, out: jax.ShapeDtypeStruct) -> Any:
    aval = jax.typeof(x)
    if not aval.weak_type or out.shape != aval.shape:
        return x
    if out.weak_type and out.dtype == aval.dtype:
        return x
    return jnp.asarray(x, dtype=jnp.result_type(x, out))


def _promoted(body_fun: Callable, init_val: Any) -> Any:
    """`init_val` with each weakly typed leaf converted to the type `body_fun` gives
    it, as `jax.lax.while_loop` promotes its carry: the loop's result then has the
    body's types, whether or not the body ran."""
    leaves, treedef = jtu.tree_flatten(hide_static(init_val))
    if not any(jax.typeof(x).weak_type for x in leaves):
        return init_val
    out_leaves, out_def = jtu.tree_flatten(hide_static(eval_shape(body_fun, init_val)))
    if out_def != treedef:
        return init_val  # The loop reports the mismatch.
    promoted = [_promote_leaf(x, o) for x, o in zip(leaves, out_leaves)]
    return show_static(jtu.tree_unflatten(treedef, promoted))


def bounded_while_loop(
    cond_fun: Callable[[_Carry], Any],
    body_fun: Callable[[_Carry], _Carry],
    init_val: _Carry,
    max_steps: int,
) -> _Carry:
    """A while loop of at most `max_steps` iterations that reverse-mode autodiff can
    differentiate (`jax.lax.while_loop` cannot). It runs `max_steps` guarded steps,
    each applying `body_fun` only while `cond_fun` holds, so its cost is that of
    `max_steps` iterations.

    **Arguments:**

    - `cond_fun`, `body_fun`, `init_val`: as for [`eqstate.transform.while_loop`][]
        (`cond_fun` may read states but not write them).
    - `max_steps`: the most iterations to run, a non-negative integer; the loop
        stops there even if `cond_fun` still holds.

    **Returns:**

    The final value.

    !!! Example

        ```python
        import eqstate as es
        import jax
        import jax.numpy as jnp

        def f(x):
            return es.transform.bounded_while_loop(lambda v: v < 10.0, lambda v: v * 2, x, 8)

        assert f(1.0) == 16.0 and jax.grad(f)(1.0) == 16.0
        ```
    """
    hint = ": the length of the compiled loop, so it cannot be traced either"
    max_steps = integer(max_steps, "max_steps", hint=hint)

    @functools.wraps(body_fun)  # Errors name `body_fun`.
    def body(val):
        out = body_fun(val)
        if jit_disabled():  # Eagerly, as in `jax.lax`, the carry may change.
            return _as_arrays(out)
        where = "`body_fun` of `bounded_while_loop`"
        _check_static_carry(hide_static(val), hide_static(out), where, "val")
        return out

    def step(val, _):
        pred = _condition(cond_fun, val, "bounded_while_loop")
        return cond(pred, body, lambda v: v, val), None

    if jit_disabled():
        if max_steps == 0:  # `jax.lax.scan` cannot run zero steps eagerly.
            return _as_arrays(init_val)
        # Arrays from the start, as `while_loop` gives `body_fun` and `cond_fun`.
        return scan(step, _as_arrays(init_val), None, length=max_steps)[0]
    init = _promoted(body_fun, init_val)
    if compat.in_manual_axes():
        # Where the condition differs between devices, so does the number of steps
        # each takes, and the carry with it (see `varying_along`).
        axes = predicate_axes(_condition(cond_fun, init, "bounded_while_loop"))
        init = show_static(varying_along(hide_static(init), axes))
    final, _ = scan(step, init, None, length=max_steps)
    return final
