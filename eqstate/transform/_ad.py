"""Autodiff: grad, value_and_grad, vector_grad, jacrev, jacfwd, hessian, vjp, jvp.

Each traces the function to find its states (a `_Call`), differentiates its pure
form with the JAX transform of the same name, with respect to the values of
`grad_states` and the arguments in `argnums`, and writes back the states the function
wrote. The edge cases are in `docs/faq.md`.
"""

import contextlib
import functools as ft
import operator
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, overload, ParamSpec, TypedDict, TypeVar, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .. import _context, _jax_compat as compat
from .._custom_types import Filter, MISSING, Missing
from .._pretty_print import first_and_more, state_label
from .._run import states_of
from .._state import draws_atomically, is_state, ParamState, State
from .._state_dict import state_dict_of, StateDict
from .._training import inexact_part
from ._common import as_arrays, copied_numpy, ErrorsRaisedAs, partition, select_states
from ._discovery import Discovery, kept_or_fresh, traces_for
from ._equinox_errors import EQUINOX_ERRORS
from ._leaves import dynamic_mask


compat.hide_from_tracebacks(__file__)


_P = ParamSpec("_P")
_T = TypeVar("_T")
_X = TypeVar("_X")


def _as_argnums(argnums: int | Sequence[int] | None) -> tuple[tuple[int, ...], bool]:
    """`(indices, single)`: `argnums` as a tuple, and whether it was one integer."""
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
    s = "s" if n_args > 1 else ""
    got = (
        f"only {n_args} positional argument{s}" if n_args else "no positional arguments"
    )
    hint = (
        f" Keyword arguments ({', '.join(sorted(kwargs))}) are not differentiated: "
        "pass the ones to differentiate positionally."
        if kwargs
        else ""
    )
    default = " (the default without `grad_states`)" if spec is None else ""
    # The error types of `jax.grad`: `TypeError` past the end, `ValueError` before.
    raise (ValueError if out_of_range[0] < 0 else TypeError)(
        f"Differentiating with respect to `argnums={0 if spec is None else spec}`"
        f"{default} needs argument {out_of_range[0]}, but {name} was called with "
        f"{got}.{hint} To differentiate with respect to states instead, pass "
        "`grad_states=...`."
    )


def split_differentiable(tree: Any, allow_int: bool = False) -> tuple[Any, Any]:
    """`(differentiable, rest)`, as `eqx.partition` splits `tree`: the leaves JAX
    differentiates (traced floating-point arrays and Python floats, and integers with
    `allow_int`), and every other leaf (handles, integer arrays, static fields). So
    a gradient has `None` where nothing is differentiated, as in Equinox."""
    leaves, treedef = jtu.tree_flatten(tree)
    kinds = (jnp.inexact, jnp.integer, jnp.bool_) if allow_int else (jnp.inexact,)
    chosen = [
        traced and any(jnp.issubdtype(jnp.result_type(x), k) for k in kinds)
        for x, traced in zip(leaves, dynamic_mask(tree))
    ]
    return eqx.partition(tree, jtu.tree_unflatten(treedef, chosen))


