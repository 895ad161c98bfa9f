"""`eqstate.clone`, `eqstate.member`, `copy.deepcopy` and Equinox serialisation of
models holding handles."""

import collections
import copy
import os
import tempfile

import eqstate as es
import eqstate.nn as enn
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import pytest
from equinox._serialisation import TreePathError

from .helpers import tree_bitwise_equal, unchecked


class _Model(eqx.Module):
    linear: eqx.nn.Linear
    bn: enn.BatchNorm
    steps: es.ShortTermState
    shared: es.ShortTermState  # the same handle as `steps`
    scale: es.NonBatchState

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 4, key=key)
        self.bn = enn.BatchNorm(4)
        self.steps = es.ShortTermState(jnp.array(0), name="steps", tag="counter")
        self.shared = self.steps
        self.scale = es.NonBatchState(jnp.array(2.0), name="scale")

    def __call__(self, x):
        self.steps.value = self.steps.value + 1
        return self.bn(jax.vmap(self.linear)(x)) * self.scale.value


def _values(tree):
    return [s.value for s in es.states_of(tree)]


def test_clone_gives_fresh_handles_with_the_same_kinds_tags_names_and_values(getkey):
    model = _Model(getkey())
    model(jr.normal(getkey(), (8, 3)))
    clone = es.clone(model)
    old, new = es.states_of(model), es.states_of(clone)
    assert len(old) == len(new) == 6
    for a, b in zip(old, new):
        assert a is not b
        assert (type(a), a.tag, a.name) == (type(b), b.tag, b.name)
    assert tree_bitwise_equal(_values(clone), _values(model))
    assert clone.shared is clone.steps  # sharing inside the tree is kept
    assert clone.linear.weight is model.linear.weight  # arrays are immutable: kept


def test_writes_to_a_clone_and_to_its_original_are_independent(getkey):
    model = _Model(getkey())
    clone = es.clone(model)
    before = _values(model)
    clone(jr.normal(getkey(), (8, 3)))
    assert tree_bitwise_equal(_values(model), before)
    assert clone.steps.value == 1
    model(jr.normal(getkey(), (8, 3)))
    model(jr.normal(getkey(), (8, 3)))
    assert clone.steps.value == 1 and model.steps.value == 2


def test_a_clone_keeps_its_values_when_the_original_is_donated(getkey):
    w = es.ParamState(jr.normal(getkey(), (3,)), name="w")
    clone = es.clone(w)
    expected = w.value + 0

    @es.transform.jit(donate_states=True)
    def bump():
        w.value = w.value + 1

    bump()
    assert tree_bitwise_equal(clone.value, expected)


def test_clone_inside_a_scope_adds_the_new_states_to_the_scope(getkey):
    model, states = es.make_with_states(_Model)(getkey())
    world_before = set(es.world().states)
    with es.scope(states) as sc:
        clone = es.clone(model)
    assert set(es.world().states) == world_before
    assert sc.states is not None
    assert set(es.states_of(clone)) <= set(sc.states.states)
    assert tree_bitwise_equal(
        [sc.states[s] for s in es.states_of(clone)],
        [states[s] for s in es.states_of(model)],
    )


def test_clone_inside_a_jitted_function_returns_fresh_handles(getkey):
    model = _Model(getkey())
    make = es.transform.jit(lambda: es.clone(model))
    a, b = make(), make()
    assert a.bn.running_mean is not b.bn.running_mean
    assert tree_bitwise_equal(_values(a), _values(model))


def test_member_inside_a_jitted_function_returns_fresh_handles():
    # What the docstrings of `clone` and `member` recommend over `eqx.filter_jit`.
    ensemble = es.transform.vmap_new_states(lambda: enn.BatchNorm(3), axis_size=2)()
    take = es.transform.jit(es.member, static_argnums=1)
    a, b = take(ensemble, 1), take(ensemble, 1)
    assert a.running_mean is not b.running_mean


def test_clone_of_a_tree_without_handles_is_the_tree(getkey):
    tree = {"x": jnp.ones(2), "n": 3}
    assert es.clone(tree) is tree


def test_clone_of_a_state_without_a_value_raises_and_registers_nothing(getkey):
    model, _ = es.make_with_states(_Model)(getkey())
    before = set(es.world().states)
    with pytest.raises(es.StateNotFoundError, match="has no value in the world"):
        es.clone(model)
    assert set(es.world().states) == before


