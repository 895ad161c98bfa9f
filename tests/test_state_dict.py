import copy
import re

import eqstate as es
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from hypothesis import given, settings

from .helpers import tree_bitwise_equal, unchecked


KINDS = [es.State, es.ParamState, es.ShortTermState, es.LongTermState]


@pytest.fixture
def sd():
    w = es.ParamState(jnp.zeros(3), name="w")
    n = es.ShortTermState(jnp.array(0), name="n", tag="count")
    return es.StateDict({w: jnp.ones(3), n: jnp.array(5)}), w, n


def test_mapping_interface(sd):
    sd, w, n = sd
    assert len(sd) == 2 and list(sd) == [w, n] and sd.states == (w, n)
    assert (sd[w] == 1).all() and sd.get(n) == 5
    assert w in sd and es.State(jnp.zeros(1)) not in sd
    other = es.State(jnp.zeros(1))
    assert sd.get(other, "default") == "default"
    with pytest.raises(
        es.StateNotFoundError, match=r"State .* is not in this StateDict"
    ):
        sd[other]


def test_a_missing_state_is_named_with_the_first_five_held():
    held = [es.State(jnp.zeros(1), name=f"s{i}") for i in range(7)]
    sd = es.StateDict(dict.fromkeys(held, jnp.zeros(1)))
    with pytest.raises(
        es.StateNotFoundError,
        match=r"State 'x' is not in this StateDict, which holds State 's0', State 's1', "
        r"State 's2', State 's3', State 's4' and 2 more\.$",
    ):
        sd[es.State(jnp.zeros(1), name="x")]
    with pytest.raises(es.StateNotFoundError, match="which holds no states"):
        es.StateDict()[held[0]]


def test_looking_up_a_name_says_keys_are_handles_and_how_to_select_by_name(sd):
    sd, w, _ = sd
    for states in (sd, es.world()):
        with pytest.raises(
            es.StateNotFoundError,
            match=r"keys are state handles, not names: 'w' is a str\. .*"
            r"filter\(eqstate\.filters\.WithName\('w'\)\)",
        ):
            unchecked(states.__getitem__)("w")
    assert sd.filter(es.filters.WithName("w")).states == (w,)
    with pytest.raises(es.StateNotFoundError, match=r"keys are state handles, got 0"):
        unchecked(sd.__getitem__)(0)


def test_keys_must_be_handles():
    with pytest.raises(TypeError, match="StateDict"):
        es.StateDict({"w": jnp.zeros(2)})  # pyright: ignore[reportArgumentType]


def test_values_are_converted_to_arrays():
    s = es.State(jnp.zeros(()))
    assert isinstance(es.StateDict({s: 1.0})[s], jax.Array)


def test_is_immutable(sd):
    sd, w, _ = sd
    with pytest.raises(AttributeError, match="immutable"):
        sd.x = 1  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(TypeError):
        sd[w] = jnp.zeros(3)  # pyright: ignore[reportIndexIssue]


def test_set_returns_a_new_dict_and_checks_the_write(sd):
    sd, w, n = sd
    new = sd.set(w, jnp.full(3, 7.0))
    assert (new[w] == 7).all() and (sd[w] == 1).all()
    with pytest.raises(ValueError, match=r"shape \(2,\) .* to ParamState 'w'"):
        sd.set(w, jnp.zeros(2))
    with pytest.raises(es.StateNotFoundError, match="not in this StateDict"):
        sd.set(es.State(jnp.zeros(3)), jnp.zeros(3))


def test_update_and_or_add_new_states_and_check_old_ones(sd):
    sd, w, n = sd
    extra = es.State(jnp.zeros(2))
    merged = sd | {extra: jnp.ones(2)}
    assert merged.states == (w, n, extra)
    assert sd.update({w: jnp.zeros(3)})[w].sum() == 0
    with pytest.raises(ValueError, match="dtype float32 to ShortTermState 'n'"):
        sd | {n: jnp.zeros((), jnp.float32)}


def test_filter_and_split(sd):
    sd, w, n = sd
    assert sd.filter(es.ParamState).states == (w,)
    assert sd.filter("count").states == (n,)
    assert sd.filter(es.ParamState, "count").states == (w, n)
    params, counts, rest = sd.split(es.ParamState, "count")
    assert params.states == (w,) and counts.states == (n,) and len(rest) == 0


def test_split_gives_a_state_to_the_first_filter_it_matches(sd):
    sd, w, n = sd
    first, second, rest = sd.split(es.State, es.ParamState)
    assert first.states == (w, n) and len(second) == 0 and len(rest) == 0


