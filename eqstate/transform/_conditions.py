"""Conditionals: cond, switch, ifelse.

Every branch is traced to find its states. The states written by any branch are
threaded through `jax.lax.switch` (a branch that does not write one passes its value
through); the others are closed over. States cannot be created inside a branch.
"""

import functools as ft
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Bool, Integer, Real

from .. import _jax_compat as compat
from .._pretty_print import array_summary, state_label
from .._state import draws_atomically, State
from .._write_checks import has_tracer
from ._common import (
    abstract,
    changed_static,
    changed_type,
    hide_static,
    predicate_axes,
    show_static,
    static_skeleton,
    strong,
    varying_along,
    WeakCarry,
)
from ._discovery import Discovery
from ._eager import guarded, jit_disabled
from ._equinox_errors import with_equinox_errors


compat.hide_from_tracebacks(__file__)

_T = TypeVar("_T")


def switch(
    index: Integer[ArrayLike, ""], branches: Sequence[Callable[..., _T]], *operands: Any
) -> _T:
    """Like `jax.lax.switch`, for branches that read and write states.

    Under `jax.disable_jit()`, a concrete `index` runs its branch directly, as
    `jax.lax.switch` does, so that `print` and `float(x)` work inside it.

    **Arguments:**

    - `index`: which branch to run, an integer scalar; clamped to
        `[0, len(branches) - 1]` as in `jax.lax.switch`.
    - `branches`: functions of `*operands` returning outputs of the same structure,
        shapes and dtypes, and the same Python values where they return any (a
        module's `bool` field, a handle): `True` and `1`, or `0.0` and `-0.0`, differ
        and raise `TypeError`, as in `jax.lax.switch`. They may read and write
        states, but not create them.
    - `*operands`: passed to the chosen branch.

    **Returns:**

    The output of the chosen branch. The states it wrote hold their new values.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        mode = es.State(jnp.array(0))
        branches = [lambda x: x, lambda x: x * 2, lambda x: x * 3]

        def tripled(x):
            mode.value = jnp.array(2)
            return x * 3

        assert es.transform.switch(2, [*branches[:2], tripled], 1.0) == 3.0
        assert mode.value == 2
        ```
    """
    branches = tuple(branches)
    if not branches:
        raise ValueError("`switch` needs at least one branch.")
    if not all(callable(b) for b in branches):
        raise TypeError("`branches` must be a sequence of functions.")
    names = [f"branch {i} of a conditional" for i in range(len(branches))]
    return _switch(index, branches, operands, names)


@draws_atomically
def _switch(
    index: Any, branches: Sequence[Callable], operands: tuple, names: Sequence[str]
) -> Any:
    """`switch`, whose errors call each branch by its name in `names`."""
    _check_index(index)
    # As `jax.lax.switch`: to int32 first (a large index wraps), then clamp.
    index = jax.lax.convert_element_type(index, jnp.int32)
    if jit_disabled() and not has_tracer(index):
        chosen = min(max(int(index), 0), len(branches) - 1)
        with guarded(names[chosen]):
            return branches[chosen](*operands)
    traced = [
        Discovery(b, operands, name=getattr(b, "__name__", f"branch {i}"))
        for i, b in enumerate(branches)
    ]
    for name, t in zip(names, traced):
        t.refuse_new_states(name)
    values: dict[State, Any] = {}
    for t in traced:
        values.update(zip(t.states, t.values))
    written = tuple(dict.fromkeys(s for t in traced for s in t.written))
    entry = [values[s] for s in written]
    # Every branch reads the states as they are on entry (`at_entry` is never updated);
    # `weak` gathers the writes of all branches, for the values after the switch. One
    # `WeakCarry` for both would let a branch see the writes of the branches traced
    # before it: a weak state written strongly in branch 0 would read as strong in
    # branch 1.
    at_entry = WeakCarry(entry)
    weak = WeakCarry(entry)

    # Each branch's name and output as `static_skeleton` has it, to name a handle
    # that differs.
    skeletons: list[tuple[str, Any]] = []
    outputs: list[tuple[str, Callable, Any]] = []  # and its function and output type

    def make_branch(t: Discovery, fun: Callable, name: str) -> Callable:
        @ft.wraps(fun)  # JAX's errors (outputs that differ) name the user's function.
        def branch(written_values, *ops):
            current = dict(zip(written, at_entry.restored(written_values)))
            state_values = [current.get(s, values[s]) for s in t.states]
            out, updates, _ = t.evaluate(state_values, show_static(ops))
            for i, s in enumerate(written):
                if s in updates:
                    weak.written(i, updates[s])
            out = hide_static(out)
            skeletons.append((name, static_skeleton(out)))
            outputs.append((name, fun, abstract(out)))
            return out, strong([updates.get(s, current[s]) for s in written])

        return branch

    try:
        out, new_values = with_equinox_errors(
            lambda index, entry, operands: jax.lax.switch(
                index,
                [make_branch(*tbn) for tbn in zip(traced, branches, names)],
                entry,
                *operands,
            ),
            index,
            strong(entry),
            hide_static(operands),
        )
    except TypeError as error:
        _raise_if_static_outputs_differ(skeletons)
        _raise_if_output_types_differ(outputs, error)
        raise
    out, new_values = varying_along((out, new_values), predicate_axes(index))
    traced[0].commit(dict(zip(written, weak.restored(new_values))))
    return show_static(out)


