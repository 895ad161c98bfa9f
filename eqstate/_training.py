"""What an optimiser updates in a model: its parameter states and its own arrays."""

import functools as ft
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._context import current_frame
from ._custom_types import Filter, PyTree
from ._errors import StateValueError
from ._pretty_print import first_and_more, state_label
from ._run import assign, states_of, values_of
from ._state import ParamState, State
from ._state_dict import state_dict_of, StateDict
from ._write_checks import STRUCTURE_HINTS


_Model = TypeVar("_Model")


_UPDATES_SHAPE = """\
`eqstate.apply_updates(model, updates)` takes updates shaped like
`eqstate.trainable(model)`, a pair `(StateDict, arrays)`; got {got}. Optimise
`eqstate.trainable(model)` and pass what `optimizer.update` returns:

    params = eqstate.trainable(model)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    model = eqstate.apply_updates(model, updates)

Updates of the states alone (a StateDict, as optax gives them for
`eqstate.values_of(model, eqstate.ParamState)`) are written with `eqstate.assign`:

    params = eqstate.values_of(model, eqstate.ParamState)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    eqstate.assign(optax.apply_updates(params, updates))"""


_OTHER_STYLE = """\
Cannot write a value shaped like {new} to {label}, whose value is shaped like {old}:
the two come from the two ways of training a model (`eqstate.trainable` gives pairs
`(StateDict, arrays)`, `eqstate.values_of` StateDicts alone). Build the optimiser
state, the gradients and the updates alike, as in the recommended step:

    opt_state = eqstate.LongTermState(optimizer.init(eqstate.trainable(model)))
    ...
    grad = eqstate.transform.grad(loss, argnums=0, grad_states=eqstate.ParamState)
    params = eqstate.trainable(model)
    updates, opt_state.value = optimizer.update(grad(model, x), opt_state.value, params)
    model = eqstate.apply_updates(model, updates)"""

_SHAPED_LIKE = {
    "trainable": "`eqstate.trainable(model)`",
    "values_of": "`eqstate.values_of(model, eqstate.ParamState)`",
}


def _is_trainable_pair(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], StateDict)


def _style(value: PyTree) -> str | None:
    """`'trainable'` if `value` (an optimiser state, say) holds `trainable`'s pairs
    only, `'values_of'` if it holds StateDicts alone only, else `None`."""
    is_node = lambda x: _is_trainable_pair(x) or isinstance(x, StateDict)  # noqa: E731
    kinds = {
        _is_trainable_pair(x) for x in jtu.tree_leaves(value, is_node) if is_node(x)
    }
    return {frozenset({True}): "trainable", frozenset({False}): "values_of"}.get(
        frozenset(kinds)
    )


def _other_style_hint(label: str, old: PyTree, new: PyTree) -> str:
    styles = (_style(old), _style(new))
    if set(styles) != {"trainable", "values_of"}:
        return ""
    old_shape, new_shape = (_SHAPED_LIKE[s] for s in styles)  # type: ignore[index]
    return _OTHER_STYLE.format(label=label, old=old_shape, new=new_shape)


STRUCTURE_HINTS.append(_other_style_hint)


def _is_inexact_leaf(x: Any) -> bool:
    # Under `vmap`, `peek` gives a lane's `jax.ShapeDtypeStruct`s, not arrays.
    return isinstance(
        x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)
    ) and jnp.issubdtype(x.dtype, jnp.inexact)


def inexact_part(value: PyTree) -> PyTree | None:
    """The part of a state's value that gets a gradient: `value` with `None` in place
    of every leaf that is not a floating-point or complex array (as `eqx.filter_grad`
    differentiates a PyTree), or `None` if no leaf is one."""
    part = eqx.filter(value, _is_inexact_leaf)
    return part if jtu.tree_leaves(part) else None


