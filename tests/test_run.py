import asyncio
import contextvars
import re
import threading

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from .helpers import unchecked


def test_world_is_an_immutable_snapshot():
    s = es.State(jnp.zeros(2))
    snapshot = es.world()
    assert s in snapshot and (snapshot[s] == 0).all()
    s.value = jnp.ones(2)
    assert (snapshot[s] == 0).all() and (es.world()[s] == 1).all()


def test_scope_reads_and_writes_its_dict_and_never_the_world():
    s = es.State(jnp.zeros(2), name="s")
    with es.scope(es.StateDict({s: jnp.ones(2)})) as sc:
        assert (s.value == 1).all()
        s.value = s.value * 3
        new = es.ParamState(jnp.full(2, 9.0))
    assert (s.value == 0).all()
    assert sc.states is not None
    assert (sc.states[s] == 3).all() and (sc.states[new] == 9).all()
    assert new not in es.world()


def test_scope_is_strict():
    inside = es.State(jnp.zeros(2))
    outside = es.State(jnp.zeros(2), name="outside")
    with es.scope(es.StateDict({inside: jnp.ones(2)})):
        with pytest.raises(es.StateNotFoundError, match="State 'outside' is not in"):
            outside.value


def test_scope_keeps_nothing_if_the_block_raises():
    s = es.State(jnp.zeros(2))
    sc = es.scope(es.StateDict({s: jnp.ones(2)}))
    with pytest.raises(RuntimeError, match="boom"):
        with sc:
            s.value = jnp.full(2, 5.0)
            raise RuntimeError("boom")
    assert (s.value == 0).all()
    with pytest.raises(RuntimeError, match="only available once the block has exited"):
        sc.states


def test_scope_takes_a_state_dict():
    with pytest.raises(TypeError, match="StateDict"):
        es.scope({})  # pyright: ignore[reportArgumentType]


def test_a_scope_cannot_be_entered_twice():
    sc = es.scope(es.StateDict())
    with sc:
        with pytest.raises(RuntimeError, match="entered twice"):
            with sc:
                pass


def test_reading_an_eager_scope_inside_raw_jit_raises():
    s = es.State(jnp.zeros(2), name="s")
    with es.scope(es.StateDict({s: jnp.ones(2)})):
        with pytest.raises(es.TraceContextError, match="Cannot read State 's'"):
            jax.jit(lambda: s.value)()


def test_run_is_the_functional_scope():
    s = es.State(jnp.array(1.0))

    def f(x):
        s.value = s.value + x
        return s.value * 2

    states, out = es.run(f, es.StateDict({s: jnp.array(10.0)}), 1.0)
    assert states[s] == 11 and out == 22 and s.value == 1


def test_run_works_under_jit_and_filter_jit():
    s = es.ShortTermState(jnp.array(0))

    def tick(x):
        s.value = s.value + 1
        return x * s.value

    states = es.world().filter(s)
    states, out = jax.jit(lambda sd, x: es.run(tick, sd, x))(states, 3.0)
    states, out = eqx.filter_jit(lambda sd, x: es.run(tick, sd, x))(states, 3.0)
    assert states[s] == 2 and out == 6 and s.value == 0


def test_run_under_jit_refuses_writes_inside_a_nested_raw_vmap():
    s = es.State(jnp.zeros(()), name="s")

    def f(xs):
        def body(x):
            s.value = x
            return x

        return jax.vmap(body)(xs)

    with pytest.raises(es.TraceContextError, match="Cannot write State 's'"):
        jax.jit(lambda sd, xs: es.run(f, sd, xs))(es.world().filter(s), jnp.ones(3))


def test_run_under_jit_allows_reads_inside_a_nested_raw_vmap():
    s = es.State(jnp.array(2.0))
    f = lambda xs: jax.vmap(lambda x: x * s.value)(xs)  # noqa: E731
    _, out = jax.jit(lambda sd, xs: es.run(f, sd, xs))(
        es.world().filter(s), jnp.ones(3)
    )
    assert (out == 2).all()


