"""Data-parallel training across processes, with sharded checkpoints to resume from.

Every process runs this same program (JAX's multi-controller model). The model, an
MLP with a BatchNorm, is replicated on every device of every process; each global
batch is split across all of them, so the BatchNorm statistics and the gradients are
those of the whole batch. Every `--checkpoint-every` steps the program saves the
parameters, the BatchNorm's running statistics, the optimiser state and the step
with `eqstate.CheckpointManager` (Orbax: every process writes its own shards, in the
background while training goes on). Started again with the same `--checkpoint-dir`,
it resumes from the latest checkpoint and ends exactly where an uninterrupted run
ends.

On this machine, two processes with two CPU devices each:

    python -m eqstate.launch -n 2 --cpu-devices 2 examples/multi_process_train.py \\
        --checkpoint-dir /tmp/run --quick

On a SLURM cluster, the same program, nothing else (`jax.distributed.initialize()`
reads the task's rank and the coordinator from SLURM's environment):

    srun --ntasks=8 python examples/multi_process_train.py --checkpoint-dir /shared/run

With `--single-process` it trains on the devices of one process, without
`jax.distributed`: the same global batches, so the same numbers.
"""

import argparse
import sys
from typing import cast

import eqstate as es
import eqstate.nn as enn
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Float, Int


N_IN, N_HIDDEN = 4, 32


class Model(eqx.Module):
    w1: es.ParamState[Float[jax.Array, "n_in n_hidden"]]
    bn: enn.BatchNorm
    w2: es.ParamState[Float[jax.Array, "n_hidden 1"]]

    def __init__(self, key: jax.Array):
        k1, k2 = jr.split(key)
        self.w1 = es.ParamState(jr.normal(k1, (N_IN, N_HIDDEN)) / N_IN**0.5)
        self.bn = enn.BatchNorm(N_HIDDEN, momentum=0.9)
        self.w2 = es.ParamState(jr.normal(k2, (N_HIDDEN, 1)) / N_HIDDEN**0.5)

    def __call__(self, x: Float[jax.Array, "batch n_in"]) -> Float[jax.Array, " batch"]:
        h = jnp.tanh(self.bn(x @ self.w1.value))
        return (h @ self.w2.value)[:, 0]


class Training(eqx.Module):
    """Everything a checkpoint holds: the model, the optimiser state and the step."""

    model: Model
    opt_state: es.LongTermState[optax.OptState]
    step: es.ShortTermState[Int[jax.Array, ""]]


def batch(step: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of a step, the same in every process (each uses its rows)."""
    rng = np.random.default_rng([0, step])
    x = rng.normal(size=(size, N_IN)).astype(np.float32)
    return x, np.sin(x[:, 0]) + x[:, 1] * x[:, 2]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--single-process", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.checkpoint_every = 160, 40

    if not args.single_process:
        jax.distributed.initialize()  # before any array exists
    leader = jax.process_index() == 0

    def say(message: str, flush: bool = False) -> None:
        if leader:
            print(message, flush=flush)

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    data = NamedSharding(mesh, P("data"))
    say(f"{jax.process_count()} processes, {jax.device_count()} devices")

    # --8<-- [start:program]
    optimizer = optax.adam(3e-3)
    model = Model(jr.key(0))
    training = Training(
        model,
        es.LongTermState(optimizer.init(es.values_of(model, es.ParamState))),
        es.ShortTermState(jnp.array(0)),
    )
    es.shard(training, mesh, P())  # everything replicated on every device

    @es.transform.jit
    def train_step(x: jax.Array, y: jax.Array) -> jax.Array:
        def loss() -> jax.Array:
            return jnp.mean((model(x) - y) ** 2)

        params = es.values_of(model, es.ParamState)
        value, grads = es.transform.value_and_grad(loss, grad_states=params)()
        updates, training.opt_state.value = optimizer.update(
            grads, training.opt_state.value, params
        )
        es.assign(optax.apply_updates(params, updates))
        training.step.value = training.step.value + 1
        return value

    @es.transform.jit
    def evaluate(x: jax.Array, y: jax.Array) -> jax.Array:
        # Inference mode: the BatchNorm normalises with its running statistics.
        # (Equinox returns an untyped PyTree.)
        inference = cast(Model, eqx.nn.inference_mode(model))
        return jnp.mean((inference(x) - y) ** 2)

    def global_array(host: np.ndarray) -> jax.Array:
        # Each process fills only the rows of its own devices.
        return jax.make_array_from_callback(host.shape, data, lambda i: host[i])

    with es.CheckpointManager(args.checkpoint_dir, max_to_keep=2) as manager:
        if manager.latest_step() is not None:
            training = manager.load(training)  # writes the states
            say(f"resumed from checkpoint {manager.latest_step()}", flush=True)
        step = int(training.step.value)
        pending = None
        while step < args.steps:
            x, y = batch(step, args.batch_size)
            loss = train_step(global_array(x), global_array(y))
            # JAX 0.10's CPU backend can deadlock across processes when several
            # steps are in flight at once; on CPU, wait for each step to finish.
            if jax.default_backend() == "cpu":
                loss.block_until_ready()
            step += 1
            if pending is not None and not manager.is_saving():
                say(f"checkpoint {pending} saved", flush=True)
                pending = None
            if step % args.checkpoint_every == 0:
                # Returns once the values are copied off the devices (after the
                # previous save, if any, is written); the files are written while
                # the next steps run.
                manager.save(step, training)
                if pending is not None:
                    say(f"checkpoint {pending} saved", flush=True)
                pending = step
            if step % 100 == 0:
                say(f"step {step}: loss {float(loss):.4f}", flush=True)
        manager.wait_until_finished()
        if pending is not None:
            say(f"checkpoint {pending} saved", flush=True)
    # --8<-- [end:program]

    x, y = batch(10**9, 4 * args.batch_size)  # held out: no step uses it
    final = float(evaluate(global_array(x), global_array(y)))
    say(f"final loss {final!r}", flush=True)
    return final


if __name__ == "__main__":
    main(sys.argv[1:])
