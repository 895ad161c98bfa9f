"""Placing values on devices without sharing a device buffer with the caller's."""

from typing import Any

import jax
from jax.core import Tracer

from ._custom_types import PyTree
from ._multi_process import device_put
from ._shapes import is_key


def _buffers(x: jax.Array) -> set[int]:
    """The addresses of the device buffers of `x` on this process."""
    if is_key(x):
        x = jax.random.key_data(x)
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def _shares_a_buffer(x: Any, placed: Any) -> bool:
    if placed is x or not isinstance(x, jax.Array):
        return False
    if isinstance(x, Tracer) or isinstance(placed, Tracer):
        return False  # Placed inside a trace: no buffer exists yet.
    return bool(_buffers(x) & _buffers(placed))


def _put_leaf_apart(x: Any, sharding: jax.sharding.Sharding) -> Any:
    placed = device_put(x, sharding)
    if _shares_a_buffer(x, placed):
        return device_put(private_copy(x), sharding)
    return placed


def device_put_apart(value: PyTree, sharding: jax.sharding.Sharding) -> PyTree:
    """`device_put(value, sharding)`, but no array of the result shares a device
    buffer with `value` unless it is the very array of `value` (already placed so).

    `jax.device_put` may return a new array whose shard on a device is the buffer of
    the value there (replicating a one-device array does, even with
    `may_alias=False` in JAX 0.10). A state holding it could be donated by
    `jit(donate_states=True)`, which would delete the value the caller placed. A shared buffer is found by address,
    and only then is the value copied.
    """
    return jax.tree_util.tree_map(lambda x: _put_leaf_apart(x, sharding), value)


def private_copy(x: Any) -> Any:
    """A copy of the array `x` that shares no device buffer with it, with its
    sharding, made buffer by buffer on this process's devices: no computation, which
    every process of a multi-process program would have to run in step."""
    if not isinstance(x, jax.Array) or isinstance(x, Tracer):
        return x
    if is_key(x):
        data = private_copy(jax.random.key_data(x))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if x.is_fully_addressable:
        return jax.device_put(x, may_alias=False)
    shards = [
        jax.device_put(shard.data, shard.device, may_alias=False)
        for shard in x.addressable_shards
    ]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)


def private_copies(tree: PyTree) -> PyTree:
    """`private_copy` of every array in `tree`, those on this process's devices alone
    in one `jax.device_put` (far cheaper than one each)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    copies = list(leaves)
    local = []
    for i, x in enumerate(leaves):
        if _copied_in_one_put(x):
            local.append(i)
        else:
            copies[i] = private_copy(x)
    if local:
        together = jax.device_put([leaves[i] for i in local], may_alias=False)
        for i, copy in zip(local, together):
            copies[i] = copy
    return jax.tree_util.tree_unflatten(treedef, copies)


def _copied_in_one_put(x: Any) -> bool:
    return (
        isinstance(x, jax.Array)
        and not isinstance(x, Tracer)
        and not is_key(x)
        and x.is_fully_addressable
    )
