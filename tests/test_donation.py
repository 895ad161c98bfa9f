"""`jit(donate_states=True)` and `donate_argnums`: the buffers are really reused for
every training pattern the docs teach; a call that does not donate says so; a failed
call says which values it took.

These tests compare buffer addresses (`unsafe_buffer_pointer`), which XLA reuses for a
donated input of the same shape on the CPU as on accelerators. The test of a call XLA
refuses for want of memory runs unchanged on an accelerator:
`pytest tests/test_donation.py -k refuses`.
"""

import threading
import warnings

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import pytest

from .helpers import raises_at_run_time


def _buffers(tree) -> set[int]:
    """The device buffers of the arrays of `tree` (of a key, its data's)."""
    found = set()
    for x in jax.tree.leaves(tree):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jr.key_data(x)
        found.add(x.unsafe_buffer_pointer())
    return found


def _kept_in_place(step, values) -> bool:
    """Whether one more call of `step` writes the new value of each array of
    `values()` into that array's own buffer (not into another donated one, which
    costs XLA a copy of both)."""
    before = [_buffers(x) for x in jax.tree.leaves(values())]
    step()
    return before == [_buffers(x) for x in jax.tree.leaves(values())]


def _reused(step, values) -> tuple[int, int]:
    """`(reused, all)`: how many of the buffers of `values()` one more call of `step`
    gives back to the new values."""
    before = _buffers(values())
    step()
    return len(_buffers(values()) & before), len(before)


def _increment(s, **options):
    @es.transform.jit(donate_states=True, **options)
    def increment(x=1.0):
        s.value = s.value + x
        return jnp.sum(s.value)

    return increment


def test_a_single_written_state_is_updated_in_place():
    s = es.State(jnp.ones(3), name="s")
    increment = _increment(s)
    increment()
    for _ in range(3):
        assert _reused(increment, lambda: s.value) == (1, 1)
    assert (s.value == 5).all()


def test_read_only_states_are_never_donated(getkey):
    w = es.ParamState(jr.normal(getkey(), (3, 3)), name="w")
    h = es.ShortTermState(jnp.zeros(3), name="h")

    @es.transform.jit(donate_states=True)
    def step(x):
        h.value = jnp.tanh(w.value @ h.value + x)

    step(jnp.ones(3))
    w_before = w.value
    assert _reused(lambda: step(jnp.ones(3)), lambda: h.value) == (1, 1)
    assert not w_before.is_deleted()


@pytest.mark.parametrize("taken", ["value", "values_of"])
def test_a_donating_call_consumes_the_values_taken_before_it_as_jax_jit_does(taken):
    # As `jax.jit(f, donate_argnums=0)(x)` deletes `x`: a donated value is the
    # call's, and an array taken from it before the call is deleted by it.
    plain = jnp.ones(3)
    jax.jit(lambda x: x + 1, donate_argnums=0)(plain)
    s = es.State(jnp.ones(3), name="s")
    increment = _increment(s)
    increment()
    old = s.value if taken == "value" else es.values_of(s)[s]
    increment()
    assert old.is_deleted() == plain.is_deleted() == True  # noqa: E712
    assert (s.value == 3).all()


def test_a_copy_kept_as_the_docs_say_survives_donation():
    s = es.State(jnp.ones(3), name="s")
    increment = _increment(s)
    increment()
    snapshot = jnp.copy(s.value)
    increment()
    assert not snapshot.is_deleted() and (snapshot == 2).all()
    assert (s.value == 3).all()


def _adam_step(w, b, opt_state, optimizer):
    def loss(x):
        return jnp.sum((x @ w.value + b.value[None]) ** 2)

    def step(x):
        grads = es.transform.grad(loss, grad_states=[w, b])(x)
        params = es.values_of([w, b])
        updates, opt_state.value = optimizer.update(grads, opt_state.value, params)
        es.assign(optax.apply_updates(params, updates))

    return step


