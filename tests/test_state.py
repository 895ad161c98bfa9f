import copy
import gc
import pickle
import re
import typing
import warnings
import weakref

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from beartype import beartype
from beartype.roar import BeartypeCallHintParamViolation
from jaxtyping import Array, Float

from .helpers import leak_a_tracer


KINDS = [
    es.State,
    es.ShortTermState,
    es.LongTermState,
    es.ParamState,
    es.NonBatchState,
]


@pytest.mark.parametrize("kind", KINDS)
def test_handle_reads_and_writes_its_world_value(kind):
    s = kind(jnp.zeros(3), name="s")
    s.value = s.value + 2
    assert (s.value == 2).all()
    assert isinstance(s, es.State) and es.is_state(s)


def test_handles_hash_and_compare_by_identity():
    a = es.State(jnp.zeros(2))
    b = es.State(jnp.zeros(2))
    assert a == a and a != b
    assert len({a, b, a}) == 2
    assert hash(a) == hash(a)

    class EqualToAll:
        def __eq__(self, other: object) -> bool:
            return True

    # A handle answers `==` itself rather than deferring to the other object.
    assert not a == EqualToAll()


def test_handles_sort_in_creation_order_so_dicts_keyed_by_them_are_pytrees():
    a = es.State(jnp.zeros(2), name="a")
    b = es.State(jnp.ones(3), name="b")
    assert sorted([b, a]) == [a, b] and a < b and b > a and not b < a
    with pytest.raises(TypeError):
        _ = a < 1  # pyright: ignore[reportOperatorIssue]
    # JAX sorts dict keys: two handles used to fail ("Comparator raised exception").
    updates = {b: jnp.full(3, 2.0), a: jnp.full(2, 5.0)}
    assert jtu.tree_structure(updates) == jtu.tree_structure({a: 0, b: 0})
    doubled = jax.tree.map(lambda x: 2 * x, updates)
    assert (doubled[a] == 10).all() and (doubled[b] == 4).all()
    es.transform.jit(es.assign)(updates)
    assert (a.value == 5).all() and (b.value == 2).all()
    es.transform.jit(lambda d: es.assign(d))({a: jnp.ones(2), b: jnp.zeros(3)})
    assert (a.value == 1).all() and (b.value == 0).all()
    assert jax.jit(lambda d: d[a] + 1)(updates).tolist() == [6.0, 6.0]


def test_handle_is_a_pytree_leaf():
    s = es.ParamState(jnp.zeros(2))
    tree = {"a": s, "b": [s, 1.0]}
    leaves = jtu.tree_leaves(tree)
    assert leaves[0] is s and leaves[1] is s
    assert jtu.tree_map(lambda x: x, tree)["a"] is s


def test_handle_is_immutable():
    s = es.ParamState(jnp.zeros(2), name="w", tag="t")
    with pytest.raises(AttributeError, match="handles are immutable"):
        s.name = "other"  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(AttributeError, match="handles are immutable"):
        s.anything = 1  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(AttributeError, match="Cannot delete"):
        del s.value
    assert s.name == "w" and s.tag == "t"


def test_copy_keeps_identity_and_deepcopy_points_to_clone():
    s = es.State(jnp.zeros(2), name="s")
    assert copy.copy(s) is s
    assert copy.copy({"s": s})["s"] is s
    with pytest.raises(TypeError, match=r"Cannot deep-copy State 's'.*eqstate.clone"):
        copy.deepcopy({"s": s})


def test_pickling_a_handle_is_refused():
    s = es.State(jnp.zeros(2), name="w")
    with pytest.raises(TypeError, match="Cannot pickle State 'w'"):
        pickle.dumps(s)


def test_handle_is_weakly_referenceable_and_a_collected_handle_frees_its_value():
    s = es.State(jnp.zeros(2))
    ref, value = weakref.ref(s), weakref.ref(s.value)
    gc.collect()
    assert value() is not None  # the world holds it for the handle
    del s
    gc.collect()
    assert ref() is None and value() is None


def test_initial_value_leaves_become_arrays():
    s = es.State({"a": 1.0, "b": [2, jnp.ones(2)]})
    value = s.value
    assert isinstance(value["a"], jax.Array) and isinstance(value["b"][0], jax.Array)


