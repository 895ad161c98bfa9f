"""Copies of models holding handles: `clone` and `member`."""

import itertools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _context
from ._arguments import integer
from ._custom_types import Filter, PyTree
from ._pretty_print import state_label, value_summary
from ._run import states_of
from ._state import creation_order, fresh_copy, is_state, NonBatchState, State
from ._state_dict import rekeyed, state_dict_of, StateDict


_T = TypeVar("_T")

INIT_NO_BATCHING = "INIT_NO_BATCHING"
"""The tag that marks a state to replicate rather than batch when
[`eqstate.transform.vmap_new_states`][] (or `vmap2_new_states`) creates it, as
[`eqstate.NonBatchState`][]s are: `es.State(x, tag=INIT_NO_BATCHING)`. The reference
library's name, kept for ports."""


_CLONE_STATE_DICT = """\
`eqstate.clone` copies the handles of a PyTree (a model), and a StateDict holds none:
its states are its keys, and it is immutable, so it is its own copy. To copy a model
along with a StateDict of its states, clone the two together:

    twin, twin_states = eqstate.clone((model, states))

`twin_states` is then keyed by the handles of `twin`."""


def _copy(value: PyTree) -> PyTree:
    # A real copy, not a second reference to the same buffers: donating the original's
    # values to a jitted call (`donate_states=True`) must leave the clone's intact.
    return jtu.tree_map(jnp.copy, value)


def _replace_handles(tree: _T, new_handles: dict[State, State]) -> _T:
    return jtu.tree_map(
        lambda x: new_handles.get(x, x) if is_state(x) else x, tree, is_leaf=is_state
    )


def _register(
    tree: _T,
    states: tuple[State, ...],
    values: list[PyTree],
    sliced: "set[Build] | frozenset[Build]" = frozenset(),
) -> _T:
    """`tree` with each of `states` replaced by a fresh handle holding the matching
    value, registered in the innermost context. A `StateDict` in `tree` or held in a
    value (e.g. an optimiser's state) is keyed by the fresh handles too. The fresh
    handles keep the records of the builds that returned their originals, except
    those of `sliced` (whose members `member` took apart)."""
    frame = _context.current_frame()
    # In the originals' creation order: a StateDict flattens in the creation order of
    # its handles, and each copy counts as created right after its original.
    fresh = {s: fresh_copy(s) for s in sorted(states, key=creation_order)}
    for state, new in fresh.items():
        copy_provenance(state, new)
        if sliced:
            _forget_builds(new, sliced)
    copied = dict(zip(states, rekeyed(values, fresh)))
    for state, new in fresh.items():
        # Registered in that order too: a jitted clone returns handles in it.
        frame.add_new(new, copied[state])
    return rekeyed(_replace_handles(tree, fresh), fresh)


def _forget_builds(state: State, sliced: "set[Build] | frozenset[Build]") -> None:
    """Drops the records of the `sliced` builds from `state`, a member's handle:
    whether it is replicated is then what the last build left says (a build nested
    in the constructor may have replicated a state that the one around stacked, or
    the other way round)."""
    kept = frozenset(record for record in _builds(state) if record[0] not in sliced)
    _BUILDS[state] = kept
    built = [record for record in kept if record[1]]
    # Every build honours the tag `INIT_NO_BATCHING`: the inner ones replicated it.
    if built and replication(state) != INIT_NO_BATCHING:
        _, _, replicated = max(built, key=lambda record: record[0].serial)
        mark_replicated(state, replicated)


