import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import pytest

from .helpers import tree_allclose, tree_bitwise_equal


pytestmark = pytest.mark.usefixtures("tracing_mode")


def test_the_reference_docstring_example():
    @es.transform.vmap_new_states(in_axes=0, axis_size=4)
    def build(x):
        scratch = es.ShortTermState(jnp.zeros(()))
        scratch.value = scratch.value + x
        return scratch.value

    out = build(jnp.arange(4.0))
    assert out.dtype == jnp.float32 and (out == jnp.array([0.0, 1.0, 2.0, 3.0])).all()


def test_each_lane_creates_its_own_copy_stacked_and_registered_in_the_world():
    @es.transform.vmap_new_states(axis_size=3)
    def make():
        return es.ParamState(jnp.ones(2), name="w"), es.ShortTermState(jnp.array(0))

    w, n = make()
    assert w.value.shape == (3, 2) and n.value.shape == (3,)
    assert w in es.world() and w.name == "w"


def test_axis_size_is_inferred_from_mapped_arguments():
    make = es.transform.vmap_new_states(lambda x: es.State(x * 2))
    s = make(jnp.arange(5.0))
    assert tree_allclose(s.value, jnp.arange(5.0) * 2)


def test_fun_runs_exactly_once_per_call_and_side_effect_handles_are_real():
    runs, handed_out = [], []

    def ctor():
        runs.append(1)
        s = es.ParamState(es.random.normal((2,)))
        handed_out.append(s)
        return None

    es.transform.vmap_new_states(ctor, axis_size=4)()
    assert len(runs) == 1
    (s,) = handed_out
    assert s.value.shape == (4, 2)


def test_random_initialisation_differs_across_lanes_and_the_key_advances_once():
    es.random.seed(1)
    before = es.random.get_key()
    w = es.transform.vmap_new_states(
        lambda: es.ParamState(es.random.normal((3,))), axis_size=6
    )()
    rows = {tuple(r) for r in w.value.tolist()}
    assert len(rows) == 6
    assert tree_bitwise_equal(es.random.get_key(), jax.random.split(before)[0])


def test_new_random_states_are_rekeyed_per_lane():
    rng = es.transform.vmap_new_states(lambda: es.RandomState(0), axis_size=3)()
    data = jax.random.key_data(rng.value)
    assert len({tuple(d) for d in data.tolist()}) == 3


def test_calling_twice_creates_two_sets_of_states():
    make = es.transform.vmap_new_states(
        lambda: es.ParamState(jnp.zeros(2)), axis_size=2
    )
    a, b = make(), make()
    assert a is not b and a in es.world() and b in es.world()


def test_state_tag_tags_the_new_states():
    make = es.transform.vmap_new_states(
        lambda: (es.ParamState(jnp.zeros(2)), es.State(jnp.zeros(()), tag="own")),
        axis_size=2,
        state_tag="ensemble",
    )
    a, b = make()
    assert a.tag == "ensemble" and b.tag == "ensemble"
    assert set(es.world().filter("ensemble").states) >= {a, b}


def test_non_batch_and_excluded_states_are_replicated():
    def ctor():
        shared = es.NonBatchState(jnp.arange(3.0), name="shared")
        excluded = es.State(jnp.ones(2), tag="skip")
        batched = es.State(jnp.ones(2))
        return shared, excluded, batched

    shared, excluded, batched = es.transform.vmap_new_states(
        ctor, axis_size=4, state_to_exclude="skip"
    )()
    assert shared.value.shape == (3,) and excluded.value.shape == (2,)
    assert batched.value.shape == (4, 2)


