import errno
import json
import os
import pathlib
import re
import signal
import struct
import subprocess
import sys
import threading
import tracemalloc
import zlib

import eqstate as es
import eqstate.nn as enn
import equinox as eqx
import hypothesis
import jax
import jax.numpy as jnp
import jax.random as jr
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from .helpers import leak_a_tracer, tree_bitwise_equal, unchecked


_DTYPES = (
    jnp.float32,
    jnp.float16,
    jnp.bfloat16,
    jnp.int8,
    jnp.int32,
    jnp.uint32,
    jnp.bool_,
)


def _random(key, shape, dtype):
    """Random values covering the whole bit pattern of `dtype` (NaNs included), drawn
    on the host: compiling a sampler per shape and dtype would dominate the tests."""
    rng = np.random.default_rng(np.asarray(jr.key_data(key)))
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return jnp.asarray(rng.integers(0, 2, shape).astype(np.bool_))
    bits = rng.integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8)
    return jnp.asarray(bits.view(dtype).reshape(shape))


def _same_bits(a, b) -> bool:
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        if jax.random.key_impl(a) != jax.random.key_impl(b):
            return False
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


class _Norm(eqx.Module):
    scale: es.ParamState
    stats: dict

    def __init__(self, key, dtype):
        self.scale = es.ParamState(_random(key, (3,), dtype))
        self.stats = {
            "running_mean": es.LongTermState(jnp.zeros(3, jnp.float32)),
            "count": es.LongTermState(jnp.array(0, jnp.int32)),
        }


class _Layer(eqx.Module):
    weight: es.ParamState
    norm: _Norm

    def __init__(self, key, dtype):
        k1, k2 = jr.split(key)
        self.weight = es.ParamState(_random(k1, (2, 3), dtype))
        self.norm = _Norm(k2, dtype)


class _Model(eqx.Module):
    layers: list
    extras: dict
    rng: es.RandomState

    def __init__(self, key):
        keys = jr.split(key, len(_DTYPES) + 4)
        self.layers = [_Layer(k, dtype) for k, dtype in zip(keys, _DTYPES)]
        self.extras = {
            "flags": es.NonBatchState(_random(keys[-4], (5,), jnp.bool_)),
            "empty": es.State(jnp.zeros((0, 4), jnp.bfloat16)),
            "opt": es.ShortTermState(
                {
                    "mu": (
                        _random(keys[-3], (2,), jnp.float32),
                        jnp.array(3, jnp.int8),
                    ),
                    "nu": _random(keys[-2], (4,), jnp.uint32),
                }
            ),
        }
        self.rng = es.RandomState(keys[-1])


def _header(path) -> dict:
    """Reads the header by the format spec, independently of `eqstate._checkpoint`."""
    raw = pathlib.Path(path).read_bytes()
    magic, version, size = struct.unpack_from("<8sIQ", raw)
    assert (magic, version) == (b"\x93EQSTATE", 1)
    return json.loads(raw[20 : 20 + size].decode("utf-8"))


def _flip(path, position: int) -> None:
    raw = bytearray(pathlib.Path(path).read_bytes())
    raw[position] ^= 0x01
    pathlib.Path(path).write_bytes(bytes(raw))


def _data_start(path) -> int:
    (size,) = struct.unpack_from("<Q", pathlib.Path(path).read_bytes(), 12)
    return 24 + size


@pytest.fixture
def checkpoint(tmp_path):
    """A small named checkpoint: `w` f32[3] and `n` i32[], with the states and values."""
    w = es.ParamState(jnp.array([1.0, 2.0, 3.0]), name="w")
    n = es.ShortTermState(jnp.array(7), name="n")
    path = tmp_path / "small.eqstate"
    es.save(path, es.values_of([w, n]))
    return path, w, n


@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_round_trip_is_bit_exact(dtype, getkey, tmp_path):
    value = _random(getkey(), (4, 5), dtype)
    x = es.State(value, name="x")
    es.save(tmp_path / "x", es.values_of(x))

    fresh = es.State(jnp.zeros((4, 5), dtype), name="x")
    loaded = es.load(tmp_path / "x", es.values_of(fresh))
    assert loaded.states == (fresh,)
    assert _same_bits(loaded[fresh], value)


def test_round_trip_keeps_special_float_bits(tmp_path):
    # NaN payloads, signed zeros, infinities and subnormals survive unchanged.
    bits = np.array([0x7E01, 0xFE00, 0x8000, 0x0000, 0x7C00, 0x0001], np.uint16)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        value = jnp.asarray(bits.view(dtype))
        x = es.State(value, name="x")
        es.save(tmp_path / "x", es.values_of(x))
        loaded = es.load(tmp_path / "x", es.values_of(x))
        assert np.asarray(loaded[x]).view(np.uint16).tolist() == bits.tolist()


@pytest.mark.parametrize("impl", ("threefry2x32", "rbg"))
def test_round_trip_of_prng_keys(impl, getkey, tmp_path):
    seed1, seed2 = (int(jr.randint(getkey(), (), 0, 2**30)) for _ in range(2))
    rng = es.RandomState(jr.key(seed1, impl=impl), name="rng")
    keys = es.State(jr.split(jr.key(seed2, impl=impl), (2, 3)), name="keys")
    es.save(tmp_path / "k", es.values_of([rng, keys]))

    fresh = [
        es.RandomState(jr.key(0, impl=impl), name="rng"),
        es.State(jr.split(jr.key(0, impl=impl), (2, 3)), name="keys"),
    ]
    loaded = es.load(tmp_path / "k", es.values_of(fresh))
    assert jax.random.key_impl(loaded[fresh[0]]) == impl
    assert _same_bits(loaded[fresh[0]], rng.value)
    assert _same_bits(loaded[fresh[1]], keys.value)


def test_round_trip_into_freshly_built_model(getkey, tmp_path):
    key = getkey()
    model = _Model(key)
    original = es.values_of(model)
    es.save(tmp_path / "model.eqstate", model)

    fresh = _Model(getkey())
    assert not set(es.states_of(fresh)) & set(es.states_of(model))
    assert not tree_bitwise_equal(es.values_of(fresh), original)

    restored = es.load(tmp_path / "model.eqstate", fresh)
    assert es.states_of(restored) == es.states_of(fresh)
    for state, old in zip(es.states_of(fresh), original.states):
        assert jax.tree.structure(state.value) == jax.tree.structure(original[old])
        for a, b in zip(jax.tree.leaves(state.value), jax.tree.leaves(original[old])):
            assert _same_bits(a, b)
    # The restored key continues the same stream as the original.
    assert _same_bits(fresh.rng.split_key(), model.rng.split_key())


def test_paths_are_human_readable(getkey, tmp_path):
    model = _Model(getkey())
    es.save(tmp_path / "model.eqstate", es.values_of(model), model=model)
    entries = {e["path"]: e for e in _header(tmp_path / "model.eqstate")["entries"]}
    layer0 = [
        "layers.0.weight",
        "layers.0.norm.scale",
        "layers.0.norm.stats.count",
        "layers.0.norm.stats.running_mean",
    ]
    assert list(entries)[:4] == layer0
    assert "layers.6.norm.stats.running_mean" in entries
    assert entries["extras.opt.mu.0"]["dtype"] == "float32"
    assert entries["extras.opt.mu.1"]["shape"] == []
    assert entries["extras.opt.nu"]["dtype"] == "uint32"
    assert entries["extras.empty"]["shape"] == [0, 4]
    assert entries["layers.2.weight"]["dtype"] == "bfloat16"
    assert entries["rng"]["key_impl"] == "threefry2x32"
    assert entries["rng"]["dtype"] == "uint32" and entries["rng"]["shape"] == [2]
    assert len(entries) == 4 * len(_DTYPES) + 6


def test_file_follows_the_written_spec(getkey, tmp_path):
    # Decodes the file with nothing but the spec, and gets the saved values back.
    w = es.ParamState(jnp.array([[1.5, -2.0]], jnp.bfloat16), name="w")
    rng = es.RandomState(getkey(), name="rng")
    es.save(tmp_path / "c", es.values_of([w, rng]))
    raw = (tmp_path / "c").read_bytes()
    header = _header(tmp_path / "c")
    (size,) = struct.unpack_from("<Q", raw, 12)
    (header_crc,) = struct.unpack_from("<I", raw, 20 + size)
    assert header_crc == zlib.crc32(raw[: 20 + size])
    data = raw[24 + size :]
    assert len(data) == sum(e["length"] for e in header["entries"])
    decoded = {}
    for e in header["entries"]:
        blob = data[e["offset"] : e["offset"] + e["length"]]
        assert zlib.crc32(blob) == e["crc32"]
        array = np.frombuffer(blob, np.dtype(e["dtype"]).newbyteorder("<"))
        decoded[e["path"]] = (array.reshape(e["shape"]), e.get("key_impl"))
    assert np.asarray(w.value).tobytes() == decoded["w"][0].tobytes()
    assert decoded["w"][0].dtype == ml_dtypes.bfloat16
    assert decoded["rng"][1] == "threefry2x32"
    assert decoded["rng"][0].tobytes() == np.asarray(jr.key_data(rng.value)).tobytes()


def test_save_without_model_uses_names(tmp_path):
    opt = es.State({"mu": (jnp.ones(2), jnp.zeros(2))}, name="opt")
    w = es.ParamState(jnp.ones(3), name="encoder.w")
    es.save(tmp_path / "c", {w: w.value, opt: opt.value})
    paths = [e["path"] for e in _header(tmp_path / "c")["entries"]]
    assert paths == ["encoder.w", "opt.mu.0", "opt.mu.1"]


def test_save_without_model_needs_names(tmp_path):
    w = es.ParamState(jnp.ones(3))
    with pytest.raises(
        es.CheckpointError,
        match=r"Cannot save unnamed ParamState .* without a model.*unique",
    ):
        es.save(tmp_path / "c", es.values_of(w))
    assert not (tmp_path / "c").exists()


def test_save_without_model_refuses_duplicate_names(tmp_path):
    a = es.ParamState(jnp.ones(3), name="w")
    b = es.ParamState(jnp.ones(3), name="w")
    with pytest.raises(es.CheckpointError, match="two states named 'w'"):
        es.save(tmp_path / "c", es.values_of([a, b]))


def test_save_refuses_states_missing_from_model(tmp_path):
    model = {"w": es.ParamState(jnp.ones(3))}
    stray = es.ShortTermState(jnp.zeros(()), name="stray")
    with pytest.raises(
        es.CheckpointError,
        match="Cannot save ShortTermState 'stray': it is not in `model`",
    ):
        es.save(tmp_path / "c", es.values_of([model, stray]), model=model)


