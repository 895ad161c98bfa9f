"""eqstate: state in JAX programs, in the style of Equinox."""

import importlib.metadata

from . import filters as filters, nn as nn, random as random, transform as transform
from ._checkpoint import load as load, save as save
from ._checkpoint_manager import CheckpointManager as CheckpointManager
from ._clone import clone as clone, member as member
from ._errors import (
    BatchAxisError as BatchAxisError,
    CheckpointError as CheckpointError,
    NewStateError as NewStateError,
    StateNotFoundError as StateNotFoundError,
    StateValueError as StateValueError,
    TraceContextError as TraceContextError,
    UnknownCacheKeyError as UnknownCacheKeyError,
    UnstableStatesError as UnstableStatesError,
)
from ._run import (
    assign as assign,
    init_states as init_states,
    make_with_states as make_with_states,
    run as run,
    scope as scope,
    states_of as states_of,
    values_of as values_of,
    world as world,
)
from ._sharding import shard as shard
from ._state import (
    is_state as is_state,
    LongTermState as LongTermState,
    NonBatchState as NonBatchState,
    ParamState as ParamState,
    RandomState as RandomState,
    ShortTermState as ShortTermState,
    State as State,
)
from ._state_dict import StateDict as StateDict
from ._training import apply_updates as apply_updates, trainable as trainable


__version__ = importlib.metadata.version("eqstate")
