"""Checks of the numbers, sizes and flags that users pass, with one message: the
argument, the value given, and what to pass instead.

A `bool` is refused where a number is expected (Python takes `True` as 1), and a
string or `None` where a number or a flag is (`float("0.5")` would take the one,
and a non-empty string is true)."""

import operator
from typing import Any

import jax.numpy as jnp
import numpy as np


def given(value: Any) -> str:
    """The words `got <value> (a <type>)` (or the shape of an array), for messages."""
    if hasattr(value, "dtype") and jnp.ndim(value) > 0:
        return f"got an array of shape {jnp.shape(value)} and dtype {value.dtype}"
    kind = type(value).__name__
    return f"got {value!r} ({'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind})"


def integer(
    value: Any,
    name: str,
    *,
    at_least: int | None = 0,
    none: bool = False,
    owner: str = "",
    what: str | None = None,
    hint: str = "",
) -> Any:
    """`value` as a Python int: any integer `operator.index` takes (NumPy's and JAX's
    integer scalars too), not a `bool`; or `None` if `none` and it is `None`.

    Raises `TypeError` for any other type, `ValueError` below `at_least` (`None`: no
    bound). Both name `name`, after `owner` (such as "GRUCell's "), say that it must
    be `what` (by default, an integer of at least `at_least`), and end in `hint`."""
    if none and value is None:
        return None
    if what is None:
        bounds = {
            None: "an integer",
            0: "a non-negative integer",
            1: "a positive integer",
        }
        what = bounds.get(at_least, f"an integer of at least {at_least}")
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        or_none = " or None" if none else ""
        raise TypeError(
            f"{owner}`{name}` must be {what}{or_none}, {given(value)}{hint}."
        ) from None
    if at_least is not None and number < at_least:
        raise ValueError(f"{owner}`{name}` must be {what}, got {number}{hint}.")
    return number


def real(value: Any, name: str, *, owner: str = "", what: str = "a real number") -> Any:
    """`value` unchanged if it is a real number: a Python `int` or `float` (not a
    `bool`), or a real scalar array (NumPy's, JAX's or a tracer). Else `TypeError`
    naming `name` after `owner`, and saying it must be `what`."""
    dtype = getattr(value, "dtype", None)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if dtype is not None and jnp.shape(value) == () and _is_real(dtype):
        return value
    raise TypeError(f"{owner}`{name}` must be {what}, {given(value)}.")


def _is_real(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)


def flag(value: Any, name: str, *, owner: str = "", none: bool = False) -> Any:
    """`value` unchanged if it is `True` or `False` (Python's or NumPy's), or `None`
    if `none`; else `TypeError` naming `name` after `owner`."""
    if isinstance(value, (bool, np.bool_)) or (none and value is None):
        return value
    or_none = ", or None" if none else ""
    raise TypeError(f"{owner}`{name}` must be True or False{or_none}, {given(value)}.")


def text(value: Any, name: str, *, owner: str = "", none: bool = True) -> Any:
    """`value` unchanged if it is a string (or `None`, if `none`); else `TypeError`
    naming `name` after `owner`."""
    if isinstance(value, str) or (none and value is None):
        return value
    or_none = " or None" if none else ""
    raise TypeError(
        f"{owner}`{name}` must be a string{or_none}, {given(value)}. E.g. "
        f"`{name}={str(value)!r}`."
    )