def test_load_into_state_dict_needs_names(checkpoint):
    path, w, n = checkpoint
    fresh = es.ParamState(jnp.zeros(3))
    with pytest.raises(
        es.CheckpointError,
        match=r"(?s)Cannot load unnamed .*eqstate.load\(path, model\)",
    ):
        es.load(path, es.values_of(fresh))


def test_load_state_missing_from_model(checkpoint):
    path, w, n = checkpoint
    with pytest.raises(es.CheckpointError, match="Cannot load ParamState 'w': it is"):
        es.load(path, es.values_of([w, n]), model=[n])


def test_save_refuses_colliding_paths(tmp_path):
    model = {"a.b": es.State(jnp.ones(1)), "a": {"b": es.State(jnp.ones(1))}}
    with pytest.raises(es.CheckpointError, match=r"same path `a\.b`"):
        es.save(tmp_path / "c", es.values_of(model), model=model)


def test_state_at_several_paths_is_stored_under_the_first(tmp_path):
    shared = es.ParamState(jnp.ones(2))
    model = {"decoder": shared, "encoder": shared}
    es.save(tmp_path / "c", model)
    assert [e["path"] for e in _header(tmp_path / "c")["entries"]] == ["decoder"]
    fresh = es.ParamState(jnp.zeros(2))
    es.load(tmp_path / "c", {"decoder": fresh, "encoder": fresh})
    assert (fresh.value == 1).all()


@pytest.mark.parametrize("backend", ["single-file", "orbax"])
def test_save_refuses_leaked_tracers(tmp_path, backend):
    w = es.ParamState(jnp.ones(2), name="w")
    with pytest.raises(es.CheckpointError, match=r"`w`.*tracer"):
        es.save(tmp_path / "c", {w: leak_a_tracer((2,))}, backend=backend)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("backend", ["single-file", "orbax"])
def test_saving_a_deleted_array_names_the_state_and_keeps_the_old_checkpoint(
    tmp_path, backend
):
    # As after a call that donated the buffers of values taken before it.
    w = es.ParamState(jnp.ones(3), name="w")
    path = _ckpt_path(tmp_path, backend)
    es.save(path, es.values_of(w), backend=backend)
    before = _files(path)
    stale = es.StateDict({w: jnp.arange(3.0)})
    stale[w].delete()
    with pytest.raises(
        es.CheckpointError,
        match=r"`w` \(ParamState 'w'\): its value \(shape \(3,\), dtype float32\) "
        r"is an array that has been deleted.*donate_states=True",
    ):
        es.save(path, stale, backend=backend)
    assert _files(path) == before and os.listdir(tmp_path) == [path.name]


# Each runs `body()` once inside a transform that traces it.
_TRANSFORMS = {
    "eqstate jit": lambda body: es.transform.jit(body)(),
    "jax.jit": lambda body: jax.jit(body)(),
    "eqstate scan": lambda body: es.transform.scan(
        lambda c, _: (body(), None), None, length=1
    ),
    "jax.lax.scan": lambda body: jax.lax.scan(
        lambda c, _: (body(), None), None, length=1
    ),
    "eqstate vmap": lambda body: es.transform.vmap(lambda _: body())(jnp.ones(2)),
    "eager jax.vmap": lambda body: jax.vmap(lambda _: body())(jnp.ones(2)),
}


@pytest.mark.parametrize("transform", _TRANSFORMS.values(), ids=_TRANSFORMS.keys())
def test_load_inside_a_transform_is_refused(checkpoint, transform):
    # Traced once, a load would read the file once and bake its values into the
    # compiled function: a newer checkpoint would never be seen.
    path, w, n = checkpoint

    def body():
        es.load(path, {"w": w, "n": n})

    with pytest.raises(
        es.CheckpointError,
        match=r"(?s)Cannot load .* inside a JAX transform.*"
        r"read once.*model = eqstate\.load\(path, model\)",
    ):
        transform(body)
    assert (w.value == jnp.array([1.0, 2.0, 3.0])).all() and n.value == 7


@pytest.mark.parametrize("transform", _TRANSFORMS.values(), ids=_TRANSFORMS.keys())
def test_save_inside_a_transform_is_refused(checkpoint, transform):
    # Even of concrete values: traced once, later calls would write nothing.
    path, w, n = checkpoint
    before = path.read_bytes()
    values = es.StateDict({w: jnp.zeros(3), n: jnp.array(0)})

    with pytest.raises(
        es.CheckpointError,
        match=r"(?s)Cannot save .* inside a JAX transform.*written once.*"
        r"after calling the compiled step",
    ):
        transform(lambda: es.save(path, values))
    assert path.read_bytes() == before
    assert os.listdir(path.parent) == [path.name]


def test_checkpoint_manager_refuses_to_load_or_save_inside_a_transform(tmp_path):
    w = es.ParamState(jnp.ones(2), name="w")
    with es.CheckpointManager(tmp_path, async_save=False) as manager:
        values = es.values_of(w)
        manager.save(1, values)
        with pytest.raises(
            es.CheckpointError, match=r"(?s)Cannot load .*manager\.load"
        ):
            jax.jit(lambda: manager.load(values))()
        with pytest.raises(
            es.CheckpointError, match=r"(?s)Cannot save .*manager\.save"
        ):
            jax.jit(lambda: manager.save(2, values))()
        assert manager.steps() == (1,)


def test_save_into_missing_directory(tmp_path):
    w = es.ParamState(jnp.ones(2), name="w")
    with pytest.raises(es.CheckpointError, match=r"directory .* does not exist"):
        es.save(tmp_path / "nope" / "c", es.values_of(w))


def test_save_overwrites_and_keeps_permissions(checkpoint):
    path, w, n = checkpoint
    w.value = jnp.array([4.0, 5.0, 6.0])
    es.save(path, es.values_of([w, n]))
    assert (es.load(path, es.values_of([w, n]))[w] == w.value).all()
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask
    assert os.listdir(path.parent) == [path.name]


@pytest.mark.parametrize("mode", [0o600, 0o444, 0o640])
def test_save_keeps_the_permissions_of_the_file_it_replaces(checkpoint, mode):
    path, w, n = checkpoint
    path.chmod(mode)
    w.value = jnp.array([4.0, 5.0, 6.0])
    es.save(path, es.values_of([w, n]))
    assert os.stat(path).st_mode & 0o777 == mode
    assert (es.load(path, es.values_of([w, n]))[w] == w.value).all()
    assert os.listdir(path.parent) == [path.name]


def test_load_from_state_dict_matches_names(checkpoint):
    path, w, n = checkpoint
    fresh_w = es.ParamState(jnp.zeros(3), name="w")
    fresh_n = es.ShortTermState(jnp.array(0), name="n")
    loaded = es.load(path, es.StateDict({fresh_n: 0, fresh_w: jnp.zeros(3)}))
    assert loaded.states == (fresh_n, fresh_w)
    assert _same_bits(loaded[fresh_w], w.value) and _same_bits(loaded[fresh_n], n.value)


def test_load_part_of_a_model_with_model_keyword(tmp_path):
    def build():
        return {"w": es.ParamState(jnp.zeros(2)), "n": es.ShortTermState(jnp.array(0))}

    model = build()
    model["w"].value = jnp.array([3.0, 4.0])
    es.save(tmp_path / "c", es.values_of(model, es.ParamState), model=model)

    fresh = build()
    with pytest.raises(es.CheckpointError, match=r"no entry `n`"):
        es.load(tmp_path / "c", fresh)
    loaded = es.load(tmp_path / "c", es.values_of(fresh, es.ParamState), model=fresh)
    assert loaded.states == (fresh["w"],)
    assert _same_bits(loaded[fresh["w"]], jnp.array([3.0, 4.0]))


def test_load_model_keyword_needs_a_state_dict(checkpoint):
    path, w, n = checkpoint
    with pytest.raises(TypeError, match="`model=` only when its target is a StateDict"):
        es.load(path, [w, n], model=[w, n])


def test_load_does_not_write_states(checkpoint):
    path, w, n = checkpoint
    w.value = jnp.zeros(3)
    loaded = es.load(path, es.values_of([w, n]))
    assert (w.value == 0).all()
    es.assign(loaded)
    assert (w.value == jnp.array([1.0, 2.0, 3.0])).all()


def test_load_keeps_the_target_sharding(getkey, tmp_path):
    sharding = NamedSharding(jax.make_mesh((8,), ("x",)), PartitionSpec("x"))
    w = es.ParamState(jax.device_put(jnp.arange(16.0), sharding), name="w")
    keys = es.State(jax.device_put(jr.split(getkey(), 8), sharding), name="keys")
    es.save(tmp_path / "c", es.values_of([w, keys]))
    loaded = es.load(tmp_path / "c", es.values_of([w, keys]))
    assert loaded[w].sharding == sharding and loaded[keys].sharding == sharding
    assert _same_bits(loaded[w], w.value) and _same_bits(loaded[keys], keys.value)


def test_load_missing_path(tmp_path):
    old = {"encoder": es.ParamState(jnp.ones(2))}
    es.save(tmp_path / "c", es.values_of(old), model=old)
    new = {"encoder": es.ParamState(jnp.ones(2)), "decoder": es.ParamState(jnp.ones(2))}
    with pytest.raises(
        es.CheckpointError, match=r"(?s)does not match the model.*no entry `decoder`"
    ):
        es.load(tmp_path / "c", new)


def test_load_extra_path(tmp_path):
    old = {"encoder": es.ParamState(jnp.ones(2)), "decoder": es.ParamState(jnp.ones(2))}
    es.save(tmp_path / "c", es.values_of(old), model=old)
    new = {"encoder": es.ParamState(jnp.ones(2))}
    with pytest.raises(
        es.CheckpointError, match=r"holds `decoder`, which the model does not have"
    ):
        es.load(tmp_path / "c", new)


def test_load_renamed_path_lists_both_sides(tmp_path):
    old = [es.ParamState(jnp.ones(2))]
    es.save(tmp_path / "c", es.values_of(old), model=old)
    new = {"w": es.ParamState(jnp.ones(2))}
    with pytest.raises(es.CheckpointError, match=r"(?s)no entry `w`.*holds `0`"):
        es.load(tmp_path / "c", new)


def test_a_long_mismatch_lists_the_first_five_and_counts_the_rest(tmp_path):
    old = [es.ParamState(jnp.ones(2)) for _ in range(8)]
    es.save(tmp_path / "c", es.values_of(old), model=old)
    new = {f"w{i}": es.ParamState(jnp.ones(2), name=f"w{i}") for i in range(7)}
    with pytest.raises(
        es.CheckpointError,
        match=r"no entry `w0` \(for ParamState 'w0'\), .*, `w4` \(for ParamState "
        r"'w4'\) and 2 more\.\nIt holds `0`, `1`, `2`, `3`, `4` and 3 more, which the "
        r"model does not have\.",
    ):
        es.load(tmp_path / "c", new)
    wider = [es.ParamState(jnp.ones(3)) for _ in range(8)]
    with pytest.raises(
        es.CheckpointError,
        match=r"(?s)does not match the model:\n(- `\d` holds shape \(2,\) [^\n]*;\n){5}"
        r"- and 3 more;\nBuild the target",
    ):
        es.load(tmp_path / "c", wider)


