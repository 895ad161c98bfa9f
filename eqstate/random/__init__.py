"""Random numbers as state: a default `RandomState` in the world, and samplers with
`jax.random`'s signatures minus the key, each reading and advancing that state."""

from .._state import RandomState as RandomState
from ._random import (
    bernoulli as bernoulli,
    categorical as categorical,
    choice as choice,
    DEFAULT as DEFAULT,
    dropout_mask as dropout_mask,
    exponential as exponential,
    gamma as gamma,
    get_key as get_key,
    normal as normal,
    permutation as permutation,
    rand as rand,
    randint as randint,
    randn as randn,
    seed as seed,
    set_key as set_key,
    split_key as split_key,
    truncated_normal as truncated_normal,
    uniform as uniform,
)
