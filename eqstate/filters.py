"""The filter language shared by every API that selects states."""

from ._filters import (
    AllOf as AllOf,
    AnyOf as AnyOf,
    Everything as Everything,
    Is as Is,
    Not as Not,
    Nothing as Nothing,
    OfType as OfType,
    StateFilter as StateFilter,
    to_predicate as to_predicate,
    WithName as WithName,
    WithTag as WithTag,
)