def test_load_wrong_shape(checkpoint):
    path, w, n = checkpoint
    fresh = [es.ParamState(jnp.zeros(4), name="w"), es.State(jnp.array(0), name="n")]
    with pytest.raises(
        es.CheckpointError,
        match=r"`w` holds shape \(3,\) and dtype float32, but ParamState 'w' "
        r"expects shape \(4,\) and dtype float32",
    ):
        es.load(path, es.values_of(fresh))


def test_load_wrong_dtype(checkpoint):
    path, w, n = checkpoint
    fresh = [
        es.ParamState(jnp.zeros(3, jnp.bfloat16), name="w"),
        es.State(jnp.array(0), name="n"),
    ]
    with pytest.raises(
        es.CheckpointError,
        match=r"`w` holds shape \(3,\) and dtype float32, but ParamState 'w' "
        r"expects shape \(3,\) and dtype bfloat16",
    ):
        es.load(path, es.values_of(fresh))


def test_load_key_into_array_is_a_dtype_mismatch(tmp_path):
    es.save(tmp_path / "c", es.values_of(es.RandomState(0, name="rng")))
    fresh = es.State(jnp.zeros(2, jnp.uint32), name="rng")
    with pytest.raises(
        es.CheckpointError, match=r"`rng` holds a threefry2x32 PRNG key .* but State"
    ):
        es.load(tmp_path / "c", es.values_of(fresh))


@pytest.mark.parametrize("keep", (0, 4, 15, 30, -9, -1))
def test_truncated_file(checkpoint, keep):
    path, w, n = checkpoint
    raw = path.read_bytes()
    path.write_bytes(raw[:keep])
    with pytest.raises(es.CheckpointError, match="is truncated: it has"):
        es.load(path, es.values_of([w, n]))


def test_trailing_bytes_are_corruption(checkpoint):
    path, w, n = checkpoint
    path.write_bytes(path.read_bytes() + b"\x00")
    with pytest.raises(es.CheckpointError, match="corrupted: it has 1 bytes after"):
        es.load(path, es.values_of([w, n]))


def test_flipped_byte_in_data(checkpoint):
    path, w, n = checkpoint
    _flip(path, _data_start(path) + 5)
    with pytest.raises(
        es.CheckpointError,
        match=r"corrupted: the bytes of entry `w` \(shape \(3,\), dtype float32\)",
    ):
        es.load(path, es.values_of([w, n]))


def test_flipped_byte_in_header(checkpoint):
    path, w, n = checkpoint
    _flip(path, 30)
    with pytest.raises(
        es.CheckpointError, match="corrupted: the checksum of its header"
    ):
        es.load(path, es.values_of([w, n]))


def test_every_flipped_byte_is_detected(checkpoint):
    path, w, n = checkpoint
    original = path.read_bytes()
    target = es.values_of([w, n])
    for position in range(len(original)):
        path.write_bytes(original)
        _flip(path, position)
        with pytest.raises(es.CheckpointError):
            es.load(path, target)
    path.write_bytes(original)
    assert (es.load(path, target)[w] == w.value).all()


def test_not_a_checkpoint(tmp_path):
    w = es.ParamState(jnp.ones(3), name="w")
    np.save(tmp_path / "w.npy", np.ones(3, np.float32))
    with pytest.raises(es.CheckpointError, match="is not an eqstate checkpoint"):
        es.load(tmp_path / "w.npy", es.values_of(w))


def test_unknown_version(checkpoint):
    path, w, n = checkpoint
    raw = bytearray(path.read_bytes())
    raw[8:12] = struct.pack("<I", 2)
    path.write_bytes(bytes(raw))
    with pytest.raises(es.CheckpointError, match=r"format version 2.*only version 1"):
        es.load(path, es.values_of([w, n]))


def test_malformed_header_with_valid_checksum(checkpoint):
    path, w, n = checkpoint
    header = b'{"entries": [{"path": "w"}]}'
    head = struct.pack("<8sIQ", b"\x93EQSTATE", 1, len(header)) + header
    path.write_bytes(head + struct.pack("<I", zlib.crc32(head)))
    with pytest.raises(es.CheckpointError, match="malformed header: entry 0 has no"):
        es.load(path, es.values_of([w, n]))


def test_missing_file(tmp_path):
    w = es.ParamState(jnp.ones(3), name="w")
    with pytest.raises(es.CheckpointError, match="does not exist"):
        es.load(tmp_path / "nope.eqstate", es.values_of(w))
    with pytest.raises(es.CheckpointError, match=r"is a directory.*CheckpointManager"):
        es.load(tmp_path, es.values_of(w))  # e.g. a manager's directory of checkpoints


def test_load_returns_nothing_partial_on_error(checkpoint):
    path, w, n = checkpoint
    w.value = jnp.zeros(3)
    n.value = jnp.array(0)
    # The last entry is corrupted; the first one is intact.
    _flip(path, path.stat().st_size - 1)
    with pytest.raises(es.CheckpointError, match="bytes of entry `n`"):
        es.assign(es.load(path, es.values_of([w, n])))
    assert (w.value == 0).all() and n.value == 0


class _FailingFile:
    """Wraps a file; its write of the first array raises, as a full disk or a kill
    would, after writing part of it."""

    def __init__(self, f, error):
        self._f, self._error, self._writes = f, error, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def write(self, data):
        self._writes += 1
        if self._writes == 3:
            self._f.write(bytes(data)[:3])
            raise self._error
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _fail_in_write(monkeypatch, error):
    real_fdopen = os.fdopen
    monkeypatch.setattr(
        os,
        "fdopen",
        lambda *a, **k: _FailingFile(real_fdopen(*a, **k), error),
    )


def _fail_in_fsync(monkeypatch, error):
    def fsync(fd):
        raise error

    monkeypatch.setattr(os, "fsync", fsync)


def _fail_in_replace(monkeypatch, error):
    def replace(src, dst):
        raise error

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("fail", (_fail_in_write, _fail_in_fsync, _fail_in_replace))
@pytest.mark.parametrize("error", (OSError("disk full"), KeyboardInterrupt()))
def test_crash_mid_save_keeps_previous_checkpoint(checkpoint, monkeypatch, fail, error):
    path, w, n = checkpoint
    previous = path.read_bytes()
    w.value = jnp.array([9.0, 9.0, 9.0])
    fail(monkeypatch, error)
    if isinstance(error, OSError):
        # An `OSError` becomes a `CheckpointError` naming the target, caused by it.
        expected = pytest.raises(es.CheckpointError, match=f"{path.name}'.*disk full")
    else:
        expected = pytest.raises(KeyboardInterrupt, match=r"^$")
    with expected as raised:
        es.save(path, es.values_of([w, n]))
    if isinstance(error, OSError):
        assert raised.value.__cause__ is error
    monkeypatch.undo()
    assert os.listdir(path.parent) == [path.name]
    assert path.read_bytes() == previous
    loaded = es.load(path, es.values_of([w, n]))
    assert (loaded[w] == jnp.array([1.0, 2.0, 3.0])).all() and loaded[n] == 7


def test_crash_mid_first_save_leaves_nothing(tmp_path, monkeypatch):
    w = es.ParamState(jnp.ones(3), name="w")
    _fail_in_write(monkeypatch, OSError("disk full"))
    with pytest.raises(es.CheckpointError, match="disk full"):
        es.save(tmp_path / "c", es.values_of(w))
    assert os.listdir(tmp_path) == []


def test_load_places_only_values_that_are_tied_to_devices(tmp_path):
    # Tying a loaded value to a device would make jitted functions compile again.
    loose = es.ParamState(jnp.ones(3))
    placed = es.ParamState(jax.device_put(jnp.ones(2), jax.devices()[1]))
    model = {"loose": loose, "placed": placed}
    path = tmp_path / "model.eqstate"
    es.save(path, model)
    loaded = es.load(path, es.values_of(model), model=model)
    assert not loaded[loose].committed
    assert loaded[placed].committed and loaded[placed].devices() == {jax.devices()[1]}


@pytest.mark.parametrize("backend", ["single-file", "orbax", "manager"])
def test_load_makes_values_on_the_device_of_a_target_made_under_default_device(
    tmp_path, backend
):
    device = jax.devices()[2]
    with jax.default_device(device):
        model = {
            "w": es.ParamState(jnp.arange(4.0), name="w"),
            "n": es.State(jnp.array(3), name="n"),  # weakly typed
            "key": es.State(jr.key(0), name="key"),
        }
    path = tmp_path / "model"
    if backend == "manager":
        with es.CheckpointManager(path) as manager:
            manager.save(1, model)
            loaded = manager.load(es.values_of(model), model=model)
    else:
        es.save(path, model, backend=backend)
        loaded = es.load(path, es.values_of(model), model=model, backend=backend)
    for state in model.values():
        value = loaded[state]
        assert value.devices() == {device} and not value.committed, state
    assert loaded[model["n"]].weak_type
    assert tree_bitwise_equal(
        [jr.key_data(loaded[model["key"]]), loaded[model["w"]]],
        [jr.key_data(model["key"].value), model["w"].value],
    )


def _raw_checkpoint(header: bytes, data: bytes = b"") -> bytes:
    """A file with a valid magic, version and header checksum around `header`."""
    head = struct.pack("<8sIQ", b"\x93EQSTATE", 1, len(header)) + header
    return head + struct.pack("<I", zlib.crc32(head)) + data


def test_deeply_nested_header_is_malformed_not_a_recursion_error(checkpoint):
    path, w, n = checkpoint
    path.write_bytes(_raw_checkpoint(b"[" * 100_000 + b"]" * 100_000))
    with pytest.raises(es.CheckpointError, match="malformed header: it nests"):
        es.load(path, es.values_of([w, n]))


_JSON = hypothesis.strategies.recursive(
    hypothesis.strategies.none()
    | hypothesis.strategies.booleans()
    | hypothesis.strategies.integers(-(2**70), 2**70)
    | hypothesis.strategies.floats(allow_nan=False)
    | hypothesis.strategies.sampled_from(["w", "n", "float32", "int32", "V8", "O", ""]),
    lambda children: (
        hypothesis.strategies.lists(children, max_size=4)
        | hypothesis.strategies.dictionaries(
            hypothesis.strategies.sampled_from(
                [
                    "entries",
                    "path",
                    "dtype",
                    "shape",
                    "offset",
                    "length",
                    "crc32",
                    "key_impl",
                ]
            ),
            children,
            max_size=7,
        )
    ),
    max_leaves=20,
)