def test_states_tagged_init_no_batching_are_replicated_like_non_batch_states():
    def ctor():
        tagged = es.State(jnp.arange(3.0), tag="INIT_NO_BATCHING", name="tagged")
        return tagged, es.State(jnp.ones(2))

    tagged, batched = es.transform.vmap_new_states(
        ctor, axis_size=4, state_tag="ensemble"
    )()
    assert es.transform.INIT_NO_BATCHING == "INIT_NO_BATCHING"
    assert tagged.value.shape == (3,) and batched.value.shape == (4, 2)
    assert tagged.tag == "ensemble"
    with pytest.raises(es.BatchAxisError, match="tagged 'INIT_NO_BATCHING'"):
        es.transform.vmap_new_states(
            lambda x: es.State(x, tag=es.transform.INIT_NO_BATCHING)
        )(jnp.arange(3.0))


def test_a_replicated_state_that_differs_across_lanes_is_an_error():
    def ctor(x):
        return es.NonBatchState(x, name="shared")

    with pytest.raises(
        es.BatchAxisError, match="NonBatchState 'shared' is a NonBatchState"
    ):
        es.transform.vmap_new_states(ctor)(jnp.arange(3.0))
    with pytest.raises(es.BatchAxisError, match="in `state_to_exclude`"):
        es.transform.vmap_new_states(
            lambda: es.State(es.random.normal(), tag="x"),
            axis_size=2,
            state_to_exclude="x",
        )()


def test_in_states_out_states_and_bad_axis_sizes_are_refused():
    with pytest.raises(ValueError, match=r"Use `eqstate\.transform\.vmap`"):
        es.transform.vmap_new_states(lambda: None, in_states=es.State)
    with pytest.raises(
        ValueError, match="in_states` and `out_states` are not supported"
    ):
        es.transform.vmap_new_states(lambda: None, out_states={0: es.State})
    for bad in (0, -2):
        with pytest.raises(ValueError, match="positive integer"):
            es.transform.vmap_new_states(lambda: None, axis_size=bad)


def test_keyword_arguments_are_not_implemented():
    make = es.transform.vmap_new_states(lambda x=1.0: es.State(x), axis_size=2)
    with pytest.raises(NotImplementedError, match="keyword arguments"):
        make(x=jnp.ones(2))


def test_decorator_form_and_in_axes_none():
    @es.transform.vmap_new_states(in_axes=(0, None))
    def make(x, scale):
        return es.State(x * scale)

    s = make(jnp.arange(3.0), 2.0)
    assert tree_allclose(s.value, jnp.arange(3.0) * 2)


def test_axis_name_collectives_work():
    @es.transform.vmap_new_states(axis_name="lane", axis_size=4)
    def make():
        s = es.State(es.random.uniform())
        return s, jax.lax.psum(s.value, "lane")

    s, total = make()
    assert tree_allclose(total, jnp.full(4, s.value.sum()))


def test_pre_existing_states_can_be_read_but_not_written():
    scale = es.State(jnp.array(3.0), name="scale")
    s = es.transform.vmap_new_states(
        lambda: es.State(jnp.ones(2) * scale.value), axis_size=2
    )()
    assert tree_allclose(s.value, jnp.full((2, 2), 3.0))

    def bad():
        scale.value = jnp.array(4.0)

    with pytest.raises(
        es.TraceContextError, match=r"State 'scale' \(f32\[\]\) existed before"
    ):
        es.transform.vmap_new_states(bad, axis_size=2)()
    assert scale.value == 3.0


def test_new_states_register_in_the_enclosing_scope_or_trace():
    with es.scope(es.world().filter(es.random.DEFAULT)) as sc:
        s = es.transform.vmap_new_states(lambda: es.State(jnp.zeros(2)), axis_size=3)()
    assert sc.states is not None and sc.states[s].shape == (3, 2)
    assert s not in es.world()

    @es.transform.jit
    def build():
        return es.transform.vmap_new_states(
            lambda: es.ParamState(es.random.normal((2,))), axis_size=3
        )()

    a, b = build(), build()
    assert a is not b and a.value.shape == (3, 2)
    assert not jnp.allclose(a.value, b.value)