def clone(tree: _T) -> _T:
    """A copy of `tree` whose handles are fresh states holding copies of the original
    values: writing to the copy leaves the original as it was, and the other way round.

    Each handle of `tree` is replaced by a new handle of the same kind, tag and name,
    registered in the innermost context (the world, an [`eqstate.scope`][], or the
    trace of a transform) with a copy of the original's value there. A handle found at
    several places in `tree` becomes one new handle, found at the same places. Leaves
    that are not handles (arrays of `eqx.nn` layers, static fields) are kept as they
    are: JAX arrays are immutable, so sharing them is safe. A `StateDict` in `tree`
    (e.g. a module field) or held in a value (an optimiser's state, a snapshot of the
    best weights), and a `dict` keyed by handles (per-state settings), are keyed by
    the new handles in place of the handles of `tree`, so that they refer to the
    clone's states, not to the original's; their keys naming states that `tree` does
    not hold stay as they are. Each new handle counts as
    created right after its original, so a `StateDict` holding the clone's states
    (with other states or not) flattens like one holding the originals' (Equinox's
    serialisation matches leaves by that order), under `jit` too.

    Compile a clone with [`eqstate.transform.jit`][], which gives each call's new
    states fresh handles, not with `eqx.filter_jit` around [`eqstate.run`][]:
    `eqx.filter_jit` keeps the non-array leaves of a function's first output (the
    handles made when it traced) and returns them again on every later call, so two
    clones made by two calls would hold the very same handles (and a merged
    `StateDict` would keep one clone's values).

    `copy.deepcopy` of a handle raises instead, since it cannot choose the context
    to copy into; use `clone`. A clone of a model holding a [`eqstate.RandomState`][]
    holds a copy of its key, so both draw the same numbers until one is reseeded.

    **Arguments:**

    - `tree`: any PyTree, e.g. an `eqx.Module` holding handles. Not a `StateDict`
        alone (`TypeError`): it holds no handles, and is its own copy; clone it
        together with the model whose states it holds, `eqstate.clone((model,
        states))`.

    **Returns:**

    `tree` with every handle replaced by its clone.

    **Raises:**

    [`eqstate.StateNotFoundError`][] if a state has no value in the innermost context
    (nothing is registered then); `TypeError` if `tree` is a `StateDict`.

    !!! Example

        ```python
        import eqstate as es
        import eqstate.nn as enn

        bn = enn.BatchNorm(3)
        copy = es.clone(bn)
        copy(es.random.normal((8, 3)))  # updates the copy's running statistics only
        assert copy.running_mean is not bn.running_mean
        assert copy.running_mean.name == "running_mean"
        assert (bn.running_mean.value == 0).all()
        assert not (copy.running_mean.value == 0).all()
        ```
    """
    if isinstance(tree, StateDict):
        raise TypeError(_CLONE_STATE_DICT)
    states = states_of(tree)
    if not states:
        return tree
    values = _context.current_frame().read_many(states)
    return _register(tree, states, [_copy(v) for v in values])


_ARRAY = "the array at "


def _outermost_builds(states: tuple[State, ...]) -> "set[Build]":
    """The outermost `vmap_new_states` call that built each of `states` (an inner
    one, nested in its constructor, is not what the ensemble's axis comes from)."""
    outermost = set()
    for state in states:
        builds = [b for b, built, _ in _builds(state) if built]
        if builds:
            outermost.add(max(builds, key=lambda b: b.serial))
    return outermost


def _built_size(states: tuple[State, ...]) -> int | None:
    """The number of members of the builds that made `states` (for an ensemble whose
    states are all shared, so that no stacked value tells it), if one size."""
    sizes = {b.size for b in _outermost_builds(states)}
    return sizes.pop() if len(sizes) == 1 else None


def _member_axis_size(stacked: list[tuple[str, PyTree]]) -> int:
    """The size of the leading axis shared by every `(label, value)` of `stacked`."""
    sizes: dict[str, int] = {}
    for label, value in stacked:
        for leaf in jtu.tree_leaves(value):
            if leaf.ndim == 0:
                fix = (
                    "Take the member of the ensemble alone, not of a tree that also "
                    "holds values of another kind (an optimiser's step count)."
                    if label.startswith(_ARRAY)
                    else "If every member shares it, pass a filter selecting it as "
                    "`shared=` (the `state_to_exclude` given to `vmap_new_states`)."
                )
                raise ValueError(
                    f"{label} holds {value_summary(value)}, which has no leading "
                    f"member axis, so it cannot be part of an ensemble member. {fix}"
                )
            sizes[f"{label} ({value_summary(value)})"] = leaf.shape[0]
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"{label}: {size}" for label, size in sizes.items())
        raise ValueError(
            "The states and arrays of this ensemble have leading axes of different "
            f"sizes ({shown}), so they are not the stacked values of one ensemble. "
            "States shared by every member must be selected by `shared=` (the "
            "`state_to_exclude` given to `vmap_new_states`)."
        )
    return next(iter(sizes.values()))