@hypothesis.settings(max_examples=300)
@hypothesis.given(header=_JSON, data=hypothesis.strategies.binary(max_size=16))
def test_any_header_loads_or_raises_checkpoint_error(tmp_path_factory, header, data):
    w = es.ParamState(jnp.zeros(2), name="w")
    path = tmp_path_factory.mktemp("fuzz") / "c.eqstate"
    path.write_bytes(_raw_checkpoint(json.dumps(header).encode(), data))
    try:
        es.load(path, es.values_of(w))
    except es.CheckpointError:
        pass


@hypothesis.settings(max_examples=200)
@hypothesis.given(
    cut=hypothesis.strategies.integers(0, 200),
    junk=hypothesis.strategies.binary(max_size=40),
)
def test_any_cut_or_extended_file_raises_checkpoint_error(tmp_path_factory, cut, junk):
    w = es.ParamState(jnp.arange(3.0), name="w")
    path = tmp_path_factory.mktemp("cut") / "c.eqstate"
    es.save(path, es.values_of(w))
    raw = path.read_bytes()
    hypothesis.assume(cut < len(raw) or junk)
    path.write_bytes(raw[:cut] + junk)
    with pytest.raises(es.CheckpointError, match=r"checkpoint|malformed|truncated"):
        es.load(path, es.values_of(w))


def _peak_bytes_of_refused_load(path, states) -> int:
    """The most memory Python allocated while `load` refused the file."""
    tracemalloc.start()
    try:
        with pytest.raises(es.CheckpointError, match="checkpoint"):
            es.load(path, states)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


@pytest.mark.skipif(
    not os.path.exists("/proc/self/io"), reason="counts bytes read in /proc (Linux)"
)
@pytest.mark.parametrize("claim", ("none", "header", "entries"))
def test_a_huge_file_costs_only_the_bytes_its_header_vouches_for(tmp_path, claim):
    # A 1 GiB sparse file: not a checkpoint, or one whose header claims more than
    # it holds. Reading it whole would take 1 GiB (of memory, or of reads).
    w = es.ParamState(jnp.zeros(2), name="w")
    path = tmp_path / "big.eqstate"
    if claim == "none":
        start = b"not a checkpoint"
    elif claim == "header":
        start = struct.pack("<8sIQ", b"\x93EQSTATE", 1, 2**62)
    else:
        entry = {"path": "w", "dtype": "float32", "shape": [2**40], "offset": 0}
        entry.update(length=2**42, crc32=0)
        start = _raw_checkpoint(json.dumps({"entries": [entry]}).encode())
    with open(path, "wb") as f:
        f.write(start)
        f.truncate(2**30)
    match = {"none": "not an eqstate checkpoint", "header": "truncated"}
    before = _bytes_read()
    with pytest.raises(es.CheckpointError, match=match.get(claim, "truncated")):
        es.load(path, es.values_of(w))
    assert _bytes_read() - before < 2**20
    assert _peak_bytes_of_refused_load(path, es.values_of(w)) < 2**20


def _bytes_read() -> int:
    """How many bytes this process has read from files, pipes and sockets."""
    for line in pathlib.Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("/proc/self/io has no rchar")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_dev_zero_is_not_a_checkpoint_and_is_cheap():
    w = es.ParamState(jnp.zeros(2), name="w")
    with pytest.raises(es.CheckpointError, match="not an eqstate checkpoint"):
        es.load("/dev/zero", es.values_of(w))
    assert _peak_bytes_of_refused_load("/dev/zero", es.values_of(w)) < 2**20


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("extra", (b"", b"x"))
def test_a_checkpoint_streamed_through_a_pipe(checkpoint, tmp_path, extra):
    # A pipe has no size up front: it is read only as far as the header says.
    path, w, n = checkpoint
    raw = path.read_bytes() + extra
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(raw))
    writer.start()
    try:
        if extra:
            with pytest.raises(es.CheckpointError, match="bytes after its last entry"):
                es.load(fifo, es.values_of([w, n]))
        else:
            loaded = es.load(fifo, es.values_of([w, n]))
            assert (loaded[w] == jnp.array([1.0, 2.0, 3.0])).all() and loaded[n] == 7
    finally:
        writer.join()


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")
@pytest.mark.parametrize("relative", (False, True))
def test_save_onto_a_symlink_keeps_the_link_and_replaces_its_target(tmp_path, relative):
    w = es.ParamState(jnp.ones(3), name="w")
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "real.eqstate"
    link = tmp_path / "latest.eqstate"
    es.save(target, es.values_of(w))
    link.symlink_to(os.path.relpath(target, tmp_path) if relative else target)
    es.assign({w: jnp.full(3, 5.0)})
    es.save(link, es.values_of(w))
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert (es.load(target, es.values_of(w))[w] == 5.0).all()
    assert sorted(os.listdir(tmp_path / "store")) == ["real.eqstate"]
    assert sorted(os.listdir(tmp_path)) == ["latest.eqstate", "store"]


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")
def test_save_onto_a_dangling_symlink_creates_its_target(tmp_path):
    w = es.ParamState(jnp.ones(3), name="w")
    link = tmp_path / "latest.eqstate"
    link.symlink_to(tmp_path / "new.eqstate")
    es.save(link, es.values_of(w))
    assert link.is_symlink() and (tmp_path / "new.eqstate").is_file()
    assert (es.load(link, es.values_of(w))[w] == 1.0).all()


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_next_save_removes_the_temporaries_of_killed_saves(checkpoint):
    path, w, n = checkpoint
    directory = path.parent
    stale = [
        f".{path.name}.{_dead_pid()}.{'a' * 16}.tmp",  # its process is gone
        f".{path.name}.{os.getpid()}.{'b' * 16}.tmp",  # ours, and no save runs
        f".{path.name}.{'c' * 16}.tmp",  # named before the pid was added
    ]
    kept = [
        f".{path.name}.{os.getppid()}.{'d' * 16}.tmp",  # its process may still write
        f".other.eqstate.{_dead_pid()}.{'e' * 16}.tmp",  # another target's
        f".{path.name}.notes.tmp",  # not a temporary of eqstate
    ]
    for name in stale + kept:
        (directory / name).write_bytes(b"partial")
    es.save(path, es.values_of([w, n]))
    assert sorted(os.listdir(directory)) == sorted([path.name, *kept])


