"""An ensemble of 8 mixed Equinox/eqstate MLPs, trained jointly; then member 3 alone.

`vmap_new_states` builds the 8 members in one call: each lane builds an `eqx.nn.Linear`
from its own key and an `eqstate.nn.BatchNorm`, so the ensemble is one `MLP` whose
arrays and states all have a leading axis of size 8. `vmap` over that axis trains the
members side by side, with one optimiser. `es.member(ensemble, 3)` then takes member 3
out as a standalone `MLP`, which runs without any vmap.

Run with `python examples/ensemble_member.py` (add `--quick` for a few steps).
"""

import argparse
from typing import cast

import eqstate as es
import eqstate.nn as enn
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax


N_MEMBERS = 8


class MLP(eqx.Module):
    linear1: eqx.nn.Linear
    bn: enn.BatchNorm
    linear2: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2 = jr.split(key)
        self.linear1 = eqx.nn.Linear(1, 32, key=k1)
        self.bn = enn.BatchNorm(32, momentum=0.9)
        self.linear2 = eqx.nn.Linear(32, 1, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x` of shape `(batch,)` -> `(batch,)`."""
        h = jnp.tanh(self.bn(jax.vmap(self.linear1)(x[:, None])))
        return jax.vmap(self.linear2)(h)[:, 0]


def predict_all(ensemble: MLP, x: jax.Array) -> jax.Array:
    """Every member's predictions, `(N_MEMBERS, batch)`: the arrays of `ensemble`
    are mapped by `in_axes=0`, its states by `in_states`."""

    @es.transform.vmap(in_states={0: es.states_of(ensemble)})
    def lanes(member: MLP) -> jax.Array:
        return member(x)

    return lanes(ensemble)


def loss_fn(ensemble: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    # Each member's loss depends on its own lane only, so the gradient of the sum
    # trains every member as if alone.
    return jnp.sum(jnp.mean((predict_all(ensemble, x) - y) ** 2, axis=1))


optimizer = optax.adam(1e-2)


@es.transform.jit
def train_step(
    ensemble: MLP,
    opt_state: es.LongTermState[optax.OptState],
    x: jax.Array,
    y: jax.Array,
) -> MLP:
    grad_fn = es.transform.grad(loss_fn, argnums=0, grad_states=es.ParamState)
    updates, opt_state.value = optimizer.update(
        grad_fn(ensemble, x, y), opt_state.value, es.trainable(ensemble)
    )
    return es.apply_updates(ensemble, updates)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps only")
    steps = 20 if parser.parse_args().quick else 1000

    keys = jr.split(jr.key(0), N_MEMBERS)
    ensemble = es.transform.vmap_new_states(MLP, axis_size=N_MEMBERS)(keys)
    print("linear1.weight:", ensemble.linear1.weight.shape, "(members first)")
    print("bn.running_mean:", ensemble.bn.running_mean.value.shape)

    opt_state = es.LongTermState(optimizer.init(es.trainable(ensemble)))
    for key in jr.split(jr.key(1), steps):
        x = jr.uniform(key, (64,), minval=-3, maxval=3)
        ensemble = train_step(ensemble, opt_state, x, jnp.sin(x))

    x = jnp.linspace(-3, 3, 50)
    # BatchNorm: the running statistics. (Equinox returns an untyped PyTree.)
    ensemble = cast(MLP, eqx.nn.inference_mode(ensemble))
    lanes = es.transform.jit(predict_all)(ensemble, x)
    errors = jnp.mean((lanes - jnp.sin(x)) ** 2, axis=1)
    print("test MSE per member:", " ".join(f"{e:.4f}" for e in errors))

    third = es.member(ensemble, 3)  # a standalone MLP, with fresh states
    assert third.linear1.weight.shape == (32, 1)
    # Its parameters and statistics are bit for bit those of lane 3.
    mine = jax.tree.leaves((eqx.filter(third, eqx.is_array), es.values_of(third)))
    lane = jax.tree.leaves((eqx.filter(ensemble, eqx.is_array), es.values_of(ensemble)))
    assert all((a == b[3]).all() for a, b in zip(mine, lane, strict=True))
    # Its output is computed by another XLA program than the batched one, which may
    # add in another order: on CPU they differ in the last bits (~2e-7 here).
    alone = es.transform.jit(MLP.__call__)(third, x)
    gap = float(jnp.max(jnp.abs(alone - lanes[3])))
    print(f"member 3 alone vs its lane: max difference {gap:.1e}")
    assert jnp.allclose(alone, lanes[3], rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    main()
