"""eqstate in a real multi-process JAX program: two processes on 127.0.0.1, two CPU
devices each, joined by `jax.distributed` into one mesh of four devices.

Launching processes costs seconds, so one launch runs every check (this file, run as
a script, is the worker) and reports JSON; the tests below each assert one behaviour
of that report. The launch is shared by the pytest-xdist workers through a lock file,
and every process is killed and reaped when it ends, fails or times out.
"""

import contextlib
import fcntl
import json
import os
import pathlib
import sys

import numpy as np
import pytest


_TIMEOUT = 240.0  # seconds for one launch, start to end; it takes about 15
_NUM_PROCESSES = 2
_RESULT = "RESULT "


# The worker: run with `python tests/test_multi_process.py WORKDIR [--orbax]` under the
# launcher. --------------------------------------------------------------------------


def _worker(workdir: str, use_orbax: bool) -> None:
    # eqstate is imported before `jax.distributed.initialize()`, as in any program
    # with its imports at the top: importing it must not start JAX's backend.
    import hashlib

    import eqstate as es
    import jax

    jax.distributed.initialize()

    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    report: dict = {"process": jax.process_index()}
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))

    def gather(x):
        if x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x).tolist()
        return np.asarray(multihost_utils.process_allgather(x, tiled=True)).tolist()

    def check(name):
        def record(fn):
            try:
                report[name] = fn()
            except Exception as e:  # reported, and the test names it
                report[name] = {"error": f"{type(e).__name__}: {e}"}

        return record

    report["devices"] = [jax.process_count(), jax.device_count()]

    @check("jit")
    def _():
        w = es.ParamState(jnp.arange(8.0), name="w")
        es.shard([w], mesh, P("d"))
        traces = []

        @es.transform.jit
        def step(x):
            traces.append(None)
            w.value = w.value * 2 + x
            return w.value.sum()

        for _ in range(5):
            # One step in flight at a time: JAX 0.10's CPU backend can deadlock
            # across processes with several (plain JAX too).
            total = step(1.0).block_until_ready()
        return {
            "w": gather(w.value),
            "total": float(total),
            "spec": str(tuple(w.value.sharding.spec)),
            "addressable": w.value.is_fully_addressable,
            "traces": len(traces),
            "planned": step.planned,
        }

    @check("grad")
    def _():
        w = es.ParamState(jnp.arange(8.0), name="w")
        es.shard([w], mesh, P("d"))
        loss = lambda: jnp.sum(w.value**2)  # noqa: E731
        jitted = es.transform.jit(es.transform.value_and_grad(loss, grad_states=[w]))
        value, grads = jitted()
        eager_value, eager_grads = es.transform.value_and_grad(loss, grad_states=[w])()
        return {
            "value": float(value),
            "grad": gather(grads[w]),
            "eager_grad": gather(eager_grads[w]),
            "eager_value": float(eager_value),
            "spec": str(tuple(grads[w].sharding.spec)),
        }

    @check("loops")
    def _():
        w = es.ParamState(jnp.arange(8.0), name="w")
        es.shard([w], mesh, P("d"))

        def body(carry, x):
            w.value = w.value + x
            return carry + w.value.sum(), x

        final, _ = es.transform.jit(lambda: es.transform.scan(body, 0.0, jnp.ones(3)))()
        es.transform.for_loop(lambda i: body(0.0, i), jnp.arange(3.0))
        return {"carry": float(final), "w": gather(w.value)}

    @check("ensemble")
    def _():
        @es.transform.jit
        @es.transform.vmap_new_states(axis_size=4)
        def make():
            return es.ParamState(es.random.normal((3,)), name="member")

        es.random.seed(0)
        member = make()
        es.shard([member], mesh, P("d"))  # two members on each process

        @es.transform.jit
        @es.transform.vmap(in_states={0: member}, out_states={0: member})
        def update():
            member.value = member.value * 2
            return member.value.sum()

        sums = update()
        return {
            "members": gather(member.value),
            "sums": gather(sums),
            "spec": str(tuple(member.value.sharding.spec)),
            "addressable": member.value.is_fully_addressable,
        }

    @check("shard_map")
    def _():
        counts = es.State(jnp.zeros(4), name="counts")

        @es.transform.shard_map(
            mesh=mesh,
            in_specs=(P("d"),),
            out_specs=P(),
            state_specs={counts: P("d")},
        )
        def total(x):
            counts.value = counts.value + x.size
            return jax.lax.psum(x.sum(), "d")

        x = jax.make_array_from_callback(
            (8,), NamedSharding(mesh, P("d")), lambda i: np.arange(8.0)[i]
        )
        return {"total": float(total(x)), "counts": gather(counts.value)}

    @check("random")
    def _():
        rng = es.RandomState(0, name="rng")
        w = es.ParamState(jnp.ones(8), name="w")
        es.shard([w], mesh, P("d"))

        @es.transform.jit
        def noisy():
            # A replicated draw, used with a sharded value: both processes must agree.
            noise = jax.random.normal(rng.split_key(), (8,))
            w.value = w.value + noise
            return noise, jnp.sum(w.value)

        noise, total = noisy()
        return {"noise": gather(noise), "total": float(total)}

    @check("shard_map_random")
    def _():
        # The key starts on one device of this process: `shard_map` must place it
        # on the mesh, which spans both processes.
        rng = es.RandomState(0, name="rng")

        @es.transform.shard_map(mesh=mesh, in_specs=(P("d"),), out_specs=P("d"))
        def noisy(x):
            return x + jax.random.normal(rng.split_key(), x.shape)

        x = jax.make_array_from_callback(
            (8,), NamedSharding(mesh, P("d")), lambda i: np.zeros(8)[i]
        )
        return {"noise": gather(noisy(x))}

    @check("same_program")
    def _():
        # Unnamed handles, and a StateDict keyed by one in a state (as an optimiser's
        # state holds one): their text enters the compiled program's argument names.
        # Process 0 has made one handle more than the other (to log, say), so the
        # numbers of the handles below differ between processes.
        if jax.process_index() == 0:
            es.ParamState(jnp.zeros(1))
        w = es.ParamState(jnp.ones(4))
        momentum = es.LongTermState(es.values_of([w]))
        es.shard([w, momentum], mesh, P())

        @es.transform.jit
        def step(x):
            grads = {w: jnp.mean(x) * w.value}  # the mean: a collective
            momentum.value = jax.tree.map(
                lambda m, g: 0.9 * m + g, momentum.value, es.StateDict(grads)
            )
            w.value = w.value - 0.1 * momentum.value[w]
            return jnp.sum(w.value)

        x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
        program = step.lower(x).compile().as_text()
        for _ in range(2):
            total = step(x).block_until_ready()
        return {
            "program": hashlib.sha256(program.encode()).hexdigest(),
            "total": float(total),
        }

    @check("donation_held_by_one_process")
    def _():
        # Process 0 alone keeps a copy of a value (to log it, say): both processes
        # must still run the same program (with JAX 0.12.1, different ones
        # deadlock).
        w = es.ParamState(jnp.ones(4), name="donated")
        es.shard([w], mesh, P())

        @es.transform.jit(donate_states=True)
        def step(x):
            w.value = w.value * 0.5 + jnp.mean(x)  # the mean: a collective
            return jnp.sum(w.value)

        x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
        step(x).block_until_ready()
        kept = None
        if jax.process_index() == 0:  # a copy on the host: no program to run
            kept = np.asarray(w.value.addressable_shards[0].data).tolist()
        total = step(x).block_until_ready()
        return {"total": float(total), "kept": kept}

    @check("printing")
    def _():
        w = es.ParamState(jnp.arange(8.0), name="w")
        es.shard([w], mesh, P("d"))
        return {"state": repr(w), "world": str(es.world().filter(w))}

    @check("single_file_save")
    def _():
        w = es.ParamState(jnp.arange(8.0), name="w")
        es.shard([w], mesh, P("d"))
        path = os.path.join(workdir, f"single-{jax.process_index()}.eqstate")
        try:
            es.save(path, es.values_of(w), backend="single-file")
        except es.CheckpointError as e:
            return {"error": str(e), "written": os.path.exists(path)}
        return {"error": None, "written": os.path.exists(path)}

    if use_orbax:
        _orbax_checks(report, workdir, mesh, gather, check)

    sys.stdout.write(_RESULT + json.dumps(report) + "\n")  # one write: one line
    sys.stdout.flush()
    jax.distributed.shutdown()