_KILLED_SAVE = """
import os, signal, sys
import jax.numpy as jnp
import eqstate as es

def killed(fd):
    os.kill(os.getpid(), signal.SIGKILL)

os.fsync = killed
w = es.ParamState(jnp.zeros(1000), name="w")
es.save(sys.argv[1], es.values_of(w))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_save_killed_with_sigkill_is_cleaned_up_by_the_next(checkpoint):
    path, w, n = checkpoint
    previous = path.read_bytes()
    killed = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(path)])
    assert killed.returncode == -signal.SIGKILL
    assert path.read_bytes() == previous  # the kill left the old checkpoint...
    assert len(os.listdir(path.parent)) == 2  # ...and its temporary file
    es.save(path, es.values_of([w, n]))
    assert os.listdir(path.parent) == [path.name]


@pytest.mark.parametrize(
    "error",
    (
        PermissionError(errno.EACCES, "Permission denied"),
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EROFS, "Read-only file system"),
    ),
    ids=("read-only directory", "full disk", "read-only file system"),
)
@pytest.mark.parametrize("fail", (_fail_in_write, "open"))
def test_unwritable_target_gives_checkpoint_error_and_keeps_the_old_file(
    checkpoint, monkeypatch, error, fail
):
    path, w, n = checkpoint
    previous = path.read_bytes()
    if fail == "open":
        real_open = os.open

        def refuse(name, *args, **kwargs):
            if str(name).endswith(".tmp"):
                raise error
            return real_open(name, *args, **kwargs)

        monkeypatch.setattr(os, "open", refuse)
    else:
        fail(monkeypatch, error)
    with pytest.raises(es.CheckpointError, match=f"{path.name}'.*{error.strerror}"):
        es.save(path, es.values_of([w, n]))
    monkeypatch.undo()
    assert path.read_bytes() == previous and os.listdir(path.parent) == [path.name]


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0,
    reason="needs POSIX permissions that apply (root writes anywhere)",
)
def test_save_into_a_read_only_directory(checkpoint):
    path, w, n = checkpoint
    previous = path.read_bytes()
    path.parent.chmod(0o500)
    try:
        with pytest.raises(es.CheckpointError, match="Permission denied") as raised:
            es.save(path, es.values_of([w, n]))
    finally:
        path.parent.chmod(0o700)
    assert isinstance(raised.value.__cause__, PermissionError)
    assert path.read_bytes() == previous


def test_unreadable_file_gives_checkpoint_error(checkpoint, monkeypatch):
    path, w, n = checkpoint

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("builtins.open", refuse)
    with pytest.raises(es.CheckpointError, match=r"Cannot read .*Permission denied"):
        es.load(path, es.values_of([w, n]))


@pytest.mark.parametrize("bad", (None, [1, 2], {"w": "text"}))
def test_save_refuses_what_holds_neither_arrays_nor_states(tmp_path, bad):
    with pytest.raises(TypeError, match=r"saves the arrays .* holds neither"):
        unchecked(es.save)(tmp_path / "c", bad)
    assert os.listdir(tmp_path) == []


class _Trained(eqx.Module):
    w: es.ParamState
    b: es.ParamState
    opt_state: es.LongTermState

    def __init__(
        self, scale: float, names: tuple[str | None, str | None] = (None, None)
    ):
        self.w = es.ParamState(jnp.ones(3) * scale, name=names[0])
        self.b = es.ParamState(jnp.ones(3) * scale, name=names[1])
        params = es.values_of(self, es.ParamState)
        self.opt_state = es.LongTermState(optax.adam(1e-3).init(params))


@pytest.mark.parametrize("backend", ["single-file", "orbax"])
def test_optimiser_state_of_state_dicts_loads_into_a_fresh_model(tmp_path, backend):
    # The optimiser's moments are StateDicts keyed by handles: they are stored under
    # the parameters' paths, so a model built afresh (other handles) loads them.
    model = _Trained(2.0)
    model.opt_state.value = jax.tree.map(lambda x: x + 1, model.opt_state.value)
    path = tmp_path / "model"
    es.save(path, model, backend=backend)
    fresh = es.load(path, _Trained(0.0), backend=backend)
    mu = fresh.opt_state.value[0].mu
    assert (mu[fresh.w] == 1).all() and (mu[fresh.b] == 1).all()
    assert (fresh.w.value == 2).all()


class _TwoNorms(eqx.Module):
    first: enn.BatchNorm  # both layers name their parameters "weight" and "bias"
    second: enn.BatchNorm
    opt_state: es.LongTermState

    def __init__(self):
        self.first, self.second = enn.BatchNorm(3), enn.BatchNorm(3)
        params = es.values_of(self, es.ParamState)
        self.opt_state = es.LongTermState(optax.adam(1e-3).init(params))


def _with_moments(model, moments: list[jax.Array]) -> None:
    """Gives the parameters of `model` the first Adam moments `moments`, in order."""
    params = es.states_of(model, es.ParamState)
    adam, *rest = model.opt_state.value
    mu = es.StateDict(dict(zip(params, moments, strict=True)))
    model.opt_state.value = (adam._replace(mu=mu), *rest)


def _opt_state_only(model) -> es.StateDict:
    return es.StateDict({model.opt_state: model.opt_state.value})


@pytest.mark.parametrize("backend", ["single-file", "orbax"])
@pytest.mark.parametrize(
    "build", (_TwoNorms, lambda: _Trained(1.0)), ids=("two BatchNorms", "unnamed")
)
def test_saving_only_the_optimiser_state_takes_parameter_paths_from_model(
    backend, build, tmp_path
):
    # The moments are StateDicts keyed by the parameters, whose values are not saved:
    # their paths come from `model=` too (unnamed, or named alike in both layers).
    model, fresh = build(), build()
    moments = [jnp.full(3, float(i)) for i in range(4 if build is _TwoNorms else 2)]
    _with_moments(model, moments)
    path = _ckpt_path(tmp_path, backend)
    es.save(path, _opt_state_only(model), model=model, backend=backend)
    loaded = es.load(path, _opt_state_only(fresh), model=fresh, backend=backend)
    mu = loaded[fresh.opt_state][0].mu
    assert tree_bitwise_equal(
        [mu[p] for p in es.states_of(fresh, es.ParamState)], moments
    )


def test_parameters_keying_a_saved_value_are_matched_by_path_not_name(tmp_path):
    # Names that do not identify the parameters (swapped in the model built afresh)
    # must not load one parameter's moment into another.
    model, fresh = _Trained(1.0, ("w", "b")), _Trained(0.0, ("b", "w"))
    _with_moments(model, [jnp.full(3, 5.0), jnp.full(3, 7.0)])
    path = tmp_path / "opt.eqstate"
    es.save(path, _opt_state_only(model), model=model)
    loaded = es.load(path, _opt_state_only(fresh), model=fresh)
    mu = loaded[fresh.opt_state][0].mu
    assert (mu[fresh.w] == 5).all() and (mu[fresh.b] == 7).all()


def test_a_value_keyed_by_an_unnamed_state_outside_the_model_is_refused(tmp_path):
    stray = es.ParamState(jnp.ones(3))
    model = {"opt": es.LongTermState(es.StateDict({stray: jnp.zeros(3)}))}
    with pytest.raises(
        es.CheckpointError,
        match=r"entry for unnamed ParamState .* not in `model`.*give it a `name=`",
    ):
        es.save(tmp_path / "c", es.values_of(model), model=model)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("backend", ["single-file", "orbax"])
def test_round_trip_keeps_weak_types(backend, tmp_path):
    # A value made from a Python scalar is weakly typed: it takes the dtype of what
    # it meets. Loaded strongly typed, it would turn bfloat16 products into float32.
    def build():
        return {
            "w": es.ParamState(jnp.full(3, 1.5, jnp.bfloat16), name="w"),
            "scale": es.State(1.0039, name="scale"),
            "steps": es.ShortTermState(jnp.array(0), name="steps"),
        }

    def forward(model, x):
        return model["w"].value * model["scale"].value * x

    old, x = build(), jnp.ones(3, jnp.bfloat16)
    path = tmp_path / ("ckpt" if backend == "orbax" else "ckpt.eqstate")
    es.save(path, old, backend=backend)
    new = es.load(path, build(), backend=backend)
    assert new["scale"].value.weak_type and new["steps"].value.weak_type
    assert not new["w"].value.weak_type
    assert forward(new, x).dtype == jnp.bfloat16
    assert tree_bitwise_equal(forward(new, x), forward(old, x))


def _scale_states(weak: bool) -> tuple[es.State, es.State]:
    """A state made from a Python scalar (weakly typed) and a strongly typed one, or
    the other way round, under the same names in both."""
    scale, bias = es.State(1.0, name="scale"), es.State(2.0, name="bias")
    (bias if weak else scale).value = jnp.float32(0.5)  # strongly typed now
    return scale, bias


def _ckpt_path(tmp_path, backend):
    return tmp_path / ("ckpt" if backend == "orbax" else "ckpt.eqstate")


@pytest.mark.parametrize("backend", ["single-file", "orbax"])
def test_weak_types_come_back_as_saved_whatever_the_target(backend, tmp_path):
    # Training can make a state made from a Python scalar strongly typed: resumed
    # weakly typed, `scale * x` would take the bfloat16 of `x` instead of float32.
    saved, target, x = (
        _scale_states(False),
        _scale_states(True),
        jnp.ones(3, jnp.bfloat16),
    )
    path = _ckpt_path(tmp_path, backend)
    es.save(path, es.values_of(saved), backend=backend)
    loaded = es.load(path, es.values_of(target), backend=backend)
    for old, new in zip(saved, target):
        assert loaded[new].weak_type == old.value.weak_type != new.value.weak_type
        with jax.numpy_dtype_promotion("standard"):  # where weak types matter
            assert (loaded[new] * x).dtype == (old.value * x).dtype


def test_a_checkpoint_without_weak_types_takes_the_targets(tmp_path):
    # As eqstate wrote files before their entries recorded weak types.
    saved, target = _scale_states(False), _scale_states(True)
    path = tmp_path / "ckpt.eqstate"
    es.save(path, es.values_of(saved))
    header, data = _header(path), path.read_bytes()[_data_start(path) :]
    for entry in header["entries"]:
        entry.pop("weak_type", None)
    path.write_bytes(_raw_checkpoint(json.dumps(header).encode(), data))
    loaded = es.load(path, es.values_of(target))
    for old, new in zip(saved, target):
        assert loaded[new].weak_type == new.value.weak_type
        assert tree_bitwise_equal(jnp.asarray(loaded[new]), old.value)


def test_a_weak_type_that_is_not_a_boolean_is_malformed(checkpoint):
    path, w, n = checkpoint
    header, data = _header(path), path.read_bytes()[_data_start(path) :]
    header["entries"][0]["weak_type"] = "yes"
    path.write_bytes(_raw_checkpoint(json.dumps(header).encode(), data))
    with pytest.raises(
        es.CheckpointError, match="entry `w` has an invalid 'weak_type'"
    ):
        es.load(path, es.values_of([w, n]))


def test_orbax_refuses_an_empty_array_before_touching_the_old_checkpoint(tmp_path):
    model = {
        "w": es.ParamState(jnp.arange(3.0), name="w"),
        "empty": es.State(jnp.zeros((0, 2)), name="empty"),
    }
    path = tmp_path / "ckpt"
    es.save(path, es.values_of(model["w"]), model=model, backend="orbax")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(
        es.CheckpointError, match=r"`empty` \(shape \(0, 2\).*single-file"
    ):
        es.save(path, es.values_of(model), model=model, backend="orbax")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    loaded = es.load(path, es.values_of(model["w"]), model=model, backend="orbax")
    assert (loaded[model["w"]] == jnp.arange(3.0)).all()


@pytest.mark.parametrize("keys", (("x", "x/"), ("a.b", "a.b/"), ("", "/")))
def test_orbax_refuses_paths_it_would_merge_before_touching_the_old_checkpoint(
    tmp_path, keys
):
    # Orbax drops a trailing '/': it would store both arrays at one path, and with
    # different shapes fail while writing, after removing the old checkpoint.
    plain, slashed = keys
    model = {plain: es.ParamState(jnp.ones(3)), slashed: es.ParamState(jnp.zeros(5))}
    path = tmp_path / "ckpt"
    es.save(path, es.values_of(model[plain]), model=model, backend="orbax")
    before = _files(path)
    with pytest.raises(es.CheckpointError, match=r"drops a path's trailing '/'"):
        es.save(path, es.values_of(model), model=model, backend="orbax")
    assert _files(path) == before
    # Apart, each one round-trips; the single-file backend keeps the two apart.
    es.save(tmp_path / "one", es.values_of(model), model=model)
    loaded = es.load(tmp_path / "one", es.values_of(model), model=model)
    assert (loaded[model[slashed]] == 0).all() and (loaded[model[plain]] == 1).all()


def _files(root: pathlib.Path) -> dict[str, bytes | None]:
    """Everything under `root` (itself included), with each file's bytes."""
    found = [root, *root.rglob("*")] if root.is_dir() else [root]
    return {
        str(p.relative_to(root.parent)): p.read_bytes() if p.is_file() else None
        for p in found
    }


def _run_directory(path: pathlib.Path) -> None:
    (path / "logs").mkdir(parents=True)
    (path / "notes.txt").write_text("precious")
    (path / "logs" / "train.log").write_text("step 1")


def _single_file_checkpoint(path: pathlib.Path) -> None:
    es.save(path, es.values_of(es.ParamState(jnp.ones(3), name="w")))


_FLOAT8 = (
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)


@pytest.mark.parametrize("name", _FLOAT8)
def test_orbax_saves_a_float8_bit_exactly_or_refuses_it_keeping_the_old_checkpoint(
    tmp_path, name
):
    # Which of these TensorStore can write depends on its release.
    dtype = getattr(jnp, name, None)
    if dtype is None:
        pytest.skip(f"this JAX has no {name}")
    q = es.State(jnp.linspace(-2, 2, 5).astype(dtype), name="q")
    w = es.ParamState(jnp.arange(3.0), name="w")
    path = tmp_path / "ckpt"
    es.save(path, es.values_of(w), backend="orbax")
    before = _files(path)
    try:
        es.save(path, es.values_of([w, q]), backend="orbax")
    except es.CheckpointError as error:
        assert f"dtype {name}" in str(error) and "Nothing was written" in str(error)
        assert _files(path) == before and os.listdir(tmp_path) == ["ckpt"]
        loaded = es.load(path, es.values_of(w), backend="orbax")
        assert (loaded[w] == jnp.arange(3.0)).all()
    else:
        target = es.values_of([w, q])
        loaded = es.load(path, target, backend="orbax")
        assert tree_bitwise_equal(loaded[q], q.value)