class _Linear(eqx.Module):
    w: es.ParamState
    count: es.ShortTermState

    def __init__(self, n):
        self.w = es.ParamState(jnp.ones(n), name="w")
        self.count = es.ShortTermState(jnp.array(0), name="count")

    def __call__(self, x):
        self.count.value = self.count.value + 1
        return self.w.value @ x


def test_make_with_states_builds_without_touching_the_world():
    before = len(es.world())
    model, states = es.make_with_states(_Linear)(3)
    assert len(es.world()) == before
    assert states.states == (model.w, model.count)
    with pytest.raises(es.StateNotFoundError):
        model.w.value
    states, out = es.run(model, states, jnp.ones(3))
    assert out == 3 and states[model.count] == 1


def test_states_of_finds_handles_in_flattening_order_once():
    model = _Linear(2)
    tree = {"a": model, "b": [model.w, 1.0]}
    assert es.states_of(tree) == (model.w, model.count)
    assert es.states_of(tree, es.ShortTermState) == (model.count,)
    pairs = es.states_of(tree, with_paths=True)
    assert [jax.tree_util.keystr(p) for p, _ in pairs] == ["['a'].w", "['a'].count"]


def test_states_of_passes_paths_to_predicates():
    model = _Linear(2)
    by_path = es.states_of(
        {"enc": model}, lambda path, s: jax.tree_util.keystr(path).endswith(".w")
    )
    assert by_path == (model.w,)


def test_threads_each_run_their_own_scope():
    s = es.State(jnp.array(0))
    results = {}

    def work(i):
        with es.scope(es.StateDict({s: jnp.array(i)})) as sc:
            for _ in range(50):
                s.value = s.value + 1
        assert sc.states is not None
        results[i] = int(sc.states[s])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: i + 50 for i in range(8)}
    assert s.value == 0


def _context_of_a_scope(count, *, raises=False):
    """The `contextvars` context copied inside a scope over `count`, and the scope."""
    sc = es.scope(es.StateDict({count: jnp.array(0)}))
    try:
        with sc:
            count.value = count.value + 1
            copied = contextvars.copy_context()
            if raises:
                raise ValueError("boom")
    except ValueError:
        pass
    return copied, sc


def _increment(count):
    count.value = count.value + 1


@pytest.mark.parametrize(
    "use",
    [
        _increment,
        es.transform.jit(_increment),
        lambda count: count.value,
        lambda count: es.world(),
        lambda count: es.State(jnp.zeros(2)),
        lambda count: es.assign({count: jnp.array(5)}),
    ],
    ids=["write", "jit", "read", "world", "create", "assign"],
)
def test_code_that_copied_a_scope_context_cannot_use_it_once_the_scope_ended(use):
    count = es.State(jnp.array(0), name="count")
    copied, sc = _context_of_a_scope(count)
    result = sc.states
    with pytest.raises(es.TraceContextError, match=r"`eqstate.scope`.*has ended"):
        copied.run(use, count)
    assert result[count] == 1 and sc.states[count] == 1 and count.value == 0


def test_a_scope_that_raised_is_ended_too():
    count = es.State(jnp.array(0), name="count")
    copied, _ = _context_of_a_scope(count, raises=True)
    with pytest.raises(es.TraceContextError, match=r"State 'count'.*has ended"):
        copied.run(_increment, count)


def test_an_asyncio_task_outliving_its_scope_leaves_the_result_unchanged():
    count = es.State(jnp.array(0), name="count")
    step = es.transform.jit(_increment)

    async def worker():
        for _ in range(10):
            step(count)
            await asyncio.sleep(0)

    async def main():
        with es.scope(es.StateDict({count: jnp.array(0)})) as sc:
            task = asyncio.create_task(worker())
            await asyncio.sleep(0)
        first = int(sc.states[count])
        with pytest.raises(es.TraceContextError, match=r"State 'count'.*await"):
            await task
        return first, int(sc.states[count])

    first, later = asyncio.run(main())
    assert first == later == 1


def test_an_awaited_task_writes_to_its_scope():
    count = es.State(jnp.array(0), name="count")

    async def main():
        with es.scope(es.StateDict({count: jnp.array(0)})) as sc:
            await asyncio.to_thread(_increment, count)
            await asyncio.create_task(asyncio.to_thread(_increment, count))
        return sc.states[count]

    assert asyncio.run(main()) == 2