def _orbax_checks(report, workdir, mesh, gather, check):
    import eqstate as es
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    model = _checkpoint_model()
    es.shard(model, mesh, {model["w"]: P("d"), model["b"]: P()})

    @check("orbax_restore_from_one_process")
    def _():
        target = _checkpoint_model(zeros=True)
        es.shard(target, mesh, {target["w"]: P("d")})
        where = os.path.join(workdir, "from-one")
        loaded = es.load(where, es.values_of(target), model=target)
        return {
            "values": _plain(loaded, target, gather),
            "w_spec": str(tuple(loaded[target["w"]].sharding.spec)),
        }

    @check("orbax_round_trip")
    def _():
        path = os.path.join(workdir, "from-two")
        es.save(path, model)  # Orbax: two processes
        target = _checkpoint_model(zeros=True)
        es.shard(target, mesh, {target["w"]: P(None)})  # onto another layout
        loaded = es.load(path, es.values_of(target), model=target)
        return {
            "values": _plain(loaded, target, gather),
            "w_spec": str(tuple(loaded[target["w"]].sharding.spec)),
            "saved": _plain(es.values_of(model), model, gather),
        }

    @check("orbax_mismatch")
    def _():
        target = _checkpoint_model(zeros=True)
        target["w"] = es.ParamState(jnp.zeros(6))
        try:
            es.load(os.path.join(workdir, "from-two"), target)
        except es.CheckpointError as e:
            return str(e)
        return None

    @check("orbax_values_that_differ_between_processes")
    def _():
        # A value each process holds apart, seeded by rank: a checkpoint would keep
        # process 0's, and give it to every process.
        import jax

        rank = jax.process_index()
        local = {
            "rng": es.RandomState(100 + rank, name="rng"),
            "step": es.State(jnp.int32(7), name="step"),  # the same everywhere
        }
        path = os.path.join(workdir, "per-process")
        errors = []
        for manager in (False, True):
            try:
                if manager:
                    with es.CheckpointManager(path + "-run") as saver:
                        saver.save(1, es.values_of(local), model=local)
                else:
                    es.save(path, es.values_of(local), model=local)
            except es.CheckpointError as e:
                errors.append(str(e))
        same = {"step": local["step"]}
        es.save(path + "-same", es.values_of(same), model=same)
        return {"errors": errors, "written": os.path.exists(path)}

    @check("orbax_values_a_step_made_differ_between_processes")
    def _():
        # A value seeded by rank, written by a jitted step together with an array
        # across the processes: JAX returns one array across them whose copies
        # differ, which a checkpoint would keep process 0's copy of.
        import jax

        w = es.ParamState(jnp.zeros(8), name="w")
        es.shard([w], mesh, P("d"))
        rng = es.RandomState(200 + jax.process_index(), name="rng")

        @es.transform.jit
        def step():
            w.value = w.value + jax.random.normal(rng.split_key(), (8,))

        step()
        path = os.path.join(workdir, "made-to-differ")
        try:
            es.save(
                path, es.values_of({"w": w, "rng": rng}), model={"w": w, "rng": rng}
            )
        except es.CheckpointError as e:
            return {"error_text": str(e), "written": os.path.exists(path)}
        return {"error_text": None, "written": os.path.exists(path)}

    @check("shard_a_value_that_differs_between_processes")
    def _():
        import jax

        pos = es.State(jnp.array(100 * jax.process_index()), name="pos")
        try:
            es.shard([pos], mesh, P())
        except ValueError as e:
            return str(e)
        return None

    @check("orbax_save_one_process_refuses")
    def _():
        # Process 1 would replace a file: it refuses, and so must process 0, which
        # would otherwise wait for it inside Orbax's save; the next save then runs.
        import jax

        w = es.ParamState(jnp.arange(8.0), name="w")
        es.shard([w], mesh, P("d"))
        rank = jax.process_index()
        path = os.path.join(workdir, f"refused-{rank}")
        if rank == 1:
            with open(path, "w") as f:
                f.write("not a checkpoint")
        try:
            es.save(path, es.values_of({"w": w}), model={"w": w}, backend="orbax")
            refusal = None
        except es.CheckpointError as e:
            refusal = str(e)
        after = os.path.join(workdir, "after-refusal")
        es.save(after, es.values_of({"w": w}), model={"w": w}, backend="orbax")
        loaded = es.load(after, es.values_of(w))[w]
        return {"refusal": refusal, "loaded": gather(loaded)}

    @check("latest_step_of_process_0")
    def _():
        # What `CheckpointManager.load` loads when the processes list the directory
        # at different moments, while another program saves: process 0's latest.
        # Here one process's listing lacks step 2, as if made before it was saved.
        directory = os.path.join(workdir, "listed-apart")
        n = es.State(jnp.int32(0), name="n")
        with es.CheckpointManager(directory) as manager:
            for step in (1, 2):
                manager.save(step, {n: jnp.int32(step)})
        loaded = []
        for late in (1, 0):
            with es.CheckpointManager(directory) as manager:
                if jax.process_index() == late:
                    manager.steps = lambda: (1,)
                loaded.append(int(manager.load({n: jnp.int32(0)})[n]))
        return loaded

    @check("manager")
    def _():
        directory = os.path.join(workdir, "run")
        w = model["w"]

        @es.transform.jit
        def train_step():
            w.value = w.value + 1.0
            return w.value.sum()

        done, overlapped, saved_at = 0, 0, {}
        with es.CheckpointManager(directory, max_to_keep=2) as manager:
            for step in range(1, 4):
                train_step().block_until_ready()
                done += 1
                manager.save(step, model)
                saved_at[step] = done
                # Training goes on while the save is written in the background.
                # Every process runs the same steps (each has collectives); each
                # counts those that ended before the save did, and `save` itself
                # if it returned first (a step may outlast a save this small).
                overlapped += manager.is_saving()
                for _ in range(20):
                    train_step().block_until_ready()
                    done += 1
                    overlapped += manager.is_saving()
            manager.wait_until_finished()
            steps = list(manager.steps())
        target = _checkpoint_model(zeros=True)
        es.shard(target, mesh, {target["w"]: P("d")})
        with es.CheckpointManager(directory) as resumed:
            latest = resumed.latest_step()
            loaded = resumed.load(es.values_of(target), model=target)
        return {
            "steps": steps,
            "latest": latest,
            "overlapped": overlapped,
            "done": done,
            "saved_at": saved_at[3],
            "loaded_w": gather(loaded[target["w"]]),
            "final_w": gather(w.value),
        }