def test_deepcopy_of_a_handle_points_to_clone(getkey):
    model = _Model(getkey())
    with pytest.raises(TypeError, match=r"Cannot deep-copy .*eqstate.clone\(tree\)"):
        copy.deepcopy(model)
    assert copy.copy(model.steps) is model.steps


# --- member ----------------------------------------------------------------------------


def _member_ctor(key):
    return _Model(key)


def test_member_is_bitwise_its_lane_and_independent_of_the_ensemble(getkey):
    keys = jr.split(getkey(), 4)
    ensemble = es.transform.vmap_new_states(_member_ctor, axis_size=4)(keys)
    x = jr.normal(getkey(), (8, 3))
    third = es.member(ensemble, 2)
    for state, original in zip(es.states_of(third), es.states_of(ensemble)):
        expected = (
            original.value
            if isinstance(original, es.NonBatchState)
            else (original.value[2])
        )
        assert tree_bitwise_equal(state.value, expected)
        assert state is not original and state.name == original.name
    assert third.bn.running_mean.value.shape == (4,) and third.scale.value.shape == ()
    assert es.member(ensemble, -2).bn.weight is not None
    assert tree_bitwise_equal(
        _values(es.member(ensemble, -2)), _values(es.member(ensemble, 2))
    )

    before = _values(ensemble)
    third(x)
    assert tree_bitwise_equal(_values(ensemble), before)


def test_member_matches_the_lane_of_the_vmapped_ensemble(getkey):
    def make():
        return enn.GRUCell(3, 5)

    ensemble = es.transform.vmap_new_states(make, axis_size=6)()
    xs = jr.normal(getkey(), (7, 3))
    lanes = es.transform.vmap(
        lambda xs: es.transform.for_loop(ensemble, xs),
        in_states={0: es.states_of(ensemble)},
        in_axes=None,
    )
    alone = es.member(es.clone(ensemble), 4)
    lane = lanes(xs)[4]
    assert jnp.allclose(es.transform.for_loop(alone, xs), lane, rtol=1e-6, atol=1e-6)


def test_member_of_an_ensemble_in_a_state_dict_with_run(getkey):
    keys = jr.split(getkey(), 3)
    ensemble, states = es.transform.vmap2_new_states(
        _member_ctor, axis_size=3, in_axes=0
    )(keys)
    new_states, first = es.run(es.member, states, ensemble, 0)
    mine = new_states.filter(es.states_of(first))
    assert len(mine) == 6
    assert tree_bitwise_equal(
        mine[first.bn.weight],
        states[ensemble.bn.weight][0],  # pyright: ignore
    )


def test_member_copies_excluded_states_whole_without_being_told(getkey):
    def make():
        return {
            "w": es.ParamState(es.random.normal((2,)), name="w"),
            "lr": es.State(jnp.array([0.1, 0.2, 0.3]), name="lr", tag="hyper"),
        }

    ensemble = es.transform.vmap_new_states(
        make, axis_size=4, state_to_exclude="hyper"
    )()
    for shared in (es.NonBatchState, (es.NonBatchState, "hyper")):
        one = es.member(ensemble, 3, shared=shared)
        assert tree_bitwise_equal(one["lr"].value, ensemble["lr"].value)
        assert tree_bitwise_equal(one["w"].value, ensemble["w"].value[3])


class _Tuned(eqx.Module):
    w: es.ParamState
    lr: es.State

    def __init__(self, scale=1.0):
        self.w = es.ParamState(es.random.normal((2,)) * scale, name="w")
        self.lr = es.State(jnp.arange(4.0) * 0.1, name="lr", tag="hyper")


def test_a_member_of_a_member_copies_whole_what_the_inner_build_replicated():
    # The outer build stacks `lr`, which the inner one replicated: only the outer
    # build's decision was recorded, so the member of a member took element 2 of
    # `lr` (whose length happens to be the inner size) for a whole value.
    inner = es.transform.vmap_new_states(_Tuned, axis_size=4, state_to_exclude="hyper")
    outer = es.transform.vmap_new_states(inner, axis_size=2)()
    assert outer.lr.value.shape == (2, 4) and outer.w.value.shape == (2, 4, 2)
    one = es.member(outer, 1)
    assert tree_bitwise_equal(one.lr.value, outer.lr.value[1])
    two = es.member(one, 2)
    assert tree_bitwise_equal(two.lr.value, outer.lr.value[1])
    assert tree_bitwise_equal(two.w.value, outer.w.value[1, 2])


