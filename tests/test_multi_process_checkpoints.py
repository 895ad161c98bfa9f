"""The Orbax backend of `eqstate.save` / `eqstate.load` and `eqstate.CheckpointManager`,
in one process; `test_multi_process.py` runs them across processes."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import eqstate as es
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from eqstate import _checkpoint_manager, _orbax
from hypothesis import given, settings, strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .helpers import launch, reports, tree_bitwise_equal, unchecked_new


_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint32, jnp.bool_)


def _model(getkey, zeros=False):
    def value(dtype):
        x = jax.random.normal(getkey(), (8, 3)) * 100
        x = x > 0 if dtype == jnp.bool_ else x.astype(dtype)
        return jnp.zeros_like(x) if zeros else x

    return {
        "arrays": [es.ParamState(value(dtype)) for dtype in _DTYPES],
        "rng": es.RandomState(0 if zeros else 7),
        "opt": es.State({"mu": value(jnp.float32), "count": jnp.array(3)}),
    }


def test_orbax_round_trips_every_dtype_bit_exactly_onto_the_targets_sharding(
    tmp_path, getkey
):
    model = _model(getkey)
    mesh = jax.make_mesh((len(jax.devices()),), ("d",))
    es.shard(model, mesh, {model["arrays"][0]: P("d")})
    es.save(tmp_path / "ckpt", model, backend="orbax")
    assert (tmp_path / "ckpt").is_dir()

    target = _model(getkey, zeros=True)
    es.shard(target, mesh, {target["arrays"][1]: P("d")})  # another layout
    es.load(tmp_path / "ckpt", target)  # a directory: Orbax, by default
    assert tree_bitwise_equal(
        [s.value for s in es.states_of(target)], [s.value for s in es.states_of(model)]
    )
    assert target["arrays"][0].value.sharding.spec == P()
    assert target["arrays"][1].value.sharding.spec == P("d")


def _split_later(shape, spec, mesh, fill):
    """A dict of states of several dtypes, each of `shape` and placed by `spec`."""
    x = fill(shape)
    model = {
        "f32": es.ParamState(x),
        "bf16": es.ParamState(x.astype(jnp.bfloat16)),
        "i8": es.State(x.astype(jnp.int8)),
        "mask": es.State(x > 3),
    }
    es.shard(model, mesh, spec)
    return model


# On a mesh with Explicit axes (`jax.make_mesh`'s default from JAX 0.10 on), the
# checksum used to reshape each array to one axis, which JAX refuses for an array
# split along a later axis only: save and load raised `ShardingTypeError`.
@pytest.mark.parametrize(
    "shape, spec", [((4, 8), P(None, "d")), ((2, 3, 8), P(None, None, "d"))]
)
@pytest.mark.parametrize("via", ["save", "manager"])
def test_orbax_round_trips_values_split_along_a_later_axis_of_an_explicit_mesh(
    tmp_path, getkey, shape, spec, via
):
    mesh = jax.make_mesh((len(jax.devices()),), ("d",), axis_types=(AxisType.Explicit,))
    model = _split_later(shape, spec, mesh, lambda s: jax.random.normal(getkey(), s))
    target = _split_later(shape, spec, mesh, jnp.zeros)
    if via == "save":
        es.save(tmp_path / "ckpt", model, backend="orbax")
        es.load(tmp_path / "ckpt", target)
    else:
        with es.CheckpointManager(tmp_path / "run") as manager:
            manager.save(1, model)
            manager.load(target)
    assert tree_bitwise_equal(
        [s.value for s in es.states_of(target)], [s.value for s in es.states_of(model)]
    )
    assert all(s.value.sharding.spec == spec for s in es.states_of(target))


# The checksums stored in checkpoints (eqstate's Orbax format version 2): a change
# would refuse every checkpoint saved before it.
_PINNED_CHECKSUMS = [
    3752665816936513480,
    6037356004539565040,
    3625128629409687066,
    5841783868567822132,
]


def test_orbax_checksums_do_not_depend_on_the_placement():
    x = jnp.arange(64.0).reshape(4, 8, 2)
    values = [x, x.astype(jnp.bfloat16), x.astype(jnp.int8), x > 20]
    assert _orbax.checksums(values) == _PINNED_CHECKSUMS
    on_device_3 = [jax.device_put(v, jax.devices()[3]) for v in values]
    assert _orbax.checksums(on_device_3) == _PINNED_CHECKSUMS
    specs = [P("a"), P(None, "b"), P(None, None, "a"), P("a", "b"), P(None, ("a", "b"))]
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(axis_type,) * 2)
        for spec in specs:
            placed = [jax.device_put(v, NamedSharding(mesh, spec)) for v in values]
            assert _orbax.checksums(placed) == _PINNED_CHECKSUMS, (axis_type, spec)


def _meta_file(path) -> "os.PathLike":
    return path / "eqstate" / "metadata"


def _sign_flipped(x: np.ndarray, *at: int) -> np.ndarray:
    flipped = x.copy()
    flipped.view(np.uint32)[list(at)] ^= np.uint32(1 << 31)
    return flipped


def test_orbax_load_refuses_values_that_differ_from_their_entry_by_two_sign_flips(
    tmp_path,
):
    # A checksum that weighs each word by an odd number modulo 2**32 (as eqstate's
    # first one did) would miss this: two top bits flipped add 2**32.
    x = np.arange(1.0, 1001.0, dtype=np.float32)
    flipped = _sign_flipped(x, 3, 700)
    w = es.ParamState(jnp.asarray(x), name="w")
    es.save(tmp_path / "a", es.values_of(w), backend="orbax")
    w.value = jnp.asarray(flipped)
    es.save(tmp_path / "b", es.values_of(w), backend="orbax")
    # b's arrays, described by a's entries: what a damaged disk could leave.
    shutil.copyfile(_meta_file(tmp_path / "a"), _meta_file(tmp_path / "b"))
    with pytest.raises(es.CheckpointError, match=r"corrupted: the values of entry `w`"):
        es.load(tmp_path / "b", es.values_of(w))


@settings(max_examples=50, deadline=None)
@given(
    words=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
    data=st.data(),
)
def test_an_orbax_checksum_changes_with_any_word_and_any_two_sign_bits(words, data):
    x = np.array(words, np.uint32)
    i = data.draw(st.integers(0, len(x) - 1), label="changed word")
    other = data.draw(st.integers(0, 2**32 - 1).filter(lambda v: v != x[i]))
    changed = x.copy()
    changed[i] = other
    assert _orbax.checksums([jnp.asarray(changed)]) != _orbax.checksums(
        [jnp.asarray(x)]
    )
    if len(x) > 1:
        j = data.draw(st.integers(0, len(x) - 1).filter(lambda j: j != i), label="j")
        flipped = _sign_flipped(x, i, j)
        assert _orbax.checksums([jnp.asarray(flipped)]) != _orbax.checksums(
            [jnp.asarray(x)]
        )


def _rename_checksum_key(meta: dict) -> None:
    entry = meta["entries"][0]
    entry["chdcksum"] = entry.pop("checksum")  # one bit: 'e' ^ 0x01 is 'd'


def _flip_weak_type(meta: dict) -> None:
    entry = meta["entries"][0]
    entry["weak_type"] = not entry["weak_type"]


@pytest.mark.parametrize(
    "damage",
    [_rename_checksum_key, _flip_weak_type, lambda meta: meta.pop("entries_crc32")],
    ids=["checksum key", "weak type", "entries crc32"],
)
def test_orbax_load_refuses_damaged_entries(tmp_path, damage):
    w = es.ParamState(jnp.arange(8.0), name="w")
    es.save(tmp_path / "c", es.values_of(w), backend="orbax")
    meta = json.loads(_meta_file(tmp_path / "c").read_text())
    damage(meta)
    _meta_file(tmp_path / "c").write_text(json.dumps(meta))
    with pytest.raises(es.CheckpointError, match=r"corrupted: its `eqstate` item"):
        es.load(tmp_path / "c", es.values_of(w))


def test_an_orbax_checkpoint_of_another_format_version_is_refused(tmp_path):
    w = es.ParamState(jnp.arange(8.0), name="w")
    es.save(tmp_path / "c", es.values_of(w), backend="orbax")
    meta = json.loads(_meta_file(tmp_path / "c").read_text())
    _meta_file(tmp_path / "c").write_text(json.dumps({**meta, "version": 1}))
    with pytest.raises(es.CheckpointError, match=r"version 1, .* reads only version 2"):
        es.load(tmp_path / "c", es.values_of(w))


# Plain Orbax, restoring with no target, says that it reads the shardings from the
# checkpoint: expected here, where only the paths are checked.
@pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")
def test_orbax_checkpoint_keeps_readable_paths_for_plain_orbax(tmp_path, getkey):
    model = _model(getkey)
    es.save(tmp_path / "ckpt", es.values_of(model), model=model, backend="orbax")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(
            tmp_path / "ckpt", args=ocp.args.Composite(state=ocp.args.PyTreeRestore())
        )
    assert set(restored["state"]) == {
        *(f"arrays.{i}" for i in range(len(_DTYPES))),
        "rng",
        "opt.count",
        "opt.mu",
    }
    assert np.array_equal(restored["state"]["opt.count"], 3)


def test_an_orbax_directory_not_written_by_eqstate_is_refused(tmp_path):
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "other", {"w": np.zeros(3)})
    w = es.ParamState(jnp.zeros(3), name="w")
    with pytest.raises(es.CheckpointError, match=r"not one written by `eqstate\.save`"):
        es.load(tmp_path / "other", es.values_of(w))


def test_orbax_backend_without_orbax_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    w = es.ParamState(jnp.zeros(3), name="w")
    with pytest.raises(ImportError, match=r"pip install 'eqstate\[orbax\]'"):
        es.save(tmp_path / "ckpt", es.values_of(w), backend="orbax")
    with pytest.raises(ImportError, match=r"pip install 'eqstate\[orbax\]'"):
        es.CheckpointManager(tmp_path / "run")
    # The single-file format needs nothing more.
    es.save(tmp_path / "w.eqstate", es.values_of(w))
    assert es.load(tmp_path / "w.eqstate", es.values_of(w))[w].shape == (3,)


def test_manager_loads_an_older_step_on_request(tmp_path):
    w = es.ParamState(jnp.zeros(2), name="w")
    with es.CheckpointManager(tmp_path, async_save=False) as manager:
        for step in (10, 20):
            w.value = w.value + step
            manager.save(step, es.values_of(w))
        assert manager.steps() == (10, 20) and manager.latest_step() == 20
        assert (manager.load(es.values_of(w), step=10)[w] == 10).all()
        assert (manager.load(es.values_of(w))[w] == 30).all()
        with pytest.raises(es.CheckpointError, match=r"holds steps \[10, 20\]"):
            manager.load(es.values_of(w), step=15)


def test_manager_steps_are_integers_and_found_again_after_reopening(tmp_path):
    w = es.ParamState(jnp.zeros(2), name="w")
    with es.CheckpointManager(tmp_path, async_save=False) as manager:
        for bad in (jnp.array(1.5), jnp.array(-1)):
            with pytest.raises(es.CheckpointError, match="non-negative integers"):
                manager.save(bad, es.values_of(w))
        manager.save(np.int64(3), es.values_of(w))
        manager.save(jnp.array(4), es.values_of(w))
        with pytest.raises(es.CheckpointError, match="non-negative integers"):
            manager.load(es.values_of(w), step=jnp.array(3.0))
        assert manager.load(es.values_of(w), step=np.int64(3))[w].shape == (2,)
    with es.CheckpointManager(tmp_path) as reopened:
        assert reopened.steps() == (3, 4)


_SAVE_FLOAT_STEP = """
import sys
import eqstate as es
import jax.numpy as jnp