@pytest.mark.parametrize("name", ("int4", "uint4", "int2", "uint2", "float4_e2m1fn"))
def test_orbax_refuses_a_sub_byte_dtype_before_touching_the_old_checkpoint(
    tmp_path, name
):
    dtype = getattr(jnp, name, None)
    if dtype is None:
        pytest.skip(f"this JAX has no {name}")
    model = {
        "w": es.ParamState(jnp.arange(3.0), name="w"),
        "q": es.State(jnp.zeros(4, dtype), name="q"),
    }
    path = tmp_path / "ckpt"
    es.save(path, es.values_of(model["w"]), model=model, backend="orbax")
    before = _files(path)
    with pytest.raises(
        es.CheckpointError,
        match=rf"(?s)`q` \(shape \(4,\), dtype {name}\) of State 'q' .*narrower "
        "than a byte.*Nothing was written or removed.*backend='single-file'",
    ):
        es.save(path, es.values_of(model), model=model, backend="orbax")
    assert _files(path) == before and os.listdir(tmp_path) == ["ckpt"]
    loaded = es.load(path, es.values_of(model["w"]), model=model, backend="orbax")
    assert (loaded[model["w"]] == jnp.arange(3.0)).all()


def _flip_middle(path: pathlib.Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def _entries_of_numbers(path: pathlib.Path) -> None:
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "entries": [1, 2]}))


@pytest.mark.parametrize(
    "file, damage",
    (
        ("state/_METADATA", lambda p: p.write_text("{")),
        ("state/_METADATA", lambda p: p.write_text("{}")),
        ("state/manifest.ocdbt", _flip_middle),
        ("eqstate/metadata", _entries_of_numbers),
    ),
    ids=("not JSON", "empty JSON", "flipped byte", "entries of numbers"),
)
def test_damaged_orbax_metadata_gives_checkpoint_error(tmp_path, file, damage):
    model = {"w": es.ParamState(jnp.arange(64.0)), "n": es.ShortTermState(3)}
    path = tmp_path / "ckpt"
    es.save(path, es.values_of(model), model=model, backend="orbax")
    damage(path / file)
    with pytest.raises(es.CheckpointError, match=re.escape(f"'{path}'")) as info:
        es.load(path, model)
    # Orbax's own error is kept as the cause.
    message, cause = str(info.value), info.value.__cause__
    assert ("damaged" in message and cause is not None) or "malformed" in message


@pytest.mark.parametrize(
    "make, what, fix",
    (
        (_run_directory, r"a directory holding 'logs', 'notes\.txt'", "subdirectory"),
        (_single_file_checkpoint, "a file", "backend='single-file'"),
    ),
    ids=("directory of other files", "single-file checkpoint"),
)
def test_orbax_save_refuses_to_replace_what_is_not_a_checkpoint(
    tmp_path, make, what, fix
):
    # Orbax removes what is at the path before writing: a run's directory would go.
    path = tmp_path / "run"
    make(path)
    before = _files(path)
    w = es.ParamState(jnp.zeros(3), name="w")
    with pytest.raises(
        es.CheckpointError,
        match=rf"(?s)Cannot save an Orbax checkpoint to .*/run': it is {what}, not an "
        rf"Orbax checkpoint.*Nothing was written or removed.*{fix}",
    ):
        es.save(path, es.values_of(w), backend="orbax")
    assert _files(path) == before
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_orbax_save_replaces_an_earlier_checkpoint_or_fills_an_empty_directory(
    tmp_path,
):
    w = es.ParamState(jnp.zeros(3), name="w")
    path = tmp_path / "ckpt"
    path.mkdir()
    es.save(path, es.values_of(w), backend="orbax")
    w.value = jnp.ones(3)
    es.save(path, es.values_of(w), backend="orbax")
    assert (es.load(path, es.values_of(w))[w] == 1).all()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_an_orbax_save_that_fails_while_writing_keeps_the_checkpoint_it_replaces(
    tmp_path, monkeypatch
):
    # Orbax removes the directory it writes to before writing: a full disk would
    # lose the last good checkpoint.
    import orbax.checkpoint as ocp

    w = es.ParamState(jnp.arange(3.0), name="w")
    path = tmp_path / "ckpt"
    es.save(path, es.values_of(w), backend="orbax")
    before = _files(path)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(ocp.CompositeCheckpointHandler, "save", full_disk)
        w.value = jnp.zeros(3)
        with pytest.raises(es.CheckpointError, match="No space left on device"):
            es.save(path, es.values_of(w), backend="orbax")
    assert _files(path) == before
    assert (es.load(path, es.values_of(w))[w] == jnp.arange(3.0)).all()
    # The next save replaces it, and what the failed one left beside it.
    es.save(path, es.values_of(w), backend="orbax")
    assert (es.load(path, es.values_of(w))[w] == 0).all()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_an_orbax_save_through_a_symlink_replaces_the_checkpoint_it_leads_to(tmp_path):
    w = es.ParamState(jnp.arange(3.0), name="w")
    real, link = tmp_path / "real", tmp_path / "link"
    es.save(real, es.values_of(w), backend="orbax")
    link.symlink_to(real, target_is_directory=True)
    w.value = jnp.zeros(3)
    es.save(link, es.values_of(w), backend="orbax")
    assert link.is_symlink()
    assert (es.load(real, es.values_of(w))[w] == 0).all()
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]


def test_loading_an_orbax_checkpoint_whose_replacement_stopped_says_where_it_is(
    tmp_path,
):
    # A save killed between its two renames leaves the old checkpoint beside the path.
    w = es.ParamState(jnp.arange(3.0), name="w")
    path = tmp_path / "ckpt"
    es.save(path, es.values_of(w), backend="orbax")
    path.rename(tmp_path / "ckpt.eqstate-replaced")
    with pytest.raises(
        es.CheckpointError,
        match=r"(?s)stopped between two renames.*ckpt\.eqstate-replaced'.*rename",
    ):
        es.load(path, es.values_of(w), backend="orbax")


_BACKENDS = ("single-file", "orbax")


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("what", ("no states", "a state holding {}"))
def test_a_checkpoint_of_no_arrays_replaces_a_good_one_and_loads(
    tmp_path, backend, what
):
    # Orbax refused an empty PyTree only after removing the checkpoint it replaced.
    w = es.ParamState(jnp.arange(3.0), name="w")
    empty = es.ShortTermState({}, name="empty")
    states = es.StateDict() if what == "no states" else es.values_of(empty)
    path = tmp_path / "ckpt"
    es.save(path, es.values_of(w), backend=backend)
    es.save(path, states, backend=backend)
    assert os.listdir(tmp_path) == ["ckpt"]
    assert dict(es.load(path, states, backend=backend)) == dict(states)
    with pytest.raises(es.CheckpointError, match="`w`"):
        es.load(path, es.values_of(w), backend=backend)


def test_checkpoint_manager_saves_and_loads_a_checkpoint_of_no_arrays(tmp_path):
    w = es.ParamState(jnp.arange(3.0), name="w")
    empty = es.ShortTermState({}, name="empty")
    with es.CheckpointManager(tmp_path, async_save=False) as manager:
        manager.save(1, es.values_of(w))
        manager.save(2, es.StateDict())
        manager.save(3, es.values_of(empty))
        assert manager.steps() == (1, 2, 3)
        assert sorted(os.listdir(tmp_path)) == ["1", "2", "3"]
        assert dict(manager.load(es.StateDict(), step=2)) == {}
        assert dict(manager.load(es.values_of(empty))) == {empty: {}}
        assert (manager.load(es.values_of(w), step=1)[w] == jnp.arange(3.0)).all()


def _good_checkpoint(path: pathlib.Path, backend: str):
    w = es.ParamState(jnp.arange(3.0), name="w")
    c = es.ShortTermState(jnp.array(7), name="c")
    es.save(path, es.values_of([w, c]), backend=backend)
    return w, c


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize(
    "value, match",
    (
        (None, "its value is None"),
        ("hello", r"its value holds 'hello' \(a str\), which JAX cannot"),
        ({"a": object()}, r"its value holds <object .* at `\['a'\]`, which JAX"),
    ),
    ids=("None", "text", "object"),
)
def test_save_refuses_a_value_without_arrays_naming_the_state(
    tmp_path, backend, value, match
):
    path = tmp_path / "ckpt"
    w, c = _good_checkpoint(path, backend)
    before = _files(path)
    with pytest.raises(
        es.CheckpointError,
        match=rf"(?s)Cannot save ParamState 'w': {match}.*Nothing was written",
    ):
        es.save(path, {w: value, c: jnp.array(8)}, backend=backend)
    assert _files(path) == before and os.listdir(tmp_path) == ["ckpt"]
    assert (es.load(path, es.values_of([w, c]))[w] == jnp.arange(3.0)).all()


@pytest.mark.parametrize("backend", _BACKENDS)
def test_save_refuses_a_float0_array_before_writing(tmp_path, backend):
    # A float0 array is what `jax.grad(..., allow_int=True)` gives for an int leaf:
    # the single-file backend wrote it, and its own `load` refused the file.
    path = tmp_path / "ckpt"
    w, c = _good_checkpoint(path, backend)
    g = es.State(np.zeros((2,), jax.dtypes.float0), name="g")
    before = _files(path)
    with pytest.raises(
        es.CheckpointError,
        match=r"(?s)Cannot save `g` \(State 'g'\): .*dtype float0.*Nothing was written",
    ):
        es.save(path, es.values_of([w, c, g]), backend=backend)
    assert _files(path) == before and os.listdir(tmp_path) == ["ckpt"]


@pytest.mark.parametrize(
    "make, what",
    (
        (lambda p: p.write_text("user data"), "a file"),
        (lambda p: _run_directory(p), r"a directory holding 'logs', 'notes\.txt'"),
    ),
    ids=("file", "directory"),
)
def test_checkpoint_manager_refuses_to_save_over_what_is_not_a_checkpoint(
    tmp_path, make, what
):
    make(tmp_path / "5")
    before = _files(tmp_path)
    w = es.ParamState(jnp.zeros(3), name="w")
    with es.CheckpointManager(tmp_path, async_save=False) as manager:
        assert manager.steps() == ()
        with pytest.raises(
            es.CheckpointError,
            match=rf"(?s)Cannot save checkpoint 5 to .*/5': it is {what}, not an "
            "Orbax checkpoint.*Nothing was written or removed.*Move it out of",
        ):
            manager.save(5, es.values_of(w))
        assert _files(tmp_path) == before
        manager.save(6, es.values_of(w))
        assert manager.steps() == (6,)


@pytest.mark.parametrize("async_save", (False, True))
def test_checkpoint_manager_ignores_directories_that_are_not_checkpoints(
    tmp_path, async_save
):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "notes.txt").write_text("precious")
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "notes.txt").write_text("precious")
    w = es.ParamState(jnp.zeros(3), name="w")
    with es.CheckpointManager(
        tmp_path, max_to_keep=1, async_save=async_save
    ) as manager:
        assert manager.steps() == () and manager.latest_step() is None
        with pytest.raises(es.CheckpointError, match="No checkpoint in"):
            manager.load(es.values_of(w))
        with pytest.raises(
            es.CheckpointError, match=r"No checkpoint 1 in .*steps \[\]"
        ):
            manager.load(es.values_of(w), step=1)
        manager.save(2, es.values_of(w))
        manager.save(3, es.values_of(w))
        manager.wait_until_finished()
        assert manager.steps() == (3,)
    assert (tmp_path / "1" / "notes.txt").read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == ["1", "3", "7"]
    with es.CheckpointManager(tmp_path) as manager:
        assert manager.steps() == (3,)