def test_write_with_wrong_shape_names_the_state():
    w = es.ParamState(jnp.zeros(3), name="w")
    with pytest.raises(ValueError, match=r"shape \(4,\) .* to ParamState 'w'"):
        w.value = jnp.zeros(4)
    assert w.value.shape == (3,)


def test_write_with_wrong_dtype_names_the_state():
    w = es.ParamState(jnp.zeros(3), name="w")
    with pytest.raises(es.StateValueError, match="dtype int32 to ParamState 'w'"):
        w.value = jnp.zeros(3, jnp.int32)


def test_write_with_wrong_structure_names_the_state():
    w = es.ParamState({"a": jnp.zeros(3)}, name="w")
    with pytest.raises(ValueError, match=r"structure .* ParamState 'w'"):
        w.value = (jnp.zeros(3),)
    assert set(w.value) == {"a"}


def test_python_scalars_take_the_state_dtype_when_promotion_allows():
    f = es.State(jnp.zeros((), jnp.float16))
    f.value = 1
    assert f.value.dtype == jnp.float16
    i = es.State(jnp.zeros((), jnp.int32), name="i")
    with pytest.raises(ValueError, match="State 'i'"):
        i.value = 0.5
    assert i.value.dtype == jnp.int32


def _write_value(s, value, how):
    """Writes `value` to `s` eagerly, with `StateDict.set`, `es.assign` or in a
    `scope`."""
    if how == "eager":
        s.value = value
    elif how == "StateDict.set":
        es.values_of(s).set(s, value)
    elif how == "assign":
        es.assign({s: value})
    else:
        with es.scope(es.values_of(s)):
            s.value = value


_HOW = ["eager", "StateDict.set", "assign", "scope"]


@pytest.mark.parametrize("how", _HOW)
@pytest.mark.parametrize(
    "dtype, number, wrapped",
    [("uint8", 300, 44), ("uint8", -1, 255), ("int8", 200, -56), ("uint8", 256, 0)],
)
def test_a_python_int_the_state_dtype_cannot_hold_is_refused(
    how, dtype, number, wrapped
):
    u = es.State(jnp.array(5, dtype), name="u")
    with pytest.raises(
        es.StateValueError,
        match=rf"State 'u' the value {number} as {dtype}: .*become {wrapped}\)",
    ):
        _write_value(u, number, how)
    assert u.value == 5
    for fits in (jnp.iinfo(dtype).min, jnp.iinfo(dtype).max):
        _write_value(u, int(fits), how)
    u.value = jnp.asarray(number).astype(dtype)  # Wrapping on purpose.
    assert u.value == wrapped


@pytest.mark.parametrize("how", _HOW)
@pytest.mark.parametrize(
    "dtype, number, broken",
    [("uint8", 300, "44"), ("uint8", -1, "255"), ("float16", 70000.0, "inf")],
)
def test_an_array_made_from_a_python_number_the_state_cannot_hold_is_refused(
    how, dtype, number, broken
):
    # `jnp.asarray(300)` is weakly typed, as the number it was made from, and so is the
    # value of a StateDict or a state made from `300`: each would take the state's
    # dtype, and break, as the number itself would.
    u = es.State(jnp.array(5, dtype), name="u")
    made = [
        jnp.asarray(number),
        es.StateDict({u: number})[u],
        es.State(number).value,
    ]
    for value in made:
        assert value.weak_type
        with pytest.raises(
            es.StateValueError, match=rf"State 'u' the value .* become {broken}\)"
        ):
            _write_value(u, value, how)
        assert u.value == 5
    with pytest.raises(es.StateValueError, match="State 'u'"):
        es.assign(es.StateDict({u: number}))
    assert u.value == 5
    _write_value(u, jnp.asarray(7), how)  # A value that fits is written.
    u.value = jnp.asarray(7)
    assert u.value == 7 and u.value.dtype == dtype


@pytest.mark.parametrize("how", _HOW)
def test_a_numpy_value_that_narrowing_breaks_is_refused(how):
    # With 64-bit types off, JAX converts NumPy's int64 to int32, wrapping 2**32 + 5.
    assert not jax.config.jax_enable_x64
    step = es.State(jnp.array(0, jnp.int32), name="step")
    with pytest.raises(
        es.StateValueError,
        match=r"State 'step' the value 4294967301 as int32 .*become 5\).*x64",
    ):
        _write_value(step, np.int64(2**32 + 5), how)
    w = es.State(jnp.zeros(2), name="w")
    with pytest.raises(es.StateValueError, match="State 'w' the value 1e\\+40"):
        _write_value(w, np.array([0.5, 1e40]), how)
    assert step.value == 0 and (w.value == 0).all()
    # Values that fit, or that only round to the nearest float32, are written.
    _write_value(step, np.int64(-(2**31)), how)
    _write_value(w, np.array([0.1, 1e-30]), how)