w = es.ParamState(jnp.zeros(2), name="w")
with es.CheckpointManager(sys.argv[1], async_save=False) as manager:
    for step in (1.5, "2", True):
        try:
            manager.save(step, es.values_of(w))
        except es.CheckpointError as error:
            assert "non-negative integers" in str(error), error
        else:
            raise AssertionError(f"step {step!r} was accepted")
    assert manager.steps() == ()
"""


def test_a_python_float_or_string_step_is_refused_without_runtime_type_checks(
    tmp_path,
):
    # The suite checks annotations at run time, which refuses these first; a program
    # without those checks must get eqstate's own error.
    subprocess.run(
        [sys.executable, "-c", _SAVE_FLOAT_STEP, str(tmp_path)], check=True, timeout=300
    )
    assert list(tmp_path.iterdir()) == []


_SAVE_AND_EXIT = """
import sys
import eqstate as es
import jax.numpy as jnp

w = es.ParamState(jnp.arange(1_000_000.0), name="w")


def train():
    manager = es.CheckpointManager(sys.argv[1])  # saves in the background
    for step in (1, 2, 3):
        manager.save(step, es.values_of(w))
    # No `close()` or `wait_until_finished()`.
    {keep}


train()
"""


def _end_a_program_without_close(directory, keep=""):
    return subprocess.run(
        [sys.executable, "-c", _SAVE_AND_EXIT.format(keep=keep), str(directory)],
        check=True,
        timeout=120,
        capture_output=True,
        text=True,
    )


def _steps_and_last_value(directory):
    w = es.ParamState(jnp.zeros(1_000_000), name="w")
    with es.CheckpointManager(directory) as manager:
        return manager.steps(), manager.load(es.values_of(w))[w]


def test_a_manager_dropped_without_close_finishes_its_background_saves(tmp_path):
    # Dropped while the program runs, on every Python: from 3.12 on, at exit would be
    # too late (Python refuses the threads Orbax needs, and Orbax's threads then wait
    # for minutes).
    ended = _end_a_program_without_close(tmp_path / "run")
    assert "may be incomplete" not in ended.stderr
    steps, last = _steps_and_last_value(tmp_path / "run")
    assert steps == (1, 2, 3)
    assert (last == jnp.arange(1_000_000.0)).all()


def test_a_dropped_manager_is_closed_and_its_saves_are_on_disk(tmp_path):
    w = es.ParamState(jnp.arange(3_000_000.0), name="w")
    manager = es.CheckpointManager(tmp_path)
    inner = manager._manager
    for step in (1, 2, 3):
        manager.save(step, es.values_of(w))
    del manager  # No `close()`.
    assert not inner.is_saving_in_progress()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "3"]


@pytest.mark.skipif(
    sys.version_info >= (3, 12),
    reason="from Python 3.12 on, Python refuses at exit the threads Orbax needs to "
    "finish a save: documented under `CheckpointManager(async_save=...)`",
)
def test_a_program_ending_with_a_manager_it_did_not_close_keeps_its_last_save(
    tmp_path,
):
    ended = _end_a_program_without_close(
        tmp_path / "run", "global kept; kept = manager"
    )
    assert "may be incomplete" not in ended.stderr
    steps, last = _steps_and_last_value(tmp_path / "run")
    assert steps == (1, 2, 3)
    assert (last == jnp.arange(1_000_000.0)).all()


def test_each_unclosed_manager_is_closed_at_exit_even_if_one_fails(tmp_path, capsys):
    def fails():
        raise OSError("the disk is gone")

    w = es.ParamState(jnp.zeros(2), name="w")
    a = es.CheckpointManager(tmp_path / "a")
    b = es.CheckpointManager(tmp_path / "b")
    a.save(1, es.values_of(w))
    b.save(1, es.values_of(w))
    close_a, close_b = a._manager.close, b._manager.close
    closed = []
    a._manager.close = fails
    b._manager.close = lambda: closed.append(close_b())
    _checkpoint_manager._finish_saves()  # what runs when the program ends
    assert closed == [None] and not b._manager.is_saving_in_progress()
    error = capsys.readouterr().err
    assert "may be incomplete" in error and str(tmp_path / "a") in error
    assert "close()" in error and str(tmp_path / "b") not in error
    close_a()


def test_a_manager_closed_by_the_program_is_not_closed_again_at_its_end(tmp_path):
    manager = es.CheckpointManager(tmp_path)
    manager.save(1, es.values_of(es.ParamState(jnp.zeros(2), name="w")))
    manager.close()
    manager._manager.close = lambda: pytest.fail("closed twice")
    _checkpoint_manager._finish_saves()  # what runs when the program ends
    del manager


def test_managers_dropped_long_ago_are_not_kept_for_the_programs_end(tmp_path):
    for run in range(3):
        es.CheckpointManager(tmp_path / str(run))
    kept = es.CheckpointManager(tmp_path / "kept")
    assert sum(closer.alive for closer in _checkpoint_manager._UNCLOSED) == len(
        _checkpoint_manager._UNCLOSED
    )
    kept.close()


def test_a_closed_manager_refuses_to_save_or_load(tmp_path):
    w = es.ParamState(jnp.arange(3.0), name="w")
    manager = es.CheckpointManager(tmp_path)
    manager.save(1, es.values_of(w))
    manager.close()
    manager.close()  # again: harmless
    for call in (
        lambda: manager.save(2, es.values_of(w)),
        lambda: manager.load(es.values_of(w)),
    ):
        with pytest.raises(es.CheckpointError, match=r"is closed.*new"):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]


def test_a_step_another_manager_saved_is_not_replaced(tmp_path):
    w = es.ParamState(jnp.arange(3.0), name="w")
    late = es.CheckpointManager(tmp_path)  # made before the steps below are saved
    with es.CheckpointManager(tmp_path) as first:
        first.save(1, es.values_of(w))
        first.save(2, es.values_of(w))
    w.value = w.value + 100
    with pytest.raises(es.CheckpointError, match=r"(?s)another manager.*Nothing was"):
        late.save(1, es.values_of(w))
    late.save(3, es.values_of(w))
    late.close()
    with es.CheckpointManager(tmp_path) as manager:
        assert manager.steps() == (1, 2, 3)
        assert (manager.load(es.values_of(w), step=1)[w] == jnp.arange(3.0)).all()


def _unfinished_save(directory, step):
    """Makes what a save of `step` looks like while it is written (or after a crash)."""
    path = directory / f"{step}.orbax-checkpoint-tmp"
    (path / "eqstate.orbax-checkpoint-tmp").mkdir(parents=True)
    return path


def test_making_a_manager_removes_no_save_another_program_is_writing(tmp_path):
    with es.CheckpointManager(tmp_path) as manager:
        manager.save(1, es.values_of(es.ParamState(jnp.zeros(2), name="w")))
    writing = _unfinished_save(tmp_path, 2)
    reader = es.CheckpointManager(tmp_path)
    deadline = time.monotonic() + 1.0  # long enough for a removal in the background
    while time.monotonic() < deadline and writing.exists():
        time.sleep(0.01)
    assert reader.steps() == (1,)
    reader.close()
    assert writing.exists()


@pytest.mark.parametrize("through_a_symlink", [False, True])
def test_a_first_save_removes_no_save_another_manager_is_writing(
    tmp_path, through_a_symlink
):
    w = es.ParamState(jnp.arange(2.0), name="w")
    other_path = tmp_path
    if through_a_symlink:
        other_path = tmp_path.parent / f"{tmp_path.name}-link"
        other_path.symlink_to(tmp_path, target_is_directory=True)
    writing = es.CheckpointManager(tmp_path)
    writing.save(1, es.values_of(w))
    writing.wait_until_finished()
    in_flight = _unfinished_save(tmp_path, 2)
    # As while its save of step 2 is written in the background:
    writing._manager.is_saving_in_progress = lambda: True
    with es.CheckpointManager(other_path) as other:
        other.save(3, es.values_of(w))
        assert in_flight.exists()
        writing._manager.is_saving_in_progress = lambda: False
        other.save(4, es.values_of(w))  # its save is done: what is left is a crash's
        assert not in_flight.exists()
        assert other.steps() == (1, 3, 4)
    writing.close()


def test_the_first_save_removes_what_an_interrupted_save_left(tmp_path):
    w = es.ParamState(jnp.arange(2.0), name="w")
    left = _unfinished_save(tmp_path, 1)
    with es.CheckpointManager(tmp_path) as manager:
        assert manager.steps() == ()
        manager.save(2, es.values_of(w))
        assert manager.steps() == (2,)
        assert not left.exists()
    assert sorted(os.listdir(tmp_path)) == ["2"]
    with es.CheckpointManager(tmp_path) as manager:
        assert (manager.load(es.values_of(w))[w] == jnp.arange(2.0)).all()


_DROPPED_IN_A_CYCLE = """
import gc, os, sys, time
import eqstate as es
import jax.numpy as jnp