def test_a_member_of_a_member_slices_what_the_outer_build_replicated():
    # The other way round: the outer build replicates `w`, which the inner one
    # stacked; the member of a member must take its own row of it.
    def make(scale):
        return {
            "w": es.ParamState(jnp.full(2, scale), name="w", tag="fixed"),
            "b": es.ParamState(es.random.normal((3,)), name="b"),
        }

    def build():
        return es.transform.vmap_new_states(make, axis_size=4)(jnp.arange(4.0))

    outer = es.transform.vmap_new_states(build, axis_size=2, state_to_exclude="fixed")()
    assert outer["w"].value.shape == (4, 2) and outer["b"].value.shape == (2, 4, 3)
    one = es.member(outer, 1)
    assert tree_bitwise_equal(one["w"].value, outer["w"].value)
    two = es.member(one, 2)
    assert tree_bitwise_equal(two["w"].value, outer["w"].value[2])
    assert tree_bitwise_equal(two["b"].value, outer["b"].value[1, 2])


@pytest.mark.parametrize("index", [True, False, "1", 1.0])
def test_member_refuses_an_index_that_is_not_an_integer(index):
    # `operator.index(True)` is 1: a mask by mistake would give member 1 silently.
    ensemble = es.transform.vmap_new_states(_Tuned, axis_size=2)()
    with pytest.raises(TypeError, match=rf"`index` must be an integer, got {index!r}"):
        unchecked(es.member)(ensemble, index)


def test_member_of_a_hand_stacked_ensemble_needs_its_shared_states_named():
    stacked = {
        "w": es.ParamState(jnp.zeros((4, 2)), name="w"),
        "lr": es.State(jnp.array([0.1, 0.2, 0.3]), name="lr", tag="hyper"),
    }
    with pytest.raises(ValueError, match=r"different sizes .*State 'lr'.*shared="):
        es.member(stacked, 0)
    one = es.member(stacked, 3, shared="hyper")
    assert tree_bitwise_equal(one["lr"].value, stacked["lr"].value)


def test_member_gives_a_shared_predicate_each_state_path():
    stacked = {
        "w": es.ParamState(jnp.arange(6.0).reshape(3, 2), name="w"),
        "scale": es.State(jnp.array([10.0, 20.0, 30.0]), name="scale"),
    }
    seen = []

    def by_path(path, state):
        seen.append(jax.tree_util.keystr(path))
        return "scale" in jax.tree_util.keystr(path)

    one = es.member(stacked, 1, shared=by_path)
    assert sorted(seen) == ["['scale']", "['w']"]
    assert tree_bitwise_equal(one["scale"].value, stacked["scale"].value)
    assert tree_bitwise_equal(one["w"].value, stacked["w"].value[1])


def test_member_copies_whole_a_state_that_existed_before_the_build():
    table = es.ParamState(jnp.array([10.0, 20.0, 30.0]), name="table")

    def make():
        return {"w": es.ParamState(es.random.normal(()), name="w"), "table": table}

    ensemble = es.transform.vmap_new_states(make, axis_size=3)()
    lanes = es.transform.vmap(
        lambda m: m["w"].value * m["table"].value, in_states={0: ensemble["w"]}
    )(ensemble)
    one = es.member(ensemble, 1)
    assert tree_bitwise_equal(one["table"].value, table.value)
    assert tree_bitwise_equal(one["w"].value * one["table"].value, lanes[1])


class _WithOptimiser(eqx.Module):
    w: es.ParamState
    opt_state: es.LongTermState

    def __init__(self):
        self.w = es.ParamState(jnp.array([1.0, 2.0]), name="w")
        self.opt_state = es.LongTermState(optax.adam(0.1).init(es.trainable(self)[0]))


def _adam_step(model):
    optimizer = optax.adam(0.1)
    grads = es.transform.grad(
        lambda: jnp.sum(model.w.value**2), grad_states=es.ParamState
    )()
    params = es.trainable(model)[0]
    updates, model.opt_state.value = optimizer.update(
        grads, model.opt_state.value, params
    )
    es.assign(optax.apply_updates(params, updates))


def _ensemble_of_two():
    return es.transform.vmap_new_states(_WithOptimiser, axis_size=2)()