@pytest.mark.parametrize("kind", ("file", "dangling symlink"))
def test_checkpoint_manager_refuses_a_path_that_is_not_a_directory(tmp_path, kind):
    path = tmp_path / "run"
    if kind == "file":
        path.write_text("user data")
    else:
        path.symlink_to(tmp_path / "nowhere")
    with pytest.raises(
        es.CheckpointError, match=r"Cannot keep checkpoints in .*/run': it is a"
    ):
        es.CheckpointManager(path, async_save=False)
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_orbax_saves_from_several_threads_keep_every_checkpoint(tmp_path):
    # Orbax numbers saves from one process-wide counter: saves started at once from
    # threads used to write into each other's temporary directories, fail, and
    # leave the paths they replaced empty.
    count = 4
    models = [{"a": es.State(jnp.full(100, i, jnp.float32))} for i in range(count)]
    paths = [tmp_path / f"c{i}" for i in range(count)]
    for model, path in zip(models, paths):
        es.save(path, es.values_of(model), model=model, backend="orbax")
    w = es.State(jnp.arange(10.0), name="w")
    errors = []

    def save(i):
        try:
            for _ in range(3):
                values = es.values_of(models[i])
                es.save(paths[i], values, model=models[i], backend="orbax")
        except Exception as e:
            errors.append(e)

    def manage():
        try:
            with es.CheckpointManager(tmp_path / "run") as manager:
                for step in range(1, 4):
                    manager.save(step, es.values_of(w))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(count)]
    threads.append(threading.Thread(target=manage))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert sorted(os.listdir(tmp_path)) == [*(f"c{i}" for i in range(count)), "run"]
    for i, path in enumerate(paths):
        loaded = es.load(path, {"a": es.State(jnp.zeros(100))}, backend="orbax")
        assert (loaded["a"].value == i).all()
    with es.CheckpointManager(tmp_path / "run") as manager:
        assert manager.steps() == (1, 2, 3)
        assert (manager.load(es.values_of(w))[w] == jnp.arange(10.0)).all()


def test_orbax_save_turns_an_os_error_into_a_checkpoint_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    w = es.State(jnp.arange(3.0), name="w")
    with pytest.raises(es.CheckpointError, match=r"file/ckpt'.*Orbax failed"):
        es.save(tmp_path / "file" / "ckpt", es.values_of(w), backend="orbax")
    assert (tmp_path / "file").read_text() == "not a directory"


@pytest.mark.parametrize("backend", ["single-file", "orbax"])
def test_save_refuses_a_python_int_too_large_and_keeps_the_old_checkpoint(
    backend, tmp_path
):
    n = es.State(jnp.array(0), name="tokens_seen")
    path = _ckpt_path(tmp_path, backend)
    es.save(path, {n: 3}, backend=backend)
    before = _files(path)
    with pytest.raises(
        es.CheckpointError,
        match=r"State 'tokens_seen'.* holds 1099511627776 .* at `\['a'\]`.*int32",
    ):
        es.save(path, {n: {"a": 2**40}}, backend=backend)
    assert _files(path) == before
    assert es.load(path, es.values_of(n), backend=backend)[n] == 3


@pytest.mark.parametrize("backend", ["single-file", "orbax"])
def test_load_into_abstract_values_places_them_on_their_shardings(
    backend, getkey, tmp_path
):
    # Abstract values, as `eqstate.transform.eval_shape` returns, give the shape and
    # dtype; one with a sharding is loaded onto it, keys as other arrays.
    sharding = NamedSharding(jax.make_mesh((8,), ("x",)), PartitionSpec("x"))
    w = es.ParamState(jnp.arange(16.0), name="w")
    keys = es.State(jr.split(getkey(), 8), name="keys")
    key = es.RandomState(getkey(), name="key")
    path = _ckpt_path(tmp_path, backend)
    es.save(path, es.values_of([w, keys, key]), backend=backend)
    abstract = {
        w: jax.ShapeDtypeStruct((16,), jnp.float32, sharding=sharding),
        keys: jax.ShapeDtypeStruct((8,), keys.value.dtype, sharding=sharding),
        key: jax.eval_shape(lambda k: k, key.value),
    }
    loaded = es.load(path, es.StateDict(abstract), backend=backend)
    for state in (w, keys):
        assert loaded[state].sharding == sharding and loaded[state].committed
    assert not loaded[key].committed
    for state in (w, keys, key):
        assert _same_bits(loaded[state], state.value)


@pytest.mark.parametrize("backend", ["single-file", "orbax"])
@pytest.mark.parametrize(
    "value, held, shown",
    [
        (
            np.array([1, 2**33 + 5]),
            "a NumPy array of dtype int64",
            "8589934597 becomes 5",
        ),
        (
            np.array([[0.5], [1e40]]),
            "a NumPy array of dtype float64",
            "1e+40 becomes inf",
        ),
        (np.array([0.5, 1e-50]), "a NumPy array of dtype float64", "1e-50 becomes 0.0"),
        (np.uint64(2**40), "a NumPy array of dtype uint64", "1099511627776 becomes 0"),
        # A Python float is a float64 too, and is refused on the same terms.
        (1e40, "a Python float", "1e+40 becomes inf"),
        (-1e39, "a Python float", "-1e+39 becomes -inf"),
        (1e-50, "a Python float", "1e-50 becomes 0.0"),
        (complex(1e-50, 1.0), "a Python complex", "(1e-50+1j) becomes 1j"),
    ],
)
def test_save_refuses_a_64_bit_value_that_narrowing_would_change(
    backend, value, held, shown, tmp_path
):
    # With 64-bit types off, JAX narrows 64-bit values (NumPy's, and Python floats)
    # to 32 bits, silently changing those that do not fit: the checkpoint would
    # store another value.
    assert not jax.config.jax_enable_x64
    n = es.State(jnp.zeros(2), name="n")
    path = _ckpt_path(tmp_path, backend)
    es.save(path, {n: jnp.ones(2)}, backend=backend)
    before = _files(path)
    with pytest.raises(
        es.CheckpointError,
        match=rf"State 'n': .*{held} at `\['a'\]`.*"
        rf"{re.escape(shown)}.*jax_enable_x64",
    ):
        es.save(path, {n: {"a": value}}, backend=backend)
    assert _files(path) == before
    # A 64-bit value that narrowing keeps, or only rounds (as a write of it to a
    # state does), is saved.
    es.save(path, {n: np.array([0.5, np.nan])}, backend=backend)
    loaded = es.load(path, {n: jnp.zeros(2)}, backend=backend)[n]
    assert loaded[0] == 0.5 and jnp.isnan(loaded[1])
    rounded = np.random.default_rng(0).normal(size=2)
    es.save(path, {n: rounded}, backend=backend)
    loaded = es.load(path, {n: jnp.zeros(2)}, backend=backend)[n]
    assert (loaded == jnp.asarray(rounded, jnp.float32)).all()
    es.save(path, {n: 0.1}, backend=backend)
    assert es.load(path, {n: jnp.zeros(())}, backend=backend)[n] == jnp.float32(0.1)


def test_save_to_a_long_file_name(tmp_path, monkeypatch):
    # Temporary names add ~30 bytes to the target's: for a long name, they use its
    # first bytes and a hash of it, and stay within the file system's limit.
    w = es.ParamState(jnp.ones(3), name="w")
    path = tmp_path / ("é" + "m" * 238)  # 240 bytes, within NAME_MAX (255)
    other = tmp_path / ("é" + "m" * 237 + "n")  # the same first 200 bytes
    temporaries = []
    replace = os.replace

    def recording_replace(src, dst):
        temporaries.append(os.path.basename(src))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)
    es.save(other, es.values_of(w))
    es.save(path, es.values_of(w))
    assert all(len(os.fsencode(name)) <= 255 for name in temporaries)
    # `.{stem}.{pid}.{16 hex digits}.tmp`: a crashed save's, of a process now gone,
    # is removed by the next save of its own target only.
    other_stem, stem = (name[1:].rsplit(".", 3)[0] for name in temporaries)
    assert stem != other_stem and stem.startswith("é")
    stale = f".{stem}.{_dead_pid()}.{'a' * 16}.tmp"
    kept = f".{other_stem}.{_dead_pid()}.{'b' * 16}.tmp"
    for name in (stale, kept):
        (tmp_path / name).write_bytes(b"partial")
    es.save(path, es.values_of(w))
    assert sorted(os.listdir(tmp_path)) == sorted([path.name, other.name, kept])
    assert (es.load(path, es.values_of(w))[w] == 1.0).all()
    # A name the file system refuses says so, not that the disk is full.
    with pytest.raises(es.CheckpointError, match=r"too long.*Use a shorter file name"):
        es.save(tmp_path / ("m" * 300), es.values_of(w))
    assert sorted(os.listdir(tmp_path)) == sorted([path.name, other.name, kept])


_SAVED_WITH_X64 = """
import sys
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import eqstate as es
model = {"n": es.State(jnp.array(2**33 + 5, jnp.int64), name="n"),
         "x": es.State(jnp.array(1e-50, jnp.float64), name="x")}
es.save(sys.argv[1], es.values_of(model), model=model, backend=sys.argv[2])
"""


@pytest.mark.parametrize("backend", ["single-file", "orbax"])
def test_a_64_bit_checkpoint_loaded_with_64_bit_types_off_is_refused(tmp_path, backend):
    path = str(tmp_path / "x64")
    subprocess.run(
        [sys.executable, "-c", _SAVED_WITH_X64, path, backend],
        check=True,
        timeout=120,
        capture_output=True,
    )
    model = {"n": es.State(jnp.array(0), name="n"), "x": es.State(jnp.array(0.0))}
    asks_64_bits = es.StateDict(
        {
            model["n"]: jax.ShapeDtypeStruct((), np.int64),
            model["x"]: jax.ShapeDtypeStruct((), np.float64),
        }
    )
    with pytest.raises(
        es.CheckpointError,
        match=r"(?s)`n` holds int64, which JAX holds as int32 while 64-bit types are "
        r"off.*turn them on before loading it \(`jax.config.update\('jax_enable_x64'",
    ):
        es.load(path, asks_64_bits, model=model, backend=backend)
    with pytest.raises(
        es.CheckpointError,
        match=r"(?s)`n` holds shape \(\) and dtype int64, but State 'n' expects shape "
        r"\(\) and dtype int32.*jax_enable_x64",
    ):
        es.load(path, model, backend=backend)


