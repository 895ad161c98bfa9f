"""The only module of eqstate that touches JAX internals.

Everything here has a fallback on public APIs, so a JAX release that moves an internal
makes eqstate slower or its errors less precise, never wrong:

- adding a jaxpr input in the middle of a trace (`new_input`) lets a StatefulFunction
  discover the states it uses in a single trace. Without it, eqstate traces twice: once
  to discover the states, once with their values as inputs.
- the current trace (`current_trace`, `is_top_level`, `in_trace`) is read through
  `jax.extend.core` (JAX 0.10 on) when the private module is missing.
- a value loaded from a checkpoint is made weakly typed again (`weakly_typed`) when
  it was saved weakly typed; without the internal it stays strongly typed.
- a `scan`'s parameters that describe how its values are grouped (`FLAT_TREES`, JAX
  0.12) are compared by value in the keys of top-level programs; without it each call
  of such a loop compiles again.
- the key of eqstate's cache of traces holds JAX's trace context (`trace_context`:
  the configuration and the mapped axes `jax.jit` keys by). Without it no trace is
  reused, so every call traces again.
- JAX's caches of the traces nested in an eqstate trace (a `jax.jit` function, a
  `lax.scan` body) are keyed by an era of eqstate's (`enter_trace_era`), which
  changes when one of them reads a state, so that such a trace is never reused by
  another. Without it, reading a state inside a raw transform that stages out raises
  in eqstate traces too, as at top level.

- a JAX differentiation (`differentiation_inside`, `is_traced_by`) is told apart
  from other transforms that evaluate at once, so that a parameter read inside
  `eqx.filter_grad` or `jax.grad` of `eqstate.run`, which gets no gradient, warns.
  Without it nothing warns.

- the effect a collective over a named axis records (`psum` inside `shard_map`) is told
  apart from those that can fail while a computation runs (`can_fail_at_run_time`),
  so that `jit(donate_states=True)` donates such functions. Without it every effect
  counts as one that can fail, and they run without donation.

- a state handle given to JAX where it takes an array (an argument of `jax.jit` or
  `jax.grad`, of a `jax.numpy` function) gets eqstate's error (`refuse_as_array`),
  through JAX's table of the types it abstracts. Without it, JAX's own error, whose
  advice (mark the argument static) does not fit a handle.

- the client of `jax.distributed`'s coordination service (`distributed_client`), whose
  key-value store and barriers with a timeout let the processes of a program agree on
  what a checkpoint save holds before Orbax's collectives, so that processes saving
  different things refuse in bounded time. Without it the agreement is skipped, and
  such saves wait in those collectives, or crash there, as plain Orbax does.

- whether the computation of a typed PRNG key has ended is asked of the array of
  its data (`key_buffer`), without waiting, so that a call can replace a random state's
  key whose computation failed without waiting for the calls before it. Without it,
  `jax.random.key_data`, slower, gives that array.

Names that moved between the JAX releases eqstate supports (see `pyproject.toml`) are
looked up here too, by `_from_jax`, and nowhere else.
"""

import contextlib
import contextvars
import importlib
import inspect
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.extend.core as jex_core
from jax.core import Tracer as _Tracer


try:  # JAX 0.10: the internals that make single-pass tracing possible.
    _core: Any = importlib.import_module("jax._src.core")
    _source_info_util: Any = importlib.import_module("jax._src.source_info_util")
    _traceback_util: Any = importlib.import_module("jax._src.traceback_util")
    _pe: Any = importlib.import_module("jax._src.interpreters.partial_eval")
    _trace_ctx: Any = _core.trace_ctx
    _lax_internal: Any = importlib.import_module("jax._src.lax.lax")
    _HAS_NEW_ARG = callable(getattr(_pe.DynamicJaxprTrace, "new_arg", None))
except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX release
    _core = _source_info_util = _traceback_util = _pe = _trace_ctx = None
    _lax_internal = None
    _HAS_NEW_ARG = False


try:  # JAX 0.12: the structures of a `scan`'s inputs and outputs, in its parameters.
    _flattree: Any = importlib.import_module("jax._src.flattree")
    FLAT_TREES: tuple[type, ...] = (_flattree.FlatTree,)
except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX release
    FLAT_TREES = ()
"""Types of jaxpr parameters that describe how values are grouped (compared by
value, as JAX compares them); empty before JAX 0.12, whose `scan` introduced them."""


def _from_jax(name: str, modules: tuple[Any, ...]) -> Any:
    """`name` from the first of `modules` that has it, or None."""
    for module in modules:
        if module is not None and hasattr(module, name):
            return getattr(module, name)
    return None


