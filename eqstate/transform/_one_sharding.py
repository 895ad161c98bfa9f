"""`jit(in_shardings=<one Sharding>)`: one sharding for every argument, as in `jax.jit`."""

from collections.abc import Callable
from typing import Any

import jax

from .. import _jax_compat as compat


compat.hide_from_tracebacks(__file__)


class OneShardingJit:
    """`jax.jit(body, ...)` whose leading `n_states` positional arguments (the states'
    values) are placed as they are, and every other dynamic positional argument on
    `sharding`. JAX reads a single `Sharding` as applying to every argument, states
    included, and a tuple must have one entry per argument: so there is one
    `jax.jit` per number of arguments, each with a tuple of the right length."""

    def __init__(
        self,
        body: Callable,
        sharding: jax.sharding.Sharding,
        n_states: int,
        options: dict[str, Any],
    ):
        self._body = body
        self._sharding = sharding
        self._n_states = n_states
        self._options = options
        self._static = tuple(options.get("static_argnums", ()))
        self._jitted: dict[int, Any] = {}

    def _for(self, n_args: int) -> Any:
        jitted = self._jitted.get(n_args)
        if jitted is None:
            static = {i % n_args for i in self._static if -n_args <= i < n_args}
            dynamic = [i for i in range(self._n_states, n_args) if i not in static]
            in_shardings = (None,) * self._n_states + (self._sharding,) * len(dynamic)
            jitted = jax.jit(self._body, in_shardings=in_shardings, **self._options)
            self._jitted[n_args] = jitted
        return jitted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._for(len(args))(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self._for(len(args)).lower(*args, **kwargs)