def test_a_jit_inside_the_constructor_reads_random_states_per_lane():
    inner = es.transform.jit(lambda: es.random.normal((2,)))
    s = es.transform.vmap_new_states(lambda: es.State(inner()), axis_size=3)()
    assert len({tuple(r) for r in s.value.tolist()}) == 3


def test_a_failing_constructor_registers_nothing():
    before = len(es.world())
    key = es.random.get_key()

    def ctor():
        es.ParamState(jnp.zeros(2))
        raise RuntimeError("half-built")

    with pytest.raises(RuntimeError, match="half-built"):
        es.transform.vmap_new_states(ctor, axis_size=2)()
    assert len(es.world()) <= before
    assert tree_bitwise_equal(es.random.get_key(), key)


@pytest.mark.parametrize("inside", ["world", "jit"])
def test_a_handle_escaping_a_failing_constructor_names_the_failed_call(inside):
    leak = []

    def ctor(x):
        leak.append(es.State(x, name="p"))
        raise ValueError("boom")

    build = es.transform.vmap_new_states(ctor)
    call = build if inside == "world" else es.transform.jit(build)
    with pytest.raises(ValueError, match="boom"):
        call(jnp.arange(3.0))
    with pytest.raises(
        es.TraceContextError,
        match=r"State 'p' was created inside a trace of `vmap_new_states\(ctor\)`",
    ):
        leak[0].value


class MLP(eqx.Module):
    w1: es.ParamState
    b1: es.ParamState
    w2: es.ParamState
    b2: es.ParamState

    def __init__(self, n_in=2, n_hidden=8):
        self.w1 = es.ParamState(es.random.normal((n_hidden, n_in)) * 0.5, name="w1")
        self.b1 = es.ParamState(jnp.zeros(n_hidden), name="b1")
        self.w2 = es.ParamState(es.random.normal((1, n_hidden)) * 0.5, name="w2")
        self.b2 = es.ParamState(jnp.zeros(1), name="b2")

    def __call__(self, x):
        h = jnp.tanh(self.w1.value @ x + self.b1.value)
        return (self.w2.value @ h + self.b2.value)[0]


def test_vmap2_new_states_builds_without_touching_the_world():
    before = set(es.world().states)
    model, states = es.transform.vmap2_new_states(MLP, axis_size=5)()
    assert set(es.world().states) == before
    assert states[model.w1].shape == (5, 8, 2)
    outs = es.transform.vmap(lambda x: model(x), in_states={0: es.ParamState})
    with es.scope(states):
        ys = outs(jnp.ones((5, 2)))
    assert ys.shape == (5,) and len(set(ys.tolist())) == 5


@pytest.mark.numpy_promotion("optax.adam: a Python float to an int32 power")
def test_ensemble_of_mlps_built_evaluated_and_trained(getkey):
    es.random.seed(0)
    ensemble = es.transform.vmap_new_states(MLP, axis_size=8)()
    params = es.states_of(ensemble, es.ParamState)
    xs = jr.normal(getkey(), (16, 2))
    ys = jnp.sin(xs[:, 0]) * xs[:, 1]

    def member_loss(x_batch, y_batch):
        preds = jax.vmap(ensemble)(x_batch)
        return jnp.mean((preds - y_batch) ** 2)

    @es.transform.vmap(in_states={0: params}, in_axes=None)
    def losses(x_batch, y_batch):
        return member_loss(x_batch, y_batch)

    before = losses(xs, ys)
    assert before.shape == (8,) and len(set(before.tolist())) == 8

    optimizer = optax.adam(3e-2)
    opt_state = optimizer.init(es.values_of(ensemble, es.ParamState))
    loss_and_grad = es.transform.jit(
        es.transform.value_and_grad(
            lambda x, y: losses(x, y).sum(), grad_states=es.ParamState
        )
    )
    for _ in range(30):
        _, grads = loss_and_grad(xs, ys)
        current = es.values_of(ensemble, es.ParamState)
        updates, opt_state = optimizer.update(grads, opt_state, current)
        es.assign(optax.apply_updates(current, updates))

    after = losses(xs, ys)
    assert (after < before).all()
    w1 = ensemble.w1.value
    assert len({tuple(r.ravel().tolist()) for r in w1}) == 8


