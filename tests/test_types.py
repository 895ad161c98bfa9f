"""What optax and Equinox return goes into eqstate's APIs without casts.

This file is also type-checked by pyright (it is in `[tool.pyright] include`), so each
test is a check at run time (the values are what the APIs want) and at type-checking
time (the idioms need no `cast`)."""

import functools as ft
import json
import pathlib
import subprocess
import sys
import tempfile
import typing
from typing import Any, assert_type

import eqstate as es
import eqstate.nn as enn
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

from .check_docs_types import _modules


@pytest.mark.numpy_promotion("optax.adam: a Python float to an int32 power")
def test_optax_updates_are_state_dicts_that_assign_run_and_merge_take():
    bn = enn.BatchNorm(3)
    x = jnp.arange(12.0).reshape(4, 3) ** 2
    optimiser = optax.adam(1e-2)
    params, rest = es.values_of(bn).split(es.ParamState)
    opt_state = optimiser.init(params)
    grads = es.transform.grad(lambda x: bn(x)[:, 0].sum(), grad_states=es.ParamState)(x)
    updates, opt_state = optimiser.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    assert isinstance(new_params, es.StateDict)  # declared as a PyTree by optax

    es.assign(new_params)
    for merged in (
        new_params | rest,
        rest | new_params,
        es.StateDict.merge(new_params, rest),
        es.StateDict(new_params).update(rest),
    ):
        states, y = es.run(bn, merged, x)
        assert isinstance(states, es.StateDict) and y.shape == (4, 3)


def test_what_optax_returns_goes_straight_into_run_and_scope():
    w = es.ParamState(jnp.ones(3), name="w")
    params = es.values_of(w)
    optimiser = optax.sgd(0.5)
    updates, _ = optimiser.update(params, optimiser.init(params), params)

    def step() -> es.StateDict:
        return es.StateDict(optax.apply_updates(params, updates))

    _, total = es.run(lambda: w.value.sum(), optax.apply_updates(params, updates))
    with es.scope(optax.apply_updates(params, updates)):
        assert (w.value == 0.5).all()
    assert total == 1.5 and (step()[w] == 0.5).all()
    with pytest.raises(TypeError, match="takes a StateDict, got dict"):
        es.run(lambda: None, {w: jnp.ones(3)})


def test_equinox_gradients_of_a_state_dict_go_back_into_run():
    bn, states = es.make_with_states(enn.BatchNorm)(3)
    params, rest = states.split(es.ParamState)
    x = jnp.arange(12.0).reshape(4, 3) ** 2

    @eqx.filter_grad
    def grads_of(params: es.StateDict) -> jax.Array:
        return jnp.sum((es.run(bn, params | rest, x)[1] - 1.0) ** 2)

    grads = grads_of(params)
    stepped = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    new_states, _ = es.run(bn, stepped | rest, x)
    assert all(not (new_states[s] == states[s]).all() for s in params)


def test_states_of_is_typed_by_with_paths():
    bn = enn.BatchNorm(3)
    names = [state.name for state in es.states_of(bn)]
    paths = [
        jax.tree_util.keystr(path) for path, _ in es.states_of(bn, with_paths=True)
    ]
    assert names == ["running_mean", "running_var", "weight", "bias"]
    assert paths == [".running_mean", ".running_var", ".weight", ".bias"]


def test_scope_states_and_jaxpr_call_return_state_dicts():
    w = es.ParamState(jnp.ones(2), name="w")
    with es.scope(es.values_of(w)) as sc:
        w.value = w.value * 2
    assert (sc.states[w] == 2).all()
    sf = es.transform.StatefulFunction(lambda: w.value.sum())
    states, out = sf.jaxpr_call(sc.states)
    assert states[w].shape == (2,) and out == 4


def test_an_abstract_state_dict_takes_a_shape_dtype_struct_as_a_value():
    w = es.ParamState(jnp.ones(2), name="w")
    abstract = es.transform.eval_shape(lambda: es.values_of(w))
    struct = jax.ShapeDtypeStruct((2,), jnp.float32)
    for written in (abstract.set(w, struct), abstract.update({w: struct})):
        assert written[w] == struct


class _Scaled(eqx.Module):
    linear: eqx.nn.Linear
    scale: es.ParamState[jax.Array]

    def __init__(self, key: jax.Array):
        self.linear = eqx.nn.Linear(2, 2, key=key)
        self.scale = es.ParamState(jnp.ones(2))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear(x) * self.scale.value