def _raise_if_static_outputs_differ(skeletons: list[tuple[str, Any]]) -> None:
    """Raises `TypeError` naming the branches and the values if two branches return
    different handles (or other leaves that are not traced) at one place, which JAX
    reports as outputs of different structures."""
    if not skeletons:
        return
    (first, skeleton), *others = skeletons
    for name, other in others:
        changed = changed_static(skeleton, other)
        if changed is not None:
            path, mine, theirs = changed
            handles = isinstance(mine, State) or isinstance(theirs, State)
            raise TypeError(
                f"{first} returns {_shown(mine)} {_at(path)}, but {name} returns "
                f"{_shown(theirs)}: the branches of a conditional must return the same "
                "handles, and the same values that are not traced (strings, Python "
                "fields of a Module, where `1`, `1.0` and `True` differ), at each "
                "place. "
                + (_RETURN_VALUES if handles else "Return arrays (`jnp.asarray`).")
            ) from None


def _raise_if_output_types_differ(
    outputs: list[tuple[str, Callable, Any]], error: TypeError
) -> None:
    """Raises `TypeError` naming the branches if two of them return outputs of
    different structures, or arrays of different shapes or dtypes at one place (with
    the place and both types). JAX's own message counts the branches of `cond` from
    `false_fun`, and shows the place in what eqstate makes of the output."""
    if not outputs:
        return
    (first, first_fun, out), *others = outputs
    for name, fun, other in others:
        changed = changed_type(out, other)
        if changed is None:
            continue
        path, mine, theirs = changed
        mine_is, theirs_is = _described(first, first_fun), _described(name, fun)
        if path is None:
            raise TypeError(
                f"{mine_is} returns an output of structure {mine}, but {theirs_is} "
                f"returns one of structure {theirs}: the branches of a conditional "
                "must return the same structure."
            ) from error
        raise TypeError(
            f"{mine_is} returns {array_summary(mine)} {_at(path)}, but {theirs_is} "
            f"returns {array_summary(theirs)}: the branches of a conditional must "
            "return arrays of the same shapes and dtypes at each place. Cast or "
            "reshape one of them (e.g. `x.astype(jnp.float32)`)."
        ) from error


def _described(name: str, fun: Callable) -> str:
    """`name`, with the function's own name and where it is defined, if known:
    "`true_fun` of `cond` (`big`, at model.py:12)"."""
    code = getattr(fun, "__code__", None)
    if code is None:
        return name
    where = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"
    return f"{name} (`{getattr(fun, '__qualname__', code.co_name)}`, at {where})"


_RETURN_VALUES = (
    "Return the state's value (`state.value`) instead, or choose between the handles "
    "outside the conditional."
)


def _shown(x: Any) -> str:
    return state_label(x) if isinstance(x, State) else repr(x)


def _at(path: str) -> str:
    return f"at `output{path}`" if path else "as its output"


def _check_index(index: Any) -> None:
    # The checks of `jax.lax.switch`, made before the branches are traced.
    if jnp.ndim(index) != 0:
        raise TypeError(
            f"`switch` needs a scalar branch index, got {index!r} of shape "
            f"{jnp.shape(index)}."
        )
    try:
        dtype = jnp.result_type(index)
    except TypeError:
        raise TypeError(
            f"`switch` needs an integer branch index, got {index!r}."
        ) from None
    if dtype.kind not in "iu":
        raise TypeError(
            f"`switch` needs an integer branch index, got {index!r} of dtype {dtype}. "
            "Convert it, e.g. `index.astype(int)`, or use `cond` for a predicate."
        )


def _not_scalar(x: Any) -> str | None:
    """What makes `x` no scalar (`"type list"`, `"shape (3,)"`), or `None`."""
    if isinstance(x, Sequence):
        return f"type {type(x).__name__}"
    return f"shape {jnp.shape(x)}" if jnp.ndim(x) != 0 else None


def _branch_index(pred: Any) -> Any:
    """`pred` as the index of `cond`'s branch, by the rules of `jax.lax.cond`: a
    scalar bool, or a number that is true when non-zero."""
    if pred is None:
        raise TypeError("`cond` got None as its predicate; pass a boolean scalar.")
    not_scalar = _not_scalar(pred)
    if not_scalar:
        raise TypeError(
            f"`cond` needs a scalar predicate, got {pred!r} of {not_scalar}."
        )
    try:
        dtype = jnp.result_type(pred)
    except TypeError:
        raise TypeError(
            f"`cond` needs a boolean or real number as its predicate, got {pred!r}."
        ) from None
    if dtype.kind not in "biuf":
        raise TypeError(
            f"`cond` needs a boolean or real number as its predicate, got {pred!r} of "
            f"dtype {dtype}."
        )
    if dtype.kind != "b":
        pred = pred != 0
    return jax.lax.convert_element_type(pred, jnp.int32)


