from typing import NamedTuple

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from .helpers import traces_per_key, tree_allclose, tree_bitwise_equal


pytestmark = pytest.mark.usefixtures("tracing_mode")


def test_vmap_over_arguments_matches_jax_with_broadcast_states(getkey):
    w = es.ParamState(jr.normal(getkey(), (3, 2)))
    xs = jr.normal(getkey(), (5, 2))
    out = es.transform.vmap(lambda x: w.value @ x)(xs)
    wv = w.value
    assert tree_allclose(out, jax.vmap(lambda x: wv @ x)(xs))


def test_a_weakly_typed_mapped_argument_is_traced_once(getkey):
    count = es.ShortTermState(jnp.array(0), name="count")
    traces = []

    def scale(x, factor):
        traces.append(1)
        count.value = count.value + 1
        return x * factor

    xs = jr.normal(getkey(), (4, 3))
    factors = jax.lax.broadcast(jnp.asarray(2.0), (4,))  # weakly typed, like 2.0
    assert jax.typeof(factors).weak_type
    out = es.transform.vmap(scale)(xs, factors)
    assert tree_allclose(out, jax.vmap(lambda x, f: x * f)(xs, factors))
    assert len(traces) == traces_per_key() and count.value == 1


def test_declared_states_are_mapped_and_written_back(getkey):
    w = es.ParamState(jr.normal(getkey(), (4, 3)), name="w")
    count = es.ShortTermState(jnp.zeros(4), name="count")

    @es.transform.vmap(in_states={0: (w, count)})
    def step(x):
        count.value = count.value + x
        return jnp.sum(w.value * x)

    xs = jnp.arange(4.0)
    out = step(xs)
    assert tree_allclose(out, jnp.sum(w.value, axis=1) * xs)
    assert tree_allclose(count.value, xs)


def test_a_bare_filter_maps_along_axis_zero_and_other_axes_work(getkey):
    w = es.ParamState(jr.normal(getkey(), (3, 5)), tag="ens")
    by_tag = es.transform.vmap(lambda: w.value.sum(), in_states="ens", axis_size=3)()
    assert tree_allclose(by_tag, w.value.sum(axis=1))
    by_axis = es.transform.vmap(lambda: w.value.sum(), in_states={1: w})()
    assert tree_allclose(by_axis, w.value.sum(axis=0))


def test_out_states_must_keep_the_shape(getkey):
    w = es.State(jnp.zeros((2, 3)), name="w")
    f = es.transform.vmap(
        lambda: setattr(w, "value", w.value + 1), in_states={0: w}, out_states={1: w}
    )
    with pytest.raises(ValueError, match="would change the shape of State 'w'"):
        f()
    assert (w.value == 0).all()


def test_batched_write_to_an_undeclared_state_raises_naming_it():
    s = es.State(jnp.zeros(()), name="total")

    def f(x):
        s.value = s.value + x
        return x

    with pytest.raises(
        es.BatchAxisError, match="State 'total' is written inside `vmap`"
    ):
        es.transform.vmap(f)(jnp.arange(3.0))
    assert s.value == 0


def test_unbatched_write_to_an_undeclared_state_is_kept():
    s = es.State(jnp.zeros(()), name="seen")
    es.transform.vmap(lambda x: setattr(s, "value", jnp.ones(())) or x)(jnp.arange(3.0))
    assert s.value == 1


def test_random_states_are_split_per_lane_and_advance_once():
    es.random.seed(0)
    key = es.random.get_key()
    samples = es.transform.vmap(lambda _: es.random.normal(), axis_size=4)(jnp.zeros(4))
    assert len(set(samples.tolist())) == 4
    advanced, lanes = jax.random.split(key, 5)[0], jax.random.split(key, 5)[1:]
    assert tree_bitwise_equal(es.random.get_key(), advanced)
    expected = jax.vmap(lambda k: jax.random.normal(jax.random.split(k)[1]))(lanes)
    assert tree_allclose(samples, expected)


