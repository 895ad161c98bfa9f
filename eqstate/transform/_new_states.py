"""vmap_new_states and vmap2_new_states: build ensembles by vectorising over the states
a function creates."""

import functools as ft
from collections.abc import Callable, Hashable
from typing import Any, overload, ParamSpec, SupportsIndex, TypeVar, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _context, _jax_compat as compat
from .._arguments import text
from .._clone import (
    Build,
    INIT_NO_BATCHING,
    mark_build,
    mark_replicated,
    replication,
)
from .._context import expire
from .._custom_types import AxisSpec, Filter, MISSING, Missing
from .._errors import BatchAxisError, TraceContextError
from .._filters import to_predicate
from .._pretty_print import state_label
from .._run import run, states_of
from .._state import (
    draws_atomically,
    lock_keys,
    NonBatchState,
    RandomState,
    retag,
    split_and_advance,
    State,
)
from .._state_dict import StateDict
from .._write_checks import check_write, has_tracer
from ..random import DEFAULT
from ._decorator import decorator_form
from ._vmap import (
    arrays_only,
    axis_size_of,
    checked_axis_size,
    per_argument_axes,
    split_like_mapped,
    VmapOptions,
    with_impl_of,
)


compat.hide_from_tracebacks(__file__)

_P = ParamSpec("_P")
_T = TypeVar("_T")


_REPLICATED_BUT_BATCHED = (
    "{label} is {why}, so it is created once for every lane, but its value differs "
    "across the lanes of `vmap_new_states`. Keeping lane 0 would silently drop the "
    "others. Make its value independent of the mapped arguments and of random draws, "
    "or let it be batched{how}."
)

_PRE_EXISTING_WRITE = (
    "`vmap_new_states` maps over the states its function creates; {label} existed "
    "before the call, and writing it from every lane has no single result. Use "
    "`eqstate.transform.vmap` with `in_states` to map over existing states."
)


_NESTED_SHARED_KEY = (
    "{label} was created inside a transform nested in `vmap_new_states` (such as "
    "`jit`) from a traced value that is the same in every lane. `vmap_new_states` "
    "re-keys such a state per lane, but only after that transform ran, which may "
    "have drawn from it: every member would draw the same numbers. Create it from an "
    "integer seed (`RandomState(0)`, re-keyed at once; inside the nested transform "
    "a key such as `jax.random.key(0)` is already traced), from a key that differs "
    "across lanes (`es.random.split_key()`, a mapped argument), or outside the "
    "nested transform."
)