# Their public home is `jax.extend.core` from JAX 0.10 on; `jax.core` had them before
# (JAX 0.9.2 warns they are deprecated there), `jax._src.core` on every release.
_TRACE_MODULES = (jex_core, _core)
_set_current_trace: Any = _from_jax("set_current_trace", _TRACE_MODULES)
_find_top_trace: Any = _from_jax("find_top_trace", _TRACE_MODULES)
_NamedAxisEffect: Any = _from_jax("NamedAxisEffect", (_core,))


try:  # JAX 0.10: the traces of transforms that evaluate at once when called eagerly.
    _batching: Any = importlib.import_module("jax._src.interpreters.batching")
    _ad: Any = importlib.import_module("jax._src.interpreters.ad")
    _DIFFERENTIATING_TRACES: tuple[type, ...] = (_ad.JVPTrace, _ad.LinearizeTrace)
    _AT_ONCE_TRACES: tuple[type, ...] = (_batching.BatchTrace, *_DIFFERENTIATING_TRACES)
except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX release
    _AT_ONCE_TRACES = _DIFFERENTIATING_TRACES = ()


_single_pass = contextvars.ContextVar("eqstate_single_pass", default=_HAS_NEW_ARG)


def refuse_as_array(cls: type, refuse: "Callable[[Any], Any]") -> None:
    """Makes JAX call `refuse(x)` for an `x` of type `cls` (or a subclass) where it
    takes an array, before its own error. `refuse` raises an error that is not a
    `TypeError`, which `jax.jit` would replace with its own."""
    mappings = getattr(_core, "pytype_aval_mappings", None)
    if isinstance(mappings, dict):
        mappings[cls] = refuse


def hide_from_tracebacks(path: str) -> None:
    """Hides the frames of the file at `path` from JAX's filtered tracebacks."""
    if _traceback_util is not None:
        _traceback_util.register_exclusion(path)


def current_trace() -> Any:
    """The JAX trace that operations are currently recorded into."""
    if _trace_ctx is not None:
        return _trace_ctx.trace
    return _current_trace_public()  # pragma: no cover - depends on the JAX release


def _current_trace_public() -> Any:
    return _find_top_trace(())


_EVAL_TRACE = current_trace()


def _is_top_level_public() -> bool:
    return _current_trace_public() is _EVAL_TRACE


def _top_level_check() -> "Callable[[], bool]":
    """`trace_ctx.is_top_level` without its two property calls (it runs on every
    call of a jitted function and every eager state access)."""
    try:
        trace, axis_env = _core.trace_state_strong_ref, _core.axis_env_state
        eval_trace, top_axis_env = _core.eval_trace, _core.top_axis_env
    except AttributeError:  # pragma: no cover - depends on the JAX release
        if _trace_ctx is not None:
            return _trace_ctx.is_top_level
        return _is_top_level_public

    def is_top_level() -> bool:
        return trace.value is eval_trace and axis_env.value is top_axis_env

    return is_top_level


is_top_level = _top_level_check()
"""Whether code runs eagerly, outside every JAX transform."""


def evaluates_at_once() -> bool:
    """Whether every active JAX transform evaluates at once (`jax.vmap`, `jax.jvp`,
    `jax.grad` called eagerly) rather than staging out a jaxpr that may be cached and
    run later (`jax.jit`, `lax.scan` bodies, `jax.checkpoint`, ...). Unknown traces
    count as staging, so a JAX release that renames them only makes eqstate stricter.
    """
    trace = current_trace()
    while isinstance(trace, _AT_ONCE_TRACES):
        trace = getattr(trace, "parent_trace", None)
    return is_eval_trace(trace)


def _trace_context_state() -> Any:
    """A JAX configuration value of eqstate's own that is part of JAX's trace context,
    which JAX's caches of traces (`jax.jit`, `lax.scan` bodies, `jax.checkpoint`)
    include in their keys; `None` where this JAX cannot make one."""
    try:  # JAX 0.8 to 0.12: `State` and its `include_in_trace_context`.
        config: Any = importlib.import_module("jax._src.config")
        return config.State(
            "eqstate_trace",
            None,
            "Set by eqstate inside its traces; not an option.",
            include_in_trace_context=True,
        )
    except (ImportError, AttributeError, TypeError):  # pragma: no cover
        return None


_TRACE_CONTEXT = _trace_context_state()


def _never_equal(axis_env: Any = None) -> object:
    return object()