def test_drawing_from_an_undeclared_batch_of_keys_names_the_state():
    rngs = es.RandomState(jr.split(jr.key(0), 3), name="rngs")

    def noisy(x):
        return x + jr.normal(rngs.split_key())

    with pytest.raises(
        es.BatchAxisError, match=r"RandomState 'rngs' .*shape \(3,\).*`in_states`"
    ):
        es.transform.vmap(noisy)(jnp.zeros(3))
    out = es.transform.vmap(noisy, in_states={0: rngs})(jnp.zeros(3))
    assert out.shape == (3,) and len(set(out.tolist())) == 3


def test_axis_name_collectives(getkey):
    w = es.ParamState(jr.normal(getkey(), (4,)))
    out = es.transform.vmap(
        lambda: w.value / jax.lax.psum(w.value, "i"), in_states=w, axis_name="i"
    )()
    assert tree_allclose(out, w.value / w.value.sum())


def test_a_named_vmap_runs_the_python_once_per_call_and_sees_each_size(tracing_mode):
    # The trace that finds the states (with the axis in scope) serves the mapped call.
    # (The two-pass fallback runs the Python again to trace with values, by design.)
    single_pass = tracing_mode == "single-pass"
    runs, count = [], es.ShortTermState(jnp.array(0), name="count")

    def f(x):
        runs.append(None)
        count.value = count.value + 1
        return x / jax.lax.axis_size("i")

    mapped = es.transform.vmap(f, axis_name="i")
    for n in (2, 2, 4):
        before = len(runs)
        assert mapped(jnp.ones(n)) == pytest.approx(jnp.full(n, 1 / n))
        assert len(runs) - before == 1 or not single_pass
    assert count.value == 3


def test_in_axes_none_and_keyword_arguments(getkey):
    out = es.transform.vmap(lambda x, y, *, z: x + y + z, in_axes=(0, None))(
        jnp.arange(3.0), 10.0, z=jnp.ones(3)
    )
    assert tree_allclose(out, jnp.arange(3.0) + 11)


class _Pair(NamedTuple):
    a: jax.Array
    b: float


@pytest.mark.parametrize(
    "args, where",
    [
        ((jnp.ones(3), 2.0), r"argument 1 along axis 0, but it is a Python float"),
        ((jnp.ones(3), [1.0, 2.0]), r"argument 1\[0\] along .* Python float"),
        ((jnp.ones(3), {"n": 3}), r"argument 1\['n'\] along .* Python int"),
        ((jnp.ones(3), _Pair(jnp.ones(3), 2.0)), r"argument 1.b along .* Python float"),
    ],
)
def test_mapping_a_python_number_raises_as_in_jax_vmap(args, where):
    f = es.transform.vmap(lambda x, y: x)
    with pytest.raises(ValueError, match=where):
        f(*args)
    with pytest.raises(ValueError):
        jax.vmap(lambda x, y: x)(*args)


class _Flagged(eqx.Module):
    scale: jax.Array
    inference: bool


def test_a_python_number_in_a_mapped_module_reaches_every_lane():
    module = _Flagged(jnp.arange(3.0), False)
    out = es.transform.vmap(lambda m: m.scale * (0 if m.inference else 2))(module)
    assert tree_allclose(out, jnp.arange(3.0) * 2)


def test_unmapped_python_scalars_reach_the_function_as_they_are():
    # As in `jax.vmap`: `range(n)` and `if flag:` work on unmapped Python scalars.
    traces = []

    def f(x, n, flag, label, *, scale):
        traces.append((n, flag, label, scale))
        for _ in range(n):
            x = x * 2 if flag else x
        return x * scale if label == "scaled" else x

    xs = jnp.arange(3.0)
    vf = es.transform.vmap(f, in_axes=(0, None, None, None))
    assert tree_allclose(vf(xs, 2, True, "scaled", scale=0.5), xs * 2)
    assert traces[-1] == (2, True, "scaled", 0.5)
    assert tree_allclose(vf(xs, 2, True, "scaled", scale=0.5), xs * 2)
    assert tree_allclose(vf(xs, 3, False, None, scale=1), xs)
    assert all(type(t[0]) is int and type(t[1]) is bool for t in traces)


