"""eval_shape: the output's shapes without computing anything."""

from collections.abc import Callable
from typing import Any

from .. import _context, _jax_compat as compat
from ._stateful_function import StatefulFunction


compat.hide_from_tracebacks(__file__)


def eval_shape(fun: Callable, *args: Any, **kwargs: Any) -> Any:
    """Like `jax.eval_shape`, for a function that uses states: traces `fun` abstractly
    and returns its output's shapes and dtypes. No value is computed, and no state is
    read (beyond its shape and dtype) or written.

    **Arguments:**

    - `fun`: the function.
    - `*args`, `**kwargs`: its arguments: arrays, or `jax.ShapeDtypeStruct`s.

    **Returns:**

    The output with every array replaced by a `jax.ShapeDtypeStruct` (handles of
    states `fun` would create stay in place).

    !!! Example

        ```python
        import eqstate as es
        import jax
        import jax.numpy as jnp

        w = es.ParamState(jnp.ones((3, 4)))
        count = es.State(jnp.array(0))

        def f(x):
            count.value = count.value + 1
            return x @ w.value

        out = es.transform.eval_shape(f, jax.ShapeDtypeStruct((2, 3), jnp.float32))
        assert out.shape == (2, 4) and count.value == 0
        ```
    """
    sf = StatefulFunction(
        fun, state_returns="write", name=getattr(fun, "__name__", None)
    )
    call = sf.parse_args(args, kwargs)
    sf.compile(call, _context.current_frame())
    return sf.get_out_shapes(call.key)[0]