def _jax_trace_context() -> "Callable[..., Any]":
    try:  # JAX 0.8 to 0.12.
        config: Any = importlib.import_module("jax._src.config")
        config.trace_context()
    except (ImportError, AttributeError, TypeError):  # pragma: no cover
        return _never_equal
    own = _TRACE_CONTEXT
    extend_axes = getattr(_core, "extend_axis_env_nd", None)
    if own is None:  # pragma: no cover - depends on the JAX release
        return _never_equal

    def trace_context(axis_env: Any = None) -> Any:
        # Without eqstate's era, which keys JAX's caches apart, not eqstate's: its
        # traces take the states' values as inputs, so one made at top level still
        # serves a call nested in a trace.
        previous = own.swap_local(None)
        try:
            if axis_env and extend_axes is not None:
                with extend_axes(axis_env):
                    return config.trace_context()
            return config.trace_context()
        finally:
            own.set_local(previous)

    return trace_context


trace_context: "Callable[..., Any]" = _jax_trace_context()
"""What `jax.jit` keys its cache of traces by besides the arguments: the
configuration a trace depends on (64-bit mode, promotion rules, matmul precision,
PRNG options) and the names and sizes of the axes mapped around it. A hashable value,
equal between two calls that would trace alike; a new object on each call where this
JAX does not tell (no trace is then reused). `axis_env` (`(name, size)` pairs): as
inside those axes too, as `jax.make_jaxpr(..., axis_env=axis_env)` traces."""
# The era of the traces JAX caches inside eqstate's frames, per thread (JAX's caches
# are shared between threads); a new one begins whenever a raw transform nested in
# such a frame reads a state (see `new_trace_era`). Every era is a new number.
_eras = itertools.count()
_thread_era = threading.local()


def _era() -> int:
    era = getattr(_thread_era, "value", None)
    if era is None:
        era = _thread_era.value = next(_eras)
    return era


KEEPS_TRACES_APART = _TRACE_CONTEXT is not None
"""Whether this JAX lets `enter_trace_era` key its caches of traces."""


def is_eval_trace(trace: Any) -> bool:
    """Whether `trace` evaluates eagerly (the top level, or `jax.disable_jit`)."""
    return _core is not None and isinstance(trace, _core.EvalTrace)


def enter_trace_era() -> Any:
    """Keys JAX's caches of the traces made from now on (a `jax.jit` function, a
    `lax.scan` body, traced inside a frame of eqstate's made under a trace) by the
    current era, apart from those made outside such frames. Returns what
    `leave_trace_era` takes to undo it."""
    if _TRACE_CONTEXT is None:  # pragma: no cover - depends on the JAX release
        return None
    return _TRACE_CONTEXT.swap_local(_era())


def leave_trace_era(previous: Any) -> None:
    """Undoes `enter_trace_era`: back in an enclosing frame, in the current era."""
    if _TRACE_CONTEXT is None:  # pragma: no cover - depends on the JAX release
        return
    _TRACE_CONTEXT.set_local(_era() if isinstance(previous, int) else previous)


def new_trace_era() -> None:
    """Begins a new era: a raw transform nested in a frame of eqstate's reads a state,
    and JAX may cache its trace, holding the value read (a tracer of this trace, or a
    constant the function wrote). No trace made from now on finds it in the cache:
    another trace must read its own value."""
    if _TRACE_CONTEXT is None:  # pragma: no cover - depends on the JAX release
        return
    _thread_era.value = next(_eras)
    if isinstance(_TRACE_CONTEXT.value, int):  # inside a frame (see `enter_trace_era`)
        _TRACE_CONTEXT.set_local(_thread_era.value)


def differentiation_inside(trace: Any) -> Any:
    """The trace of the innermost JAX differentiation (`jax.grad`, `jax.vjp`,
    `jax.jvp`, `eqx.filter_grad`, called eagerly or under `jax.vmap`) that runs
    inside `trace` (an enclosing frame's; `None`: the top level), or `None`. A value
    read from a frame outside it is a constant to it and gets no derivative. Always
    `None` where this JAX cannot tell."""
    current = current_trace()
    while current is not trace and isinstance(current, _AT_ONCE_TRACES):
        if isinstance(current, _DIFFERENTIATING_TRACES):
            return current
        current = getattr(current, "parent_trace", None)
    return None


def is_traced_by(x: Any, trace: Any) -> bool:
    """Whether `x` is a tracer of `trace` or of a transform nested in it (so `trace`
    follows what `x` depends on)."""
    current = getattr(x, "_trace", None)
    while current is not None:
        if current is trace:
            return True
        current = getattr(current, "parent_trace", None)
    return False


