import re
import subprocess
import sys
import warnings

import eqstate as es
import jax
import jax.numpy as jnp
import pytest

from .helpers import tree_bitwise_equal, unchecked, unchecked_new


SAMPLERS = {
    "normal": lambda: es.random.normal((3,)),
    "randn": lambda: es.random.randn(2, 3),
    "rand": lambda: es.random.rand(3),
    "uniform": lambda: es.random.uniform((3,), minval=-1.0, maxval=2.0),
    "randint": lambda: es.random.randint((3,), 0, 10),
    "bernoulli": lambda: es.random.bernoulli(0.3, (3,)),
    "categorical": lambda: es.random.categorical(
        jnp.log(jnp.array([0.2, 0.8])), shape=(3,)
    ),
    "choice": lambda: es.random.choice(5, (3,), replace=False),
    "permutation": lambda: es.random.permutation(5),
    "truncated_normal": lambda: es.random.truncated_normal(-1.0, 1.0, (3,)),
    "gamma": lambda: es.random.gamma(2.0, (3,)),
    "exponential": lambda: es.random.exponential((3,)),
    "dropout_mask": lambda: es.random.dropout_mask(0.5, (3,)),
}

_REFERENCE = {
    "normal": lambda k: jax.random.normal(k, (3,)),
    "randn": lambda k: jax.random.normal(k, (2, 3)),
    "rand": lambda k: jax.random.uniform(k, (3,)),
    "uniform": lambda k: jax.random.uniform(k, (3,), minval=-1.0, maxval=2.0),
    "randint": lambda k: jax.random.randint(k, (3,), 0, 10),
    "bernoulli": lambda k: jax.random.bernoulli(k, 0.3, (3,)),
    "categorical": lambda k: jax.random.categorical(
        k, jnp.log(jnp.array([0.2, 0.8])), shape=(3,)
    ),
    "choice": lambda k: jax.random.choice(k, 5, (3,), replace=False),
    "permutation": lambda k: jax.random.permutation(k, 5),
    "truncated_normal": lambda k: jax.random.truncated_normal(k, -1.0, 1.0, (3,)),
    "gamma": lambda k: jax.random.gamma(k, 2.0, (3,)),
    "exponential": lambda k: jax.random.exponential(k, (3,)),
    "dropout_mask": lambda k: jax.random.bernoulli(k, 0.5, (3,)),
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_samplers_match_jax_random_with_the_split_key(name):
    es.random.seed(7)
    _, expected_key = jax.random.split(jax.random.key(7))
    assert tree_bitwise_equal(SAMPLERS[name](), _REFERENCE[name](expected_key))


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_samplers_advance_the_key(name):
    es.random.seed(1)
    first = SAMPLERS[name]()
    second = SAMPLERS[name]()
    assert not tree_bitwise_equal(first, second) or name == "permutation"
    es.random.seed(1)
    assert tree_bitwise_equal(SAMPLERS[name](), first)


@pytest.mark.usefixtures("tracing_mode")
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_same_seed_same_numbers_eagerly_under_jit_and_through_jaxpr_call(name):
    es.random.seed(11)
    eager = [SAMPLERS[name]() for _ in range(2)]
    eager_key = es.random.get_key()
    es.random.seed(11)
    jitted = es.transform.jit(SAMPLERS[name])
    under_jit = [jitted() for _ in range(2)]
    jit_key = es.random.get_key()
    es.random.seed(11)
    sf = es.transform.StatefulFunction(SAMPLERS[name])
    states = es.world().filter(es.random.DEFAULT)
    pure = []
    for _ in range(2):
        states, out = sf.jaxpr_call(states)
        pure.append(out)
    assert tree_bitwise_equal(eager, under_jit) and tree_bitwise_equal(eager, pure)
    assert tree_bitwise_equal(eager_key, jit_key)
    assert tree_bitwise_equal(eager_key, states[es.random.DEFAULT])


def test_explicit_key_leaves_the_default_state_alone():
    es.random.seed(0)
    before = es.random.get_key()
    x = es.random.normal((2,), key=jax.random.key(5))
    assert tree_bitwise_equal(x, jax.random.normal(jax.random.key(5), (2,)))
    assert tree_bitwise_equal(es.random.get_key(), before)


def test_split_key_and_set_key():
    es.random.set_key(jax.random.key(3))
    keys = es.random.split_key(4)
    ref = jax.random.split(jax.random.key(3), 5)
    assert tree_bitwise_equal(keys, ref[1:]) and tree_bitwise_equal(
        es.random.get_key(), ref[0]
    )


def test_random_state_from_a_seed_or_a_key():
    a = es.RandomState(3)
    b = es.RandomState(jax.random.key(3))
    assert tree_bitwise_equal(a.value, b.value)
    assert tree_bitwise_equal(a.split_key(), b.split_key())
    a.seed(9)
    assert tree_bitwise_equal(a.value, jax.random.key(9))


def test_random_state_refuses_a_legacy_key():
    with pytest.raises(TypeError, match="typed PRNG key"):
        es.RandomState(jnp.zeros(2, jnp.uint32))


def test_dropout_rate_is_checked():
    with pytest.raises(ValueError, match=r"rate` must be in \[0, 1\)"):
        es.random.dropout_mask(1.0, (2,))


def test_dropout_mask_with_a_traced_rate_matches_a_float_rate():
    es.random.seed(3)
    traced = es.transform.jit(lambda r: es.random.dropout_mask(r, (50,)))
    mask = traced(jnp.array(0.25))
    es.random.seed(3)
    assert tree_bitwise_equal(mask, es.random.dropout_mask(0.25, (50,)))


def test_default_state_is_a_random_state_in_the_world():
    assert isinstance(es.random.DEFAULT, es.RandomState)
    assert es.random.DEFAULT in es.world()
    sf = es.transform.StatefulFunction(lambda: es.random.uniform())
    sf.make_jaxpr()
    assert sf.get_write_states() == (es.random.DEFAULT,)


_FIRST_DRAW_UNDER_JIT = """
import eqstate as es, jax, jax.numpy as jnp

# Making the default key fails once (as under `jax.transfer_guard`): it is made on
# the next access, here a first draw under `jit`.
make_key, tries = jax.random.key, []

def fails_once(seed):
    tries.append(seed)
    if len(tries) == 1:
        raise RuntimeError("the first try fails")
    return make_key(seed)

jax.random.key = fails_once
try:
    es.random.DEFAULT.value
except RuntimeError as error:
    assert "the first try fails" in str(error), error
draw = es.transform.jit(lambda x: x + es.random.normal(()))
a, b = draw(jnp.zeros(())), draw(jnp.zeros(()))
assert a != b, (a, b)
es.random.DEFAULT.value  # a concrete key in the world
assert tries == [0, 0], tries
"""


def test_the_default_key_is_made_again_after_a_failure_and_not_as_a_tracer_in_jit():
    # In a fresh interpreter, so that the default key is made on these first uses.
    result = subprocess.run(
        [sys.executable, "-c", _FIRST_DRAW_UNDER_JIT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_a_key_of_another_implementation_gets_a_fitting_message():
    with pytest.raises(es.StateValueError, match="another PRNG implementation"):
        es.random.seed(jax.random.key(0, impl="rbg"))


_BAD_CALLS = {
    "choice_too_many": (
        lambda: es.random.choice(3, (5,), replace=False),
        ValueError,
        r"larger sample \(size 5\) than population \(size 3\)",
    ),
    "normal_int_dtype": (
        lambda: es.random.normal((2,), jnp.int32),
        ValueError,
        "`normal` must be a float",
    ),
    "exponential_int_dtype": (
        lambda: es.random.exponential((2,), jnp.int32),
        ValueError,
        "`exponential` must be a float",
    ),
    "randint_float_dtype": (
        lambda: es.random.randint((2,), 0, 5, jnp.float32),
        TypeError,
        "randint only accepts integer dtypes",
    ),
    "categorical_axis": (
        lambda: es.random.categorical(jnp.zeros(3), axis=4),
        ValueError,
        r"categorical`: `axis=4` is out of range for `logits` of shape \(3,\)",
    ),
    "categorical_scalar_logits": (
        lambda: es.random.categorical(jnp.zeros(())),
        ValueError,
        r"`axis=-1` is out of range for `logits` of shape \(\)",
    ),
    "negative_shape": (
        lambda: es.random.normal(-1),
        ValueError,
        r"normal`: `shape` must not have negative sizes, got -1",
    ),
    "fractional_shape": (
        lambda: unchecked(es.random.uniform)((2.5,)),
        TypeError,
        r"uniform`: `shape` must be an integer or a sequence of integers",
    ),
    "uniform_minval_shape": (
        lambda: es.random.uniform((2,), minval=jnp.zeros(3)),
        ValueError,
        r"`minval` of shape \(3,\) does not broadcast to `shape` \(2,\)",
    ),
    "bernoulli_p_shape": (
        lambda: es.random.bernoulli(jnp.full(3, 0.5), (2,)),
        ValueError,
        r"bernoulli`: `p` of shape \(3,\)",
    ),
    "gamma_a_shape": (
        lambda: es.random.gamma(jnp.ones((3, 2)), (2,)),
        ValueError,
        r"gamma`: `a` of shape \(3, 2\)",
    ),
    "truncated_normal_shape": (
        lambda: es.random.truncated_normal(jnp.zeros(3), 1.0, (2,)),
        ValueError,
        r"`lower` of shape \(3,\)",
    ),
    "permutation_axis": (
        lambda: es.random.permutation(jnp.arange(3), axis=2),
        ValueError,
        r"permutation`: `axis=2` is out of range for `x` of shape \(3,\)",
    ),
    "choice_axis": (
        lambda: es.random.choice(jnp.ones((2, 2)), (2,), axis=5),
        ValueError,
        r"choice`: `axis=5` is out of range for `a` of shape \(2, 2\)",
    ),
    "choice_p_shape": (
        lambda: es.random.choice(3, (2,), p=jnp.ones(4) / 4),
        ValueError,
        "p must be None or a 1D vector",
    ),
    "dropout_negative_shape": (
        lambda: es.random.dropout_mask(0.5, (-2,)),
        ValueError,
        "dropout_mask`: `shape` must not have negative sizes",
    ),
    "split_key_negative": (
        lambda: es.random.split_key(-5),
        ValueError,
        r"cannot make a negative number of keys \(-5\)",
    ),
    "split_key_fractional": (
        lambda: unchecked(es.random.DEFAULT.split_key)(2.5),
        TypeError,
        "takes a non-negative integer `n`",
    ),
    "seed_text": (
        lambda: unchecked(es.random.DEFAULT.seed)("abc"),
        TypeError,
        "pass an integer seed or a key .* got 'abc'",
    ),
}


@pytest.mark.parametrize("jit", (False, True))
@pytest.mark.parametrize("case", sorted(_BAD_CALLS))
def test_a_refused_sampler_call_leaves_the_default_key_alone(getkey, case, jit):
    call, error, match = _BAD_CALLS[case]
    es.random.set_key(getkey())
    before = es.random.get_key()
    with pytest.raises(error, match=match):
        (es.transform.jit(call) if jit else call)()
    assert tree_bitwise_equal(es.random.get_key(), before)


def test_a_random_state_refuses_text_as_a_seed():
    with pytest.raises(TypeError, match="got 'abc'"):
        unchecked_new(es.RandomState, "abc")


def test_split_key_of_zero_keys_is_empty():
    keys = es.random.split_key(0)
    assert keys.shape == (0,)


def test_seeding_a_random_state_with_an_integer_keeps_its_prng_implementation():
    rng = es.RandomState(jax.random.key(0, impl="rbg"), name="rng")
    rng.seed(5)
    assert jax.random.key_impl(rng.value) == jax.random.key_impl(
        jax.random.key(0, impl="rbg")
    )
    assert tree_bitwise_equal(
        jax.random.key_data(rng.value),
        jax.random.key_data(jax.random.key(5, impl="rbg")),
    )


@pytest.mark.usefixtures("tracing_mode")
def test_vmap_draws_from_mapped_keys_of_another_prng_implementation():
    keys = jax.random.split(jax.random.key(0, impl="rbg"), 3)
    rng = es.RandomState(keys, name="rng")
    out = es.transform.vmap(
        lambda x: jax.random.normal(rng.split_key()) + x, in_states={0: rng}
    )(jnp.zeros(3))
    want = jax.vmap(lambda k: jax.random.normal(jax.random.split(k)[1]))(keys)
    assert tree_bitwise_equal(out, want)
    assert jax.random.key_impl(rng.value) == jax.random.key_impl(keys)


@pytest.mark.parametrize("traced", (False, True))
def test_seeding_with_an_integer_array_keeps_the_prng_implementation(traced):
    rng = es.RandomState(jax.random.key(0, impl="rbg"), name="rng")
    seed = (lambda i: rng.seed(i)) if not traced else es.transform.jit(rng.seed)
    seed(jnp.int32(5))
    assert tree_bitwise_equal(
        jax.random.key_data(rng.value),
        jax.random.key_data(jax.random.key(5, impl="rbg")),
    )


def test_a_state_dict_gives_a_random_state_only_typed_keys():
    # A legacy `uint32[2]` key (or a seed) in a StateDict would reach the draws of
    # `es.run` as a batch of two keys (or fail inside JAX).
    rng = es.RandomState(0, name="rng")
    for value in (jax.random.PRNGKey(1), 5, jnp.zeros((), jnp.uint32)):
        with pytest.raises(es.StateValueError, match="RandomState 'rng' holds typed"):
            es.StateDict({rng: value})
        with pytest.raises(es.StateValueError, match="RandomState 'rng' holds typed"):
            es.StateDict().update({rng: value})
    keys = jax.random.split(jax.random.key(1), 3)
    assert es.StateDict({rng: keys})[rng].shape == (3,)
    one = es.StateDict({rng: jax.random.key(1)})
    _, draw = es.run(lambda: jax.random.normal(rng.split_key()), one)
    assert draw.shape == ()


@pytest.mark.parametrize(
    ("arguments", "got"),
    [
        ((-1.0, 1.0, (3,)), "shape=-1.0, dtype=1.0"),
        ((0, 1, (3,)), "shape=0, dtype=1"),
    ],
)
def test_uniform_called_as_numpy_s_names_the_eqstate_call(arguments, got):
    # `uniform(low, high, size)`, as NumPy and brainstate take it.
    with pytest.raises(
        TypeError,
        match=rf"got {got}\. Write `eqstate\.random\.uniform\(size, minval=low, maxval=high\)`",
    ):
        unchecked(es.random.uniform)(*arguments)


def test_randn_and_rand_with_a_key_are_jax_random_s(getkey):
    key = getkey()
    assert tree_bitwise_equal(
        es.random.randn(4, 2, key=key), jax.random.normal(key, (4, 2))
    )
    assert tree_bitwise_equal(
        es.random.rand(5, dtype=jnp.bfloat16, key=key),
        jax.random.uniform(key, (5,), jnp.bfloat16),
    )


# 2**46 elements, 2**48 bytes: beyond what a process can map on today's machines, so
# refused at once, never swapped. On the CPU the refusal comes after the call has
# returned, with every output of the program that failed.
_TOO_LARGE = 2**46
_OUT_OF_MEMORY = r"(?i)memory|RESOURCE_EXHAUSTED"
_REPLACED = (
    r"RandomState 'default_rng' held a key made by a computation that failed as it "
    r"ran \(.*\): that computation's outputs are lost"
)

# Calls whose successor key is split apart from the keys they hand out: it survives.
_KEY_APART = {
    "split_key": lambda: es.random.split_key(_TOO_LARGE),
    "vmap_new_states": lambda: (
        es.transform.vmap_new_states(
            lambda: es.ParamState(es.random.normal(())), axis_size=_TOO_LARGE
        )().value
    ),
}

# Calls whose successor key is an output of the program that fails: lost with it.
_KEY_LOST = {
    "jitted_draw": lambda: es.transform.jit(lambda: es.random.normal((_TOO_LARGE,)))(),
    "jit_creating_a_state": lambda: (
        es.transform.jit(lambda: es.ParamState(es.random.normal((_TOO_LARGE,))))().value
    ),
    "scan": lambda: es.transform.scan(
        lambda c, _: (c + es.random.normal((_TOO_LARGE,)).sum(), None),
        0.0,
        None,
        length=1,
    )[0],
    "cond": lambda: es.transform.cond(
        True, lambda: es.random.normal((_TOO_LARGE,)).sum(), lambda: 0.0
    ),
}


def _usable(x, what: str) -> None:
    """Fails if `x` is an output of a computation that failed as it ran, without
    printing it: converting such an array to NumPy hangs, on the CPU with JAX 0.10."""
    try:
        jax.block_until_ready(x)
    except Exception as error:
        pytest.fail(f"{what} failed with the computation: {error}")


def _fail(call) -> bool:
    """Runs `call`, which fails for want of memory. Returns whether it failed as it
    ran, after returning (the CPU with JAX 0.10), not at dispatch (JAX 0.8), where the
    call raises and writes nothing."""
    try:
        out = call()
    except Exception as error:
        assert re.search(_OUT_OF_MEMORY, str(error)), error
        return False
    with pytest.raises(Exception, match=_OUT_OF_MEMORY):
        jax.block_until_ready(out)  # the failure is the output's
    return True


def _fail_as_it_runs(call) -> None:
    """`_fail(call)`, for a test of what a failure as the call runs leaves. Where
    this JAX refuses the call at dispatch instead, checks that the default key is
    the one before the call, usable, and ends the test: no key was lost."""
    before = es.random.get_key()
    if not _fail(call):
        _usable(es.random.get_key(), "the default key")
        assert tree_bitwise_equal(es.random.get_key(), before)
        pytest.skip("this JAX refuses the call at dispatch, which writes nothing")


@pytest.mark.parametrize("call", sorted(_KEY_APART))
def test_a_call_too_large_for_memory_leaves_the_default_key_its_successor(getkey, call):
    es.random.set_key(getkey())
    key = es.random.get_key()
    successor, _ = jax.random.split(key)
    if not _fail(_KEY_APART[call]):
        successor = key  # refused at dispatch: nothing written
    _usable(es.random.get_key(), "the default key")
    assert tree_bitwise_equal(es.random.get_key(), successor)
    advanced, drawn = jax.random.split(successor)
    assert tree_bitwise_equal(es.random.normal((2,)), jax.random.normal(drawn, (2,)))
    assert tree_bitwise_equal(es.random.get_key(), advanced)


@pytest.mark.parametrize("call", sorted(_KEY_LOST))
def test_a_key_lost_with_a_failed_computation_is_replaced_when_read(getkey, call):
    start = getkey()
    es.random.set_key(start)
    handed_out = [es.random.split_key() for _ in range(3)]
    _fail_as_it_runs(_KEY_LOST[call])
    with pytest.warns(RuntimeWarning, match=_REPLACED):
        key = es.random.get_key()  # never hangs
    _usable(key, "the default key")
    # A fresh key, none handed out before, which draws as any key does.
    before = [start, *handed_out, *(jax.random.split(k)[0] for k in handed_out)]
    assert not any(tree_bitwise_equal(key, k) for k in before)
    advanced, drawn = jax.random.split(key)
    assert tree_bitwise_equal(es.random.normal((2,)), jax.random.normal(drawn, (2,)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # replaced once
        assert tree_bitwise_equal(es.random.get_key(), advanced)


_DRAW = es.transform.jit(lambda: es.random.normal((2,)))

# The next call that draws from the key, which finds it failed.
_NEXT_DRAWS = {
    "eager": lambda: es.random.normal((2,)),
    "jitted": _DRAW,
    "split_key": lambda: jax.random.normal(es.random.split_key(), (2,)),
    "vmap": lambda: es.transform.vmap(lambda: es.random.normal(()), axis_size=2)(),
}


@pytest.mark.parametrize("draw", sorted(_NEXT_DRAWS))
def test_the_next_draw_after_a_failed_computation_replaces_its_key(getkey, draw):
    es.random.set_key(getkey())
    _DRAW()  # the plan is made: the call below takes the fast path
    _fail_as_it_runs(_KEY_LOST["jitted_draw"])
    with pytest.warns(RuntimeWarning, match=_REPLACED):
        drawn = _NEXT_DRAWS[draw]()
    _usable(drawn, "the draw")
    _usable(es.random.get_key(), "the default key")


def test_a_failed_key_whose_last_good_key_was_donated_is_replaced(getkey):
    es.random.set_key(getkey())
    draw = es.transform.jit(lambda: es.random.normal((2,)), donate_states=True)
    for _ in range(3):
        es.random.get_key()  # seen good, then donated by the draw
        jax.block_until_ready(draw())
    failing = es.transform.jit(
        lambda: es.random.normal((_TOO_LARGE,)), donate_states=True
    )
    _fail_as_it_runs(failing)
    with pytest.warns(RuntimeWarning, match=_REPLACED):
        key = es.random.get_key()
    _usable(key, "the default key")
    _usable(draw(), "a draw")


def test_keys_replaced_after_two_failures_from_one_key_differ(getkey):
    start = getkey()
    replaced = []
    for _ in range(2):
        es.random.set_key(start)
        _fail_as_it_runs(_KEY_LOST["jitted_draw"])
        with pytest.warns(RuntimeWarning, match=_REPLACED):
            replaced.append(es.random.get_key())
    assert not tree_bitwise_equal(*replaced)


def test_a_failed_key_written_to_a_state_never_checked_is_replaced(getkey):
    failing = jax.jit(
        lambda k: (jax.random.split(k, 3), jax.random.normal(k, (_TOO_LARGE,)))
    )
    try:
        keys, out = failing(getkey())
    except Exception as error:
        assert re.search(_OUT_OF_MEMORY, str(error)), error
        pytest.skip("this JAX refuses the program at dispatch: no failed key to store")
    with pytest.raises(Exception, match=_OUT_OF_MEMORY):
        jax.block_until_ready(out)
    rng = es.RandomState(keys, name="failed")
    with pytest.warns(RuntimeWarning, match="RandomState 'failed' held a key"):
        fresh = rng.value
    _usable(fresh, "the replaced keys")
    assert fresh.shape == (3,)
    assert len({tuple(k) for k in jax.random.key_data(fresh).tolist()}) == 3


def test_a_jitted_draw_does_not_wait_for_the_key_it_draws_from(getkey):
    @jax.jit
    def slow(key, m):
        for _ in range(4):
            m = jnp.tanh(m @ m)
        return jax.random.fold_in(key, m.sum().astype(jnp.uint32))

    m = jnp.ones((600, 600)) / 600
    key = getkey()
    jax.block_until_ready(slow(key, m))  # compiled
    _DRAW()
    pending = slow(key, m)
    es.random.set_key(pending)
    drawn = _DRAW()
    # Still computing: the call returned without waiting for it.
    if jax.random.key_data(pending).is_ready():
        pytest.skip(
            "this JAX ran the program at dispatch: there is nothing to wait for"
        )
    _usable(drawn, "the draw")
