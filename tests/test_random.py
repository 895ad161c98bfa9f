import eqstate as es
import jax
import jax.numpy as jnp
import pytest

from .helpers import tree_bitwise_equal


SAMPLERS = {
    "normal": lambda: es.random.normal((3,)),
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


def test_default_state_is_a_random_state_in_the_world():
    assert isinstance(es.random.DEFAULT, es.RandomState)
    assert es.random.DEFAULT in es.world()
    sf = es.transform.StatefulFunction(lambda: es.random.uniform())
    sf.make_jaxpr()
    assert sf.get_write_states() == (es.random.DEFAULT,)


def test_a_key_of_another_implementation_gets_a_fitting_message():
    with pytest.raises(es.StateValueError, match="another PRNG implementation"):
        es.random.seed(jax.random.key(0, impl="rbg"))
