"""Layer construction finds the routed blocks (router, dispatch, experts, combine) of a
mixture-of-experts model and marks their modules ``routed``; dense blocks, attention and a
loss's ``argmax`` are not routed."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from harpjax.compiler import layers as L
from harpjax.compiler.trace import trace_step
from harpjax.models import BUILTIN_MODELS, MIXTRAL_TINY, ModelSpec, make_lm_spec
from harpjax.models.mixtral import Mixtral


def _layers(spec: ModelSpec) -> L.LayerSequence:
  ts = trace_step(spec.step_fn, spec.args, num_microbatches=1, batch_argnums=(1,))
  return L.layers_for_step(ts)


def test_interleaved_model_marks_its_moe_blocks_routed():
  seq = _layers(BUILTIN_MODELS["moe-tiny"](num_microbatches=1))
  assert seq.module_kinds() == {"DenseBlock": 4, "MoEBlock": 4}
  assert [m.name for m in seq.routed_modules()] == ["MoEBlock"] * 4
  assert not any(m.routed for m in seq.modules if m.name != "MoEBlock")


def test_mixtral_blocks_are_routed_for_every_routing():
  for cfg in (MIXTRAL_TINY,
              dataclasses.replace(MIXTRAL_TINY, top_k=1, routing_group="sequence",
                                  num_kv_heads=None, num_blocks=2)):
    spec = make_lm_spec("mixtral", Mixtral(cfg), cfg, microbatch_size=2)
    seq = _layers(spec)
    routed = seq.routed_modules()
    assert len(routed) == cfg.num_blocks and {m.name for m in routed} == {"block"}, str(seq)
    assert seq.module_kinds() == {"block": cfg.num_blocks}
    assert all(m.repeated for m in routed)
    assert not any(m.routed for m in seq.modules if m.name != "block")


def test_dense_models_and_a_loss_argmax_are_not_routed():
  assert not _layers(BUILTIN_MODELS["gpt-tiny"](num_microbatches=1)).routed_modules()

  class Net(nn.Module):   # argmax of the logits for an accuracy: a choice, but nothing routed
    @nn.compact
    def __call__(self, x):
      for i in range(3):
        x = x + nn.Dense(8, name=f"fc_{i}")(nn.tanh(nn.Dense(8)(x)))
      return x

  net = Net()
  x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  params = jax.eval_shape(net.init, jax.random.key(0), x)

  def step(p, batch):
    import harpjax

    def loss(p):
      logits = net.apply(p, batch)
      accuracy = jnp.mean(jnp.argmax(logits, -1) == 0)
      return jnp.mean(logits ** 2), accuracy
    (l, acc), g = harpjax.value_and_grad(loss, has_aux=True)(p)
    return l, acc, g

  ts = trace_step(step, (params, x), num_microbatches=1, batch_argnums=(1,))
  seq = L.layers_for_step(ts)
  assert any(op.name == "argmax" for op in seq.program.ops)
  assert not seq.routed_modules()


def test_routing_by_gather_is_routed():
  # Top-1 routing written with indices: argsort of the tokens by expert, the tokens gathered in
  # that order, each token's expert weights gathered by index, the outputs scattered back.
  class GatherExperts(nn.Module):
    @nn.compact
    def __call__(self, x):
      t, h = x.shape
      expert = jnp.argmax(nn.Dense(4, use_bias=False, name="router")(x), -1)
      order = jnp.argsort(expert)
      w = self.param("w", nn.initializers.lecun_normal(), (4, h, h))
      y = jnp.einsum("th,thf->tf", x[order], w[expert[order]])
      return x + jnp.zeros_like(y).at[order].set(y)

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(2):
        x = nn.Dense(8, name=f"fc_{i}")(x)
        x = GatherExperts(name=f"experts_{i}")(x)
      return x

  net = Net()
  x = jax.ShapeDtypeStruct((6, 8), jnp.float32)
  params = jax.eval_shape(net.init, jax.random.key(0), x)

  def step(p, batch):
    import harpjax
    return harpjax.value_and_grad(lambda q: jnp.mean(net.apply(q, batch) ** 2))(p)

  seq = L.layers_for_step(trace_step(step, (params, x), num_microbatches=1,
                                     batch_argnums=(1,)))
  assert len(seq.routed_modules()) == 2, [(m.name, m.routed) for m in seq.modules]
