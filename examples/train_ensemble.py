"""Train an ensemble of 16 recurrent forecasters at once, with eqstate.

Each member is a small GRU that reads noisy time series one value at a time and
predicts the next value. Its weights are `ParamState`s and its hidden state is a
`ShortTermState`, so a member is a plain `eqx.Module` that takes no state argument:
calling it reads and writes its states. The program shows how to

1. build all 16 members in one call with `vmap_new_states`, each with its own random
   initialisation (every state gets a leading axis of size 16);
2. train them together: `vmap(..., in_states={0: ensemble_states})` runs the members
   side by side, `for_loop` runs a member along its series, and `value_and_grad`
   differentiates with respect to the `ParamState`s. The whole training loop is one
   compiled `scan`, which prints a progress bar as it runs;
3. compare each member with the ensemble (the mean of their predictions) on
   held-out series, save a checkpoint, load it into a freshly built ensemble, and
   plot the predictions.

Run it from the repository root with `python examples/train_ensemble.py` (about a
minute on two CPU cores), or add `--quick` for a smaller run. It writes
`ensemble.eqstate` and `ensemble_predictions.png` to `outputs/` (or `--out DIR`).
"""

import argparse
import pathlib
import time
from collections.abc import Callable
from typing import Any

import eqstate as es
import eqstate.nn as enn
import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from jaxtyping import Float


matplotlib.use("Agg")  # draw to files: no display needed
import matplotlib.pyplot as plt


N_MEMBERS = 16
HIDDEN_SIZE = 32
# The number of series a member reads at once. It fixes the shape of the hidden state,
# `(BATCH_SIZE, HIDDEN_SIZE)`, so training and evaluation both use batches this size.
BATCH_SIZE = 32
# The standard deviation of the noise in the series. No model can predict the noise,
# so its variance is the lowest loss a forecaster can reach.
NOISE = 0.1


# --------------------------------------------------------------------------------------
# The data: sums of two sines with random frequencies, phases and amplitudes, and noise.
# --------------------------------------------------------------------------------------


def make_series(rng: np.random.Generator, n_series: int, length: int) -> np.ndarray:
    """`n_series` noisy series of `length` values, as an array of shape
    `(length, n_series)`: time comes first, as loops run along the first axis."""
    freq = rng.uniform(0.02, 0.12, (2, n_series))  # in cycles per time step
    phase = rng.uniform(0, 2 * np.pi, (2, n_series))
    amplitude = rng.uniform(0.3, 1.0, (2, n_series))
    t = np.arange(length)[:, None, None]
    clean: np.ndarray = np.sum(amplitude * np.sin(2 * np.pi * freq * t + phase), axis=1)
    noisy = clean + NOISE * rng.standard_normal(clean.shape)
    return noisy.astype(np.float32)


def mse(predictions: Any, series: Any) -> Any:
    """The next-step loss: the predictions made at times `0 .. T-2` against the values
    at times `1 .. T-1`, averaged over time and series (the last two axes). Written
    with array methods, so that it takes JAX and NumPy arrays alike."""
    return ((predictions[..., :-1, :] - series[1:]) ** 2).mean(axis=(-2, -1))


# --------------------------------------------------------------------------------------
# The model: one member of the ensemble.
# --------------------------------------------------------------------------------------


class Forecaster(eqx.Module):
    """A GRU cell and a linear read-out. A call reads one value of each of
    `BATCH_SIZE` series and predicts their next values."""

    cell: enn.GRUCell
    weight: es.ParamState[Float[jax.Array, " hidden"]]
    bias: es.ParamState[Float[jax.Array, ""]]

    def __init__(self):
        # The cell keeps its hidden state, of shape (BATCH_SIZE, HIDDEN_SIZE), in a
        # `ShortTermState`. All weights are drawn from eqstate's default random
        # state, which `vmap_new_states` splits so that every member starts apart.
        self.cell = enn.GRUCell(1, HIDDEN_SIZE, batch_size=BATCH_SIZE)
        self.weight = es.ParamState(
            es.random.normal((HIDDEN_SIZE,)) / HIDDEN_SIZE**0.5, name="weight"
        )
        self.bias = es.ParamState(jnp.zeros(()), name="bias")

    def __call__(self, x: jax.Array) -> jax.Array:
        """One time step: `x` of shape `(BATCH_SIZE,)` -> the predicted next values."""
        h = self.cell(x[:, None])  # reads and writes `self.cell.hidden`
        return h @ self.weight.value + self.bias.value

    def predict(self, series: jax.Array) -> jax.Array:
        """Next-step predictions along `series`, both of shape `(time, BATCH_SIZE)`:
        the prediction made at time `t` has seen the values up to time `t`."""
        self.cell.reset()  # each batch of series starts from a zero hidden state
        return es.transform.for_loop(self, series)  # calls `self` at each time step


