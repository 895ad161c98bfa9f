"""A custom differentiation rule that reads a state in a backward pass JAX traces apart
(a loop's, a nested `jit`'s) under `jit`: JAX cannot compile the traced value the rule
closes over, and says only "No constant handler"; eqstate says what to do."""

import jax

from .. import _context
from .._errors import TraceContextError
from ._common import ErrorsRaisedAs


def _is_jax_error_for_a_closed_over_tracer(exc: BaseException) -> bool:
    text = str(exc)
    if isinstance(exc, jax.errors.UnexpectedTracerError):  # JAX 0.12.1 on
        return "reached lowering as a constant" in text
    return (  # JAX up to 0.12.0
        isinstance(exc, TypeError)
        and "No constant handler for type" in text
        and "Tracer" in text
    )


def raise_if_rule_closed_over_a_tracer(exc: BaseException, name: str) -> None:
    """Raises `TraceContextError` in place of JAX's error for a traced value closed
    over by a custom rule (see the module documentation); returns for any other."""
    if not _is_jax_error_for_a_closed_over_tracer(exc):
        return
    if not _context.rule_reads():
        return  # No rule has read a state: another leak, which JAX's message names.
    raise TraceContextError(
        f"{name} cannot be compiled: a traced value is closed over where JAX needs a "
        "constant. The usual cause is a custom differentiation rule (a "
        "`jax.custom_vjp`'s `bwd`) that reads a state, run in the backward pass of a "
        "loop (`scan`, `for_loop`, ...) or of a nested `jit` inside the "
        "differentiated function: JAX traces that pass apart, and cannot take the "
        "traced value the rule reads with it. Pass the state's value to the custom "
        "function as an argument instead (`surrogate(x, threshold.value)`, the rule "
        "getting it as a residual), or call the custom function outside the loop."
    ) from exc


def rule_closure_errors(name: str) -> ErrorsRaisedAs:
    """`with rule_closure_errors(name):` raises the error above in place of JAX's."""
    return ErrorsRaisedAs(lambda exc: raise_if_rule_closed_over_a_tracer(exc, name))