@pytest.mark.numpy_promotion("optax.adam: a Python float to an int32 power")
def test_a_state_holding_an_optax_state_over_a_state_dict_is_donated(getkey):
    # The optimiser's state holds `StateDict`s (its moments, keyed by `w` and `b`).
    w = es.ParamState(jr.normal(getkey(), (4, 3)), name="w")
    b = es.ParamState(jnp.zeros(3), name="b")
    optimizer = optax.adam(1e-2)
    opt_state = es.LongTermState(optimizer.init(es.values_of([w, b])), name="opt")
    step = es.transform.jit(_adam_step(w, b, opt_state, optimizer), donate_states=True)
    x = jnp.ones((2, 4))
    step(x)
    # The same step in plain JAX, donating the parameters and the optimiser's state.
    params = {"w": w.value + 0, "b": b.value + 0}
    plain_state = optimizer.init(params)

    def plain_step(params, state, x):
        grads = jax.grad(lambda p: jnp.sum((x @ p["w"] + p["b"][None]) ** 2))(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    plain = jax.jit(plain_step, donate_argnums=(0, 1))
    box = {"plain": plain(params, plain_state, x)}

    def plain_call():
        box["plain"] = plain(*box["plain"], x)

    plain_reused = _reused(plain_call, lambda: box["plain"])
    reused = _reused(lambda: step(x), lambda: es.values_of([w, b, opt_state]))
    assert reused == plain_reused and reused[0] == reused[1]
    assert _kept_in_place(lambda: step(x), lambda: es.values_of([w, b, opt_state]))


def test_donated_states_keep_their_buffers_beside_outputs_of_their_types():
    total = es.State(jnp.zeros(()), name="total")
    w = es.ParamState(jnp.ones(3), name="w")

    @es.transform.jit(donate_states=True)
    def step(x):
        loss = jnp.sum(w.value * x)
        total.value = total.value + loss
        w.value = w.value - x
        return loss, w.value * 2  # a scalar and a vector, as the states

    step(jnp.ones(3))
    assert _kept_in_place(lambda: step(jnp.ones(3)), lambda: (total.value, w.value))
    assert float(total.value) == 3.0 and (w.value == -1).all()


def test_donated_arguments_keep_their_buffers_beside_written_states_of_their_types():
    # `donate_argnums` alone: the written state (not donated) must not take the
    # buffer of the argument's array of its type.
    calls = es.State(jnp.zeros(3), name="calls")

    @es.transform.jit(donate_argnums=0)
    def step(params):
        calls.value = calls.value + params["b"]
        return {"w": params["w"] - 1.0, "b": params["b"] - 1.0}

    box = {"params": step({"w": jnp.ones((3, 3)), "b": jnp.ones(3)})}

    def call():
        box["params"] = step(box["params"])

    assert _kept_in_place(call, lambda: box["params"])
    assert (calls.value == 1.0).all()  # 0 + 1, then + 0


class _Net(eqx.Module):
    linear: eqx.nn.Linear
    scale: es.ParamState
    calls: es.ShortTermState

    def __init__(self, key):
        self.linear = eqx.nn.Linear(4, 3, key=key)
        self.scale = es.ParamState(jnp.ones(3), name="scale")
        self.calls = es.ShortTermState(jnp.array(0), name="calls")

    def __call__(self, x):
        self.calls.value = self.calls.value + 1
        return jax.vmap(self.linear)(x) * self.scale.value[None]


@pytest.mark.numpy_promotion("optax.adam: a Python float to an int32 power")
def test_a_model_passed_as_an_argument_is_donated_with_its_optimiser_state(getkey):
    # The model-in style of the Equinox how-to: `donate_argnums=0` donates the
    # model's arrays, `donate_states=True` its states and the optimiser's.
    model = _Net(getkey())
    optimizer = optax.adam(1e-2)
    opt_state = es.LongTermState(optimizer.init(es.trainable(model)), name="opt")

    @es.transform.jit(donate_states=True, donate_argnums=0)
    def train_step(model, opt_state, x):
        loss = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
        grads = es.transform.grad(loss, argnums=0, grad_states=es.ParamState)
        updates, opt_state.value = optimizer.update(
            grads(model, x), opt_state.value, es.trainable(model)
        )
        return es.apply_updates(model, updates)

    x = jnp.ones((2, 4))
    model = train_step(model, opt_state, x)
    box = {"model": model}

    def step():
        box["model"] = train_step(box["model"], opt_state, x)

    def values():
        model = box["model"]
        arrays = eqx.filter(model, eqx.is_array)
        return arrays, es.values_of(model), opt_state.value

    reused, n = _reused(step, values)
    assert reused == n
    # Each array in its own buffer: the optimiser's moments have the model's types.
    assert _kept_in_place(step, values)


def test_an_ensemble_from_vmap_new_states_is_donated(getkey):
    def make(key):
        return es.ParamState(jr.normal(key, (3,)), name="w")

    w = es.transform.vmap_new_states(make, axis_size=4)(jr.split(getkey(), 4))

    @es.transform.jit(donate_states=True)
    def step(x):
        grads = es.transform.grad(
            lambda: jnp.sum((w.value * x[None]) ** 2), grad_states=w
        )()
        w.value = w.value - 0.1 * grads[w]

    step(jnp.ones(3))
    assert _reused(lambda: step(jnp.ones(3)), lambda: w.value) == (1, 1)


def test_the_buffers_of_a_tuple_are_reused():
    hc = es.State((jnp.ones(2), jnp.full(2, 2.0)), name="hc")

    @es.transform.jit(donate_states=True)
    def step():
        hc.value = (hc.value[0] * 2, hc.value[1] * 2)

    step()
    assert _reused(step, lambda: hc.value) == (2, 2)


def test_the_buffer_of_a_random_key_is_reused():
    rng = es.RandomState(0, name="rng")
    draw = es.transform.jit(lambda: jr.normal(rng.split_key()), donate_states=True)
    draw()
    for _ in range(3):
        assert _reused(draw, lambda: rng.value) == (1, 1)


def test_a_state_written_from_another_inside_the_call():
    a = es.State(jnp.ones(3), name="a")
    b = es.State(jnp.zeros(3), name="b")

    @es.transform.jit(donate_states=True)
    def step():
        b.value = a.value
        a.value = a.value * 2

    for _ in range(3):
        step()
    assert (b.value == 4).all() and (a.value == 8).all()


def test_a_value_also_passed_as_an_argument_is_copied_and_said_so():
    # XLA cannot donate a buffer the call also reads: the value is copied first.
    s = es.State(jnp.ones(3), name="s")
    increment = _increment(s)
    increment(1.0)
    with pytest.warns(UserWarning, match=r"does not donate the values of State 's'"):
        assert increment(s.value) == 12.0  # 2 + 2, three times
    assert (s.value == 4).all()
    assert _reused(increment, lambda: s.value) == (1, 1)  # donated again after


def test_two_states_holding_one_array_are_copied_and_said_so():
    a = es.State(jnp.ones(3), name="a")
    b = es.State(jnp.ones(3), name="b")

    @es.transform.jit(donate_states=True)
    def step():
        a.value = a.value + 1
        b.value = b.value * 3

    shared = jnp.zeros(3)
    es.assign({a: shared, b: shared})
    with pytest.warns(UserWarning, match=r"State 'a'.*State 'b'.*also another input"):
        step()
    assert (a.value == 1).all() and (b.value == 0).all()


def test_calls_in_a_scope_or_run_do_not_donate_and_say_so_once():
    s = es.State(jnp.ones(3), name="s")
    increment = _increment(s)
    increment()
    with pytest.warns(UserWarning, match=r"State 's'.*inside `eqstate.scope`"):
        with es.scope(es.world().filter(s)) as scope:
            kept = s.value
            increment()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per function and reason
        mine = es.StateDict({s: jnp.ones(3)})
        new, _ = es.run(increment, mine)
    assert (kept == 2).all() and (s.value == 2).all() and (mine[s] == 1).all()
    assert scope.states is not None and (scope.states[s] == 3).all()
    assert (new[s] == 2).all()


@pytest.mark.parametrize(
    "check",
    [
        pytest.param(
            "error_if",
            marks=pytest.mark.upstream_leak(
                "eqx.error_if keeps its caller's frames alive"
            ),
        ),
        "debug_callback",
    ],
)
@raises_at_run_time
def test_functions_that_can_fail_at_run_time_do_not_donate_and_say_so(check):
    s = es.State(jnp.ones(3), name="s")

    def fail(x):
        if x > 0:
            raise RuntimeError("failed at run time")

    @es.transform.jit(donate_states=True)
    def step(x):
        if check == "error_if":
            s.value = eqx.error_if(s.value + x, x > 0, "x must not be positive")
        else:
            jax.debug.callback(fail, x)
            s.value = s.value + x

    with pytest.warns(UserWarning, match=r"not donate the values of State 's'.*fail"):
        step(-1.0)
    failure = eqx.EquinoxRuntimeError if check == "error_if" else Exception
    with pytest.raises(failure, match=r"x must not be positive|failed at run time"):
        step(1.0)
        jax.block_until_ready(s.value)
    assert (s.value == 0).all()  # the failed call left the last value readable


def test_a_nan_under_debug_nans_keeps_a_donated_value_and_says_so():
    s = es.State(jnp.ones(3), name="s")

    @es.transform.jit(donate_states=True)
    def step(x):
        s.value = jnp.log(s.value * x)

    step(2.0)
    with jax.debug_nans(True), pytest.raises(FloatingPointError, match="nan"):
        with pytest.warns(UserWarning, match=r"State 's'.*jax.debug_nans"):
            step(-1.0)
    assert jnp.allclose(s.value, jnp.log(2.0))


def test_a_state_that_lost_its_value_to_another_s_donation_is_named():
    # `target` was given the very array of `online`, which a donating call consumed:
    # a call reading `target` says so, rather than JAX's bare "deleted".
    online = es.State(jnp.ones(3), name="online")
    target = es.State(jnp.zeros(3), name="target")
    increment = _increment(online)
    increment()
    es.assign({target: online.value})
    increment()
    read = es.transform.jit(lambda: target.value * 2)
    with pytest.raises(RuntimeError, match=r"deleted") as info:
        read()
    assert "State 'target' (f32[3] (deleted)) held a deleted array" in "".join(
        info.value.__notes__
    )


def test_a_snapshot_a_donating_call_consumed_is_refused_by_save(tmp_path):
    # What a thread saving `values_of(...)` while another runs the step meets; the
    # fix is to take turns (below).
    s = es.State(jnp.ones(3), name="s")
    increment = _increment(s)
    increment()
    snapshot = es.values_of(s)
    increment()
    with pytest.raises(es.CheckpointError, match=r"deleted.*take turns"):
        es.save(tmp_path / "s.eqstate", snapshot)


def test_a_thread_saving_while_another_donates_takes_turns_with_it(tmp_path):
    s = es.State(jnp.zeros(1000), name="s")
    increment = _increment(s)
    lock = threading.Lock()
    done = threading.Event()

    def train():
        for _ in range(200):
            with lock:
                increment()
        done.set()

    saved = []
    thread = threading.Thread(target=train)
    thread.start()
    while not done.is_set():
        with lock:  # the docs' pattern: a copy taken in turn, saved outside it
            snapshot = jax.tree.map(jnp.copy, es.values_of([s]))
        es.save(tmp_path / "s.eqstate", snapshot)
        saved.append(float(es.load(tmp_path / "s.eqstate", snapshot)[s][0]))
    thread.join()
    assert saved and saved == sorted(saved)


def test_a_donating_call_xla_refuses_names_the_states_whose_values_it_took():
    # XLA refuses this call for want of memory (a terabyte output). The CPU refuses
    # it when run, after taking the donated buffers: the error names the states
    # whose values are lost. A TPU (v5e, JAX 0.10.2) refuses it while compiling and
    # takes nothing. Read-only states keep their values everywhere.
    w = es.State(jnp.ones(3), name="w")
    scale = es.State(jnp.full(3, 2.0), name="scale")

    @es.transform.jit(donate_states=True)
    def too_big():
        w.value = w.value * scale.value
        return jnp.ones((2**38,))  # 1 TiB

    with pytest.raises(Exception, match=r"(?i)memory|RESOURCE_EXHAUSTED") as info:
        too_big()
    notes = "".join(getattr(info.value, "__notes__", []))
    assert not scale.value.is_deleted() and (scale.value == 2).all()
    if w.value.is_deleted():
        assert (
            "donated buffers of State 'w' (f32[3] (deleted)): their values are lost"
            in notes
        )
    else:
        assert "their values are lost" not in notes and (w.value == 1).all()