def test_a_thread_with_a_context_copied_in_run_cannot_write_once_run_returned():
    count = es.State(jnp.array(0), name="count")
    new, copied = es.run(contextvars.copy_context, es.values_of([count]))
    errors = []

    def write_later():
        try:
            _increment(count)
        except es.TraceContextError as error:
            errors.append(error)

    thread = threading.Thread(target=copied.run, args=(write_later,))
    thread.start()
    thread.join()
    assert len(errors) == 1 and "State 'count'" in str(errors[0])
    assert new[count] == 0


def test_a_world_snapshot_taken_in_a_scope_keeps_its_values_once_it_ended():
    inside = es.State(jnp.array(3), name="inside")
    outside = es.State(jnp.array(4), name="outside")
    with es.scope(es.values_of([inside])):
        snapshot = es.world()
    assert snapshot[inside] == 3 and outside in snapshot
    assert "State(name='outside'): <not visible here>" in repr(snapshot)


def test_values_of_reads_the_states_of_a_pytree():
    model = _Linear(2)
    params = es.values_of(model, es.ParamState)
    assert params.states == (model.w,) and (params[model.w] == 1).all()
    with es.scope(es.StateDict({model.w: jnp.full(2, 3.0), model.count: jnp.array(0)})):
        assert (es.values_of(model)[model.w] == 3).all()


def test_assign_writes_all_or_nothing():
    model = _Linear(2)
    es.assign({model.w: jnp.full(2, 2.0), model.count: jnp.array(5)})
    assert (model.w.value == 2).all() and model.count.value == 5
    with pytest.raises(ValueError, match="ShortTermState 'count'"):
        es.assign({model.w: jnp.zeros(2), model.count: jnp.zeros(3)})
    assert (model.w.value == 2).all() and model.count.value == 5


@pytest.mark.parametrize("where", ["world", "scope"])
def test_assign_inside_a_raw_jit_says_it_cannot_write(where):
    w = es.ParamState(jnp.zeros(3), name="w")
    write = jax.jit(lambda x: es.assign({w: x}))
    with pytest.raises(es.TraceContextError, match="Cannot write ParamState 'w'"):
        if where == "world":
            write(jnp.ones(3))
        else:
            with es.scope(es.values_of(w)):
                write(jnp.ones(3))
    assert (w.value == 0).all()


def test_init_states_gives_states_values_of_new_shapes_and_dtypes():
    h = es.ShortTermState(jnp.zeros((512, 100)), name="h")
    c = es.State({"a": jnp.zeros(2)}, name="c")
    with pytest.raises(es.StateValueError, match=r"`eqstate\.init_states\(\{state: "):
        h.value = jnp.zeros((1, 100))
    with pytest.raises(es.StateValueError, match=r"structure.*`eqstate\.init_states"):
        c.value = [jnp.zeros(3)]
    es.init_states({h: jnp.ones((1, 100), jnp.int32), c: [jnp.zeros(3)]})
    assert h.value.shape == (1, 100) and h.value.dtype == jnp.int32
    assert jax.tree.structure(c.value) == jax.tree.structure([0])
    h.value = h.value + 1  # writes check against the new value
    assert (h.value == 2).all()


def test_init_states_is_all_or_nothing():
    h = es.ShortTermState(jnp.zeros(3), name="h")
    rng = es.RandomState(0, name="rng")
    with pytest.raises(es.StateValueError, match=r"RandomState 'rng'.*typed PRNG keys"):
        es.init_states({h: jnp.zeros(5), rng: jnp.zeros(2)})
    with pytest.raises(es.StateValueError, match=r"'abc'.*ShortTermState 'h'"):
        es.init_states({h: "abc"})
    assert h.value.shape == (3,)


