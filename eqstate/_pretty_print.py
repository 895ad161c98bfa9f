"""Helpers every `repr` and error message uses to describe arrays and states."""

import collections
from collections.abc import Iterable
from typing import Any

import jax
import jax.tree_util as jtu
import wadler_lindig as wl

from ._custom_types import MISSING
from ._shapes import is_key


_LIST_LIMIT = 5
_DTYPE_ABBREVIATIONS = {
    "float": "f",
    "bfloat": "bf",
    "int": "i",
    "uint": "u",
    "complex": "c",
    "bool": "bool",
}


def dtype_summary(dtype: Any) -> str:
    """`float32` -> `f32`, `bfloat16` -> `bf16`, `key<fry>` -> `key<fry>`."""
    name = str(dtype)
    for long, short in _DTYPE_ABBREVIATIONS.items():
        if name.startswith(long) and name[len(long) :].isdigit():
            return short + name[len(long) :]
    return name


def shape_summary(shape: tuple, dtype: Any) -> str:
    """`f32[3,4]` for shape `(3, 4)` and dtype `float32`."""
    return f"{dtype_summary(dtype)}[{','.join(map(str, shape))}]"


def array_summary(x: Any) -> str:
    """`f32[3,4]` for an array or tracer, `repr(x)` for anything else."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return repr(x)
    if isinstance(x, jax.Array) and _deleted(x):
        # Donated: printing it must not fail, and should say why reading it will.
        return f"{shape_summary(shape, dtype)} (deleted)"
    if isinstance(x, jax.Array) and is_key(x):
        return f"key<{jax.random.key_impl(x)}>[{','.join(map(str, shape))}]"
    return shape_summary(shape, dtype)


def _deleted(x: jax.Array) -> bool:
    try:
        return x.is_deleted()
    except Exception:  # a tracer has no buffer to ask about
        return False


def value_summary(value: Any) -> str:
    """A one-line summary of a PyTree of arrays: `f32[3]` or `{'a': f32[3], ...}`."""
    leaves, treedef = jtu.tree_flatten(value)
    if treedef.num_leaves == 1 and treedef.num_nodes == 1:
        return array_summary(leaves[0])
    summaries = [array_summary(x) for x in leaves]
    try:
        return str(jtu.tree_unflatten(treedef, list(map(_Summary, summaries))))
    except Exception:  # A user's node that checks its fields, or prints them, may
        # refuse the summaries: list them flat, after the name of its type.
        return f"{type(value).__name__}({', '.join(summaries)})"


class _Summary:
    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def handle_number(state: Any) -> str:
    """`#N`: `N` handles were made in this process before `state`. Unlike its
    address, this is the same in every process of a multi-process program that
    makes the same handles in the same order (see `numberless_label` for the text
    that enters compiled programs)."""
    return f"#{state._order[-1]}"


def state_label(state: Any, value: Any = MISSING) -> str:
    """Names a state in messages: `ParamState 'w'`, or `ParamState 'w' (f32[3])` when its
    value is known. Unnamed states show their tag, or their identity."""
    label = numberless_label(state)
    if getattr(state, "name", None) is None and getattr(state, "tag", None) is None:
        label += f" {handle_number(state)}"
    if value is not MISSING:
        label += f" ({value_summary(value)})"
    return label


def numberless_label(state: Any) -> str:
    """`ParamState 'w'`, `ParamState tagged 't'` or `unnamed ParamState`: a handle's
    text in the key paths of a `StateDict`, which enter the argument and result names
    of compiled programs. Without the handle's number, it is the same in every process
    of a multi-process program, even one that makes more handles than the others (to
    log, say): processes whose programs differ deadlock in their first collective
    (JAX 0.12.1)."""
    kind = type(state).__name__
    name = getattr(state, "name", None)
    tag = getattr(state, "tag", None)
    if name is not None:
        return f"{kind} {name!r}"
    if tag is not None:
        return f"{kind} tagged {tag!r}"
    return f"unnamed {kind}"


def state_doc(
    state: Any, value: Any = MISSING, *, show_id: bool = False, **kwargs: Any
) -> wl.AbstractDoc:
    """The pretty-doc of a handle, in Equinox's style: `ParamState(name='w',
    value=f32[3])`. Unnamed, untagged handles show their identity, as do all with
    `show_id`."""
    name = getattr(state, "name", None)
    tag = getattr(state, "tag", None)
    pairs: list[tuple[str, Any]] = []
    if name is not None:
        pairs.append(("name", name))
    if tag is not None:
        pairs.append(("tag", tag))
    if show_id or (name is None and tag is None):
        pairs.append(("id", _Summary(handle_number(state))))
    if value is not MISSING:
        pairs.append(("value", _Summary(value_summary(value))))
    return wl.bracketed(
        begin=wl.TextDoc(f"{type(state).__name__}("),
        docs=wl.named_objs(pairs, **kwargs),
        sep=wl.comma,
        end=wl.TextDoc(")"),
        indent=kwargs.get("indent", 2),
    )


def state_text_with_number(state: Any) -> str:
    """`ParamState(name='w', id=#3)`: a handle's kind, name, tag and number."""
    return wl.pformat(state_doc(state, show_id=True))


def state_dict_doc(items: Any, **kwargs: Any) -> wl.AbstractDoc:
    """The pretty-doc of a StateDict, laid out like a dict: handles (without their
    values) to value summaries. Handles that would print alike (the same layer of two
    models) show their identity."""
    summaries = {
        state: _Summary(
            "<not visible here>" if value is MISSING else value_summary(value)
        )
        for state, value in items
    }
    looks = collections.Counter(map(_look, summaries))
    shown = {id(s) for s in summaries if looks[_look(s)] > 1}
    kwargs = {**kwargs, "eqstate_hide_values": True, "eqstate_show_ids": shown}
    return wl.ConcatDoc(
        wl.TextDoc("StateDict("), wl.pdoc(summaries, **kwargs), wl.TextDoc(")")
    )


def _look(state: Any) -> tuple:
    """What `state_doc` prints of `state` (without its value)."""
    return type(state), getattr(state, "name", None), getattr(state, "tag", None)


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table with aligned columns."""
    widths = [
        max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))
    ]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def state_name(state: Any) -> str:
    """A state's name; its tag in brackets, or its identity, if it has none."""
    name = getattr(state, "name", None)
    if name is not None:
        return name
    tag = getattr(state, "tag", None)
    return f"[{tag}]" if tag is not None else f"<{handle_number(state)}>"


def first_and_more(
    texts: Iterable[str],
    limit: int = _LIST_LIMIT,
    *,
    sep: str = ", ",
    more: str = " and {} more",
) -> str:
    """The first `limit` of `texts` joined by `sep`, then `more` with the number left
    out (only if some are): `a, b, c and 2 more`.

    **Arguments:**

    - `texts`: the items to list, already formatted.
    - `limit`: how many to show.
    - `sep`: what goes between two shown items. (Keyword only argument.)
    - `more`: what follows the shown items when some are left out; `{}` is replaced
        by their number. (Keyword only argument.)

    **Returns:**

    The list as one string; `""` if `texts` is empty.
    """
    texts = list(texts)
    left_out = len(texts) - limit
    return sep.join(texts[:limit]) + (more.format(left_out) if left_out > 0 else "")