def _checkpoint_model(zeros: bool = False) -> dict:
    """A model with a sharded float array, a replicated bfloat16 one, a counter, a
    flag and a PRNG key: the same paths and shapes in every process and in pytest."""
    import eqstate as es
    import jax
    import jax.numpy as jnp

    def value(x):
        return jnp.zeros_like(x) if zeros else x

    return {
        "w": es.ParamState(value(jnp.arange(16.0))),
        "b": es.ParamState(value(jnp.linspace(-1, 1, 4).astype(jnp.bfloat16))),
        "steps": es.ShortTermState(value(jnp.array(7))),
        "flags": es.State(value(jnp.array([True, False, True]))),
        "rng": es.RandomState(jax.random.key(0 if zeros else 42)),
    }


def _plain(states, model, gather) -> dict:
    """The values of a checkpoint model as JSON lists (keys as their key data)."""
    import jax

    out = {}
    for name, state in model.items():
        value = states[state]
        if name == "rng":
            value = jax.random.key_data(value)
        out[name] = gather(value.astype("float32") if name == "b" else value)
    return out


if __name__ == "__main__":
    _worker(sys.argv[1], "--orbax" in sys.argv[2:])
    sys.exit(0)


# The tests. ----------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _has_orbax() -> bool:
    try:
        import orbax.checkpoint  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    """The report of each process, from one launch shared by every xdist worker."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    cached = root / "multi_process_report.json"
    with _locked(root / "multi_process_report.lock"):
        if not cached.exists():
            cached.write_text(json.dumps(_run_checks(root / "multi_process")))
    report = json.loads(cached.read_text())
    if "failure" in report:
        pytest.fail(report["failure"])
    return report


def _run_checks(workdir: pathlib.Path) -> dict:
    import eqstate as es
    import jax

    from .helpers import launch, reports

    workdir.mkdir(exist_ok=True)
    args = [str(workdir)]
    if _has_orbax():
        # A checkpoint of one process with eight devices, for the two to restore.
        model = _checkpoint_model()
        mesh = jax.make_mesh((8,), ("d",))
        from jax.sharding import PartitionSpec as P

        es.shard(model, mesh, {model["w"]: P("d")})
        es.save(workdir / "from-one", model, backend="orbax")
        args.append("--orbax")
    code, output = launch([__file__, *args], _NUM_PROCESSES, _TIMEOUT)
    found = reports(output, _RESULT)
    if code != 0 or len(found) != _NUM_PROCESSES:
        return {"failure": f"the launch exited with {code}:\n{output[-6000:]}"}
    found.sort(key=lambda r: r["process"])
    return {"processes": found, "workdir": str(workdir)}


def _both(run, name):
    """The two processes' results for one check, which must not be errors."""
    results = [report[name] for report in run["processes"]]
    for result in results:
        if isinstance(result, dict) and "error" in result and len(result) == 1:
            pytest.fail(f"{name} failed in a process: {result['error']}")
    return results


