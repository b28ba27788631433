"""Built-in models: the GPT of the examples and of the paper, MLPs, MoE blocks and a
Mixtral-shaped MoE transformer.

:data:`BUILTIN_MODELS` maps a name (``"gpt-39b"``, ``"gpt-15b"``, ``"gpt-2.6b"``,
``"gpt-tiny"``, ``"moe-tiny"``, ``"mixtral-8x7b"``, ``"mixtral-tiny"``) to a factory
``factory(*, microbatch_size=None, num_microbatches=1, abstract=True, **config_overrides) ->
ModelSpec``. With ``abstract=True`` (the default) the train state and batch are
``jax.ShapeDtypeStruct`` s, so a 39B-parameter model is traced and
costed without allocating it (what ``python -m harpjax plan --model gpt-39b`` needs)::

    spec = BUILTIN_MODELS["gpt-39b"](num_microbatches=4)
    ts = trace_step(spec.step_fn, spec.args, num_microbatches=spec.num_microbatches,
                    batch_argnums=spec.batch_argnums)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from harpjax.models import gpt, mixtral, moe
from harpjax.models.gpt import GPT, GPT_2_6B, GPT_15B, GPT_39B, GPT_TINY, GPTConfig
from harpjax.models.mixtral import MIXTRAL_8X7B, MIXTRAL_TINY, Mixtral, MixtralConfig
from harpjax.models.mlp import MLP, DropoutMLP
from harpjax.models.moe import MOE_TINY, MoEConfig, MoETransformer

__all__ = ["ModelSpec", "BUILTIN_MODELS", "make_lm_spec", "GPT", "GPTConfig", "GPT_39B",
           "GPT_15B", "GPT_2_6B", "GPT_TINY", "MLP", "DropoutMLP", "MoEConfig", "MoETransformer",
           "MOE_TINY", "Mixtral", "MixtralConfig", "MIXTRAL_8X7B", "MIXTRAL_TINY", "lm_loss_for"]


class ModelSpec(NamedTuple):
  """A model and a train step ready for :func:`harpjax.compiler.trace.trace_step`.

  Attributes:
    name: registry name.
    model: the Flax module.
    config: its configuration dataclass.
    step_fn: ``step(state, batch) -> (state, loss)`` using ``harpjax.value_and_grad``.
    args: ``(state, batch)``: arrays, or ``jax.ShapeDtypeStruct`` s when abstract.
    num_microbatches: B.
    batch_argnums: ``(1,)``.
    microbatch_size: sequences per microbatch.
  """
  name: str
  model: Any
  config: Any
  step_fn: Callable
  args: tuple
  num_microbatches: int
  batch_argnums: tuple
  microbatch_size: int


def lm_loss_for(config) -> Callable:
  """The train loss ``loss(outputs, labels)`` of a built-in model's configuration: the token
  cross-entropy, plus the weighted load-balancing loss for a :class:`MixtralConfig`."""
  if isinstance(config, MixtralConfig):
    return lambda outputs, labels: mixtral.mixtral_loss(outputs, labels, config.aux_loss_coef)
  return gpt.lm_loss


def make_lm_spec(name: str, model, config, *, microbatch_size: int, num_microbatches: int = 1,
                 abstract: bool = True, seed: int = 0) -> ModelSpec:
  """A language-model train step (token cross-entropy, Adam) around ``model``; its loss is
  :func:`lm_loss_for` ``(config)``."""
  import harpjax  # late: harpjax imports the compiler, which does not import models

  batch_size = microbatch_size * num_microbatches
  tokens = jax.ShapeDtypeStruct((batch_size, config.seq_len), jnp.int32)
  tx = optax.adam(1e-4)
  loss_of = lm_loss_for(config)

  def create(key):
    params = model.init(key, jnp.zeros((1, config.seq_len), jnp.int32))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def step(state, batch):
    def loss_fn(params):
      outputs = state.apply_fn({"params": params}, batch["tokens"])
      return loss_of(outputs, batch["labels"])
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  if abstract:
    state = jax.eval_shape(create, jax.random.key(seed))
    batch = {"tokens": tokens, "labels": tokens}
  else:
    state = create(jax.random.key(seed))
    rng = np.random.default_rng(seed)
    batch = {k: jnp.asarray(rng.integers(0, config.vocab_size, tokens.shape), jnp.int32)
             for k in ("tokens", "labels")}
  return ModelSpec(name, model, config, step, (state, batch), num_microbatches, (1,),
                   microbatch_size)


def _gpt_factory(name: str, base, default_mbs: int, cls=None):
  def factory(*, microbatch_size: int | None = None, num_microbatches: int = 1,
              abstract: bool = True, **overrides) -> ModelSpec:
    cfg = dataclasses.replace(base, **overrides)
    module = (cls or gpt.GPT)(cfg)
    return make_lm_spec(name, module, cfg, microbatch_size=microbatch_size or default_mbs,
                        num_microbatches=num_microbatches, abstract=abstract)
  factory.__doc__ = f"ModelSpec of {name} ({base})."
  return factory


BUILTIN_MODELS: dict[str, Callable[..., ModelSpec]] = {
    "gpt-39b": _gpt_factory("gpt-39b", gpt.GPT_39B, 8),
    "gpt-15b": _gpt_factory("gpt-15b", gpt.GPT_15B, 8),
    "gpt-2.6b": _gpt_factory("gpt-2.6b", gpt.GPT_2_6B, 8),
    "gpt-tiny": _gpt_factory("gpt-tiny", gpt.GPT_TINY, 2),
    "moe-tiny": _gpt_factory("moe-tiny", moe.MOE_TINY, 2, cls=moe.MoETransformer),
    "mixtral-8x7b": _gpt_factory("mixtral-8x7b", mixtral.MIXTRAL_8X7B, 1, cls=mixtral.Mixtral),
    "mixtral-tiny": _gpt_factory("mixtral-tiny", mixtral.MIXTRAL_TINY, 2, cls=mixtral.Mixtral),
}
"""Name -> factory of a :class:`ModelSpec` (see the module docstring)."""