def test_unmapped_python_scalars_inside_a_mapped_argument_stay_as_they_are():
    # `jax.vmap` passes a leaf whose axis is `None` as it is, even when the other
    # leaves of its argument are mapped.
    seen = []

    def f(batch, model):
        seen.append((type(batch["n"]), type(model.flag)))
        x = batch["x"]
        for _ in range(batch["n"]):
            x = x * 2 if model.flag else x
        return x * model.w

    class Model(eqx.Module):
        w: jax.Array
        flag: bool

    axes = ({"x": 0, "n": None}, Model(0, None))  # pyright: ignore[reportArgumentType]
    xs, model = jnp.arange(3.0), Model(jnp.arange(3.0), True)
    batch = {"x": xs, "n": 2}
    out = es.transform.vmap(f, in_axes=axes)(batch, model)
    assert tree_allclose(out, jax.vmap(f, in_axes=axes)(batch, model))
    assert tree_allclose(out, xs * 4 * model.w)
    assert set(seen) == {(int, bool)}
    out = es.transform.vmap(f, in_axes=axes)({"x": xs, "n": 3}, model)
    assert tree_allclose(out, xs * 8 * model.w)


def test_an_unmapped_python_scalar_is_part_of_the_cache_key():
    traces = []

    def f(x, n):
        traces.append(n)
        return x * n

    vf = es.transform.vmap(f, in_axes=(0, None))

    @es.transform.jit
    def calls(xs):
        return vf(xs, 2) + vf(xs, 2) + vf(xs, 3)

    xs = jnp.arange(3.0)
    assert tree_allclose(calls(xs), xs * 7)
    # The second call reused the trace of the first; a new value was traced anew.
    assert traces.count(2) == traces.count(3) > 0


def test_unmapped_python_scalars_stay_static_under_jit():
    w = es.ParamState(jnp.ones(()), name="w")

    def repeat(x, n):
        for _ in range(n):
            x = x * w.value * 2
        return x

    xs = jnp.arange(3.0)
    outer = es.transform.jit(
        lambda xs: es.transform.vmap(repeat, in_axes=(0, None))(xs, 3)
    )
    assert tree_allclose(outer(xs), xs * 8)
    inner = es.transform.vmap(
        es.transform.jit(repeat, static_argnums=1), in_axes=(0, None)
    )
    assert tree_allclose(inner(xs, 2), xs * 4)
    # Mapped arguments are traced, and `jit` traces a Python scalar as `jax.jit` does.
    traced = es.transform.vmap(es.transform.jit(lambda x, n: x * n), in_axes=(0, None))
    assert tree_allclose(traced(xs, 2), xs * 2)


def test_axis_size_inference_errors():
    with pytest.raises(ValueError, match="Cannot infer the size"):
        es.transform.vmap(lambda: 1.0)()
    with pytest.raises(ValueError, match="inconsistent sizes"):
        es.transform.vmap(lambda x, y: x + y)(jnp.ones(2), jnp.ones(3))
    for size in (0, True, np.int64(-1)):
        with pytest.raises(ValueError, match="positive integer"):
            es.transform.vmap(lambda: 1.0, axis_size=size)
        with pytest.raises(ValueError, match="positive integer"):
            es.transform.vmap_new_states(lambda: None, axis_size=size)
    with pytest.raises(ValueError, match="one entry per argument"):
        es.transform.vmap(lambda x: x, in_axes=(0, 0))(jnp.ones(2))


@pytest.mark.parametrize("axis_name", (None, "i"))
def test_a_declared_state_the_function_does_not_use_is_not_mapped(axis_name):
    s = es.State(jnp.zeros((4, 2)), name="s")
    unused = es.transform.vmap(lambda: 1.0, in_states={0: s}, axis_name=axis_name)
    with pytest.raises(ValueError, match="none of the states declared in `in_states`"):
        unused()
    assert es.transform.vmap(lambda: 1.0, in_states=s, axis_size=4)().shape == (4,)


@pytest.mark.parametrize("transform", ("vmap", "vmap_new_states"))
def test_in_axes_of_filter_vmap_style_raise_saying_what_is_accepted(transform):
    f = getattr(es.transform, transform)(lambda x: x, in_axes=(eqx.if_array(0),))
    with pytest.raises(TypeError, match=r"takes ints and None.*write `eqx.if_array"):
        f(jnp.ones(3))