def test_init_states_changes_a_scope_and_not_the_world():
    h = es.ShortTermState(jnp.zeros(3), name="h")
    step = jax.jit(lambda sd: es.run(lambda: es.init_states({h: jnp.ones(4)}), sd)[0])
    assert (step(es.values_of(h))[h] == jnp.ones(4)).all()
    with es.scope(es.values_of(h)) as scope:
        es.init_states({h: jnp.ones(2)})
    assert scope.states[h].shape == (2,) and h.value.shape == (3,)
    other = es.State(jnp.zeros(()), name="other")
    with pytest.raises(es.StateNotFoundError, match="State 'other'"):
        with es.scope(es.values_of(h)):
            es.init_states({other: jnp.ones(2)})


def test_init_states_inside_a_transform_writes_the_same_shape_and_refuses_another():
    h = es.ShortTermState(jnp.zeros(3), name="h")
    es.transform.jit(lambda: es.init_states({h: jnp.ones(3)}))()
    assert (h.value == 1).all()
    with pytest.raises(
        es.StateValueError,
        match=r"Cannot give ShortTermState 'h' \(f32\[3\]\) the value f32\[4\] "
        "inside an eqstate transform.*before calling the transformed function",
    ):
        es.transform.jit(lambda: es.init_states({h: jnp.ones(4)}))()
    with pytest.raises(es.TraceContextError, match="Cannot write ShortTermState 'h'"):
        jax.jit(lambda: es.init_states({h: jnp.ones(4)}))()
    assert (h.value == 1).all()


def test_a_jitted_function_traces_again_after_init_states():
    h = es.ShortTermState(jnp.zeros((2, 3)), name="h")

    @es.transform.jit
    def step(x):
        h.value = h.value + x
        return h.value.sum()

    assert step(jnp.ones((2, 3))) == 6
    es.init_states({h: jnp.zeros((5, 3))})
    assert step(jnp.ones((5, 3))) == 15 and h.value.shape == (5, 3)


def test_a_state_set_in_a_module_call_gets_a_note_under_eqstate():
    class VAE(eqx.Module):
        scale: es.ParamState

        def __call__(self, x):
            self.kl_loss = es.State(x.sum())  # pyright: ignore[reportAttributeAccessIssue]
            return x * self.scale.value

    model = VAE(es.ParamState(jnp.ones(2)))
    for call in (
        es.transform.jit(model),
        es.transform.grad(lambda x: model(x).sum()),
        lambda x: es.run(model, es.values_of(model), x),
    ):
        with pytest.raises(AttributeError, match="kl_loss") as info:
            call(jnp.ones(2))
        assert "Create the state in `__init__`" in "".join(info.value.__notes__)


def test_world_read_inside_an_eqstate_transform_is_a_state_read():
    s = es.State(jnp.array(1.0), name="s")
    f = es.transform.jit(lambda x: es.world()[s] * x)
    assert f(2.0) == 2.0
    s.value = jnp.array(3.0)
    assert f(2.0) == 6.0  # not a stale constant
    sf = es.transform.StatefulFunction(lambda x: es.world()[s] * x).make_jaxpr(2.0)
    assert sf.get_read_states() == (s,)


def test_world_filter_inside_an_eqstate_transform_reads_only_the_states_kept():
    s = es.State(jnp.array(2.0), name="s")
    other = es.State(jnp.array(5.0), name="other")

    def f():
        return es.run(lambda: s.value * 2, es.world().filter(s))[1]

    sf = es.transform.StatefulFunction(f).make_jaxpr()
    assert sf.get_states() == (s,)
    assert es.transform.jit(f)() == 4.0
    s.value = jnp.array(7.0)
    assert es.transform.jit(f)() == 14.0
    assert other.value == 5.0


_WORLD_DERIVED = {
    "filter": lambda w, s: w.filter(es.ParamState)[s],
    "split": lambda w, s: w.split(es.ParamState)[0][s],
    "set": lambda w, s: w.set(s, w[s] * 2)[s],
    "update": lambda w, s: w.update({s: w[s] * 2})[s],
    "or": lambda w, s: (w | {s: w[s] * 2})[s],
    "ror": lambda w, s: ({s: jnp.array(0.0)} | w)[s],
    "merge": lambda w, s: es.StateDict.merge(w, {}).filter(s)[s],
    "get": lambda w, s: w.get(s),
    "repr": lambda w, s: repr(w.split(es.ParamState)[0].set(s, w[s])) and w[s],
}