def _tangent_like(index: int, tangent: Any, primal: Any) -> Any:
    """The part of `tangent` for the differentiable part of `primal` (argument
    `index`) where it has `primal`'s structure (a model's handles in both); else
    `tangent`. As `jax.jvp`, refuses a tangent other than `float0` (or `None`, or a
    Python int that `eqx.combine` put back) for an integer, boolean or key leaf."""
    if jtu.tree_structure(tangent) != jtu.tree_structure(primal):
        return tangent
    chosen, _ = split_differentiable(primal)
    leaves = jtu.tree_leaves(tangent)
    flags = jtu.tree_leaves(chosen, is_leaf=lambda x: x is None)
    for t, (path, p), c in zip(leaves, jtu.tree_leaves_with_path(primal), flags):
        integer = isinstance(p, (bool, int, np.integer, np.bool_)) or (
            isinstance(p, (jax.Array, np.ndarray))
            and not jnp.issubdtype(p.dtype, jnp.inexact)
        )
        given = isinstance(t, (float, complex)) or (
            isinstance(t, (jax.Array, np.ndarray, np.generic))
            and t.dtype != jax.dtypes.float0
        )
        if c is None and integer and given:
            where = f"primals[{index}]{jtu.keystr(path)}"
            raise TypeError(
                f"jvp was given a tangent of dtype {jnp.result_type(t)} for "
                f"{where}, which has the integer, boolean or key dtype "
                f"{getattr(p, 'dtype', type(p).__name__)}: as in `jax.jvp`, such a "
                "primal has no tangent, and only a `float0` tangent (or `None`) is "
                f"taken for it. To differentiate along {where}, pass it as a "
                "floating-point value (e.g. `3.0`, or `x.astype(float)`)."
            )
    return jtu.tree_unflatten(
        jtu.tree_structure(primal),
        [t if c is not None else None for t, c in zip(leaves, flags)],
    )


def _state_tangent(state: State, tangent: Any, primal: Any) -> Any:
    """`tangent` for a leaf of `state`'s value, as `jax.jvp` takes it: in the
    primal's dtype, or `float0` for an integer, boolean or key primal."""
    if not jnp.issubdtype(primal.dtype, jnp.inexact):
        if getattr(tangent, "dtype", None) == jax.dtypes.float0:
            return tangent
        raise TypeError(
            f"`state_tangents` gives {state_label(state)} a tangent of dtype "
            f"{jnp.result_type(tangent)} for a value of dtype {primal.dtype}. As "
            "`jax.jvp` requires, the tangent of an integer, boolean or key value has "
            "dtype `float0`: pass "
            f"`np.zeros({tuple(primal.shape)}, jax.dtypes.float0)`."
        )
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


# --- What a differentiation leaves out: warnings naming it.


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

_PARAMS_UNDIFFERENTIATED = (
    "{name} uses {params}, held by the differentiated {where}, but no "
    "`grad_states` is given: as in `eqx.filter_grad`, a handle gets no gradient "
    "(`None`), and only the arrays are differentiated. To differentiate those "
    "states too, add `grad_states=eqstate.ParamState` (the gradients then come as "
    "`(state_grads, grads)`; see `eqstate.trainable`)."
)


def _warn_if_half_differentiated(call: "_Call", fun: Any, with_states: bool) -> bool:
    """Warns if the call differentiates some of a model's values but not others:
    the `ParamState`s held by the differentiated arguments without `grad_states`;
    with `grad_states`, the floating-point arrays of a model holding one of them, in
    an argument outside `argnums` or reached otherwise (closure, global, attribute)
    and become constants of the trace. Returns whether it warned."""
    traced, args, positions = call.traced, call.args, call.positions
    if not with_states:
        values = dict(zip(traced.states, traced.values))
        params = [
            s
            for s in call.held
            if isinstance(s, ParamState)
            and s in values
            and inexact_part(values[s]) is not None
        ]
        if params:
            where = "argument" if len(positions) == 1 else "arguments"
            where += f" ({', '.join(map(str, positions))})"
            params = first_and_more(map(state_label, params))
            message = _PARAMS_UNDIFFERENTIATED.format(
                name=traced.name, params=params, where=where
            )
            warnings.warn(message, stacklevel=3)
        return bool(params)
    states, consts = set(call.grad_states), {id(c) for c in traced.trace.jaxpr.consts}
    untrained: dict[int, str] = {}
    for i in (i for i in range(len(args)) if i not in positions):
        untrained.update(
            (k, f"args[{i}]{p}") for k, p in _arrays_beside(args[i], states, None)
        )
    for where, obj in _reached(fun):
        for k, path in _arrays_beside(obj, states, consts):
            untrained.setdefault(k, where + path)
    if untrained:
        arrays = first_and_more(f"`{p}`" for p in untrained.values())
        message = _ARRAYS_UNTRAINED.format(name=traced.name, arrays=arrays)
        warnings.warn(message, stacklevel=3)
    return bool(untrained)


