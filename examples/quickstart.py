"""eqstate in one minute: a stateful model, what it reads and writes, and a pure loop.

Run with `python examples/quickstart.py`.
"""

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int


class CountingLinear(eqx.Module):
    """A linear layer that counts its calls and keeps a running mean of its inputs."""

    weight: es.ParamState[Float[Array, "n_out n_in"]]
    calls: es.ShortTermState[Int[Array, ""]]
    mean: es.LongTermState[Float[Array, " n_in"]]

    def __init__(self, n_in: int, n_out: int, key: jax.Array):
        self.weight = es.ParamState(
            jr.normal(key, (n_out, n_in)) / n_in**0.5, name="weight"
        )
        self.calls = es.ShortTermState(jnp.array(0), name="calls")
        self.mean = es.LongTermState(jnp.zeros(n_in), name="mean")

    def __call__(self, x: jax.Array) -> jax.Array:
        self.calls.value = self.calls.value + 1
        self.mean.value = self.mean.value + (x - self.mean.value) / self.calls.value
        return self.weight.value @ x


def main() -> None:
    model = CountingLinear(3, 2, jr.key(0))

    # 1. Eager use: states live in the world.
    y = model(jnp.ones(3))
    print("eager output:", y, "| calls:", model.calls.value)

    # 2. Trace once and ask what the function reads and writes.
    sf = es.transform.StatefulFunction(model).make_jaxpr(jnp.ones(3))
    print("reads: ", sf.get_read_states())
    print("writes:", sf.get_write_states())
    print("pure jaxpr:", sf.get_jaxpr())

    # 3. A pure loop: thread an explicit StateDict through `jax.lax.scan`, compiled
    # by Equinox (`jax.jit` works as well, but its result has no type).
    @eqx.filter_jit
    def run_many(states: es.StateDict, xs: jax.Array) -> tuple[es.StateDict, jax.Array]:
        def step(states: es.StateDict, x: jax.Array) -> tuple[es.StateDict, jax.Array]:
            return sf.jaxpr_call(states, x)

        return jax.lax.scan(step, states, xs)

    xs = jr.normal(jr.key(1), (100, 3))
    states, _ = run_many(sf.to_state_manager(), xs)
    print(
        "after 100 pure steps: calls =",
        states[model.calls],
        "| world calls =",
        model.calls.value,
    )
    print("running mean:", states[model.mean], "| true mean:", (xs.sum(0) + 1) / 101)


if __name__ == "__main__":
    main()
