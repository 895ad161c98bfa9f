"""Autodiff: grad, value_and_grad, vector_grad, vjp, jvp, jacrev, jacfwd, hessian.

Each traces the function to find its states, differentiates its pure form with the
JAX transform of the same name (with respect to the values of `grad_states` and the
arguments in `argnums`), and writes back the states the function wrote.
"""

import contextlib
import functools as ft
import operator
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import (
    Any,
    Literal,
    overload,
    ParamSpec,
    TypedDict,
    TypeVar,
    Unpack,
)

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .. import _context, _jax_compat as compat
from .._custom_types import Filter, MISSING, Missing, PyTreeDef
from .._pretty_print import first_and_more, state_label
from .._run import states_of
from .._state import is_state, ParamState, State
from .._state_dict import state_dict_of, StateDict
from .._training import inexact_part
from ._common import (
    as_arrays,
    copied_numpy,
    ErrorsRaisedAs,
    partition,
    select_states,
)
from ._decorator import decorator_form
from ._discovery import Discovery, kept_or_fresh, traces_for
from ._equinox_errors import EQUINOX_ERRORS
from ._leaves import dynamic_mask


compat.hide_from_tracebacks(__file__)


_P = ParamSpec("_P")
_T = TypeVar("_T")
_X = TypeVar("_X")


def _as_argnums(argnums: int | Sequence[int] | None) -> tuple[tuple[int, ...], bool]:
    if argnums is None:
        return (), False
    try:
        if isinstance(argnums, (int, np.integer)):
            return (operator.index(argnums),), True
        return tuple(operator.index(i) for i in argnums), False
    except TypeError:
        raise TypeError(
            f"`argnums` must be an integer or a sequence of integers, got {argnums!r}."
        ) from None


def _positions(
    argnums: tuple[int, ...], spec: Any, n_args: int, kwargs: dict, name: str
) -> tuple[int, ...]:
    """`argnums` as non-negative positions among the `n_args` positional arguments
    of a call, or an error in the user's terms."""
    out_of_range = [i for i in argnums if not -n_args <= i < n_args]
    if not out_of_range:
        positions = tuple(i % n_args for i in argnums)
        repeated = sorted({i for i in positions if positions.count(i) > 1})
        if repeated:
            raise ValueError(
                f"`argnums={spec}` names argument {repeated[0]} more than once "
                f"({name} was called with {n_args} positional arguments, and "
                "negative entries count from the end). Name each argument once."
            )
        return positions
    if n_args == 0:
        got = "no positional arguments"
    else:
        got = f"only {n_args} positional argument{'s' if n_args > 1 else ''}"
    hint = (
        f" Keyword arguments ({', '.join(sorted(kwargs))}) are not differentiated: "
        "pass the ones to differentiate positionally."
        if kwargs
        else ""
    )
    default = " (the default without `grad_states`)" if spec is None else ""
    # The error types of `jax.grad`: `TypeError` past the end, `ValueError` before.
    raise (ValueError if out_of_range[0] < 0 else TypeError)(
        f"Differentiating with respect to `argnums={spec if spec is not None else 0}`"
        f"{default} needs argument {out_of_range[0]}, but {name} was called with "
        f"{got}.{hint} To differentiate with respect to states instead, pass "
        "`grad_states=...`."
    )


def _is_differentiable(x: Any, allow_int: bool) -> bool:
    dtype = jnp.result_type(x)
    return jnp.issubdtype(dtype, jnp.inexact) or (
        allow_int and (jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_)
    )


def split_differentiable(tree: Any, allow_int: bool = False) -> tuple[Any, Any]:
    """`(differentiable, rest)`: two trees shaped like `tree`. The first holds the
    leaves JAX differentiates (traced floating-point arrays and Python floats, and
    integers with `allow_int`), the second every other leaf (state handles, integer
    arrays, a module's static fields), each with `None` in the other's places:
    Equinox's convention, so a gradient has `None` where nothing is differentiated.
    `combine` joins them back."""
    leaves, treedef = jtu.tree_flatten(tree)
    chosen = [
        traced and _is_differentiable(x, allow_int)
        for x, traced in zip(leaves, dynamic_mask(tree))
    ]
    differentiable = [x if c else None for x, c in zip(leaves, chosen)]
    rest = [None if c else x for x, c in zip(leaves, chosen)]
    return jtu.tree_unflatten(treedef, differentiable), jtu.tree_unflatten(
        treedef, rest
    )


def _tangent_like(index: int, tangent: Any, primal: Any) -> Any:
    """The part of `tangent` for the differentiable part of `primal` (argument
    `index`), where it has `primal`'s structure (e.g. a model's handles in both);
    else `tangent`.

    **Raises:**

    `TypeError`, as `jax.jvp` does, for a floating-point tangent, or an array one
    other than `float0`, given to an integer or boolean leaf (setting it aside would
    drop it).
    """
    if jtu.tree_structure(tangent) != jtu.tree_structure(primal):
        return tangent
    leaves = jtu.tree_leaves(tangent)
    with_paths = jtu.tree_leaves_with_path(primal)
    chosen = jtu.tree_leaves(split_differentiable(primal)[0], is_leaf=_is_none)
    for t, (path, p), c in zip(leaves, with_paths, chosen):
        if c is None and _has_no_tangent(p) and _is_a_nonzero_tangent(t):
            where = f"primals[{index}]{jtu.keystr(path)}"
            raise TypeError(
                f"jvp was given a tangent of dtype {jnp.result_type(t)} for "
                f"{where}, which has the integer, boolean or key dtype "
                f"{p.dtype if hasattr(p, 'dtype') else type(p).__name__}: as in "
                "`jax.jvp`, such a primal has no "
                "tangent, and only a `float0` tangent (or `None`) is taken for it. "
                f"To differentiate along {where}, pass it as a floating-point "
                "value (e.g. `3.0`, or `x.astype(float)`)."
            )
    return jtu.tree_unflatten(
        jtu.tree_structure(primal),
        [t if c is not None else None for t, c in zip(leaves, chosen)],
    )


def _has_no_tangent(primal_leaf: Any) -> bool:
    """Whether a leaf JAX differentiates with a `float0` tangent: an integer, a
    boolean (a Python one, or an array) or a key."""
    if isinstance(primal_leaf, (bool, int, np.integer, np.bool_)):
        return True
    if not isinstance(primal_leaf, (jax.Array, np.ndarray)):
        return False
    dtype = primal_leaf.dtype
    return not jnp.issubdtype(dtype, jnp.inexact)