@pytest.mark.parametrize(
    "make",
    [
        lambda: es.clone(_WithOptimiser()),
        lambda: es.member(_ensemble_of_two(), 1),
        es.transform.jit(_WithOptimiser),
        lambda: es.member(es.transform.jit(_ensemble_of_two)(), 1),
    ],
    ids=["clone", "member", "jitted-build", "member-of-jitted-ensemble"],
)
@pytest.mark.numpy_promotion("optax.adam: a Python float to an int32 power")
def test_state_dicts_inside_values_follow_their_states_to_new_handles(make):
    eager = _WithOptimiser()
    model = make()
    keys = jax.tree.leaves(
        model.opt_state.value, is_leaf=lambda x: isinstance(x, es.StateDict)
    )
    assert all(sd.states == (model.w,) for sd in keys if isinstance(sd, es.StateDict))
    before = eager.w.value
    _adam_step(model)  # an optimiser's state keyed by the old handles cannot train
    _adam_step(eager)
    assert tree_bitwise_equal(model.w.value, eager.w.value)
    assert not tree_bitwise_equal(model.w.value, before)


def test_restoring_a_snapshot_held_by_a_clone_writes_the_clone(getkey):
    w = es.ParamState(jnp.array([1.0, 2.0]), name="w")
    model = {"w": w, "best": es.LongTermState(es.values_of({"w": w}))}
    twin = es.clone(model)
    twin["w"].value = jnp.array([9.0, 9.0])
    es.assign(twin["best"].value)
    assert tree_bitwise_equal(twin["w"].value, jnp.array([1.0, 2.0]))
    assert tree_bitwise_equal(w.value, jnp.array([1.0, 2.0]))
    w.value = jnp.array([5.0, 5.0])
    es.assign(twin["best"].value)
    assert tree_bitwise_equal(w.value, jnp.array([5.0, 5.0]))


def test_member_slices_a_stacked_state_added_to_an_ensemble_after_the_build():
    def make():
        return {"w": es.ParamState(es.random.normal((2,)), name="w"), "head": None}

    ensemble = es.transform.vmap_new_states(make, axis_size=3)()
    head = es.ParamState(jnp.arange(6.0).reshape(3, 2), name="head")
    ensemble = {**ensemble, "head": head}  # stacked by hand, after the build
    one = es.member(ensemble, 1)
    assert tree_bitwise_equal(one["head"].value, head.value[1])
    assert tree_bitwise_equal(one["w"].value, ensemble["w"].value[1])


# --- Equinox serialisation ------------------------------------------------------------


def test_eqx_serialisation_of_handles_is_refused_with_the_recipe(getkey):
    model = _Model(getkey())
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.eqx")
        with open(path, "wb") as f:
            f.write(b"an earlier checkpoint")
        with pytest.raises(TreePathError) as info:
            eqx.tree_serialise_leaves(path, model)
        assert isinstance(info.value.__cause__, TreePathError)
        cause = info.value.__cause__.__cause__
        assert isinstance(cause, TypeError)
        assert "eqx.tree_serialise_leaves` met LongTermState 'running_mean'" in str(
            cause
        )
        assert "eqstate.save(path, model)" in str(cause)
        # Equinox truncates the file before it meets a handle: the message says so.
        assert "a file that was at that path is now truncated" in str(cause)
        with open(path, "rb") as f:
            assert b"an earlier checkpoint" not in f.read()
        with pytest.raises(TreePathError) as info:
            eqx.tree_deserialise_leaves(path, model)
        cause = info.value.__cause__.__cause__  # pyright: ignore
        assert "eqx.tree_deserialise_leaves` met" in str(cause)
        assert "model = eqstate.load(path, model)" in str(cause)


def _serialise_recipe(path, model):
    values = [s.value for s in es.states_of(model)]
    eqx.tree_serialise_leaves(path, (eqx.filter(model, eqx.is_array), values))


def _deserialise_recipe(path, fresh):
    states = es.states_of(fresh)
    like = (eqx.filter(fresh, eqx.is_array), [s.value for s in states])
    arrays, values = eqx.tree_deserialise_leaves(path, like)
    es.assign(dict(zip(states, values)))
    return eqx.combine(arrays, fresh)


