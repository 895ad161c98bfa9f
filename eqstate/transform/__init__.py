"""State-aware transforms: each traces a function with a StatefulFunction and applies
the JAX transform of the same name to its pure form."""

from ._jit import jit as jit, JittedFunction as JittedFunction
from ._stateful_function import (
    make_jaxpr as make_jaxpr,
    StatefulFunction as StatefulFunction,
)