# --- One call of a differentiated function.


def _split_aux(out: Any, name: str) -> tuple[Any, Any]:
    if isinstance(out, (tuple, list)) and len(out) == 2:
        return out[0], out[1]
    if isinstance(out, (tuple, list)):
        got = f"a {type(out).__name__} of length {len(out)}"
    elif hasattr(out, "shape"):
        got = f"an array of shape {tuple(out.shape)}"
    else:
        got = repr(out)
    raise TypeError(
        f"With `has_aux=True`, {name} must return a pair `(value, aux)`, but it "
        f"returned {got}. Return `(value, aux)`, or drop `has_aux`."
    )


# What an unused state named in each transform's argument would get, and the fix.
_UNUSED = {
    "grad_states": "its gradient would be zero. Remove it, or pass "
    "`check_states=False` to get zeros.",
    "state_tangents": "its tangent would have no effect. Remove it, or pass "
    "`check_states=False` to ignore it.",
}


def _inexact_or_whole(value: Any) -> Any:
    """The floating-point leaves of a state's value, as `grad` differentiates them;
    the whole value of a state holding none (an integer state named explicitly, whose
    cotangent is `float0`, as `jax.vjp` gives)."""
    part = inexact_part(value)
    return value if part is None else part


class _Call:
    """One call to differentiate: `fun` traced on `args`, the states `grad_states`
    picks and the arguments at `positions`, and `pure`, the function of their values
    that JAX differentiates.

    `grad_states` is matched against the states the function uses and those the
    differentiated arguments hold (which get zero gradients when unused); a filter
    selects only states holding floating-point values. `part` is the part of a
    state's value that is differentiated; `argument`, the user's name for
    `grad_states`, for messages.
    """

    def __init__(
        self,
        fun: Callable,
        args: tuple,
        kwargs: dict,
        positions: Sequence[int],
        grad_states: Any,
        check_states: bool,
        has_aux: bool,
        *,
        traces: Any = None,
        part: Callable[[Any], Any] = inexact_part,
        allow_int: bool = False,
        argument: str = "grad_states",
    ):
        name = getattr(fun, "__name__", "fun")
        self.traced = traced = Discovery(fun, args, kwargs, name=name, traces=traces)
        self.args, self.kwargs, self.positions = args, kwargs, tuple(positions)
        self.has_aux, self.part = has_aux, part
        self.index = {s: i for i, s in enumerate(traced.states)}
        self.held = states_of(tuple(args[i] for i in positions)) if positions else ()
        self.grad_states: tuple[State, ...] = ()
        if grad_states is not None:
            unused = [s for s in self.held if s not in self.index]
            candidates = [
                s
                for s in (*traced.states, *unused)
                if inexact_part(self._peek(s)) is not None
            ]
            states, explicit = select_states(grad_states, candidates)
            missing = [s for s in states if s not in self.index]
            if explicit and check_states and missing:
                raise ValueError(
                    f"`{argument}` holds {state_label(missing[0])}, which "
                    f"{traced.name} does not use, so {_UNUSED[argument]}"
                )
            self.grad_states = states
        self.parts = [split_differentiable(args[i], allow_int) for i in positions]

    def _peek(self, state: State) -> Any:
        i = self.index.get(state)
        return self.traced.frame.peek(state) if i is None else self.traced.values[i]

    def value(self, state: State) -> Any:
        """The whole value of one of `grad_states`."""
        i = self.index.get(state)
        return self.traced.frame.read(state) if i is None else self.traced.values[i]

    def inputs(self) -> tuple:
        """What `pure` is differentiated at: the states' values, then the arguments'
        differentiable parts."""
        values = state_dict_of({s: self.part(self.value(s)) for s in self.grad_states})
        return (values, *(d for d, _ in self.parts))

    def pure(self, grad_values: StateDict, *differentiated: Any) -> tuple:
        """`(out, (out, extras))`: the function's value, also as auxiliary output
        with what `finish` needs."""
        values = list(self.traced.values)
        for state, value in grad_values.items():
            if state in self.index:
                # The leaves left out of `value` (integers) keep their values.
                i = self.index[state]
                values[i] = eqx.combine(value, values[i])
        args = list(self.args)
        for i, d, (_, rest) in zip(self.positions, differentiated, self.parts):
            args[i] = eqx.combine(d, rest)
        # Python scalars in `aux` come back as they are, as from `jax.grad`.
        out, updates, new = self.traced.evaluate(
            values, tuple(args), self.kwargs, self.has_aux
        )
        main, aux = _split_aux(out, self.traced.name) if self.has_aux else (out, None)
        aux_leaves, self.rebuild_aux = partition(aux)
        self.written, self.new_states = list(updates), [s for s, _ in new]
        return main, (main, (aux_leaves, list(updates.values()), [v for _, v in new]))

    def finish(self, extras: tuple) -> Any:
        """Writes back the states and returns the auxiliary output."""
        aux_leaves, updated, new_values = extras
        # Eagerly, JAX returns a value passed through as it is (see `as_arrays`).
        updated, new_values = as_arrays(updated), as_arrays(new_values)
        self.traced.commit(
            dict(zip(self.written, updated)), list(zip(self.new_states, new_values))
        )
        return self.rebuild_aux(aux_leaves)

    def rules_see(self) -> Any:
        """A context in which the custom rules JAX runs in a backward pass (a
        `jax.custom_vjp`'s `bwd`) read the values the function was traced with."""
        trace = self.traced.trace
        return _context.rules_see(
            trace.read_only(self.traced.values), trace.rule_mapped
        )