def stages_inside(trace: Any) -> bool:
    """Whether a JAX transform that stages out (see `evaluates_at_once`) runs inside
    `trace`: between it and the current trace. Its trace may be cached by JAX (a
    `jax.jit` function, a `lax.scan` body) and reused under later traces."""
    current = current_trace()
    while current is not trace:
        if not isinstance(current, _AT_ONCE_TRACES):
            return True
        current = getattr(current, "parent_trace", None)
    return False


try:  # JAX 0.10: the config states behind `jax.debug_nans` and `jax.debug_infs`.
    _config: Any = importlib.import_module("jax._src.config")
    _NAN_CHECKS: tuple[Any, ...] = (_config.debug_nans, _config.debug_infs)
    _NAN_CHECKS[0].value  # noqa: B018 - fails here, not per call, if it moved
except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX release
    _NAN_CHECKS = ()


def nan_checks_enabled() -> bool:
    """Whether `jax.debug_nans` or `jax.debug_infs` is on (in this thread). Cheap
    enough for a per-call check."""
    if _NAN_CHECKS:
        return _NAN_CHECKS[0].value or _NAN_CHECKS[1].value
    config: Any = jax.config  # pragma: no cover - depends on the JAX release
    return bool(config.jax_debug_nans or config.jax_debug_infs)  # pragma: no cover


def is_dead_tracer(x: Any) -> bool:
    """Whether `x` is a tracer of a trace that has ended (it leaked out through a
    Python side effect). `False` where this JAX cannot tell."""
    if not isinstance(x, _Tracer):
        return False
    trace = getattr(x, "_trace", None)
    is_valid = getattr(trace, "is_valid", None)
    if is_valid is not None and not is_valid():
        return True
    # JAX 0.10: a jaxpr trace is not marked invalid when it ends, but its frame's weak
    # table of constants is replaced by a plain dict then.
    frame = getattr(trace, "frame", None)
    return type(getattr(frame, "constid_to_tracer", None)) is dict


@contextlib.contextmanager
def in_trace(trace: Any) -> Iterator[None]:
    """Records the operations of the `with` block into `trace`."""
    with _set_current_trace(trace):
        yield


def single_pass_enabled() -> bool:
    """Whether StatefulFunction discovers states in a single trace."""
    return _single_pass.get()


@contextlib.contextmanager
def use_single_pass(enabled: bool) -> Iterator[None]:
    """Chooses single-pass tracing (if this JAX supports it) or the public two-pass
    fallback for the `with` block. Used by the tests to check both paths."""
    token = _single_pass.set(enabled and _HAS_NEW_ARG)
    try:
        yield
    finally:
        _single_pass.reset(token)


def can_add_inputs(trace: Any) -> bool:
    """Whether `new_input` can add an input to `trace`."""
    return (
        _single_pass.get()
        and _pe is not None
        and isinstance(trace, _pe.DynamicJaxprTrace)
    )


def new_input(trace: Any, like: Any) -> jax.Array:
    """Adds an input typed as `like` (an array, tracer or struct) to the jaxpr being
    traced by `trace`, and returns the tracer that stands for it: with `like`'s full
    type, its sharding and varying manual axes included (inside `jax.shard_map`, an
    input typed as invariant would not mix with varying values). Only call this if
    `can_add_inputs(trace)`."""
    return trace.new_arg(jax.typeof(like), source_info=_source_info_util.current())


def is_batched_here(x: Any) -> bool:
    """Whether `x`, seen inside `jax.vmap`, differs across the lanes of the innermost
    vmap (a tracer of the current batching trace with a batch axis). Values of outer
    traces or of outer vmaps count as unbatched here."""
    # JAX 0.10: unbatched values are plain values or `BatchTracer`s whose `batch_dim`
    # is None (the old `not_mapped`).
    return (
        getattr(x, "_trace", None) is current_trace()
        and getattr(x, "batch_dim", None) is not None
    )


def can_fail_at_run_time(effect: Any) -> bool:
    """Whether a jaxpr equation with this effect can raise while the computation runs
    (a callback's, an I/O's effect). A collective over a named axis (`psum`,
    `axis_index` inside `shard_map`) records the axis it uses as its effect, and
    cannot."""
    return _NamedAxisEffect is None or not isinstance(effect, _NamedAxisEffect)


def key_buffer(key: Any) -> Any:
    """The array of the data of `key`, a concrete array of typed PRNG keys (its
    `_base_array`), whose `is_ready()` and `block_until_ready()` cost a third of the
    key array's own (a key array has no `is_ready`); `jax.random.key_data(key)`
    without it."""
    data = getattr(key, "_base_array", None)
    return jax.random.key_data(key) if data is None else data


