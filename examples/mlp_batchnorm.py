"""An MLP mixing Equinox and eqstate layers, trained with optax, then checkpointed.

The model holds `eqx.nn.Linear` layers (plain arrays) next to an `eqstate.nn.BatchNorm`
(parameter and running-statistics states) and an `eqstate.nn.Dropout` (which draws
from eqstate's default random state). It is passed into `eqstate.transform.jit` as an
argument; one optax optimiser updates its arrays and its `ParamState`s. Then the
model is saved with `eqstate.save` and loaded into a freshly built one, bit for bit.

Run with `python examples/mlp_batchnorm.py` (add `--quick` for a few steps).
"""

import argparse
import os
import tempfile
from typing import cast

import eqstate as es
import eqstate.nn as enn
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax


class MLP(eqx.Module):
    linear1: eqx.nn.Linear
    bn: enn.BatchNorm
    dropout: enn.Dropout
    linear2: eqx.nn.Linear

    def __init__(self, key: jax.Array, width: int = 64):
        k1, k2 = jr.split(key)
        self.linear1 = eqx.nn.Linear(2, width, key=k1)
        self.bn = enn.BatchNorm(width, momentum=0.9)
        self.dropout = enn.Dropout(0.1)
        self.linear2 = eqx.nn.Linear(width, 1, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x` of shape `(batch, 2)` -> `(batch,)`."""
        h = self.dropout(jax.nn.relu(self.bn(jax.vmap(self.linear1)(x))))
        return jax.vmap(self.linear2)(h)[:, 0]


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


optimizer = optax.adam(3e-3)


@es.transform.jit
def train_step(
    model: MLP, opt_state: es.LongTermState[optax.OptState], x: jax.Array, y: jax.Array
) -> tuple[MLP, jax.Array]:
    # Gradients of the model's arrays (argnums=0) and of its ParamStates, in the
    # structure of `es.trainable(model)`; the running statistics are written back.
    grad_fn = es.transform.grad(
        loss_fn, argnums=0, grad_states=es.ParamState, return_value=True
    )
    grads, loss = grad_fn(model, x, y)
    updates, opt_state.value = optimizer.update(
        grads, opt_state.value, es.trainable(model)
    )
    return es.apply_updates(model, updates), loss


def data(key: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """Points in the plane, and a smooth function of them to regress."""
    x = jr.uniform(key, (n, 2), minval=-2, maxval=2)
    return x, jnp.sin(x[:, 0]) * jnp.cos(x[:, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps only")
    steps = 30 if parser.parse_args().quick else 2000

    model = MLP(jr.key(0))
    opt_state = es.LongTermState(optimizer.init(es.trainable(model)))
    x_test, y_test = data(jr.key(1), 256)

    @es.transform.jit
    def evaluate(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
        # (Equinox returns an untyped PyTree.)
        inference = cast(MLP, eqx.nn.inference_mode(model))
        return loss_fn(inference, x, y)

    print(f"test loss before training: {evaluate(model, x_test, y_test):.4f}")
    for step, key in enumerate(jr.split(jr.key(2), steps)):
        model, loss = train_step(model, opt_state, *data(key, 128))
        if step % max(steps // 5, 1) == 0:
            print(f"  step {step:4d}: training loss {loss:.4f}")
    print(f"test loss after training:  {evaluate(model, x_test, y_test):.4f}")

    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "mlp.eqstate")
        es.save(path, model)  # the arrays of its `eqx.nn` layers and its states
        restored = es.load(path, MLP(jr.key(3)))  # other weights, until loaded
    same = jax.tree.leaves((eqx.filter(model, eqx.is_array), es.values_of(model)))
    got = jax.tree.leaves((eqx.filter(restored, eqx.is_array), es.values_of(restored)))
    assert all((a == b).all() and a.dtype == b.dtype for a, b in zip(same, got))
    assert (evaluate(restored, x_test, y_test) == evaluate(model, x_test, y_test)).all()
    print(f"checkpoint round trip: {len(got)} arrays, bit for bit")


if __name__ == "__main__":
    main()
