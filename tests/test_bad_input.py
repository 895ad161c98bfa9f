"""Every bad input in `docs/bad-input.md`, each a test: the error it gets, and every
state left as it was. The page's table and `CASES` must list the same cases."""

import copy
import os
import pathlib
import pickle
import re
import tempfile

import eqstate as es
import eqstate.nn as enn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from .helpers import leak_a_tracer, tree_bitwise_equal


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


@case("a handle passed as an argument", TypeError, "received ParamState 'w'")
def handle_as_argument():
    w = _w()
    return lambda: es.transform.jit(lambda s: s.value)(w), [w]


@case("a pre-existing handle returned", TypeError, "returned ParamState 'w'")
def handle_as_output():
    w = _w()
    return lambda: es.transform.StatefulFunction(lambda: w)(), [w]


@case("an unhashable static argument", TypeError, "unhashable static argument 1")
def unhashable_static():
    sf = es.transform.StatefulFunction(lambda x, n: x, static_argnums=1)
    return lambda: sf(1.0, [1]), []


@case("`static_argnums` out of range", ValueError, "`static_argnums` holds 2")
def static_out_of_range():
    sf = es.transform.StatefulFunction(lambda x: x, static_argnums=2)
    return lambda: sf(1.0), []


@case("`jaxpr_call` with the wrong number of values", ValueError, "touches 1 state")
def jaxpr_call_count():
    w = _w()
    sf = es.transform.StatefulFunction(lambda: w.value).make_jaxpr()
    return lambda: sf.jaxpr_call([w.value, w.value]), [w]


@case("`jaxpr_call` with a None value", ValueError, "is None")
def jaxpr_call_none():
    w = _w()
    sf = es.transform.StatefulFunction(lambda: w.value).make_jaxpr()
    return lambda: sf.jaxpr_call([None]), [w]


@case("`jaxpr_call` with a wrongly shaped value", ValueError, r"is f32\[5\]")
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


@case(
    "an unknown cache key", es.UnknownCacheKeyError, "no compilation for the cache key"
)
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


@case("a StateDict key that is not a handle", TypeError, "StateDict")
def state_dict_bad_key():
    return lambda: es.StateDict({"w": jnp.zeros(2)}), []


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


@case("a state created inside a loop body", ValueError, "creates states")
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
    es.save(path, es.values_of(model), model=model)
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
    ValueError,
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


@case("a legacy uint32 key for a RandomState", TypeError, "typed PRNG key")
def legacy_key():
    return lambda: es.RandomState(jnp.zeros(2, jnp.uint32)), []


@case("a dropout rate outside [0, 1)", ValueError, "must be in")
def dropout_rate():
    return lambda: es.random.dropout_mask(1.5, (2,)), []


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
    "`es.assign` given something that is not a mapping", TypeError, "takes a StateDict"
)
def assign_not_a_mapping():
    w = _w()
    return lambda: es.assign(jnp.ones(3)), [w]


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
    ValueError,
    r"Cannot change the batch shape of the hidden state of LSTMCell.*\(\) to \(8,\)",
)
def cell_reset_batch_in_transform():
    cell = enn.LSTMCell(2, 3)
    return lambda: es.transform.jit(lambda: cell.reset(batch_size=8))(), es.states_of(
        cell
    )


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
