"""Recurrent cells whose hidden state is a `ShortTermState`.

Every cell computes one example at a time (`_step`, the same operations as the
`eqx.nn` cell of that name) and maps it over the batch axes of its input, so the batch
shape of a call follows the input and the hidden state, never a static field.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NoReturn, SupportsIndex

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, ArrayLike, Inexact, PRNGKeyArray

from .. import random
from .._arguments import flag, integer
from .._pretty_print import state_label
from .._run import init_states
from .._state import ParamState, ShortTermState
from ._ensemble import refuse_stacked_call


_Carry = tuple[Array, ...]
_Params = tuple[Array | None, ...]


# An integer for one batch axis, a sequence for several: Python ints, or NumPy and JAX
# integer scalars (as `np.prod` gives).
_BatchSize = SupportsIndex | Sequence[SupportsIndex] | None


def _batch_shape(layer: str, batch_size: Any) -> tuple[int, ...]:
    """`batch_size` as a tuple of positive Python ints (`()` for None)."""
    if batch_size is None:
        return ()
    sizes = (batch_size,) if np.ndim(batch_size) == 0 else batch_size
    owner, what = f"{layer}'s ", "a positive integer or a tuple of them"
    return tuple(
        integer(n, "batch_size", at_least=1, owner=owner, what=what) for n in sizes
    )


def _check_sizes(layer: str, input_size: Any, hidden_size: Any) -> None:
    for name, size in (("input_size", input_size), ("hidden_size", hidden_size)):
        integer(size, name, at_least=1, owner=f"{layer}'s ")


def _map_over_batch(
    step: Callable[[_Params, Array, _Carry], _Carry],
    params: _Params,
    x: Array,
    carry: _Carry,
    batch_shape: tuple[int, ...],
) -> _Carry:
    """`step` of one example, applied to every example of a batch of shape
    `batch_shape` (flattened into one `jax.vmap`, the parameters shared)."""
    if not batch_shape:
        return step(params, x, carry)

    def flat(a: Array) -> Array:
        return a.reshape(-1, a.shape[-1])

    out = jax.vmap(step, in_axes=(None, 0, 0))(
        params, flat(x), jtu.tree_map(flat, carry)
    )
    return jtu.tree_map(lambda a: a.reshape(*batch_shape, a.shape[-1]), out)


class _RecurrentCell(eqx.Module):
    """What every cell shares: the shape checks, the batch mapping, `reset` and the
    call convention. Subclasses give their parameters and `_step` for one example."""

    weight_ih: eqx.AbstractVar[ParamState[Array]]
    weight_hh: eqx.AbstractVar[ParamState[Array]]
    bias: eqx.AbstractVar[ParamState[Array] | None]
    hidden: eqx.AbstractVar[ShortTermState[Array]]
    input_size: eqx.AbstractVar[int]
    hidden_size: eqx.AbstractVar[int]
    # Whether the cell can be created with a complex `dtype`.
    _takes_complex: ClassVar[bool] = True

    def _carry_states(self) -> tuple[ShortTermState, ...]:
        """The states carried from step to step (the hidden state first)."""
        return (self.hidden,)

    def _params(self) -> _Params:
        """The values of the parameters, as `_step` takes them."""
        return (self.weight_ih.value, self.weight_hh.value, _value(self.bias))

    @staticmethod
    def _step(params: _Params, x: Array, carry: _Carry) -> _Carry:
        """One step for one example: `x` of shape `(input_size,)`, each carried value
        of shape `(hidden_size,)`. Pure: the parameters are passed in, so that it can
        be mapped over a batch with `jax.vmap`."""
        raise NotImplementedError

    def _name(self) -> str:
        return (
            f"{type(self).__name__}(input_size={self.input_size}, "
            f"hidden_size={self.hidden_size})"
        )

    def _check_input(
        self, x: Array, states: tuple[ShortTermState, ...], carry: _Carry
    ) -> tuple[int, ...]:
        """The batch shape of the call, or `ValueError` naming the input's shape and
        that of the first carried state whose batch shape differs."""
        weight = self.weight_ih.value
        if weight.ndim > 2:
            refuse_stacked_call(
                self._name(),
                self.weight_ih,
                weight,
                weight.shape[-2:],
                unit="cell",
                example="`vmap(ensemble, in_states={0: eqstate.states_of(ensemble)}, "
                "in_axes=None)(x)` gives every member the same `x`",
            )
        if x.ndim == 0 or x.shape[-1] != self.input_size:
            raise ValueError(
                f"{self._name()} takes one time step of shape (*batch, "
                f"{self.input_size}), got shape {x.shape}. To run a whole sequence, "
                "loop over its time axis with `eqstate.transform.for_loop(cell, xs)`."
            )
        batch = x.shape[:-1]
        for state, value in zip(states, carry):
            if value.shape[:-1] != batch:
                self._refuse_batch(x, batch, state, value)
        return batch

    def _refuse_batch(
        self, x: Array, batch: tuple[int, ...], state: ShortTermState, value: Array
    ) -> NoReturn:
        carried = "hidden state" if state is self.hidden else f"state '{state.name}'"
        raise ValueError(
            f"{self._name()} got an input of shape {x.shape} (batch shape {batch}), "
            f"but its {carried} has shape {value.shape} here (batch shape "
            f"{value.shape[:-1]}). Give the carried states the batch of the input "
            "before the sequence, outside transforms: `cell.reset(batch_size="
            f"{batch if len(batch) != 1 else batch[0]})`. Inside "
            "`eqstate.transform.vmap`, map every carried state along with the input: "
            "`vmap(cell, in_states={0: eqstate.states_of(cell, "
            "eqstate.ShortTermState)})`; the carried states of an ensemble keep "
            "their members axis first: `cell.reset(batch_size=(members, *batch))`."
        )

    def reset(self, batch_size: _BatchSize = None) -> None:
        """Sets the hidden state to zeros, e.g. before a new sequence.

        **Arguments:**

        - `batch_size`: if given, the hidden state takes this batch shape (an integer
            for one batch axis, a Python int or a NumPy or JAX integer scalar; a
            tuple of them for several; `()` for none), so that the next
            calls take inputs of shape `(*batch, input_size)`. Changing the batch
            shape gives the state a value of a new shape with
            [`eqstate.init_states`][], so only outside eqstate's transforms: in
            eager code, or inside [`eqstate.scope`][] or [`eqstate.run`][] (also
            under `jax.jit`). By default the batch shape stays as it is, and the
            reset is an ordinary write that works everywhere. The hidden
            state of an ensemble built by [`eqstate.transform.vmap_new_states`][]
            has the members axis first: give it too,
            `reset(batch_size=(members, batch))`.
        """
        states = self._carry_states()
        current = [state.value for state in states]
        batch = current[0].shape[:-1]
        if batch_size is not None:
            batch = _batch_shape(type(self).__name__, batch_size)
        shape = (*batch, self.hidden_size)
        init_states({s: jnp.zeros(shape, v.dtype) for s, v in zip(states, current)})

    def _check_dtype(self, x: Array) -> None:
        """`ValueError` for a complex input to a real cell, whose update would drop its
        imaginary part."""
        param_dtype = self.weight_ih.value.dtype
        if not jnp.iscomplexobj(x) or jnp.issubdtype(param_dtype, jnp.complexfloating):
            return
        if not self._takes_complex:
            fix = (
                f"{type(self).__name__} has no complex parameters: give it a real "
                "input, such as the real and imaginary parts side by side, "
                "`jnp.concatenate([x.real, x.imag], -1)`, with twice the `input_size`."
            )
        else:
            fix = (
                "Create the cell with a complex dtype, as in `"
                f"{type(self).__name__}({self.input_size}, {self.hidden_size}, "
                "dtype=jnp.complex64)`."
            )
        raise ValueError(
            f"{self._name()} got a {x.dtype} input, but its "
            f"{state_label(self.weight_ih)} is {param_dtype}, and its real update "
            f"would drop the imaginary part of the input. {fix}"
        )

    def __call__(
        self, x: Inexact[ArrayLike, "..."], *, key: PRNGKeyArray | None = None
    ) -> Inexact[Array, "..."]:
        """**Arguments:**

        - `x`: one time step, of shape `(*batch, input_size)`. The batch shape must
            be that of the hidden state: `()` for a cell built without `batch_size`;
            see `reset` to change it. A complex input needs a cell created with a
            complex `dtype`; a real cell refuses it rather than drop its imaginary
            part.
        - `key`: ignored; accepted so that the cell can be called as an Equinox layer
            (`eqx.nn.Sequential` passes one). (Keyword only argument.)

        **Returns:**

        The new hidden state, of shape `(*batch, hidden_size)`, which is also
        written to `hidden`.
        """
        del key
        x = jnp.asarray(x)
        states = self._carry_states()
        carry = tuple(state.value for state in states)
        self._check_dtype(x)
        batch_shape = self._check_input(x, states, carry)
        new = _map_over_batch(self._step, self._params(), x, carry, batch_shape)
        new = tuple(value.astype(old.dtype) for old, value in zip(carry, new))
        for state, value in zip(states, new):
            state.value = value
        return new[0]


def _check_param_dtype(cls: type[_RecurrentCell], dtype: Any) -> None:
    layer = cls.__name__
    if cls._takes_complex and not jnp.issubdtype(dtype, jnp.inexact):
        raise ValueError(
            f"{layer} needs a floating or complex `dtype` for its parameters and "
            f"hidden state, which are drawn at random and trained, got "
            f"{jnp.dtype(dtype)}. Use a floating dtype such as the default "
            "`jnp.float32`, or a complex one such as `jnp.complex64` for complex inputs."
        )
    if not cls._takes_complex and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{layer} needs a real floating `dtype` for its parameters and hidden "
            f"state, got {jnp.dtype(dtype)}: it has no complex parameters, and "
            "integer ones could not be drawn at random or trained. Use a floating "
            "dtype such as the default `jnp.float32`. For complex inputs, give it the "
            "real and imaginary parts side by side, `jnp.concatenate([x.real, "
            "x.imag], -1)`, with twice the `input_size`, or use `GRUCell` or "
            "`LSTMCell` with `dtype=jnp.complex64`."
        )


def _batch_and_key(
    cls: type[_RecurrentCell],
    input_size: Any,
    hidden_size: Any,
    use_bias: Any,
    batch_size: Any,
    dtype: Any,
    key: PRNGKeyArray | None,
) -> tuple[tuple[int, ...], PRNGKeyArray]:
    """The checked batch shape of a new cell, and the key to initialise it from (split
    from the default random state if `key` is None), after checking the sizes,
    `use_bias` and `dtype`."""
    layer = cls.__name__
    _check_sizes(layer, input_size, hidden_size)
    batch = _batch_shape(layer, batch_size)
    flag(use_bias, "use_bias", owner=f"{layer}'s ")
    _check_param_dtype(cls, dtype)
    return batch, random.split_key() if key is None else key


def _affine(
    weight_ih: Array, weight_hh: Array, bias: Array | None, x: Array, h: Array
) -> Array:
    """`weight_ih @ x + weight_hh @ h + bias`, in the order of `eqx.nn.LSTMCell`."""
    out = weight_ih @ x + weight_hh @ h
    return out if bias is None else out + bias


def _hidden(shape: tuple[int, ...], dtype: Any, name: str) -> ShortTermState:
    return ShortTermState(jnp.zeros(shape, dtype), name=name)


def _param(array: Array | None, name: str) -> ParamState | None:
    return None if array is None else ParamState(array, name=name)


def _value(state: ParamState | None) -> Array | None:
    return None if state is None else state.value


class GRUCell(_RecurrentCell):
    """One step of a Gated Recurrent Unit (GRU), which keeps its hidden state in an
    [`eqstate.ShortTermState`][].

    The parameters are those of `eqx.nn.GRUCell`, each in an [`eqstate.ParamState`][]
    and initialised as it does (so the same `key` gives the same weights), and a call
    computes the same update. Instead of taking and returning the hidden state, a call
    reads and writes `hidden`; [`eqstate.nn.GRUCell.reset`][] zeroes it between
    sequences, and gives it a batch shape.

    The batch shape follows the hidden state: a cell built without `batch_size` takes
    one example of shape `(input_size,)`; after `cell.reset(batch_size=8)` it takes
    inputs of shape `(8, input_size)`; and [`eqstate.transform.vmap`][] over a cell
    whose hidden state has a batch axis maps the single-example cell.

    !!! Example

        ```python
        import eqstate as es
        import eqstate.nn as enn
        import jax.numpy as jnp

        cell = enn.GRUCell(2, 4)
        xs = es.random.normal((10, 2))  # (time, input_size)
        hs = es.transform.for_loop(cell, xs)  # every hidden state, (10, 4)
        assert (cell.hidden.value == hs[-1]).all()

        cell.reset(batch_size=8)  # the batch is chosen here, after building
        hs = es.transform.for_loop(cell, es.random.normal((10, 8, 2)))
        assert hs.shape == (10, 8, 4)

        # Or map the single-example cell over the hidden state's batch axis:
        step = es.transform.vmap(cell, in_states={0: cell.hidden})
        assert step(es.random.normal((8, 2))).shape == (8, 4)
        ```
    """

    weight_ih: ParamState[Array]
    weight_hh: ParamState[Array]
    bias: ParamState[Array] | None
    bias_n: ParamState[Array] | None
    hidden: ShortTermState[Array]
    input_size: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        *,
        use_bias: bool = True,
        batch_size: _BatchSize = None,
        dtype: Any = jnp.float32,
        key: PRNGKeyArray | None = None,
    ):
        """**Arguments:**

        - `input_size`: the size of the input at each time step.
        - `hidden_size`: the size of the hidden state.
        - `use_bias`: whether to add the biases `bias` and `bias_n`. (Keyword only
            argument.)
        - `batch_size`: the initial batch shape of the hidden state (an integer,
            Python's or a NumPy or JAX integer scalar, or a tuple of them for several
            batch axes); by default none, for one example at a
            time. `reset(batch_size=...)` changes it. (Keyword only argument.)
        - `dtype`: the dtype of the parameters and of the hidden state: a floating
            dtype, or a complex one for complex inputs (an integer one is refused).
            (Keyword only argument.)
        - `key`: the key to initialise the parameters from. By default one is split
            from the default random state, [`eqstate.random.DEFAULT`][]. (Keyword only
            argument.)
        """
        batch, key = _batch_and_key(
            GRUCell, input_size, hidden_size, use_bias, batch_size, dtype, key
        )
        ref = eqx.nn.GRUCell(input_size, hidden_size, use_bias, dtype, key=key)
        self.weight_ih = ParamState(ref.weight_ih, name="weight_ih")
        self.weight_hh = ParamState(ref.weight_hh, name="weight_hh")
        self.bias = _param(ref.bias, "bias")
        self.bias_n = _param(ref.bias_n, "bias_n")
        self.hidden = _hidden((*batch, hidden_size), dtype, "hidden")
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.use_bias = use_bias

    def _params(self) -> _Params:
        return (*super()._params(), _value(self.bias_n))

    @staticmethod
    def _step(params: _Params, x: Array, carry: _Carry) -> _Carry:
        # The operations of `eqx.nn.GRUCell.__call__`, in its order.
        weight_ih, weight_hh, bias, bias_n = params
        assert weight_ih is not None and weight_hh is not None
        (h,) = carry
        i_r, i_z, i_n = jnp.split(weight_ih @ x + (0 if bias is None else bias), 3)
        h_r, h_z, h_n = jnp.split(weight_hh @ h, 3)
        bias_n = 0 if bias_n is None else bias_n
        reset = jax.nn.sigmoid(i_r + h_r)
        update = jax.nn.sigmoid(i_z + h_z)
        new = jnp.tanh(i_n + reset * (h_n + bias_n))
        return (new + update * (h - new),)


class LSTMCell(_RecurrentCell):
    """One step of a Long Short-Term Memory (LSTM) cell, which keeps its hidden state
    and its cell state in two [`eqstate.ShortTermState`][]s, `hidden` and `cell`.

    The parameters are those of `eqx.nn.LSTMCell`, each in an [`eqstate.ParamState`][]
    and initialised as it does (so the same `key` gives the same weights), and a call
    computes the same update of `(hidden, cell)`. A call returns the new hidden state;
    [`eqstate.nn.LSTMCell.reset`][] zeroes both states and sets their batch shape, as
    for [`eqstate.nn.GRUCell`][].

    !!! Example

        ```python
        import eqstate as es
        import eqstate.nn as enn

        lstm = enn.LSTMCell(3, 5)
        lstm.reset(batch_size=4)
        hs = es.transform.for_loop(lstm, es.random.normal((20, 4, 3)))
        assert hs.shape == (20, 4, 5) and (lstm.hidden.value == hs[-1]).all()
        assert lstm.cell.value.shape == (4, 5)
        ```
    """

    weight_ih: ParamState[Array]
    weight_hh: ParamState[Array]
    bias: ParamState[Array] | None
    hidden: ShortTermState[Array]
    cell: ShortTermState[Array]
    input_size: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        *,
        use_bias: bool = True,
        batch_size: _BatchSize = None,
        dtype: Any = jnp.float32,
        key: PRNGKeyArray | None = None,
    ):
        """**Arguments:**

        As for [`eqstate.nn.GRUCell.__init__`][]; `use_bias` adds one bias, `bias`.
        """
        batch, key = _batch_and_key(
            LSTMCell, input_size, hidden_size, use_bias, batch_size, dtype, key
        )
        ref = eqx.nn.LSTMCell(input_size, hidden_size, use_bias, dtype, key=key)
        self.weight_ih = ParamState(ref.weight_ih, name="weight_ih")
        self.weight_hh = ParamState(ref.weight_hh, name="weight_hh")
        self.bias = _param(ref.bias, "bias")
        self.hidden = _hidden((*batch, hidden_size), dtype, "hidden")
        self.cell = _hidden((*batch, hidden_size), dtype, "cell")
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.use_bias = use_bias

    def _carry_states(self) -> tuple[ShortTermState, ...]:
        return (self.hidden, self.cell)

    @staticmethod
    def _step(params: _Params, x: Array, carry: _Carry) -> _Carry:
        # The operations of `eqx.nn.LSTMCell.__call__`, in its order.
        weight_ih, weight_hh, bias = params
        assert weight_ih is not None and weight_hh is not None
        h, c = carry
        i, f, g, o = jnp.split(_affine(weight_ih, weight_hh, bias, x, h), 4)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c)


class RNNCell(_RecurrentCell):
    """One step of an Elman recurrent cell, `h = tanh(W_ih x + W_hh h + b)`, which
    keeps its hidden state in an [`eqstate.ShortTermState`][].

    The parameters are [`eqstate.ParamState`][]s initialised uniformly in
    `[-1/sqrt(hidden_size), 1/sqrt(hidden_size)]`, as `eqx.nn.GRUCell` does. A call
    reads and writes `hidden`; [`eqstate.nn.RNNCell.reset`][] zeroes it and sets its
    batch shape, as for [`eqstate.nn.GRUCell`][].

    !!! Example

        ```python
        import eqstate as es
        import eqstate.nn as enn

        cell = enn.RNNCell(3, 5, batch_size=8)
        xs = es.random.normal((20, 8, 3))  # (time, batch, input_size)
        hs = es.transform.for_loop(cell, xs)
        assert hs.shape == (20, 8, 5) and (cell.hidden.value == hs[-1]).all()
        ```
    """

    weight_ih: ParamState[Array]
    weight_hh: ParamState[Array]
    bias: ParamState[Array] | None
    hidden: ShortTermState[Array]
    input_size: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    _takes_complex: ClassVar[bool] = False

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        *,
        use_bias: bool = True,
        batch_size: _BatchSize = None,
        dtype: Any = jnp.float32,
        key: PRNGKeyArray | None = None,
    ):
        """**Arguments:**

        As for [`eqstate.nn.GRUCell.__init__`][], except that `dtype` must be a real
        floating dtype: an `RNNCell` has no complex parameters (a complex `dtype` is
        refused). For complex inputs, use `GRUCell` or `LSTMCell`, or give the cell
        the real and imaginary parts side by side.
        """
        batch, key = _batch_and_key(
            RNNCell, input_size, hidden_size, use_bias, batch_size, dtype, key
        )
        ihkey, hhkey, bkey = jax.random.split(key, 3)
        lim = math.sqrt(1 / hidden_size)

        def init(k: PRNGKeyArray, shape: tuple[int, ...], name: str) -> ParamState:
            value = jax.random.uniform(k, shape, dtype, minval=-lim, maxval=lim)
            return ParamState(value, name=name)

        self.weight_ih = init(ihkey, (hidden_size, input_size), "weight_ih")
        self.weight_hh = init(hhkey, (hidden_size, hidden_size), "weight_hh")
        self.bias = init(bkey, (hidden_size,), "bias") if use_bias else None
        self.hidden = _hidden((*batch, hidden_size), dtype, "hidden")
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.use_bias = use_bias

    @staticmethod
    def _step(params: _Params, x: Array, carry: _Carry) -> _Carry:
        weight_ih, weight_hh, bias = params
        assert weight_ih is not None and weight_hh is not None
        (h,) = carry
        return (jnp.tanh(_affine(weight_ih, weight_hh, bias, x, h)),)
