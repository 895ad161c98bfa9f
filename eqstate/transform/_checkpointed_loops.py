"""checkpointed_scan, checkpointed_for_loop: loops whose reverse-mode memory grows far
slower than their number of steps.

A plain `scan` under reverse-mode autodiff stores the intermediate values of every
step. These loops split the steps into segments, nested: each segment is a
`jax.checkpoint`, so that only the carries at segment boundaries are stored on the
forward pass, and a segment's steps are run again, one segment at a time, on the
backward pass. States are carried as in `scan` (the same tracing and carry).
"""

import math
import operator
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _jax_compat as compat
from ._common import merge_leading_axes
from ._loops import check_loop_options, lax_scan_ticking, scan_states
from ._progress_bar import ProgressBar


_Carry = TypeVar("_Carry")
_X = TypeVar("_X")
_Y = TypeVar("_Y")


compat.hide_from_tracebacks(__file__)


_CHECKPOINTED_SCAN = (
    "`checkpointed_scan`",
    "xs",
    "`checkpointed_scan` needs `length` when `xs` has no arrays: pass `length=n` to "
    "run the body n times.",
)
_CHECKPOINTED_FOR_LOOP = (
    "`checkpointed_for_loop`",
    "operands",
    "`checkpointed_for_loop` needs operands to iterate over: "
    "`checkpointed_for_loop(f, xs)` calls `f(x)` for each slice `x` of `xs` along its "
    "leading axis. To run a body a fixed number of times, use "
    "`checkpointed_scan(f, init, length=n)`.",
)


def _check_base(base: Any) -> int | None:
    if base is None:
        return None
    try:
        if isinstance(base, bool):  # `True` is an integer, 1, to `operator.index`
            raise TypeError
        base = operator.index(base)
    except TypeError:
        raise TypeError(
            f"`base` must be an integer of at least 2, or None, got {base!r}."
        ) from None
    if base < 2:
        raise ValueError(
            f"`base` must be at least 2, got {base}: it is the number of segments each "
            "level of checkpointing splits the loop into. Leave it as None for two "
            "levels of about sqrt(length) segments."
        )
    return base


def _rows(xs: Any, start: Any, size: int) -> Any:
    """Rows `start:start + size` of every leaf of `xs` (`start` may be traced)."""
    return jtu.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size), xs)


def _stack(main: Any, rest: Any) -> Any:
    """`main`, stacked as `(segments, steps, ...)`, as one axis, then `rest`."""
    flat = merge_leading_axes(main)
    if rest is None:
        return flat
    return jtu.tree_map(lambda a, b: jnp.concatenate([a, b]), flat, rest)


def _nested(step: Callable, carry: Any, xs: Any, start: Any, n: int, base: int) -> Any:
    """`n` steps over the rows `start:start + n` of `xs`, in `base` checkpointed
    segments, each nested likewise, down to segments of at most `base` steps, which
    run as plain scans. Each level reads its rows by index, as the outer one does, so
    that no level keeps a copy of them for the backward pass."""
    if n <= base:
        return jax.lax.scan(step, carry, _rows(xs, start, n), length=n)
    size = math.ceil(n / base)
    count, left = divmod(n, size)

    def segment(length: int) -> Callable:
        return jax.checkpoint(
            lambda c, at: _nested(step, c, xs, at, length, base), prevent_cse=False
        )

    whole = segment(size)
    carry, ys = jax.lax.scan(
        lambda c, i: whole(c, start + i * size), carry, jnp.arange(count)
    )
    rest = None
    if left:
        carry, rest = segment(left)(carry, start + count * size)
    return carry, _stack(ys, rest)


def _checkpointed(
    step: Callable,
    init: Any,
    xs: Any,
    n: int,
    base: int | None,
    pbar: ProgressBar | None,
) -> tuple[Any, Any]:
    """The outer level: segments that read their rows of `xs` by index, so that no
    copy of `xs` is made or stored; `pbar` ticks once per segment, outside the
    checkpoints (the steps inside run again on the backward pass)."""
    count = base if base is not None else math.isqrt(max(n - 1, 0)) + 1
    size = math.ceil(n / count) if n else 0
    inner_base = base if base is not None else size
    if n <= count or size <= 1:
        # Too short to split: a plain scan, whose memory is that of `count` steps.
        return lax_scan_ticking(step, init, xs, n, False, 1, pbar)
    count, left = divmod(n, size)

    def segment(carry, i):
        return _nested(step, carry, xs, i * size, size, inner_base)

    checkpointed = jax.checkpoint(segment, prevent_cse=False)

    def outer(carry, i):
        carry, ys = checkpointed(carry, i)
        if pbar is not None:
            pbar.tick((i + 1) * size - 1, n, stride=size)
        return carry, ys

    carry, ys = jax.lax.scan(outer, init, jnp.arange(count))
    rest = None
    if left:
        last = jax.checkpoint(
            lambda c: _nested(step, c, xs, count * size, left, inner_base),
            prevent_cse=False,
        )
        carry, rest = last(carry)
        if pbar is not None:
            pbar.tick(n - 1, n, stride=left)
    return carry, _stack(ys, rest)


