import dataclasses
import re
import subprocess
import sys

import eqstate as es
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest


def test_handle_repr_shows_kind_name_tag_and_value_summary():
    w = es.ParamState(jnp.zeros((2, 3)), name="w")
    assert repr(w) == "ParamState(name='w', value=f32[2,3])"
    t = es.ShortTermState(jnp.zeros(()), tag="hidden")
    assert repr(t) == "ShortTermState(tag='hidden', value=f32[])"
    both = es.State(jnp.zeros(2, jnp.int8), name="n", tag="t")
    assert repr(both) == "State(name='n', tag='t', value=i8[2])"
    anonymous = es.State(jnp.zeros(()))
    other = es.State(jnp.zeros(()))
    assert re.fullmatch(r"State\(id=#\d+, value=f32\[\]\)", repr(anonymous))
    assert repr(other) != repr(anonymous)


# The text of a handle enters the argument names of a compiled program (a StateDict
# keyed by handles is an argument, an optimiser's state holds one), and the processes
# of a multi-process job must compile the very same program: with JAX 0.12.1, one
# that differs (in its argument names too) deadlocks in its first collective. So a
# handle prints the same in every process that makes the same handles, not by its
# address, which differs between processes.
_SAME_HANDLES = """
import eqstate as es, jax, jax.numpy as jnp
a = es.ParamState(jnp.zeros(3))
b, c = (es.ParamState(jnp.zeros(3), name="w") for _ in range(2))
sd = es.StateDict({a: jnp.ones(3), b: jnp.ones(3), c: jnp.ones(3)})
print(repr(a), repr(sd), jax.tree_util.tree_structure(sd))
try:
    sd[es.ParamState(jnp.zeros(3), name="w")]
except KeyError as error:
    print(error)
step = lambda opt: jax.tree.map(lambda v: v + a.value, opt)
print(es.transform.jit(step).lower(sd).compile().as_text())
print(jax.jit(lambda opt: opt).lower(sd).compile().as_text())
"""