def test_eqx_serialisation_recipe_round_trips_arrays_and_states_bitwise(getkey):
    model = _Model(getkey())
    model(jr.normal(getkey(), (8, 3)))
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.eqx")
        _serialise_recipe(path, model)
        restored = _deserialise_recipe(path, _Model(getkey()))
    assert tree_bitwise_equal(restored.linear, model.linear)
    assert tree_bitwise_equal(_values(restored), _values(model))


def test_eqx_serialisation_recipe_matches_states_by_place_not_creation_order():
    # A state replaced after the model was built is newer than its neighbours: a
    # `StateDict` would flatten it last and load it into the other state.
    class Two(eqx.Module):
        a: es.State
        b: es.State

        def __init__(self):
            self.a, self.b = es.State(jnp.zeros(2)), es.State(jnp.zeros(2))

    model = eqx.tree_at(lambda m: m.a, Two(), es.State(jnp.ones(2)))
    model.b.value = jnp.full(2, 2.0)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.eqx")
        _serialise_recipe(path, model)
        restored = _deserialise_recipe(path, Two())
    assert tree_bitwise_equal(restored.a.value, jnp.ones(2))
    assert tree_bitwise_equal(restored.b.value, jnp.full(2, 2.0))


class _Autoencoder(eqx.Module):
    encoder: es.ParamState  # declared first, created second
    decoder: es.ParamState

    def __init__(self, encoder, decoder):
        self.decoder = es.ParamState(decoder)
        self.encoder = es.ParamState(encoder)


@pytest.mark.parametrize("make_clone", (es.clone, es.transform.jit(es.clone)))
def test_a_clone_flattens_its_state_dict_like_the_original(make_clone):
    # A StateDict flattens in the creation order of its handles; Equinox's
    # serialisation matches leaves by that order, from a model into its clone too.
    model = _Autoencoder(jnp.full(3, 1.0), jnp.full(3, 2.0))
    twin = make_clone(model)
    assert tree_bitwise_equal(
        jax.tree.leaves(es.values_of(twin)), jax.tree.leaves(es.values_of(model))
    )
    twin.encoder.value, twin.decoder.value = jnp.zeros(3), jnp.zeros(3)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.eqx")
        eqx.tree_serialise_leaves(path, es.values_of(model))
        es.assign(eqx.tree_deserialise_leaves(path, es.values_of(twin)))
    assert (twin.encoder.value == 1).all() and (twin.decoder.value == 2).all()


@pytest.mark.parametrize("jitted", (False, True))
def test_a_member_flattens_its_state_dict_like_the_ensemble(jitted):
    ensemble = es.transform.vmap_new_states(
        lambda: _Autoencoder(es.random.normal((3,)), es.random.normal((3,))),
        axis_size=2,
    )()
    take = es.transform.jit(es.member, static_argnums=1) if jitted else es.member
    one = take(ensemble, 1)
    expected = [x[1] for x in jax.tree.leaves(es.values_of(ensemble))]
    assert tree_bitwise_equal(jax.tree.leaves(es.values_of(one)), expected)


@pytest.mark.parametrize("make_clone", (es.clone, es.transform.jit(es.clone)))
def test_a_clone_takes_its_originals_place_among_other_states(make_clone):
    # A snapshot of the model's states and of one made between them: the clone's
    # snapshot must flatten like the original's, or a file saved from the one loads
    # into the wrong states of the other.
    first = es.State(jnp.full(2, 1.0), name="first")
    between = es.State(jnp.full(2, 2.0), name="between")
    last = es.State(jnp.full(2, 3.0), name="last")
    model = [last, first]
    twin = make_clone(model)
    twice = make_clone(twin)
    for copied in (twin, twice):
        snapshot = es.values_of([*copied, between])
        assert [s.name for s in jax.tree.structure(snapshot).node_data()[1]] == [
            "first",
            "between",
            "last",
        ]
        leaves = jax.tree.leaves(snapshot)
        assert [float(x[0]) for x in leaves] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("jitted", (False, True))
def test_states_a_function_creates_are_created_by_each_call_jitted_or_not(jitted):
    # Built twice, a model of two states flattens call by call, as eager code does.
    def make(i):
        a = es.State(jnp.full(2, 10.0 * i + 1), name="a")
        return a, es.State(jnp.full(2, 10.0 * i + 2), name="b")

    make = es.transform.jit(make, static_argnums=0) if jitted else make
    first, second = make(1), make(2)
    other = es.State(jnp.zeros(2), name="other")
    third = make(3)
    leaves = jax.tree.leaves(es.values_of([third, other, second, first]))
    assert [float(x[0]) for x in leaves] == [11, 12, 21, 22, 0, 31, 32]


