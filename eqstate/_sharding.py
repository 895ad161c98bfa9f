"""Placing state values on several devices."""

from collections.abc import Callable, Mapping
from typing import Any

import jax.tree_util as jtu
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._custom_types import PyTree
from ._pretty_print import state_label
from ._run import assign, values_of
from ._state import is_state, State
from ._state_dict import StateDict
from ._state_rule import per_state_rule


def spec_rule(specs: Any) -> Callable[[State, Any], PartitionSpec | None]:
    """`specs` (a `PartitionSpec`, `{filter: PartitionSpec}`, or a function) as a
    function `(state, value) -> PartitionSpec | None`."""
    return per_state_rule(
        specs,
        PartitionSpec,
        what="Partition specs",
        spelled="PartitionSpec",
        short="PartitionSpec",
    )


def check_divisible(state: State, value: Any, mesh: Mesh, spec: PartitionSpec) -> None:
    """Raises `ValueError` naming `state` if `spec` cannot split its value on `mesh`
    (too many entries, an axis not in the mesh or named twice, a size not a
    multiple)."""
    _check_axes_named_once(state, value, spec)
    for leaf in jtu.tree_leaves(value):
        shape = leaf.shape
        if len(spec) > len(shape):
            raise ValueError(
                f"The partition spec {spec} has {len(spec)} entries, but "
                f"{state_label(state, value)} has only {len(shape)} dimensions."
            )
        for dim, axes in enumerate(spec):
            if axes is None:
                continue
            names = axes if isinstance(axes, tuple) else (axes,)
            _check_axes_in_mesh(state, value, mesh, spec, names)
            devices = 1
            for name in names:
                devices *= mesh.shape[name]
            if shape[dim] % devices:
                raise ValueError(
                    f"Cannot split dimension {dim} (size {shape[dim]}) of "
                    f"{state_label(state, value)} over mesh axes {names} "
                    f"({devices} devices): the size must be a multiple of the number "
                    "of devices."
                )


def _check_axes_named_once(state: State, value: Any, spec: PartitionSpec) -> None:
    names = [
        name
        for axes in spec
        if axes is not None
        for name in (axes if isinstance(axes, tuple) else (axes,))
    ]
    twice = sorted({name for name in names if names.count(name) > 1}, key=str)
    if twice:
        raise ValueError(
            f"The partition spec {spec} of {state_label(state, value)} names mesh "
            f"axes {twice} more than once, but a mesh axis splits at most one "
            "dimension. Name each axis once (e.g. `P('x', None)`), splitting other "
            "dimensions over other axes."
        )


def _check_axes_in_mesh(
    state: State, value: Any, mesh: Mesh, spec: PartitionSpec, names: tuple
) -> None:
    unknown = [name for name in names if name not in mesh.shape]
    if unknown:
        raise ValueError(
            f"The partition spec {spec} of {state_label(state, value)} names mesh "
            f"axes {unknown}, but the mesh has only the axes "
            f"{tuple(mesh.axis_names)}: name one of those."
        )


def shard(
    states: StateDict | PyTree,
    mesh: Mesh,
    specs: PartitionSpec | Mapping[Any, PartitionSpec] | Callable[..., Any],
) -> StateDict:
    """Places state values on the devices of `mesh` with `NamedSharding`s. A placed
    value shares no device buffer with the value it replaces (unless it is that very
    array, already placed so), so `jit(..., donate_states=True)` leaves a value read
    before intact.

    **Arguments:**

    - `states`: a [`eqstate.StateDict`][] (or a mapping from handles to values), whose
        values are placed and returned; or a PyTree holding handles (a model), whose
        values are read from the innermost context, placed, and written back there.
    - `mesh`: a `jax.sharding.Mesh`.
    - `specs`: how to split each state: one `PartitionSpec` for all; a mapping
        `{filter: PartitionSpec}` (first match; unmatched states are replicated); or
        a function `(state, value) -> PartitionSpec | None` (`None`: replicated).

    **Returns:**

    A `StateDict` of the placed values.

    !!! Example

        ```python
        import eqstate as es
        import jax
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P

        n = len(jax.devices())
        mesh = jax.make_mesh((n,), ("model",))
        big = es.ParamState(jnp.ones((4 * n, 8)), name="big")
        bias = es.ParamState(jnp.zeros(8), name="bias")
        placed = es.shard([big, bias], mesh, {big: P("model")})
        assert big.value.sharding.spec == P("model")    # written back to the world
        assert bias.value.sharding.spec == P()           # replicated
        ```
    """
    rule = spec_rule(specs)
    is_dict = isinstance(states, Mapping) and any(map(is_state, states))
    values = StateDict(states) if is_dict else values_of(states)

    def sharding(state: State, value: Any) -> NamedSharding:
        spec = rule(state, value)
        spec = PartitionSpec() if spec is None else spec
        check_divisible(state, value, mesh, spec)
        return NamedSharding(mesh, spec)

    placed = values.with_sharding(sharding)
    if not is_dict:
        assign(placed)
    return placed