class _LaneFrame(_context.Frame, _context.AnswersNested):
    """The frame of one lane of `vmap_new_states` (it sees every lane at once, as the
    function is traced under `jax.vmap`).

    New states are kept here and returned stacked. Every random state first read in
    the lane (the default one included), and every random state created in it with a
    value shared by the lanes, draws from a key derived from the lane's key, so lanes
    differ; lane-local writes to pre-existing random states are dropped, the outer key
    advancing once per call. Pre-existing states are read (broadcast to every lane)
    but not written.

    No two of these keys are alike: the default random state starts from
    `default_key`, whose stream (its successors and the keys drawn from them) stays
    inside `default_key`'s subtree of splits, and the `i`-th other random state gets
    `fold_in(others_key, i)`, a distinct child of a sibling subtree (or, if it holds
    a batch of keys, a batch of the same shape split from that child).
    """

    __slots__ = (
        "default_key",
        "excluded",
        "first_keys",
        "new_states",
        "others_key",
        "parent",
        "randoms",
        "replicated",
        "tag",
        "values",
    )

    def __init__(
        self,
        parent: _context.Frame,
        lane_keys: tuple[Any, Any],
        tag: str | None,
        excluded: Callable[[tuple, State], bool],
    ):
        self.parent = parent
        self.jax_trace = compat.current_trace()
        self.default_key, self.others_key = lane_keys
        self.tag = tag
        self.excluded = excluded
        self.values: dict[State, Any] = {}
        self.new_states: list[State] = []
        self.replicated: dict[State, str] = {}
        self.randoms: list[State] = []
        # The lane key each pre-existing random state got at its first read, which
        # a snapshot (`eqstate.world()`) taken before a write to it still shows.
        self.first_keys: dict[State, Any] = {}

    def _lane_key_for(self, state: State, like: Any) -> Any:
        """The lane's key for `state`, whose value is `like`: one key, or a batch of
        keys split from it (for a random state holding several keys), in the PRNG
        implementation of `like`."""
        # Computed in the vmap's own trace even when a nested transform asks for it.
        if state is DEFAULT:
            return self.default_key
        with compat.in_trace(self.jax_trace):
            key = jax.random.fold_in(self.others_key, len(self.randoms))
            shape = jnp.shape(like)
            if shape:
                key = jax.random.split(key, shape)
            key = with_impl_of(like, key)
        self.randoms.append(state)
        return key

    def read(self, state):
        value = self.values.get(state, MISSING)
        if value is MISSING:
            if isinstance(state, RandomState):
                like = self.parent.fetch(state)
                value = self.values[state] = self._lane_key_for(state, like)
                self.first_keys[state] = value
            else:
                value = self.parent.fetch(state)
        return value

    fetch = read

    def original(self, state: State) -> Any:
        """The state's value in the lane before any write to it there, as a snapshot
        of the world taken then (`eqstate.world()`) shows it."""
        value = self.first_keys.get(state, MISSING)
        return self.read(state) if value is MISSING else value

    def _checked(self, state: State, value: Any) -> Any:
        """`value` as a write to `state` stores it; raises if the lane refuses it."""
        if state not in self.values and not isinstance(state, RandomState):
            raise TraceContextError(
                _PRE_EXISTING_WRITE.format(label=_context.label_here(state))
            )
        return check_write(state, self.read(state), value)

    def write(self, state, value):
        self.check_trace(state)
        self.values[state] = self._checked(state, value)

    def commit(self, updates, new=()):
        self.check_commit_trace(updates, new)
        # Every write is checked before any is stored: a refused call writes nothing.
        checked = {
            state: self._checked(state, value) for state, value in updates.items()
        }
        for state, value in new:
            if self._rekeyed(state) and not _batched(value):
                raise BatchAxisError(
                    _NESTED_SHARED_KEY.format(label=state_label(state, value))
                )
        self.values.update(checked)
        for state, value in new:
            self.add_new(state, value)

    def nested_new_value(self, state, value):
        # A transform traced in the lane (a jitted constructor) may draw from a new
        # random state before it commits it here: re-key it now, as `add_new` does. A
        # traced value may or may not differ across lanes: `commit` checks it.
        if self._rekeyed(state) and not has_tracer(value):
            return self._lane_key_for(state, value)
        return value

    def _rekeyed(self, state: State) -> bool:
        """Whether the new `state` gets a key of its own in each lane: a random
        state, unless replicated (every member then shares its key)."""
        return (
            isinstance(state, RandomState)
            and _why_replicated(state, self.excluded) is None
        )

    def nested_mark(self):
        return len(self.randoms)

    def rewind_nested(self, mark):
        # The re-keying indices handed out since `mark`, and the lane keys read
        # then, were for a trace thrown away: hand them out again, in order.
        for state in self.randoms[mark:]:
            self.values.pop(state, None)
            self.first_keys.pop(state, None)
        del self.randoms[mark:]

    def add_new(self, state, value):
        self.check_trace(state, creates=True)
        # Exclusion is decided on the state as its creator made it, before
        # `state_tag` replaces its tag.
        why = _why_replicated(state, self.excluded)
        if why is not None:
            self.replicated[state] = why
        mark_replicated(state, INIT_NO_BATCHING if why == _TAGGED else why is not None)
        if self.tag is not None:
            retag(state, self.tag)
        # (`why`, not `_rekeyed`: the tag may have been replaced since.)
        rekeyed = isinstance(state, RandomState) and why is None
        if rekeyed and not _batched(value):
            # A new random state seeded alike in every lane is re-keyed per lane,
            # unless it is to be replicated: then every member shares its key.
            value = self._lane_key_for(state, value)
        self.values[state] = value
        self.new_states.append(state)

    def peek(self, state):
        value = self.values.get(state, MISSING)
        return self.parent.peek(state) if value is MISSING else value