def test_a_clone_of_a_clone_sorts_before_another_clone_of_the_original():
    base = es.State(jnp.zeros(2), name="base")
    a, b = es.clone(base), es.clone(base)
    a.value, b.value = jnp.full(2, 1.0), jnp.full(2, 2.0)
    again = es.clone(a)
    before = jax.tree.leaves(es.values_of([b, a]))
    after = jax.tree.leaves(es.values_of([b, again]))
    assert tree_bitwise_equal(before, after)


def test_a_handle_is_not_array_like_to_equinox_or_jax(getkey):
    w = es.ParamState(jnp.zeros(2), name="w")
    assert not eqx.is_array_like(w) and not hasattr(w, "__jax_array__")
    arrays, static = eqx.partition({"w": w, "x": jnp.ones(2)}, eqx.is_array_like)
    assert arrays["w"] is None and static["w"] is w


def test_member_copies_whole_a_state_excluded_by_tag_and_then_retagged():
    # `state_tag` replaces the tag `state_to_exclude` matched on; the member must
    # still know the state was replicated, even when its first axis has K entries.
    def make():
        return {
            "w": es.ParamState(es.random.normal((3,)), name="w"),
            "lr": es.State(jnp.array([0.1, 0.2, 0.3, 0.4]), name="lr", tag="hyper"),
        }

    ensemble = es.transform.vmap_new_states(
        make, axis_size=4, state_tag="ensemble", state_to_exclude="hyper"
    )()
    assert ensemble["lr"].tag == "ensemble"
    for shared in (es.NonBatchState, (es.NonBatchState, "hyper")):
        one = es.member(ensemble, 1, shared=shared)
        assert (one["lr"].value == jnp.array([0.1, 0.2, 0.3, 0.4])).all()
        assert (one["w"].value == ensemble["w"].value[1]).all()


def test_member_copies_whole_a_state_tagged_init_no_batching():
    def make():
        return {
            "w": es.ParamState(es.random.normal((3,)), name="w"),
            "lr": es.State(jnp.arange(4.0), name="lr", tag="INIT_NO_BATCHING"),
        }

    ensemble = es.transform.vmap_new_states(make, axis_size=4, state_tag="ensemble")()
    one = es.member(ensemble, 1)
    assert (one["lr"].value == jnp.arange(4.0)).all()
    assert (one["w"].value == ensemble["w"].value[1]).all()


@pytest.mark.parametrize("route", ["jitted build", "clone", "jitted clone"])
def test_member_copies_replicated_states_whole_after_jit_or_clone(route):
    # The handles a jitted build returns, and clones, are new handles: they must keep
    # the record that `vmap_new_states` replicated the state, even when its first axis
    # has as many entries as the ensemble has members.
    def make():
        return {
            "w": es.ParamState(es.random.normal((3,)), name="w"),
            "table": es.State(jnp.arange(4.0) * 10, name="table", tag="shared"),
        }

    build = es.transform.vmap_new_states(make, axis_size=4, state_to_exclude="shared")
    if route == "jitted build":
        ensemble = es.transform.jit(build)()
    elif route == "clone":
        ensemble = es.clone(build())
    else:
        ensemble = es.transform.jit(es.clone)(build())
    one = es.member(ensemble, 2)
    assert tree_bitwise_equal(one["table"].value, jnp.arange(4.0) * 10)
    assert tree_bitwise_equal(one["w"].value, ensemble["w"].value[2])
    again = es.member(one, 0)  # still whole: a member's copy keeps the record
    assert tree_bitwise_equal(again["table"].value, jnp.arange(4.0) * 10)


def test_member_of_a_tree_holding_the_default_random_state():
    tree = {"w": es.ParamState(jnp.arange(8.0).reshape(4, 2)), "rng": es.random.DEFAULT}
    one = es.member(tree, 1, shared=es.RandomState)
    assert (one["w"].value == jnp.array([2.0, 3.0])).all()
    assert tree_bitwise_equal(
        jax.random.key_data(one["rng"].value),
        jax.random.key_data(es.random.DEFAULT.value),
    )


