import contextvars
import os

import jax


# Multi-device tests need 8 CPU devices, which must be set before any array exists.
jax.config.update("jax_num_cpu_devices", 8)

import jax.random as jr  # noqa: E402
import pytest  # noqa: E402
from eqstate import _jax_compat  # noqa: E402


if os.environ.get("EQSTATE_TEST_TWO_PASS"):
    # Runs the whole suite on the public-API fallback: every thread starts in it.
    _jax_compat._single_pass = contextvars.ContextVar(
        "eqstate_single_pass", default=False
    )


@pytest.fixture
def getkey():
    """Returns a function giving a fresh PRNG key each call."""
    keys = iter(jr.split(jr.key(5678), 10_000))
    return lambda: next(keys)


@pytest.fixture(params=["single-pass", "two-pass"])
def tracing_mode(request):
    """Runs a test with single-pass tracing and with the public-API fallback."""
    with _jax_compat.use_single_pass(request.param == "single-pass"):
        if request.param == "single-pass" and not _jax_compat.single_pass_enabled():
            pytest.fail("this JAX release lost the single-pass tracing hook")
        yield request.param