def test_is_a_pytree_with_values_as_children(sd):
    sd, w, n = sd
    leaves, treedef = jtu.tree_flatten(sd)
    assert len(leaves) == 2
    rebuilt = jtu.tree_unflatten(treedef, leaves)
    assert isinstance(rebuilt, es.StateDict) and rebuilt.states == (w, n)
    doubled = jtu.tree_map(lambda x: x * 2, sd)
    assert (doubled[w] == 2).all() and doubled[n] == 10
    paths = [p for p, _ in jtu.tree_leaves_with_path(sd)]
    assert [p[0].key for p in paths] == [w, n]  # the handles, as in a `DictKey`
    assert all(isinstance(p[0], jtu.DictKey) for p in paths)
    assert [jtu.keystr(p) for p in paths] == [
        "[ParamState 'w']",
        "[ShortTermState 'n']",
    ]


def _program_text(make_extra_handles: int) -> str:
    for _ in range(make_extra_handles):
        es.ParamState(jnp.zeros(1))  # as a process that logs something might
    w = es.ParamState(jnp.ones(3))
    tagged = es.ShortTermState(jnp.zeros(2), tag="t")
    moments = es.values_of([w, tagged])
    return jax.jit(lambda m: jax.tree.map(lambda v: v * 2, m)).lower(moments).as_text()


def test_a_programs_text_is_the_same_however_many_handles_were_made_before():
    # Key paths of a StateDict name a compiled program's arguments and results; every
    # process of a multi-process program must compile the very same text.
    first, later = _program_text(0), _program_text(3)
    assert "unnamed ParamState, entry 0" in first and "tagged 't'" in first
    assert "id=" not in first
    assert first == later


def test_passes_through_jit_and_filter_jit(sd):
    sd, w, n = sd
    out = jax.jit(lambda d: d.set(w, d[w] + 1))(sd)
    assert isinstance(out, es.StateDict) and (out[w] == 2).all()
    out = eqx.filter_jit(lambda d: d)(sd)
    assert out.states == (w, n)


_values = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.sampled_from([None, "a", "b"]),
        st.lists(st.integers(1, 3), max_size=2),
        st.sampled_from([jnp.float32, jnp.int32, jnp.bool_]),
    ),
    max_size=8,
)


def _build(specs):
    values = {}
    for kind, tag, shape, dtype in specs:
        state = kind(jnp.zeros(shape, dtype), tag=tag)
        values[state] = jnp.ones(shape, dtype)
    return es.StateDict(values)


@settings(max_examples=50, deadline=None)
@given(
    _values, st.lists(st.sampled_from([es.ParamState, "a", "b", es.State]), max_size=3)
)
def test_split_then_merge_gives_back_the_same_dict(specs, filters):
    sd = _build(specs)
    parts = sd.split(*filters)
    assert len(parts) == len(filters) + 1
    assert sum(len(p) for p in parts) == len(sd)
    merged = es.StateDict.merge(*parts)
    assert set(merged.states) == set(sd.states)
    assert all(tree_bitwise_equal(merged[s], sd[s]) for s in sd)


@settings(max_examples=50, deadline=None)
@given(_values, st.sampled_from([es.ParamState, "a", es.State, None, ...]))
def test_filter_keeps_exactly_the_matching_states_in_order(specs, filter):
    sd = _build(specs)
    predicate = es.filters.to_predicate(filter)
    assert sd.filter(filter).states == tuple(s for s in sd if predicate((), s))


@settings(max_examples=50, deadline=None)
@given(_values)
def test_flatten_unflatten_roundtrip(specs):
    sd = _build(specs)
    leaves, treedef = jtu.tree_flatten(sd)
    rebuilt = jtu.tree_unflatten(treedef, leaves)
    assert rebuilt.states == sd.states
    assert all(tree_bitwise_equal(rebuilt[s], sd[s]) for s in sd)


def test_dicts_of_the_same_states_flatten_alike_whatever_their_order():
    a, b = es.ParamState(jnp.zeros(2)), es.ParamState(jnp.zeros(3))
    ab = es.StateDict({a: jnp.ones(2), b: jnp.ones(3)})
    ba = es.StateDict({b: jnp.full(3, 2.0), a: jnp.full(2, 2.0)})
    assert jtu.tree_structure(ab) == jtu.tree_structure(ba)
    summed = jtu.tree_map(lambda x, y: x + y, ab, ba)
    assert (summed[a] == 3).all() and (summed[b] == 3).all()
    assert ba.states == (b, a)  # iteration keeps insertion order


def test_gradients_read_in_another_order_feed_optax():
    import optax

    a, b = es.ParamState(jnp.ones(2), name="a"), es.ParamState(jnp.ones(3), name="b")
    model = {"a": a, "b": b}
    grads = es.transform.grad(
        lambda: jnp.sum(b.value) * jnp.sum(a.value), grad_states=es.ParamState
    )()
    params = es.values_of(model, es.ParamState)
    optimizer = optax.sgd(0.1)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    new = optax.apply_updates(params, updates)
    assert (new[a] == 1 - 0.1 * 3).all() and (new[b] == 1 - 0.1 * 2).all()