def test_a_mapped_state_needs_the_axis():
    s = es.State(jnp.zeros(()), name="scalar")
    with pytest.raises(ValueError, match=r"maps State 'scalar' .* along axis 0"):
        es.transform.vmap(lambda: s.value, in_states=s, axis_size=2)()


def test_bad_state_spec():
    with pytest.raises(TypeError, match="integer axes"):
        es.transform.vmap(lambda: 0.0, in_states={"a": es.State})


def test_states_cannot_be_created_inside_vmap():
    with pytest.raises(ValueError, match="use `vmap_new_states`"):
        es.transform.vmap(lambda x: es.State(x).name)(jnp.ones(2))


def test_vmap_as_a_decorator_inside_jit_and_grad(getkey):
    w = es.ParamState(jr.normal(getkey(), (3, 2)))

    @es.transform.jit
    def loss(xs):
        return jnp.sum(es.transform.vmap(lambda x: jnp.tanh(w.value @ x))(xs) ** 2)

    xs = jr.normal(getkey(), (5, 2))
    grads = es.transform.grad(loss, grad_states=[w])(xs)
    wv = w.value
    ref = jax.grad(lambda w: jnp.sum(jax.vmap(lambda x: jnp.tanh(w @ x))(xs) ** 2))(wv)
    assert tree_allclose(grads[w], ref, atol=1e-5)


def test_nested_vmaps(getkey):
    w = es.ParamState(jr.normal(getkey(), (2, 3)))
    inner = es.transform.vmap(lambda x: w.value[0] * x)
    xs = jr.normal(getkey(), (4, 3))
    out = es.transform.vmap(inner)(xs)
    wv = w.value
    assert tree_allclose(out, jax.vmap(jax.vmap(lambda x: wv[0] * x))(xs))


@pytest.mark.parametrize("transform", ("vmap", "vmap_new_states"))
def test_mapping_a_scalar_argument_names_it(transform):
    f = getattr(es.transform, transform)(lambda x, y: x + y)
    with pytest.raises(ValueError, match=r"maps argument 1 along axis 0, but it has"):
        f(jnp.ones(2), jnp.float32(1.0))
    with pytest.raises(ValueError, match="rank should be at least 1"):
        jax.vmap(lambda x, y: x + y)(jnp.ones(2), jnp.float32(1.0))


@pytest.mark.parametrize(
    "run",
    [
        lambda f: es.transform.vmap(f)(jnp.arange(3.0)),
        lambda f: es.transform.map(f, jnp.arange(3.0), batch_size=2),
        lambda f: es.transform.scan(lambda c, x: (c, f(x)), 0.0, jnp.arange(3.0)),
    ],
    ids=["vmap", "map-in-chunks", "scan"],
)
def test_a_key_reseeded_alike_in_every_lane_is_kept(run):
    rng = es.RandomState(0, name="rng")

    def reseed_then_draw(x):
        rng.seed(42)
        es.random.seed(7)
        return x + es.random.normal() + jax.random.normal(rng.split_key())

    run(reseed_then_draw)
    # Every lane advanced the reseeded keys alike, as a sequential loop does.
    after = jax.random.split(jax.random.key(42))[0]
    assert (jax.random.key_data(rng.value) == jax.random.key_data(after)).all()
    default_after = jax.random.split(jax.random.key(7))[0]
    assert (
        jax.random.key_data(es.random.DEFAULT.value)
        == jax.random.key_data(default_after)
    ).all()


def _reseed_in_cond(rng, x):
    es.transform.cond(x > 0, lambda: rng.seed(42), lambda: rng.seed(42))


def _reseed_in_while(rng, x):
    # Every lane runs at least one iteration, each reseeding.
    body = lambda i: (rng.seed(42), i + 1)[1]  # noqa: E731
    es.transform.while_loop(lambda i: i < x, body, 0.0)