# What JAX raises when reverse mode meets a `while_loop`.
_WHILE_LOOP_REFUSED = "Reverse-mode differentiation does not work for lax.while_loop"


def _hint_bounded_while_loop(exc: BaseException) -> None:
    if isinstance(exc, ValueError) and _WHILE_LOOP_REFUSED in str(exc):
        raise ValueError(
            f"{exc}\n\nFor `eqstate.transform.while_loop`, use "
            "`eqstate.transform.bounded_while_loop(cond_fun, body_fun, init, "
            "max_steps)`, which reverse-mode differentiation supports."
        ) from exc


_JAX_ERRORS = ErrorsRaisedAs(_hint_bounded_while_loop)

_NOTHING_TO_DIFFERENTIATE = (
    "`grad_states` selects none of the floating-point states that {name} uses, and "
    "no `argnums` is given, so nothing would be differentiated (the gradients would "
    "be empty, and an optimiser given them would train nothing). Check the filter "
    "(a tag or kind that the states have), name the states, or pass `argnums` for "
    "the arguments to differentiate."
)


def _vector_grad(fun: Callable, argnums: tuple[int, ...], has_aux: bool) -> Callable:
    """`jax.grad`'s convention for the vector-Jacobian product of `fun` (returning
    `(value, aux)`, and differentiated with respect to every argument) with a
    cotangent of ones (`float0` zeros for integer outputs)."""

    def ones(x: Any) -> Any:
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.ones_like(x)
        return np.zeros(x.shape, jax.dtypes.float0)

    def transformed(*args: Any) -> tuple:
        value, vjp_fn, aux = jax.vjp(fun, *args, has_aux=True)
        return vjp_fn(jtu.tree_map(ones, value)), aux

    return transformed


