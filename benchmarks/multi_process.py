"""Multi-process figures: step time of `eqstate.transform.jit` against the same step
in plain JAX (one run, two processes), checkpoint save and restore times of a ~100 MB
sharded model for both backends, and how many training steps run during an async
save.

    python -m benchmarks.multi_process [--quick]

It launches two processes with two CPU devices each (`eqstate.launch`); the
single-file backend, which cannot save from several processes, is timed in one
process with four devices.
"""

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time


_RESULT = "RESULT "


def _model_values(megabytes: float):
    import jax

    # Eight float32 matrices of 1024 columns, `rows` rows each, of random values
    # (constant ones would compress to nothing in Orbax's files).
    rows = max(8, int(megabytes * 2**20 / 4 / 1024 / 8) // 8 * 8)
    keys = jax.random.split(jax.random.key(0), 8)
    return {f"layer{i}": jax.random.normal(k, (rows, 1024)) for i, k in enumerate(keys)}


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _step_times(mesh, steps: int) -> dict:
    """Median step time of one data-parallel MLP step, eqstate and plain JAX."""
    import eqstate as es
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    replicated = NamedSharding(mesh, P())
    data = NamedSharding(mesh, P("d"))
    key = jax.random.key(0)
    w1 = jax.device_put(jax.random.normal(key, (64, 256)) / 8, replicated)
    w2 = jax.device_put(jnp.zeros((256, 1)), replicated)
    x_host = np.random.default_rng(0).normal(size=(256, 64)).astype(np.float32)
    x = jax.make_array_from_callback(x_host.shape, data, lambda i: x_host[i])

    def loss(w1, w2, x):
        return jnp.mean((jnp.tanh(x @ w1) @ w2 - 1.0) ** 2)

    @jax.jit
    def plain_step(w1, w2, x):
        value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2, x)
        return w1 - 0.01 * g1, w2 - 0.01 * g2, value

    s1, s2 = es.ParamState(w1, name="w1"), es.ParamState(w2, name="w2")

    @es.transform.jit
    def eqstate_step(x):
        value, grads = es.transform.value_and_grad(
            lambda: loss(s1.value, s2.value, x), grad_states=[s1, s2]
        )()
        s1.value = s1.value - 0.01 * grads[s1]
        s2.value = s2.value - 0.01 * grads[s2]
        return value

    plain = [w1, w2]

    def run_plain():
        plain[0], plain[1], value = plain_step(plain[0], plain[1], x)
        value.block_until_ready()  # one step in flight (JAX 0.10 CPU collectives)

    def run_eqstate():
        eqstate_step(x).block_until_ready()

    times: dict[str, list[float]] = {"plain": [], "eqstate": []}
    for fn in (run_plain, run_eqstate):
        fn()  # compile
    # Interleaved, so that both see the same machine load.
    for _ in range(steps):
        for name, fn in (("plain", run_plain), ("eqstate", run_eqstate)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    plain_ms = 1e3 * float(np.median(times["plain"]))
    eqstate_ms = 1e3 * float(np.median(times["eqstate"]))
    return {
        "plain_ms": plain_ms,
        "eqstate_ms": eqstate_ms,
        "ratio": eqstate_ms / plain_ms,
    }


def _checkpoint_times(mesh, directory: str, megabytes: float, backends) -> dict:
    import eqstate as es
    import jax
    from jax.sharding import PartitionSpec as P

    values = _model_values(megabytes)
    model = {name: es.ParamState(v, name=name) for name, v in values.items()}
    es.shard(model, mesh, P("d"))
    size = sum(v.nbytes for v in values.values()) / 2**20
    out: dict = {"megabytes": size}
    for backend in backends:
        path = os.path.join(directory, f"model-{backend}")

        def save(path=path, backend=backend):
            es.save(path, model, backend=backend)

        def load(path=path, backend=backend):
            es.load(path, model, backend=backend)
            jax.block_until_ready(es.values_of(model))

        save()  # warm up: compiles, imports
        out[backend] = {"save_s": _time(save, 3), "load_s": _time(load, 3)}
    return out


def _async_overlap(mesh, directory: str, megabytes: float, steps: int) -> dict:
    """Training steps run while the manager writes a ~`megabytes` checkpoint."""
    import eqstate as es
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    values = _model_values(megabytes)
    model = {name: es.ParamState(v, name=name) for name, v in values.items()}
    es.shard(model, mesh, P("d"))
    first = model["layer0"]

    @es.transform.jit
    def train_step():
        first.value = first.value + 1.0
        return jnp.sum(first.value[0])

    train_step().block_until_ready()
    with es.CheckpointManager(os.path.join(directory, "run")) as manager:
        manager.save(0, model)  # warm up
        manager.wait_until_finished()
        start = time.perf_counter()
        manager.save(1, model)
        blocking = time.perf_counter() - start
        # Every process runs the same steps (they have collectives) and counts
        # those that ended while its save was still being written.
        during, total = 0, None
        for _ in range(steps):
            train_step().block_until_ready()
            if manager.is_saving():
                during += 1
            elif total is None:
                total = time.perf_counter() - start
        manager.wait_until_finished()
        total = total or time.perf_counter() - start
    return {
        "save_call_s": blocking,
        "save_total_s": total,
        "steps_run": steps,
        "steps_during_save": during,
    }


def _worker(directory: str, megabytes: float, steps: int) -> None:
    import eqstate as es  # noqa: F401  # imported before initialize, as programs do
    import jax

    jax.distributed.initialize()
    mesh = jax.make_mesh(
        (jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    report = {"process": jax.process_index()}
    report["step"] = _step_times(mesh, steps)
    report["checkpoint"] = _checkpoint_times(mesh, directory, megabytes, ["orbax"])
    report["async"] = _async_overlap(mesh, directory, megabytes, 5 * steps)
    print(_RESULT + json.dumps(report), flush=True)


def _single_process(directory: str, megabytes: float) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    os.makedirs(directory, exist_ok=True)
    return _checkpoint_times(mesh, directory, megabytes, ["single-file", "orbax"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", nargs=3, metavar=("DIR", "MB", "STEPS"))
    args = parser.parse_args(argv)
    if args.worker:
        directory, megabytes, steps = args.worker
        _worker(directory, float(megabytes), int(steps))
        return
    megabytes, steps = (8.0, 20) if args.quick else (100.0, 200)
    from eqstate._launch import local_processes, wait_all

    directory = tempfile.mkdtemp()
    try:
        out = io.StringIO()
        command = [sys.executable, "-m", "benchmarks.multi_process", "--worker"]
        with local_processes(
            [*command, directory, str(megabytes), str(steps)], 2, cpu_devices=2, out=out
        ) as procs:
            code = wait_all(procs, 900.0)
        if code != 0:
            raise SystemExit(out.getvalue())
        reports = [
            json.loads(line.split(_RESULT, 1)[1])
            for line in out.getvalue().splitlines()
            if _RESULT in line
        ]
        single = _single_process(os.path.join(directory, "single"), megabytes)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps({"two_processes": reports, "one_process": single}, indent=1))


if __name__ == "__main__":
    main()
