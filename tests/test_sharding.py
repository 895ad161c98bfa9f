"""States on several devices: placement, jit, shard_map, and the two examples. The
suite runs with 8 virtual CPU devices (tests/conftest.py)."""

import contextlib
import functools as ft
import importlib.util
import pathlib
import unittest.mock
import warnings

import eqstate as es
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .helpers import tree_allclose, tree_bitwise_equal


N = len(jax.devices())
_EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


# JAX before 0.10 needs `jax.set_mesh` around an eager computation that mixes arrays
# split on explicit mesh axes with arrays on one device (as random keys are).
_EXPLICIT_NEEDS_SET_MESH = tuple(map(int, jax.__version__.split(".")[:2])) < (0, 10)
_NO_MESH_SET = r"jax\.set_mesh|is not found in mesh"


def _mesh(name="x", axis_type=AxisType.Auto):
    return jax.make_mesh((N,), (name,), axis_types=(axis_type,))


def _over_data(f, **options):
    """`f` under `shard_map`, its one argument and its output split over "data"."""
    return es.transform.shard_map(
        f, mesh=_mesh("data"), in_specs=(P("data"),), out_specs=P("data"), **options
    )


def test_there_are_eight_devices():
    assert N == 8


def test_with_sharding_by_sharding_mapping_and_function():
    mesh = _mesh()
    a = es.ParamState(jnp.ones((N, 2)), name="a")
    b = es.State(jnp.ones(N), name="b")
    sd = es.world().filter(a, b)
    split = NamedSharding(mesh, P("x"))
    everything = sd.with_sharding(split)
    assert everything[a].sharding == split and everything[b].sharding == split
    some = sd.with_sharding({es.ParamState: split})
    assert some[a].sharding == split and some[b].sharding == sd[b].sharding
    by_fn = sd.with_sharding(lambda s, v: split if s is b else None)
    assert by_fn[b].sharding == split and by_fn[a].sharding == sd[a].sharding
    assert tree_allclose(everything[a], sd[a])
    with pytest.raises(TypeError, match="Shardings are given as"):
        sd.with_sharding(3)


def test_shard_places_a_models_states_in_the_world():
    mesh = _mesh("model")
    big = es.ParamState(jnp.arange(4.0 * N * 3).reshape(4 * N, 3), name="big")
    small = es.ParamState(jnp.zeros(3), name="small")
    placed = es.shard({"big": big, "small": small}, mesh, {big: P("model")})
    assert big.value.sharding.spec == P("model") and small.value.sharding.spec == P()
    assert placed[big].sharding == big.value.sharding
    assert tree_allclose(big.value, jnp.arange(4.0 * N * 3).reshape(4 * N, 3))
    shards = {s.index[0].start for s in big.value.addressable_shards}
    assert len(shards) == N


def test_shard_takes_one_spec_for_all_or_a_function():
    mesh = _mesh("model")
    a = es.ParamState(jnp.ones((N, 2)), name="a")
    b = es.ParamState(jnp.ones(N), name="b")
    by_fn = es.shard([a, b], mesh, lambda s, v: P("model") if s is a else None)
    assert by_fn[a].sharding.spec == P("model") and by_fn[b].sharding.spec == P()
    everything = es.shard([a, b], mesh, P("model"))
    assert all(v.sharding.spec == P("model") for v in everything.values())


@pytest.mark.parametrize("key", (False, True))
def test_donating_a_sharded_state_leaves_the_value_held_before_sharding(getkey, key):
    # `jax.device_put` to a replicated sharding can return a new array whose shard on
    # the value's device is the value's own buffer; donating it would delete the
    # value the caller still holds.
    value = jr.split(getkey(), N) if key else jnp.arange(8.0)
    w = es.State(value, name="w")

    @ft.partial(es.transform.jit, donate_states=True)
    def step():
        w.value = w.value if key else w.value + 1

    old = w.value
    es.shard([w], _mesh(), P())
    step()
    assert not old.is_deleted()
    assert tree_bitwise_equal(old, value)


def test_shard_names_the_state_that_cannot_be_split():
    mesh = _mesh("model")
    odd = es.ParamState(jnp.ones((N + 1, 2)), name="odd")
    with pytest.raises(ValueError, match=r"dimension 0 \(size 9\) of ParamState 'odd'"):
        es.shard([odd], mesh, P("model"))
    flat = es.ParamState(jnp.ones(N), name="flat")
    with pytest.raises(ValueError, match="has only 1 dimensions"):
        es.shard([flat], mesh, P(None, "model"))
    assert len(odd.value.sharding.device_set) == 1  # left where it was


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_jit_keeps_the_sharding_of_written_states(axis_type):
    mesh = _mesh("x", axis_type)
    w = es.ParamState(jnp.ones((2 * N, 4)), name="w")
    b = es.ParamState(jnp.zeros(4), name="b")
    es.shard([w, b], mesh, {w: P("x")})

    @es.transform.jit
    def step(x):
        w.value = w.value * 0.5 + x
        b.value = b.value + 1
        return (w.value @ b.value).sum()

    for _ in range(3):
        out = step(1.0)
    assert w.value.sharding.is_equivalent_to(NamedSharding(mesh, P("x")), 2)
    assert b.value.sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)
    assert (
        tree_allclose(w.value, jnp.full((2 * N, 4), 1.875))
        and out == 2 * N * 4 * 3 * 1.875
    )