# What `vmap_new_states` records about the states it builds, read by `member` (which
# states it copies whole), `vmap` and `shard_map` (which states the members share).
# Kept here rather than on the handles, which carry their identity only.
_REPLICATED: "weakref.WeakKeyDictionary[State, bool | str]" = (
    weakref.WeakKeyDictionary()
)
_BUILDS: "weakref.WeakKeyDictionary[State, frozenset]" = weakref.WeakKeyDictionary()


def mark_replicated(state: State, replicated: bool | str) -> None:
    """Records that `vmap_new_states` replicated `state` rather than stacked it (its
    outermost call decides; `"INIT_NO_BATCHING"`: replicated for that tag, which
    builds around it honour too, whatever tag it gets): `member` copies such states
    whole, whatever `shared` says and whatever their tag became. The handles a
    jitted build returns, and clones, are copies that keep the record (see
    `copy_provenance`)."""
    if replicated:
        _REPLICATED[state] = replicated
    else:
        _REPLICATED.pop(state, None)


def replication(state: State) -> bool | str:
    """What `mark_replicated` last recorded for `state` (`False` if nothing)."""
    return _REPLICATED.get(state, False)


def shared_by_members(state: State) -> bool:
    """Whether every member of an ensemble shares `state`'s one value: a
    `NonBatchState`, or a state `vmap_new_states` replicated rather than stacked
    (tagged `INIT_NO_BATCHING`, or selected by its `state_to_exclude`)."""
    return isinstance(state, NonBatchState) or state in _REPLICATED


def why_shared(state: State) -> str:
    """What makes `state` shared (see `shared_by_members`), for error messages."""
    if isinstance(state, NonBatchState):
        return "a NonBatchState is shared whole by every lane"
    return (
        "`vmap_new_states` replicated it (tagged `INIT_NO_BATCHING`, or selected by "
        "`state_to_exclude`): every member shares its one value"
    )


def copy_provenance(state: State, copy: State) -> None:
    """Gives `copy`, a fresh handle standing for `state` (a clone, a member, the
    handle a jitted build returns), the records of `state`."""
    if state in _REPLICATED:
        _REPLICATED[copy] = _REPLICATED[state]
    if state in _BUILDS:
        _BUILDS[copy] = _BUILDS[state]


_BUILD_SERIALS = itertools.count()


class Build:
    """One `vmap_new_states` call, as recorded on the states it returned (see
    `mark_build`): its number of members, and whether it stacked its output's arrays
    along their leading axis (`out_axes=0`), where `member` slices them."""

    __slots__ = ("arrays_leading", "serial", "size")

    def __init__(self, size: int, arrays_leading: bool):
        self.size = size
        self.arrays_leading = arrays_leading
        # A build nested in another's constructor ends, and is recorded, first.
        self.serial = next(_BUILD_SERIALS)


def mark_build(
    state: State, build: Build, *, built: bool, replicated: bool = False
) -> None:
    """Records that the `vmap_new_states` call `build` built `state` (`built=True`),
    replicating it (`replicated=True`) or stacking it, or returned it without
    building it (a table tied into every member): `member` copies the latter whole
    in a tree that holds a state `build` built."""
    _BUILDS[state] = _builds(state) | {(build, built, replicated)}