def test_a_state_returned_by_a_build_is_copied_whole_only_with_that_build():
    # A build that returns a hand-stacked ensemble's handle as a tied table does not
    # change how `member` treats that handle in other trees.
    hand = {"w": es.ParamState(jnp.arange(8.0).reshape(4, 2), name="w")}
    built = es.transform.vmap_new_states(
        lambda: {"table": hand["w"], "p": es.ParamState(es.random.normal())},
        axis_size=3,
    )()
    assert tree_bitwise_equal(es.member(hand, 2)["w"].value, jnp.array([4.0, 5.0]))
    one = es.member(built, 1)
    assert tree_bitwise_equal(one["table"].value, hand["w"].value)
    assert tree_bitwise_equal(
        es.member(es.clone(built), 1)["table"].value, hand["w"].value
    )


def test_member_copies_whole_an_ensemble_that_a_second_build_ties_into_every_member():
    # A state stacked by one build and returned unchanged by a second is shared by
    # every member of the second: each of its lanes reads every row.
    teachers = es.transform.vmap_new_states(
        lambda: es.ParamState(es.random.normal((3,)), name="teacher"), axis_size=4
    )()
    students = es.transform.vmap_new_states(
        lambda: {"w": es.ParamState(es.random.normal((3,))), "teacher": teachers},
        axis_size=4,
    )()
    rows = es.transform.vmap(
        lambda s: s["teacher"].value.shape[0] + 0 * s["w"].value.sum(),
        in_states={0: students["w"]},
    )(students)
    assert (rows == 4).all()
    one = es.member(students, 2)
    assert tree_bitwise_equal(one["teacher"].value, teachers.value)
    assert tree_bitwise_equal(one["w"].value, students["w"].value[2])
    # In the first ensemble, the teacher is still stacked.
    assert tree_bitwise_equal(es.member(teachers, 2).value, teachers.value[2])


def test_member_copies_whole_a_state_that_shared_selects_at_any_of_its_paths():
    # As `states_of(tree, shared)` selects a state found at several paths.
    glob = es.ParamState(jnp.arange(4.0), name="global")
    tree = {
        "a_alias": glob,
        "b": es.ParamState(jnp.arange(8.0).reshape(4, 2)),
        "shared": glob,
    }

    def in_shared(path, state):
        return jax.tree_util.keystr(path).startswith("['shared']")

    assert es.states_of(tree, in_shared) == (glob,)
    one = es.member(tree, 1, shared=in_shared)
    assert tree_bitwise_equal(one["shared"].value, glob.value)
    assert one["a_alias"] is one["shared"]
    assert tree_bitwise_equal(one["b"].value, jnp.array([2.0, 3.0]))


class _Resettable(eqx.Module):
    h: es.ShortTermState
    initial: es.StateDict  # the values `reset` restores

    def __init__(self):
        self.h = es.ShortTermState(es.random.normal((2,)), name="h")
        self.initial = es.values_of(self.h)

    def reset(self):
        es.assign(self.initial)


def test_a_state_dict_held_in_the_tree_follows_its_states_to_the_clone():
    model = _Resettable()
    outside = es.State(jnp.zeros(3), name="outside")
    tree = {"model": model, "both": es.values_of({"h": model.h, "o": outside})}
    twin = es.clone(tree)
    assert twin["model"].initial.states == (twin["model"].h,)
    # A key naming a state outside the cloned tree stays as it is.
    assert twin["both"].states == (twin["model"].h, outside)
    start = model.h.value
    model.h.value = jnp.ones(2)
    twin["model"].h.value = jnp.full(2, 5.0)
    twin["model"].reset()
    assert tree_bitwise_equal(twin["model"].h.value, start)
    assert tree_bitwise_equal(model.h.value, jnp.ones(2))


def test_a_state_dict_held_in_an_ensemble_follows_its_states_to_a_member():
    ensemble = es.transform.vmap_new_states(_Resettable, axis_size=3)()
    one = es.member(ensemble, 1)
    assert one.initial.states == (one.h,)
    assert tree_bitwise_equal(one.initial[one.h], ensemble.h.value[1])
    one.h.value = jnp.zeros(2)
    one.reset()
    assert tree_bitwise_equal(one.h.value, ensemble.h.value[1])