def test_state_to_exclude_sees_the_creators_tag_even_with_a_state_tag():
    def ctor():
        w = es.ParamState(es.random.normal((3,)))
        lr = es.State(jnp.array(0.1), name="lr", tag="hyper")
        return w, lr

    w, lr = es.transform.vmap_new_states(
        ctor, axis_size=4, state_tag="ensemble", state_to_exclude="hyper"
    )()
    assert lr.value.shape == () and w.value.shape == (4, 3)
    assert lr.tag == "ensemble" and w.tag == "ensemble"


@pytest.mark.parametrize("inner_tag", [None, "inner"])
def test_a_state_tagged_init_no_batching_stays_replicated_in_every_enclosing_build(
    inner_tag,
):
    # `state_tag` replaces the tag, but the state stays one the builds replicate.
    def inner():
        return es.State(
            jnp.arange(2.0), name="shared", tag=es.transform.INIT_NO_BATCHING
        )

    def outer():
        return es.transform.vmap_new_states(inner, axis_size=3, state_tag=inner_tag)()

    shared = es.transform.vmap_new_states(outer, axis_size=4, state_tag="outer")()
    assert shared.value.shape == (2,) and shared.tag == "outer"
    assert (shared.value == jnp.arange(2.0)).all()
    # Excluded by the inner build alone: the outer one stacks it, as any state.
    excluded = es.transform.vmap_new_states(
        lambda: es.transform.vmap_new_states(
            lambda: es.State(jnp.zeros(2), name="kept", tag="keep"),
            axis_size=3,
            state_to_exclude="keep",
        )(),
        axis_size=4,
    )()
    assert excluded.value.shape == (4, 2)


def _member_keys(shared: es.RandomState) -> dict:
    """Every key a lane hands out: to the default random state's draws, to two new
    random states seeded alike, and to a pre-existing random state it reads."""
    own, other = es.RandomState(0, name="own"), es.RandomState(0, name="other")
    keys = {
        "default": es.random.split_key(),
        "default_again": es.random.split_key(2),
        "own": own.value,
        "other": other.value,
        "shared": shared.value,
        "own_draw": own.split_key(),
        "other_draw": other.split_key(),
        "shared_draw": shared.split_key(),
    }
    keys["default_last"] = es.random.split_key()
    keys["own_last"], keys["other_last"] = own.value, other.value
    return keys


@pytest.mark.parametrize("jit", (False, True))
def test_no_two_consumers_in_any_of_1000_lanes_share_a_key(getkey, jit):
    es.random.set_key(getkey())
    shared = es.RandomState(getkey(), name="shared")
    build = es.transform.vmap_new_states(lambda: _member_keys(shared), axis_size=1000)
    keys = (es.transform.jit(build) if jit else build)()
    data = [jax.random.key_data(k).reshape(-1, 2) for k in jax.tree.leaves(keys)]
    data.append(jax.random.key_data(es.random.get_key()).reshape(-1, 2))
    rows = jnp.concatenate(data).tolist()
    assert len(rows) == 1000 * 12 + 1  # 12 keys a lane, and the outer key
    assert len({tuple(r) for r in rows}) == len(rows)