def _is_a_nonzero_tangent(tangent_leaf: Any) -> bool:
    # A Python int or bool is taken: what `eqx.combine` puts back where a model's
    # non-array leaves are (its tangent built from `eqx.filter(model, eqx.is_array)`).
    if isinstance(tangent_leaf, (float, complex)):
        return True
    return (
        isinstance(tangent_leaf, (jax.Array, np.ndarray, np.generic))
        and tangent_leaf.dtype != jax.dtypes.float0
    )


def _is_none(x: Any) -> bool:
    return x is None


def combine(differentiable: Any, rest: Any) -> Any:
    """Undoes `split_differentiable`."""
    return eqx.combine(differentiable, rest)


def _reached(fun: Any) -> Iterator[tuple[str, Any]]:
    """`(name, object)` for what `fun` reaches besides its arguments: itself (a
    module called), the `self` of a method, what a `functools.partial` binds, its
    closure cells, the globals its code names, and, a few levels down, what the
    functions and plain objects among those reach (`trainer.model`)."""
    seen: set[int] = set()
    pending = [(getattr(fun, "__name__", "fun"), fun, 0)]
    while pending:
        name, obj, depth = pending.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type)):
            continue
        seen.add(id(obj))
        yield name, obj
        if depth < 3:
            pending += [(n, x, depth + 1) for n, x in _references(name, obj)]


def _references(name: str, obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, ft.partial):
        bound = [*obj.args, *obj.keywords.values()]
        return [(name, obj.func), *((f"{name}(...)", x) for x in bound)]
    found = [(n, getattr(obj, n)) for n in ("__self__", "__func__") if hasattr(obj, n)]
    found = [("self" if n == "__self__" else name, x) for n, x in found]
    if isinstance(obj, types.FunctionType):
        code, cells = obj.__code__, obj.__closure__ or ()
        for n, cell in zip(code.co_freevars, cells):
            with contextlib.suppress(ValueError):  # an empty cell
                found.append((n, cell.cell_contents))
        found += [(n, obj.__globals__[n]) for n in _names(code) if n in obj.__globals__]
    elif hasattr(obj, "__dict__") and not isinstance(obj, eqx.Module):
        found += [(f"{name}.{n}", x) for n, x in vars(obj).items()]
    return found