@pytest.mark.parametrize("reseed", (_reseed_in_cond, _reseed_in_while))
@pytest.mark.parametrize(
    "run",
    [
        lambda f: es.transform.vmap(f)(jnp.arange(1.0, 4.0)),
        lambda f: es.transform.map(f, jnp.arange(1.0, 4.0), batch_size=3),
    ],
    ids=["vmap", "map-in-chunks"],
)
def test_a_key_reseeded_alike_under_a_batched_predicate_is_kept(run, reseed):
    # The predicate is batched, so the reseeded key is too, though every lane wrote
    # the same one: it is kept, as a sequential loop keeps it.
    rng = es.RandomState(0, name="rng")
    run(lambda x: (reseed(rng, x), x)[1])
    assert (
        jax.random.key_data(rng.value) == jax.random.key_data(jax.random.key(42))
    ).all()


def test_keys_reseeded_differently_per_lane_leave_the_outer_successor():
    rng = es.RandomState(0, name="rng")
    before = rng.value
    es.transform.vmap(lambda x: rng.seed(x))(jnp.arange(3))
    after = jax.random.split(before)[0]
    assert (jax.random.key_data(rng.value) == jax.random.key_data(after)).all()


def test_a_zero_size_batch_maps_to_an_empty_result_like_jax_vmap():
    # The inferred size 0 is not checked as a user's `axis_size` (which stays > 0).
    xs = jnp.zeros((0, 3))
    s = es.State(jnp.zeros((0, 3)), name="s")
    assert es.transform.vmap(lambda x: x * 2)(xs).shape == (0, 3)
    assert es.transform.vmap(lambda x: x * s.value, in_states=s)(xs).shape == (0, 3)
    noisy = es.transform.jit(es.transform.vmap(lambda x: x * es.random.normal()))
    assert noisy(xs).shape == (0, 3)


def test_inconsistent_sizes_name_what_was_given_and_every_leaf_of_a_state():
    q = es.State(jnp.ones(5), name="q")
    with pytest.raises(ValueError, match="sizes") as info:
        es.transform.vmap(lambda x: x * q.value.sum(), in_states=q)(jnp.ones(3))
    # The size taken from the argument is not presented as an `axis_size`.
    assert "axis_size" not in str(info.value) and "argument 0: 3" in str(info.value)
    u = es.State({"a": jnp.zeros(3), "b": jnp.zeros(4)}, name="u")
    with pytest.raises(ValueError, match=r"State 'u'.*\['a'\]: 3.*\['b'\]: 4"):
        es.transform.vmap(lambda: u.value["a"], in_states={0: u})()


def test_a_shared_state_written_under_a_batched_predicate_is_refused_saying_why():
    # Both branches write 5, but the predicate is batched, so the value is too: the
    # error says so rather than that the lanes differ.
    c = es.State(jnp.array(0), name="c")

    def h(x):
        write = lambda: setattr(c, "value", jnp.array(5))  # noqa: E731
        es.transform.cond(x > 0, write, write)
        return x

    with pytest.raises(es.BatchAxisError, match=r"State 'c'.*batched.*predicate"):
        es.transform.vmap(h)(jnp.arange(3.0))
    assert c.value == 0


_SHARED = {
    "NonBatchState": lambda value: es.NonBatchState(value, name="scale"),
    "INIT_NO_BATCHING": lambda value: es.State(
        value, name="scale", tag=es.transform.INIT_NO_BATCHING
    ),
    "state_to_exclude": lambda value: es.State(value, name="scale", tag="hyper"),
}


@pytest.mark.parametrize("kind", sorted(_SHARED))
def test_in_states_never_maps_a_state_shared_by_the_members_it_selects(kind):
    # The ensemble recipe `in_states={0: es.states_of(ensemble)}`: each lane sees a
    # member's `w` and the whole shared `scale`, whose leading axis has the size of
    # the ensemble (mapped, each lane would see one element of it).
    ensemble = es.transform.vmap_new_states(
        lambda: {
            "w": es.ParamState(es.random.normal((4,)), name="w"),
            "scale": _SHARED[kind](jnp.arange(4.0)),
        },
        axis_size=4,
        state_to_exclude="hyper",
    )()
    assert ensemble["scale"].value.shape == (4,)

    def predict(member):
        return member["w"].value * member["scale"].value

    lanes = es.transform.vmap(predict, in_states={0: es.states_of(ensemble)})(ensemble)
    want = ensemble["w"].value * ensemble["scale"].value[None, :]
    assert tree_bitwise_equal(lanes, want)