def _builds(state: State) -> frozenset:
    """The `(build, built, replicated)` records of `state` (see `mark_build`)."""
    return _BUILDS.get(state, frozenset())


def stacked_by_its_last_build(state: State) -> bool:
    """Whether the last `vmap_new_states` call that returned `state` built it,
    stacking one value per member (not replicated, and not tied whole into the
    members of a later build)."""
    builds = _builds(state)
    if not builds or state in _REPLICATED:
        return False
    _, built, _ = max(builds, key=lambda record: record[0].serial)
    return built


def member(ensemble: _T, index: int, *, shared: Filter = NonBatchState) -> _T:
    """Member `index` of an ensemble, as a standalone model with its own states.

    An ensemble built by [`eqstate.transform.vmap_new_states`][] (or
    [`eqstate.transform.vmap2_new_states`][]) is one model whose states hold stacked
    values, one per member. `member` returns the same model with every handle
    replaced by a fresh one (same kind, tag and name) holding a copy of slice `index`
    of the stacked value, so the member's values are bit for bit those of its lane.
    States shared by every member (not stacked) are copied whole. Arrays of the tree
    that are not states, such as the weights of an `eqx.nn.Linear` built in each
    lane, are stacked by `vmap_new_states` too, and are sliced the same way; so are
    the values of a `StateDict` in the tree (those of states copied whole are kept
    whole), which is keyed by the member's handles as by [`eqstate.clone`][].

    The new states are registered in the innermost context, as by
    [`eqstate.clone`][]. For an ensemble whose values are in a `StateDict`, run it
    against the dictionary: `new_states, one = eqstate.run(eqstate.member, states,
    ensemble, 3)`. As for `clone`, compile it with [`eqstate.transform.jit`][], not
    with `eqx.filter_jit` around `eqstate.run`: `eqx.filter_jit` returns the handles
    made when it traced on every later call, so two members taken by two calls would
    hold the very same handles (and a merged `StateDict` would keep one member's
    values).

    The member computes what its lane computes, but as another XLA program: a
    batched matrix product may sum in another order than an unbatched one, so
    outputs can differ from the lane's in the last bits (a few 1e-7 for float32).

    **Arguments:**

    - `ensemble`: a PyTree holding the ensemble's handles, e.g. the module returned
        by `vmap_new_states`.
    - `index`: which member, in `[-K, K)` for an ensemble of K members.
    - `shared`: a filter selecting the states that are not stacked, by default the
        [`eqstate.NonBatchState`][]s; a predicate receives each state's PyTree path
        in `ensemble`, and a state found at several paths is selected if any of
        them matches, as by [`eqstate.states_of`][]. Whatever this filter says, in
        an ensemble built by `vmap_new_states` (also by a jitted build, and in
        [`eqstate.clone`][]s of it), the states it replicated (its
        `NonBatchState`s, those tagged `INIT_NO_BATCHING` and those matching its
        `state_to_exclude`, even after `state_tag` replaced their tags) and the
        states it returned without creating them (they existed before the build,
        such as a table, or another ensemble's stacked state, tied into every
        member) are copied whole; the latter only in a tree that also holds states
        that build created, so a handle a build returned is sliced as usual
        elsewhere. Pass a filter for ensembles stacked some other way. (Keyword
        only argument.)

    **Returns:**

    A standalone copy of member `index`. Writing to it leaves the ensemble as it was.
    A member of an ensemble of ensembles (a build whose constructor makes another
    with `vmap_new_states`) is an ensemble of the inner build, whose states are
    stacked or copied whole as that build made them: its own members are taken the
    same way.

    **Raises:**

    `IndexError` if `index` is out of range; `TypeError` if it is not an integer
    (a `bool` included); `ValueError` if a stacked state or
    array has no leading axis, if they disagree on its size (a shared state that
    `shared` does not select), or if the tree holds arrays of an ensemble built with
    `out_axes` other than 0.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        def make():
            return {"w": es.ParamState(es.random.normal((3,)), name="w")}

        ensemble = es.transform.vmap_new_states(make, axis_size=4)()
        third = es.member(ensemble, 2)
        assert third["w"].value.shape == (3,)
        assert (third["w"].value == ensemble["w"].value[2]).all()

        third["w"].value = jnp.zeros(3)  # the ensemble keeps its own values
        assert (ensemble["w"].value[2] != 0).all()
        ```
    """
    index = integer(index, "index", at_least=None, owner="`eqstate.member`'s ")
    states = states_of(ensemble)
    values = _context.current_frame().read_many(states) if states else []
    # Selected as `states_of` selects: by any of the paths a state is found at.
    whole = _copied_whole(states, set(states_of(ensemble, shared)))
    stacked = [(state_label(s), v) for s, v in zip(states, values) if s not in whole]
    unsliced = _map_stacked(ensemble, whole, lambda x: x, lambda v: None)
    arrays = jtu.tree_leaves_with_path(eqx.filter(unsliced, eqx.is_array))
    if arrays:
        _refuse_arrays_off_the_leading_axis(states)
    stacked += [(f"{_ARRAY}{jtu.keystr(path)}", x) for path, x in arrays]
    size = _member_axis_size(stacked) if stacked else _built_size(states)
    if size is not None:
        if not -size <= index < size:
            raise IndexError(
                f"Member {index} of an ensemble of {size} members does not exist: "
                f"the index must be in [{-size}, {size})."
            )
    ensemble = _map_stacked(ensemble, whole, lambda x: x[index], lambda v: v)
    picked = [
        _copy(v) if s in whole else jtu.tree_map(lambda x: x[index], v)
        for s, v in zip(states, values)
    ]
    # The member's states are not stacked by the builds it was taken from (a member
    # of a nested ensemble is still stacked by the inner build).
    sliced = _outermost_builds(tuple(s for s in states if s not in whole))
    return _register(ensemble, states, picked, sliced)