@pytest.mark.parametrize("op", list(_WORLD_DERIVED))
def test_a_dictionary_derived_from_world_inside_vmap_reads_only_what_is_used(op):
    # Reading the default key inside `vmap` splits it per lane and advances it: a
    # dictionary derived from `world()` must not read states it was not asked for.
    s = es.ParamState(jnp.array(1.0), name="s")
    derive = _WORLD_DERIVED[op]
    es.random.seed(0)
    expected = es.random.split_key()
    es.random.seed(0)
    out = es.transform.vmap(lambda x: derive(es.world(), s) + x)(jnp.zeros(3))
    assert out.shape == (3,)
    assert (
        jax.random.key_data(es.random.split_key()) == jax.random.key_data(expected)
    ).all()


@pytest.mark.parametrize("op", list(_WORLD_DERIVED))
def test_a_dictionary_derived_from_world_inside_a_scope_needs_only_what_is_used(op):
    s = es.ParamState(jnp.array(3.0), name="s")
    outside = es.ParamState(jnp.array(0.0), name="outside")
    with es.scope(es.values_of([s])):
        got = _WORLD_DERIVED[op](es.world(), s)
    del outside
    assert float(got) == {"set": 6.0, "update": 6.0, "or": 6.0, "ror": 3.0}.get(op, 3.0)


def test_a_dictionary_derived_from_world_inside_jit_keeps_its_values():
    s = es.State(jnp.array(1.0), name="s")
    t = es.State(jnp.array(10.0), name="t")

    def f():
        derived = es.world().filter(s, t).set(t, jnp.array(20.0))
        s.value = jnp.array(7.0)  # after the snapshot: not seen by it
        return derived[s] + derived[t]

    assert es.transform.jit(f)() == 21.0


def test_world_get_inside_a_scope_raises_for_a_world_state_the_scope_lacks():
    s = es.State(jnp.array(1.0), name="s")
    other = es.State(jnp.array(2.0), name="other")
    stranger = es.State(jnp.array(3.0), name="stranger")
    with es.scope(es.values_of([s])):
        world = es.world()
        with pytest.raises(es.StateNotFoundError, match="'other'"):
            world.get(other)
    assert es.StateDict({s: 1.0}).get(stranger, "default") == "default"
    del stranger


@pytest.mark.parametrize("jit", (False, True))
def test_world_inside_a_scope_reads_the_scope_eagerly_and_under_jit(jit):
    inside = es.State(jnp.array(1.0), name="inside")
    outside = es.State(jnp.array(2.0), name="outside")

    def read(state):
        return es.world()[state] + 0.0

    read = es.transform.jit(read) if jit else read
    with es.scope(es.StateDict({inside: jnp.array(100.0)})):
        assert read(inside) == 100.0 == inside.value
        with pytest.raises(
            es.StateNotFoundError, match="'outside' is not in the StateDict this code"
        ):
            read(outside)


def test_world_inside_a_scope_is_a_snapshot():
    s = es.State(jnp.array(1.0), name="s")
    with es.scope(es.StateDict({s: jnp.array(100.0)})):
        snapshot = es.world()
        s.value = jnp.array(7.0)
        assert snapshot[s] == 100.0 and es.world()[s] == 7.0


@pytest.mark.parametrize(
    "call",
    [
        lambda f, values: es.run(f, values)[1],
        lambda f, values: es.run(es.transform.jit(f), values)[1],
        lambda f, values: es.transform.jit(f)(),
        lambda f, values: es.transform.StatefulFunction(f).jaxpr_call_auto(),
    ],
    ids=["eager", "jit-in-run", "jit", "stateful-function"],
)
def test_a_world_snapshot_inside_a_function_keeps_the_values_it_was_taken_with(call):
    s = es.State(jnp.array(1.0), name="s")
    t = es.State(jnp.array(10.0), name="t")

    def f():
        t.value = t.value + 1  # written before the snapshot
        snapshot = es.world()
        s.value = jnp.array(7.0)
        t.value = jnp.array(-5.0)
        return snapshot[s], snapshot[t]

    got = call(f, es.values_of([s, t]))
    assert float(got[0]) == 1.0 and float(got[1]) == 11.0