def _loop(base: int | None) -> Callable:
    """The loop driver `scan_states` runs: checkpointed segments of the pure step."""

    def loop(step, init, xs, n, reverse, unroll, pbar):
        del reverse, unroll  # Not options of the checkpointed loops.
        return _checkpointed(step, init, xs, n, base, pbar)

    return loop


def checkpointed_scan(
    f: Callable[[_Carry, _X], tuple[_Carry, _Y]],
    init: _Carry,
    xs: _X | None = None,
    length: int | None = None,
    base: int | None = None,
    pbar: ProgressBar | None = None,
) -> tuple[_Carry, _Y]:
    """Like [`eqstate.transform.scan`][], with far less memory under reverse-mode
    autodiff: for backpropagation through long loops (thousands of steps of an RNN,
    an ODE or a spiking network).

    A plain scan stores the intermediate values of every step for the backward pass.
    This one splits the steps into segments, each a `jax.checkpoint`: only the carry
    (and the written states) at segment boundaries is stored, and each segment runs
    again on the backward pass. With `base=None`, about `sqrt(length)` segments of
    about `sqrt(length)` steps: memory of about `2 sqrt(length)` carries plus the
    intermediate values of one segment, for one extra forward pass. With an integer
    `base`, each level splits into `base` segments, nested `ceil(log(length, base))`
    deep: less memory (about `base` carries per level) for one extra forward pass per
    level. The forward values and the gradients are those of `scan` (up to the
    rounding of floating-point operations that XLA fuses differently).

    Under `jax.disable_jit()` the body runs directly, iteration by iteration, as in
    `scan`.

    **Arguments:**

    - `f`: `(carry, x) -> (carry, y)`. It may read and write states, but not create
        them.
    - `init`, `xs`, `length`: as in `jax.lax.scan`.
    - `base`: the number of segments per level of nesting, at least 2; `None` for
        two levels of about `sqrt(length)` segments.
    - `pbar`: a [`eqstate.transform.ProgressBar`][]. It reports progress once per
        outer segment, since the steps inside a segment run again on the backward
        pass.

    **Returns:**

    `(final_carry, stacked_ys)`, as `jax.lax.scan`.

    !!! Example

        ```python
        import eqstate as es
        import jax
        import jax.numpy as jnp

        w = es.ParamState(jnp.array(0.9))
        steps = es.ShortTermState(jnp.array(0))

        def step(h, x):
            steps.value = steps.value + 1
            h = jnp.tanh(w.value * h + x)
            return h, h

        def loss(xs, loop):
            _, hs = loop(step, 0.0, xs)
            return jnp.sum(hs**2)

        xs = jnp.linspace(0.0, 1.0, 1000)
        checkpointed = lambda xs: loss(xs, es.transform.checkpointed_scan)
        plain = lambda xs: loss(xs, es.transform.scan)
        grads = es.transform.grad(checkpointed, grad_states=[w])(xs)
        expected = es.transform.grad(plain, grad_states=[w])(xs)
        assert jnp.allclose(grads[w], expected[w], rtol=1e-5)
        assert steps.value == 2000
        ```
    """
    check_loop_options(False, 1, pbar)
    base = _check_base(base)
    return scan_states(
        f, init, xs, length, False, 1, pbar, _CHECKPOINTED_SCAN, _loop(base)
    )


def checkpointed_for_loop(
    f: Callable[..., _Y],
    *operands: Any,
    base: int | None = None,
    pbar: ProgressBar | None = None,
) -> _Y:
    """Like [`eqstate.transform.for_loop`][], with the memory of
    [`eqstate.transform.checkpointed_scan`][] under reverse-mode autodiff.

    **Arguments:**

    - `f`: called with one slice of each operand. It may read and write states, but
        not create them.
    - `*operands`: arrays (or PyTrees of arrays) with a common leading axis; at
        least one.
    - `base`, `pbar`: as for [`eqstate.transform.checkpointed_scan`][].

    **Returns:**

    The outputs of `f`, stacked along a new leading axis.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        v = es.ShortTermState(jnp.array(0.0))

        def step(i):
            v.value = 0.9 * v.value + i
            return v.value

        vs = es.transform.checkpointed_for_loop(step, jnp.arange(100.0), base=4)
        assert vs.shape == (100,) and v.value == vs[-1]
        ```
    """

    def body(carry, xs):
        return carry, f(*xs)

    check_loop_options(False, 1, pbar)
    base = _check_base(base)
    _, ys = scan_states(
        body, None, operands, None, False, 1, pbar, _CHECKPOINTED_FOR_LOOP, _loop(base)
    )
    return ys