def test_a_copy_of_a_state_dict_is_itself():
    sd = es.StateDict({es.State(jnp.ones(2)): jnp.ones(2)})
    assert copy.copy(sd) is sd


def test_a_deep_copy_of_a_state_dict_keeps_its_handles_and_copies_its_values(sd):
    sd, w, n = sd
    nested = es.StateDict({n: sd[n], w: {"inner": sd}})
    copied = copy.deepcopy(nested)
    assert copied.states == (n, w)
    assert copied[w]["inner"].states == (w, n)
    assert copied[w]["inner"] is not sd and copied[w]["inner"][w] is not sd[w]
    assert tree_bitwise_equal(copied, nested)


def test_a_deep_copy_of_an_optax_state_of_a_state_dict_keeps_its_handles(sd):
    import optax

    sd, w, _ = sd
    opt_state = optax.adam(0.1).init(sd.filter(w))
    copied = copy.deepcopy(opt_state)
    assert copied[0].mu.states == (w,)
    assert tree_bitwise_equal(copied, opt_state)


def test_a_state_created_from_what_jax_cannot_convert_is_named():
    with pytest.raises(es.StateValueError, match="Cannot create State 'cfg' holding"):
        es.State(np.array([print], dtype=object), name="cfg")


def test_filter_without_filters_keeps_every_state_as_states_of_does():
    model = {"w": es.ParamState(jnp.ones(2)), "n": es.State(jnp.array(0))}
    values = es.values_of(model)
    assert values.filter().states == values.states == es.states_of(model)


def test_structures_keyed_by_different_handles_of_one_name_print_apart():
    # JAX's error about mismatched structures (an optimiser's state made for another
    # copy of a model) prints both sides' handles: their numbers tell them apart.
    a, b = (es.ParamState(jnp.ones(2), name="w") for _ in range(2))
    with pytest.raises(ValueError) as info:
        jax.tree.map(
            lambda x, y: x + y,
            es.StateDict({a: jnp.ones(2)}),
            es.StateDict({b: jnp.ones(2)}),
        )
    numbers = re.findall(r"ParamState\(name='w', id=(#\d+)\)", str(info.value))
    assert len(set(numbers)) == 2
    treedef = jax.tree.structure(es.StateDict({a: jnp.ones(2), b: jnp.ones(2)}))
    assert treedef == jax.tree.structure(
        es.StateDict({b: jnp.zeros(2), a: jnp.ones(2)})
    )


def test_lookup_errors_tell_same_named_handles_apart():
    a, b = (es.ParamState(jnp.ones(2), name="w") for _ in range(2))
    sd = es.StateDict({a: jnp.ones(2)})
    with pytest.raises(es.StateNotFoundError) as info:
        sd[b]
    numbers = re.fullmatch(
        r"ParamState 'w' (#\d+) is not in this StateDict, which holds "
        r"ParamState 'w' (#\d+)\.",
        str(info.value),
    )
    assert numbers is not None and numbers[1] != numbers[2]
    with pytest.raises(es.StateNotFoundError, match=r"'w' #\d+.*\.update"):
        sd.set(b, jnp.zeros(2))
    n = es.ParamState(jnp.ones(2), name="n")
    with pytest.raises(es.StateNotFoundError) as info:
        sd[n]
    assert str(info.value) == (
        "ParamState 'n' is not in this StateDict, which holds ParamState 'w'."
    )


def test_state_dicts_compare_by_identity_and_tree_equal_compares_contents():
    w = es.ParamState(jnp.ones(2), name="w")
    a, b = es.values_of(w), es.StateDict({w: jnp.ones(2)})
    assert a != b and a == a
    assert eqx.tree_equal(a, b) and not eqx.tree_equal(a, b.set(w, jnp.zeros(2)))


def test_a_dict_of_python_scalars_takes_set_and_update():
    w = es.ParamState(jnp.ones(2), name="w")
    b = es.ParamState(jnp.zeros(2), name="b")
    params = es.values_of([w, b])
    rates = jax.tree.map(lambda x: 0.1, params)
    for changed in (rates.set(b, 0.0), rates.update({b: 0.0}), rates | {b: 0.0}):
        assert changed[b] == 0.0 and changed[w] == pytest.approx(0.1)
        assert isinstance(changed[b], jax.Array)  # the others are kept as they are
    mask = jax.tree.map(lambda x: True, params).set(b, False)
    assert mask[w] and mask[b].dtype == jnp.bool_ and not mask[b]
    with pytest.raises(es.StateValueError, match="ParamState 'b'"):
        rates.set(b, jnp.zeros(3))
    on_host = jax.device_get(params).set(w, jnp.zeros(2))
    assert (on_host[w] == 0).all() and (on_host[b] == 0).all()