def test_a_seed_given_in_every_lane_is_replaced_by_a_per_lane_key(getkey):
    # The documented rule (docs/how-to/random.md): the seed is not used, so building
    # with another seed gives the same keys; the default key decides them.
    key = getkey()
    built = []
    for seed in (0, 1):
        es.random.set_key(key)
        rng = es.transform.vmap_new_states(
            lambda seed=seed: es.RandomState(seed), axis_size=4
        )()
        built.append(jax.random.key_data(rng.value))
    assert (built[0] == built[1]).all()
    lanes = jax.random.split(jax.random.split(key)[1], 4)
    others = jax.vmap(lambda k: jax.random.split(k)[1])(lanes)
    expected = jax.vmap(lambda k: jax.random.fold_in(k, 0))(others)
    assert (built[0] == jax.random.key_data(expected)).all()


def test_keys_that_differ_across_lanes_are_kept(getkey):
    chosen = jax.random.split(getkey(), 3)
    rng = es.transform.vmap_new_states(lambda k: es.RandomState(k))(chosen)
    assert tree_bitwise_equal(rng.value, chosen)


def test_a_shared_batch_of_keys_is_rekeyed_per_lane_keeping_its_shape(getkey):
    shared = jax.random.split(getkey(), 3)
    rng = es.transform.vmap_new_states(lambda: es.RandomState(shared), axis_size=4)()
    assert rng.value.shape == (4, 3)
    rows = jax.random.key_data(rng.value).reshape(-1, 2).tolist()
    assert len({tuple(r) for r in rows}) == 4 * 3


def _seeded_member():
    rng = es.RandomState(0, name="rng")
    return es.ParamState(jr.normal(rng.split_key(), (2,)), name="w"), rng


def _bits(value):
    """A value as bits to compare: a typed key as its data."""
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(value)
    return value


def _seeded_member_drawing_from_the_default_key():
    # Reading the default key makes the two-pass fallback trace a nested transform
    # twice: the first pass must not use up re-keying indices.
    b = es.ParamState(es.random.normal((2,)), name="b")
    return (*_seeded_member(), b, es.RandomState(1, name="other"))


@pytest.mark.parametrize(
    "nest",
    (
        es.transform.jit,
        es.transform.checkpoint,
        lambda f: es.transform.jit(es.transform.jit(f)),
    ),
)
@pytest.mark.parametrize(
    "member", (_seeded_member, _seeded_member_drawing_from_the_default_key)
)
def test_a_seed_in_a_nested_transform_is_rekeyed_before_its_draws(
    getkey, nest, member, tracing_mode
):
    # The seeded state is re-keyed when the nested trace creates it, not when it is
    # committed after the draws: the build equals the unnested one bit for bit, in
    # either tracing mode.
    key = getkey()
    built = []
    for ctor in (member, nest(member)):
        es.random.set_key(key)
        states = es.transform.vmap_new_states(ctor, axis_size=3)()
        built.append([_bits(s.value) for s in states])
    assert tree_bitwise_equal(built[0], built[1])
    assert len({tuple(r) for r in built[1][0].tolist()}) == 3


def test_a_traced_shared_key_made_in_a_nested_transform_is_an_error():
    # A traced seed may or may not differ across lanes: it cannot be re-keyed before
    # the nested transform draws from it, so it is refused rather than shared.
    def member(seed):
        rng = es.RandomState(seed, name="rng")
        return es.ParamState(jr.normal(rng.split_key(), (2,)))

    build = es.transform.vmap_new_states(
        es.transform.jit(member), in_axes=None, axis_size=3
    )
    with pytest.raises(es.BatchAxisError, match=r"RandomState 'rng'.*nested"):
        build(0)


def test_a_literal_key_in_a_nested_transform_is_refused_pointing_to_a_seed():
    # Eagerly `RandomState(jax.random.key(0))` is re-keyed per lane; inside a nested
    # `jit` that key is traced, so the error says to pass the integer seed.
    build = es.transform.vmap_new_states(
        es.transform.jit(lambda: es.RandomState(jr.key(0), name="rng")), axis_size=3
    )
    with pytest.raises(es.BatchAxisError, match=r"integer seed.*already traced"):
        build()
    eager = es.transform.vmap_new_states(
        lambda: es.RandomState(jr.key(0)), axis_size=3
    )()
    assert len({tuple(r) for r in jax.random.key_data(eager.value).tolist()}) == 3