def test_world_default_key_inside_jit_is_read_at_every_call():
    es.random.seed(0)
    draw = es.transform.jit(
        lambda: jax.random.normal(es.world()[es.random.DEFAULT], ())
    )
    first = draw()
    es.random.split_key()  # advances the default key
    assert draw() != first


@pytest.mark.parametrize(
    "raw",
    [
        lambda f: jax.jit(f)(2.0),
        lambda f: eqx.filter_jit(f)(2.0),
        lambda f: jax.lax.scan(lambda c, x: (c + f(x), None), 0.0, jnp.ones(2))[0],
        lambda f: jax.vmap(jax.jit(f))(jnp.ones(2)),
    ],
)
def test_world_inside_a_staging_raw_transform_raises(raw):
    s = es.State(jnp.array(1.0), name="s")
    with pytest.raises(es.TraceContextError, match=r"Cannot read `eqstate.world\(\)`"):
        raw(lambda x: es.world()[s] * x)


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: jax.vmap(f)(jnp.ones((2, 3))),
        lambda f: jax.grad(lambda x: jnp.sum(f(x)))(jnp.ones(3)),
        lambda f: jax.jvp(f, (jnp.ones(3),), (jnp.ones(3),))[0],
        lambda f: jax.jacrev(f)(jnp.ones(3)),
        lambda f: eqx.filter_vmap(f)(jnp.ones((2, 3))),
    ],
)
def test_eager_raw_transforms_that_evaluate_at_once_may_read(transform):
    # Not a ParamState: reading one inside a raw differentiation warns.
    w = es.LongTermState(jnp.arange(3.0), name="w")
    reference = transform(lambda x: jnp.arange(3.0) * x)
    assert jnp.allclose(transform(lambda x: w.value * x), reference)
    assert jnp.allclose(transform(lambda x: es.world()[w] * x), reference)
    with es.scope(es.world().filter(w)):
        assert jnp.allclose(transform(lambda x: w.value * x), reference)


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: jax.vmap(f)(jnp.ones((2, 3))),
        lambda f: jax.grad(lambda x: jnp.sum(f(x)))(jnp.ones(3)),
    ],
)
def test_eager_raw_transforms_still_refuse_writes(transform):
    w = es.ParamState(jnp.arange(3.0), name="w")

    def write(x):
        w.value = x
        return x

    with pytest.raises(es.TraceContextError, match="Cannot write ParamState 'w'"):
        transform(write)
    assert (w.value == jnp.arange(3.0)).all()


@pytest.mark.parametrize(
    "staging",
    [
        lambda f: jax.jit(f)(jnp.ones(3)),
        lambda f: jax.vmap(jax.jit(f))(jnp.ones((2, 3))),
        lambda f: jax.jit(jax.vmap(f))(jnp.ones((2, 3))),
        lambda f: jax.checkpoint(f)(jnp.ones(3)),
        lambda f: jax.grad(lambda x: jnp.sum(jax.jit(f)(x)))(jnp.ones(3)),
    ],
)
def test_raw_transforms_that_stage_out_refuse_reads(staging):
    w = es.ParamState(jnp.arange(3.0), name="w")
    with pytest.raises(es.TraceContextError, match="Cannot read ParamState 'w'"):
        staging(lambda x: w.value * x)


@pytest.mark.parametrize("values", ([1, 2], {"w": 1.0}, None))
def test_assign_takes_a_mapping_of_states(values):
    w = es.State(jnp.zeros(()), name="w")
    with pytest.raises(TypeError, match=r"`eqstate\.assign` takes a StateDict"):
        unchecked(es.assign)(values)
    assert w.value == 0.0


def test_printing_the_world_inside_a_scope_marks_what_it_cannot_see():
    a = es.State(jnp.zeros(2), name="a")
    b = es.State(jnp.ones(2), name="b")  # a world state the scope does not hold
    with es.scope(es.values_of([a])):
        text = repr(es.world())
        assert b in es.world()
    # (With an `id=` too where another live state of the world has the same name.)
    assert re.search(r"State\(name='a'(, id=#\d+)?\): f32\[2\]", text)
    assert re.search(r"State\(name='b'(, id=#\d+)?\): <not visible here>", text)