w = es.ParamState(jnp.zeros(2_000_000), name="w")
for run in range(3):
    manager = es.CheckpointManager(os.path.join(sys.argv[1], str(run)))
    manager.cycle = manager  # only the garbage collector can drop it
    manager.save(1, es.values_of(w))
    gc.disable()
    del manager
    # Collect often while the save runs, so that Orbax's own threads collect too.
    gc.enable()
    gc.set_threshold(1, 1, 1)
    start = time.monotonic()
    while time.monotonic() - start < 1.5:
        time.sleep(0.001)
    gc.set_threshold(700, 10, 10)
"""


def test_managers_collected_in_a_cycle_finish_their_saves_without_deadlock(tmp_path):
    # The collector may run in the thread that writes the save: waiting for the save
    # there would wait forever.
    subprocess.run(
        [sys.executable, "-c", _DROPPED_IN_A_CYCLE, str(tmp_path)],
        check=True,
        timeout=120,
        capture_output=True,
    )
    for run in range(3):
        assert os.listdir(tmp_path / str(run)) == ["1"]


# A manager saving `size` zeros, dropped in a reference cycle: only a garbage
# collection closes it.
_DROPPED_IN_A_CYCLE_WHILE_SAVING = """
import gc, os, sys, threading, time
import eqstate as es
import jax.numpy as jnp