@pytest.mark.parametrize("new_first", (True, False))
def test_a_refused_nested_call_in_a_build_writes_nothing(new_first):
    # The nested call writes a state of the lane and a state that existed before
    # the build (refused): the lane's state keeps its value, in either order.
    existing = es.ShortTermState(jnp.zeros(()), name="existing")

    def member():
        p = es.ParamState(jnp.zeros(()), name="p")

        def inner():
            for s in (p, existing) if new_first else (existing, p):
                s.value = s.value + 1.0

        with pytest.raises(es.TraceContextError, match="existing"):
            es.transform.jit(inner)()
        return p

    p = es.transform.vmap_new_states(member, axis_size=3)()
    assert (p.value == 0).all() and existing.value == 0


def test_eval_shape_of_a_seeded_constructor_inside_a_build():
    def member():
        shapes, (w, _) = es.transform.eval_shape(
            _seeded_member, return_state_shapes=True
        )
        assert shapes[w].shape == (2,)
        return _seeded_member()

    w, _ = es.transform.vmap_new_states(member, axis_size=3)()
    assert len({tuple(r) for r in w.value.tolist()}) == 3


def test_a_pre_existing_batch_of_keys_is_read_per_lane_keeping_its_shape(getkey):
    # As the lane frame's docstring promises: a batch of the same shape, per lane.
    noise = es.RandomState(jax.random.split(getkey(), 3), name="noise")
    draws = es.transform.vmap_new_states(
        lambda: es.ParamState(jax.vmap(lambda k: jr.normal(k, (2,)))(noise.value)),
        axis_size=4,
    )()
    assert draws.value.shape == (4, 3, 2)
    assert len({tuple(r) for r in draws.value.reshape(-1, 2).tolist()}) == 4 * 3


def _impl(keys):
    return jax.random.key_impl(keys)


def test_vmap_new_states_keeps_the_prng_implementation_of_random_states():
    rbg = _impl(jr.key(0, impl="rbg"))
    before = es.RandomState(jr.key(1, impl="rbg"), name="before")
    seen = []

    def member():
        seen.append(_impl(before.value))
        rng = es.RandomState(jr.key(0, impl="rbg"), name="rng")
        return es.ParamState(jr.normal(rng.split_key(), (2,)), name="w"), rng

    w, rng = es.transform.vmap_new_states(member, axis_size=3)()
    assert seen == [rbg] and _impl(rng.value) == rbg
    assert rng.value.shape == (3,) and len({tuple(x) for x in w.value.tolist()}) == 3
    rng.value = jr.split(jr.key(2, impl="rbg"), 3)  # still takes its own kind


@pytest.mark.parametrize("jitted", (False, True))
@pytest.mark.parametrize("how", ("state_to_exclude", "INIT_NO_BATCHING"))
def test_a_replicated_random_state_is_shared_by_every_member(how, jitted):
    tag = es.transform.INIT_NO_BATCHING if how == "INIT_NO_BATCHING" else "shared"

    def member():
        rng = es.RandomState(0, name="rng", tag=tag)
        w = es.ParamState(es.random.normal((2,)), name="w")
        return w, rng, jr.normal(rng.split_key(), (2,))

    build = es.transform.jit(member) if jitted else member
    w, rng, draws = es.transform.vmap_new_states(
        build, axis_size=3, state_to_exclude="shared"
    )()
    assert rng.value.shape == ()
    first, successor = jr.split(jr.key(0))[1], jr.split(jr.key(0))[0]
    assert tree_bitwise_equal(draws, jnp.stack([jr.normal(first, (2,))] * 3))
    assert tree_bitwise_equal(jr.key_data(rng.value), jr.key_data(successor))
    assert not (w.value[0] == w.value[1]).all()