def test_two_processes_form_one_mesh_of_four_devices(run):
    assert [r["devices"] for r in run["processes"]] == [[2, 4], [2, 4]]


def test_jit_steps_a_state_sharded_across_processes(run):
    expected = np.arange(8.0)
    for _ in range(5):
        expected = expected * 2 + 1
    for result in _both(run, "jit"):
        assert result["w"] == expected.tolist()
        assert result["total"] == expected.sum()
        # Each process holds half of it; the sharding survives the steps.
        assert result["spec"] == "('d',)" and not result["addressable"]
        # Traced once, and the calls after the first take the planned fast path.
        assert result["traces"] == 1 and result["planned"]


def test_grad_of_a_sharded_state_matches_plain_jax(run):
    w = np.arange(8.0)
    for result in _both(run, "grad"):
        assert result["grad"] == (2 * w).tolist() == result["eager_grad"]
        assert result["value"] == (w**2).sum() == result["eager_value"]
        assert result["spec"] == "('d',)"


def test_scan_and_for_loop_write_a_sharded_state(run):
    for result in _both(run, "loops"):
        # scan adds one three times; for_loop adds 0, 1 and 2.
        assert result["w"] == (np.arange(8.0) + 3 + 3).tolist()
        assert result["carry"] == sum((np.arange(8.0) + k).sum() for k in (1, 2, 3))