def trainable(model: PyTree, *filters: Filter) -> tuple[StateDict, Any]:
    """The values an optimiser updates in a model: the floating-point values of its
    states matching `filters` ([`eqstate.ParamState`][]s by default), and its own
    floating-point arrays (the weights of `eqx.nn` layers).

    As `eqstate.transform.grad` picks states, a state is included if its value holds
    a floating-point or complex array, with `None` at its other leaves (a state
    `{"w": floats, "mask": ints}` gives `{"w": floats, "mask": None}`); a state
    holding none (an integer setting, a step counter) is left out. So the pair has
    the structure of the gradients that
    `eqstate.transform.grad(loss, grad_states=es.ParamState, argnums=0)(model, ...)`
    returns, and one optax optimiser serves both, when the loss reads no
    `ParamState` outside `model`. A loss that also reads another model's (a frozen
    teacher it closes over) gets gradients for those too: pass
    `grad_states=es.trainable(model)[0], check_states=False` to differentiate this
    model's alone ([`eqstate.apply_updates`][] refuses updates to states `model`
    does not hold).

    **Arguments:**

    - `model`: a PyTree, typically an `eqx.Module` holding arrays and handles.
    - `*filters`: the states to include (see [`eqstate.filters`][]).

    **Returns:**

    `(state_values, arrays)`: a [`eqstate.StateDict`][] of the states' floating-point
    parts, and `model` with `None` in place of every leaf that is not a
    floating-point array (as `eqx.filter(model, eqx.is_inexact_array)`, and typed
    `Any` as it is: optax's `Params` type admits no `eqx.Module`). A
    `StateDict` the model holds as a field (a snapshot to reset to) is arrays of the
    model to Equinox: it gets gradients with `argnums`, and an optimiser updates it
    (weight decay shrinks it). Keep such values out of the model passed to `grad`
    and `trainable`, or in a state of their own.

    !!! Example

        ```python
        import eqstate as es
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        class Model(eqx.Module):
            linear: eqx.nn.Linear
            scale: es.ParamState

            def __init__(self, key):
                self.linear = eqx.nn.Linear(2, 2, key=key)
                self.scale = es.ParamState(jnp.ones(2))

        model = Model(jax.random.key(0))
        states, arrays = es.trainable(model)
        assert states.states == (model.scale,)
        assert arrays.linear.weight is model.linear.weight and arrays.scale is None
        ```
    """
    values = values_of(model, *(filters or (ParamState,)))
    parts = {s: inexact_part(v) for s, v in values.items()}
    states = state_dict_of({s: p for s, p in parts.items() if p is not None})
    return states, eqx.filter(model, eqx.is_inexact_array)


def apply_updates(model: _Model, updates: PyTree) -> _Model:
    """Applies optimiser updates shaped like [`eqstate.trainable`][]`(model)`: writes
    each state's value plus its update (as [`eqstate.assign`][], all at once), and
    returns `model` with its arrays updated (as `eqx.apply_updates`).

    Each sum is cast to the state's dtype, as `optax.apply_updates` casts it (a
    float32 update to a bfloat16 parameter gives bfloat16), also under strict dtype
    promotion. An update that the state's dtype cannot hold, complex for a real
    state or inexact for an integer one, is refused rather than truncated, as is an
    integer update of a wider dtype than its integer state's (the sum could wrap
    around), one of another shape, and an update to a state that `model` does not
    hold.

    **Arguments:**

    - `model`: the model the updates are for.
    - `updates`: `(state_updates, array_updates)`, e.g. from `optimizer.update`
        given [`eqstate.trainable`][]`(model)`. A StateDict of updates alone, from an
        optimiser of `eqstate.values_of(model, eqstate.ParamState)`, is refused with
        a `TypeError`: write those with
        `eqstate.assign(optax.apply_updates(params, updates))`.

    **Returns:**

    The updated model. (The states are updated in the innermost context.)

    !!! Example

        ```python
        import eqstate as es
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import optax

        class Model(eqx.Module):
            linear: eqx.nn.Linear
            scale: es.ParamState

            def __init__(self, key):
                self.linear = eqx.nn.Linear(2, 1, key=key)
                self.scale = es.ParamState(jnp.ones(1))

            def __call__(self, x):
                return self.linear(x) * self.scale.value

        def loss(model, x, y):
            return jnp.sum((model(x) - y) ** 2)

        model = Model(jax.random.key(0))
        optimizer = optax.sgd(0.1)
        opt_state = es.LongTermState(optimizer.init(es.trainable(model)))

        @es.transform.jit
        def train_step(model, x, y):
            grad = es.transform.grad(loss, grad_states=es.ParamState, argnums=0)
            grads = grad(model, x, y)
            params = es.trainable(model)
            updates, opt_state.value = optimizer.update(grads, opt_state.value, params)
            return es.apply_updates(model, updates)

        x, y = jnp.ones(2), jnp.zeros(1)
        before = loss(model, x, y)
        for _ in range(5):
            model = train_step(model, x, y)
        assert loss(model, x, y) < before
        ```
    """
    state_updates, array_updates = _split_updates(updates)
    states = state_updates.states
    _refuse_foreign(states, model)
    # The arrays first, then every state's update, before any state is written: updates
    # that do not fit the model raise, and a failed call changes nothing.
    updated = eqx.apply_updates(model, array_updates)
    current = current_frame().read_many(states) if states else []
    assign(
        {
            s: jtu.tree_map(ft.partial(_add, s), value, state_updates[s])
            for s, value in zip(states, current)
        }
    )
    return updated


