"""Data-parallel training: the parameters are replicated on every device, the batch is
split across them, and the numbers match a single-device run.

Run with `python examples/data_parallel.py`. Where there is no accelerator, it asks JAX
for 8 virtual CPU devices.
"""

import jax


# Eight virtual CPU devices where there is no accelerator (set before any array exists).
jax.config.update("jax_num_cpu_devices", 8)

import eqstate as es  # noqa: E402
import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from jaxtyping import Array, Float, Int  # noqa: E402


class MLP(eqx.Module):
    w1: es.ParamState[Float[Array, "n_in n_hidden"]]
    b1: es.ParamState[Float[Array, " n_hidden"]]
    w2: es.ParamState[Float[Array, "n_hidden 1"]]
    steps: es.ShortTermState[Int[Array, ""]]

    def __init__(self, key: Array, n_in: int = 4, n_hidden: int = 32):
        k1, k2 = jr.split(key)
        self.w1 = es.ParamState(jr.normal(k1, (n_in, n_hidden)) / n_in**0.5, name="w1")
        self.b1 = es.ParamState(jnp.zeros(n_hidden), name="b1")
        self.w2 = es.ParamState(jr.normal(k2, (n_hidden, 1)) / n_hidden**0.5, name="w2")
        self.steps = es.ShortTermState(jnp.array(0), name="steps")

    def __call__(self, x: Float[Array, "batch n_in"]) -> Float[Array, " batch"]:
        self.steps.value = self.steps.value + 1
        return (jnp.tanh(x @ self.w1.value + self.b1.value) @ self.w2.value)[:, 0]


def data(n: int = 256) -> tuple[Array, Array]:
    x = jr.normal(jr.key(1), (n, 4))
    return x, jnp.sin(x[:, 0]) + x[:, 1] * x[:, 2]


def train(
    mesh: Mesh | None = None, steps: int = 50
) -> tuple[dict[str | None, Array], list[float], MLP]:
    """Trains from a fixed initialisation; with `mesh`, the batch is split along the
    mesh's `data` axis and the parameters are replicated. Returns the final parameter
    values (by name) and the losses."""
    model = MLP(jr.key(0))
    x, y = data()
    if mesh is not None:
        es.shard(model, mesh, P())  # replicate every state on every device
        batch = NamedSharding(mesh, P("data"))
        x, y = jax.device_put(x, batch), jax.device_put(y, batch)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(es.values_of(model, es.ParamState))

    @es.transform.jit
    def loss_and_grads(x: Array, y: Array) -> tuple[Array, es.StateDict]:
        def loss() -> Array:
            return jnp.mean((model(x) - y) ** 2)

        return es.transform.value_and_grad(loss, grad_states=es.ParamState)()

    losses: list[float] = []
    for _ in range(steps):
        loss, grads = loss_and_grads(x, y)
        params = es.values_of(model, es.ParamState)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        es.assign(optax.apply_updates(params, updates))
        losses.append(float(loss))
    final = {s.name: s.value for s in es.states_of(model, es.ParamState)}
    return final, losses, model


def main() -> None:
    n = jax.device_count()
    single, single_losses, _ = train()
    # Automatic axes: XLA chooses the intermediate shardings (GSPMD).
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    sharded, sharded_losses, model = train(mesh)
    print(f"{n} devices; parameters: {model.w1.value.sharding}")
    print(f"loss: {single_losses[0]:.4f} -> {single_losses[-1]:.4f} on one device")
    print(f"loss: {sharded_losses[0]:.4f} -> {sharded_losses[-1]:.4f} data-parallel")
    gap = max(float(jnp.max(jnp.abs(single[k] - sharded[k]))) for k in single)
    print(f"largest parameter difference: {gap:.2e}")


if __name__ == "__main__":
    main()
