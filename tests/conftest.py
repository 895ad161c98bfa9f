import contextvars
import gc
import os

import jax


# Multi-device tests need 8 CPU devices, which must be set before any array exists.
jax.config.update("jax_num_cpu_devices", 8)

# Equinox's test settings: no implicit dtype or rank promotion, in the library or in
# the tests (but see the `numpy_promotion` marker), so that eqstate works for users
# who run strict.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import jax.random as jr  # noqa: E402
import pytest  # noqa: E402
from eqstate import _jax_compat  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402


# Property tests: a few hundred examples in CI, the same ones on every run so that a
# red CI is reproducible; `--hypothesis-profile=long` by hand explores fresh ones.
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "default",
    max_examples=200,
    deadline=None,
    suppress_health_check=_SLOW_OK,
    derandomize=True,
)
# Its own parent would be the "default" profile above, fixed programs included.
settings.register_profile(
    "long",
    max_examples=10_000,
    deadline=None,
    suppress_health_check=_SLOW_OK,
    derandomize=False,
)
settings.load_profile("default")


# `EQSTATE_TEST_TWO_PASS=1` runs the tests on the public-API fallback: every thread
# starts in it. Tests taking `tracing_mode` already run in both modes in the normal
# suite, so this run leaves them out (see `pytest_collection_modifyitems`).
_TWO_PASS_ONLY = bool(os.environ.get("EQSTATE_TEST_TWO_PASS"))
if _TWO_PASS_ONLY:
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


if os.environ.get("EQSTATE_TEST_CHECK_LEAKS"):

    @pytest.fixture(autouse=True)
    def _check_tracer_leaks(request):
        """Every test under `jax.checking_leaks()`: a tracer kept after its trace
        ends (in a cache, a frame, a handle) fails the test. Tests marked
        `upstream_leak` run unchecked: they use a JAX or Equinox feature that trips
        JAX's checker without eqstate too (the marker says which); so do those
        marked `counts_compilations`, as the checker turns JAX's caches off."""
        node = request.node
        if node.get_closest_marker("upstream_leak") or node.get_closest_marker(
            "counts_compilations"
        ):
            yield
            return
        # JAX's checker runs `gc.collect()` whenever a trace ends; freezing what exists
        # before the test keeps that cheap. Tracers made during the test stay visible
        # to the checker, so leaks into older objects (caches) are still caught.
        gc.collect()
        gc.freeze()
        with jax.checking_leaks():
            yield


# On a TPU, float32 matrix products run at bfloat16 precision by default; the tests
# compare with references computed at float32 precision on the CPU.
_ON_TPU = jax.default_backend() == "tpu"
if _ON_TPU:
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _cpu_or_gpu_only(request):
    """Tests marked `cpu_or_gpu` are skipped on a TPU, with the marker's reason."""
    marker = request.node.get_closest_marker("cpu_or_gpu")
    if _ON_TPU and marker is not None:
        pytest.skip(f"not on a TPU: {marker.args[0]}")


@pytest.fixture(autouse=True)
def _numpy_promotion(request):
    """Tests marked `numpy_promotion` run with JAX's default promotion: they run code
    that is not eqstate's and relies on it (the marker says which)."""
    if not request.node.get_closest_marker("numpy_promotion"):
        yield
        return
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


def pytest_collection_modifyitems(config, items):
    if not _TWO_PASS_ONLY:
        return
    both_modes = [item for item in items if "tracing_mode" in item.fixturenames]
    if both_modes:
        config.hook.pytest_deselected(items=both_modes)
        items[:] = [item for item in items if "tracing_mode" not in item.fixturenames]


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "upstream_leak(reason): trips jax.checking_leaks without eqstate too",
    )
    config.addinivalue_line(
        "markers",
        "cpu_or_gpu(reason): needs what a TPU lacks (a program that raises while it "
        "runs, the CPU's memory accounting); skipped on a TPU with the reason",
    )
    config.addinivalue_line(
        "markers",
        "counts_compilations: counts XLA compilations, which jax.checking_leaks "
        "multiplies (it turns JAX's caches off), so the leak-checked run runs it "
        "unchecked",
    )
    config.addinivalue_line(
        "markers",
        "numpy_promotion(reason): relies on implicit promotion outside eqstate, so "
        "it runs with JAX's default promotion (the others run strict)",
    )