w = es.ParamState(jnp.zeros({size}), name="w")
manager = es.CheckpointManager(sys.argv[1])
manager.cycle = manager
manager.save(1, es.values_of(w))
del manager
"""


def _run_and_check_the_save(script: str, tmp_path) -> None:
    ended = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        check=True,
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert "may be incomplete" not in ended.stderr
    assert os.listdir(tmp_path) == ["1"]


_COLLECTED_HOLDING_A_THREADING_LOCK = (
    _DROPPED_IN_A_CYCLE_WHILE_SAVING.format(size=1000)
    + """
# Collected where a thread that ends or starts holds this lock (Python 3.11, 3.12),
# which a new thread needs before it reports that it started.
with threading._shutdown_locks_lock:
    gc.collect()
# Closed in the background; wait here, as from Python 3.12 on the save cannot finish
# at exit (documented under `CheckpointManager(async_save=...)`).
while os.listdir(sys.argv[1]) != ["1"]:
    time.sleep(0.01)
"""
)


@pytest.mark.skipif(
    not hasattr(threading, "_shutdown_locks_lock"),
    reason="from Python 3.13 on, threads start and end without this lock",
)
def test_a_manager_collected_while_threading_holds_a_lock_does_not_deadlock(tmp_path):
    _run_and_check_the_save(_COLLECTED_HOLDING_A_THREADING_LOCK, tmp_path)


_COLLECTED_THEN_ENDS = (
    _DROPPED_IN_A_CYCLE_WHILE_SAVING.format(size=32_000_000)
    + """