def test_a_dict_refuses_values_their_arrays_cannot_hold():
    # With 64-bit types off, JAX converts NumPy's int64 to int32, wrapping 2**32 + 5.
    step = es.ShortTermState(jnp.array(0, jnp.int32), name="step")
    w = es.ParamState(jnp.zeros(2), name="w")
    big = np.int64(2**32 + 5)
    for make in (
        lambda: es.StateDict({step: big}),
        lambda: es.StateDict().update({step: big}),
        lambda: es.StateDict({w: jnp.ones(2)}) | {step: {"a": big}},
    ):
        with pytest.raises(
            es.StateValueError, match=r"ShortTermState 'step' the value 4294967301"
        ):
            make()
    with pytest.raises(es.StateValueError, match=r"ShortTermState 'step' .* 2199"):
        es.StateDict({step: 2**41})
    kept = es.StateDict({step: np.int64(7), w: np.array([0.1, 2.0])})
    assert kept[step] == 7 and kept[w].dtype == jnp.float32


def test_an_abstract_dict_can_be_split_merged_and_rebuilt():
    w = es.ParamState(jnp.ones(2), name="w")
    n = es.ShortTermState(jnp.array(0), name="n")

    def f():
        n.value = n.value + 1
        return w.value.sum()

    shapes, _ = es.transform.eval_shape(f, return_state_shapes=True)
    params, rest = shapes.split(es.ParamState)
    for merged in (
        params | rest,
        es.StateDict.merge(params, rest),
        es.StateDict(shapes),
    ):
        assert set(merged) == {w, n}
        assert merged[w] == jax.ShapeDtypeStruct((2,), jnp.float32)
        assert merged[n].shape == () and merged[n].dtype == n.value.dtype
    assert es.StateDict.merge(shapes, shapes)[w] == shapes[w]
    assert (shapes.set(w, jnp.zeros(2))[w] == 0).all()
    with pytest.raises(es.StateValueError, match=r"shape \(3,\).*ParamState 'w'"):
        shapes.set(w, jnp.zeros(3))
    # The other way round: an abstract value replaces a concrete one, in any order.
    concrete = es.values_of((w, n))
    for mixed in (
        concrete | shapes,
        es.StateDict.merge(concrete, shapes),
        concrete.update(shapes),
        concrete.set(w, shapes[w]).set(n, shapes[n]),
    ):
        assert mixed[w] == shapes[w] and mixed[n] == shapes[n]
    assert (es.StateDict.merge(concrete, params)[n] == n.value).all()
    with pytest.raises(es.StateValueError, match=r"shape \(3,\).*ParamState 'w'"):
        concrete.set(w, jax.ShapeDtypeStruct((3,), jnp.float32))
    with pytest.raises(es.StateValueError, match=r"dtype int32 to ParamState 'w'"):
        concrete | {w: jax.ShapeDtypeStruct((2,), jnp.int32)}


def test_building_from_what_is_not_pairs_says_what_a_state_dict_takes():
    w = es.ParamState(jnp.ones(2), name="w")
    n = es.ShortTermState(jnp.array(0), name="n")
    with pytest.raises(TypeError, match=r"not a pair\. .*`eqstate.values_of"):
        es.StateDict([w, n])  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"`\(handle, value\)` pairs; got ArrayImpl"):
        es.StateDict(jnp.ones(3))
    with pytest.raises(
        es.StateValueError, match="'adam' \\(a str\\) for ParamState 'w'"
    ):
        es.StateDict({w: "adam"})
    with pytest.raises(TypeError, match=r"`StateDict\.merge` takes a StateDict"):
        es.StateDict.merge(es.values_of(w), [(n, 1)])


def test_an_abstract_dict_takes_writes_as_a_concrete_one_does():
    w = es.ParamState(jnp.ones(()), name="w")
    b = es.ParamState(jnp.ones((), jnp.bfloat16), name="b")
    concrete = es.values_of([w, b])
    abstract = jax.eval_shape(lambda: concrete)
    for s, value in ((w, 1.0), (w, 0), (w, jnp.ones(())), (b, 1.0), (b, 0)):
        want = jax.typeof(concrete.set(s, value)[s])
        assert jax.typeof(abstract.set(s, value)[s]) == want
    with pytest.raises(es.StateValueError, match="ParamState 'w'"):
        abstract.set(w, jnp.ones(3))
    with pytest.raises(es.StateValueError, match="abstract value"):
        with es.scope(abstract):
            pass