def _loss(model: _Scaled, x: jax.Array) -> jax.Array:
    return jnp.sum(model(x) ** 2)


def test_the_gradients_of_the_training_step_are_typed_by_their_layout():
    model, x = _Scaled(jax.random.key(0)), jnp.ones(2)
    grad = es.transform.grad(
        _loss, argnums=0, grad_states=es.ParamState, return_value=True
    )
    (state_grads, grads), value = grad(model, x)
    assert_type(state_grads, es.StateDict)
    assert_type(value, jax.Array)
    params = es.trainable(model)
    assert_type(params, tuple[es.StateDict, Any])
    optimiser = optax.sgd(0.1)
    updates, _ = optimiser.update((state_grads, grads), optimiser.init(params), params)
    new_model = es.apply_updates(model, updates)
    assert_type(new_model, _Scaled)
    assert isinstance(new_model, _Scaled) and value.shape == ()

    pair = es.transform.grad(_loss, grad_states=es.ParamState, argnums=0)(model, x)
    assert_type(pair, tuple[es.StateDict, Any])

    def scale_loss(x: jax.Array) -> jax.Array:
        return jnp.sum(model.scale.value * x)

    only_states = es.transform.grad(scale_loss, grad_states=es.ParamState)(x)
    assert_type(only_states, es.StateDict)
    loss, state_grads = es.transform.value_and_grad(
        scale_loss, grad_states=es.ParamState
    )(x)
    assert_type(loss, jax.Array)
    assert_type(state_grads, es.StateDict)
    assert state_grads.states == (model.scale,)


def test_vjp_and_jvp_are_typed_by_the_function_output():
    model, x = _Scaled(jax.random.key(0)), jnp.ones(2)
    out, vjp_fn = es.transform.vjp(_loss, model, x, argnums=1)
    assert_type(out, jax.Array)
    assert vjp_fn(jnp.ones(())).shape == (2,)
    primal_out, tangent_out = es.transform.jvp(ft.partial(_loss, model), (x,), (x,))
    assert_type(primal_out, jax.Array)
    assert_type(tangent_out, jax.Array)


def test_load_returns_the_type_of_its_target(tmp_path):
    class Model(eqx.Module):
        linear: eqx.nn.Linear
        w: es.ParamState

    model = Model(eqx.nn.Linear(2, 2, key=jax.random.key(0)), es.ParamState(1.0))
    es.save(tmp_path / "c", model)
    restored = typing.assert_type(es.load(tmp_path / "c", model), Model)
    assert isinstance(restored, Model)
    values = es.values_of(model, es.ParamState)
    es.save(tmp_path / "p", values, model=eqx.filter(model, es.is_state))
    loaded = typing.assert_type(
        es.load(tmp_path / "p", values, model=model), es.StateDict
    )
    assert isinstance(loaded, es.StateDict)


def test_a_jitted_function_keeps_its_signature_and_has_its_methods():
    w = es.ParamState(jnp.ones(3), name="w")

    def step(x: jax.Array, scale: float = 1.0) -> jax.Array:
        w.value = w.value * scale + x
        return w.value.sum()

    @es.transform.jit(donate_states=True)
    def decorated(x: jax.Array) -> jax.Array:
        return step(x)

    jitted = es.transform.jit(step)
    functions: list[es.transform.JittedFunction[..., jax.Array]] = [jitted, decorated]
    assert all(isinstance(f, es.transform.JittedFunction) for f in functions)
    assert_type(jitted(jnp.ones(3), scale=2.0), jax.Array)
    assert_type(decorated(jnp.ones(3)), jax.Array)
    assert_type(jitted.lower(jnp.ones(3)), jax.stages.Lowered)
    assert jitted.eval_shape(jnp.ones(3)).shape == ()
    stats: dict[str, Any] = jitted.get_cache_stats()
    assert stats["misses"] >= 1
    assert jitted.validate_states()
    expected = w.value + 1
    new, out = jitted.debug_call(es.values_of(w), jnp.ones(3))
    assert out == expected.sum() and (new[w] == expected).all()
    jitted.clear_cache()
    decorated.clear_cache()