def test_ensemble_members_sharded_across_processes(run):
    first, second = _both(run, "ensemble")
    assert first == second
    members = np.array(first["members"])
    assert members.shape == (4, 3) and len({tuple(m) for m in members}) == 4
    assert np.allclose(first["sums"], members.sum(axis=1))
    assert first["spec"] == "('d',)" and not first["addressable"]


def test_shard_map_threads_a_state_split_across_processes(run):
    for result in _both(run, "shard_map"):
        assert result["total"] == np.arange(8.0).sum()
        assert result["counts"] == [2.0] * 4


def test_random_draws_agree_across_processes(run):
    import jax

    first, second = _both(run, "random")
    assert first == second
    key = jax.random.split(jax.random.key(0))[1]
    expected = np.asarray(jax.random.normal(key, (8,)))
    assert np.allclose(first["noise"], expected, atol=1e-6)
    assert np.isclose(first["total"], (1 + expected).sum(), atol=1e-5)


def test_a_random_state_read_inside_shard_map_is_replicated_across_processes(run):
    import jax

    first, second = _both(run, "shard_map_random")
    assert first == second
    # Every device draws its two numbers from the same key, as from a replicated
    # key in plain JAX.
    key = jax.random.split(jax.random.key(0))[1]
    expected = np.tile(np.asarray(jax.random.normal(key, (2,))), 4)
    assert np.allclose(first["noise"], expected, atol=1e-6)


def test_every_process_compiles_the_same_program_for_unnamed_handles(run):
    # With JAX 0.12.1, processes whose programs differ, if only in the argument names
    # (a handle printed by its address or number), deadlock in the first collective.
    # One process made a handle more than the other before these.
    results = _both(run, "same_program")
    assert results[0]["program"] == results[1]["program"]
    w = np.ones(4)
    momentum = np.zeros(4) + 1.0  # the value it was made with, w's
    for _ in range(2):
        momentum = 0.9 * momentum + 3.5 * w
        w = w - 0.1 * momentum
    assert [r["total"] for r in results] == pytest.approx([w.sum()] * 2)


def test_a_value_one_process_keeps_does_not_desynchronise_donation(run):
    results = _both(run, "donation_held_by_one_process")
    w = np.ones(4)
    w = w * 0.5 + 3.5
    kept = w.tolist()
    w = w * 0.5 + 3.5
    assert [r["total"] for r in results] == pytest.approx([w.sum()] * 2)
    assert results[0]["kept"] == kept


def test_printing_a_sharded_state_shows_its_summary(run):
    for result in _both(run, "printing"):
        assert result["state"] == "ParamState(name='w', value=f32[8])"
        assert "f32[8]" in result["world"]