class _GradientTransform:
    """The function `grad`, `value_and_grad`, `vector_grad`, `jacrev` and `jacfwd`
    return: see `grad` for its outputs."""

    def __init__(
        self,
        fun: Callable,
        jax_transform: Callable,
        grad_states: Any,
        argnums: int | Sequence[int] | None,
        has_aux: bool,
        return_value: bool | str,
        check_states: bool,
        **options: bool,
    ):
        self.fun = fun
        self._jax_transform, self._options = jax_transform, options
        # A Jacobian comes as one entry per output leaf, each over every input.
        self._per_output = jax_transform in (jax.jacrev, jax.jacfwd)
        self._grad_states, self._check_states = grad_states, check_states
        self._argnums_spec = argnums  # The user's, for messages (None: 0).
        if argnums is None and grad_states is None:
            argnums = 0
        self._argnums, self._single = _as_argnums(argnums)
        self._has_aux, self._return_value = has_aux, return_value
        name = getattr(fun, "__name__", "fun")
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
        return self if instance is None else ft.partial(self, instance)

    @draws_atomically
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = copied_numpy((args, kwargs))
        name = self._traces.name
        positions = _positions(
            self._argnums, self._argnums_spec, len(args), kwargs, name
        )
        allow_int = self._options.get("allow_int", False)
        options = (self._grad_states, self._check_states, self._has_aux)
        call = _Call(
            self.fun,
            args,
            kwargs,
            positions,
            *options,
            traces=kept_or_fresh(self._traces),
            part=(lambda v: v) if allow_int else inexact_part,
            allow_int=allow_int,
        )
        if not self._warned:
            self._warned = _warn_if_half_differentiated(
                call, self.fun, self._grad_states is not None
            )
        if not allow_int:
            self._check_inexact(call)
        if self._grad_states is not None and not positions and not call.grad_states:
            raise ValueError(_NOTHING_TO_DIFFERENTIATE.format(name=name))
        inputs = call.inputs()
        with call.rules_see(), EQUINOX_ERRORS, _JAX_ERRORS:
            if jtu.tree_leaves(inputs):
                transform = self._jax_transform(
                    call.pure,
                    argnums=tuple(range(len(inputs))),
                    has_aux=True,
                    **self._options,
                )
                grads, (value, extras) = transform(*inputs)
            else:
                # Only integers (`None` derivatives, as `grad` gives): JAX's
                # Jacobians take no empty input, so every entry is made empty here.
                value, extras = call.pure(*inputs)[1]
                grads = inputs
                if self._per_output:
                    out_def = jtu.tree_structure(value)
                    grads = out_def.unflatten([inputs] * out_def.num_leaves)
        aux = call.finish(extras)
        return self._arrange(*self._split(grads, value), value, aux)

    def _split(self, grads: Any, value: Any) -> tuple[Any, Any]:
        """`(state part, argument part)` of the derivatives, each laid out as JAX
        lays out those with respect to those inputs alone: for a Jacobian, the
        output's structure outermost, and inside it the `StateDict`, or the one
        argument or the tuple of arguments."""
        if not self._per_output:
            return grads[0], grads[1] if self._single else grads[1:]
        out_def = jtu.tree_structure(value)
        per_leaf = out_def.flatten_up_to(grads)
        args = [e[1] if self._single else tuple(e[1:]) for e in per_leaf]
        return out_def.unflatten([e[0] for e in per_leaf]), out_def.unflatten(args)

    def _check_inexact(self, call: _Call) -> None:
        """JAX's `TypeError` for a state named in `grad_states` that holds only
        integers or keys, naming the state. (A filter selects floating-point states
        only.)"""
        for state in call.grad_states:
            value = call.value(state)
            if inexact_part(value) is None:
                hint = ", or pass `allow_int=True` for a `float0` gradient"
                raise TypeError(
                    f"`grad_states` names {state_label(state, value)}, but "
                    f"{self._traces.name} can be differentiated only with respect "
                    "to floating-point or complex values. Remove it from "
                    f"`grad_states`{hint if 'allow_int' in self._options else ''}."
                )

    def _arrange(self, state_grads: Any, grads: Any, value: Any, aux: Any) -> Any:
        """The result in the layout the options ask for (see `grad`)."""
        if self._grad_states is not None:
            grads = (state_grads, grads) if self._argnums else state_grads
        if self._return_value == "first":  # `value_and_grad`
            return ((value, aux) if self._has_aux else value), grads
        extra = (value,) * bool(self._return_value) + (aux,) * self._has_aux
        return (grads, *extra) if extra else grads