# --------------------------------------------------------------------------------------
# The ensemble: every state holds the values of all members, stacked on a first axis.
# --------------------------------------------------------------------------------------

# Each call builds a new ensemble, with new handles and new random weights. The
# constructor runs once per call, traced under a vmap of size N_MEMBERS. Compiling it
# is optional; it makes building faster, as JAX then compiles one program (once)
# rather than each random draw separately.
build_ensemble = es.transform.jit(
    es.transform.vmap_new_states(Forecaster, axis_size=N_MEMBERS)
)


def predict_all(ensemble: Forecaster, series: jax.Array) -> jax.Array:
    """Every member's predictions, of shape `(members, time, BATCH_SIZE)`.

    `vmap` maps the ensemble's states along their first axis, so that each member
    sees its own weights and hidden state; `series` is shared (`in_axes=None`).
    """
    states = es.states_of(ensemble)
    per_member = es.transform.vmap(
        ensemble.predict, in_axes=None, in_states={0: states}
    )
    return per_member(series)


# --------------------------------------------------------------------------------------
# Training: the whole loop is one compiled program.
# --------------------------------------------------------------------------------------


def make_train(
    ensemble: Forecaster, optimizer: optax.GradientTransformation
) -> Callable[[optax.OptState, jax.Array], tuple[optax.OptState, jax.Array]]:
    """Returns `train(opt_state, batches) -> (opt_state, losses)`, which takes one
    optimiser step per batch of `batches`, an array of shape
    `(steps, time, BATCH_SIZE)`. `losses[i]` holds every member's loss on batch `i`."""

    def loss_fn(series: jax.Array) -> tuple[jax.Array, jax.Array]:
        losses = mse(predict_all(ensemble, series), series)
        # Each member's loss depends only on its own parameters, so the gradient of
        # the sum trains every member as if it were trained alone.
        return jnp.sum(losses), losses

    loss_and_grads = es.transform.value_and_grad(
        loss_fn, grad_states=es.ParamState, has_aux=True
    )

    def step(
        opt_state: optax.OptState, series: jax.Array
    ) -> tuple[optax.OptState, jax.Array]:
        (_, losses), grads = loss_and_grads(series)
        # `grads` and `params` are StateDicts, from states to values, which optax
        # takes as they are.
        params = es.values_of(ensemble, es.ParamState)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        es.assign(optax.apply_updates(params, updates))
        return opt_state, losses

    pbar = es.transform.ProgressBar(desc="training")

    @es.transform.jit
    def train(
        opt_state: optax.OptState, batches: jax.Array
    ) -> tuple[optax.OptState, jax.Array]:
        # The states `step` reads and writes are carried through the loop for us.
        return es.transform.scan(step, opt_state, batches, pbar=pbar)

    return train


# --------------------------------------------------------------------------------------
# Reporting and plotting.
# --------------------------------------------------------------------------------------


def report(member_losses: np.ndarray, ensemble_loss: float) -> None:
    """Prints the held-out loss of each member and of the ensemble."""
    print(f"\nHeld-out next-step MSE (the noise alone gives {NOISE**2:.4f}):")
    for i, loss in enumerate(member_losses):
        print(f"  member {i:2d}        {loss:.4f}")
    print(f"  average member   {member_losses.mean():.4f}")
    print(f"  best member      {member_losses.min():.4f}")
    print(f"  ensemble (mean)  {ensemble_loss:.4f}")


