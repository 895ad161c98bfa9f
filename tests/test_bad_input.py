"""Every bad input in `docs/bad-input.md`, each a test: the error it gets, and every
state left as it was. The page's table and `CASES` must list the same cases."""

import contextvars
import copy
import os
import pathlib
import pickle
import re
import struct
import tempfile
import zlib

import eqstate as es
import eqstate.nn as enn
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from .helpers import leak_a_tracer, tree_bitwise_equal, unchecked, unchecked_new


_DOC = pathlib.Path(__file__).parent.parent / "docs" / "bad-input.md"
CASES: dict[str, tuple[str, type[BaseException], str]] = {}


def case(description: str, error: type[BaseException], match: str):
    """Registers a case: a function that sets up states and returns `(trigger,
    states)`; `trigger()` must raise `error` matching `match`, and `states` must keep
    their values."""

    def register(fn):
        CASES[fn.__name__] = (description, error, match)
        fn.expected = (error, match)
        return fn

    return register


def _w(shape=(3,), name="w"):
    return es.ParamState(jnp.zeros(shape), name=name)


@case(
    "write with the wrong shape", es.StateValueError, r"shape \(4,\) .* ParamState 'w'"
)
def write_wrong_shape():
    w = _w()
    return lambda: setattr(w, "value", jnp.zeros(4)), [w]


@case("write with the wrong dtype", es.StateValueError, "dtype int32 to ParamState 'w'")
def write_wrong_dtype():
    w = _w()
    return lambda: setattr(w, "value", jnp.zeros(3, jnp.int32)), [w]


@case("write with the wrong PyTree structure", es.StateValueError, "structure")
def write_wrong_structure():
    w = es.State({"a": jnp.zeros(2)}, name="w")
    return lambda: setattr(w, "value", [jnp.zeros(2)]), [w]


@case("a Python float written to an int state", es.StateValueError, "dtype float32")
def write_float_to_int():
    n = es.State(jnp.array(0), name="n")
    return lambda: setattr(n, "value", 0.5), [n]


@case("a value JAX cannot make an array of, written", es.StateValueError, "'abc'.*'w'")
def write_non_array():
    w = _w()
    return lambda: setattr(w, "value", "abc"), [w]


@case("a number written to a key state", es.StateValueError, "'rng'.*reseed")
def write_number_to_key():
    rng = es.RandomState(0, name="rng")
    return lambda: setattr(rng, "value", 3), [rng]


@case(
    "read a state no context knows", es.StateNotFoundError, "has no value in the world"
)
def read_unknown_state():
    with es.scope(es.StateDict()):
        lost = es.State(jnp.zeros(2), name="lost")
    return lambda: lost.value, []


@case("read a state of another scope", es.StateNotFoundError, "is not in the StateDict")
def read_other_scope():
    mine, other = _w(name="mine"), _w(name="other")

    def trigger():
        with es.scope(es.StateDict({mine: jnp.ones(3)})):
            return other.value

    return trigger, [mine, other]


@case("read inside a raw `jax.jit`", es.TraceContextError, "Cannot read ParamState 'w'")
def read_in_raw_jit():
    w = _w()
    return lambda: jax.jit(lambda: w.value)(), [w]


@case("write inside a raw `jax.vmap`", es.TraceContextError, "Cannot write")
def write_in_raw_vmap():
    w = es.State(jnp.zeros(()), name="w")
    return lambda: jax.vmap(lambda x: setattr(w, "value", x))(jnp.ones(2)), [w]


@case("write a tracer leaked out of its trace", es.TraceContextError, "leaked")
def write_leaked_tracer():
    w = _w()
    leaked = leak_a_tracer((3,))
    return lambda: setattr(w, "value", leaked), [w]


@case("create a state inside a raw `jax.jit`", es.TraceContextError, "Cannot create")
def create_in_raw_jit():
    return lambda: jax.jit(lambda: es.State(jnp.zeros(2)).name)(), []


@case(
    "use a handle that escaped a trace",
    es.TraceContextError,
    "was created inside a trace",
)
def escaped_handle():
    escaped = []
    es.transform.StatefulFunction(lambda: escaped.append(es.State(jnp.zeros(2))))()
    return lambda: escaped[0].value, []


@case(
    "read a handle `eval_shape` returned",
    es.TraceContextError,
    "ParamState 'p' comes from `eqstate.transform.eval_shape` of `ctor`.* shape and "
    "dtype only.*Call `ctor` itself",
)
def eval_shape_handle():
    def ctor():
        return es.ParamState(jnp.zeros(2), name="p")

    return lambda: es.transform.eval_shape(ctor).value, []


@case(
    "a write, from a copied context, to a scope that has ended",
    es.TraceContextError,
    "ParamState 'w' through an `eqstate.scope`.*has ended.*`await` the task",
)
def write_after_scope_ended():
    w = _w()
    with es.scope(es.values_of([w])):
        copied = contextvars.copy_context()  # as an asyncio task created here does
    return lambda: copied.run(setattr, w, "value", jnp.ones(3)), [w]


@case(
    "`jit(out_shardings=...)` of a function returning handles or strings",
    NotImplementedError,
    "refers to positions of outputs",
)
def positional_options_with_handles():
    w = _w()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    step = es.transform.jit(lambda x: (w.value * x, "label"), out_shardings=one)
    return lambda: step(jnp.ones(3)), [w]


@case(
    "a model keeping a handle in a field marked `eqx.field(static=True)`, cloned",
    ValueError,
    r"`Counter.n` \(at `.n`\), a field marked.*Remove `static=True`",
)
def handle_in_static_field():
    import equinox as eqx

    class Counter(eqx.Module):
        n: es.State = eqx.field(static=True)

    n = es.State(jnp.array(0), name="n")
    return lambda: es.clone(Counter(n)), [n]


@case("an unhashable static argument", TypeError, "unhashable static argument 1")
def unhashable_static():
    sf = es.transform.StatefulFunction(lambda x, n: x, static_argnums=1)
    return lambda: sf(1.0, [1]), []


@case("`static_argnums` out of range", ValueError, "`static_argnums` holds 2")
def static_out_of_range():
    return lambda: es.transform.StatefulFunction(lambda x: x, static_argnums=2), []


@case("`static_argnames` naming no parameter", ValueError, "`static_argnames` holds")
def static_name_unknown():
    return lambda: es.transform.StatefulFunction(lambda x: x, static_argnames="y"), []


@case("`jaxpr_call` with the wrong number of values", ValueError, "touches 1 state")
def jaxpr_call_count():
    w = _w()
    sf = es.transform.StatefulFunction(lambda: w.value).make_jaxpr()
    return lambda: sf.jaxpr_call([w.value, w.value]), [w]


@case("`jaxpr_call` with a None value", es.StateValueError, "is None")
def jaxpr_call_none():
    w = _w()
    sf = es.transform.StatefulFunction(lambda: w.value).make_jaxpr()
    return lambda: sf.jaxpr_call([None]), [w]


@case(
    "`jaxpr_call` with a Python int beyond the default integer type",
    es.StateValueError,
    r"position 0 .* Python int 1099511627776.*int32, cannot hold",
)
def jaxpr_call_int_too_large():
    count = es.State(jnp.array(0, jnp.int32), name="count")

    def step():
        count.value = count.value + 1

    sf = es.transform.StatefulFunction(step).make_jaxpr()
    return lambda: sf.jaxpr_call([2**40]), [count]


@case("`jaxpr_call` with a wrongly shaped value", es.StateValueError, r"is f32\[5\]")
def jaxpr_call_shape():
    w = _w()
    sf = es.transform.StatefulFunction(lambda: w.value).make_jaxpr()
    return lambda: sf.jaxpr_call([jnp.zeros(5)]), [w]