class _Options(TypedDict, total=False):
    holomorphic: bool
    allow_int: bool
    check_states: bool


# The overloads of `grad` and `value_and_grad` type the layouts of the gradients (see
# `grad`'s Returns) with `grad_states` and `argnums` of 0 or none; other calls (and
# the decorator form) return `Any`. The arrays' gradients are `Any`: a model's type would be exact, but optax's
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
    fun: Callable[_P, Any] | Missing = MISSING,
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    return_value: bool = False,
    **options: Unpack[_Options],
) -> Callable[_P, Any]: ...
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

    The function is traced to find its states, and its pure form is differentiated
    by `jax.grad` with respect to the values of `grad_states` and the arguments in
    `argnums`. States the function writes (running statistics, counters) are written
    back. To train a model, pass it in and differentiate both its arrays and its
    parameters: `grad(loss, argnums=0, grad_states=eqstate.ParamState)(model, ...)`
    gives gradients shaped like [`eqstate.trainable`][]`(model)`. The rules for
    filters, integer leaves, unused and foreign states are in the FAQ.

    **Arguments:**

    - `fun`: a function returning a scalar (or `(scalar, aux)` with `has_aux`). If
        omitted, `grad` returns a decorator.
    - `grad_states`: the states to differentiate with respect to: handles (a handle,
        a sequence, or a [`eqstate.StateDict`][] whose keys are used), or a filter
        (e.g. `eqstate.ParamState`), which selects the floating-point states the
        function uses and those the arguments in `argnums` hold.
    - `argnums`: the positional arguments to differentiate with respect to. Defaults
        to `0` without `grad_states`, to none with them. Their floating-point
        leaves are differentiated, Python floats included, as by `jax.grad`
        (`grad(lambda x: x**2)(3.0)` is `6.0`; `eqx.filter_grad` gives `None`);
        their other leaves get `None`, as in `eqx.filter_grad`.
    - `has_aux`: `fun` returns `(value, aux)`.
    - `return_value`: also return the function's value.
    - `holomorphic`, `allow_int`: as in `jax.grad`. (Keyword only arguments.)
    - `check_states`: raise if a handle in `grad_states` is not used by `fun`;
        otherwise its gradient is zero. (Keyword only argument.)

    **Returns:**

    A function with `fun`'s arguments returning, with `state_grads` a `StateDict`
    keyed by the handles:

    - without `grad_states`: `arg_grads`;
    - with `grad_states` and no `argnums`: `state_grads`;
    - with both: `(state_grads, arg_grads)`;

    followed by the value if `return_value` (`(grads, value)`), and by the
    auxiliary output if `has_aux` (`(grads, aux)`, or `(grads, value, aux)`).

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
    options = {"holomorphic": holomorphic, "allow_int": allow_int}
    return _GradientTransform.or_decorator(
        fun,
        jax.grad,
        grad_states,
        argnums,
        has_aux,
        return_value,
        check_states,
        **options,
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
    fun: Callable[_P, Any] | Missing = MISSING,
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    **options: Unpack[_Options],
) -> Callable[_P, Any]: ...
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
    options = {"holomorphic": holomorphic, "allow_int": allow_int}
    return _GradientTransform.or_decorator(
        fun, jax.grad, grad_states, argnums, has_aux, "first", check_states, **options
    )


