"""Batch normalisation, with its running statistics held in `LongTermState`s."""

from typing import Any, cast, Generic, Literal, overload

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Inexact, Num, PRNGKeyArray
from typing_extensions import TypeVar

from .. import _jax_compat as compat
from .._arguments import flag, integer, real
from .._pretty_print import state_label
from .._state import LongTermState, ParamState
from ._ensemble import refuse_stacked_call


# The type of `weight` and `bias`, which follows `affine`: typed code then reads
# `bn.weight.value` without narrowing away `None`.
_Affine = TypeVar("_Affine", bound=ParamState[Array] | None, default=ParamState[Array])

_PER_EXAMPLE_HINT = (
    " If this is one example (as when the layer is called per example inside `vmap`, "
    "the way `eqx.nn.BatchNorm` is), call it on the whole batch instead, outside "
    "`vmap`: `bn(xs)` rather than `vmap(bn, axis_name=...)(xs)`."
)
_CHANNELS_LAST_HINT = (
    " Its last axis has size {n}: move the features of a channels-last input to axis "
    "1 and back, as in `jnp.moveaxis(bn(jnp.moveaxis(x, -1, 1)), 1, -1)`."
)


class BatchNorm(eqx.Module, Generic[_Affine]):
    r"""Normalises each feature of a batch by its mean and variance, then applies an
    optional per-feature affine map.

    For an input `x` of shape `(batch, num_features, *spatial)` it computes

    $$\frac{x - \mathbb{E}[x]}{\sqrt{\text{Var}[x] + \varepsilon}} \gamma + \beta$$

    per feature, with the statistics taken over every axis but the feature axis
    (axis 1). The layer sees the whole batch, so unlike `eqx.nn.BatchNorm` it is
    called on the batch, outside any `vmap`, not per example inside a `jax.vmap` with
    an `axis_name`.

    - In training, it normalises with the batch statistics and updates the running
        statistics: `running = momentum * running + (1 - momentum) * batch_stat`.
    - In inference, it normalises with the running statistics and writes nothing.

    The running mean starts at zeros and the running variance at ones, and both are
    [`eqstate.LongTermState`][]s; $\gamma$ (`weight`) and $\beta$ (`bias`) are
    [`eqstate.ParamState`][]s, so `grad_states=eqstate.ParamState` differentiates the
    parameters while the running statistics are written back. With `affine=False`
    they are `None`. For type checkers `BatchNorm` is generic in their type: a bare
    `BatchNorm` (as `BatchNorm(n)` makes) has `weight: ParamState[Array]`, and one
    made with any other `affine` is `BatchNorm[ParamState[Array] | None]`.

    The conventions are those of `eqx.nn.BatchNorm(..., mode="batch")`: `momentum` is
    the weight of the old running value, and the variance is the biased one (the mean
    of squared deviations), both to normalise and to update the running variance (as in
    Flax and Haiku; PyTorch stores the unbiased variance). In inference the running
    statistics are used as they are, as in PyTorch and Flax: `eqx.nn.BatchNorm`
    divides them by `1 - momentum**steps`, which for a running variance that starts at
    one inflates it during the first few hundred steps.

    The output has the dtype of `x` promoted with the states' (float32 for float16
    or integer inputs with the default float32 states). Statistics and normalisation
    are computed in at least float32 whatever the input, as in Flax: squaring a
    float16 deviation above 256 would overflow, and a bfloat16 mean is rounded to
    three significant digits. (`eqx.nn.BatchNorm` computes in the input's dtype.)

    A complex input needs a layer with a complex `dtype`, such as `jnp.complex64`. Its
    running mean, `weight` and `bias` are complex, and the variance is the mean of
    $|x - \mathbb{E}[x]|^2$, as in `eqx.nn.BatchNorm`; being real, the running variance
    is stored in the real dtype (float32 for complex64), where `eqx.nn.BatchNorm` keeps
    a complex one with a zero imaginary part.

    !!! Example

        ```python
        import eqstate as es
        import eqstate.nn as enn
        import jax.numpy as jnp

        bn = enn.BatchNorm(3, momentum=0.9)
        x = es.random.normal((32, 3, 8)) * 2.0 + 1.0  # (batch, features, length)
        y = bn(x)  # training: batch statistics; updates the running ones
        assert jnp.allclose(y.mean(axis=(0, 2)), 0.0, atol=1e-5)
        assert (bn.running_mean.value != 0).all()

        running_mean = bn.running_mean.value
        bn(x, inference=True)  # running statistics; writes nothing
        assert (bn.running_mean.value == running_mean).all()
        ```
    """

    running_mean: LongTermState[Array]
    running_var: LongTermState[Array]
    weight: _Affine
    bias: _Affine
    inference: bool
    num_features: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    momentum: float = eqx.field(static=True)
    affine: bool = eqx.field(static=True)

    @overload
    def __init__(
        self: "BatchNorm[ParamState[Array]]",
        num_features: int,
        *,
        eps: float = 1e-5,
        momentum: float = 0.99,
        affine: Literal[True] = True,
        inference: bool = False,
        dtype: Any = jnp.float32,
    ) -> None: ...

    @overload
    def __init__(
        self: "BatchNorm[ParamState[Array] | None]",
        num_features: int,
        *,
        eps: float = 1e-5,
        momentum: float = 0.99,
        affine: bool = True,
        inference: bool = False,
        dtype: Any = jnp.float32,
    ) -> None: ...

    def __init__(
        self,
        num_features: int,
        *,
        eps: float = 1e-5,
        momentum: float = 0.99,
        affine: bool = True,
        inference: bool = False,
        dtype: Any = jnp.float32,
    ):
        """**Arguments:**

        - `num_features`: the size of the feature axis (axis 1) of the input.
        - `eps`: added to the variance before taking its square root. (Keyword only
            argument.)
        - `momentum`: the weight of the old running statistics in each update, in
            `[0, 1]`. (Keyword only argument.)
        - `affine`: whether to learn a per-feature scale `weight` (initialised to
            ones) and shift `bias` (zeros). (Keyword only argument.)
        - `inference`: whether to normalise with the running statistics instead of
            the batch ones. It can be overridden per call, or set on a whole model with
            `eqx.nn.inference_mode`. (Keyword only argument.)
        - `dtype`: the dtype of the running mean and of `weight` and `bias`: a
            floating or complex dtype (an integer one is refused). The running variance
            has the matching real dtype (float32 for `jnp.complex64`). A complex input
            needs a complex `dtype`. (Keyword only argument.)
        """
        owner = "BatchNorm's "
        num_features = integer(num_features, "num_features", at_least=1, owner=owner)
        real(momentum, "momentum", owner=owner, what="a real number in [0, 1]")
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(
                f"BatchNorm's `momentum` is the weight of the old running statistics "
                f"and must be in [0, 1], got {momentum}. (A PyTorch `momentum=m` is "
                f"`momentum=1 - m` here.)"
            )
        real(eps, "eps", owner=owner, what="a non-negative real number")
        if not eps >= 0:
            raise ValueError(f"BatchNorm's `eps` must be non-negative, got {eps}.")
        flag(affine, "affine", owner=owner)
        flag(inference, "inference", owner=owner)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise ValueError(
                "BatchNorm needs a floating or complex `dtype` for its running "
                f"statistics, `weight` and `bias`, got {jnp.dtype(dtype)}, which would "
                "truncate every update. Use a floating dtype such as the default "
                "`jnp.float32` (integer inputs are normalised in float32 all the same), "
                "or a complex one for complex inputs."
            )
        zeros = jnp.zeros(num_features, dtype)
        self.running_mean = LongTermState(zeros, name="running_mean")
        # A variance is real: float32 for a complex64 layer.
        self.running_var = LongTermState(jnp.ones_like(zeros.real), name="running_var")
        if affine:
            weight = ParamState(jnp.ones(num_features, dtype), name="weight")
            bias = ParamState(jnp.zeros(num_features, dtype), name="bias")
        else:
            weight = bias = None
        self.weight, self.bias = cast(_Affine, weight), cast(_Affine, bias)
        self.inference = inference
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine

    def _check_input(self, x: Array, inference: bool) -> None:
        # Checked before anything is written. Inside `eqstate.transform.vmap` a
        # member's lane sees 1-D statistics.
        for state in (self.running_mean, self.running_var):
            if state.value.ndim > 1:
                refuse_stacked_call(
                    f"BatchNorm(num_features={self.num_features})",
                    state,
                    state.value,
                    (self.num_features,),
                    unit="layer",
                    example="`vmap(ensemble, in_states={0: eqstate.states_of("
                    "ensemble)})(xs)` gives member `i` the batch `xs[i]`, and "
                    "`in_axes=None` gives every member the same batch",
                )
        mean_dtype = self.running_mean.value.dtype
        if jnp.iscomplexobj(x) and not jnp.issubdtype(mean_dtype, jnp.complexfloating):
            raise ValueError(
                f"BatchNorm(num_features={self.num_features}) got a {x.dtype} input, "
                f"but its {state_label(self.running_mean)} is {mean_dtype} and would "
                "lose the imaginary part of the mean. Create the layer with a complex "
                f"dtype, as in `BatchNorm({self.num_features}, dtype=jnp.complex64)`."
            )
        n = self.num_features
        if x.ndim < 2 or x.shape[1] != n:
            got = f"got shape {x.shape}"
            if x.ndim >= 2:
                got += f", whose feature axis (axis 1) has size {x.shape[1]}, not {n}"
            hint = ""
            if x.ndim < 2 or x.shape[0] == n:
                hint = _PER_EXAMPLE_HINT
            elif x.shape[-1] == n:
                hint = _CHANNELS_LAST_HINT.format(n=n)
            raise ValueError(
                f"BatchNorm(num_features={n}) normalises the whole batch it is given, "
                f"of shape (batch, {n}) or (batch, {n}, *spatial): the batch on axis 0 "
                f"and the features on axis 1; {got}.{hint}"
            )
        if inference and x.shape[0] == n and self._per_example(x):
            raise ValueError(
                f"BatchNorm(num_features={n}) got an input of shape {x.shape} inside "
                "a `vmap` that maps the input but not the layer's running statistics: "
                f"one example of {n} channels, which would be normalised along axis "
                f"1 (of size {n} too) as if it were a batch.{_PER_EXAMPLE_HINT} If "
                f"each lane really is a batch of {n} examples, call the layer on all "
                "of them at once: `bn(xs.reshape(-1, *xs.shape[2:]))`."
            )
        if not inference and x.size // self.num_features < 2:
            raise ValueError(
                f"BatchNorm(num_features={self.num_features}) got an input of shape "
                f"{x.shape} in training mode: that is one value per feature, whose "
                "variance is zero. Train on batches of two or more, or call it with "
                "`inference=True` to use the running statistics."
            )

    def _per_example(self, x: Array) -> bool:
        """Whether `x` is mapped by the innermost `vmap` and the running statistics
        are not: the layer is called per example, as `eqx.nn.BatchNorm` is (an
        ensemble's lanes each have statistics of their own)."""
        return compat.is_batched_here(x) and not compat.is_batched_here(
            self.running_mean.value
        )

    def __call__(
        self,
        x: Num[ArrayLike, "..."],
        *,
        inference: bool | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Inexact[Array, "..."]:
        """**Arguments:**

        - `x`: an array of shape `(batch, num_features, *spatial)`.
        - `inference`: if `True` or `False`, overrides `self.inference` for this call.
            (Keyword only argument.)
        - `key`: ignored; accepted so that the layer can be called as an Equinox
            layer (`eqx.nn.Sequential` passes one). (Keyword only argument.)

        **Returns:**

        The normalised array, of the shape of `x`.

        **Raises:**

        `ValueError` if the feature axis of `x` does not have size `num_features`,
        if the layer is an ensemble built by [`eqstate.transform.vmap_new_states`][]
        and called directly, not inside [`eqstate.transform.vmap`][] with its states
        in `in_states` (nothing is written then), if `x` is complex and the layer's
        states are real, in training if there is only one value per feature, or in
        inference if `x` looks like one example of a square shape
        `(num_features, num_features, ...)` called per example inside `jax.vmap` or
        `eqx.filter_vmap` (mapped there, while the running statistics are not),
        which would be normalised along the wrong axis. The layer sees only the
        innermost transform around it: with a `jax.jit`, `jax.checkpoint` or loop
        between the vmap and the layer, or under [`eqstate.transform.vmap`][]
        (which traces one lane before mapping it), it cannot see that it is mapped,
        and such an example is not refused but normalised along the wrong axis.
        Call the layer on the whole batch.
        """
        x = jnp.asarray(x)
        flag(inference, "inference", owner="BatchNorm's ", none=True)
        if inference is None:
            inference = self.inference
        self._check_input(x, inference)
        affine = ()
        if self.weight is not None and self.bias is not None:
            affine = (self.weight.value, self.bias.value)
        running = (self.running_mean.value, self.running_var.value)
        # The output takes the dtype of `x` promoted with the states' (f32 for f16
        # inputs and f32 statistics); the computation runs in at least float32, where
        # the square of a float16 deviation above 256 does not overflow. Promoted
        # explicitly, so that strict dtype promotion accepts the layer.
        out_dtype = _promoted_dtype(x, *running, *affine)
        dtype = _promoted_dtype(out_dtype, jnp.float32)
        x = x.astype(dtype)
        # Statistics over every axis but the features; reshaped to broadcast on axis 1.
        axes = (0, *range(2, x.ndim))
        shape = (1, self.num_features) + (1,) * (x.ndim - 2)
        if inference:
            mean, var = running
        else:
            mean = jnp.mean(x, axis=axes)
            deviation = x - mean.reshape(shape)
            # |x - mean|², real also for complex x, as in `eqx.nn.BatchNorm`.
            var = jnp.mean(jnp.real(deviation * jnp.conj(deviation)), axis=axes)
            # The running statistics are written back, never differentiated.
            batch_mean, batch_var = jax.lax.stop_gradient((mean, var))
            self.running_mean.value = self._updated(running[0], batch_mean)
            self.running_var.value = self._updated(running[1], batch_var)
        mean, var, *affine = (a.astype(dtype) for a in (mean, var, *affine))
        out = (x - mean.reshape(shape)) / jnp.sqrt(var.reshape(shape) + self.eps)
        if affine:
            weight, bias = affine
            out = out * weight.reshape(shape) + bias.reshape(shape)
        return out.astype(out_dtype)

    def _updated(self, running: Array, batch: Array) -> Array:
        """`momentum * running + (1 - momentum) * batch`, in the dtype of `running`."""
        dtype = _promoted_dtype(running, batch)
        m = self.momentum
        new = running.astype(dtype) * m + batch.astype(dtype) * (1 - m)
        return new.astype(running.dtype)


def _promoted_dtype(*arrays: Any) -> Any:
    """The dtype JAX's standard promotion gives `arrays` (or dtypes), whatever the
    configured promotion mode."""
    with jax.numpy_dtype_promotion("standard"):
        return jnp.result_type(*arrays)