@case(
    "`jaxpr_call` with a StateDict lacking a state", es.StateNotFoundError, "is not in"
)
def jaxpr_call_missing():
    w = _w()
    return lambda: es.transform.StatefulFunction(lambda: w.value).jaxpr_call(
        es.StateDict()
    ), [w]


@case("an unknown cache key", es.UnknownCacheKeyError, "no trace for the cache key")
def unknown_cache_key():
    sf = es.transform.StatefulFunction(lambda x: x).make_jaxpr(1.0)
    return lambda: sf.get_jaxpr(("not", "a", "key")), []


@case("a value that is not a filter", TypeError, "is not a filter")
def bad_filter():
    return lambda: es.world().filter(3), []


@case(
    "a class that is not a state kind as a filter", TypeError, "int is not a State kind"
)
def bad_filter_class():
    return lambda: es.world().filter(int), []


@case(
    "a one-argument predicate as a filter",
    TypeError,
    r"`<lambda>\(state\)` cannot be called as `filter\(path, state\)`",
)
def filter_one_argument():
    return lambda: es.world().filter(lambda state: True), []


@case("a StateDict key that is not a handle", TypeError, "StateDict")
def state_dict_bad_key():
    return lambda: es.StateDict({"w": jnp.zeros(2)}), []


@case("a key that is not a handle, merged in", TypeError, "must be state handles")
def state_dict_or_bad_key():
    w = _w()
    sd = es.StateDict({w: jnp.ones(3)})
    return lambda: sd | {"w": jnp.ones(3)}, [w]


@case(
    "a state's name as a StateDict key",
    es.StateNotFoundError,
    r"keys are state handles, not names.*WithName\('w'\)",
)
def state_dict_name_key():
    w = _w()
    sd = es.StateDict({w: jnp.ones(3)})
    return lambda: unchecked(sd.__getitem__)("w"), [w]


@case("`StateDict.set` with the wrong shape", es.StateValueError, "shape")
def state_dict_set_shape():
    w = _w()
    sd = es.world().filter(w)
    return lambda: sd.set(w, jnp.zeros(2)), [w]


@case(
    "merging StateDicts that disagree on a state's shape",
    es.StateValueError,
    "ParamState 'w'",
)
def state_dict_merge_mismatch():
    w = _w()
    return lambda: es.StateDict.merge(es.world().filter(w), {w: jnp.zeros(7)}), [w]


@case("`es.assign` with one bad value", es.StateValueError, "ParamState 'b'")
def assign_partly_bad():
    a, b = _w(name="a"), _w(name="b")
    return lambda: es.assign({a: jnp.ones(3), b: jnp.ones(4)}), [a, b]


@case("a batched write to a state `vmap` broadcasts", es.BatchAxisError, "not declared")
def vmap_undeclared_write():
    w = es.State(jnp.zeros(()), name="w")
    return lambda: es.transform.vmap(lambda x: setattr(w, "value", x))(jnp.ones(3)), [w]


@case(
    "`vmap` with an `in_axes` of the wrong length", ValueError, "one entry per argument"
)
def vmap_bad_in_axes():
    return lambda: es.transform.vmap(lambda x: x, in_axes=(0, 0))(jnp.ones(2)), []


@case("`vmap` over arguments of different sizes", ValueError, "inconsistent sizes")
def vmap_inconsistent_sizes():
    return lambda: es.transform.vmap(lambda x, y: x + y)(jnp.ones(2), jnp.ones(3)), []


@case("`vmap` mapping a state without that axis", ValueError, "which it does not have")
def vmap_state_without_axis():
    w = es.State(jnp.zeros(()), name="w")
    return lambda: es.transform.vmap(lambda: w.value, in_states=w, axis_size=2)(), [w]


@case("`in_states` with non-integer axes", TypeError, "integer axes")
def vmap_bad_state_axes():
    return lambda: es.transform.vmap(lambda: 0.0, in_states={"a": es.State}), []


@case("`vmap_new_states` given `in_states`", ValueError, "in_states` and `out_states`")
def new_states_in_states():
    return lambda: es.transform.vmap_new_states(lambda: None, in_states=es.State), []


@case(
    "`vmap_new_states` with a non-positive `axis_size`", ValueError, "positive integer"
)
def new_states_axis_size():
    return lambda: es.transform.vmap_new_states(lambda: None, axis_size=0), []


@case(
    "keyword arguments to a `vmap_new_states` function", NotImplementedError, "keyword"
)
def new_states_kwargs():
    f = es.transform.vmap_new_states(lambda x=1.0: es.State(x), axis_size=2)
    return lambda: f(x=jnp.ones(2)), []


@case(
    "a NonBatchState that differs across lanes",
    es.BatchAxisError,
    "NonBatchState 'shared'",
)
def new_states_nonbatch_batched():
    f = es.transform.vmap_new_states(lambda x: es.NonBatchState(x, name="shared"))
    return lambda: f(jnp.arange(3.0)), []


@case(
    "`vmap_new_states` writing a pre-existing state",
    es.TraceContextError,
    "existed before",
)
def new_states_write_existing():
    w = es.State(jnp.zeros(()), name="w")
    f = es.transform.vmap_new_states(
        lambda: setattr(w, "value", jnp.ones(())), axis_size=2
    )
    return f, [w]


@case(
    "`grad_states` naming a state the function does not use", ValueError, "does not use"
)
def grad_unused_state():
    w, unused = _w(), _w(name="unused")
    f = es.transform.grad(lambda: jnp.sum(w.value), grad_states=[w, unused])
    return f, [w, unused]


@case("a state created inside a loop body", es.NewStateError, "creates states")
def state_in_loop():
    body = lambda c, x: (es.State(x).name and c, x)  # noqa: E731
    return lambda: es.transform.scan(body, 0, jnp.arange(3.0)), []


@case("a `while_loop` condition that writes", ValueError, "condition may read states")
def while_cond_writes():
    w = es.State(jnp.array(0), name="w")

    def cond(x):
        w.value = w.value + 1
        return x < 3

    return lambda: es.transform.while_loop(cond, lambda x: x + 1, 0), [w]


@case("a `scan` body that does not return a pair", TypeError, "must return a pair")
def scan_not_pair():
    return lambda: es.transform.scan(lambda c, x: c, 0, jnp.arange(3)), []


@case(
    "`ifelse` with one condition per branch missing",
    ValueError,
    "one condition per branch",
)
def ifelse_counts():
    return lambda: es.transform.ifelse([True], [lambda: 1, lambda: 2]), []


@case("an array condition for `ifelse`", TypeError, r"condition 1 of shape \(2,\)")
def ifelse_array_condition():
    hits, hit = _counted_branch()
    conditions = [False, jnp.ones(2, bool)]
    ifelse = unchecked(es.transform.ifelse)
    return lambda: ifelse(conditions, [hit, hit], check_cond=False), [hits]


@case("an exception in the middle of a trace", RuntimeError, "mid-trace")
def exception_mid_trace():
    w = _w()

    def f():
        w.value = w.value + 1
        raise RuntimeError("mid-trace")

    return es.transform.jit(f), [w]


def _checkpoint_of(model, tamper):
    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "model.eqstate")
    es.save(path, model)
    tamper(path)
    return path


@case("loading a checkpoint that does not exist", es.CheckpointError, "does not exist")
def checkpoint_missing_file():
    model = {"w": _w()}
    return lambda: es.load("/nonexistent/model.eqstate", model), []


@case("loading a truncated checkpoint", es.CheckpointError, "truncated")
def checkpoint_truncated():
    model = {"w": _w()}

    def truncate(path):
        data = pathlib.Path(path).read_bytes()
        pathlib.Path(path).write_bytes(data[:-5])

    path = _checkpoint_of(model, truncate)
    return lambda: es.load(path, model), []