def vector_grad(
    fun: Callable[_P, Any] = MISSING,
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    return_value: bool = False,
    *,
    check_states: bool = True,
) -> Callable[_P, Any]:
    """Gradient of a vector-valued function: the vector-Jacobian product with a
    cotangent of ones (the gradient of the sum of its outputs), in one reverse pass.
    For an elementwise function (a neuron model's update, a surrogate spike
    function) it is the elementwise derivative. Arguments and outputs are as for
    [`eqstate.transform.grad`][]; the value returned with `return_value` is the
    vector output.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.array([1.0, 2.0]))
        x = jnp.array([3.0, 4.0])
        grads = es.transform.vector_grad(lambda: w.value * x**2, grad_states=[w])()
        assert (grads[w] == x**2).all()
        ```
    """
    return _GradientTransform.or_decorator(
        fun, _vector_grad, grad_states, argnums, has_aux, return_value, check_states
    )


def jacrev(
    fun: Callable[_P, Any] = MISSING,
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    return_value: bool = False,
    *,
    holomorphic: bool = False,
    allow_int: bool = False,
    check_states: bool = True,
) -> Callable[_P, Any]:
    """Jacobian by reverse-mode autodiff (`jax.jacrev`), with respect to state
    values and arguments. Arguments and outputs are as for
    [`eqstate.transform.grad`][], with Jacobians in place of gradients, each laid
    out as `jax.jacrev` lays it out: `jac[s]` has the output's shape followed by the
    state's (for a PyTree output, the output's structure comes first:
    `jac["loss"][s]`). `holomorphic` and `allow_int` are as in `jax.jacrev`.

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.array([1.0, 2.0]))
        jac = es.transform.jacrev(lambda x: w.value * x, grad_states=[w])(jnp.ones(2))
        assert jac[w].shape == (2, 2)
        ```
    """
    options = {"holomorphic": holomorphic, "allow_int": allow_int}
    return _GradientTransform.or_decorator(
        fun,
        jax.jacrev,
        grad_states,
        argnums,
        has_aux,
        return_value,
        check_states,
        **options,
    )


def jacfwd(
    fun: Callable[_P, Any] = MISSING,
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    return_value: bool = False,
    *,
    holomorphic: bool = False,
    check_states: bool = True,
) -> Callable[_P, Any]:
    """Jacobian by forward-mode autodiff (`jax.jacfwd`), with respect to state
    values and arguments, laid out as by [`eqstate.transform.jacrev`][].

    !!! Example

        ```python
        import eqstate as es
        import jax.numpy as jnp

        w = es.ParamState(jnp.array([1.0, 2.0]))
        jac = es.transform.jacfwd(lambda x: w.value * x, grad_states=[w])(jnp.ones(2))
        assert jac[w].shape == (2, 2)
        ```
    """
    return _GradientTransform.or_decorator(
        fun,
        jax.jacfwd,
        grad_states,
        argnums,
        has_aux,
        return_value,
        check_states,
        holomorphic=holomorphic,
    )