def _map_stacked(
    tree: _T, whole: set[State], f: Callable[[Any], Any], keep: Callable[[Any], Any]
) -> _T:
    """`tree` with `f` applied to every array that holds the members, and `keep` to
    the values that a `StateDict` in it (at any depth: a snapshot, an optimiser's
    state) holds for states copied whole, which are not stacked."""

    def one(x: Any) -> Any:
        if isinstance(x, StateDict):
            return state_dict_of(
                {
                    s: keep(v) if s in whole else _map_stacked(v, whole, f, keep)
                    for s, v in x.items()
                }
            )
        return f(x) if eqx.is_array(x) else x

    return jtu.tree_map(one, tree, is_leaf=_is_state_dict)


def _is_state_dict(x: Any) -> bool:
    return isinstance(x, StateDict)


def _refuse_arrays_off_the_leading_axis(states: tuple[State, ...]) -> None:
    """Raises if a build of these states stacked its arrays along another axis than
    the leading one, where `member` would slice them."""
    if any(not b.arrays_leading for b in _outermost_builds(states)):
        raise ValueError(
            "This ensemble was built by `vmap_new_states` with `out_axes` other than "
            "0, so its arrays hold the members along another axis than the leading "
            "one, and `member` would slice them wrongly (its states are stacked "
            "along the leading axis whatever `out_axes` says). Build it with "
            "`out_axes=0` to take members with `eqstate.member`."
        )


def _copied_whole(states: tuple[State, ...], shared: set[State]) -> set[State]:
    """The states of an ensemble that `member` copies whole rather than slices: those
    `vmap_new_states` replicated, those it returned without building them from a
    build that built another state of the ensemble (see `mark_build`), and those of
    `shared`."""
    # A state one build stacked may be tied by another into every member of its own.
    builds = {b for s in states for b, built, _ in _builds(s) if built}

    def tied(state: State) -> bool:
        return any(b in builds for b, built, _ in _builds(state) if not built)

    return {s for s in states if s in _REPLICATED or tied(s) or s in shared}