def test_in_states_naming_a_non_batch_state_alone_is_an_error():
    shared = es.NonBatchState(jnp.arange(3.0), name="shared")
    for in_states in (shared, {0: shared}):
        with pytest.raises(ValueError, match="names NonBatchState 'shared'"):
            es.transform.vmap(lambda x: x + shared.value, in_states=in_states)


class _Member(eqx.Module):
    w: es.ParamState
    b: jax.Array

    def __init__(self):
        self.w = es.ParamState(es.random.normal((3,)), name="w")
        self.b = es.random.normal(())

    def __call__(self, x):
        return jnp.sum(self.w.value * x) + self.b


def test_an_ensemble_mapped_by_in_axes_alone_is_an_error_naming_its_states():
    # As `eqx.filter_vmap` maps a model's arrays: the stacked states would reach every
    # lane whole (each lane summing every member's weights), not one member's.
    ensemble = es.transform.vmap_new_states(_Member, axis_size=3)()
    xs = jnp.arange(9.0).reshape(3, 3)
    mapped = es.transform.vmap(lambda m, x: m(x), in_axes=(0, 0))
    with pytest.raises(
        ValueError,
        match=r"`vmap` maps argument 0\.w, which holds ParamState 'w' \(f32\[3,3\]\): "
        r"its value has an axis 0 of size 3.*in_states=\{0: es.states_of\(model\)\}",
    ):
        mapped(ensemble, xs)
    declared = es.transform.vmap(
        lambda m, x: m(x), in_axes=(0, 0), in_states={0: es.states_of(ensemble)}
    )(ensemble, xs)
    one_by_one = jnp.stack([es.member(ensemble, i)(xs[i]) for i in range(3)])
    assert tree_bitwise_equal(declared, one_by_one)
    # Passed whole (`None`), or as a keyword argument with `in_states`, it is fine.
    whole = es.transform.vmap(lambda m, x: m.w.value.sum() + x.sum(), in_axes=(None, 0))
    assert whole(ensemble, xs).shape == (3,)
    with pytest.raises(ValueError, match=r"maps keyword argument 'm'\.w"):
        es.transform.vmap(lambda x, *, m: m(x))(xs, m=ensemble)


class _StatesOnly(eqx.Module):
    w: es.ParamState

    def __init__(self):
        self.w = es.ParamState(es.random.normal((3,)), name="w")

    def __call__(self, x):
        return jnp.sum(self.w.value * x)


def test_a_member_of_an_ensemble_maps_as_a_model_of_its_own():
    # Its states are not stacked, even where their leading axis has the batch size.
    ensemble = es.transform.vmap_new_states(_StatesOnly, axis_size=3)()
    xs = jnp.arange(9.0).reshape(3, 3)
    for one in (es.member(ensemble, 1), es.clone(es.member(ensemble, 1))):
        mapped = es.transform.vmap(lambda m, x: m(x))(one, xs)
        expected = jax.vmap(lambda x, w=one.w.value: jnp.sum(w * x))(xs)
        assert tree_bitwise_equal(mapped, expected)
    # A member of an ensemble of ensembles is still an ensemble, stacked by the inner
    # build.
    nested = es.transform.vmap_new_states(
        lambda: es.transform.vmap_new_states(_StatesOnly, axis_size=3)(), axis_size=2
    )()
    inner = es.member(nested, 1)
    assert inner.w.value.shape == (3, 3)
    with pytest.raises(ValueError, match=r"maps argument 0\.w, which holds"):
        es.transform.vmap(lambda m, x: m(x))(inner, xs)