def hessian(
    fun: Callable[_P, Any] = MISSING,
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    *,
    holomorphic: bool = False,
    check_states: bool = True,
) -> Callable[_P, Any]:
    """Hessian of a scalar function: [`eqstate.transform.jacfwd`][] of
    [`eqstate.transform.jacrev`][], as in `jax.hessian`. For `grad_states` alone, a
    `StateDict` of `StateDict`s: `h[a][b]` is the block for states `a` and `b`, of
    shape `a.shape + b.shape`.

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
    if fun is MISSING:
        given = {"grad_states": grad_states, "argnums": argnums, "has_aux": has_aux}
        return ft.partial(hessian, **given, **options)
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
@draws_atomically
def vjp(
    fun: Callable,
    *primals: Any,
    grad_states: Filter = None,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    check_states: bool = True,
) -> Any:
    """Like `jax.vjp`, also with respect to the values of `grad_states`; the states
    the function writes are written back at once. `grad_states` and `check_states`
    are as for [`eqstate.transform.grad`][]; `argnums` picks the primals as in
    brainstate's `vjp` (an integer: its cotangent alone; by default every primal,
    as in `jax.vjp`).

    **Returns:**

    `(out, vjp_fn)`, or `(out, vjp_fn, aux)` with `has_aux`. `vjp_fn(cotangent)`
    returns the primals' cotangents (a tuple, or as `argnums` asks), preceded by the
    states' cotangents if `grad_states` is given: `(state_cotangents,
    primal_cotangents)`, or `state_cotangents` alone for a call without primals or
    `argnums`. `state_cotangents` has the structure of `grad_states`, as in
    brainstate: `ct_w, ct_b = vjp_fn(1.0)` for `grad_states=[w, b]`; a StateDict for
    a filter or a StateDict.

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
    indices, single = _as_argnums(argnums)
    positions = range(len(primals))
    if argnums is not None:
        name = getattr(fun, "__name__", "fun")
        positions = _positions(indices, argnums, len(primals), {}, name)
    options = (grad_states, check_states, has_aux)
    call = _Call(fun, primals, {}, positions, *options, part=_inexact_or_whole)
    with EQUINOX_ERRORS, _JAX_ERRORS:
        out, vjp_fn, (_, extras) = jax.vjp(call.pure, *call.inputs(), has_aux=True)
    aux = call.finish(extras)

    def state_vjp(cotangent: Any) -> Any:
        with call.rules_see(), EQUINOX_ERRORS, _JAX_ERRORS:
            state_cts, *arg_cts = vjp_fn(cotangent)
        args = arg_cts[0] if single else tuple(arg_cts)
        if grad_states is None:
            return args
        state_cts = _in_structure_of(grad_states, state_cts)
        return state_cts if argnums is None and not primals else (state_cts, args)

    return (out, state_vjp, aux) if has_aux else (out, state_vjp)


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
@draws_atomically
def jvp(
    fun: Callable,
    primals: Sequence[Any],
    tangents: Sequence[Any],
    *,
    state_tangents: StateDict | None = None,
    has_aux: bool = False,
    check_states: bool = True,
) -> Any:
    """Like `jax.jvp`, also along tangents of state values; the states the function
    writes are written back. `state_tangents` is a [`eqstate.StateDict`][] of
    tangents for some of the states `fun` uses (the others have zero tangents; an
    integer, boolean or key leaf takes a `float0` one, as in `jax.jvp`);
    `check_states` refuses one that `fun` does not use.

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
    if len(tangents) != len(primals):
        raise TypeError(
            f"jvp of {getattr(fun, '__name__', 'fun')} was given {len(primals)} "
            f"primals but {len(tangents)} tangents. Pass one tangent per primal, as "
            "to `jax.jvp`; tangents of states go in `state_tangents`."
        )
    primals = tuple(copied_numpy(tuple(primals)))
    given = state_tangents if state_tangents is not None else StateDict()
    options = (given if len(given) else None, check_states, has_aux)
    call = _Call(
        fun,
        primals,
        {},
        range(len(primals)),
        *options,
        part=lambda v: v,
        argument="state_tangents",
    )
    values, *differentiable = call.inputs()
    state_tangent_values = state_dict_of(
        {
            s: jtu.tree_map(ft.partial(_state_tangent, s), given[s], v)
            for s, v in values.items()
        }
    )
    arg_tangents = map(_tangent_like, range(len(primals)), tangents, primals)
    with EQUINOX_ERRORS:
        out, tangent_out, (_, extras) = jax.jvp(
            call.pure,
            (values, *differentiable),
            (state_tangent_values, *arg_tangents),
            has_aux=True,
        )
    aux = call.finish(extras)
    return (out, tangent_out, aux) if has_aux else (out, tangent_out)