_TAGGED = f"tagged {INIT_NO_BATCHING!r}"


def _why_replicated(
    state: State, excluded: Callable[[tuple, State], bool]
) -> str | None:
    """Why `vmap_new_states` replicates the new `state` rather than batch it, as the
    error about a replicated state that differs across lanes words it; `None` if it
    batches it."""
    if isinstance(state, NonBatchState):
        return "a NonBatchState"
    # Also when an inner build replicated it for its tag, then gave it its own
    # `state_tag`: the tag still holds for the builds around.
    if state.tag == INIT_NO_BATCHING or replication(state) == INIT_NO_BATCHING:
        return _TAGGED
    if excluded((), state):
        return "in `state_to_exclude`"
    return None


def _split_for_lanes(key: Any, size: int) -> tuple[Any, tuple[Any, Any]]:
    """`(outer successor of key, (default_keys, others_keys))`, one pair per lane.

    The key's children are `0`, the successor the caller keeps, and `1`, split into
    one key per lane; each lane key's child `0` starts the lane's default random
    state, and its child `1` roots the keys of the lane's other random states. The
    successor is split apart from the lanes' keys: too many lanes for memory fail
    after the call returns, and must not take the successor with them.
    """
    outer, lanes = split_and_advance(key, None)
    return outer, _per_lane(lanes, size)


@ft.partial(jax.jit, static_argnums=1)
def _per_lane(lanes: Any, size: int) -> tuple[Any, Any]:
    # Jitted, so that an eager build pays one dispatch for all its lanes' keys.
    per_lane = jax.vmap(jax.random.split)(jax.random.split(lanes, size))
    return per_lane[:, 0], per_lane[:, 1]


def _batched(value: Any) -> bool:
    return any(compat.is_batched_here(x) for x in jtu.tree_leaves(value))


def _build(
    fun: Callable,
    args: tuple,
    *,
    in_axes: AxisSpec,
    out_axes: AxisSpec,
    axis_name: Hashable | None,
    axis_size: int | None,
    spmd_axis_name: Any,
    state_tag: str | None,
    excluded: Callable[[tuple, State], bool],
) -> Any:
    """One call of a `vmap_new_states` function: `fun` traced once under
    `eqx.filter_vmap`, its new states registered, stacked, in the innermost frame."""
    frame = _context.current_frame()
    if frame is _context.WORLD and not compat.is_top_level():
        # Said before the key is split, whose write would be refused less clearly.
        raise TraceContextError(
            _context.RAW_TRANSFORM_CREATE.format(label="the states of an ensemble")
        )
    axes = per_argument_axes(in_axes, len(args))
    size = axis_size_of(axes, args, axis_size)
    lock_keys(frame, (DEFAULT,))
    outer_key, lane_keys = _split_for_lanes(frame.read(DEFAULT), size)
    lane_keys = split_like_mapped(lane_keys, axes, args)
    made: dict[str, list] = {"new": []}
    try:
        out, batched, shared = eqx.filter_vmap(  # pyright: ignore[reportCallIssue]
            _lane_function(fun, frame, state_tag, excluded, made),
            in_axes=(0, arrays_only(axes)),
            out_axes=(arrays_only(out_axes), 0, None),
            axis_name=axis_name,
            axis_size=size,
            spmd_axis_name=spmd_axis_name,
        )(lane_keys, args)
        new = _with_values(made["new"], made["replicated"], batched, shared)
        frame.commit({DEFAULT: outer_key}, new)
    except BaseException:
        # As after a failed trace: a handle that escaped through a side effect says
        # where it came from when read.
        where = f"vmap_new_states({getattr(fun, '__name__', type(fun).__name__)})"
        for state in made["new"]:
            expire(state, where)
        raise
    _mark_build(out, made["new"], made["replicated"], size, out_axes)
    return out