def test_an_orbax_checkpoint_loaded_as_a_single_file_says_to_use_the_orbax_backend(
    tmp_path,
):
    w = es.ParamState(jnp.arange(3.0), name="w")
    es.save(tmp_path / "c", es.values_of(w), backend="orbax")
    with pytest.raises(
        es.CheckpointError, match=r"checkpoint of the Orbax backend.*backend='orbax'"
    ):
        es.load(tmp_path / "c", es.values_of(w), backend="single-file")


def test_saving_onto_a_directory_says_to_pass_a_file_path_and_keeps_it(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "kept.txt").write_text("kept")
    w = es.ParamState(jnp.arange(3.0), name="w")
    with pytest.raises(
        es.CheckpointError, match=r"it is a directory. Pass the path of"
    ):
        es.save(tmp_path / "logs", es.values_of(w), backend="single-file")
    assert os.listdir(tmp_path) == ["logs"]
    assert os.listdir(tmp_path / "logs") == ["kept.txt"]


def test_a_manager_whose_directory_cannot_be_made_raises_checkpoint_error(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(es.CheckpointError, match=r"creating or reading it failed"):
        es.CheckpointManager(tmp_path / "afile" / "run")


# --- A model's arrays and states, saved and loaded whole ---------------------------


class _Mixed(eqx.Module):
    """`eqx.nn` layers (plain arrays) and eqstate layers and states, as a model mixes
    them."""

    linear: eqx.nn.Linear
    bn: enn.BatchNorm
    head: list
    steps: es.ShortTermState

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.linear = eqx.nn.Linear(3, 4, key=k1)
        self.bn = enn.BatchNorm(4)
        self.head = [eqx.nn.Linear(4, 2, key=k2), es.ParamState(jnp.ones(2))]
        self.steps = es.ShortTermState(jnp.array(0))

    def __call__(self, x):
        self.steps.value = self.steps.value + 1
        h = self.bn(jax.vmap(self.linear)(x))
        return jax.vmap(self.head[0])(h) * self.head[1].value[None]


def _trained_mixed(getkey) -> _Mixed:
    model = _Mixed(getkey())
    model(jr.normal(getkey(), (5, 3)))
    model.head[1].value = jr.normal(getkey(), (2,))
    return model


def _everything(model) -> list:
    """Every array and every state value of `model`, in flattening order."""
    leaves = jax.tree.leaves(model, is_leaf=es.is_state)
    return [x.value if es.is_state(x) else x for x in leaves if not isinstance(x, bool)]


def _save_whole(path, model, backend):
    if backend == "manager":
        with es.CheckpointManager(path) as manager:
            manager.save(1, model)
    else:
        es.save(path, model, backend=backend)


def _load_whole(path, model, backend):
    if backend == "manager":
        with es.CheckpointManager(path) as manager:
            return manager.load(model)
    return es.load(path, model, backend=backend)


_WHOLE = ("single-file", "orbax", "manager")


@pytest.mark.parametrize("backend", _WHOLE)
def test_a_mixed_model_round_trips_bit_exactly_into_a_freshly_built_one(
    backend, getkey, tmp_path
):
    model = _trained_mixed(getkey)
    path = tmp_path / "model"
    _save_whole(path, model, backend)
    fresh = _Mixed(getkey())  # other random weights, new handles
    assert not tree_bitwise_equal(fresh.linear.weight, model.linear.weight)
    restored = _load_whole(path, fresh, backend)
    assert type(restored) is _Mixed
    assert es.states_of(restored) == es.states_of(fresh)  # its handles, written to
    assert tree_bitwise_equal(_everything(restored), _everything(model))
    x = jr.normal(getkey(), (5, 3))
    infer = eqx.nn.inference_mode
    assert tree_bitwise_equal(infer(restored)(x), infer(model)(x))


@pytest.mark.parametrize("backend", _WHOLE)
def test_saving_the_states_alone_of_a_model_holding_arrays_is_refused(
    backend, getkey, tmp_path
):
    model = _trained_mixed(getkey)
    path = tmp_path / "model"
    values = es.values_of(model)
    with pytest.raises(
        es.CheckpointError,
        match=r"(?s)states alone from `model`: it also holds 4 arrays, "
        r"`linear\.weight`, `linear\.bias`, `head\.0\.weight`, `head\.0\.bias`, "
        r"which .*Nothing was written.*eqstate\.save\(path, model\).*"
        r"model=eqx\.filter\(model, eqstate\.is_state\)",
    ):
        if backend == "manager":
            with es.CheckpointManager(path) as manager:
                manager.save(1, values, model=model)
        else:
            es.save(path, values, model=model, backend=backend)
    assert os.listdir(tmp_path) == ([] if backend != "manager" else ["model"])
    assert not os.listdir(path) if backend == "manager" else True


def test_a_long_list_of_arrays_left_out_is_cut_short(tmp_path):
    model = {"arrays": [jnp.zeros(2) for _ in range(8)], "w": es.ParamState(1.0)}
    with pytest.raises(
        es.CheckpointError, match=r"8 arrays, `arrays\.0`, .* and 3 more"
    ):
        es.save(tmp_path / "c", es.values_of(model), model=model)


@pytest.mark.parametrize("backend", _BACKENDS)
def test_chosen_states_save_alone_with_the_model_filtered_to_its_handles(
    backend, getkey, tmp_path
):
    model = _trained_mixed(getkey)
    path = _ckpt_path(tmp_path, backend)
    params = es.values_of(model, es.ParamState)
    es.save(path, params, model=eqx.filter(model, es.is_state), backend=backend)
    fresh = _Mixed(getkey())
    loaded = es.load(path, es.values_of(fresh, es.ParamState), model=fresh)
    assert loaded.states == es.states_of(fresh, es.ParamState)
    assert tree_bitwise_equal(list(loaded.values()), list(params.values()))


def test_loading_into_a_model_writes_its_states_and_a_state_dict_target_does_not(
    getkey, tmp_path
):
    model = _trained_mixed(getkey)
    es.save(tmp_path / "c", model)
    fresh = _Mixed(getkey())
    before = _everything(fresh)
    with pytest.raises(es.CheckpointError, match=r"holds `linear\.weight`"):
        # A StateDict target has no arrays: the model's are extra entries.
        es.load(tmp_path / "c", es.values_of(fresh), model=fresh)
    restored = es.load(tmp_path / "c", fresh)
    assert tree_bitwise_equal(fresh.bn.running_mean.value, model.bn.running_mean.value)
    assert tree_bitwise_equal(fresh.linear.weight, before[0])  # arrays are returned
    assert tree_bitwise_equal(restored.linear.weight, model.linear.weight)


@pytest.mark.parametrize("backend", _WHOLE)
def test_a_refused_load_into_a_model_writes_no_state(backend, getkey, tmp_path):
    model = _trained_mixed(getkey)
    path = tmp_path / "model"
    _save_whole(path, model, backend)

    class Wider(_Mixed):
        def __init__(self, key):
            super().__init__(key)
            self.head = [eqx.nn.Linear(4, 3, key=key), es.ParamState(jnp.ones(2))]

    fresh = Wider(getkey())
    before = _everything(fresh)
    with pytest.raises(es.CheckpointError, match=r"`head\.0\.weight` holds shape"):
        _load_whole(path, fresh, backend)
    assert tree_bitwise_equal(_everything(fresh), before)


@pytest.mark.parametrize("backend", _BACKENDS)
def test_a_states_only_checkpoint_loads_into_a_model_of_states_alone(
    backend, getkey, tmp_path
):
    # As `save(path, values_of(model), model=model)` wrote it before models were
    # saved whole: the same entries.
    model, fresh = _Trained(2.0), _Trained(0.0)
    model.opt_state.value = jax.tree.map(lambda x: x + 1, model.opt_state.value)
    path = _ckpt_path(tmp_path, backend)
    es.save(path, es.values_of(model), model=model, backend=backend)
    fresh = es.load(path, fresh)
    leaves = [jax.tree.leaves(_everything(m)) for m in (fresh, model)]
    assert tree_bitwise_equal(*leaves)


@pytest.mark.parametrize("backend", _BACKENDS)
def test_a_states_only_checkpoint_into_a_mixed_model_names_the_missing_arrays(
    backend, getkey, tmp_path
):
    model = _trained_mixed(getkey)
    path = _ckpt_path(tmp_path, backend)
    states = eqx.filter(model, es.is_state)
    es.save(path, es.values_of(model), model=states, backend=backend)
    fresh = _Mixed(getkey())
    before = _everything(fresh)
    with pytest.raises(
        es.CheckpointError,
        match=r"(?s)no entry `linear\.weight`, `linear\.bias`, `head\.0\.weight`, "
        r"`head\.0\.bias`\..*lacks arrays of the model.*eqstate\.values_of\(model\)",
    ):
        es.load(path, fresh)
    assert tree_bitwise_equal(_everything(fresh), before)
    # What the message advises loads the states and keeps the model's arrays.
    es.assign(es.load(path, es.values_of(fresh), model=fresh))
    assert tree_bitwise_equal(fresh.bn.running_var.value, model.bn.running_var.value)


@pytest.mark.parametrize("backend", _BACKENDS)
def test_numpy_arrays_of_a_model_come_back_as_numpy_bit_exactly(backend, tmp_path):
    values = np.arange(6.0).reshape(2, 3) / 7  # float64, which JAX would narrow
    model = {"table": values, "flag": np.bool_(True), "w": es.ParamState(jnp.ones(2))}
    path = _ckpt_path(tmp_path, backend)
    es.save(path, model, backend=backend)
    target = {
        "table": np.zeros((2, 3)),
        "flag": np.bool_(False),
        "w": es.ParamState(0.0 * jnp.ones(2)),
    }
    restored = es.load(path, target, backend=backend)
    assert type(restored["table"]) is np.ndarray and type(restored["flag"]) is np.bool_
    assert restored["table"].dtype == np.float64
    assert restored["table"].tobytes() == values.tobytes() and restored["flag"]


def test_a_model_of_abstract_arrays_loads_the_arrays(getkey, tmp_path):
    model = _trained_mixed(getkey)
    es.save(tmp_path / "c", model)
    fresh = _Mixed(getkey())
    abstract = eqx.tree_at(
        lambda m: m.linear.weight,
        fresh,
        jax.ShapeDtypeStruct(fresh.linear.weight.shape, jnp.float32),
    )
    restored = es.load(tmp_path / "c", abstract)
    assert tree_bitwise_equal(restored.linear.weight, model.linear.weight)


def test_save_with_model_keyword_and_a_model_to_save_is_refused(getkey, tmp_path):
    model = _trained_mixed(getkey)
    with pytest.raises(TypeError, match=r"To save a whole model.*save\(path, model\)"):
        es.save(tmp_path / "c", model, model=model)
    assert os.listdir(tmp_path) == []
