"""Dropout, drawing its masks from `eqstate.random`."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.core import Tracer
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .. import random
from .._arguments import flag, real


class Dropout(eqx.Module):
    """Zeroes each entry with probability `p` and scales the rest by `1 / (1 - p)` in
    training; does nothing in inference.

    Unlike `eqx.nn.Dropout`, it needs no key: the mask is drawn from the default
    random state ([`eqstate.random.DEFAULT`][]), which each call advances, so every
    eqstate transform threads it like any other state (and
    [`eqstate.transform.vmap`][] draws a different mask in each lane). Given a `key`,
    it draws from that key instead and gives exactly the output of `eqx.nn.Dropout`.

    Run through [`eqstate.run`][] inside a raw `jax.vmap` or `eqx.filter_vmap`, with
    the default random state in an unmapped `StateDict`, every lane reads the same
    key (JAX does not split it), so every example gets the same mask. Use
    [`eqstate.transform.vmap`][], which splits random states per lane, or pass a key
    per example with `key=`, as for `eqx.nn.Dropout`.

    !!! Example

        ```python
        import eqstate as es
        import eqstate.nn as enn
        import jax.numpy as jnp

        dropout = enn.Dropout(0.25)
        x = jnp.ones(1000)
        y1, y2 = dropout(x), dropout(x)  # two calls, two masks
        assert ((y1 == 0) | jnp.isclose(y1, 1 / 0.75)).all() and (y1 != y2).any()
        assert (dropout(x, inference=True) == x).all()
        ```
    """

    # Not static, as in `eqx.nn.Dropout`, so that `eqx.tree_at` can change them.
    p: float | Float[ArrayLike, ""]
    inference: bool

    def __init__(
        self, p: float | Float[ArrayLike, ""] = 0.5, *, inference: bool = False
    ):
        """**Arguments:**

        - `p`: the probability of zeroing each entry, in `[0, 1)`: a Python float or
            a scalar array (traced under `jit` when it is a field of a model passed as
            an argument, so it can change without compiling again).
        - `inference`: whether to turn dropout off. It can be overridden per call, or
            set on a whole model with `eqx.nn.inference_mode`. (Keyword only
            argument.)
        """
        real(p, "p", owner="Dropout's ", what="a probability in [0, 1)")
        if not isinstance(p, Tracer) and not 0.0 <= float(p) < 1.0:  # pyright: ignore[reportArgumentType]
            raise ValueError(
                f"Dropout's `p` is the probability of zeroing an entry and must be in "
                f"[0, 1), got {p}. (`p=1` would zero everything and scale by 1/0.)"
            )
        self.p = p
        self.inference = flag(inference, "inference", owner="Dropout's ")

    def __call__(
        self,
        x: Float[ArrayLike, "..."],
        *,
        inference: bool | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "..."]:
        """**Arguments:**

        - `x`: an array of any shape.
        - `inference`: if `True` or `False`, overrides `self.inference` for this call.
            (Keyword only argument.)
        - `key`: a key to draw the mask from. By default one is split from the
            default random state, which advances. (Keyword only argument.)

        **Returns:**

        An array of the shape of `x`.
        """
        x = jnp.asarray(x)
        flag(inference, "inference", owner="Dropout's ", none=True)
        if inference is None:
            inference = self.inference
        if inference or (isinstance(self.p, (int, float)) and self.p == 0):
            return x
        # The same operations as `eqx.nn.Dropout`, so that a given key gives its bits.
        q = 1 - jax.lax.stop_gradient(self.p)
        mask = random.bernoulli(q, x.shape, key=key)
        return jnp.where(mask, x / q, 0)