def plot(path: pathlib.Path, series: np.ndarray, predictions: np.ndarray) -> None:
    """Plots the ensemble's next-step predictions (the mean over the members, +- 2
    standard deviations) against the truth, for four held-out series."""
    t = np.arange(1, int(series.shape[0]))  # the times being predicted
    mean = predictions.mean(axis=0)[:-1]
    spread = 2 * predictions.std(axis=0)[:-1]
    fig, axes = plt.subplots(4, 1, figsize=(9, 8), sharex=True)
    for j, ax in enumerate(axes):
        ax.plot(t, series[1:, j], "k.", markersize=4, label="truth")
        ax.plot(t, mean[:, j], color="C0", label="ensemble mean")
        ax.fill_between(
            t,
            mean[:, j] - spread[:, j],
            mean[:, j] + spread[:, j],
            color="C0",
            alpha=0.3,
            label="± 2 std over members",
        )
    axes[0].set_title("Next-step predictions on held-out series", loc="left")
    axes[0].legend(loc="lower right", bbox_to_anchor=(1, 1), ncols=3, frameon=False)
    axes[-1].set_xlabel("time step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a small run, as a smoke test"
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("outputs"),
        help="the directory for the checkpoint and the plot (default: outputs)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the random seed")
    args = parser.parse_args()
    if args.quick:
        length, n_train, n_steps = 30, 512, 60
    else:
        length, n_train, n_steps = 50, 2048, 500
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    # The data: training series, and one batch of held-out series.
    rng = np.random.default_rng(args.seed)
    train_series = make_series(rng, n_train, length)
    test_series = make_series(rng, BATCH_SIZE, length)

    # 1. Build the ensemble.
    es.random.seed(args.seed)
    ensemble = build_ensemble()
    print(f"Built {N_MEMBERS} GRU forecasters in one call. The ensemble's states:")
    for path, state in es.states_of(ensemble, with_paths=True):
        print(f"  {jax.tree_util.keystr(path):<18} {state}")

    # 2. Train every member at once, on random batches of the training series.
    optimizer = optax.adam(optax.cosine_decay_schedule(1e-2, n_steps))
    opt_state = optimizer.init(es.values_of(ensemble, es.ParamState))
    train = make_train(ensemble, optimizer)
    rows = rng.integers(0, n_train, (n_steps, BATCH_SIZE))
    batches = jnp.asarray(
        train_series[:, rows].transpose(1, 0, 2)
    )  # (steps, time, BATCH_SIZE)
    print(
        f"\nTraining for {n_steps} steps, on batches of {BATCH_SIZE} out of "
        f"{n_train} series of length {length}:"
    )
    opt_state, losses = train(opt_state, batches)
    losses = np.asarray(losses)  # waits for the loop to finish...
    jax.effects_barrier()  # ...and for its progress bar to be printed
    for i in [*range(0, n_steps, n_steps // 5), n_steps - 1]:
        print(f"  step {i + 1:4d}: average member loss {losses[i].mean():.4f}")

    # 3. Evaluate on the held-out series. (Transforms find the states a function uses
    # by tracing it, so it may close over the model, as here, or take it as an
    # argument.)
    @es.transform.jit
    def predict(series: np.ndarray) -> jax.Array:
        return predict_all(ensemble, jnp.asarray(series))

    predictions = np.asarray(predict(test_series))
    report(mse(predictions, test_series), mse(predictions.mean(axis=0), test_series))

    # 4. Save every state (weights and hidden states), each under its path in the
    # model, such as `cell.weight_hh`.
    checkpoint = args.out / "ensemble.eqstate"
    es.save(checkpoint, ensemble)
    print(f"\nSaved {checkpoint}.")
    # A freshly built ensemble has new handles and new random weights...
    restored = build_ensemble()
    gap = np.abs(restored.cell.weight_hh.value - ensemble.cell.weight_hh.value).max()
    print(f"A freshly built ensemble has other weights (differing by up to {gap:.2f}).")
    # ...until the checkpoint, matched to its states by path, is loaded into it.
    restored = es.load(checkpoint, restored)

    @es.transform.jit
    def predict_restored(series: np.ndarray) -> jax.Array:
        return predict_all(restored, jnp.asarray(series))

    same = np.array_equal(predict_restored(test_series), predictions)
    print(
        f"Once the checkpoint is loaded into it, its predictions are identical: {same}."
    )

    # 5. Plot the ensemble's predictions.
    figure = args.out / "ensemble_predictions.png"
    plot(figure, test_series, predictions)
    print(f"Wrote {figure}. Done in {time.perf_counter() - start:.0f} s.")


if __name__ == "__main__":
    main()