def _mark_build(
    out: Any, new: list[State], replicated: list[bool], size: int, out_axes: AxisSpec
) -> None:
    """Records this build on its new states (and which of them it replicated) and on
    the states of `out` that existed before it (a table tied into every member):
    `member` of a tree holding the former copies the latter whole, as it copies
    replicated states."""
    build = Build(size, arrays_leading=_stacks_arrays_first(out_axes))
    for state, is_replicated in zip(new, replicated, strict=True):
        mark_build(state, build, built=True, replicated=is_replicated)
    for state in set(states_of((out,))).difference(new):  # `out` may be a StateDict
        mark_build(state, build, built=False)


def _stacks_arrays_first(out_axes: AxisSpec) -> bool:
    """Whether `out_axes` puts every output array's member axis first (`0`, or a
    callable such as `eqx.if_array(0)` that gives `0` for an array)."""
    array = jnp.zeros(1)
    for axis in jtu.tree_leaves(out_axes, is_leaf=lambda x: x is None):
        if callable(axis):
            axis = axis(array)
        if not (type(axis) is int and axis == 0):
            return False
    return True


def _lane_function(
    fun: Callable,
    frame: _context.Frame,
    state_tag: str | None,
    excluded: Callable[[tuple, State], bool],
    made: dict[str, list],
) -> Callable:
    """One lane of the build: `fun` run in a `_LaneFrame`. Returns its output and the
    values of the new states, batched ones apart from replicated ones; the new states
    and which of them are replicated go to `made`."""

    def lane(lane_keys, args):
        lane_frame = _LaneFrame(frame, lane_keys, state_tag, excluded)
        made["new"] = lane_frame.new_states  # filled as `fun` creates states
        token = _context.enter(lane_frame)
        try:
            out = fun(*args)
        finally:
            _context.leave(token)
        new = lane_frame.new_states
        replicated = [s in lane_frame.replicated for s in new]
        for state, why in lane_frame.replicated.items():
            _check_same_in_every_lane(state, lane_frame.values[state], why)
        made["new"], made["replicated"] = new, replicated
        values = [lane_frame.values[s] for s in new]
        batched = [v for v, r in zip(values, replicated) if not r]
        shared = [v for v, r in zip(values, replicated) if r]
        return out, batched, shared

    return lane


_HOW_TO_BATCH = {
    "in `state_to_exclude`": " (drop it from `state_to_exclude`)",
    f"tagged {INIT_NO_BATCHING!r}": " (give it another tag)",
}


def _check_same_in_every_lane(state: State, value: Any, why: str) -> None:
    """Raises `BatchAxisError` if `value`, of a state created once for every lane
    (for the reason `why`), differs across lanes."""
    if _batched(value):
        raise BatchAxisError(
            _REPLICATED_BUT_BATCHED.format(
                label=state_label(state), why=why, how=_HOW_TO_BATCH.get(why, "")
            )
        )


def _with_values(
    new: list[State], replicated: list[bool], batched: list, shared: list
) -> list[tuple[State, Any]]:
    """The new states paired with their values, taken in order from `batched` or,
    for replicated ones, from `shared`."""
    batched_iter, shared_iter = iter(batched), iter(shared)
    return [
        (s, next(shared_iter) if r else next(batched_iter))
        for s, r in zip(new, replicated)
    ]


class _VmapNewStatesOptions(VmapOptions, total=False):
    state_tag: str | None
    state_to_exclude: Filter