def test_a_failure_is_blamed_on_a_stacked_state_only_if_the_function_read_it():
    class Model(eqx.Module):
        w: es.ParamState
        stats: es.LongTermState

        def __init__(self):
            self.w = es.ParamState(es.random.normal((2,)), name="w")
            self.stats = es.LongTermState(jnp.zeros(2), name="stats")

    ensemble = es.transform.vmap_new_states(Model, axis_size=3)()
    xs = jnp.ones((3, 2))

    def mapped(f):
        return es.transform.vmap(f, in_states={0: es.ParamState})(ensemble, xs)

    assert mapped(lambda m, x: m.w.value @ x).shape == (3,)  # `stats` left whole
    with pytest.raises(TypeError, match="dot_general requires contracting"):
        mapped(lambda m, x: m.w.value @ jnp.ones(5))  # the function's own error
    with pytest.raises(ValueError, match=r"maps argument 0\.stats, which holds"):
        mapped(lambda m, x: m.stats.value @ jnp.ones(5))


def test_keyword_arguments_give_the_axis_size_and_are_checked_against_the_others():
    # As `jax.vmap`: keyword arguments are mapped along axis 0.
    twice = es.transform.vmap(lambda *, y: y * 2)
    assert tree_bitwise_equal(
        twice(y=jnp.arange(3.0)), jax.vmap(lambda y: y * 2)(jnp.arange(3.0))
    )
    with pytest.raises(
        ValueError, match=r"sizes \(argument 0: 3, keyword argument 'y': 4\)"
    ):
        es.transform.vmap(lambda x, *, y: x + y.sum())(jnp.ones(3), y=jnp.ones(4))
    s = es.State(jnp.arange(3.0), name="s")
    with pytest.raises(
        ValueError, match=r"State 's' \(f32\[3\]\): 3, keyword argument 'y': 4"
    ):
        es.transform.vmap(lambda *, y: y * s.value, in_states={0: s})(y=jnp.ones(4))
    with pytest.raises(
        ValueError, match="keyword argument 'y' along axis 0, but it has"
    ):
        es.transform.vmap(lambda x, *, y: x + y)(jnp.ones(3), y=jnp.float32(2))


def test_in_states_never_maps_what_vmap2_new_states_replicated():
    def ctor():
        w = es.ParamState(es.random.normal((3,)), name="w")
        scale = es.State(jnp.arange(3.0), name="scale", tag="INIT_NO_BATCHING")
        return w, scale

    (w, scale), states = es.transform.vmap2_new_states(ctor, axis_size=3)()
    assert states[scale].shape == (3,)
    with es.scope(states):
        lanes = es.transform.vmap(
            lambda: jnp.sum(w.value * scale.value), in_states={0: states}
        )()
    assert tree_bitwise_equal(lanes, jnp.sum(states[w] * states[scale][None], axis=1))


def test_in_states_naming_a_replicated_state_alone_is_an_error():
    ensemble = es.transform.vmap_new_states(
        lambda: es.State(jnp.arange(3.0), name="shared", tag="hyper"),
        axis_size=3,
        state_to_exclude="hyper",
    )()
    with pytest.raises(ValueError, match=r"names State 'shared'.*replicated it"):
        es.transform.vmap(lambda x: x + ensemble.value, in_states={0: ensemble})


@pytest.mark.parametrize("size", [np.int64(3), np.int32(3), jnp.int32(3)])
def test_axis_size_takes_numpy_and_jax_integers_as_jax_vmap(size):
    assert es.transform.vmap(lambda: jnp.float32(1.0), axis_size=size)().shape == (3,)
    ensemble = es.transform.vmap_new_states(
        lambda: es.ParamState(jnp.zeros(2)), axis_size=size
    )()
    assert ensemble.value.shape == (3, 2)


@pytest.mark.parametrize("axis", [1, -2, 3])
def test_an_out_states_axis_out_of_range_names_the_state_and_the_range(axis):
    a = es.State(jnp.zeros(2), name="a")

    def f(x):
        a.value = a.value + x

    with pytest.raises(
        ValueError,
        match=rf"`out_states` puts the mapped axis of State 'a' \(f32\[2\]\) at {axis}, "
        r"but its value has 1 axes: pass an axis from -1 to 0\.",
    ):
        es.transform.vmap(f, in_states={0: a}, out_states={axis: a})(jnp.ones(2))
    assert (a.value == 0).all()
