"""Model-parallel training: one large ParamState is split across devices (its rows on
different devices), the rest is replicated, and the numbers match a single-device run.
The layer is written twice: with automatic partitioning under `eqstate.transform.jit`,
and by hand with `eqstate.transform.shard_map` and a collective.

Run with `python examples/model_parallel.py`. Where there is no accelerator, it asks JAX
for 8 virtual CPU devices.
"""

from typing import cast

import jax


# Eight virtual CPU devices where there is no accelerator (set before any array exists).
jax.config.update("jax_num_cpu_devices", 8)

import eqstate as es  # noqa: E402
import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh, PartitionSpec as P  # noqa: E402
from jaxtyping import Array, Float  # noqa: E402


class WideLayer(eqx.Module):
    # The large one, split by rows.
    embed: es.ParamState[Float[Array, "vocab features"]]
    out: es.ParamState[Float[Array, " features"]]

    def __init__(self, key: Array, vocab: int = 512, features: int = 16):
        k1, k2 = jr.split(key)
        self.embed = es.ParamState(jr.normal(k1, (vocab, features)) * 0.1, name="embed")
        self.out = es.ParamState(jr.normal(k2, (features,)) * 0.1, name="out")

    def __call__(self, counts: Float[Array, "batch vocab"]) -> Float[Array, " batch"]:
        # `counts` (batch, vocab): a bag of words; the product sums over the vocabulary.
        return jnp.tanh(counts @ self.embed.value) @ self.out.value


def data(n: int = 64, vocab: int = 512) -> tuple[Array, Array]:
    counts = jr.poisson(jr.key(1), 0.05, (n, vocab)).astype(jnp.float32)
    return counts, jnp.sin(counts[:, :8].sum(1))


def train(
    mesh: Mesh | None = None, steps: int = 30, manual: bool = False
) -> tuple[dict[str | None, Array], list[float], WideLayer]:
    """Trains from a fixed initialisation. With `mesh`, `embed` is split along the
    mesh's `model` axis; with `manual`, the forward pass is a `shard_map` in which each
    device multiplies its slice of the vocabulary and a `psum` adds the parts."""
    model = WideLayer(jr.key(0))
    counts, y = data()
    if mesh is not None:
        es.shard(model, mesh, {model.embed: P("model")})
    optimizer = optax.sgd(0.5)
    opt_state = optimizer.init(es.values_of(model, es.ParamState))

    def forward(counts: Array) -> Array:
        if not manual or mesh is None:
            return model(counts)

        @es.transform.shard_map(
            mesh=mesh,
            in_specs=(P(None, "model"),),
            out_specs=P(),
            state_specs={model.embed: P("model")},
        )
        def hidden(counts: Array) -> Array:
            # (JAX's `psum` returns an untyped PyTree.)
            return cast(Array, jax.lax.psum(counts @ model.embed.value, "model"))

        return jnp.tanh(hidden(counts)) @ model.out.value

    @es.transform.jit
    def loss_and_grads(counts: Array, y: Array) -> tuple[Array, es.StateDict]:
        def loss() -> Array:
            return jnp.mean((forward(counts) - y) ** 2)

        return es.transform.value_and_grad(loss, grad_states=es.ParamState)()

    losses: list[float] = []
    for _ in range(steps):
        loss, grads = loss_and_grads(counts, y)
        params = es.values_of(model, es.ParamState)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        es.assign(optax.apply_updates(params, updates))
        losses.append(float(loss))
    return {s.name: s.value for s in es.states_of(model)}, losses, model


def main() -> None:
    n = jax.device_count()
    # Automatic axes: XLA chooses the intermediate shardings (GSPMD).
    mesh = jax.make_mesh((n,), ("model",), axis_types=(AxisType.Auto,))
    single, single_losses, _ = train()
    auto, auto_losses, model = train(mesh)
    manual, manual_losses, _ = train(mesh, manual=True)
    print(f"{n} devices; embed: {model.embed.value.sharding}")
    for name, losses in [
        ("one device", single_losses),
        ("auto", auto_losses),
        ("shard_map", manual_losses),
    ]:
        print(f"loss ({name}): {losses[0]:.4f} -> {losses[-1]:.4f}")
    for name, params in [("auto", auto), ("shard_map", manual)]:
        gap = max(float(jnp.max(jnp.abs(single[k] - params[k]))) for k in single)
        print(f"largest parameter difference ({name}): {gap:.2e}")


if __name__ == "__main__":
    main()