# Collected in a daemon thread, as in Orbax's own, just before the program ends.
collector = threading.Thread(target=gc.collect, daemon=True)
collector.start()
collector.join()
"""
)


@pytest.mark.skipif(
    sys.version_info >= (3, 12),
    reason="from Python 3.12 on, Python refuses at exit the threads Orbax needs to "
    "finish a save: documented under `CheckpointManager(async_save=...)`",
)
def test_a_manager_collected_just_before_the_program_ends_keeps_its_save(tmp_path):
    _run_and_check_the_save(_COLLECTED_THEN_ENDS, tmp_path)


@pytest.mark.parametrize("max_to_keep", [0, -1, 1.5, "2", True])
def test_max_to_keep_other_than_a_positive_int_is_refused_when_made(
    tmp_path, max_to_keep
):
    with pytest.raises(ValueError, match=r"`max_to_keep` must be a positive number"):
        unchecked_new(es.CheckpointManager, tmp_path / "run", max_to_keep=max_to_keep)
    assert not (tmp_path / "run").exists()


def test_max_to_keep_may_be_a_numpy_integer(tmp_path):
    w = es.ParamState(jnp.arange(3.0), name="w")
    with es.CheckpointManager(tmp_path, max_to_keep=np.int64(1)) as manager:
        manager.save(1, es.values_of(w))
        manager.save(2, es.values_of(w))
    assert os.listdir(tmp_path) == ["2"]


def test_a_manager_sees_the_steps_another_manager_saved_or_removed_since(tmp_path):
    w = es.ParamState(jnp.zeros(3), name="w")
    reader = es.CheckpointManager(tmp_path)  # made before any step is saved
    with es.CheckpointManager(tmp_path, max_to_keep=2) as writer:
        for step in (1, 2, 3):
            w.value = jnp.full(3, float(step))
            writer.save(step, es.values_of(w))
    assert reader.steps() == (2, 3) and reader.latest_step() == 3
    assert (reader.load(es.values_of(w))[w] == 3.0).all()
    shutil.rmtree(tmp_path / "3")  # removed by hand, to free space say
    assert reader.steps() == (2,) and reader.latest_step() == 2
    assert (reader.load(es.values_of(w))[w] == 2.0).all()
    reader.close()


# Two processes that do not make the same save: every process refuses, in bounded time,
# before Orbax's collectives (where one more state in a process aborted both with
# Gloo's "Received data size doesn't match expected size", and a save made by one
# process alone, or to another path, waited until the launcher's timeout).
_DISAGREEING_SAVES = """
import json, os, sys
import eqstate as es
import jax