def test_vmap2_new_states_leaves_the_default_key_as_it_was_when_the_build_fails():
    def member(fail):
        w = es.ParamState(es.random.normal((2,)), name="w")
        if fail:
            raise RuntimeError("no")
        return w

    make = es.transform.vmap2_new_states(member, in_axes=None, axis_size=3)
    es.random.seed(7)
    with pytest.raises(RuntimeError, match="no"):
        make(True)
    w, states = make(False)
    es.random.seed(7)
    w2, states2 = make(False)
    assert tree_bitwise_equal(states[w], states2[w2])


def test_a_batch_of_keys_of_another_implementation_is_re_keyed_in_it():
    def member():
        keys = jr.split(jr.key(0, impl="rbg"), 2)
        return es.RandomState(keys, name="rngs")

    rngs = es.transform.vmap_new_states(member, axis_size=3)()
    assert rngs.value.shape == (3, 2) and _impl(rngs.value) == _impl(
        jr.key(0, impl="rbg")
    )
    data = jr.key_data(rngs.value).reshape(6, -1)
    assert len({tuple(row) for row in data.tolist()}) == 6


@pytest.mark.parametrize("out_axes", (0, eqx.if_array(0)), ids=("zero", "if_array"))
def test_member_takes_an_ensemble_whose_arrays_are_stacked_first(out_axes):
    def make(key):
        return {"w": es.ParamState(jnp.zeros(3)), "lin": eqx.nn.Linear(3, 3, key=key)}

    ensemble = es.transform.vmap_new_states(make, out_axes=out_axes)(
        jr.split(jr.key(0), 2)
    )
    one = es.member(ensemble, 1)
    assert tree_bitwise_equal(one["lin"].weight, ensemble["lin"].weight[1])


def test_member_of_an_ensemble_of_ensembles_follows_the_outer_build():
    class Leaf(eqx.Module):
        w: jax.Array
        s: es.ParamState

        def __init__(self):
            self.w = es.random.normal((2,))
            self.s = es.ParamState(es.random.normal((2,)), name="s")

    def inner():  # its members stacked along axis 1 of its arrays
        return es.transform.vmap_new_states(Leaf, axis_size=3, out_axes=1)()

    outer = es.transform.vmap_new_states(inner, axis_size=4)()
    one = es.member(outer, 1)
    assert tree_bitwise_equal(one.w, outer.w[1])
    assert tree_bitwise_equal(one.s.value, outer.s.value[1])
    with pytest.raises(IndexError, match="ensemble of 4"):
        es.member(outer, 4)


@pytest.mark.parametrize("read_first", [False, True])
def test_a_snapshot_of_the_world_in_a_lane_keeps_a_random_state_as_it_was(read_first):
    r = es.RandomState(7, name="r")

    def build():
        if read_first:
            r.value
        snapshot = es.world()
        before = jr.key_data(r.value)
        r.split_key()
        return es.ParamState(jnp.zeros(1)), before, jr.key_data(snapshot[r])

    _, before, seen = es.transform.vmap_new_states(build, axis_size=2)()
    assert tree_bitwise_equal(seen, before)
    assert not (before[0] == before[1]).all()


@pytest.mark.parametrize("raw", (jax.vmap, jax.jit))
def test_a_build_under_a_raw_jax_transform_says_it_cannot_create_states_there(raw):
    build = es.transform.vmap_new_states(
        lambda x: es.ParamState(2 * x), axis_size=3, in_axes=None
    )
    key = jax.random.key_data(es.random.DEFAULT.value)
    with pytest.raises(
        es.TraceContextError,
        match=r"Cannot create the states of an ensemble inside a raw JAX transform",
    ):
        raw(build)(jnp.ones(2))
    assert tree_bitwise_equal(jax.random.key_data(es.random.DEFAULT.value), key)
    assert build(jnp.ones(2)).value.shape == (3, 2)  # eagerly, it builds
