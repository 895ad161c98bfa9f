"""Every exception eqstate raises, and the message text they share."""

import dataclasses


class StateNotFoundError(KeyError):
    """A state was read or written where no context holds its value."""

    def __str__(self) -> str:
        # A plain `KeyError` prints its message quoted, with escaped newlines.
        return str(self.args[0]) if self.args else ""


class TraceContextError(RuntimeError):
    """A state was used across a JAX trace boundary that eqstate cannot see: inside a raw
    JAX transform, or after the trace that created it ended. Also raised for a use
    through an `eqstate.scope` that has ended, from a task or thread that inherited
    its context, and for a handle given to JAX where it takes an array (an argument
    of `jax.jit` or `jax.grad`)."""


class HandleGivenToJax(TraceContextError):
    """A state handle given to JAX where it takes an array. Not a `TypeError`, which
    `jax.jit` would replace with its own advice (to mark the argument static)."""


class StateValueError(ValueError):
    """A value written to a state does not match the state's structure, shape or dtype."""


class BatchAxisError(ValueError):
    """A state was given (or would get) a batch axis it may not have: a value that
    differs across the lanes of a `vmap` or the devices of a `shard_map`, written to a
    state that holds one value for all of them."""


class NewStateError(ValueError):
    """A function creates states where they cannot be kept: inside a transform whose
    every call or iteration would create another set (`vmap`, `scan`, `grad`, ...), or
    in a call whose state values are a sequence with no place for them."""


class UnstableStatesError(RuntimeError):
    """The states a function uses, or their shapes, changed between its trace and its
    call: they depend on the values of its arguments, or other threads keep writing
    values of new shapes to them."""


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupted or does not match the model."""


RAW_TRANSFORM_READ = (
    "Cannot read {label} inside a JAX transform that stages out a computation "
    "(`jax.jit`, `eqx.filter_jit`, a `jax.lax.scan` body, ...) and that eqstate does "
    "not know about: the value would be baked into the compiled function as a "
    "constant and go stale. Either use the eqstate version of the transform "
    "(`eqstate.transform.jit`, `eqstate.transform.scan`, ...), or pass the values in "
    "explicitly with `eqstate.run(fn, states, *args)` inside the transform. (A "
    "`jax.custom_jvp`/`custom_vjp` rule reading it may run under such a transform "
    "when JAX differentiates: pass the value to the custom function as an argument.)"
)

PARAMETER_IN_RAW_GRAD = (
    "{label} is read inside a JAX differentiation that eqstate does not know about "
    "(`jax.grad`, `jax.vjp`, `jax.jvp`, `eqx.filter_grad`, ...): its value is a "
    "constant there and gets no gradient. To differentiate a model's arrays and its "
    "parameters together, use `eqstate.transform.grad(loss, argnums=0, "
    "grad_states=eqstate.ParamState)(model, ...)`; with a raw transform, "
    "differentiate the values themselves, passed in with `eqstate.run(fn, states, "
    "...)` inside the differentiated function."
)

RAW_TRANSFORM_WRITE = (
    "Cannot write {label} inside a JAX transform (`jax.jit`, `jax.vmap`, "
    "`jax.lax.scan`, ...) that eqstate does not know about: the new value is a tracer "
    "that would leak out of its trace. Either use the eqstate version of the transform "
    "(`eqstate.transform.jit`, `eqstate.transform.vmap`, `eqstate.transform.scan`, "
    "...), or thread the values explicitly with `eqstate.run(fn, states, *args)`."
)

LEAKED_TRACER_WRITE = (
    "Cannot write a JAX tracer to {label}: the tracer comes from a trace that has "
    "already finished (it leaked out of a `jax.jit`, `jax.vmap`, ... through a Python "
    "side effect). Return the value from the transformed function instead."
)

EXPIRED_STATE = (
    "{label} was created inside a trace of `{where}` and only existed there. It reached "
    "this code through a Python side effect (a global, a closure or a list), so it has "
    "no value outside that trace. Return it from the function instead: every call "
    "then gives the caller fresh states holding their values."
)

FORGOTTEN_VALUE = (
    "{label} is a state handle, not an array: {use} needs its value. Read it with "
    "`.value`, as in `{eg}`."
)

HANDLE_GIVEN_TO_JAX = (
    "{label} was given to JAX where it takes an array: as an argument of a JAX "
    "transform (`jax.jit`, `jax.grad`, `jax.vmap`, `jax.lax.scan`, ...) or of a "
    "`jax.numpy` function. A state handle is not an array, and marking it static "
    "would bake its current value into the compiled function. To transform a function "
    "of a model holding handles, use eqstate's transform, which carries the states: "
    "`eqstate.transform.jit`, `eqstate.transform.grad`, ... To compute with the "
    "state's value, read it: `state.value`."
)

SHAPES_ONLY_STATE = (
    "{label} comes from `eqstate.transform.eval_shape` of `{where}`, which traces the "
    "function abstractly: the handle carries the state's shape and dtype only, and its "
    "value was never made. Call `{where}` itself to create the state with a value."
)


class UnknownCacheKeyError(KeyError):
    """A StatefulFunction was asked for a trace it does not have."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


FROZEN_MODULE = (
    "eqstate: an `eqx.Module` is frozen once `__init__` returns, so a method cannot set "
    "its fields (`self.loss = eqstate.State(loss)` in `__call__`, as a brainstate "
    "module may). Create the state in `__init__`, with a value of its shape, and write "
    "it in `__call__`: `self.loss.value = loss`. Or return the value."
)


def note_frozen_module(error: BaseException) -> None:
    """Adds `FROZEN_MODULE` to a `dataclasses.FrozenInstanceError` (once): Equinox's
    own message names only the field."""
    if isinstance(error, dataclasses.FrozenInstanceError) and FROZEN_MODULE not in (
        getattr(error, "__notes__", ())
    ):
        error.add_note(FROZEN_MODULE)