def test_clone_of_a_state_dict_alone_raises_and_shows_how_to_clone_it_with_its_model():
    model = _Resettable()
    with pytest.raises(
        TypeError, match=r"(?s)StateDict.*its own copy.*clone\(\(model, "
    ):
        es.clone(model.initial)
    twin, initial = es.clone((model, model.initial))
    assert initial.states == (twin.h,)


class _PerStateScale(eqx.Module):
    w: es.ParamState
    b: es.ParamState
    scale: dict  # per-parameter settings, keyed by handles
    ordered: collections.OrderedDict

    def __init__(self):
        self.w = es.ParamState(jnp.ones(3), name="w")
        self.b = es.ParamState(jnp.zeros(()), name="b")
        self.scale = {self.w: 0.1, self.b: 1.0}
        self.ordered = collections.OrderedDict([(self.b, 3.0)])


def test_clone_and_member_key_a_dict_keyed_by_handles_by_the_new_handles():
    # As a StateDict in the tree: the copy's settings must refer to its own states,
    # else `for s, k in copy.scale.items(): s.value *= k` would change the original.
    model = _PerStateScale()
    twin = es.clone(model)
    assert set(twin.scale) == {twin.w, twin.b} and twin.scale[twin.w] == 0.1
    assert type(twin.ordered) is collections.OrderedDict
    assert list(twin.ordered) == [twin.b]
    for state, factor in twin.scale.items():
        state.value = state.value * factor + 1
    assert (model.w.value == 1).all() and model.b.value == 0
    ensemble = es.transform.vmap_new_states(_PerStateScale, axis_size=2)()
    one = es.member(ensemble, 1)
    assert set(one.scale) == {one.w, one.b}


def test_clone_keeps_a_state_dict_whose_states_are_not_in_the_tree():
    model = _Resettable()
    tree = {"initial": model.initial, "x": jnp.ones(2)}
    assert es.clone(tree) is tree


def test_member_copies_whole_a_shared_states_value_in_a_state_dict_in_the_tree():
    # A snapshot of an ensemble's values taken with it: the shared state's value is
    # not stacked, so slicing it would give the member a part of it.
    ensemble = es.transform.vmap_new_states(
        lambda: {
            "w": es.ParamState(es.random.normal((2,)), name="w"),
            "table": es.NonBatchState(jnp.arange(4.0) * 10, name="table"),
        },
        axis_size=4,
    )()
    one, snapshot = es.member((ensemble, es.values_of(ensemble)), 2)
    assert tree_bitwise_equal(snapshot[one["table"]], jnp.arange(4.0) * 10)
    assert tree_bitwise_equal(snapshot[one["w"]], ensemble["w"].value[2])
    es.assign(snapshot)  # restores the member as it was
    assert tree_bitwise_equal(one["table"].value, jnp.arange(4.0) * 10)


def test_member_of_an_ensemble_with_its_optimiser_state_names_the_stray_array():
    ensemble = es.transform.vmap_new_states(
        lambda: {"w": es.ParamState(es.random.normal((2,)), name="w")}, axis_size=3
    )()
    opt_state = optax.adam(0.1).init(es.trainable(ensemble))
    with pytest.raises(ValueError, match=r"\.count holds i32\[\].*ensemble alone"):
        es.member((ensemble, opt_state), 1)


@pytest.mark.parametrize("out_axes", (1, -1, {"w": 0, "lin": 1}))
def test_member_refuses_an_ensemble_whose_arrays_are_stacked_on_another_axis(out_axes):
    def make(key):
        return {
            "w": es.ParamState(jnp.zeros(3), name="w"),
            "lin": eqx.nn.Linear(3, 3, key=key),
        }

    keys = jr.split(jr.key(0), 2)
    ensemble = es.transform.vmap_new_states(make, out_axes=out_axes)(keys)
    with pytest.raises(ValueError, match="`out_axes` other than 0"):
        es.member(ensemble, 1)
    # Without arrays in the tree, the states alone are sliced as usual.
    assert es.member(ensemble["w"], 1).value.shape == (3,)


def test_member_of_an_ensemble_of_shared_states_only_checks_the_index():
    ensemble = es.transform.vmap_new_states(
        lambda: {"n": es.NonBatchState(jnp.ones(2), name="n")}, axis_size=3
    )()
    assert tree_bitwise_equal(es.member(ensemble, -3)["n"].value, jnp.ones(2))
    with pytest.raises(IndexError, match=r"Member 3 of an ensemble of 3"):
        es.member(ensemble, 3)