def test_printing_the_world_inside_a_transform_reads_nothing():
    a = es.State(jnp.zeros(2), name="a")
    b = es.State(jnp.ones(2), name="b")

    def f(x):
        print(es.world())  # a debugging print must not change the trace
        return x * a.value

    sf = es.transform.StatefulFunction(f)
    sf.make_jaxpr(jnp.ones(2))
    assert sf.get_states() == (a,) and b not in sf.get_states()
    key = jax.random.key_data(es.random.DEFAULT.value)
    es.transform.vmap(f)(jnp.ones((3, 2)))
    assert (jax.random.key_data(es.random.DEFAULT.value) == key).all()


def test_a_world_snapshot_that_escaped_its_trace_says_so():
    a = es.State(jnp.zeros(2), name="a")
    box = []

    @es.transform.jit
    def f():
        box.append(es.world())
        return a.value

    f()
    # (With an `id=` too if another live state of the world is named 'a'.)
    assert "State(name='a'" in repr(box[0])
    with pytest.raises(es.TraceContextError, match=r"State 'a'.*trace that has ended"):
        box[0][a]


def test_a_world_snapshot_in_eager_control_flow_keeps_its_values():
    s = es.State(jnp.array(1.0), name="s")

    def body():
        snapshot = es.world()
        s.value = jnp.array(7.0)
        return snapshot[s]

    with jax.disable_jit():
        got = es.transform.cond(True, body, body)
    assert got == 1.0 and s.value == 7.0


@pytest.mark.parametrize(
    "call",
    [es.states_of, es.values_of, es.trainable, lambda sd: es.values_of(sd, es.State)],
    ids=["states_of", "values_of", "trainable", "values_of-filtered"],
)
def test_a_state_dict_given_for_a_model_is_refused_rather_than_found_empty(call):
    values = es.StateDict({es.ParamState(jnp.ones(2)): jnp.ones(2)})
    with pytest.raises(TypeError, match=r"a StateDict holds none.*filter"):
        call(values)


def test_make_with_states_says_what_its_constructor_cannot_read():
    build = es.make_with_states(lambda: es.ParamState(es.random.normal((2,))))
    with pytest.raises(es.StateNotFoundError, match=r"make_with_states.*explicit key"):
        build()


@pytest.mark.parametrize(
    "convert",
    [lambda sd: jax.tree.map(lambda x: 0.0, sd), jax.device_get],
    ids=["tree-map-to-floats", "device-get"],
)
def test_a_state_dict_of_python_or_numpy_values_runs_as_arrays(convert):
    count = es.State(jnp.array(0.0), name="count")
    values = convert(es.values_of([count]))

    def step():
        count.value = count.value + 1
        return count.value

    new, out = es.run(step, values)
    assert isinstance(out, jax.Array) and out == 1.0 and new[count] == 1.0


@pytest.mark.parametrize(
    "transform", [es.transform.jit, es.transform.StatefulFunction], ids=["jit", "sf"]
)
def test_a_kept_trace_iterating_the_world_keeps_the_states_it_was_traced_with(
    transform,
):
    class Bias(es.ParamState):  # A kind of this test's own.
        pass

    def total():
        return sum(es.world().filter(Bias).values())

    kept = transform(total)
    first = Bias(jnp.array(1.0))
    assert kept() == 1
    later = Bias(jnp.array(10.0))
    assert kept() == 1 and total() == 11  # as documented in `world`
    kept.clear_cache()
    assert kept() == 11
    assert first in es.world() and later in es.world()


def test_a_scope_cannot_be_entered_again_after_it_exits():
    n = es.State(jnp.array(0))
    sc = es.scope(es.StateDict({n: jnp.array(0)}))
    with sc:
        n.value = n.value + 1
    with pytest.raises(RuntimeError, match="entered twice"):
        with sc:
            n.value = n.value + 10
    assert sc.states[n] == 1
    with es.scope(sc.states) as again:
        n.value = n.value + 1
    assert again.states[n] == 2 and n.value == 0