@case("loading a checkpoint with a flipped byte", es.CheckpointError, "corrupted")
def checkpoint_flipped_byte():
    model = {"w": _w()}

    def flip(path):
        data = bytearray(pathlib.Path(path).read_bytes())
        data[-3] ^= 0xFF
        pathlib.Path(path).write_bytes(bytes(data))

    path = _checkpoint_of(model, flip)
    return lambda: es.load(path, model), []


@case("loading a checkpoint that lacks a path", es.CheckpointError, "no entry")
def checkpoint_missing_path():
    path = _checkpoint_of({"w": _w()}, lambda p: None)
    return lambda: es.load(path, {"w": _w(), "extra": _w(name="extra")}), []


@case("loading a checkpoint with a wrong shape", es.CheckpointError, "shape")
def checkpoint_wrong_shape():
    path = _checkpoint_of({"w": _w()}, lambda p: None)
    return lambda: es.load(path, {"w": _w((4,))}), []


@case(
    "loading a checkpoint inside a jitted function",
    es.CheckpointError,
    "read once, while the function is traced",
)
def checkpoint_load_in_jit():
    model = {"w": _w()}
    path = _checkpoint_of(model, lambda p: None)
    return es.transform.jit(lambda: es.load(path, model)), [model["w"]]


@case(
    "saving an array that has been deleted (donated)",
    es.CheckpointError,
    r"`w` \(ParamState 'w'\): its value .* has been deleted",
)
def save_deleted_array():
    w = _w()
    stale = es.StateDict({w: jnp.ones(3)})
    stale[w].delete()
    path = os.path.join(tempfile.mkdtemp(), "model.eqstate")
    return lambda: es.save(path, stale), [w]


@case(
    "saving None as a state's value",
    es.CheckpointError,
    "Cannot save ParamState 'w': its value is None",
)
def save_none_value():
    w = _w()
    path = _checkpoint_of({"w": w}, lambda p: None)
    return lambda: es.save(path, {w: None}), [w]


@case(
    "saving text as a state's value",
    es.CheckpointError,
    r"ParamState 'w': its value holds 'hello' \(a str\)",
)
def save_text_value():
    w = _w()
    path = _checkpoint_of({"w": w}, lambda p: None)
    return lambda: es.save(path, {w: "hello"}), [w]


@case(
    "saving a Python float that `float32` cannot hold (64-bit types off)",
    es.CheckpointError,
    r"ParamState 'w': its value holds a Python float, .* 1e\+40 becomes inf",
)
def save_python_float_overflow():
    w = es.ParamState(jnp.zeros(()), name="w")
    path = _checkpoint_of({"w": w}, lambda p: None)
    return lambda: es.save(path, {w: 1e40}), [w]


@case(
    "saving a `float0` array (the gradient of an integer)",
    es.CheckpointError,
    r"`g` \(State 'g'\): .*dtype float0",
)
def save_float0():
    g = es.State(np.zeros(2, jax.dtypes.float0), name="g")
    path = os.path.join(tempfile.mkdtemp(), "model.eqstate")
    return lambda: es.save(path, es.values_of(g)), [g]


@case("an unknown checkpoint backend", ValueError, "Unknown checkpoint backend")
def checkpoint_unknown_backend():
    model = {"w": _w()}
    path = os.path.join(tempfile.mkdtemp(), "model")
    return lambda: es.save(path, es.values_of(model), backend="zip"), []


@case(
    "an Orbax save to a directory holding other files",
    es.CheckpointError,
    "holding 'notes.txt', not an Orbax checkpoint",
)
def orbax_save_over_other_files():
    w = _w()
    directory = tempfile.mkdtemp()
    pathlib.Path(directory, "notes.txt").write_text("precious")
    return lambda: es.save(directory, es.values_of(w), backend="orbax"), [w]


@case(
    "an Orbax save of an `int4` array",
    es.CheckpointError,
    r"dtype int4\) of State 'q' .* narrower than a byte",
)
def orbax_sub_byte_dtype():
    q = es.State(jnp.zeros(4, jnp.int4), name="q")
    path = os.path.join(tempfile.mkdtemp(), "model")
    return lambda: es.save(path, es.values_of(q), backend="orbax"), [q]


