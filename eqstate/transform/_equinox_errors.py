"""`eqx.error_if` failing in a program eqstate compiled raises what it raises under
`eqx.filter_jit`: `eqx.EquinoxRuntimeError`, with the check's message."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from ._common import ErrorsRaisedAs


# What running a compiled program raises for a failed callback (JAX reports some
# runtime errors as `ValueError`).
RUNTIME_ERRORS: tuple[type[Exception], ...] = (jax.errors.JaxRuntimeError, ValueError)
# Equinox's callback raises a private class of this name, and adds a notice about
# `eqx.filter_jit` after the message.
_EQUINOX_CLASS = "_EquinoxRuntimeError: "
_EQUINOX_NOTICE = "\n\n\n--------------------"


def raise_equinox_error(exc: BaseException) -> None:
    """Raises `eqx.EquinoxRuntimeError` with the message of the `eqx.error_if` check
    whose failure `exc` reports; returns if `exc` reports none."""
    text = str(exc)
    start = text.find(_EQUINOX_CLASS)
    if start < 0:
        return
    message = text[start + len(_EQUINOX_CLASS) :].split(_EQUINOX_NOTICE, 1)[0]
    # `from None`, as `eqx.filter_jit` does: JAX's report is long and says nothing more.
    raise eqx.EquinoxRuntimeError(
        f"{message}\n\n(An `eqx.error_if` check failed in a program that eqstate "
        "compiled; the states keep their values from before the call. To stop in a "
        "debugger where it fails, set the environment variable "
        "`EQX_ON_ERROR=breakpoint`.)"
    ) from None


def _raise_equinox_runtime_error(exc: BaseException) -> None:
    if isinstance(exc, RUNTIME_ERRORS):
        raise_equinox_error(exc)


# `with EQUINOX_ERRORS:` turns a failed `eqx.error_if` check raised in the block into
# `eqx.EquinoxRuntimeError`.
EQUINOX_ERRORS = ErrorsRaisedAs(_raise_equinox_runtime_error)


def with_equinox_errors(fn: Callable, *args: Any) -> Any:
    """`fn(*args)`, where a failed `eqx.error_if` check of a top-level call (which JAX
    evaluates at once) raises `eqx.EquinoxRuntimeError`, as under `eqx.filter_jit`."""
    with EQUINOX_ERRORS:
        return fn(*args)