def _split_updates(updates: PyTree) -> tuple[StateDict, PyTree]:
    """`updates` as `(state_updates, array_updates)`, checked before it is unpacked:
    a StateDict of two states would unpack into two handles."""
    if isinstance(updates, StateDict):
        got = "a StateDict alone"
    elif not isinstance(updates, (tuple, list)) or len(updates) != 2:
        got = f"a {type(updates).__name__}"
    elif not isinstance(updates[0], StateDict):
        got = f"a pair whose first element is a {type(updates[0]).__name__}"
    else:
        return updates[0], updates[1]
    raise TypeError(_UPDATES_SHAPE.format(got=got))


def _refuse_foreign(states: tuple[State, ...], model: PyTree) -> None:
    """Refuses updates to states that `model` does not hold, such as a frozen
    teacher's parameters that the loss closes over."""
    held = set(states_of(model))
    foreign = [s for s in states if s not in held]
    if foreign:
        raise StateValueError(
            f"The updates hold {first_and_more(map(state_label, foreign))}, which "
            "`model` does not hold: `apply_updates` updates the model's own states "
            "only. `grad_states=es.ParamState` differentiates every ParamState the "
            "loss reads, also those of a model it closes over (a frozen teacher); "
            "to train this model's alone, name them: "
            "`grad_states=es.trainable(model)[0], check_states=False`."
        )


def _add(state: Any, value: Any, update: Any) -> Any:
    if update is None:
        return value
    # `value + update` would broadcast an update of another shape.
    if jnp.shape(update) != value.shape:
        raise StateValueError(
            f"Cannot apply an update of shape {jnp.shape(update)} to "
            f"{state_label(state)} (shape {value.shape}). An update must have the "
            "shape of the value it updates: pass what `optimizer.update` returned "
            "for `eqstate.trainable(model)`."
        )
    # JAX's standard promotion whatever the user's setting: the sum is cast back to
    # the state's dtype (as optax does), and refused where that would drop something.
    with jax.numpy_dtype_promotion("standard"):
        summed = jnp.result_type(value, update)
    if _kind(summed) != _kind(value.dtype):
        raise StateValueError(
            f"Cannot apply an update of dtype {jnp.result_type(update)} to "
            f"{state_label(state)} (dtype {value.dtype}): the sum is {summed}, and "
            f"casting it back to {value.dtype} would drop what that dtype cannot hold "
            "(an imaginary part, a fraction). Compute the updates in the state's "
            "dtype, or give the state a dtype that holds them."
        )
    given = getattr(update, "dtype", None)  # None: a Python number, weakly typed
    if (
        _kind(value.dtype) in "bi"
        and given is not None
        and not np.can_cast(given, value.dtype, casting="safe")
    ):
        raise StateValueError(
            f"Cannot apply an update of dtype {given} to {state_label(state)} "
            f"(dtype {value.dtype}): casting the sum back to {value.dtype} would "
            "wrap around where it does not fit (250 + 10 as uint8 is 4). Compute "
            f"the updates in {value.dtype}."
        )
    return (value.astype(summed) + jnp.asarray(update, summed)).astype(value.dtype)


def _kind(dtype: Any) -> str:
    """The kind of numbers `dtype` holds: `b` (bool), `i` (integers), `f` (real) or
    `c` (complex)."""
    for kind, of in (("c", jnp.complexfloating), ("f", jnp.floating)):
        if jnp.issubdtype(dtype, of):
            return kind
    return "b" if jnp.issubdtype(dtype, jnp.bool_) else "i"