def test_jit_writes_states_placed_on_a_mesh_of_explicit_and_auto_axes():
    # `reshard` takes only explicit axes and `with_sharding_constraint` only the
    # others: a write constrained to a sharding naming both needs the two.
    mesh = jax.make_mesh(
        (2, N // 2), ("e", "a"), axis_types=(AxisType.Explicit, AxisType.Auto)
    )
    both, auto_only = (
        NamedSharding(mesh, P("e", "a")),
        NamedSharding(mesh, P(None, "a")),
    )
    w = es.ParamState(jnp.arange(4.0 * N).reshape(4, N), name="w")
    b = es.ParamState(jnp.ones((2, N)), name="b")
    es.shard([w], mesh, P("e", "a"))

    def step():
        w.value = w.value * 2
        b.value = b.value + 1

    es.transform.jit(step, state_shardings={b: auto_only})()
    assert w.value.sharding.is_equivalent_to(both, 2)
    assert b.value.sharding.is_equivalent_to(auto_only, 2)
    assert (w.value == 2 * jnp.arange(4.0 * N).reshape(4, N)).all()
    assert (b.value == 2).all()


def test_a_dimension_split_over_auto_then_explicit_axes_comes_out_explicit_first():
    # As the multi-device how-to says: inside a computation JAX places a value on
    # its explicit axes (its type) before its auto ones.
    mesh = jax.make_mesh(
        (N // 2, 2), ("e", "u"), axis_types=(AxisType.Explicit, AxisType.Auto)
    )
    w = es.State(jnp.arange(float(N * N)).reshape(N, N), name="w")

    @es.transform.jit(state_shardings=NamedSharding(mesh, P(("u", "e"))))
    def step():
        w.value = w.value + 1

    step()
    assert w.value.sharding.is_equivalent_to(NamedSharding(mesh, P(("e", "u"))), 2)
    assert (w.value == jnp.arange(float(N * N)).reshape(N, N) + 1).all()


@pytest.mark.parametrize("lower", (False, True))
def test_jit_state_shardings_of_a_higher_rank_than_a_state_name_it(lower):
    split = NamedSharding(_mesh(), P("x"))
    a = es.State(jnp.zeros(2 * N), name="a")
    b = es.State(jnp.zeros(()), name="b")
    c = es.State(jnp.zeros(12), name="c")  # split unevenly: legal in `jit`

    def step():
        a.value = a.value + b.value
        return c.value.sum()

    f = es.transform.jit(step, state_shardings=split)
    for _ in range(2):  # a failed call leaves no plan behind
        with pytest.raises(ValueError, match=r"State 'b' .*shape \(\) \(rank 0\)"):
            f.lower() if lower else f()
    assert es.transform.jit(lambda: c.value.sum(), state_shardings=split)() == 0


@pytest.mark.parametrize("given", (False, True), ids=("kept", "state_shardings"))
def test_jit_after_a_call_on_a_sharded_state_takes_a_value_of_lower_rank(given):
    # The plan made by the first call holds the sharding of the state's rank-2
    # value; a later call with a rank-1 value (through `es.run`) must not get a
    # constraint of rank 2 from JAX: a kept sharding no longer applies, and
    # `state_shardings` that cannot fit the value are named as on a first call.
    split = NamedSharding(_mesh(), P(None, "x"))
    v = es.State(jnp.ones((2, N)), name="v")
    es.shard([v], _mesh(), P(None, "x"))

    @es.transform.jit(state_shardings=split if given else None)
    def step():
        v.value = v.value + 1
        return v.value.sum()

    assert step() == 4 * N
    assert v.value.sharding.is_equivalent_to(split, 2)
    if given:
        with pytest.raises(ValueError, match=r"State 'v' .*shape \(8,\) \(rank 1\)"):
            es.run(step, es.StateDict({v: jnp.ones(N)}))
    else:
        new, out = es.run(step, es.StateDict({v: jnp.ones(N)}))
        assert out == 2 * N and (new[v] == 2).all()
    assert step() == 6 * N  # the rank-2 value, still split
    assert v.value.sharding.is_equivalent_to(split, 2)


def test_jit_state_shardings_as_a_prefix_of_a_states_value():
    split = NamedSharding(_mesh(), P("x"))
    value = {"mu": {"a": jnp.ones(N), "b": jnp.ones(2 * N)}, "step": jnp.zeros(())}
    opt = es.ShortTermState(value, name="opt")

    @es.transform.jit(state_shardings=lambda state, value: {"mu": split, "step": None})
    def step():
        opt.value = jax.tree.map(lambda x: x + 1, opt.value)

    step()
    assert opt.value["mu"]["a"].sharding == split
    assert opt.value["mu"]["b"].sharding == split
    assert tree_allclose(opt.value["mu"]["b"], jnp.full(2 * N, 2.0))


def test_jit_state_shardings_move_states():
    mesh = _mesh()
    s = es.State(jnp.arange(float(N)), name="s")
    split = NamedSharding(mesh, P("x"))
    step = es.transform.jit(
        lambda: setattr(s, "value", s.value * 2), state_shardings={s: split}
    )
    step()
    assert s.value.sharding == split and tree_allclose(
        s.value, jnp.arange(float(N)) * 2
    )


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_jit_keeps_the_sharding_of_each_leaf_of_a_written_state(axis_type):
    # An optimiser state: its moments split over the mesh, its step count replicated.
    mesh = _mesh("x", axis_type)
    split, replicated = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    opt = es.State(
        {
            "mu": jax.device_put(jnp.ones((N, 4)), split),
            "count": jax.device_put(jnp.array(0), replicated),
        },
        name="opt",
    )

    @es.transform.jit
    def reset():
        opt.value = {"mu": jnp.zeros((N, 4)), "count": jnp.array(0)}

    # The new values use no input: explicit axes need the mesh in context, as in JAX.
    with jax.set_mesh(mesh):
        for _ in range(2):
            reset()
            assert opt.value["mu"].sharding.is_equivalent_to(split, 2)
            assert opt.value["count"].sharding.is_equivalent_to(replicated, 0)
    assert tree_allclose(opt.value, {"mu": jnp.zeros((N, 4)), "count": jnp.array(0)})


_FIRST_CALL_IN = {
    "grad": lambda f: es.transform.grad(f)(1.0),
    "jit": lambda f: es.transform.jit(f)(1.0),
    "scan": lambda f: es.transform.scan(
        lambda carry, x: (carry + f(x), None), 0.0, jnp.ones(2)
    ),
}


@pytest.mark.parametrize("static", (False, True), ids=("plain", "static argument"))
@pytest.mark.parametrize("first_call_in", sorted(_FIRST_CALL_IN))
def test_jit_keeps_the_sharding_of_a_written_state_first_called_in_a_transform(
    first_call_in, static, tracing_mode
):
    mesh = _mesh()
    split = NamedSharding(mesh, P("x"))
    z = es.State(jnp.arange(2.0 * N), name="z")
    es.shard([z], mesh, P("x"))

    def fill(x, scale=None):
        z.value = jnp.zeros(2 * N) + x
        return x * 2

    # A static argument takes a function with it bound, made in the transform too.
    if static:
        jitted = es.transform.jit(fill, static_argnames="scale")
        reset = lambda x: jitted(x, scale=1)  # noqa: E731
    else:
        reset = es.transform.jit(fill)
    _FIRST_CALL_IN[first_call_in](reset)
    assert z.value.sharding.is_equivalent_to(split, 1)
    assert tree_allclose(z.value, jnp.ones(2 * N))
    for x in (2.0, 3.0):
        assert reset(x) == 2 * x
        assert z.value.sharding.is_equivalent_to(split, 1)
    assert tree_allclose(z.value, jnp.full(2 * N, 3.0))


@pytest.mark.parametrize("top_level_first", (False, True))
def test_jit_called_in_shard_map_and_at_top_level_keeps_a_split_state_split(
    top_level_first,
):
    mesh = _mesh("data")
    split = NamedSharding(mesh, P("data"))
    z = es.State(jnp.zeros(2 * N), name="z")
    es.shard([z], mesh, P("data"))

    @es.transform.jit
    def fill(x):
        z.value = jnp.zeros(z.value.shape) + x.sum()  # not computed from the old value
        return x

    per_device = _over_data(fill, state_specs={z: P("data")})
    calls = [
        (lambda: fill(jnp.full(2, 1.5)), 3.0),
        (lambda: per_device(jnp.ones(N)), 1.0),  # each device fills its shard
    ]
    for call, expected in (calls if top_level_first else calls[::-1]) * 2:
        call()
        assert tree_allclose(z.value, jnp.full(2 * N, expected))
        assert z.value.sharding.is_equivalent_to(split, 1)


def _scan_in_a_scope(f, states):
    with es.scope(states) as scope:
        es.transform.scan(lambda carry, x: (carry + f(x), None), 0.0, jnp.ones(1))
    return scope.states


_IN_A_DICTIONARY = {
    "scan in a scope": _scan_in_a_scope,
    "run in jax.jit": lambda f, states: jax.jit(lambda sd: es.run(f, sd, 1.0)[0])(
        states
    ),
}


@pytest.mark.parametrize("first_call_in", sorted(_IN_A_DICTIONARY))
def test_jit_first_called_against_a_dictionary_keeps_its_placement_not_the_worlds(
    first_call_in,
):
    # The world holds `z` split over half the devices, the dictionary holds it
    # replicated on the other half: the world's placement must not be copied onto it.
    devices = jax.devices()
    half = N // 2
    in_world = NamedSharding(jax.sharding.Mesh(devices[:half], ("x",)), P("x"))
    in_dict = NamedSharding(jax.sharding.Mesh(devices[half:], ("x",)), P())
    z = es.State(jnp.arange(2.0 * N), name="z")
    es.shard([z], in_world.mesh, P("x"))

    @es.transform.jit
    def add(x):
        z.value = z.value + x
        return x

    states = es.StateDict({z: jnp.arange(2.0 * N)}).with_sharding(in_dict)
    new = _IN_A_DICTIONARY[first_call_in](add, states)
    assert tree_allclose(new[z], jnp.arange(2.0 * N) + 1)
    assert new[z].sharding.is_equivalent_to(in_dict, 1)
    assert z.value.sharding.is_equivalent_to(in_world, 1)


@pytest.mark.parametrize("placed", (False, True))
def test_jit_state_shardings_on_an_explicit_mesh_match_jax_reshard(placed):
    mesh = _mesh("x", AxisType.Explicit)
    split, replicated = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    start = jnp.arange(2.0 * N)
    if placed:
        start = jax.device_put(start, replicated)
    q = es.State(start, name="q")  # written
    t = es.State(start + 1, name="t")  # read only

    def pure(q, t):
        q = jax.sharding.reshard(q, split) * 2
        return q, (q * jax.sharding.reshard(t, split)).sum()

    with jax.set_mesh(mesh):

        @es.transform.jit(state_shardings={q: split, t: split})
        def step():
            q.value = q.value * 2
            return (q.value * t.value).sum()

        expected_q, expected_t = start, start + 1
        for _ in range(2):
            out = step()
            expected_q, expected_out = jax.jit(pure)(expected_q, expected_t)
            assert tree_allclose(out, expected_out)
            assert tree_allclose(q.value, expected_q)
            assert q.value.sharding.is_equivalent_to(split, 1)


@pytest.mark.counts_compilations
def test_jit_donates_a_state_written_in_a_shard_map_with_collectives():
    # A collective records its named axis as an effect, which cannot make a call
    # fail while it runs: donation stays on, as `jax.jit` donates such a function.
    mesh = _mesh("a")
    total = es.State(jnp.zeros((N, 256)), name="total")
    es.shard([total], mesh, P("a"))

    @es.transform.shard_map(
        mesh=mesh, in_specs=(), out_specs=P(), state_specs={total: P("a")}
    )
    def add_and_sum():
        total.value = total.value + jax.lax.axis_index("a").astype(jnp.float32)
        return jax.lax.psum(total.value.sum(), "a")

    step = es.transform.jit(add_and_sum, donate_states=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "does not donate" warning
        step()
        buffers = [
            s.data.unsafe_buffer_pointer() for s in total.value.addressable_shards
        ]
        assert step() == 2 * 256 * sum(range(N))
    reused = [s.data.unsafe_buffer_pointer() for s in total.value.addressable_shards]
    assert reused == buffers  # updated in place: donated


def test_shard_map_threads_states_with_their_specs():
    mesh = _mesh("data")
    per_device = es.State(jnp.zeros(N), name="per_device")
    total = es.State(jnp.array(0.0), name="total")

    @es.transform.shard_map(
        mesh=mesh,
        in_specs=(P("data"),),
        out_specs=P("data"),
        state_specs={per_device: P("data")},
    )
    def step(x):
        per_device.value = per_device.value + x.sum()
        total.value = total.value + jax.lax.psum(x.sum(), "data")
        return x * 2

    x = jnp.arange(2.0 * N)
    y = step(x)
    assert tree_allclose(y, x * 2)
    assert tree_allclose(per_device.value, x.reshape(N, 2).sum(1))
    assert total.value == x.sum()
    assert per_device.value.sharding.spec == P("data")
    # Called again at top level, it reads the states' new values.
    step(x)
    step(x)
    assert tree_allclose(per_device.value, 3 * x.reshape(N, 2).sum(1))
    assert total.value == 3 * x.sum()
    assert per_device.value.sharding.spec == P("data")


def test_shard_map_refuses_a_spec_per_leaf_naming_the_state():
    mesh = _mesh("data")
    tree = es.State({"x": jnp.zeros((N, 2)), "y": jnp.array(0.0)}, name="tree")
    sm = es.transform.shard_map(
        lambda x: (setattr(tree, "value", tree.value), x)[1],
        mesh=mesh,
        in_specs=(P("data"),),
        out_specs=P("data"),
        # A rule, as a mapping of specs per leaf is refused by the type hints.
        state_specs=lambda state, value: {"x": P("data"), "y": P()},
    )
    with pytest.raises(TypeError, match=r"State 'tree'.*one PartitionSpec per state"):
        sm(jnp.arange(float(N)))


def test_shard_map_refuses_a_replicated_state_written_per_device():
    s = es.State(jnp.array(0.0), name="replicated")

    def f(x):
        s.value = s.value + x.sum()
        return x

    with pytest.raises(
        ValueError, match=r"State 'replicated' is written inside `shard_map`"
    ):
        _over_data(f)(jnp.arange(float(N)))
    assert s.value == 0


def _write_where(how, state, predicate):
    """Adds 1 to `state` where `predicate` holds, with eqstate's `how`."""

    def add():
        state.value = state.value + 1.0

    if how == "cond":
        es.transform.cond(predicate, add, lambda: None)
    elif how == "switch":
        es.transform.switch(predicate.astype(jnp.int32), [lambda: None, add])
    elif how == "while_loop":

        def body(i):
            add()
            return i + 1

        es.transform.while_loop(
            lambda i: i < predicate.astype(jnp.int32), body, jnp.array(0)
        )
    else:

        def step(i):
            add()
            return i + 1

        until = predicate.astype(jnp.int32)
        es.transform.bounded_while_loop(lambda i: i < until, step, jnp.array(0), 3)


@pytest.mark.parametrize("how", ["cond", "switch", "while_loop", "bounded_while_loop"])
def test_shard_map_refuses_a_replicated_state_written_under_a_predicate_per_device(
    how,
):
    # Each branch writes alike, but the branch taken (the number of steps) differs
    # between devices: JAX types the result from the branches alone.
    s = es.State(jnp.array(0.0), name="replicated")
    t = es.State(jnp.zeros(N), name="split")

    def per_device(x):
        _write_where(how, s, x[0] > N / 2)
        return x

    error, match = ValueError, r"State 'replicated' is written inside"
    if how == "bounded_while_loop":  # a `scan`, whose carry JAX refuses (see below)
        error, match = TypeError, r"(?s)carry input and carry output must have equal"
    with pytest.raises(error, match=match):
        _over_data(per_device)(jnp.arange(float(N)))
    assert s.value == 0

    def everywhere(x):
        _write_where(how, s, jax.lax.psum(x[0], "data") > 0)  # the same on every device
        _write_where(how, t, x[0] > N / 2)
        return x

    _over_data(everywhere, state_specs={t: P("data")})(jnp.arange(float(N)))
    assert s.value == 1
    assert (t.value == (jnp.arange(float(N)) > N / 2).astype(jnp.float32)).all()


def test_jit_after_a_written_state_moved_to_other_devices_says_to_clear_its_cache():
    s = es.State(jnp.arange(float(N)), name="s")
    es.shard([s], _mesh(), P("x"))

    @es.transform.jit
    def step(x):
        s.value = s.value * 2 + x
        return s.value.sum()

    step(1.0)
    half = jax.make_mesh((N // 2,), ("x",), devices=jax.devices()[N // 2 :])
    es.shard([s], half, P("x"))
    moved = s.value
    with pytest.raises(ValueError) as caught:
        step(1.0)
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert (
        f"State 's' on devices {list(range(N))} then, {list(range(N // 2, N))} now"
        in note
    )
    assert "clear_cache()" in note
    assert tree_bitwise_equal(s.value, moved)
    step.clear_cache()
    step(1.0)
    assert (s.value == moved * 2 + 1).all()
    assert s.value.sharding.device_set == set(jax.devices()[N // 2 :])


def test_shard_map_refusing_a_key_written_per_device_says_to_keep_it_the_same():
    rng = es.RandomState(0, name="rng")

    def f(x):
        rng.value = jax.random.fold_in(rng.value, jax.lax.axis_index("data"))
        return x

    with pytest.raises(
        ValueError, match=r"RandomState 'rng' is written .*the same on every device"
    ):
        _over_data(f)(jnp.arange(float(N)))


def _load(name):
    """Imports an example. It sets `jax_num_cpu_devices` to the 8 the suite already has;
    JAX before 0.10 refuses any new setting once arrays exist, even an unchanged one,
    so a setting that changes nothing is skipped here."""
    update = jax.config.update

    def update_if_changed(option, value):
        if getattr(jax.config, option) != value:
            update(option, value)

    spec = importlib.util.spec_from_file_location(name, _EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    with unittest.mock.patch.object(jax.config, "update", update_if_changed):
        spec.loader.exec_module(module)
    return module


@pytest.mark.numpy_promotion("the example broadcasts as NumPy does and uses optax.adam")
def test_data_parallel_example_matches_a_single_device():
    example = _load("data_parallel")
    single, single_losses, _ = example.train(steps=5)
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
    sharded, sharded_losses, model = example.train(mesh, steps=5)
    assert tree_allclose(single_losses, sharded_losses, rtol=1e-5, atol=1e-6)
    assert tree_allclose(single, sharded, rtol=1e-5, atol=1e-6)
    assert len(model.w1.value.sharding.device_set) == N


@pytest.mark.parametrize(
    "manual",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.upstream_leak(
                "jax.shard_map under jit and value_and_grad (plain JAX too)"
            ),
        ),
    ],
)
def test_model_parallel_example_matches_a_single_device(manual):
    example = _load("model_parallel")
    single, single_losses, _ = example.train(steps=5)
    mesh = jax.make_mesh((N,), ("model",), axis_types=(AxisType.Auto,))
    sharded, losses, model = example.train(mesh, steps=5, manual=manual)
    assert tree_allclose(single_losses, losses, rtol=1e-5, atol=1e-6)
    assert tree_allclose(single, sharded, rtol=1e-5, atol=1e-6)
    assert model.embed.value.sharding.spec == P("model")


def test_batched_ensemble_sharded_over_devices(getkey):
    mesh = _mesh("ens")
    w = es.ParamState(jr.normal(getkey(), (N, 3)), name="w")
    es.shard([w], mesh, P("ens"))
    predict = es.transform.jit(
        es.transform.vmap(lambda x: w.value @ x, in_states={0: w})
    )
    x = jr.normal(getkey(), (N, 3))
    assert tree_allclose(predict(x), jnp.einsum("ij,ij->i", w.value, x), atol=1e-5)


@pytest.mark.parametrize("axis_type", (AxisType.Auto, AxisType.Explicit))
def test_jit_takes_one_sharding_for_every_argument_as_jax_jit(axis_type):
    split = NamedSharding(_mesh(axis_type=axis_type), P("x"))
    total = es.State(jnp.zeros(()), name="total")  # a scalar: the sharding is not its

    def f(x, n, y):
        total.value = total.value + jnp.sum(x)
        return x * n + y

    jitted = es.transform.jit(f, static_argnums=1, in_shardings=split)
    ref = jax.jit(lambda x, n, y: x * n + y, static_argnums=1, in_shardings=split)
    for x in (jnp.arange(float(N)), jnp.ones(N)):
        out, expected = jitted(x, 2, jnp.ones(N)), ref(x, 2, jnp.ones(N))
        assert tree_allclose(out, expected) and out.sharding == expected.sharding
    assert total.value == sum(range(N)) + N
    compiled = jitted.lower(jnp.ones(N), 2, jnp.ones(N)).compile()
    *_, x_sharding, y_sharding = compiled.input_shardings[0]
    assert x_sharding.is_equivalent_to(split, 1)
    assert y_sharding.is_equivalent_to(split, 1)


@pytest.mark.parametrize("lower", (False, True))
def test_jit_in_shardings_of_another_length_counts_the_arguments_as_jax_jit(lower):
    split = NamedSharding(_mesh(), P("x"))
    s = es.State(jnp.zeros(N), name="s")

    def f(x, n, y, z=0.0):
        s.value = s.value + x * n + y + z
        return x + y

    shardings, args = (split, None, split), (jnp.ones(N), 2, jnp.ones(N))
    match = "length 3 for an args tuple of length 2"
    with pytest.raises(ValueError, match=match):  # as the user passed them
        jax.jit(lambda x, n, y: x + y, in_shardings=shardings, static_argnums=1)(*args)
    jitted = es.transform.jit(f, in_shardings=shardings, static_argnums=1)
    run = jitted.lower if lower else jitted
    with pytest.raises(ValueError, match="has 3 entries, but this call passes 2 pos"):
        run(*args)
    # A call after one that made the plan, too.
    good = es.transform.jit(f, in_shardings=(split, split), static_argnums=1)
    good(*args)
    with pytest.raises(ValueError, match="has 2 entries, but this call passes 3 pos"):
        good(*args, jnp.ones(N))


def test_jit_in_shardings_place_the_arrays_of_a_model_holding_handles():
    # One entry per argument, a PyTree prefix of it, as `jax.jit` takes them: the
    # model's handles are static, its arrays placed as the entry says.
    split = NamedSharding(_mesh(), P("x"))
    here = NamedSharding(_mesh(), P())
    total = es.State(jnp.zeros(()), name="total")
    model = {"scale": jnp.arange(float(N)), "total": total}

    def f(model, x):
        model["total"].value = model["total"].value + jnp.sum(x)
        return model["scale"] * x

    jitted = es.transform.jit(f, in_shardings=({"scale": split, "total": None}, here))
    compiled = jitted.lower(model, jnp.ones(N)).compile()
    *_, scale_sharding, x_sharding = compiled.input_shardings[0]
    assert scale_sharding.is_equivalent_to(split, 1)
    assert x_sharding.is_equivalent_to(here, 1)
    assert tree_allclose(jitted(model, jnp.ones(N)), jnp.arange(float(N)))
    assert total.value == N


def test_jit_with_one_sharding_refuses_keyword_arguments_as_jax_jit():
    split = NamedSharding(_mesh(), P("x"))
    jitted = es.transform.jit(lambda x, y: x + y, in_shardings=split)
    with pytest.raises(ValueError, match="kwargs when in_shardings is specified"):
        jitted(jnp.ones(N), y=jnp.ones(N))
    with pytest.raises(ValueError, match="kwargs when in_shardings is specified"):
        jax.jit(lambda x, y: x + y, in_shardings=split)(jnp.ones(N), y=jnp.ones(N))


def test_shard_map_reads_a_weakly_typed_state_in_both_tracing_modes(tracing_mode):
    seen = es.State(jnp.array(0.0), name="seen")  # a Python float: weakly typed
    assert seen.value.weak_type

    @es.transform.shard_map(
        mesh=_mesh("data"), in_specs=(P("data"),), out_specs=P("data")
    )
    def double(x):
        seen.value = seen.value + jax.lax.psum(x.sum(), "data")
        return 2 * x

    x = jnp.arange(2.0 * N)
    assert (double(x) == 2 * x).all()
    assert seen.value == x.sum()


def test_with_sharding_inside_a_trace_on_concrete_values():
    s = es.ParamState(jnp.zeros(3), name="w")
    values = es.StateDict({s: jnp.arange(3.0)})
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    @jax.jit
    def f(x):
        return values.with_sharding(sharding)[s] + x

    assert (f(jnp.ones(3)) == jnp.arange(3.0) + 1).all()


def test_with_sharding_that_does_not_fit_a_value_names_the_state():
    mesh = _mesh("data")
    step = es.State(jnp.array(0.0), name="step")
    split = jax.sharding.NamedSharding(mesh, P("data"))
    with pytest.raises(ValueError, match=r"Cannot place State 'step' \(f32\[\]\)"):
        es.values_of([step]).with_sharding(split)


_NESTED = {
    "cond": lambda f: es.transform.cond(True, f, lambda: None),
    "switch": lambda f: es.transform.switch(0, [f, lambda: None]),
    "jit": lambda f: es.transform.jit(f)(),
    "remat": lambda f: es.transform.remat(f)(),
    "while_loop": lambda f: es.transform.while_loop(
        lambda i: i < 1, lambda i: (f(), i + 1)[1], 0
    ),
}


@pytest.mark.parametrize("nested", sorted(_NESTED))
def test_transforms_nested_in_shard_map_write_a_split_state(nested, tracing_mode):
    # The nested trace must type the state as varying across devices, as its value is.
    split = es.State(jnp.zeros(N), name="split")

    def step(x):
        def add():
            split.value = split.value + x.sum()

        _NESTED[nested](add)
        return x

    _over_data(step, state_specs={split: P("data")})(jnp.arange(float(N)))
    assert tree_allclose(split.value, jnp.arange(float(N)))


def test_grad_nested_in_shard_map_of_a_split_state(tracing_mode):
    split = es.ParamState(jnp.ones(N), name="split")
    seen = es.State(jnp.zeros(N), name="seen")

    def step(x):
        loss = lambda: (split.value * x).sum()  # noqa: E731
        seen.value = es.transform.grad(loss, grad_states=[split])()[split]
        return x

    _over_data(step, state_specs=P("data"))(jnp.arange(float(N)))
    assert tree_allclose(seen.value, jnp.arange(float(N)))


def test_jit_of_shard_map_keeps_a_split_states_explicit_sharding():
    mesh = _mesh("x", AxisType.Explicit)
    s = es.State(jnp.zeros(2 * N), name="s")
    es.shard([s], mesh, P("x"))

    def add_one():
        s.value = s.value + 1

    sm = es.transform.shard_map(
        add_one, mesh=mesh, in_specs=(), out_specs=P(), state_specs=P("x")
    )
    es.transform.jit(sm)()
    assert tree_allclose(s.value, jnp.ones(2 * N))
    assert s.value.sharding.spec == P("x")
    assert jax.typeof(es.transform.jit(lambda: s.value)()) == jax.typeof(s.value)


@pytest.mark.parametrize("axis_type", (AxisType.Auto, AxisType.Explicit))
def test_jit_of_shard_map_moves_an_unplaced_state_to_its_spec(axis_type):
    # Eagerly the state is put on its spec before `jax.shard_map`; under `jit` it is
    # a traced value whose type (explicit axes) must be resharded there.
    mesh = _mesh("x", axis_type)
    s = es.State(jnp.zeros(2 * N), name="s")
    x = jax.device_put(jnp.arange(2.0 * N), NamedSharding(mesh, P("x")))

    def add(x):
        s.value = s.value + x
        return x

    sm = es.transform.shard_map(
        add, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"), state_specs=P("x")
    )
    step = es.transform.jit(sm)
    step(x)
    step(x)
    assert tree_allclose(s.value, 2 * jnp.arange(2.0 * N))
    assert s.value.sharding.is_equivalent_to(NamedSharding(mesh, P("x")), 1)


@pytest.mark.parametrize("loop", ["vmap", "map"])
def test_vmap_and_map_nested_in_shard_map_mix_a_shard_with_a_replicated_state(loop):
    w = es.State(jnp.array(2.0), name="w")
    per_row = {
        "vmap": es.transform.vmap,
        "map": lambda f: ft.partial(es.transform.map, f),
    }
    scaled = lambda x: per_row[loop](lambda row: row * w.value)(x)  # noqa: E731
    x = jnp.arange(2.0 * N).reshape(N, 2)
    out = _over_data(scaled)(x)
    assert tree_allclose(out, 2 * x)


def _vary(x):
    """`x` made varying across devices along "data", as JAX's error for a loop carry
    says: with `jax.lax.pcast(..., to="varying")`, or `jax.lax.pvary` in the JAX
    releases without it."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, ("data",), to="varying")
    return jax.lax.pvary(x, ("data",))


# Each body sums to a replicated scalar, from a value made varying across devices.
_VARYING = {
    "pcast": lambda x: jax.lax.psum(_vary(jnp.float32(1.0)), "data"),
    "axis_index": lambda x: jax.lax.psum(
        x.sum() * jax.lax.axis_index("data").astype(x.dtype), "data"
    ),
    "ppermute": lambda x: jax.lax.psum(
        jax.lax.ppermute(x, "data", [(i, (i + 1) % N) for i in range(N)]).sum(), "data"
    ),
}


@pytest.mark.parametrize("check_vma", (True, False))
@pytest.mark.parametrize("body", sorted(_VARYING))
def test_shard_map_traces_casts_to_varying_as_jax_shard_map(
    body, check_vma, tracing_mode
):
    # The states were once found by a trace outside `jax.shard_map`, where
    # `jax.lax.pcast(..., to="varying")` failed with a bare AssertionError.
    calls = es.State(jnp.array(0), name="calls")

    def f(x):
        calls.value = calls.value + 1
        return _VARYING[body](x)

    specs = dict(mesh=_mesh("data"), in_specs=(P("data"),), out_specs=P())
    x = jnp.arange(2.0 * N)
    expected = jax.shard_map(_VARYING[body], check_vma=check_vma, **specs)(x)
    out = es.transform.shard_map(f, check_vma=check_vma, **specs)(x)
    assert tree_allclose(out, expected) and calls.value == 1
    jitted = es.transform.jit(es.transform.shard_map(f, check_vma=check_vma, **specs))
    assert tree_allclose(jitted(x), expected) and calls.value == 2


def _scan_sums(x, total, cast):
    """Adds the rows of `x` to `total` in a scan, and the result summed over devices:
    one device's body of `shard_map`, the running total a per-device value."""
    if cast:  # As JAX's carry type error says: a replicated carry is made varying.
        total = _vary(total)

    def step(t, row):
        return t + row.reshape(t.shape), t

    total, partial = jax.lax.scan(step, total, x)
    return jax.lax.psum(total, "data"), partial


@pytest.mark.parametrize("replicated", (True, False))
def test_state_carried_through_scan_in_shard_map_takes_per_device_values(
    replicated, tracing_mode
):
    # A replicated state is invariant across devices on entry, so a scan that adds
    # per-device rows to it must be made varying first, as in plain JAX;
    # a split one varies already.
    start = jnp.arange(2.0) if replicated else jnp.arange(2.0 * N).reshape(N, 2)
    total = es.State(start, name="total")
    spec = P() if replicated else P("data")

    def f(x):
        if replicated:
            total.value = _vary(total.value)

        def step(_, row):
            seen = total.value
            total.value = total.value + row.reshape(total.value.shape)
            return None, seen

        _, partial = es.transform.scan(step, None, x)
        total.value = jax.lax.psum(total.value, "data")
        return partial

    mesh = _mesh("data")
    x = jnp.arange(N * 3 * 2.0).reshape(N * 3, 2)
    sm = es.transform.shard_map(
        f, mesh=mesh, in_specs=(P("data"),), out_specs=P("data"), state_specs=spec
    )
    expected_total, expected_partial = jax.shard_map(
        ft.partial(_scan_sums, cast=replicated),
        mesh=mesh,
        in_specs=(P("data"), spec),
        out_specs=(spec, P("data")),
    )(x, total.value)
    partial = sm(x)
    assert tree_allclose(partial, expected_partial)
    assert tree_allclose(total.value, expected_total)


def test_a_scan_carry_of_a_replicated_state_written_per_device_fails_as_in_jax():
    # Without the cast JAX refuses the carry, and says how to fix it.
    total = es.State(jnp.zeros(2), name="total")

    def f(x):
        def step(_, row):
            total.value = total.value + row.reshape(total.value.shape)
            return None, None

        es.transform.scan(step, None, x)
        total.value = jax.lax.psum(total.value, "data")
        return x

    x = jnp.ones((N, 2))
    match = r"(?s)carry input and carry output must have equal types.*(pcast|pvary)"
    with pytest.raises(TypeError, match=match):
        jax.shard_map(
            ft.partial(_scan_sums, cast=False),
            mesh=_mesh("data"),
            in_specs=(P("data"), P()),
            out_specs=(P(), P("data")),
        )(x, total.value)
    with pytest.raises(TypeError, match=match):
        _over_data(f)(x)
    assert tree_allclose(total.value, jnp.zeros(2))


def test_a_spec_naming_an_axis_not_in_the_mesh_names_the_state_and_the_axes():
    mesh = _mesh("x")
    s = es.State(jnp.zeros(N), name="typo")
    match = r"\('y',\) of State 'typo'.*mesh has only the axes \('x',\)"
    with pytest.raises(ValueError, match=match):
        es.shard([s], mesh, P("y"))

    def f(x):
        s.value = s.value + 1
        return x

    sm = es.transform.shard_map(
        f, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"), state_specs={s: P("y")}
    )
    with pytest.raises(ValueError, match=match):
        sm(jnp.zeros(N))


def test_a_spec_naming_a_mesh_axis_twice_names_the_state():
    mesh = _mesh("x")
    s = es.State(jnp.zeros((N, N)), name="square")
    # (`PartitionSpec(...)` or `P(...)`, as JAX's version spells it.)
    match = r"\('x', 'x'\) of State 'square'.*axes \['x'\] more than once"
    with pytest.raises(ValueError, match=match):
        es.shard([s], mesh, P("x", "x"))

    def f(x):
        s.value = s.value + 1
        return x

    sm = es.transform.shard_map(
        f, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"), state_specs={s: P("x", "x")}
    )
    with pytest.raises(ValueError, match=match):
        sm(jnp.zeros(N))
    assert (s.value == 0).all()


@pytest.mark.parametrize("n_specs", [1, 3])
def test_shard_map_refuses_in_specs_of_another_length_than_the_arguments(n_specs):
    sm = es.transform.shard_map(
        lambda x, y: x + y,
        mesh=_mesh("x"),
        in_specs=(P("x"),) * n_specs,
        out_specs=P("x"),
    )
    match = rf"`in_specs`.* has {n_specs} entries, but it is called with 2 positional"
    with pytest.raises(ValueError, match=match):
        sm(jnp.zeros(N), jnp.ones(N))


def test_shard_map_takes_one_partition_spec_for_every_argument():
    sm = es.transform.shard_map(
        lambda x, y: x + y, mesh=_mesh("x"), in_specs=P("x"), out_specs=P("x")
    )
    assert tree_allclose(sm(jnp.zeros(N), jnp.ones(N)), jnp.ones(N))


def test_shard_map_refuses_keyword_arguments_as_jax_shard_map():
    def add(x, y):
        return x + y

    sm = es.transform.shard_map(
        add, mesh=_mesh("x"), in_specs=(P("x"), P("x")), out_specs=P("x")
    )
    with pytest.raises(TypeError, match=r"of add takes positional arguments only.*'y'"):
        sm(jnp.zeros(N), y=jnp.ones(N))


def test_shard_takes_a_plain_mapping_from_handles_as_a_state_dict():
    w = es.ParamState(jnp.ones(2 * N), name="w")
    placed = es.shard({w: w.value + 1}, _mesh("x"), P("x"))
    assert isinstance(placed, es.StateDict) and list(placed) == [w]
    assert placed[w].sharding.spec == P("x")
    assert tree_allclose(placed[w], jnp.full(2 * N, 2.0))


def test_shard_map_docs_say_a_replicated_write_is_checked_only_with_check_vma():
    # With check_vma=False JAX keeps no record of what differs across devices.
    docstring = " ".join((es.transform.shard_map.__doc__ or "").split())
    assert "Only with `check_vma=True`" in docstring
    doc = (_EXAMPLES.parent / "docs" / "how-to" / "multi-device.md").read_text()
    assert "with `check_vma=False` there is none" in doc
    # Each device keeps its own value (see the test below), not one device's.
    for text in (docstring, " ".join(doc.split())):
        assert "a different value on each device under a replicated sharding" in text
        assert "one device's value" not in text


def test_shard_map_without_check_vma_leaves_each_device_its_own_replicated_write():
    mesh = _mesh("data")
    t = es.State(jnp.zeros(()), name="t")

    def index():
        return jax.lax.axis_index("data").astype(jnp.float32)

    def write():
        t.value = index()

    es.transform.shard_map(
        write, mesh=mesh, in_specs=(), out_specs=None, check_vma=False
    )()
    expected = jax.shard_map(
        index, mesh=mesh, in_specs=(), out_specs=P(), check_vma=False
    )()
    assert t.value.sharding.is_fully_replicated
    copies = [float(shard.data) for shard in t.value.addressable_shards]
    assert copies == [float(shard.data) for shard in expected.addressable_shards]
    assert copies == [float(i) for i in range(N)]


def test_a_state_and_an_argument_on_different_devices_name_the_state():
    devices = jax.devices()
    w = es.State(jax.device_put(jnp.ones(4), devices[3]), name="w")

    @es.transform.jit
    def f(x):
        w.value = w.value + x

    on_3, on_1 = (jax.device_put(jnp.ones(4), devices[i]) for i in (3, 1))
    with pytest.raises(ValueError, match="incompatible devices") as first:
        f(on_1)
    f(on_3)  # makes the plan that later calls go through
    with pytest.raises(ValueError, match="incompatible devices") as planned:
        f(on_1)
    for error in (first, planned):
        notes = "\n".join(getattr(error.value, "__notes__", []))
        assert "State 'w' on devices [3]" in notes
    assert (w.value == 2).all()


def test_shard_map_spec_for_every_state_leaves_a_non_batch_state_whole(getkey):
    # An ensemble stacked on axis 0 split over the mesh with one spec: each device
    # sees its members' parameters and the whole shared value, as `vmap` would.
    members = es.ParamState(jr.normal(getkey(), (N, 3)), name="members")
    shared = es.NonBatchState(jnp.arange(float(N)), name="shared")

    @es.transform.shard_map(
        mesh=_mesh("ens"), in_specs=(), out_specs=P("ens"), state_specs=P("ens")
    )
    def step():
        return members.value.sum(1) + shared.value.sum()

    assert tree_allclose(step(), members.value.sum(1) + shared.value.sum())


def test_shard_map_filter_leaves_a_non_batch_state_whole_and_a_function_decides():
    shared = es.NonBatchState(jnp.arange(float(N)), name="shared")

    def total_on_each_device():
        return jnp.reshape(shared.value.sum(), (1,))

    options = dict(mesh=_mesh("data"), in_specs=(), out_specs=P("data"))
    by_kind = es.transform.shard_map(
        total_on_each_device, state_specs={es.State: P("data")}, **options
    )
    assert tree_allclose(by_kind(), jnp.full(N, jnp.arange(float(N)).sum()))
    by_function = es.transform.shard_map(
        total_on_each_device, state_specs=lambda s, v: P("data"), **options
    )
    assert tree_allclose(by_function(), jnp.arange(float(N)))


@pytest.mark.parametrize("tag", ["INIT_NO_BATCHING", "hyper"])
def test_shard_map_spec_for_every_state_leaves_a_replicated_state_whole(tag):
    # As a NonBatchState: what `vmap_new_states` replicated (tagged INIT_NO_BATCHING
    # or selected by `state_to_exclude`) is shared whole by every member.
    members, shared = es.transform.vmap_new_states(
        lambda: (
            es.ParamState(es.random.normal((3,)), name="members"),
            es.State(jnp.arange(float(N)), name="shared", tag=tag),
        ),
        axis_size=N,
        state_to_exclude="hyper",
    )()
    assert shared.value.shape == (N,)

    @es.transform.shard_map(
        mesh=_mesh("ens"), in_specs=(), out_specs=P("ens"), state_specs=P("ens")
    )
    def step():
        return members.value.sum(1) + shared.value.sum()

    assert tree_allclose(step(), members.value.sum(1) + shared.value.sum())
    with pytest.raises(ValueError, match=r"'shared'.*replicated it.*never split"):
        es.transform.shard_map(
            lambda: shared.value,
            mesh=_mesh("ens"),
            in_specs=(),
            out_specs=P(),
            state_specs={shared: P("ens")},
        )


def test_shard_map_refuses_a_spec_that_splits_a_non_batch_state_it_names():
    shared = es.NonBatchState(jnp.zeros(N), name="shared")
    for whole in (P(), P(None)):  # specs that do not split it are taken
        replicated = es.transform.shard_map(
            lambda: shared.value.sum()[None],
            mesh=_mesh("data"),
            in_specs=(),
            out_specs=P("data"),
            state_specs={shared: whole},
        )
        assert replicated().shape == (N,)
    with pytest.raises(ValueError, match=r"'shared'.*NonBatchState.*never split"):
        es.transform.shard_map(
            lambda: shared.value,
            mesh=_mesh("data"),
            in_specs=(),
            out_specs=P(),
            state_specs={shared: P("data")},
        )


@pytest.mark.parametrize("mesh_set", (True, False), ids=("set_mesh", "no_set_mesh"))
@pytest.mark.parametrize("axis_type", (AxisType.Auto, AxisType.Explicit))
@pytest.mark.parametrize("in_axes", (0, 1))
def test_vmap_new_states_over_an_argument_split_along_the_mapped_axis(
    axis_type, in_axes, mesh_set
):
    mesh = _mesh("x", axis_type)
    x = jnp.arange(2.0 * N * 3).reshape(2 * N, 3)
    x = x if in_axes == 0 else x.T
    spec = P("x") if in_axes == 0 else P(None, "x")
    x = jax.device_put(x, NamedSharding(mesh, spec))

    def member(scale, row):
        return es.ParamState(row * scale + es.random.normal(()))

    # An unmapped array first: the keys follow the first *mapped* one.
    scale = jnp.full((), 2.0)
    es.random.seed(0)  # A key last split under another mesh carries that mesh.
    build = es.transform.vmap_new_states(member, in_axes=(None, in_axes))
    if _EXPLICIT_NEEDS_SET_MESH and axis_type is AxisType.Explicit and not mesh_set:
        with pytest.raises(ValueError, match=_NO_MESH_SET):
            build(scale, x)
        return
    with jax.set_mesh(mesh) if mesh_set else contextlib.nullcontext():
        ensemble = build(scale, x)
    rows = np.asarray(x if in_axes == 0 else x.T)
    noise = np.asarray(ensemble.value) - rows * 2
    assert ensemble.value.shape == (2 * N, 3)
    # One draw per member, broadcast along its row, and members differ.
    assert np.allclose(noise, noise[:, :1]) and len(set(noise[:, 0])) == 2 * N


@pytest.mark.skipif(
    _EXPLICIT_NEEDS_SET_MESH,
    reason="JAX before 0.10 cannot mix the lanes' keys with an explicitly split "
    "argument in an eager computation without `jax.set_mesh`, and may keep such a "
    "computation made without it (documented: JAX 0.10 and later)",
)
@pytest.mark.parametrize("jitted", (False, True), ids=("eager", "jit"))
def test_vmap_draws_per_lane_over_an_argument_split_on_an_explicit_axis(
    jitted, tracing_mode
):
    # `jax.vmap` needs every mapped axis split alike: the lanes' keys follow `x`.
    mesh = _mesh("x", AxisType.Explicit)
    x = jax.device_put(jnp.zeros((N, 3)), NamedSharding(mesh, P("x")))
    es.random.seed(0)
    f = es.transform.vmap(lambda row: row + es.random.normal(()))
    f = es.transform.jit(f) if jitted else f
    if tracing_mode == "two-pass":
        # The public-API fallback evaluates the lane's jaxpr under `jax.vmap`, where
        # JAX batches the draw's inner `jit` without the argument's mesh.
        with pytest.raises(ValueError, match="is not found in mesh"):
            f(x)
        return
    first, second = np.asarray(f(x)), np.asarray(f(x))
    assert np.allclose(first, first[:, :1]) and len(set(first[:, 0])) == N
    assert not np.allclose(first, second)  # the key advanced


@pytest.mark.parametrize("reads_another", (False, True))
def test_shard_map_called_twice_in_one_trace_finds_the_states_of_each_call(
    reads_another,
):
    # The first call's Python only reads `a`; the second's writes it (and reads `c`).
    # Not weakly typed, so that a kept trace would fit the second call.
    a = es.State(jnp.zeros(()), name="a")
    b = es.State(jnp.zeros(()), name="b")
    c = es.State(jnp.full((), 10.0), name="c")
    second = [False]

    def count(x):
        total = jax.lax.psum(x.sum(), "data")
        if second[0]:
            a.value = a.value + total + (c.value if reads_another else 0.0)
        else:
            a.value
        b.value = b.value + total
        return x

    counted = _over_data(count)

    @es.transform.jit
    def twice(x):
        second[0] = False
        counted(x)
        second[0] = True
        return counted(x)

    assert tree_allclose(twice(jnp.ones(N)), jnp.ones(N))
    assert a.value == N + (10 if reads_another else 0) and b.value == 2 * N


@pytest.mark.parametrize("changes", ("writes", "reads"))
def test_shard_map_refuses_a_function_whose_states_change_between_its_two_traces(
    changes, tracing_mode
):
    a = es.State(jnp.array(0.0), name="a")
    b = es.State(jnp.array(1.0), name="b")
    traces = [0]
    # Finding the states runs the Python once, or twice on the two-pass fallback.
    finding = 1 if tracing_mode == "single-pass" else 2

    def f(x):
        traces[0] += 1
        if traces[0] > finding:  # the run on each device, not the traces before it
            if changes == "writes":
                a.value = a.value + 1
            else:
                x = x + b.value
        return x + a.value

    with pytest.raises(es.UnstableStatesError, match="f touched other states"):
        _over_data(f)(jnp.ones(N))
    assert a.value == 0