def test_handles_print_alike_in_processes_that_make_them_alike():
    runs = [
        subprocess.run(
            [sys.executable, "-c", _SAME_HANDLES],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert "ParamState(id=#" in runs[0] and "ParamState 'w' #" in runs[0]


def test_handle_repr_summarises_pytrees_keys_and_large_arrays():
    opt = es.State({"mu": jnp.zeros(3), "count": jnp.array(0)}, name="opt")
    assert repr(opt) == "State(name='opt', value={'count': i32[], 'mu': f32[3]})"
    big = es.State(jnp.zeros((1000, 1000)), name="big")
    assert repr(big) == "State(name='big', value=f32[1000,1000])"
    assert "key<" in repr(es.RandomState(0, name="rng"))


def test_a_handle_without_a_value_here_prints_without_one():
    with es.scope(es.StateDict()):
        inner = es.State(jnp.zeros(2), name="inner")
    assert repr(inner) == "State(name='inner')"


def test_repr_inside_a_trace_shows_the_traced_value():
    s = es.State(jnp.zeros(3), name="s")
    seen = []
    es.transform.jit(lambda: seen.append(repr(s)))()
    assert seen == ["State(name='s', value=f32[3])"]


def test_state_dict_repr():
    w = es.ParamState(jnp.zeros(3), name="w")
    n = es.ShortTermState(jnp.array(0), name="n")
    sd = es.StateDict({w: jnp.ones(3), n: jnp.array(5)})
    assert (
        repr(sd)
        == "StateDict({ParamState(name='w'): f32[3], ShortTermState(name='n'): i32[]})"
    )
    assert repr(es.StateDict()) == "StateDict({})"
    many = es.StateDict(
        {es.State(jnp.zeros(i), name=f"s{i}"): jnp.zeros(i) for i in range(6)}
    )
    text = repr(many)
    assert text.startswith("StateDict({\n") and text.endswith("\n})")
    assert all(len(line) <= 88 for line in text.splitlines())


def test_a_state_dict_repr_tells_same_named_handles_apart():
    a, b = (es.ParamState(jnp.zeros(3), name="w") for _ in range(2))
    n = es.ParamState(jnp.zeros(()), name="n")
    text = repr(es.StateDict({a: jnp.ones(3), b: jnp.ones(3), n: 1.0}))
    ids = re.findall(r"ParamState\(name='w', id=(#\d+)\): f32\[3\]", text)
    assert len(set(ids)) == 2
    assert "ParamState(name='n'): f32[]" in text  # no clash: no number


class _Layer(eqx.Module):
    weight: es.ParamState
    calls: es.ShortTermState


def test_equinox_pretty_printer_shows_handles_in_modules():
    layer = _Layer(
        es.ParamState(jnp.zeros((4, 2)), name="weight"),
        es.ShortTermState(0, name="calls"),
    )
    assert eqx.tree_pformat(layer) == (
        "_Layer(\n"
        "  weight=ParamState(name='weight', value=f32[4,2]),\n"
        "  calls=ShortTermState(name='calls', value=i32[])\n"
        ")"
    )


def test_describe_tables_reads_writes_and_new_states():
    w = es.ParamState(jnp.ones((2, 3)), name="w")
    steps = es.ShortTermState(jnp.array(0), name="steps")
    opt = es.State({"mu": jnp.zeros(3)}, name="opt")
    sink = es.State(jnp.zeros(3), name="sink")

    def f(x):
        steps.value = steps.value + 1
        opt.value = {"mu": opt.value["mu"] * 0.9 + x}
        sink.value = x
        es.LongTermState(jnp.zeros(4, jnp.int32), name="created")
        return w.value @ x

    text = es.transform.StatefulFunction(f).describe(jnp.ones(3))
    assert text == (
        "f: reads 1, writes 3, creates 1 state(s)\n"
        "kind            name       shape   dtype    access\n"
        "--------------  ---------  ------  -------  ----------\n"
        "ShortTermState  steps      ()      int32    read+write\n"
        "State           opt['mu']  (3,)    float32  read+write\n"
        "State           sink       (3,)    float32  write\n"
        "ParamState      w          (2, 3)  float32  read\n"
        "LongTermState   created    (4,)    int32    new"
    )
    assert steps.value == 0


def test_describe_says_write_for_a_state_read_only_after_the_function_wrote_it():
    s = es.State(jnp.zeros(2), name="s")

    def f(x):
        s.value = x
        return s.value * 2  # the function's own value, not the state's incoming one

    sf = es.transform.StatefulFunction(f)
    assert sf.describe(jnp.ones(2)).splitlines()[-1].split()[-1] == "write"
    assert sf.get_read_states() == () and sf.get_write_states() == (s,)


def test_describe_of_a_function_without_states():
    text = es.transform.StatefulFunction(lambda x: x * 2, name="double").describe(1.0)
    assert text.splitlines()[0] == "double: reads 0, writes 0, creates 0 state(s)"
    assert jax.numpy.shape(1.0) == ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Gaussian:
    mean: jax.Array
    std: jax.Array

    def __post_init__(self):  # A check that summaries of the leaves do not pass.
        if not hasattr(self.std, "shape"):
            raise TypeError("std must be an array")


def test_a_value_whose_node_refuses_summaries_prints_its_leaves_flat():
    g = es.State(_Gaussian(jnp.zeros(2), jnp.ones(2)), name="posterior")
    assert repr(g) == "State(name='posterior', value=_Gaussian(f32[2], f32[2]))"
    assert "_Gaussian(f32[2], f32[2])" in repr(es.values_of(g))
    with pytest.raises(AttributeError, match="Cannot set `foo` on State 'posterior'"):
        g.foo = 1  # pyright: ignore[reportAttributeAccessIssue]


def test_a_deleted_value_prints_as_deleted():
    # Donated to another computation: reading it will fail, and printing says why.
    w = es.State(jnp.ones(3), name="w")
    w.value.delete()
    assert repr(w) == "State(name='w', value=f32[3] (deleted))"
    assert "f32[3] (deleted)" in repr(es.values_of(w))
    w.value = jnp.zeros(3)
    assert repr(w) == "State(name='w', value=f32[3])"
