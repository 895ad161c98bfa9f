"""State-aware transforms: each traces a function with a StatefulFunction and applies
the JAX transform of the same name to its pure form."""

from ._ad import (
    grad as grad,
    hessian as hessian,
    jacfwd as jacfwd,
    jacrev as jacrev,
    jvp as jvp,
    value_and_grad as value_and_grad,
    vector_grad as vector_grad,
    vjp as vjp,
)
from ._checkpointed_loops import (
    checkpointed_for_loop as checkpointed_for_loop,
    checkpointed_scan as checkpointed_scan,
)
from ._conditions import cond as cond, ifelse as ifelse, switch as switch
from ._eval_shape import eval_shape as eval_shape
from ._jit import jit as jit, JittedFunction as JittedFunction
from ._loops import (
    bounded_while_loop as bounded_while_loop,
    for_loop as for_loop,
    scan as scan,
    while_loop as while_loop,
)
from ._map import map as map
from ._new_states import (
    INIT_NO_BATCHING as INIT_NO_BATCHING,
    vmap2_new_states as vmap2_new_states,
    vmap_new_states as vmap_new_states,
)
from ._progress_bar import ProgressBar as ProgressBar
from ._remat import checkpoint as checkpoint, remat as remat
from ._shard_map import shard_map as shard_map
from ._stateful_function import (
    make_jaxpr as make_jaxpr,
    StatefulFunction as StatefulFunction,
)
from ._vmap import vmap as vmap