def test_a_python_int_too_large_for_jax_is_refused_naming_the_state():
    step = es.State(jnp.array(0, jnp.int32), name="step")
    with pytest.raises(
        es.StateValueError, match="State 'step' the value 1099511627776"
    ):
        step.value = 2**40
    with pytest.raises(ValueError, match=r"State 'step' .*int32, cannot hold it"):
        es.values_of(step).set(step, 2**40)
    # Where no state tells the dtype, 64-bit types would hold it.
    with pytest.raises(ValueError, match=r"State 'new' .*jax_enable_x64"):
        es.StateDict({es.State(0, name="new"): 2**40})


@pytest.mark.parametrize("how", _HOW)
@pytest.mark.parametrize(
    "dtype, number", [("uint32", 3_000_000_000), ("float32", 2**40), ("int32", 2**40)]
)
def test_a_python_int_beyond_int32_that_the_state_dtype_holds_is_written(
    how, dtype, number
):
    # JAX's default integer is int32 (64-bit types off): the state's dtype decides.
    u = es.State(jnp.zeros((), dtype), name="u")
    if dtype == "int32":
        with pytest.raises(es.StateValueError, match="its dtype, int32, cannot"):
            _write_value(u, number, how)
        return
    _write_value(u, number, how)
    written = es.values_of(u).set(u, number)[u]
    assert written.dtype == dtype and int(written) == number
    if dtype == "float32":  # A weakly typed state stays weak, as for any number.
        weak = es.State(1.0, name="weak")
        _write_value(weak, number, how)
        assert es.values_of(weak).set(weak, number)[weak].weak_type


def test_a_python_int_that_the_state_dtype_cannot_hold_names_the_dtype():
    for dtype, number in [("uint32", 2**33), ("uint32", -(2**40)), ("float16", 2**40)]:
        u = es.State(jnp.zeros((), dtype), name="u")
        with pytest.raises(
            es.StateValueError,
            match=rf"State 'u' the value {number}: its dtype, {dtype}, cannot hold it",
        ):
            u.value = number
        assert u.value == 0


def test_a_complex_number_whose_part_the_state_dtype_cannot_hold_is_refused():
    z = es.State(jnp.zeros((), jnp.complex64), name="z")
    for number in (1e-50 + 1j, 1 + 1e-50j, complex(1e39, 0)):
        with pytest.raises(es.StateValueError, match=r"State 'z' .*complex64 cannot"):
            z.value = number
        assert z.value == 0
    z.value = 0.1 + 2j  # only rounded
    assert z.value == jnp.complex64(0.1 + 2j)


def test_a_real_number_written_to_a_complex_state_warns_nothing():
    z = es.State(jnp.zeros((), jnp.complex64), name="z")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        z.value = 2
        assert z.value == 2
        z.value = 1.5
    assert z.value == jnp.complex64(1.5)


def test_a_state_made_from_a_value_its_array_cannot_hold_is_refused():
    # With 64-bit types off, as for a write: no state is made.
    with pytest.raises(es.StateValueError, match=r"State 'unmade' the value 42949"):
        es.State(np.int64(2**32 + 5), name="unmade")
    with pytest.raises(es.StateValueError, match=r"State 'unmade' the value 10995"):
        es.State({"a": 2**40}, name="unmade")
    assert not any(s.name == "unmade" for s in es.world())
    # Values that fit, or only round to the nearest float32, are kept.
    assert es.State(np.int64(-(2**31))).value == -(2**31)
    assert es.State(np.float64(0.1)).value == jnp.float32(0.1)


def test_weak_type_may_change_on_write():
    s = es.State(jnp.asarray(0.0))
    s.value = jnp.ones((), jnp.float32)
    assert not s.value.weak_type