def _names(code: types.CodeType) -> Iterator[str]:
    """The global and attribute names `code` and the functions inside it use."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _arrays_beside(tree: Any, states: set, among: set[int] | None) -> list:
    """`(id, path)` of the floating-point arrays of `tree` (only those whose id is in
    `among`, if given) if `tree` also holds one of `states`; else none."""
    leaves = jtu.tree_leaves_with_path(tree)
    if not any(is_state(x) and x in states for _, x in leaves):
        return []
    return [
        (id(x), jtu.keystr(path))
        for path, x in leaves
        if eqx.is_inexact_array(x) and (among is None or id(x) in among)
    ]


_ARRAYS_UNTRAINED = (
    "{name} is differentiated with respect to states of a model (`grad_states`) "
    "but not with respect to the model's floating-point arrays (the weights of "
    "`eqx.nn` layers), so these arrays get no gradient and stay as they are: "
    "{arrays}. To train them too, pass the model as an argument and differentiate "
    "it as well: `eqstate.transform.grad(loss, argnums=0, "
    "grad_states=eqstate.ParamState)(model, ...)`, with `eqstate.trainable(model)` "
    "and `eqstate.apply_updates` for the optimiser. To keep them fixed on purpose, "
    "ignore this warning."
)


def _warn_if_arrays_untrained(
    traced: Discovery, grad_states: Sequence[State], args: tuple, positions: tuple
) -> bool:
    """Warns, naming them, about the floating-point arrays of a model some of whose
    states are differentiated but whose arrays are not: those of an argument outside
    `argnums`, and those the function reaches otherwise (closure, global, attribute)
    that became constants of its trace. Returns whether it warned."""
    states, consts = set(grad_states), {id(c) for c in traced.trace.jaxpr.consts}
    untrained: dict[int, str] = {}
    for i, arg in enumerate(args):
        if i not in positions:
            untrained.update(
                (k, f"args[{i}]{p}") for k, p in _arrays_beside(arg, states, None)
            )
    for where, obj in _reached(traced.traces.fun):
        for k, path in _arrays_beside(obj, states, consts):
            untrained.setdefault(k, where + path)
    if untrained:
        arrays = first_and_more(f"`{p}`" for p in untrained.values())
        warnings.warn(
            _ARRAYS_UNTRAINED.format(name=traced.name, arrays=arrays), stacklevel=3
        )
    return bool(untrained)


def _warn_if_params_undifferentiated(
    name: str, traced: Discovery, held: Sequence[State], positions: Sequence[int]
) -> bool:
    """Warns if `traced` uses floating-point `ParamState`s held by the differentiated
    arguments while no `grad_states` is given: as in `eqx.filter_grad`, their
    handles get no gradient, silently. Returns whether it warned."""
    used = set(traced.states)
    values = dict(zip(traced.states, traced.values))
    params = [
        s
        for s in held
        if isinstance(s, ParamState)
        and s in used
        and any(eqx.is_inexact_array(x) for x in jtu.tree_leaves(values[s]))
    ]
    if not params:
        return False
    where = "argument" if len(positions) == 1 else "arguments"
    listed = ", ".join(map(str, positions))
    warnings.warn(
        f"{name} uses {first_and_more(map(state_label, params))}, held by the "
        f"differentiated {where} ({listed}), but no `grad_states` is given: as in "
        "`eqx.filter_grad`, a handle gets no gradient (`None`), and only the "
        "arrays are differentiated. To differentiate those states too, add "
        "`grad_states=eqstate.ParamState` (the gradients then come as "
        "`(state_grads, grads)`; see `eqstate.trainable`).",
        stacklevel=3,
    )
    return True


_NOTHING_TO_DIFFERENTIATE = (
    "`grad_states` selects none of the floating-point states that {name} uses, and "
    "no `argnums` is given, so nothing would be differentiated (the gradients would "
    "be empty, and an optimiser given them would train nothing). Check the filter "
    "(a tag or kind that the states have), name the states, or pass `argnums` for "
    "the arguments to differentiate."
)


def _split_aux(out: Any, name: str) -> tuple[Any, Any]:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            f"With `has_aux=True`, {name} must return a pair `(value, aux)`, but it "
            f"returned {_describe_output(out)}. Return `(value, aux)`, or drop "
            "`has_aux`."
        )
    return out[0], out[1]


def _describe_output(out: Any) -> str:
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of length {len(out)}"
    shape = getattr(out, "shape", None)
    if shape is not None:
        return f"an array of shape {tuple(shape)}"
    return f"{out!r}"


# What an unused state named in each transform's argument would get, and the fix.
_UNUSED = {
    "grad_states": "its gradient would be zero. Remove it, or pass "
    "`check_states=False` to get zeros.",
    "state_tangents": "its tangent would have no effect. Remove it, or pass "
    "`check_states=False` to ignore it.",
}


def _whole(value: Any) -> Any:
    return value


def _inexact_or_whole(value: Any) -> Any:
    """The floating-point leaves of a state's value (`None` at the others), as `grad`
    differentiates them; the whole value of a state holding none (an integer state
    named explicitly, whose cotangent is `float0`, as `jax.vjp` gives)."""
    part = inexact_part(value)
    return value if part is None else part


class _Differentiable:
    """The parts every autodiff transform shares: trace, pick the states to
    differentiate, and build the pure function JAX differentiates."""

    def __init__(
        self,
        traced: Discovery,
        grad_states: Any,
        check_states: bool,
        held: Sequence[State] = (),
        part: Callable[[Any], Any] = inexact_part,
        argument: str = "grad_states",
    ):
        """`held`: the states held by the differentiated arguments, which a filter
        in `grad_states` selects from too, used or not. A filter selects only states
        holding floating-point values, as `eqx.filter_grad` selects arrays. `part`:
        the part of a state's value that is differentiated, by default its
        floating-point leaves (`inexact_part`). `argument`: the name of the user's
        argument naming the states, for messages."""
        self.traced = traced
        self.part = part
        self.index = {s: i for i, s in enumerate(traced.states)}
        if grad_states is None:
            self.grad_states: tuple[State, ...] = ()
        else:
            used = set(traced.states)
            values = dict(zip(traced.states, traced.values))
            unused = [s for s in held if s not in used]
            values.update((s, traced.frame.peek(s)) for s in unused)
            candidates = [
                s
                for s in (*traced.states, *unused)
                if inexact_part(values[s]) is not None
            ]
            states, explicit = select_states(grad_states, candidates)
            if explicit and check_states:
                unused = [s for s in states if s not in traced.states]
                if unused:
                    raise ValueError(
                        f"`{argument}` holds {state_label(unused[0])}, which "
                        f"{traced.name} does not use, so {_UNUSED[argument]}"
                    )
            self.grad_states = states
        self.box: dict[str, Any] = {}

    def rules_see(self) -> Any:
        """A context in which the custom rules JAX runs in a backward pass (a
        `jax.custom_vjp`'s `bwd`) read the values the function was traced with."""
        trace = self.traced.trace
        return _context.rules_see(
            trace.read_only(self.traced.values), trace.rule_mapped
        )

    def value(self, state: State) -> Any:
        """The whole value of one of `grad_states`."""
        i = self.index.get(state)
        return self.traced.frame.read(state) if i is None else self.traced.values[i]

    def grad_values(self) -> StateDict:
        return state_dict_of({s: self.part(self.value(s)) for s in self.grad_states})

    def pure(self, kwargs: dict, has_aux: bool) -> Callable:
        """`(grad_values: StateDict, *args) -> (out, (aux_leaves, updated, new))`."""
        traced, index = self.traced, self.index

        def pure(grad_values: StateDict, *args):
            values = list(traced.values)
            for state, value in grad_values.items():
                if state in index:
                    # The leaves left out of `value` (integers) keep their values.
                    values[index[state]] = combine(value, values[index[state]])
            # Python scalars in `aux` come back as they are, as from `jax.grad`.
            out, updates, new = traced.evaluate(values, args, kwargs, has_aux)
            main, aux = _split_aux(out, traced.name) if has_aux else (out, None)
            aux_leaves, rebuild_aux = partition(aux)
            self.box["rebuild_aux"] = rebuild_aux
            self.box["new_states"] = [s for s, _ in new]
            self.box["updated_states"] = list(updates)
            return main, (aux_leaves, list(updates.values()), [v for _, v in new])

        return pure

    def finish(self, extras: tuple) -> Any:
        """Writes back the states and returns the auxiliary output."""
        aux_leaves, updated, new_values = extras
        # Eagerly, JAX returns a value passed through as it is (see `as_arrays`).
        updated, new_values = as_arrays(updated), as_arrays(new_values)
        self.traced.commit(
            dict(zip(self.box["updated_states"], updated)),
            list(zip(self.box["new_states"], new_values)),
        )
        return self.box["rebuild_aux"](aux_leaves)


def _jacobian_parts(out_def: PyTreeDef, jacobian: Any, single: bool) -> tuple:
    """`(state part, argument part)` of a Jacobian with respect to the state values
    and the arguments, as JAX's transforms return it (each output leaf holding one
    entry per input). Each part is laid out as JAX lays out the Jacobian with respect
    to those inputs alone: the output's structure outermost, and inside it the
    `StateDict`, or the one argument (`single`) or the tuple of arguments."""
    per_leaf = out_def.flatten_up_to(jacobian)
    states = out_def.unflatten([entry[0] for entry in per_leaf])
    args = [entry[1] if single else tuple(entry[1:]) for entry in per_leaf]
    return states, out_def.unflatten(args)


class _GradientTransform:
    """`grad`, `jacrev`, `jacfwd` and `hessian`: see `grad` for the outputs."""

    def __init__(
        self,
        fun: Callable,
        jax_transform: Callable,
        *,
        grad_states: Any,
        argnums: int | Sequence[int] | None,
        has_aux: bool,
        return_value: bool | str,
        check_states: bool,
        transform_kwargs: dict[str, Any],
        name: str | None = None,
        output_first: bool = True,
    ):
        self.fun = fun
        # Whether the JAX transform returns one entry per output leaf (a Jacobian),
        # each holding the derivatives with respect to every input.
        self._output_first = output_first
        self._jax_transform = jax_transform
        self._grad_states = grad_states
        # The user's `argnums`, for messages (None: the default 0).
        self._argnums_spec = argnums
        if argnums is None and grad_states is None:
            argnums = 0
        self._argnums, self._single_arg = _as_argnums(argnums)
        self._has_aux = has_aux
        self._return_value = return_value
        self._check_states = check_states
        self._transform_kwargs = transform_kwargs
        name = name or getattr(fun, "__name__", "fun")
        self._traces = traces_for(fun, name, transformed_argnums=self._argnums)
        self._warned = False
        ft.update_wrapper(self, fun, updated=())

    @classmethod
    def or_decorator(cls, fun: Any, *args: Any, **kwargs: Any) -> Any:
        """The transformed `fun`, or without `fun`, the decorator that makes it."""
        if fun is MISSING:
            return lambda fun: cls(fun, *args, **kwargs)
        return cls(fun, *args, **kwargs)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # A method's instance is its first argument, as for a function `jax.grad`
        # returns.
        if instance is None:
            return self
        return ft.partial(self, instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = copied_numpy((args, kwargs))
        traced = Discovery(self.fun, args, kwargs, traces=kept_or_fresh(self._traces))
        positions = _positions(
            self._argnums, self._argnums_spec, len(args), kwargs, self._traces.name
        )
        # A model's states get gradients (zero if unused), as its arrays do.
        held = states_of(tuple(args[i] for i in positions)) if positions else ()
        allow_int = self._transform_kwargs.get("allow_int", False)
        diff = _Differentiable(
            traced,
            self._grad_states,
            self._check_states,
            held,
            _whole if allow_int else inexact_part,
        )
        if self._grad_states is None and held and not self._warned:
            self._warned = _warn_if_params_undifferentiated(
                self._traces.name, traced, held, positions
            )
        if diff.grad_states and not self._warned:
            self._warned = _warn_if_arrays_untrained(
                traced, diff.grad_states, args, positions
            )
        pure = diff.pure(kwargs, self._has_aux)

        parts = [split_differentiable(args[i], allow_int) for i in positions]

        def with_value(grad_values, *differentiated):
            full = list(args)
            for i, part, (_, rest) in zip(positions, differentiated, parts):
                full[i] = combine(part, rest)
            main, extras = pure(grad_values, *full)
            return main, (main, extras)

        transformed = self._jax_transform(
            with_value,
            argnums=tuple(range(len(positions) + 1)),
            has_aux=True,
            **self._transform_kwargs,
        )
        if not allow_int:
            self._check_inexact(diff)
        if self._grad_states is not None and not positions and not diff.grad_states:
            raise ValueError(_NOTHING_TO_DIFFERENTIATE.format(name=self._traces.name))
        grad_values = diff.grad_values()
        differentiated = [part for part, _ in parts]
        inputs = (grad_values, *differentiated)
        with diff.rules_see(), EQUINOX_ERRORS, _WHILE_LOOP_HINT:
            if jtu.tree_leaves(inputs):
                grads, (value, extras) = transformed(*inputs)
            else:
                # Only integers (`None` derivatives, as `grad` gives): JAX's
                # Jacobians take no empty input, so every entry is made empty here.
                value, extras = with_value(*inputs)[1]
                grads = inputs
                if self._output_first:
                    out_def = jtu.tree_structure(value)
                    grads = out_def.unflatten([inputs] * out_def.num_leaves)
        aux = diff.finish(extras)
        single = self._single_arg
        if self._output_first:
            out_def = jtu.tree_structure(value)
            state_grads, grads = _jacobian_parts(out_def, grads, single)
        else:
            state_grads, grads = grads[0], grads[1] if single else grads[1:]
        return self._arrange(state_grads, grads, value, aux)

    def _check_inexact(self, diff: _Differentiable) -> None:
        """JAX's `TypeError` for a state named in `grad_states` that holds only
        integers or keys, naming the state. (A filter selects floating-point states
        only.)"""
        for state in diff.grad_states:
            value = diff.value(state)
            if inexact_part(value) is not None:
                continue
            hint = (
                ", or pass `allow_int=True` for a `float0` gradient"
                if "allow_int" in self._transform_kwargs
                else ""
            )
            raise TypeError(
                f"`grad_states` names {state_label(state, value)}, but "
                f"{self._traces.name} can be differentiated only with respect to "
                f"floating-point or complex values. Remove it from `grad_states`{hint}."
            )

    def _arrange(self, state_grads: Any, grads: Any, value: Any, aux: Any) -> Any:
        """The result in the layout the options ask for (`jax.grad`'s, plus the
        state gradients first when there are some)."""
        if self._grad_states is None:
            result = grads
        elif not self._argnums:
            result = state_grads
        else:
            result = (state_grads, grads)
        if self._return_value == "first":  # `value_and_grad`
            return ((value, aux) if self._has_aux else value), result
        if self._return_value and self._has_aux:
            return result, value, aux
        if self._return_value:
            return result, value
        if self._has_aux:
            return result, aux
        return result


class _Options(TypedDict, total=False):
    holomorphic: bool
    allow_int: bool
    check_states: bool


# The overloads of `grad` and `value_and_grad` type the layouts of the gradients (see
# `grad`'s Returns) with `grad_states` and `argnums` of 0 or none; other calls return
# `Any`. The arrays' gradients are `Any`: a model's type would be exact, but optax's
# `Params` refuses it (as `es.trainable`'s arrays, and Equinox's `PyTree`).
@overload
def grad(
    fun: Callable[_P, Any],
    grad_states: Filter,
    argnums: None = None,
    has_aux: Literal[False] = False,
    return_value: Literal[False] = False,
    **options: Unpack[_Options],
) -> Callable[_P, StateDict]: ...
@overload
def grad(
    fun: Callable[_P, Any],
    grad_states: Filter,
    argnums: Literal[0],
    has_aux: Literal[False] = False,
    return_value: Literal[False] = False,
    **options: Unpack[_Options],
) -> Callable[_P, tuple[StateDict, Any]]: ...
@overload
def grad(
    fun: Callable[_P, _T],
    grad_states: Filter,
    argnums: Literal[0],
    has_aux: Literal[False] = False,
    *,
    return_value: Literal[True],
    **options: Unpack[_Options],
) -> Callable[_P, tuple[tuple[StateDict, Any], _T]]: ...
@overload
def grad(
    fun: Callable[_P, Any],
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    return_value: bool = False,
    **options: Unpack[_Options],
) -> Callable[_P, Any]: ...
@overload
def grad(
    fun: Missing = MISSING,
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    return_value: bool = False,
    **options: Unpack[_Options],
) -> Callable[[Callable[_P, Any]], Callable[_P, Any]]: ...
def grad(
    fun: Any = MISSING,
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    return_value: bool = False,
    *,
    holomorphic: bool = False,
    allow_int: bool = False,
    check_states: bool = True,
) -> Any:
    """Gradient of a scalar function with respect to state values and arguments.

    The function is traced to find its states; its pure form is differentiated by
    `jax.grad` with respect to the values of `grad_states` and the arguments in
    `argnums`. States the function writes (running statistics, counters) are written
    back with their new values. The trace sees abstract values, as `jax.jit` does,
    where `jax.grad` called eagerly runs the function on concrete ones: Python
    control flow on an array's value (`if x > 0:`) raises JAX's
    `TracerBoolConversionError`; use `jnp.where` or [`eqstate.transform.cond`][]
    (Python scalars outside `argnums` stay concrete).

    **Arguments:**

    - `fun`: a function returning a scalar (or `(scalar, aux)` with `has_aux`). If
        omitted, `grad` returns a decorator.
    - `grad_states`: the states to differentiate with respect to: handles (a handle,
        a sequence, or a [`eqstate.StateDict`][] whose keys are used), or a filter
        (e.g. `eqstate.ParamState`), matched against the states the function uses
        and the states held by the arguments in `argnums`: those it does not use get
        zero gradients, as `eqx.filter_grad` gives unused arrays, so the gradients of
        a model have the structure of [`eqstate.trainable`][]`(model)` whatever of
        it the loss reads. A filter also selects the matching states the loss reads
        from elsewhere (a frozen teacher network's, say): to leave those out, name
        the model's states instead, `grad_states=eqstate.trainable(model)[0]` with
        `check_states=False`. As `eqx.filter_grad` differentiates the floating-point arrays of
        a PyTree, a state's floating-point or complex leaves are differentiated and
        its gradient has `None` at its other leaves (`{"w": floats, "mask": ints}`
        gets `{"w": dw, "mask": None}`). A filter selects the states holding such
        leaves, used or not: integer settings, step counters and
        [`eqstate.RandomState`][]s are left out. A handle of a state holding none,
        named explicitly, raises a `TypeError`, unless `allow_int=True`, which
        differentiates every leaf of the states, as `jax.grad` does (`float0`
        gradients for integers).
    - `argnums`: the positional arguments to differentiate with respect to. Defaults
        to `0` without `grad_states`, to none with them. As in `eqx.filter_grad`,
        their leaves that are not floating-point arrays (integers, Python numbers)
        get `None` rather than `jax.grad`'s `TypeError`. Without `grad_states`, a
        handle in them gets `None` too; if the function uses floating-point
        `ParamState`s they hold, `grad` warns once, naming them.
    - `has_aux`: `fun` returns `(value, aux)`.
    - `return_value`: also return the function's value.
    - `holomorphic`, `allow_int`: as in `jax.grad`. (Keyword only arguments.)
    - `check_states`: raise if a handle in `grad_states` is not used by `fun`;
        otherwise its gradient is zero. (Keyword only argument.)

    **Returns:**

    A function returning, with `state_grads` a `StateDict` keyed by the handles:

    - without `grad_states`: `arg_grads`;
    - with `grad_states` and no `argnums`: `state_grads`;
    - with both: `(state_grads, arg_grads)`;

    followed by the value if `return_value` (`(grads, value)`), and by the
    auxiliary output if `has_aux` (`(grads, aux)`, or `(grads, value, aux)`). Type
    checkers see `fun`'s signature, and these layouts for `argnums` of 0 or none;
    the arrays' gradients are `Any`, as optax's `Params` takes them.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.array([1.0, 2.0]))

        def loss(x):
            return jnp.sum((w.value * x) ** 2)

        grads = es.transform.grad(loss, grad_states=es.ParamState)(jnp.ones(2))
        assert (grads[w] == 2 * w.value).all()
        ```
    """
    return _GradientTransform.or_decorator(
        fun,
        jax.grad,
        grad_states=grad_states,
        argnums=argnums,
        has_aux=has_aux,
        return_value=return_value,
        check_states=check_states,
        transform_kwargs={"holomorphic": holomorphic, "allow_int": allow_int},
    )


@overload
def value_and_grad(
    fun: Callable[_P, _T],
    grad_states: Filter,
    argnums: None = None,
    has_aux: Literal[False] = False,
    **options: Unpack[_Options],
) -> Callable[_P, tuple[_T, StateDict]]: ...
@overload
def value_and_grad(
    fun: Callable[_P, _T],
    grad_states: Filter,
    argnums: Literal[0],
    has_aux: Literal[False] = False,
    **options: Unpack[_Options],
) -> Callable[_P, tuple[_T, tuple[StateDict, Any]]]: ...
@overload
def value_and_grad(
    fun: Callable[_P, _T],
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: Literal[False] = False,
    **options: Unpack[_Options],
) -> Callable[_P, tuple[_T, Any]]: ...
@overload
def value_and_grad(
    fun: Callable[_P, Any],
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    **options: Unpack[_Options],
) -> Callable[_P, tuple[Any, Any]]: ...
@overload
def value_and_grad(
    fun: Missing = MISSING,
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    **options: Unpack[_Options],
) -> Callable[[Callable[_P, Any]], Callable[_P, tuple[Any, Any]]]: ...
def value_and_grad(
    fun: Any = MISSING,
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    *,
    holomorphic: bool = False,
    allow_int: bool = False,
    check_states: bool = True,
) -> Any:
    """Like `jax.value_and_grad`, with the states of [`eqstate.transform.grad`][].

    **Returns:**

    A function returning `(value, grads)`, or `((value, aux), grads)` with
    `has_aux`, where `grads` is as for [`eqstate.transform.grad`][].

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.array(3.0))
        value, grads = es.transform.value_and_grad(
            lambda: w.value**2, grad_states=[w]
        )()
        assert value == 9.0 and grads[w] == 6.0
        ```
    """
    return _GradientTransform.or_decorator(
        fun,
        jax.grad,
        grad_states=grad_states,
        argnums=argnums,
        has_aux=has_aux,
        return_value="first",
        check_states=check_states,
        transform_kwargs={"holomorphic": holomorphic, "allow_int": allow_int},
    )


def _ones_like(value: Any) -> Any:
    """A cotangent of ones for a PyTree of arrays (`float0` zeros for integer and
    boolean leaves, which have no derivative)."""

    def ones(x: Any) -> Any:
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.ones_like(x)
        return np.zeros(x.shape, jax.dtypes.float0)

    return jtu.tree_map(ones, value)


def _jax_vector_grad(
    fun: Callable, argnums: tuple[int, ...], has_aux: bool
) -> Callable:
    """`jax.grad`'s calling convention for the vector-Jacobian product of `fun`
    (returning `(value, aux)`) with a cotangent of ones."""
    assert has_aux

    def transformed(*args: Any) -> tuple[tuple, Any]:
        def of_differentiated(*diff_args: Any) -> Any:
            full = list(args)
            for i, arg in zip(argnums, diff_args):
                full[i] = arg
            return fun(*full)

        value, vjp_fn, aux = jax.vjp(
            of_differentiated, *(args[i] for i in argnums), has_aux=True
        )
        return vjp_fn(_ones_like(value)), aux

    return transformed


# What JAX raises when reverse mode meets a `while_loop`.
_WHILE_LOOP_REFUSED = "Reverse-mode differentiation does not work for lax.while_loop"


def _hint_bounded_while_loop(exc: BaseException) -> None:
    """Adds eqstate's differentiable loop to JAX's error for reverse-mode
    differentiation of a `while_loop`."""
    if isinstance(exc, ValueError) and _WHILE_LOOP_REFUSED in str(exc):
        raise ValueError(
            f"{exc}\n\nFor `eqstate.transform.while_loop`, use "
            "`eqstate.transform.bounded_while_loop(cond_fun, body_fun, init, "
            "max_steps)`, which reverse-mode differentiation supports."
        ) from exc


_WHILE_LOOP_HINT = ErrorsRaisedAs(_hint_bounded_while_loop)


@decorator_form
def vector_grad(
    fun: Callable[_P, Any] = MISSING,
    grad_states: Any = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    return_value: bool = False,
    *,
    check_states: bool = True,
) -> Callable[_P, Any]:
    """Gradient of a vector-valued function: the vector-Jacobian product with a
    cotangent of ones, that is the gradient of the sum of its outputs, computed in
    one reverse pass without forming the Jacobian. For elementwise functions (a
    neuron model's update, a surrogate spike function) it is the elementwise
    derivative.

    **Arguments:**

    - `fun`: a function returning an array or a PyTree of arrays (or `(out, aux)`
        with `has_aux`). If omitted, `vector_grad` returns a decorator.
    - `grad_states`, `argnums`, `has_aux`, `return_value`, `check_states`: as for
        [`eqstate.transform.grad`][]; the value returned with `return_value` is the
        vector output.

    **Returns:**

    A function returning the gradients as [`eqstate.transform.grad`][] does (with
    `grad_states`, a `StateDict` of them), each shaped like what it differentiates.

    !!! Example

        ```python
        import eqstate as es
        import jax
        import jax.numpy as jnp

        w = es.ParamState(jnp.array([1.0, 2.0]))

        def f(x):
            return w.value * x**2  # a vector

        x = jnp.array([3.0, 4.0])
        grads, value = es.transform.vector_grad(f, argnums=0, return_value=True)(x)
        assert (grads == 2 * w.value * x).all() and (value == f(x)).all()
        state_grads = es.transform.vector_grad(f, grad_states=[w])(x)
        assert (state_grads[w] == jax.grad(lambda w: jnp.sum(w * x**2))(w.value)).all()
        ```
    """
    return _GradientTransform(
        fun,
        _jax_vector_grad,
        grad_states=grad_states,
        argnums=argnums,
        has_aux=has_aux,
        return_value=return_value,
        check_states=check_states,
        transform_kwargs={},
        name=getattr(fun, "__name__", "fun"),
        output_first=False,
    )


def _jacobian(jax_transform: Callable, name: str, transform_kwargs: tuple[str, ...]):
    @decorator_form
    def transform(
        fun: Any = MISSING,
        grad_states: Any = None,
        argnums: int | Sequence[int] | None = None,
        has_aux: bool = False,
        return_value: bool = False,
        *,
        holomorphic: bool = False,
        allow_int: bool = False,
        check_states: bool = True,
    ) -> Any:
        options = {"holomorphic": holomorphic, "allow_int": allow_int}
        return _GradientTransform(
            fun,
            jax_transform,
            grad_states=grad_states,
            argnums=argnums,
            has_aux=has_aux,
            return_value=return_value,
            check_states=check_states,
            transform_kwargs={k: options[k] for k in transform_kwargs},
            name=getattr(fun, "__name__", name),
        )

    return transform


_jacrev = _jacobian(jax.jacrev, "jacrev", ("holomorphic", "allow_int"))
_jacfwd = _jacobian(jax.jacfwd, "jacfwd", ("holomorphic",))


def jacrev(
    fun: Callable[_P, Any] = MISSING,
    grad_states: Any = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    return_value: bool = False,
    *,
    holomorphic: bool = False,
    allow_int: bool = False,
    check_states: bool = True,
) -> Callable[_P, Any]:
    """Jacobian by reverse-mode autodiff (`jax.jacrev`), with respect to state
    values and arguments. Arguments and outputs are as for [`eqstate.transform.grad`][],
    with Jacobians in place of gradients, each laid out as `jax.jacrev` lays out the
    Jacobian with respect to those inputs: for an array output, `state_grads[s]` has
    the output's shape followed by the state's; for a PyTree output, the output's
    structure comes first (`jac["loss"][s]`), as in JAX.

    **Arguments:**

    - `fun`, `grad_states`, `argnums`, `has_aux`, `return_value`, `check_states`: as
        for [`eqstate.transform.grad`][]. If `fun` is omitted, this returns a
        decorator.
    - `holomorphic`, `allow_int`: as in `jax.jacrev`. (Keyword only arguments.)

    **Returns:**

    A function with the signature of `fun` returning the Jacobians, as
    [`eqstate.transform.grad`][] returns gradients.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.array([1.0, 2.0]))
        jac = es.transform.jacrev(lambda x: w.value * x, grad_states=[w])(jnp.ones(2))
        assert jac[w].shape == (2, 2)
        ```
    """
    return _jacrev(
        fun,
        grad_states,
        argnums,
        has_aux,
        return_value,
        holomorphic=holomorphic,
        allow_int=allow_int,
        check_states=check_states,
    )


def jacfwd(
    fun: Callable[_P, Any] = MISSING,
    grad_states: Any = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    return_value: bool = False,
    *,
    holomorphic: bool = False,
    check_states: bool = True,
) -> Callable[_P, Any]:
    """Jacobian by forward-mode autodiff (`jax.jacfwd`), with respect to state
    values and arguments. Arguments and outputs are as for
    [`eqstate.transform.jacrev`][].

    **Arguments:**

    - `fun`, `grad_states`, `argnums`, `has_aux`, `return_value`, `check_states`: as
        for [`eqstate.transform.grad`][]. If `fun` is omitted, this returns a
        decorator.
    - `holomorphic`: as in `jax.jacfwd`. (Keyword only argument.)

    **Returns:**

    A function with the signature of `fun` returning the Jacobians.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.array([1.0, 2.0]))
        jac = es.transform.jacfwd(lambda x: w.value * x, grad_states=[w])(jnp.ones(2))
        assert jac[w].shape == (2, 2)
        ```
    """
    return _jacfwd(
        fun,
        grad_states,
        argnums,
        has_aux,
        return_value,
        holomorphic=holomorphic,
        check_states=check_states,
    )


@decorator_form
def hessian(
    fun: Callable[_P, Any] = MISSING,
    grad_states: Any = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    *,
    holomorphic: bool = False,
    check_states: bool = True,
) -> Callable[_P, Any]:
    """Hessian of a scalar function with respect to state values and arguments:
    [`eqstate.transform.jacfwd`][] of [`eqstate.transform.jacrev`][], as in
    `jax.hessian`. Arguments are as for [`eqstate.transform.grad`][].

    **Returns:**

    For `grad_states` alone, a `StateDict` of `StateDict`s: `h[a][b]` is the block
    for states `a` and `b`, of shape `a.shape + b.shape`, as `jax.hessian` lays out
    blocks. For `argnums` alone, what `jax.hessian` returns. With both, the
    Jacobians (by `jacfwd`) of the pair `(state_grads, arg_grads)` with respect to
    the states and to the arguments: `(h_states, h_args)`, each with the pair's
    structure outermost. Followed by the auxiliary output if `has_aux`.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.array([1.0, 2.0]))
        h = es.transform.hessian(lambda: jnp.sum(w.value**3), grad_states=[w])()
        assert (h[w][w] == jnp.diag(6 * w.value)).all()
        ```
    """

    options = {"holomorphic": holomorphic, "check_states": check_states}
    inner = jacrev(fun, grad_states, argnums, has_aux, **options)
    return jacfwd(inner, grad_states, argnums, has_aux, **options)


def _in_structure_of(spec: Any, cotangents: StateDict) -> Any:
    """`cotangents` laid out as `spec` names the states: a handle's cotangent for a
    handle, a list for a list (a tuple, a dict of handles alike); the StateDict
    itself for a StateDict or a filter."""
    if is_state(spec) or (
        isinstance(spec, (list, tuple, dict))
        and all(map(is_state, jtu.tree_leaves(spec)))
    ):
        return jtu.tree_map(cotangents.__getitem__, spec)
    return cotangents


@overload
def vjp(
    fun: Callable[..., _T],
    *primals: Any,
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: Literal[False] = False,
    check_states: bool = True,
) -> tuple[_T, Callable[[Any], Any]]: ...
@overload
def vjp(
    fun: Callable[..., tuple[_T, _X]],
    *primals: Any,
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: Literal[True],
    check_states: bool = True,
) -> tuple[_T, Callable[[Any], Any], _X]: ...
def vjp(
    fun: Callable,
    *primals: Any,
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    check_states: bool = True,
) -> Any:
    """Like `jax.vjp`, also with respect to the values of `grad_states`. The states the
    function writes are written back at once.

    **Arguments:**

    - `fun`: the function.
    - `*primals`: its arguments.
    - `grad_states`: handles or a filter, as for [`eqstate.transform.grad`][]: a
        state's cotangent has `None` at the leaves of its value that are not
        floating-point; an integer or key state named explicitly gets a `float0`
        cotangent, as `jax.vjp` gives. (Keyword only argument.)
    - `argnums`: the primals to differentiate, as in brainstate's `vjp`: an integer
        (its cotangent comes alone) or a sequence (a tuple of them). By default every
        primal, as in `jax.vjp`. (Keyword only argument.)
    - `has_aux`: `fun` returns `(out, aux)`. (Keyword only argument.)
    - `check_states`: as for [`eqstate.transform.grad`][]. (Keyword only argument.)

    **Returns:**

    `(out, vjp_fn)`, or `(out, vjp_fn, aux)`. `vjp_fn(cotangent)` returns:

    - without `grad_states`: the primals' cotangents, a tuple (as `jax.vjp`), or
        as `argnums` asks;
    - with `grad_states`: `(state_cotangents, primal_cotangents)`, or
        `state_cotangents` alone when there are no primals and no `argnums`.

    `state_cotangents` has the structure of `grad_states`, as in brainstate: a
    handle's cotangent for a handle, a list for a list of handles (so
    `ct_w, ct_b = vjp_fn(1.0)` for `grad_states=[w, b]`), a StateDict for a filter
    or a StateDict.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.array(2.0))
        out, vjp_fn = es.transform.vjp(lambda x: w.value * x, 3.0, grad_states=w)
        w_ct, (x_ct,) = vjp_fn(1.0)
        assert out == 6.0 and w_ct == 3.0 and x_ct == 2.0
        ```
    """
    primals = copied_numpy(primals)
    name = getattr(fun, "__name__", "vjp")
    indices, single = _as_argnums(argnums)
    positions = range(len(primals))
    if argnums is not None:
        positions = _positions(indices, argnums, len(primals), {}, name)
    traced = Discovery(fun, primals, name=name)
    diff = _Differentiable(traced, grad_states, check_states, part=_inexact_or_whole)
    pure, parts = diff.pure({}, has_aux), [split_differentiable(p) for p in primals]

    def differentiated(grad_values, *differentiable):
        full = list(primals)
        for i, d in zip(positions, differentiable):
            full[i] = combine(d, parts[i][1])
        return pure(grad_values, *full)

    with EQUINOX_ERRORS, _WHILE_LOOP_HINT:
        out, vjp_fn, extras = jax.vjp(
            differentiated,
            diff.grad_values(),
            *(parts[i][0] for i in positions),
            has_aux=True,
        )
    aux = diff.finish(extras)

    def state_vjp(cotangent: Any) -> Any:
        with diff.rules_see(), EQUINOX_ERRORS, _WHILE_LOOP_HINT:
            state_cts, *arg_cts = vjp_fn(cotangent)
        args = arg_cts[0] if single else tuple(arg_cts)
        if grad_states is None:
            return args
        state_cts = _in_structure_of(grad_states, state_cts)
        return state_cts if argnums is None and not primals else (state_cts, args)

    return (out, state_vjp, aux) if has_aux else (out, state_vjp)


def _state_tangent(state: State, tangent: Any, primal: Any) -> Any:
    """`tangent` for a leaf of `state`'s value, as `jax.jvp` takes it: in the
    primal's dtype, or `float0` for an integer, boolean or key primal."""
    if jnp.issubdtype(primal.dtype, jnp.inexact):
        given = jnp.result_type(tangent)
        if jnp.issubdtype(given, jnp.complexfloating) and not jnp.issubdtype(
            primal.dtype, jnp.complexfloating
        ):
            raise TypeError(
                f"`state_tangents` gives {state_label(state)} a complex tangent "
                f"(dtype {given}) for a real value of dtype {primal.dtype}: casting "
                "it would drop its imaginary part. Pass a real tangent, or give the "
                "state a complex value."
            )
        return jnp.asarray(tangent, primal.dtype)
    if getattr(tangent, "dtype", None) == jax.dtypes.float0:
        return tangent
    raise TypeError(
        f"`state_tangents` gives {state_label(state)} a tangent of dtype "
        f"{jnp.result_type(tangent)} for a value of dtype {primal.dtype}. As "
        "`jax.jvp` requires, the tangent of an integer, boolean or key value has "
        "dtype `float0`: pass "
        f"`np.zeros({tuple(primal.shape)}, jax.dtypes.float0)`."
    )


@overload
def jvp(
    fun: Callable[..., _T],
    primals: Sequence[Any],
    tangents: Sequence[Any],
    *,
    state_tangents: StateDict | None = None,
    has_aux: Literal[False] = False,
    check_states: bool = True,
) -> tuple[_T, _T]: ...
@overload
def jvp(
    fun: Callable[..., tuple[_T, _X]],
    primals: Sequence[Any],
    tangents: Sequence[Any],
    *,
    state_tangents: StateDict | None = None,
    has_aux: Literal[True],
    check_states: bool = True,
) -> tuple[_T, _T, _X]: ...
def jvp(
    fun: Callable,
    primals: Sequence[Any],
    tangents: Sequence[Any],
    *,
    state_tangents: StateDict | None = None,
    has_aux: bool = False,
    check_states: bool = True,
) -> Any:
    """Like `jax.jvp`, also along tangents of state values. The states the function
    writes are written back.

    **Arguments:**

    - `fun`: the function.
    - `primals`, `tangents`: as in `jax.jvp`.
    - `state_tangents`: a [`eqstate.StateDict`][] of tangents for some of the states
        `fun` uses; the others have zero tangents. As in `jax.jvp`, the tangent of
        an integer, boolean or key leaf has dtype `float0`
        (`np.zeros(shape, jax.dtypes.float0)`). (Keyword only argument.)
    - `has_aux`: `fun` returns `(out, aux)`. (Keyword only argument.)
    - `check_states`: raise if `state_tangents` holds a state `fun` does not use;
        otherwise its tangent has no effect, as in `jax.jvp`. (Keyword only
        argument.)

    **Returns:**

    `(primal_out, tangent_out)`, or `(primal_out, tangent_out, aux)`.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.array(2.0))
        out, t = es.transform.jvp(
            lambda x: w.value * x, (3.0,), (0.0,),
            state_tangents=es.StateDict({w: 1.0}),
        )
        assert out == 6.0 and t == 3.0
        ```
    """
    name = getattr(fun, "__name__", "jvp")
    if len(tangents) != len(primals):
        raise TypeError(
            f"jvp of {name} was given {len(primals)} primals but {len(tangents)} "
            "tangents. Pass one tangent per primal, as to `jax.jvp`; tangents of "
            "states go in `state_tangents`."
        )
    primals = tuple(copied_numpy(tuple(primals)))
    traced = Discovery(fun, primals, name=name)
    tangents_sd = state_tangents if state_tangents is not None else StateDict()
    spec = tangents_sd if len(tangents_sd) else None
    diff = _Differentiable(
        traced, spec, check_states, part=_whole, argument="state_tangents"
    )
    grad_values = diff.grad_values()
    state_tangent_values = state_dict_of(
        {
            s: jtu.tree_map(ft.partial(_state_tangent, s), tangents_sd[s], v)
            for s, v in grad_values.items()
        }
    )
    pure, parts = diff.pure({}, has_aux), [split_differentiable(p) for p in primals]

    def differentiated(grad_values, *differentiable):
        full = [combine(d, rest) for d, (_, rest) in zip(differentiable, parts)]
        return pure(grad_values, *full)

    with EQUINOX_ERRORS:
        out, tangent_out, extras = jax.jvp(
            differentiated,
            (grad_values, *(d for d, _ in parts)),
            (
                state_tangent_values,
                *map(_tangent_like, range(len(primals)), tangents, primals),
            ),
            has_aux=True,
        )
    aux = diff.finish(extras)
    return (out, tangent_out, aux) if has_aux else (out, tangent_out)