def test_single_file_save_of_a_sharded_state_names_it_and_the_fix(run):
    for result in _both(run, "single_file_save"):
        assert "ParamState 'w'" in result["error"]
        assert "process_allgather" in result["error"]
        assert "backend='orbax'" in result["error"]
        assert not result["written"]


def _expected_checkpoint_values() -> dict:
    import jax
    import jax.numpy as jnp

    return {
        "w": np.arange(16.0).tolist(),
        "b": np.asarray(
            jnp.linspace(-1, 1, 4).astype(jnp.bfloat16).astype(jnp.float32)
        ).tolist(),
        "steps": 7,
        "flags": [True, False, True],
        "rng": np.asarray(jax.random.key_data(jax.random.key(42))).tolist(),
    }


def test_orbax_checkpoint_of_one_process_restores_in_two(run):
    for result in _both(run, "orbax_restore_from_one_process"):
        assert result["values"] == _expected_checkpoint_values()
        assert result["w_spec"] == "('d',)"


def test_orbax_checkpoint_of_two_processes_round_trips_onto_another_layout(run):
    for result in _both(run, "orbax_round_trip"):
        assert result["values"] == result["saved"] == _expected_checkpoint_values()
        assert result["w_spec"] == "(None,)"


def test_orbax_checkpoint_of_two_processes_restores_in_one(run):
    import eqstate as es
    import jax
    from jax.sharding import PartitionSpec as P

    path = os.path.join(run["workdir"], "from-two")
    for mesh_size in (8, None):  # onto eight devices, and onto the default device
        target = _checkpoint_model(zeros=True)
        if mesh_size is not None:
            mesh = jax.make_mesh((mesh_size,), ("d",))
            es.shard(target, mesh, {target["w"]: P("d")})
        loaded = es.load(path, es.values_of(target), model=target)
        values = _plain(loaded, target, lambda x: np.asarray(x).tolist())
        assert values == _expected_checkpoint_values()
        if mesh_size is not None:
            assert loaded[target["w"]].sharding.spec == P("d")


def test_orbax_mismatch_gives_eqstates_error_in_every_process(run):
    for message in _both(run, "orbax_mismatch"):
        assert "does not match the model" in message
        assert "`w` holds shape (16,) and dtype float32" in message
        assert "expects shape (6,)" in message


def test_orbax_refuses_a_value_that_differs_between_processes(run):
    for result in _both(run, "orbax_values_that_differ_between_processes"):
        assert len(result["errors"]) == 2 and not result["written"]
        for error in result["errors"]:
            assert "The value at 'rng' differs between processes" in error


def test_orbax_refuses_a_value_whose_copies_a_jitted_step_made_differ(run):
    for result in _both(run, "orbax_values_a_step_made_differ_between_processes"):
        assert not result["written"]
        assert "The value at 'rng' differs between processes" in result["error_text"]
        assert "one array across them, but their copies differ" in result["error_text"]


def test_placing_a_value_that_differs_between_processes_says_so(run):
    for message in _both(run, "shard_a_value_that_differs_between_processes"):
        assert message.startswith("Cannot place State 'pos'")
        assert "must be the same in each" in message
        assert "divisible" not in message


def test_an_orbax_save_that_one_process_refuses_is_refused_by_every_process(run):
    refusals = [r["refusal"] for r in _both(run, "orbax_save_one_process_refuses")]
    assert "refused-1': it is a file, not an Orbax checkpoint" in refusals[1]
    assert "process 1 refused to save there" in refusals[0]
    for result in _both(run, "orbax_save_one_process_refuses"):
        assert result["loaded"] == list(range(8))


def test_every_process_loads_the_step_process_0_sees_as_the_latest(run):
    for result in _both(run, "latest_step_of_process_0"):
        assert result == [2, 1]  # process 1's listing lacks step 2, then process 0's


def test_manager_keeps_the_last_two_and_resumes_from_the_latest(run):
    for result in _both(run, "manager"):
        assert result["steps"] == [2, 3] and result["latest"] == 3
        # Checkpoint 3 holds the values when it was saved, not those after it.
        start = np.arange(16.0)
        assert result["loaded_w"] == (start + result["saved_at"]).tolist()
        assert result["final_w"] == (start + result["done"]).tolist()
    first, second = _both(run, "manager")
    assert first["loaded_w"] == second["loaded_w"]


def test_async_save_overlaps_training_steps(run):
    for result in _both(run, "manager"):
        assert result["overlapped"] > 0  # of 3 saves and 60 steps run during them