def cond(
    pred: Bool[ArrayLike, ""] | Real[ArrayLike, ""],
    true_fun: Callable[..., _T],
    false_fun: Callable[..., _T],
    *operands: Any,
) -> _T:
    """Like `jax.lax.cond`, for branches that read and write states (see
    [`eqstate.transform.switch`][]).

    The predicate follows `jax.lax.cond`: a scalar boolean, or a real number, true
    when non-zero (so `-1` and `0.5` take `true_fun`); `None`, complex numbers and
    arrays that are not scalars raise `TypeError`.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        hits = es.State(jnp.array(0))

        def hit(x):
            hits.value = hits.value + 1
            return x

        es.transform.cond(True, hit, lambda x: -x, 1.0)
        es.transform.cond(False, hit, lambda x: -x, 1.0)
        assert hits.value == 1
        ```
    """
    if not (callable(true_fun) and callable(false_fun)):
        raise TypeError("`cond` needs two functions, `true_fun` and `false_fun`.")
    names = ["`false_fun` of `cond`", "`true_fun` of `cond`"]
    return _switch(_branch_index(pred), [false_fun, true_fun], operands, names)


_UNCHECKED_ON_TPU = (
    "`ifelse` cannot check that exactly one condition holds while the program runs on "
    "a TPU, which cannot raise errors there: the first condition that holds wins, as "
    "with `check_cond=False`. Pass `check_cond=False` to say so, or set "
    "`EQX_ON_ERROR` to choose Equinox's behaviour (`nan`, `breakpoint`)."
)

_NOT_EXACTLY_ONE = (
    "`ifelse`: exactly one condition must hold (checked as `check_cond=True`, the "
    "default). To run the branch of the first condition that holds, as `if ... elif "
    "... else`, with a last condition `True` for the `else`, pass `check_cond=False`."
)


def ifelse(
    conditions: Sequence[Bool[ArrayLike, ""]],
    branches: Sequence[Callable[..., _T]],
    *operands: Any,
    check_cond: bool = True,
) -> _T:
    """Runs the branch whose condition holds. By default exactly one condition must
    hold, checked at run time. With `check_cond=False` the first condition that holds
    wins, as in `if c0: b0 elif c1: b1 ...`; then a last condition `True` makes an
    `else` branch.

    **Arguments:**

    - `conditions`: boolean scalars, one per branch; arrays that are not scalars
        raise `TypeError`.
    - `branches`: functions of `*operands`, as for [`eqstate.transform.switch`][].
    - `*operands`: passed to the chosen branch.
    - `check_cond`: check that exactly one condition holds, raising
        `eqx.EquinoxRuntimeError` otherwise: at once when the conditions are known
        (eager code), else while the program runs (`eqx.error_if`). A TPU cannot
        raise while a program runs, so there a traced check warns once at trace
        time and the first condition that holds wins (unless `EQX_ON_ERROR` is set,
        which Equinox then follows). If `False`, the first condition that holds
        wins, and when none holds the first branch runs. (Keyword only argument.)

    **Returns:**

    The output of the chosen branch. The states it wrote hold their new values.

    !!! Example

        ```python
        import eqstate as es

        def sign(x):
            return es.transform.ifelse(
                [x > 0, x < 0, True], [lambda: 1, lambda: -1, lambda: 0],
                check_cond=False,
            )

        assert sign(3.0) == 1 and sign(-2.0) == -1 and sign(0.0) == 0
        ```
    """
    branches = tuple(branches)
    if len(conditions) != len(branches):
        raise ValueError(
            f"`ifelse` got {len(conditions)} condition(s) and {len(branches)} "
            "branch(es); give one condition per branch."
        )
    if not branches:
        raise ValueError("`ifelse` needs at least one branch.")
    for i, c in enumerate(conditions):
        not_scalar = _not_scalar(c)
        if not_scalar:
            raise TypeError(
                f"`ifelse` needs scalar conditions, got condition {i} of {not_scalar}. "
                "Reduce it to one boolean, e.g. with `jnp.all` or `jnp.any`."
            )
    flags = jnp.stack([jnp.asarray(c, dtype=bool) for c in conditions])
    index = jnp.argmax(flags)
    if check_cond:
        index = _checked(index, jnp.sum(flags) != 1)
    return switch(index, branches, *operands)


def _checked(index: Any, failed: Any) -> Any:
    """`index`, checked that `failed` is false: at once if it is known now, else as
    the program runs where the platform can raise there."""
    if not has_tracer(failed):
        if failed:
            raise eqx.EquinoxRuntimeError(_NOT_EXACTLY_ONE)
        return index
    if jax.default_backend() == "tpu" and os.environ.get("EQX_ON_ERROR") is None:
        # A TPU program cannot raise: Equinox's check would wait at a prompt forever.
        warnings.warn(_UNCHECKED_ON_TPU, stacklevel=3)
        return index
    return eqx.error_if(index, failed, _NOT_EXACTLY_ONE)
