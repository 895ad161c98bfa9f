import typing
from typing import Any, Union

import eqstate as es
import jax.numpy as jnp
import pytest
from eqstate.filters import (
    AllOf,
    AnyOf,
    Everything,
    Is,
    Not,
    Nothing,
    OfType,
    to_predicate,
    WithName,
    WithTag,
)


@pytest.fixture
def states():
    return {
        "param": es.ParamState(jnp.zeros(1), tag="enc", name="w"),
        "short": es.ShortTermState(jnp.zeros(1), tag="dec"),
        "long": es.LongTermState(jnp.zeros(1)),
        "plain": es.State(jnp.zeros(1), name="p"),
    }


def _selected(filter, states):
    predicate = to_predicate(filter)
    return {k for k, s in states.items() if predicate((), s)}


def test_a_state_kind_selects_that_kind_and_subclasses(states):
    assert _selected(es.ParamState, states) == {"param"}
    assert _selected(es.LongTermState, states) == {"param", "long"}
    assert _selected(es.State, states) == set(states)


def test_a_handle_selects_itself(states):
    assert _selected(states["short"], states) == {"short"}


def test_a_string_selects_a_tag(states):
    assert _selected("enc", states) == {"param"}


def test_a_predicate_receives_path_and_state(states):
    seen = []

    def predicate(path, state):
        seen.append(path)
        return state.name == "p"

    assert _selected(predicate, states) == {"plain"}
    assert seen and all(p == () for p in seen)


@pytest.mark.parametrize("everything", [..., True, Everything()])
def test_ellipsis_and_true_select_everything(states, everything):
    assert _selected(everything, states) == set(states)


@pytest.mark.parametrize("nothing", [None, False, Nothing()])
def test_none_and_false_select_nothing(states, nothing):
    assert _selected(nothing, states) == set()


def test_tuples_and_lists_are_unions(states):
    assert _selected((es.ParamState, "dec"), states) == {"param", "short"}
    assert _selected([states["long"], "enc"], states) == {"param", "long"}


def test_combinators(states):
    assert _selected(AllOf(es.LongTermState, Not(es.ParamState)), states) == {"long"}
    assert _selected(AnyOf(WithTag("dec"), WithName("p")), states) == {"short", "plain"}
    assert _selected(OfType(es.ShortTermState), states) == {"short"}
    assert _selected(Is(states["param"]), states) == {"param"}


def test_filters_are_hashable_values():
    w = es.State(jnp.zeros(1))
    assert hash(OfType(es.ParamState)) == hash(OfType(es.ParamState))
    assert Is(w) == Is(w) and hash(Is(w)) == hash(Is(w))
    assert AnyOf("a", es.ParamState) == AnyOf("a", es.ParamState)


def test_a_type_that_is_not_a_state_kind_is_refused():
    with pytest.raises(TypeError, match="int is not a State kind"):
        to_predicate(int)


@pytest.mark.parametrize("bad", [3, 2.5, object(), {"a": 1}])
def test_a_value_that_is_not_a_filter_is_refused(bad):
    with pytest.raises(TypeError, match="is not a filter"):
        to_predicate(bad)


def test_an_exact_kind_filter_leaves_out_subclasses(states):
    assert _selected(OfType(es.LongTermState, exact=True), states) == {"long"}
    assert _selected(OfType(es.LongTermState), states) == {"param", "long"}
    assert _selected(OfType(es.State, exact=True), states) == {"plain"}
    assert OfType(es.State, exact=True) != OfType(es.State)


def test_a_subscripted_kind_selects_as_the_kind(states):
    assert _selected(es.ParamState[Any], states) == {"param"}
    assert _selected(es.LongTermState[Any], states) == {"param", "long"}
    w = states["param"]
    assert es.states_of(w, es.ParamState[Any]) == (w,)
    assert set(es.values_of(w).filter(es.ParamState[Any])) == {w}
    with pytest.raises(TypeError, match="list is not a State kind"):
        to_predicate(list[int])


def test_a_union_of_kinds_selects_any_of_them(states):
    assert _selected(es.ParamState | es.ShortTermState, states) == {"param", "short"}
    union = Union[es.ParamState, es.ShortTermState]  # noqa: UP007
    assert _selected(union, states) == {"param", "short"}
    with pytest.raises(TypeError, match="int is not a State kind"):
        to_predicate(es.ParamState | int)


@pytest.mark.parametrize(
    "bad",
    [lambda state: True, lambda: True, lambda path, state, extra: True],
    ids=["one argument", "no argument", "three arguments"],
)
def test_a_predicate_not_taking_path_and_state_is_refused_when_made(states, bad):
    with pytest.raises(TypeError, match=r"called as `filter\(path, state\)`"):
        to_predicate(bad)
    with pytest.raises(TypeError, match=r"called as `filter\(path, state\)`"):
        es.states_of(states["param"], bad)


def test_predicates_with_other_signatures_that_take_two_arguments_are_accepted(states):
    assert _selected(lambda *args: args[1].name == "w", states) == {"param"}
    assert _selected(lambda path, state, tag="enc": state.tag == tag, states) == {
        "param"
    }


def test_a_type_error_inside_a_predicate_is_not_hidden(states):
    def predicate(path, state):
        raise TypeError("my own mistake")

    with pytest.raises(TypeError, match=r"^my own mistake$"):
        _selected(predicate, states)


def test_of_type_takes_a_subscripted_kind_or_a_union(states):
    assert OfType(es.ParamState[Any]) == OfType(es.ParamState)
    assert _selected(OfType(es.ParamState[Any]), states) == {"param"}
    exact_long = OfType(es.LongTermState[Any], exact=True)
    assert _selected(exact_long, states) == {"long"}
    union = OfType(es.LongTermState | es.ShortTermState[Any], exact=True)
    assert _selected(union, states) == {"long", "short"}
    assert _selected(OfType(es.LongTermState | es.ShortTermState), states) == {
        "param",
        "long",
        "short",
    }


@pytest.mark.parametrize("bad", [int, "p", 3, list[int], es.ParamState | int])
def test_of_type_refuses_what_is_not_a_state_kind_when_made(bad):
    with pytest.raises(TypeError, match="is not a State kind"):
        OfType(bad)


class _NotRuntimeCheckable(typing.Protocol):
    def f(self) -> None: ...


@pytest.mark.parametrize("bad", [typing.Any, typing.Protocol, _NotRuntimeCheckable])
def test_of_type_refuses_a_typing_form_isinstance_cannot_check_when_made(bad):
    with pytest.raises(TypeError, match=r"is not a State kind.*isinstance"):
        OfType(bad)
    with pytest.raises(TypeError, match="is not a State kind"):
        OfType(es.ParamState | bad)


def test_of_type_takes_a_tuple_of_kinds_and_a_mixin_and_its_own_kind_back():
    class Trainable:
        pass

    class Special(es.ParamState, Trainable):
        pass

    states = {
        "param": es.ParamState(jnp.zeros(1)),
        "long": es.LongTermState(jnp.zeros(1)),
        "short": es.ShortTermState(jnp.zeros(1)),
        "special": Special(jnp.zeros(1)),
    }
    pair = OfType((es.ParamState, es.ShortTermState))
    assert _selected(pair, states) == {"param", "short", "special"}
    assert _selected(OfType(pair.kind, exact=True), states) == {"param", "short"}
    assert _selected(OfType(Trainable), states) == {"special"}