@overload
def vmap_new_states(
    fun: Callable[_P, _T], **options: Unpack[_VmapNewStatesOptions]
) -> Callable[_P, _T]: ...


@overload
def vmap_new_states(
    fun: Missing = MISSING, **options: Unpack[_VmapNewStatesOptions]
) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]: ...


@decorator_form
def vmap_new_states(
    fun: Any = MISSING,
    *,
    in_axes: AxisSpec = 0,
    out_axes: AxisSpec = 0,
    axis_name: Hashable | None = None,
    axis_size: SupportsIndex | None = None,
    spmd_axis_name: Hashable | tuple[Hashable, ...] | None = None,
    state_tag: str | None = None,
    state_to_exclude: Filter = None,
    in_states: Any = None,
    out_states: Any = None,
) -> Any:
    """Vectorises `fun` over the states it creates: builds an ensemble in one call.

    Unlike [`eqstate.transform.vmap`][], which maps over states that already exist,
    this maps over the states created during the call (for example, the parameters a
    model's `__init__` allocates). Each lane of the mapped axis creates its own copy of
    every new state; their values are stacked on a leading axis and registered in the
    enclosing context (the world, a scope, or the trace of an enclosing transform).
    Random states are split per lane, so randomly initialised values differ across
    lanes, and no two random states of a lane share a key; the default random key
    advances once per call. A `RandomState` created in `fun` with the same value in
    every lane (an integer seed) is re-keyed per lane, in its own PRNG implementation:
    its seed is not used (see the how-to guide on random numbers), unless the state is
    replicated (then every member shares its key). A batch of keys is replaced by a
    batch of the same shape, all distinct. This holds in a transform nested in `fun` (a jitted
    constructor) too; there, a key computed from traced values that turns out the same
    in every lane raises [`eqstate.BatchAxisError`][], as it may have been drawn from.

    `fun` is executed **exactly once per call**, traced under `eqx.filter_vmap` over a
    constructor that receives its lane's random key. There is no eager probe, so
    `fun` need not be idempotent, and the handles it hands out through Python side
    effects are the real batched states (the reference library runs `fun` twice: an
    eager probe, then the mapped pass). Calling the mapped function twice creates two
    distinct sets of states. If the call raises, it creates none: a handle it handed
    out has no value, and reading it raises [`eqstate.TraceContextError`][] naming
    the failed call.

    `NonBatchState`s, the states tagged [`eqstate.transform.INIT_NO_BATCHING`][] by
    their creator (the reference library's tag) and the states matching
    `state_to_exclude` are replicated: one value shared by every lane. Their value
    must not differ across lanes, else [`eqstate.BatchAxisError`][] (rather than
    silently keeping lane 0). [`eqstate.member`][] copies them whole.

    Inside `fun`, pre-existing states can be read (every lane sees the same value) but
    not written.

    **Arguments:**

    - `fun`: the function to vectorise. If omitted, returns a decorator.
    - `in_axes`: the mapped axis of each positional argument, as in `jax.vmap`;
        `None` broadcasts an argument.
    - `out_axes`: where the mapped axis goes in the output. Handles in the output are
        returned as they are.
    - `axis_name`: a name for the mapped axis, for collectives (`jax.lax.psum`, ...).
    - `axis_size`: the size of the mapped axis; inferred from the mapped arguments
        when omitted. Must be positive.
    - `spmd_axis_name`: as in `jax.vmap`.
    - `state_tag`: a tag given to every new state (replacing the tag its creator gave
        it; `state_to_exclude` and `INIT_NO_BATCHING` see the creator's tag).
    - `state_to_exclude`: a filter of new states to replicate instead of batching.
    - `in_states`, `out_states`: not supported: there are no pre-existing states to
        declare. Passing either raises `ValueError`; use
        [`eqstate.transform.vmap`][].

    **Returns:**

    A function with the signature of `fun` (positional arguments only:
    keyword arguments raise `NotImplementedError`).

    **Raises:**

    `ValueError` if `axis_size` is not positive, or if `in_states` or `out_states` is
    given; [`eqstate.TraceContextError`][] if called inside a raw JAX transform
    (`jax.vmap`, `jax.jit`) outside any eqstate transform, where the new states'
    values would be tracers.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        @es.transform.vmap_new_states(in_axes=0, axis_size=4)
        def build(x):
            scratch = es.ShortTermState(jnp.zeros(()))
            scratch.value = scratch.value + x
            return scratch.value

        assert (build(jnp.arange(4.0)) == jnp.array([0.0, 1.0, 2.0, 3.0])).all()
        ```
    """
    if in_states is not None or out_states is not None:
        raise ValueError(
            "`vmap_new_states` maps over the states `fun` creates, so there are no "
            "pre-existing states to declare: `in_states` and `out_states` are not "
            "supported. Use `eqstate.transform.vmap` to map over existing states."
        )
    axis_size = checked_axis_size(axis_size)
    text(state_tag, "state_tag")
    excluded = to_predicate(state_to_exclude)
    options = dict(
        in_axes=in_axes,
        out_axes=out_axes,
        axis_name=axis_name,
        axis_size=axis_size,
        spmd_axis_name=spmd_axis_name,
        state_tag=state_tag,
    )

    @ft.wraps(fun)
    @draws_atomically
    def mapped(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise NotImplementedError(
                "`vmap_new_states` does not map keyword arguments "
                f"({', '.join(sorted(kwargs))}). Pass them positionally, with "
                "`in_axes=None` for those to broadcast, or close over them."
            )
        return _build(fun, args, **options, excluded=excluded)

    return mapped


def vmap2_new_states(
    ctor: Callable[..., _T],
    *,
    axis_size: int,
    in_axes: AxisSpec = None,
    state_tag: str | None = None,
    state_to_exclude: Filter = None,
) -> Callable[..., tuple[_T, StateDict]]:
    """Builds an ensemble of modules without touching the world: the module-oriented
    form of [`eqstate.transform.vmap_new_states`][].

    **Arguments:**

    - `ctor`: builds one member (e.g. an `eqx.Module` class). It runs once, traced
        under the vmap.
    - `axis_size`: the number of members. (Keyword only argument.)
    - `in_axes`: the mapped axis of each argument of `ctor`; by default every
        argument is shared. (Keyword only argument.)
    - `state_tag`, `state_to_exclude`: as for `vmap_new_states`.

    **Returns:**

    A function taking `ctor`'s arguments and returning `(module, states)`: the module
    (its handles name the batched states) and a [`eqstate.StateDict`][] of their
    stacked values, ready for `eqstate.run` or `eqstate.transform.vmap` with
    `in_states={0: states}`. The default random key of the calling context advances
    once; no state is registered there.

    !!! Example

        ```python
        import eqstate as es

        make = es.transform.vmap2_new_states(
            lambda: es.ParamState(es.random.normal((3,))), axis_size=5
        )
        w, states = make()
        assert states[w].shape == (5, 3)
        ```
    """
    build = vmap_new_states(
        ctor,
        in_axes=in_axes,
        axis_size=axis_size,
        state_tag=state_tag,
        state_to_exclude=state_to_exclude,
    )

    @ft.wraps(ctor)
    @draws_atomically
    def make(*args: Any) -> tuple[_T, StateDict]:
        frame = _context.current_frame()
        lock_keys(frame, (DEFAULT,))
        successor, key = split_and_advance(frame.read(DEFAULT), None)
        states, module = run(build, StateDict({DEFAULT: key}), *args)
        # Only now: a failed build changes nothing, as in `vmap_new_states`.
        DEFAULT.value = successor
        return module, states.split(DEFAULT)[1]

    return make