def in_manual_axes() -> bool:
    """Whether the code runs inside `jax.shard_map` (some axes of the current mesh
    are manual): values there are each device's shard, and a sharding over the whole
    mesh does not apply to them."""
    # JAX 0.10: the public accessor; the releases without it have no abstract mesh.
    get_abstract_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    if get_abstract_mesh is None:  # pragma: no cover - depends on the JAX release
        return False
    axis_types = getattr(get_abstract_mesh(), "axis_types", ())
    return jax.sharding.AxisType.Manual in axis_types


# JAX 0.10 casts a value to varying with `jax.lax.pcast(..., to="varying")`; older
# releases had `jax.lax.pvary` for it.
_pcast: Any = _from_jax("pcast", (jax.lax,))
_pvary: Any = _from_jax("pvary", (jax.lax,))


def vary(x: Any, axes: tuple) -> Any:
    """Inside `jax.shard_map`, `x` (invariant along `axes`) typed as varying across
    devices along the mesh axes `axes`, as a value split along them is. `x` itself
    where this JAX cannot say so (nor check it)."""
    if not axes:
        return x
    if _pcast is not None:
        return _pcast(x, axes, to="varying")
    if _pvary is not None:  # pragma: no cover - depends on the JAX release
        return _pvary(x, axes)
    return x  # pragma: no cover - depends on the JAX release


def varying_axes(x: Any) -> frozenset:
    """Inside `jax.shard_map`, the mesh axes along which `x` differs across devices."""
    return _varying_of(jax.typeof(x))


def _varying_of(aval: Any) -> frozenset:
    manual = getattr(aval, "manual_axis_type", None)
    # JAX 0.10: the varying axes of an aval; older releases called them `vma`.
    varying = getattr(manual, "varying", None)
    if varying is None:
        varying = getattr(aval, "vma", frozenset())
    return frozenset(varying)


# JAX 0.10 gives a struct its varying axes as `manual_axis_type`, older releases as
# `vma` (both as the aval holds them).
_STRUCT_FIELDS = inspect.signature(jax.ShapeDtypeStruct).parameters
_VARYING_FIELD = next(
    (f for f in ("manual_axis_type", "vma") if f in _STRUCT_FIELDS), None
)


def type_beyond_shape(aval: Any) -> Any:
    """What the type `aval` says beyond shape, dtype and weak type, hashable: its
    sharding where the type splits it along explicit or manual mesh axes, and the
    axes it varies along inside `jax.shard_map`; `None` if nothing (outside
    `shard_map`: on Auto meshes, or replicated)."""
    sharding = getattr(aval, "sharding", None)
    axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    replicated = all(axes is None for axes in getattr(sharding, "spec", ()))
    manual = jax.sharding.AxisType.Manual in axis_types
    if all(t == jax.sharding.AxisType.Auto for t in axis_types) or (
        replicated and not manual
    ):
        # On Auto axes, or replicated outside `shard_map`: nothing a trace needs.
        sharding = None
    varying = None
    if _VARYING_FIELD is not None and _varying_of(aval):
        varying = getattr(aval, _VARYING_FIELD, None)
    if sharding is None and varying is None:
        return None
    return (sharding, varying)


def struct(
    shape: tuple, dtype: Any, weak_type: bool, beyond: Any = None
) -> jax.ShapeDtypeStruct:
    """The `jax.ShapeDtypeStruct` of that type (`beyond` as `type_beyond_shape` gives
    it)."""
    sharding, varying = (None, None) if beyond is None else beyond
    extra = (
        {} if varying is None or _VARYING_FIELD is None else {_VARYING_FIELD: varying}
    )
    return jax.ShapeDtypeStruct(
        shape, dtype, weak_type=weak_type, sharding=sharding, **extra
    )


def weakly_typed(x: jax.Array) -> jax.Array:
    """`x`, weakly typed (as a value made from a Python scalar is). Without JAX's
    internal conversion, `x` as it is: a loaded value then promotes as its dtype says."""
    convert = getattr(_lax_internal, "_convert_element_type", None)
    if convert is None or x.weak_type:  # pragma: no cover - depends on the JAX release
        return x
    return convert(x, weak_type=True)


def distributed_client() -> Any:
    """The client of `jax.distributed`'s coordination service in this process, or
    None (not initialised, or the internal moved)."""
    try:
        state = importlib.import_module("jax._src.distributed").global_state
    except (
        ImportError,
        AttributeError,
    ):  # pragma: no cover - depends on the JAX release
        return None
    return getattr(state, "client", None)
