"""checkpoint / remat: `jax.checkpoint` for functions that use states."""

import functools as ft
from collections.abc import Callable, Sequence
from typing import Any, overload, ParamSpec, TypeVar

import jax

from .. import _jax_compat as compat
from .._custom_types import MISSING, Missing
from .._state import draws_atomically
from ._common import as_arrays, copied_numpy, hide_static, partition, show_static
from ._decorator import decorator_form
from ._discovery import Discovery, kept_or_fresh, traces_for
from ._equinox_errors import EQUINOX_ERRORS


compat.hide_from_tracebacks(__file__)

_P = ParamSpec("_P")
_T = TypeVar("_T")


@overload
def checkpoint(
    fun: Callable[_P, _T],
    *,
    prevent_cse: bool = True,
    policy: Callable[..., bool] | None = None,
    static_argnums: int | Sequence[int] = (),
) -> Callable[_P, _T]: ...


@overload
def checkpoint(
    fun: Missing = MISSING,
    *,
    prevent_cse: bool = True,
    policy: Callable[..., bool] | None = None,
    static_argnums: int | Sequence[int] = (),
) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]: ...


@decorator_form
def checkpoint(
    fun: Any = MISSING,
    *,
    prevent_cse: bool = True,
    policy: Callable[..., bool] | None = None,
    static_argnums: int | Sequence[int] = (),
) -> Any:
    """Like `jax.checkpoint` (also called `remat`): under reverse-mode autodiff, the
    intermediate values of `fun` are recomputed on the backward pass instead of being
    stored. The states `fun` reads are inputs of the checkpointed computation, and the
    ones it writes are written back.

    **Arguments:**

    - `fun`: the function. If omitted, `checkpoint` returns a decorator.
    - `prevent_cse`, `policy`, `static_argnums`: as in `jax.checkpoint` (e.g.
        `policy=jax.checkpoint_policies.nothing_saveable`).

    **Returns:**

    A function with the signature of `fun`.

    !!! Example

        ```python
        import eqstate as es
        import jax
        import jax.numpy as jnp

        w = es.ParamState(jnp.array(2.0))
        layer = es.transform.checkpoint(lambda x: jnp.sin(w.value * x))
        g = es.transform.grad(lambda x: layer(layer(x)), grad_states=[w])(1.0)
        assert g[w].shape == ()
        ```
    """
    statics = (
        (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    )
    traces = traces_for(fun, getattr(fun, "__name__", None), statics)

    @ft.wraps(fun)
    @draws_atomically
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        traced = Discovery(fun, args, kwargs, traces=kept_or_fresh(traces))
        box: dict[str, Any] = {}

        def pure(values, *args):
            out, updates, new = traced.evaluate(values, show_static(args), kwargs)
            leaves, box["rebuild"] = partition(out)
            box["updated"], box["new"] = list(updates), [s for s, _ in new]
            return leaves, list(updates.values()), [v for _, v in new]

        shifted = tuple(i + 1 if i >= 0 else i for i in statics)
        remat = jax.checkpoint(
            pure, prevent_cse=prevent_cse, policy=policy, static_argnums=shifted
        )
        static = set(statics)
        hidden = tuple(
            a
            if i in static or i - len(args) in static
            else hide_static(copied_numpy(a))
            for i, a in enumerate(args)
        )
        with EQUINOX_ERRORS:
            leaves, updated, new_values = remat(traced.values, *hidden)
        updated, new_values = as_arrays(updated), as_arrays(new_values)
        traced.commit(
            dict(zip(box["updated"], updated)), list(zip(box["new"], new_values))
        )
        return box["rebuild"](leaves)

    return checkpointed


remat = checkpoint