jax.distributed.initialize()

import jax.numpy as jnp
from eqstate import _multi_process
from jax.experimental import multihost_utils

_multi_process.AGREEMENT_TIMEOUT_S = 10  # for the process that never comes
workdir, rank = sys.argv[1], jax.process_index()
report = {"process": rank}


def model(extra=False, size=3):
    states = {"w": es.ParamState(jnp.arange(float(size))), "n": es.State(jnp.int32(7))}
    if extra:
        states["extra"] = es.State(jnp.zeros(2))
    return states


def refusal(save):
    try:
        save()
    except es.CheckpointError as error:
        return str(error)
    return None


path = lambda name: os.path.join(workdir, name)
report["one_more_state"] = refusal(lambda: es.save(path("more"), model(rank == 1)))
report["another_shape"] = refusal(
    lambda: es.save(path("shape"), model(size=3 + rank))
)
order = ["a", "b"] if rank == 0 else ["b", "a"]
report["opposite_orders"] = [refusal(lambda: es.save(path(p), model())) for p in order]
with es.CheckpointManager(path("run")) as manager:
    report["another_step"] = refusal(lambda: manager.save(1 + rank, model()))
es.save(path("agreed"), model())  # in step again: saves
report["agreed"] = float(es.load(path("agreed"), model(size=3))["w"].value.sum())
report["written"] = sorted(os.listdir(workdir))
if rank == 0:  # last: the processes are out of step after it
    report["one_process"] = refusal(lambda: es.save(path("alone"), model()))