@case("an Orbax checkpoint with a flipped byte", es.CheckpointError, "corrupted")
def orbax_flipped_byte():
    model = {"w": es.ParamState(jnp.arange(1000.0), name="w")}
    path = os.path.join(tempfile.mkdtemp(), "model")
    es.save(path, model, backend="orbax")
    data = max(
        (p for p in pathlib.Path(path, "state").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    return lambda: es.load(path, model), [model["w"]]


@case("a checkpoint step that does not increase", es.CheckpointError, "must increase")
def manager_step_not_increasing():
    w = _w()
    manager = es.CheckpointManager(tempfile.mkdtemp(), async_save=False)
    manager.save(5, es.values_of(w))
    return lambda: manager.save(5, es.values_of(w)), [w]


@case(
    "resuming from a directory without checkpoints", es.CheckpointError, "No checkpoint"
)
def manager_nothing_to_resume():
    w = _w()
    manager = es.CheckpointManager(tempfile.mkdtemp())
    return lambda: manager.load(es.values_of(w)), [w]


@case("a checkpoint step that is not an integer", es.CheckpointError, "got Array")
def manager_step_not_integer():
    w = _w()
    manager = es.CheckpointManager(tempfile.mkdtemp(), async_save=False)
    return lambda: manager.save(jnp.array(1.5), es.values_of(w)), [w]


@case(
    "a checkpoint step whose path holds a user's file",
    es.CheckpointError,
    "Cannot save checkpoint 5 to .*: it is a file, not an Orbax checkpoint",
)
def manager_step_is_a_file():
    w = _w()
    directory = tempfile.mkdtemp()
    pathlib.Path(directory, "5").write_text("precious")
    manager = es.CheckpointManager(directory, async_save=False)
    return lambda: manager.save(5, es.values_of(w)), [w]


@case(
    "a checkpoint directory that is a file",
    es.CheckpointError,
    "Cannot keep checkpoints in .*: it is a file",
)
def manager_on_a_file():
    w = _w()
    path = os.path.join(tempfile.mkdtemp(), "run")
    pathlib.Path(path).write_text("precious")
    return lambda: es.CheckpointManager(path), [w]


@case(
    "a state split over a mesh axis that does not divide it",
    ValueError,
    "must be a multiple",
)
def shard_not_divisible():
    mesh = jax.make_mesh((len(jax.devices()),), ("x",), axis_types=(AxisType.Auto,))
    odd = es.ParamState(jnp.ones(len(jax.devices()) + 1), name="odd")
    return lambda: es.shard([odd], mesh, P("x")), [odd]


@case(
    "a replicated state written per device in `shard_map`",
    es.BatchAxisError,
    "differs across devices",
)
def shard_map_varying_write():
    mesh = jax.make_mesh((len(jax.devices()),), ("x",), axis_types=(AxisType.Auto,))
    s = es.State(jnp.array(0.0), name="s")
    f = es.transform.shard_map(
        lambda x: setattr(s, "value", x.sum()) or x,
        mesh=mesh,
        in_specs=(P("x"),),
        out_specs=P("x"),
    )
    return lambda: f(jnp.ones(len(jax.devices()))), [s]


def _mesh_x():
    return jax.make_mesh((len(jax.devices()),), ("x",), axis_types=(AxisType.Auto,))


@case("a `shard_map` spec naming an axis not in the mesh", ValueError, r"\['y'\]")
def shard_map_unknown_axis():
    s = es.State(jnp.zeros(len(jax.devices())), name="s")
    f = es.transform.shard_map(
        lambda x: setattr(s, "value", s.value + x) or x,
        mesh=_mesh_x(),
        in_specs=(P("x"),),
        out_specs=P("x"),
        state_specs=P("y"),
    )
    return lambda: f(jnp.ones(len(jax.devices()))), [s]


@case("`shard_map` with too few `in_specs`", ValueError, "has 1 entries")
def shard_map_in_specs_length():
    f = es.transform.shard_map(
        lambda x, y: x + y, mesh=_mesh_x(), in_specs=(P("x"),), out_specs=P("x")
    )
    x = jnp.ones(len(jax.devices()))
    return lambda: f(x, x), []


@case("a `shard_map` function called with keywords", TypeError, "positional")
def shard_map_keyword_arguments():
    f = es.transform.shard_map(
        lambda x: x, mesh=_mesh_x(), in_specs=(P("x"),), out_specs=P("x")
    )
    return lambda: f(x=jnp.ones(len(jax.devices()))), []


@case(
    "a draw inside `vmap` from an undeclared batch of keys",
    es.BatchAxisError,
    r"RandomState 'keys' .*holds a batch of keys of shape \(3,\)",
)
def vmap_draw_from_batched_keys():
    keys = es.RandomState(jax.random.split(jax.random.key(0), 3), name="keys")

    def draw(x):
        return x + jax.random.normal(keys.split_key())

    return lambda: es.transform.vmap(draw)(jnp.ones(3)), [keys]


@case("`eqx.filter_vmap`-style `in_axes` for `vmap`", TypeError, "ints and None")
def vmap_filter_vmap_axes():
    import equinox as eqx

    vmapped = es.transform.vmap(lambda x: x, in_axes=(eqx.if_array(0),))
    return lambda: vmapped(jnp.ones(2)), []


@case(
    "`cond` branches returning equal Python values of other types",
    TypeError,
    r"`false_fun` of `cond` returns 1 at `output.flag`, but `true_fun` of `cond` "
    r"returns True",
)
def cond_static_outputs_of_other_types():
    import equinox as eqx

    class Flagged(eqx.Module):
        flag: object  # a Python value: static

    s = es.State(jnp.array(0), name="s")

    def bump(flag):
        s.value = s.value + 1
        return Flagged(flag)

    return lambda: es.transform.cond(True, lambda: bump(True), lambda: bump(1)), [s]


@case(
    "`cond` branches returning different handles",
    TypeError,
    r"`false_fun` of `cond` returns State 'b' as its output, but `true_fun` of "
    r"`cond` returns State 'a'",
)
def cond_different_handles():
    a, b = es.State(jnp.array(0), name="a"), es.State(jnp.array(0), name="b")

    def pick(chosen):
        a.value = a.value + 1
        return chosen

    pred = jnp.array(True)
    return lambda: es.transform.cond(pred, lambda: pick(a), lambda: pick(b)), [a, b]


@case("a legacy uint32 key for a RandomState", TypeError, "typed PRNG key")
def legacy_key():
    return lambda: es.RandomState(jnp.zeros(2, jnp.uint32)), []


@case(
    "a legacy uint32 key for a RandomState, in a StateDict",
    es.StateValueError,
    r"RandomState 'rng' holds typed PRNG keys, but this StateDict gives it u32\[2\]",
)
def legacy_key_in_state_dict():
    rng = es.RandomState(0, name="rng")
    return lambda: es.StateDict({rng: jax.random.PRNGKey(1)}), [rng]


@case("a dropout rate outside [0, 1)", ValueError, "must be in")
def dropout_rate():
    return lambda: es.random.dropout_mask(1.5, (2,)), []


@case(
    "a complex input to a BatchNorm with real states",
    ValueError,
    r"complex64 input, but its LongTermState 'running_mean' is float32",
)
def batch_norm_complex_input():
    bn = enn.BatchNorm(2)
    x = jnp.ones((4, 2), jnp.complex64)
    return lambda: bn(x), es.states_of(bn)


@case(
    "a BatchNorm called per example inside `vmap`, as `eqx.nn.BatchNorm` is",
    ValueError,
    r"call it on the whole batch instead, outside `vmap`",
)
def batch_norm_per_example():
    bn = enn.BatchNorm(2)
    per_example = es.transform.vmap(bn, axis_name="batch")
    return lambda: per_example(jnp.ones((4, 2))), es.states_of(bn)


@case(
    "`abstracted_axes`, which JAX 0.10 cannot trace",
    NotImplementedError,
    "abstracted_axes",
)
def abstracted_axes():
    return lambda: es.transform.StatefulFunction(
        lambda x: x, abstracted_axes=({0: "n"},)
    ), []


@case("entering a scope twice", RuntimeError, "entered twice")
def scope_twice():
    sc = es.scope(es.StateDict())

    def trigger():
        with sc, sc:
            pass

    return trigger, []


@case("pickling a handle", TypeError, "Cannot pickle")
def pickle_handle():
    w = _w()
    return lambda: pickle.dumps(w), [w]


@case("setting an attribute of a handle", AttributeError, "handles are immutable")
def set_handle_attribute():
    w = _w()
    return lambda: setattr(w, "name", "other"), [w]


@case(
    "`eqstate.world()` inside a raw `jax.jit`",
    es.TraceContextError,
    r"Cannot read `eqstate.world\(\)`",
)
def world_in_raw_jit():
    w = _w()
    return lambda: jax.jit(lambda: es.world()[w])(), [w]


@case(
    "`assign` with a leaked tracer among good values",
    es.TraceContextError,
    "tracer to ParamState 'w'",
)
def assign_leaked_tracer():
    a, w = _w(name="a"), _w()
    return lambda: es.assign({a: jnp.ones(3), w: leak_a_tracer((3,))}), [a, w]


@case("`assign` of a deleted array", es.StateValueError, "has been deleted")
def assign_deleted_array():
    w = _w()
    dead = jnp.ones(3)
    dead.delete()
    return lambda: es.assign({w: dead}), [w]


@case(
    "a leaked tracer as a new state's value inside `scope`",
    es.TraceContextError,
    "already finished",
)
def new_state_leaked_tracer_in_scope():
    leaked = leak_a_tracer((3,))

    def trigger():
        with es.scope(es.StateDict()):
            es.State(leaked)

    return trigger, []


# Conditionals and loops.


def _counted_branch():
    hits = es.State(jnp.array(0), name="hits")

    def hit():
        hits.value = hits.value + 1
        return 1

    return hits, hit


@case("a complex predicate for `cond`", TypeError, "`cond` needs a boolean or real")
def cond_complex_pred():
    hits, hit = _counted_branch()
    return lambda: unchecked(es.transform.cond)(2j, hit, lambda: 0), [hits]


@case("None as the predicate of `cond`", TypeError, "`cond` got None")
def cond_none_pred():
    hits, hit = _counted_branch()
    return lambda: unchecked(es.transform.cond)(None, hit, lambda: 0), [hits]


@case("an array predicate for `cond`", TypeError, r"scalar predicate.*shape \(2,\)")
def cond_array_pred():
    hits, hit = _counted_branch()
    return lambda: unchecked(es.transform.cond)(jnp.ones(2, bool), hit, lambda: 0), [
        hits
    ]


@case("a float index for `switch`", TypeError, "integer branch index, got 1.5")
def switch_float_index():
    hits, hit = _counted_branch()
    return lambda: unchecked(es.transform.switch)(1.5, [hit, hit]), [hits]


@case(
    "a `bounded_while_loop` condition that writes",
    ValueError,
    "`cond_fun` of `bounded_while_loop` writes State 'w'",
)
def bounded_while_cond_writes():
    w = es.State(jnp.array(0), name="w")

    def cond(x):
        w.value = w.value + 1
        return x < 3

    return lambda: es.transform.bounded_while_loop(cond, lambda x: x + 1, 0, 5), [w]


@case(
    "a `bounded_while_loop` condition that writes, under `jax.disable_jit`",
    ValueError,
    "`cond_fun` of `bounded_while_loop` writes State 'w'",
)
def bounded_while_cond_writes_eagerly():
    w = es.State(jnp.array(0), name="w")

    def cond(x):
        w.value = w.value + 1
        return x < 3

    def trigger():
        with jax.disable_jit():
            es.transform.bounded_while_loop(cond, lambda x: x + 1, 0, 5)

    return trigger, [w]


@case("a fractional `max_steps`", TypeError, "`max_steps` must be a non-negative int")
def bounded_while_fractional_steps():
    loop = unchecked(es.transform.bounded_while_loop)
    return lambda: loop(lambda v: v < 3, lambda v: v + 1, 0, 2.5), []


@case("`for_loop` without operands", ValueError, "`for_loop` needs operands")
def for_loop_no_operands():
    return lambda: es.transform.for_loop(lambda: 1), []


@case("`scan` over a scalar", ValueError, r"`xs\['a'\]` is a scalar \(shape \(\)\)")
def scan_scalar_xs():
    body = lambda c, x: (c, x)  # noqa: E731
    return lambda: es.transform.scan(body, 0, {"a": jnp.float32(1.0)}), []


@case("`scan` over arrays of different lengths", ValueError, r"`xs\[0\]` has 2")
def scan_unequal_xs():
    body = lambda c, x: (c, x)  # noqa: E731
    return lambda: es.transform.scan(body, 0, (jnp.ones(2), jnp.ones(3))), []


@case("a `pbar` that is not a ProgressBar", TypeError, "`pbar` must be an")
def scan_bad_pbar():
    scan = unchecked(es.transform.scan)
    return lambda: scan(lambda c, x: (c, x), 0, jnp.ones(3), pbar="invalid"), []


@case(
    "a state created in an eager loop body", es.NewStateError, "body of `scan` creates"
)
def eager_loop_creates_state():
    def trigger():
        with jax.disable_jit():
            es.transform.scan(lambda c, x: (es.State(x).name and c, x), 0, jnp.ones(2))

    return trigger, []


@case(
    "a leaked tracer as a new state's value in `make_with_states`",
    es.TraceContextError,
    "already finished",
)
def new_state_leaked_tracer_make_with_states():
    leaked = leak_a_tracer((3,))
    return lambda: es.make_with_states(lambda: es.State(leaked))(), []


@case(
    "a StatefulFunction writing a leaked tracer",
    es.TraceContextError,
    "tracer to ParamState 'w'",
)
def stateful_function_writes_leaked_tracer():
    w = _w()
    leaked = leak_a_tracer((3,))
    return es.transform.StatefulFunction(lambda: setattr(w, "value", leaked)), [w]


@case(
    "`jit` of a function writing a leaked tracer",
    es.TraceContextError,
    "tracer to ParamState 'w'",
)
def jit_writes_leaked_tracer():
    w = _w()
    leaked = leak_a_tracer((3,))
    return es.transform.jit(lambda: setattr(w, "value", leaked)), [w]


# Transforms.


@case("`vmap` over a scalar argument", ValueError, "maps argument 0 along axis 0")
def vmap_scalar_argument():
    return lambda: es.transform.vmap(lambda x: x)(jnp.float32(1.0)), []


@case("`grad` with `has_aux` of a scalar output", TypeError, "must return a pair")
def grad_aux_not_pair():
    w = _w()
    f = es.transform.grad(lambda x: jnp.sum(w.value) * x, has_aux=True)
    return lambda: f(1.0), [w]


@case(
    "`grad` with `argnums` beyond the arguments",
    TypeError,
    r"`argnums=\(0, 3\)` needs argument 3",
)
def grad_argnums_out_of_range():
    return lambda: es.transform.grad(lambda x: x, argnums=(0, 3))(1.0), []


@case("`grad` with an argument named twice in `argnums`", ValueError, "more than once")
def grad_repeated_argnums():
    return lambda: es.transform.grad(lambda x, y: x * y, argnums=(0, -2))(1.0, 2.0), []


@case("`grad_states` naming an integer state", TypeError, "names State 'step'")
def grad_integer_state():
    step = es.State(jnp.array(0), name="step")

    def f(x):
        step.value = step.value + 1
        return x

    return lambda: es.transform.grad(f, grad_states=[step])(1.0), [step]


@case(
    "`grad_states` selecting no state the function uses, without `argnums`",
    ValueError,
    r"selects none of the floating-point states that loss uses.*nothing would be",
)
def grad_states_selecting_nothing():
    w = es.ParamState(jnp.ones(2), name="w")

    def loss(x):
        return jnp.sum(w.value * x)

    # A tag no state has: the gradients would be empty, and train nothing.
    return lambda: es.transform.grad(loss, grad_states="params")(jnp.ones(2)), [w]


@case("`vector_grad` of an integer state", TypeError, "names ParamState 'counts'")
def vector_grad_integer_state():
    counts = es.ParamState(jnp.array([1, 2]), name="counts")
    f = es.transform.vector_grad(
        lambda x: counts.value.astype(x.dtype) * x, grad_states=[counts]
    )
    return lambda: f(jnp.ones(2)), [counts]


@case("`grad` of a call without positional arguments", TypeError, "no positional")
def grad_no_positional():
    return lambda: es.transform.grad(lambda *, x=1.0: x)(x=2.0), []


@case("`jvp` with more tangents than primals", TypeError, "1 primals but 2 tangents")
def jvp_extra_tangents():
    return lambda: es.transform.jvp(lambda x: 2.0 * x, (1.0,), (1.0, 5.0)), []


@case(
    "`state_tangents` holding a state `jvp`'s function does not use",
    ValueError,
    r"`state_tangents` holds ParamState 'u'.*`check_states=False`",
)
def jvp_unused_state_tangent():
    w, u = _w(), _w(name="u")
    tangents = es.StateDict({u: jnp.ones(3)})
    return lambda: es.transform.jvp(
        lambda x: w.value * x, (1.0,), (1.0,), state_tangents=tangents
    ), [w, u]


@case(
    "an integer tangent for an integer state in `jvp`",
    TypeError,
    r"ParamState 'counts'.*`float0`",
)
def jvp_integer_tangent():
    counts = es.ParamState(jnp.array([1, 2]), name="counts")
    tangents = es.StateDict({counts: jnp.array([1, 1])})
    return lambda: es.transform.jvp(
        lambda: counts.value * 2, (), (), state_tangents=tangents
    ), [counts]


@case(
    "a floating-point tangent for an integer argument of `jvp`",
    TypeError,
    r"dtype float32 for primals\[1\]\['n'\].*integer.*`float0`",
)
def jvp_float_tangent_for_an_integer():
    w = _w()

    def f(x, options):
        w.value = w.value + x
        return x * options["n"]

    primals = (jnp.ones(3), {"n": jnp.array(3)})
    tangents = (jnp.ones(3), {"n": jnp.array(1.0)})
    return lambda: es.transform.jvp(f, primals, tangents), [w]


@case(
    "`apply_updates` with an update to a state the model does not hold",
    es.StateValueError,
    r"ParamState 'teacher', which `model` does not hold.*trainable",
)
def apply_updates_foreign_state():
    w, teacher = _w((2,)), _w((2,), name="teacher")
    updates = es.StateDict({w: jnp.ones(2), teacher: jnp.ones(2)})
    return lambda: es.apply_updates({"w": w}, (updates, None)), [w, teacher]


@case(
    "`apply_updates` with an update of another shape than its state",
    es.StateValueError,
    r"shape \(3,\) .* ParamState 'w' .*\(1, 3\)",
)
def apply_updates_wrong_shape():
    w = _w((1, 3))
    updates = es.StateDict({w: jnp.ones(3)})
    return lambda: es.apply_updates({"w": w}, (updates, None)), [w]


@case(
    "`apply_updates` with a complex update to a real state",
    es.StateValueError,
    r"complex64 to ParamState 'w' \(dtype float32\).*imaginary",
)
def apply_updates_complex_to_real():
    w = _w((2,))
    updates = es.StateDict({w: jnp.array([1j, 2j])})
    return lambda: es.apply_updates({"w": w}, (updates, None)), [w]


@case(
    "`apply_updates` with a fractional update to an integer state",
    es.StateValueError,
    r"float32 to ShortTermState 'n' \(dtype int32\).*fraction",
)
def apply_updates_float_to_int():
    n = es.ShortTermState(jnp.array([0, 1]), name="n")
    updates = es.StateDict({n: jnp.array([0.7, 0.7])})
    return lambda: es.apply_updates({"n": n}, (updates, None)), [n]


@case(
    "`apply_updates` with a wider integer update to an integer state",
    es.StateValueError,
    r"dtype int32 to ShortTermState 'n' \(dtype uint8\).*wrap around",
)
def apply_updates_wider_int():
    n = es.ShortTermState(jnp.array([250, 1], jnp.uint8), name="n")
    updates = es.StateDict({n: jnp.array([10, -2], jnp.int32)})
    return lambda: es.apply_updates({"n": n}, (updates, None)), [n]


@case("`jit` donating an argument the function lacks", ValueError, r"donate_argnums")
def jit_donate_out_of_range():
    return lambda: es.transform.jit(lambda x: x, donate_argnums=5), []


@case("`jit` of a generator function", TypeError, "got a generator function")
def jit_generator():
    def numbers(x):
        yield x

    return lambda: es.transform.jit(numbers), []


@case("`jit` with a static name the function lacks", ValueError, "invalid argnames")
def jit_unknown_static_name():
    return lambda: es.transform.jit(lambda x: x, static_argnames="y"), []


# Random numbers: the default key must not move.


@case("`choice` of more than it has without replacement", ValueError, "larger sample")
def sampler_choice_too_many():
    return lambda: es.random.choice(3, (5,), replace=False), [es.random.DEFAULT]


@case("`normal` of an integer dtype", ValueError, "must be a float or complex dtype")
def sampler_normal_int_dtype():
    return lambda: es.random.normal((2,), jnp.int32), [es.random.DEFAULT]


@case("`randint` of a float dtype", TypeError, "randint only accepts integer dtypes")
def sampler_randint_float_dtype():
    return lambda: es.random.randint((2,), 0, 5, jnp.float32), [es.random.DEFAULT]


@case("`categorical` along a missing axis", ValueError, "`axis=4` is out of range")
def sampler_categorical_axis():
    return lambda: es.random.categorical(jnp.zeros(3), axis=4), [es.random.DEFAULT]


@case("a sampler with a negative shape", ValueError, "must not have negative sizes")
def sampler_negative_shape():
    return lambda: es.random.normal(-1), [es.random.DEFAULT]


@case(
    "a sampler parameter that does not fit `shape`",
    ValueError,
    r"`minval` of shape \(3,\) does not broadcast",
)
def sampler_parameter_shape():
    return lambda: es.random.uniform((2,), minval=jnp.zeros(3)), [es.random.DEFAULT]


@case(
    "`uniform(low, high, size)`, NumPy's and brainstate's call",
    TypeError,
    r"Write `eqstate\.random\.uniform\(size, minval=low, maxval=high\)`",
)
def sampler_numpy_style():
    uniform = unchecked(es.random.uniform)
    return lambda: uniform(-1.0, 1.0, (3,)), [es.random.DEFAULT]


@case("`split_key` of a negative count", ValueError, "negative number of keys")
def split_key_negative():
    return lambda: es.random.split_key(-5), [es.random.DEFAULT]


@case("text as a random seed", TypeError, "pass an integer seed or a key")
def seed_text():
    return lambda: unchecked(es.random.DEFAULT.seed)("abc"), [es.random.DEFAULT]


@case("text as a RandomState's seed", TypeError, "pass an integer seed or a key")
def random_state_text():
    return lambda: unchecked_new(es.RandomState, "abc"), []


# States, assignment and checkpoints.


@case("a state name that is not a string", TypeError, "`name` must be a string")
def state_name_not_text():
    return lambda: unchecked_new(es.State, jnp.zeros(2), name=3), []


@case("`es.assign` of a list", TypeError, "`eqstate.assign` takes a StateDict")
def assign_not_mapping():
    return lambda: unchecked(es.assign)([1, 2]), []


@case(
    "`es.assign` of updates shaped like `es.trainable(model)`",
    TypeError,
    r"shaped like `eqstate.trainable\(model\)`: apply .*eqstate.apply_updates",
)
def assign_trainable_pair():
    w = _w()
    return lambda: unchecked(es.assign)(es.trainable({"w": w})), [w]


@case(
    "`apply_updates` with updates shaped like `es.values_of(model)`",
    TypeError,
    "`eqstate.apply_updates\\(model, updates\\)` takes updates shaped like",
)
def apply_updates_state_dict_alone():
    w = _w()
    return lambda: es.apply_updates({"w": w}, es.values_of(w)), [w]


@case(
    "an optimiser state of one training style written with the other's",
    es.StateValueError,
    r"shaped like `eqstate.trainable\(model\)` to LongTermState 'opt_state', whose "
    r"value is shaped like `eqstate.values_of\(model, eqstate.ParamState\)`",
)
def write_other_training_style():
    w = _w()
    opt_state = es.LongTermState([es.values_of(w, es.ParamState)], name="opt_state")
    new = [es.trainable({"w": w})]
    return lambda: setattr(opt_state, "value", new), [w, opt_state]


@case("`es.save` of None", TypeError, "holds neither")
def save_not_mapping():
    path = os.path.join(tempfile.mkdtemp(), "model.eqstate")
    return lambda: unchecked(es.save)(path, None), []


def _mixed(key=0):
    return {"linear": eqx.nn.Linear(2, 2, key=jax.random.key(key)), "w": _w()}


@case(
    "saving the states alone from a model that also holds arrays",
    es.CheckpointError,
    r"states alone from `model`: it also holds 2 arrays, `linear\.weight`",
)
def save_states_alone_of_mixed_model():
    model = _mixed()
    path = os.path.join(tempfile.mkdtemp(), "model.eqstate")
    return lambda: es.save(path, es.values_of(model), model=model), [model["w"]]


@case(
    "loading a checkpoint of a model's states alone into the whole model",
    es.CheckpointError,
    r"(?s)no entry `linear\.weight`, `linear\.bias`.*lacks arrays of the model",
)
def load_states_alone_into_mixed_model():
    model = _mixed()
    path = os.path.join(tempfile.mkdtemp(), "states.eqstate")
    es.save(path, es.values_of(model), model=eqx.filter(model, es.is_state))
    fresh = _mixed(1)
    fresh["w"].value = jnp.ones(3)
    return lambda: es.load(path, fresh), [fresh["w"]]


@case(
    "`es.assign` of the model `es.load` returns",
    TypeError,
    r"returns the model.*`model = eqstate\.load\(path, model\)`",
)
def assign_loaded_model():
    model = _mixed()
    path = _checkpoint_of(model, lambda p: None)
    return lambda: es.assign(es.load(path, model)), [model["w"]]


@case(
    "a checkpoint header nested too deeply",
    es.CheckpointError,
    "nests JSON values too deeply",
)
def checkpoint_deep_header():
    model = {"w": _w()}

    def nest(path):
        header = b"[" * 100_000 + b"]" * 100_000
        head = struct.pack("<8sIQ", b"\x93EQSTATE", 1, len(header)) + header
        pathlib.Path(path).write_bytes(head + struct.pack("<I", zlib.crc32(head)))

    path = _checkpoint_of(model, nest)
    return lambda: es.load(path, model), []


@case(
    "a checkpoint whose header claims more than the file holds",
    es.CheckpointError,
    "truncated",
)
def checkpoint_claims_too_much():
    model = {"w": _w()}

    def claim(path):
        with open(path, "r+b") as f:
            f.seek(12)
            f.write(struct.pack("<Q", 2**62))

    path = _checkpoint_of(model, claim)
    return lambda: es.load(path, model), []


@case("a large file that is not a checkpoint", es.CheckpointError, "not an eqstate")
def checkpoint_not_one():
    model = {"w": _w()}

    def replace(path):
        with open(path, "wb") as f:
            f.truncate(2**26)  # sparse: cheap to make, 64 MiB to read whole

    path = _checkpoint_of(model, replace)
    return lambda: es.load(path, model), []


@case("`copy.deepcopy` of a handle", TypeError, r"Cannot deep-copy .*eqstate.clone")
def deepcopy_handle():
    w = _w()
    return lambda: copy.deepcopy({"w": w}), [w]


@case("`es.member` with an index out of range", IndexError, r"Member 4 .* \[-4, 4\)")
def member_out_of_range():
    w = es.ParamState(jnp.zeros((4, 3)), name="w")
    return lambda: es.member(w, 4), [w]


@case(
    "`es.member` of an ensemble with an unstacked state not in `shared`",
    ValueError,
    r"State 'lr' holds f32\[\], which has no leading member axis.*shared=",
)
def member_unstacked_state():
    w = es.ParamState(jnp.zeros((4, 3)), name="w")
    lr = es.State(jnp.array(0.1), name="lr")
    return lambda: es.member({"w": w, "lr": lr}, 0), [w, lr]


@case(
    "a batched input to an RNN cell whose hidden state has another batch",
    ValueError,
    r"GRUCell\(input_size=2, hidden_size=3\) got an input of shape \(8, 2\).*reset",
)
def cell_batch_mismatch():
    cell = enn.GRUCell(2, 3)
    return lambda: cell(jnp.ones((8, 2))), es.states_of(cell)


@case(
    "changing the batch of an RNN cell inside a transform",
    es.StateValueError,
    r"Cannot give ShortTermState 'hidden' \(f32\[3\]\) the value f32\[8,3\] inside",
)
def cell_reset_batch_in_transform():
    cell = enn.LSTMCell(2, 3)
    return lambda: es.transform.jit(lambda: cell.reset(batch_size=8))(), es.states_of(
        cell
    )


@case(
    "`init_states` changing a shape inside a transform",
    es.StateValueError,
    r"Cannot give ShortTermState 'h' \(f32\[3\]\) the value f32\[4\] inside an eqstate",
)
def init_states_in_transform():
    h = es.ShortTermState(jnp.zeros(3), name="h")
    return es.transform.jit(lambda: es.init_states({h: jnp.zeros(4)})), [h]


@case(
    "`checkpointed_scan` with a `base` below 2", ValueError, "`base` must be at least 2"
)
def checkpointed_scan_small_base():
    h = es.State(jnp.zeros(()), name="h")

    def body(c, x):
        h.value = h.value + x
        return c, x

    return lambda: es.transform.checkpointed_scan(body, 0, jnp.ones(3), base=1), [h]


@case(
    "`checkpointed_for_loop` with a `base` that is not an integer",
    TypeError,
    "`base` must be an integer",
)
def checkpointed_for_loop_float_base():
    loop = unchecked(es.transform.checkpointed_for_loop)
    return lambda: loop(lambda x: x, jnp.ones(3), base=2.5), []


@case(
    "`checkpointed_scan` with a `bool` as its `base`",
    TypeError,
    r"`base` must be an integer of at least 2, or None, got True",
)
def checkpointed_scan_bool_base():
    return lambda: es.transform.checkpointed_scan(
        lambda c, x: (c, x), 0, jnp.ones(3), base=True
    ), []


@case(
    "a state created in a `checkpointed_scan` body",
    es.NewStateError,
    "body of `checkpointed_scan` creates states",
)
def checkpointed_scan_creates_state():
    body = lambda c, x: (es.State(x).name and c, x)  # noqa: E731
    return lambda: es.transform.checkpointed_scan(body, 0, jnp.arange(30.0)), []


@case("`map` with a `batch_size` of 0", ValueError, "positive integer, got 0")
def map_zero_batch_size():
    return lambda: es.transform.map(lambda x: x, jnp.ones(3), batch_size=0), []


@case(
    "`map` with a `batch_size` that is not an integer",
    TypeError,
    "`batch_size` must be a positive integer or None",
)
def map_float_batch_size():
    batched = unchecked(es.transform.map)
    return lambda: batched(lambda x: x, jnp.ones(3), batch_size=1.5), []


@case(
    "`map` with a `batch_size` of `True`",
    TypeError,
    "`batch_size` must be a positive integer or None, got True",
)
def map_bool_batch_size():
    return lambda: es.transform.map(lambda x: x, jnp.ones(3), batch_size=True), []


@case(
    "a `ProgressBar` with a `freq` that is not an integer",
    TypeError,
    "`freq` must be a positive integer or None, got 0.5",
)
def progress_bar_float_freq():
    return lambda: unchecked_new(es.transform.ProgressBar, freq=0.5), []


@case(
    "a `ProgressBar` with a string `freq`",
    TypeError,
    "`freq` must be a positive integer or None, got '2'",
)
def progress_bar_string_freq():
    return lambda: unchecked_new(es.transform.ProgressBar, freq="2"), []


@case("a `ProgressBar` with a `freq` of 0", ValueError, "positive integer, got 0")
def progress_bar_zero_freq():
    return lambda: es.transform.ProgressBar(freq=0), []


@case(
    "a batched `map` whose elements depend on each other through a state",
    ValueError,
    "State 'count' may carry a value from one element to the next",
)
def map_batched_carried_state():
    count = es.State(jnp.array(0), name="count")

    def f(x):
        count.value = count.value + 1
        return x

    return lambda: es.transform.map(f, jnp.ones(4), batch_size=2), [count]


@case("`map` without arrays", ValueError, "`map` needs arrays to map over")
def map_no_arrays():
    return lambda: es.transform.map(lambda: 1), []


@case(
    "`validate_states` after a state changed shape",
    es.StateValueError,
    r"ShortTermState 'h': traced with f32\[3\], now f32\[4\]",
)
def validate_states_changed():
    h = es.ShortTermState(jnp.zeros(3), name="h")
    sf = es.transform.StatefulFunction(lambda: h.value * 2)
    sf.make_jaxpr()

    def trigger():
        with es.scope(es.StateDict({h: jnp.zeros(4)})):
            sf.validate_states()

    return trigger, [h]


@case(
    "`debug_call` with the wrong number of values",
    ValueError,
    r"touches 1 state\(s\), but `debug_call` got 2 value",
)
def debug_call_count():
    n = es.State(jnp.array(0), name="n")
    sf = es.transform.StatefulFunction(lambda: n.value + 1)
    return lambda: sf.debug_call([jnp.array(1), jnp.array(2)]), [n]


@case("`debug_call` with a dict of values", TypeError, "Wrap it: `eqstate.StateDict")
def debug_call_dict():
    n = es.State(jnp.array(0), name="n")
    sf = es.transform.StatefulFunction(lambda: n.value + 1)
    return lambda: unchecked(sf.debug_call)({n: jnp.array(1)}), [n]


@case(
    "`vector_grad` with `has_aux` of an output that is not a pair",
    TypeError,
    "must return a pair",
)
def vector_grad_aux_not_pair():
    w = _w()
    f = es.transform.vector_grad(lambda: w.value * 2, grad_states=[w], has_aux=True)
    return f, [w]


# Numbers, sizes and flags of the wrong type: each named, with what to pass.


@case(
    "a dropout rate given as text",
    TypeError,
    r"Dropout's `p` must be a probability in \[0, 1\), got '0.5' \(a str\)",
)
def dropout_text_rate():
    return lambda: unchecked_new(enn.Dropout, "0.5"), []


@case(
    "a layer's flag given as text",
    TypeError,
    "BatchNorm's `inference` must be True or False, got 'no'",
)
def layer_text_flag():
    return lambda: unchecked_new(enn.BatchNorm, 3, inference="no"), []


@case(
    "`inference` given as text to a layer's call",
    TypeError,
    "Dropout's `inference` must be True or False, or None, got 'yes'",
)
def layer_call_text_flag():
    dropout = enn.Dropout(0.5)
    return lambda: unchecked(dropout.__call__)(jnp.ones(3), inference="yes"), []


@case(
    "a `bool` as a layer's size",
    TypeError,
    r"BatchNorm's `num_features` must be a positive integer, got True \(a bool\)",
)
def layer_bool_size():
    return lambda: enn.BatchNorm(True), []


@case(
    "a fractional size for an RNN cell",
    TypeError,
    "GRUCell's `hidden_size` must be a positive integer, got 3.5",
)
def cell_fractional_size():
    return lambda: unchecked_new(enn.GRUCell, 2, 3.5), []


@case(
    "a `bool` as an RNN cell's `batch_size`",
    TypeError,
    "LSTMCell's `batch_size` must be a positive integer or a tuple of them, got True",
)
def cell_bool_batch_size():
    cell = enn.LSTMCell(2, 3)
    return lambda: cell.reset(batch_size=True), es.states_of(cell)


@case(
    "a BatchNorm `momentum` given as text",
    TypeError,
    r"BatchNorm's `momentum` must be a real number in \[0, 1\], got '0.9'",
)
def batch_norm_text_momentum():
    return lambda: unchecked_new(enn.BatchNorm, 3, momentum="0.9"), []


@case("a NaN BatchNorm `eps`", ValueError, "BatchNorm's `eps` must be non-negative")
def batch_norm_nan_eps():
    return lambda: enn.BatchNorm(3, eps=float("nan")), []


@case("`True` as a random seed", TypeError, "pass an integer seed .*got True")
def seed_bool():
    return lambda: es.random.seed(True), [es.random.DEFAULT]


@case("`split_key` of `True`", TypeError, "takes a non-negative integer `n`.*got True")
def split_key_bool():
    return lambda: es.random.split_key(True), [es.random.DEFAULT]


@case(
    "`es.member` with an index that is not an integer",
    TypeError,
    "`eqstate.member`'s `index` must be an integer, got '0'",
)
def member_text_index():
    w = es.ParamState(jnp.zeros((2, 3)), name="w")
    return lambda: unchecked(es.member)([w], "0"), [w]


@case(
    "`states_of` with `with_paths` given as text",
    TypeError,
    "`states_of`'s `with_paths` must be True or False, got 'yes'",
)
def states_of_text_flag():
    w = _w()
    return lambda: unchecked(es.states_of)([w], with_paths="yes"), [w]


@case(
    "`WithTag` of a value that is not a string",
    TypeError,
    "`WithTag`'s `tag` must be a string, got 3",
)
def filter_tag_not_text():
    return lambda: unchecked_new(es.filters.WithTag, 3), []


@case(
    "`Is` of a value that is not a handle",
    TypeError,
    "`Is` takes a state handle, got 'w'",
)
def filter_is_not_handle():
    return lambda: unchecked_new(es.filters.Is, "w"), []


@case(
    "`in_states` with a `bool` as an axis",
    TypeError,
    r"must map integer axes to filters.*got keys \[True\]",
)
def vmap_bool_state_axis():
    w = es.State(jnp.zeros(2), name="w")
    return lambda: es.transform.vmap(lambda: w.value, in_states={True: w}), [w]


@case(
    "`static_argnums` of `True`",
    TypeError,
    "`static_argnums` must be an integer or a sequence of them, got True",
)
def static_argnums_bool():
    return lambda: es.transform.StatefulFunction(lambda x: x, static_argnums=True), []


@case(
    "`scan` with a `bool` as its `length`",
    TypeError,
    "`length` must be a non-negative integer, got True",
)
def scan_bool_length():
    return lambda: es.transform.scan(lambda c, x: (c, x), 0, None, length=True), []


@case(
    "`bounded_while_loop` with a `bool` as its `max_steps`",
    TypeError,
    "`max_steps` must be a non-negative integer, got True",
)
def bounded_while_bool_steps():
    loop = es.transform.bounded_while_loop
    return lambda: loop(lambda c: c < 3, lambda c: c + 1, 0, max_steps=True), []


@case(
    "`scan` with an `unroll` given as text",
    TypeError,
    "`unroll` must be a non-negative integer or a bool, got '2'",
)
def scan_text_unroll():
    scan = unchecked(es.transform.scan)
    return lambda: scan(lambda c, x: (c, x), 0, jnp.ones(3), unroll="2"), []


@case(
    "`scan` with a `reverse` given as text",
    TypeError,
    "`reverse` must be True or False, got 'yes'",
)
def scan_text_reverse():
    scan = unchecked(es.transform.scan)
    return lambda: scan(lambda c, x: (c, x), 0, jnp.ones(3), reverse="yes"), []


@case(
    "a `ProgressBar` with a `width` given as text",
    TypeError,
    "`width` must be a non-negative integer, got '30'",
)
def progress_bar_text_width():
    return lambda: unchecked_new(es.transform.ProgressBar, width="30"), []


@case(
    "`vmap_new_states` with a `state_tag` that is not a string",
    TypeError,
    "`state_tag` must be a string or None, got 3",
)
def new_states_tag_not_text():
    build = unchecked(es.transform.vmap_new_states)
    return lambda: build(lambda: es.State(1.0), axis_size=2, state_tag=3), []


@case(
    "`jaxpr_call` with a number for its state values",
    TypeError,
    "`jaxpr_call` takes a StateDict or a sequence of values, got 3",
)
def jaxpr_call_not_values():
    n = es.State(jnp.array(0), name="n")
    sf = es.transform.StatefulFunction(lambda: n.value + 1)
    return lambda: unchecked(sf.jaxpr_call)(3), [n]


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_gets_a_clear_error_and_changes_nothing(name):
    error, match = globals()[name].expected
    trigger, states = globals()[name]()
    before = [s.value for s in states]
    with pytest.raises(error, match=match):
        trigger()
    assert tree_bitwise_equal([s.value for s in states], before)


def test_the_docs_table_lists_every_case():
    rows = re.findall(
        r"^\| `(\w+)` \| (.+?) \| `(\w+)` \|", _DOC.read_text(), re.MULTILINE
    )
    assert len(CASES) >= 30
    documented = {name: (description, error) for name, description, error in rows}
    expected = {name: (d, e.__name__) for name, (d, e, _) in CASES.items()}
    assert documented == expected