def _write_number(s, number, how):
    """Writes the Python `number` to `s` eagerly, under `jit`, with `StateDict.set`
    or in a `scope`."""

    def write():
        s.value = number

    if how == "eager":
        write()
    elif how == "jit":
        es.transform.jit(write)()
    elif how == "StateDict.set":
        es.assign(es.values_of(s).set(s, number))
    else:
        with es.scope(es.values_of(s)) as sc:
            write()
        es.assign(sc.states)


@pytest.mark.parametrize("how", ["eager", "jit", "StateDict.set", "scope"])
@pytest.mark.parametrize("number", [3.0, 3])
def test_a_python_scalar_written_to_a_strongly_typed_state_leaves_it_strong(
    how, number
):
    s = es.State(jnp.array(2.0, jnp.float32), name="s")
    _write_number(s, number, how)
    assert s.value == 3.0 and not s.value.weak_type
    # So it promotes as the float32 it was, not as a Python scalar would.
    with jax.numpy_dtype_promotion("standard"):
        assert (jnp.ones(2, jnp.bfloat16) * s.value).dtype == jnp.float32


@pytest.mark.parametrize("how", ["eager", "jit", "StateDict.set", "scope"])
@pytest.mark.parametrize("number", [1.0, 1])
def test_a_python_scalar_written_to_a_weakly_typed_state_leaves_it_weak(how, number):
    s = es.State(0.0, name="s")
    _write_number(s, number, how)
    assert s.value == 1.0 and s.value.dtype == jnp.float32 and s.value.weak_type
    # So it promotes as a Python float, whichever number was written.
    with jax.numpy_dtype_promotion("standard"):
        assert (jnp.ones(2, jnp.bfloat16) * s.value).dtype == jnp.bfloat16


def test_a_handle_has_no_truth_value():
    done = es.State(jnp.array(False), name="done")
    with pytest.raises(TypeError, match=r"State 'done' .*no truth value.*state\.value"):
        if done:
            pass
    assert done is not None and not done.value


_FORGOTTEN_VALUE = [
    ("`@`", lambda w, x: w @ x, "state.value @ x"),
    ("`@`", lambda w, x: x @ w, "x @ state.value"),
    ("`*`", lambda w, x: w * 2, "state.value * x"),
    ("`*`", lambda w, x: 2.0 * w, "x * state.value"),
    ("`+`", lambda w, x: x + w, "x + state.value"),
    ("`+`", lambda w, x: np.ones(3) + w, "x + state.value"),
    ("`-`", lambda w, x: w - x, "state.value - x"),
    ("`/`", lambda w, x: 1 / w, "x / state.value"),
    ("`**`", lambda w, x: w**2, "state.value ** x"),
    ("`-`", lambda w, x: -w, "-state.value"),
    ("`abs`", lambda w, x: abs(w), "abs(state.value)"),
    ("`<`", lambda w, x: w < x, "state.value < x"),
    ("indexing", lambda w, x: w[0], "state.value[i]"),
    ("indexing", lambda w, x: list(w), "state.value[i]"),
    ("`len`", lambda w, x: len(w), "len(state.value)"),
    ("`float`", lambda w, x: float(w), "float(state.value)"),
]


@pytest.mark.parametrize("operation, use, example", _FORGOTTEN_VALUE)
def test_using_a_handle_as_an_array_names_the_state_and_value(operation, use, example):
    w = es.ParamState(jnp.ones((3, 3)), name="w")
    with pytest.raises(
        TypeError,
        match=r"ParamState 'w' \(f32\[3,3\]\) is a state handle, not an array: "
        rf"{re.escape(operation)} needs its value.*`{re.escape(example)}`",
    ):
        use(w, jnp.ones(3))


def test_a_handle_stays_hashable_and_equal_by_identity_beside_arrays():
    w = es.ParamState(jnp.ones(3), name="w")
    x = jnp.ones(3)
    assert (w == x) is False and (x == w) is False and (w != x) is True
    assert {w: 1}[w] == 1 and w in [x, w]