multihost_utils.sync_global_devices("reported")
sys.stdout.write("RESULT " + json.dumps(report) + "\\n")  # one write: one line
sys.stdout.flush()
jax.distributed.shutdown()
"""


@pytest.fixture(scope="module")
def disagreeing(tmp_path_factory):
    """The report of each process of one launch of `_DISAGREEING_SAVES`, which must
    end within the launch's timeout: no save waits for a process that never comes."""
    workdir = tmp_path_factory.mktemp("disagreeing")
    script = tmp_path_factory.mktemp("script") / "disagreeing_saves.py"
    script.write_text(_DISAGREEING_SAVES)
    code, output = launch([str(script), str(workdir)], 2, timeout=180.0)
    found = reports(output)
    if code != 0 or len(found) != 2:
        pytest.fail(f"the launch exited with {code}:\n{output[-6000:]}")
    return sorted(found, key=lambda r: r["process"])


def test_a_process_saving_one_more_state_is_refused_in_every_process(disagreeing):
    first, second = disagreeing
    for report in (first, second):
        message = report["one_more_state"]
        assert "the processes save different things" in message
        assert "differs between processes" not in message
        assert "same saves and loads, in the same order" in message
    assert (
        "process 1 alone saves `extra` (shape (2,), dtype float32)"
        in (first["one_more_state"])
    )
    assert "this process alone saves `extra`" in second["one_more_state"]


def test_processes_saving_another_shape_name_the_entry_and_both_shapes(disagreeing):
    first, second = disagreeing
    assert (
        "`w` has shape (4,), dtype float32 in process 1, shape (3,), dtype float32 here"
        in first["another_shape"]
    )
    assert "`w` has shape (3,), dtype float32 in process 0" in second["another_shape"]


def test_processes_saving_to_two_paths_in_opposite_orders_refuse_each_save(
    disagreeing,
):
    first, second = disagreeing
    for report, other in ((first, 1), (second, 0)):
        one, two = report["opposite_orders"]
        assert f"process {other} saves to" in one and f"process {other} saves to" in two
        assert "same saves and loads, in the same order" in one


def test_managers_saving_another_step_are_refused(disagreeing):
    first, second = disagreeing
    assert "process 1 saves step 2 at the same time" in first["another_step"]
    assert "process 0 saves step 1 at the same time" in second["another_step"]


def test_refused_saves_write_nothing_and_the_next_agreed_save_works(disagreeing):
    first, second = disagreeing
    for report in (first, second):
        assert report["agreed"] == 3.0
        assert report["written"] == ["agreed", "run"]


def test_a_save_made_by_one_process_alone_is_refused_in_bounded_time(disagreeing):
    first, second = disagreeing
    assert "process 1 did not come to it within 10 s" in first["one_process"]
    assert "same saves and loads, in the same order" in first["one_process"]
    assert "one_process" not in second
