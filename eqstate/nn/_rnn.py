"""Recurrent cells whose hidden state is a `ShortTermState`."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .. import random
from .._state import ParamState, ShortTermState


def _hidden_shape(hidden_size: int, batch_size: int | None) -> tuple[int, ...]:
    return (hidden_size,) if batch_size is None else (batch_size, hidden_size)


def _check_sizes(
    layer: str, input_size: int, hidden_size: int, batch_size: int | None
) -> None:
    for name, size in (
        ("input_size", input_size),
        ("hidden_size", hidden_size),
        ("batch_size", batch_size),
    ):
        if size is not None and size < 1:
            raise ValueError(f"{layer} needs a positive `{name}`, got {size}.")


def _check_input(cell: "GRUCell | RNNCell", x: Array) -> None:
    if cell.batch_size is None:
        expected = (cell.input_size,)
        fix = "Build the cell with `batch_size=...` to step a batch of sequences."
        batch = ""
    else:
        expected = (cell.batch_size, cell.input_size)
        fix = "The batch size is fixed when the cell is built."
        batch = f", batch_size={cell.batch_size}"
    if x.shape != expected:
        raise ValueError(
            f"{type(cell).__name__}(input_size={cell.input_size}, hidden_size="
            f"{cell.hidden_size}{batch}) takes one time step of shape {expected}, got "
            f"shape {x.shape}. {fix} To run a whole sequence, loop over its time axis "
            "with `eqstate.transform.for_loop(cell, xs)`."
        )


def _matmul(w: Array, x: Array) -> Array:
    # `w @ x` for one input, `x @ w.T` for a batch of them.
    return w @ x if x.ndim == 1 else x @ w.T


class GRUCell(eqx.Module):
    """One step of a Gated Recurrent Unit (GRU), which keeps its hidden state in an
    [`eqstate.ShortTermState`][].

    The parameters are those of `eqx.nn.GRUCell`, each in an [`eqstate.ParamState`][]
    and initialised as it does (so the same `key` gives the same weights), and a call
    computes the same update. Instead of taking and returning the hidden state, a call
    reads and writes `hidden`; [`eqstate.nn.GRUCell.reset`][] zeroes it between
    sequences.

    !!! Example

        ```python
        import eqstate as es
        import eqstate.nn as enn
        import jax.numpy as jnp

        cell = enn.GRUCell(2, 4)
        xs = es.random.normal((10, 2))  # (time, input_size)
        hs = es.transform.for_loop(cell, xs)  # every hidden state, (10, 4)
        assert (cell.hidden.value == hs[-1]).all()

        cell.reset()
        assert (cell.hidden.value == 0).all()
        ```
    """

    weight_ih: ParamState
    weight_hh: ParamState
    bias: ParamState | None
    bias_n: ParamState | None
    hidden: ShortTermState
    input_size: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    batch_size: int | None = eqx.field(static=True)

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        *,
        use_bias: bool = True,
        batch_size: int | None = None,
        dtype: Any = jnp.float32,
        key: PRNGKeyArray | None = None,
    ):
        """**Arguments:**

        - `input_size`: the size of the input at each time step.
        - `hidden_size`: the size of the hidden state.
        - `use_bias`: whether to add the biases `bias` and `bias_n`. (Keyword only
            argument.)
        - `batch_size`: if given, the cell steps a batch of sequences: its input has
            shape `(batch_size, input_size)` and its hidden state
            `(batch_size, hidden_size)`. (Keyword only argument.)
        - `dtype`: the dtype of the parameters and of the hidden state. (Keyword only
            argument.)
        - `key`: the key to initialise the parameters from. By default one is split
            from the default random state, [`eqstate.random.DEFAULT`][]. (Keyword only
            argument.)
        """
        _check_sizes("GRUCell", input_size, hidden_size, batch_size)
        key = random.split_key() if key is None else key
        cell = eqx.nn.GRUCell(input_size, hidden_size, use_bias, dtype, key=key)
        self.weight_ih = ParamState(cell.weight_ih, name="weight_ih")
        self.weight_hh = ParamState(cell.weight_hh, name="weight_hh")
        if cell.bias is not None and cell.bias_n is not None:
            self.bias = ParamState(cell.bias, name="bias")
            self.bias_n = ParamState(cell.bias_n, name="bias_n")
        else:
            self.bias = None
            self.bias_n = None
        self.hidden = ShortTermState(
            jnp.zeros(_hidden_shape(hidden_size, batch_size), dtype), name="hidden"
        )
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.use_bias = use_bias
        self.batch_size = batch_size

    def reset(self) -> None:
        """Sets the hidden state to zeros, e.g. before a new sequence."""
        self.hidden.value = jnp.zeros_like(self.hidden.value)

    def __call__(self, x: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        """**Arguments:**

        - `x`: one time step, of shape `(input_size,)`, or
            `(batch_size, input_size)` for a cell built with `batch_size`.

        **Returns:**

        The new hidden state, which is also written to `hidden`.
        """
        x = jnp.asarray(x)
        _check_input(self, x)
        h = self.hidden.value
        igates = _matmul(self.weight_ih.value, x)
        hgates = _matmul(self.weight_hh.value, h)
        bias_n: Array | float = 0.0
        if self.bias is not None and self.bias_n is not None:
            igates = igates + self.bias.value
            bias_n = self.bias_n.value
        i_r, i_z, i_n = jnp.split(igates, 3, axis=-1)
        h_r, h_z, h_n = jnp.split(hgates, 3, axis=-1)
        reset = jax.nn.sigmoid(i_r + h_r)
        update = jax.nn.sigmoid(i_z + h_z)
        new = jnp.tanh(i_n + reset * (h_n + bias_n))
        h = (new + update * (h - new)).astype(h.dtype)
        self.hidden.value = h
        return h


class RNNCell(eqx.Module):
    """One step of an Elman recurrent cell, `h = tanh(W_ih x + W_hh h + b)`, which
    keeps its hidden state in an [`eqstate.ShortTermState`][].

    The parameters are [`eqstate.ParamState`][]s initialised uniformly in
    `[-1/sqrt(hidden_size), 1/sqrt(hidden_size)]`, as `eqx.nn.GRUCell` does. A call
    reads and writes `hidden`; [`eqstate.nn.RNNCell.reset`][] zeroes it.

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

    weight_ih: ParamState
    weight_hh: ParamState
    bias: ParamState | None
    hidden: ShortTermState
    input_size: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    batch_size: int | None = eqx.field(static=True)

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        *,
        use_bias: bool = True,
        batch_size: int | None = None,
        dtype: Any = jnp.float32,
        key: PRNGKeyArray | None = None,
    ):
        """**Arguments:**

        As for [`eqstate.nn.GRUCell.__init__`][].
        """
        _check_sizes("RNNCell", input_size, hidden_size, batch_size)
        key = random.split_key() if key is None else key
        ihkey, hhkey, bkey = jax.random.split(key, 3)
        lim = math.sqrt(1 / hidden_size)

        def init(k: PRNGKeyArray, shape: tuple[int, ...]) -> Array:
            return jax.random.uniform(k, shape, dtype, minval=-lim, maxval=lim)

        self.weight_ih = ParamState(
            init(ihkey, (hidden_size, input_size)), name="weight_ih"
        )
        self.weight_hh = ParamState(
            init(hhkey, (hidden_size, hidden_size)), name="weight_hh"
        )
        self.bias = (
            ParamState(init(bkey, (hidden_size,)), name="bias") if use_bias else None
        )
        self.hidden = ShortTermState(
            jnp.zeros(_hidden_shape(hidden_size, batch_size), dtype), name="hidden"
        )
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.use_bias = use_bias
        self.batch_size = batch_size

    def reset(self) -> None:
        """Sets the hidden state to zeros, e.g. before a new sequence."""
        self.hidden.value = jnp.zeros_like(self.hidden.value)

    def __call__(self, x: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
        """**Arguments:**

        - `x`: one time step, of shape `(input_size,)`, or
            `(batch_size, input_size)` for a cell built with `batch_size`.

        **Returns:**

        The new hidden state, which is also written to `hidden`.
        """
        x = jnp.asarray(x)
        _check_input(self, x)
        h = self.hidden.value
        pre = _matmul(self.weight_ih.value, x) + _matmul(self.weight_hh.value, h)
        if self.bias is not None:
            pre = pre + self.bias.value
        h = jnp.tanh(pre).astype(h.dtype)
        self.hidden.value = h
        return h
