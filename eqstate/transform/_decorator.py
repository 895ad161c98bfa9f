"""The decorator form shared by the transforms: `@transform(**options)`."""

import functools as ft
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from .. import _jax_compat as compat
from .._custom_types import MISSING


compat.hide_from_tracebacks(__file__)


_P = ParamSpec("_P")
_T = TypeVar("_T")


def decorator_form(transform: Callable[_P, _T]) -> Callable[_P, _T]:
    """Lets `transform(fun, *options)`, whose first argument `fun` defaults to
    `MISSING`, also be written `@transform(*options)`: called without `fun`, it returns
    the decorator that applies it with those options."""

    apply: Callable[..., Any] = transform  # `fun` first, then the options

    @ft.wraps(transform)
    def transform_or_decorator(*args: Any, **kwargs: Any) -> Any:
        fun = args[0] if args else kwargs.pop("fun", MISSING)
        if fun is MISSING:
            return lambda f: apply(f, *args[1:], **kwargs)
        return apply(fun, *args[1:], **kwargs)

    return transform_or_decorator