def test_loops_conditions_and_vmap_are_typed_by_their_bodies():
    w = es.ParamState(jnp.ones(3), name="w")

    def body(total: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        w.value = w.value + x
        return total + x.sum(), w.value

    total, ys = es.transform.scan(body, jnp.array(0.0), jnp.ones((2, 3)))
    assert_type((total, ys), tuple[jax.Array, jax.Array])
    assert total == 6 and ys.shape == (2, 3)

    def double(x: jax.Array) -> jax.Array:
        return 2 * x

    assert_type(es.transform.for_loop(double, jnp.ones(2)), jax.Array)
    assert_type(es.transform.cond(True, double, jnp.negative, jnp.ones(2)), jax.Array)
    mapped = es.transform.vmap(double)
    assert_type(mapped(jnp.ones((2, 3))), jax.Array)
    assert mapped(jnp.ones((2, 3))).shape == (2, 3)


def test_batch_norm_weight_is_typed_by_affine():
    assert_type(enn.BatchNorm(3).weight, es.ParamState[jax.Array])
    plain = enn.BatchNorm(3, affine=False)
    assert_type(plain.weight, es.ParamState[jax.Array] | None)
    assert plain.weight is None


# Strict pyright over `examples/` and the pages of `docs/` and `README.md`: what is
# left out, and why. Nothing here hides a type of eqstate's.
_NOT_OURS = {
    # JAX's, Equinox's and matplotlib's own signatures have unknown parts: `jnp.zeros`'
    # `device`, `jax.device_count`'s `backend`, and every function typed with
    # jaxtyping's `PyTree`, which jaxtyping hides from type checkers on purpose.
    "reportUnknownMemberType": False,
    # optax ships no stubs; pyright reads its inline annotations.
    "reportMissingTypeStubs": False,
}
# The snippets in the docs are short: they leave parameters unannotated (`def f(x)`,
# lambdas), so what is computed from them is unknown too; each block of a page imports
# what it uses, and a page is one module. The examples and `docs/how-to/typed-code.md`
# are checked without these exceptions.
_SNIPPETS = (
    "reportMissingParameterType",
    "reportUnknownParameterType",
    "reportUnknownLambdaType",
    "reportUnknownArgumentType",
    "reportUnknownVariableType",
    "reportDuplicateImport",
    "reportConstantRedefinition",
)
_FULLY_TYPED = ("docs/how-to/typed-code.md",)


def _strict_pyright(files: dict[str, str]) -> list[str]:
    """Runs pyright in strict mode (less `_NOT_OURS`) over `{file name: source}` and
    returns its errors, one line each."""
    with tempfile.TemporaryDirectory() as directory:
        root = pathlib.Path(directory)
        for name, source in files.items():
            (root / name).write_text(source)
        settings = {
            "pythonVersion": "3.11",
            "typeCheckingMode": "strict",
            "extraPaths": [str(pathlib.Path(__file__).parent.parent)],
        }
        (root / "pyrightconfig.json").write_text(json.dumps(settings | _NOT_OURS))
        command = ["--pythonpath", sys.executable, "--outputjson", "--project"]
        result = subprocess.run(
            [sys.executable, "-m", "pyright", *command, str(root)],
            capture_output=True,
            text=True,
        )
    assert result.stdout.startswith("{"), result.stdout + result.stderr
    report = json.loads(result.stdout)
    return [
        f"{pathlib.Path(d['file']).name} line {d['range']['start']['line'] + 1}: "
        f"{d['message']} ({d.get('rule')})"
        for d in report["generalDiagnostics"]
        if d["severity"] == "error"
    ]


def test_the_examples_and_the_docs_pass_strict_pyright():
    files = {}
    for path in sorted(pathlib.Path(__file__).parent.parent.glob("examples/*.py")):
        files[f"examples_{path.name}"] = path.read_text()
    for name, (origin, source) in _modules().items():
        if not origin.endswith(".md"):
            continue  # docstrings: checked in standard mode by check_docs_types
        if origin not in _FULLY_TYPED:
            # The page's first line is its title, never code.
            assert source.startswith("\n"), origin
            rules = ", ".join(f"{rule}=false" for rule in _SNIPPETS)
            source = f"# pyright: {rules}" + source[source.index("\n") :]
        files[f"{name}.py"] = source
    assert len(files) > 20
    errors = _strict_pyright(files)
    assert not errors, "\n".join(errors)