def test_a_model_holding_handles_given_to_a_raw_jax_transform_gets_eqstates_error():
    class Linear(eqx.Module):
        w: es.ParamState

        def __call__(self, x):
            return self.w.value @ x

    model, x = Linear(es.ParamState(jnp.ones((2, 3)), name="w")), jnp.ones(3)
    for transform in (jax.jit, jax.grad, eqx.Partial(jax.vmap, in_axes=(0, None))):
        with pytest.raises(
            es.TraceContextError,
            match=r"ParamState 'w' \(f32\[2,3\]\) was given to JAX where it takes "
            r"an array.*`eqstate.transform.jit`, `eqstate.transform.grad`",
        ):
            transform(lambda m, x: m(x).sum())(model, x)
    with pytest.raises(es.TraceContextError, match=r"read it: `state\.value`"):
        jnp.dot(model.w, x)
    # eqstate's transforms carry it.
    assert es.transform.jit(lambda m, x: m(x))(model, x).shape == (2,)


def test_a_write_committed_under_a_raw_vmap_names_the_state():
    # The error names the first state written: found without a handle's truth value.
    w = es.State(jnp.zeros(()), name="w")
    with pytest.raises(es.TraceContextError, match="Cannot write State 'w'"):
        jax.vmap(lambda x: es.assign({w: x}))(jnp.ones(2))
    assert w.value == 0


def test_reading_a_state_of_a_finished_scope_raises_state_not_found():
    with es.scope(es.StateDict()):
        s = es.State(jnp.zeros(2), name="inner")
    with pytest.raises(es.StateNotFoundError, match="State 'inner' has no value"):
        s.value
    with pytest.raises(KeyError):
        s.value = jnp.zeros(2)


def test_reading_inside_raw_jit_raises_trace_context_error():
    s = es.State(jnp.zeros(2), name="s")
    with pytest.raises(es.TraceContextError, match="Cannot read State 's' inside"):
        jax.jit(lambda: s.value)()


def test_writing_inside_raw_jit_raises_and_keeps_the_value():
    s = es.State(jnp.zeros(2), name="s")

    def write(x):
        s.value = x
        return x

    with pytest.raises(es.TraceContextError, match="Cannot write State 's' inside"):
        jax.jit(write)(jnp.ones(2))
    assert (s.value == 0).all()
    with pytest.raises(es.TraceContextError, match="Cannot write"):
        eqx.filter_vmap(write)(jnp.ones((3, 2)))
    assert (s.value == 0).all()


def test_writing_a_leaked_tracer_raises():
    s = es.State(jnp.zeros(2), name="s")
    with pytest.raises(es.TraceContextError, match="leaked"):
        s.value = leak_a_tracer((2,))
    assert (s.value == 0).all()


def test_creating_a_state_inside_raw_jit_raises():
    with pytest.raises(es.TraceContextError, match="Cannot create"):
        jax.jit(lambda: es.State(jnp.zeros(2)).name)()


def _in_run(body):
    es.run(body, es.StateDict({}))


def _in_jit(body):
    es.transform.jit(body)()


def _in_new_states_lane(body):
    es.transform.vmap_new_states(body, axis_size=2)()


def _in_eager_scan(body):
    with jax.disable_jit():
        es.transform.scan(lambda c, x: (body(), None), None, jnp.zeros(1))


@pytest.mark.parametrize(
    "frame",
    [_in_run, _in_jit, _in_new_states_lane, _in_eager_scan],
    ids=lambda f: f.__name__,
)
def test_writing_inside_a_raw_transform_nested_in_any_frame_raises(frame):
    s = es.State(jnp.zeros(()), name="s")

    def body():
        jax.vmap(lambda x: setattr(s, "value", x))(jnp.ones(2))

    with pytest.raises(es.TraceContextError, match="Cannot write State 's' inside"):
        frame(body)
    assert s.value == 0


@pytest.mark.parametrize(
    "frame", [_in_run, _in_jit, _in_new_states_lane], ids=lambda f: f.__name__
)
def test_creating_inside_a_raw_transform_nested_in_any_frame_raises(frame):
    def body():
        jax.vmap(lambda x: es.State(x, name="n").name)(jnp.ones(2))

    with pytest.raises(es.TraceContextError, match="Cannot create State 'n' inside"):
        frame(body)


def test_state_is_generic_for_annotations():
    value_type = Float[Array, " n"]
    annotation = es.State[value_type]
    assert typing.get_origin(annotation) is es.State
    assert typing.get_args(annotation) == (value_type,)

    @beartype
    def f(s: es.State[value_type]) -> None:
        pass

    f(es.ParamState(jnp.zeros(3)))
    with pytest.raises(BeartypeCallHintParamViolation, match="State"):
        f(jnp.zeros(3))  # type: ignore[arg-type]
