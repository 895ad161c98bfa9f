"""A GRU feeding an LSTM (`eqstate.nn` cells), run over sequences with `scan`.

The cells keep their hidden states in `ShortTermState`s, so a step takes only the
input: `scan` carries the states from step to step. The model is built without a batch
size; `reset(batch_size=...)` gives the hidden states the batch of the next sequences,
and the same model then runs on batches of 8 and of 3 (each batch size compiles once).

Run with `python examples/rnn_scan.py` (`--quick` runs shorter sequences).
"""

import argparse

import eqstate as es
import eqstate.nn as enn
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr


class Encoder(eqx.Module):
    gru: enn.GRUCell
    lstm: enn.LSTMCell

    def __init__(self, key: jax.Array):
        k1, k2 = jr.split(key)
        self.gru = enn.GRUCell(3, 16, key=k1)  # no batch size: one example
        self.lstm = enn.LSTMCell(16, 8, key=k2)

    def reset(self, batch_size: int | None = None) -> None:
        """Zeroes the hidden states, with the batch of the next sequences. A new
        batch size changes the states' shapes: call it outside transforms."""
        self.gru.reset(batch_size=batch_size)
        self.lstm.reset(batch_size=batch_size)

    def __call__(self, xs: jax.Array) -> jax.Array:
        """`xs` of shape `(time, *batch, 3)` -> LSTM outputs `(time, *batch, 8)`."""

        def step(carry: None, x: jax.Array) -> tuple[None, jax.Array]:
            return carry, self.lstm(self.gru(x))  # reads and writes the hidden states

        return es.transform.scan(step, None, xs)[1]


@es.transform.jit
def encode(model: Encoder, xs: jax.Array) -> jax.Array:
    return model(xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short sequences")
    length = 20 if parser.parse_args().quick else 500

    model = Encoder(jr.key(0))
    sequences = jr.normal(jr.key(1), (length, 8, 3))  # (time, batch, features)

    model.reset()  # unbatched: one sequence of shape (time, 3)
    one = encode(model, sequences[:, 5])
    for batch_size in (8, 3):
        model.reset(batch_size=batch_size)
        hs = encode(model, sequences[:, :batch_size])
        print(f"batch of {batch_size}: outputs {hs.shape}")
        assert hs.shape == (length, batch_size, 8)
        assert model.lstm.hidden.value.shape == (batch_size, 8)
        assert (model.lstm.hidden.value == hs[-1]).all()
    # Each example of a batch runs alone: example 5 of the batch of 8 is `one`,
    # computed by another XLA program (so equal up to rounding).
    model.reset(batch_size=8)
    gap = jnp.max(jnp.abs(encode(model, sequences)[:, 5] - one))
    print(f"example 5, batched vs alone: max difference {gap:.1e}")
    assert gap < 1e-5


if __name__ == "__main__":
    main()
