"""A transformer whose blocks alternate dense and mixture-of-experts MLPs (Flax linen).

Even blocks are :class:`DenseBlock` (attention + GELU MLP), odd blocks :class:`MoEBlock`
(attention + top-1 routed experts with GShard-style dispatch/combine einsums and a fixed
capacity). Layer construction must find two repeated module kinds here, not one coarse pair
(HARP §6, MoE workloads), and marks the MoE blocks routed (``Module.routed``).

Each sequence is routed on its own: ``ceil(seq_len * capacity_factor / num_experts)`` slots
per expert, positions by a cumulative sum over the sequence's tokens, no auxiliary loss. No
value couples the examples of a batch, so the model pipelines equal to ``jax.jit`` of the
whole batch (docs/microbatches.md). The router runs in float32, or in the computation dtype
where that is wider. :mod:`harpjax.models.mixtral` has top-2 routing, groups over the batch
and the load-balancing loss.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from harpjax.models.gpt import Attention, GPTConfig

__all__ = ["MoEConfig", "MoETransformer", "DenseBlock", "MoEBlock", "MOE_TINY"]


@dataclasses.dataclass(frozen=True)
class MoEConfig(GPTConfig):
  """A :class:`GPTConfig` plus expert count and capacity factor."""
  num_experts: int = 8
  capacity_factor: float = 1.25


MOE_TINY = MoEConfig(vocab_size=256, seq_len=16, hidden=32, num_heads=4, num_blocks=8,
                     dtype="float32", param_dtype="float32", key_bias=True,
                     softmax_dtype="float32", layer_marks=0, num_experts=4)


def _norm(c: MoEConfig, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(dtype=c.dtype, param_dtype=c.param_dtype, name=name)


class DenseBlock(nn.Module):
  config: MoEConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    x = x + Attention(c, name="attn")(_norm(c, "ln_attn")(x))
    h = nn.Dense(c.hidden * c.mlp_ratio, dtype=c.dtype, param_dtype=c.param_dtype,
                 name="fc_in")(_norm(c, "ln_mlp")(x))
    return x + nn.Dense(c.hidden, dtype=c.dtype, param_dtype=c.param_dtype,
                        name="fc_out")(nn.gelu(h))


class Experts(nn.Module):
  """Top-1 routed experts over a sequence: ``[b, s, h] -> [b, s, h]``."""
  config: MoEConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    b, s, h = x.shape
    E, f = c.num_experts, c.hidden * c.mlp_ratio
    cap = max(1, int(math.ceil(s * c.capacity_factor / E)))
    router_dtype = jnp.promote_types(jnp.dtype(c.dtype), jnp.float32)   # float32 or wider
    gates = nn.softmax(nn.Dense(E, use_bias=False, dtype=router_dtype, param_dtype=c.param_dtype,
                              name="router")(x), -1)
    expert = jnp.argmax(gates, axis=-1)                              # [b, s]
    onehot = jax.nn.one_hot(expert, E, dtype=jnp.int32)              # [b, s, E]
    slot = jnp.cumsum(onehot, axis=1) * onehot - 1                   # position in expert
    keep = (slot >= 0) & (slot < cap)
    dispatch = (jax.nn.one_hot(slot, cap, dtype=c.dtype) * keep[..., None])   # [b, s, E, C]
    combine = dispatch * jnp.max(gates, -1)[..., None, None].astype(c.dtype)
    xin = jnp.einsum("bsec,bsh->bech", dispatch, x)
    w_in = self.param("w_in", nn.initializers.lecun_normal(), (E, h, f), c.param_dtype)
    w_out = self.param("w_out", nn.initializers.lecun_normal(), (E, f, h), c.param_dtype)
    hid = nn.gelu(jnp.einsum("bech,ehf->becf", xin, w_in.astype(c.dtype)))
    out = jnp.einsum("becf,efh->bech", hid, w_out.astype(c.dtype))
    return jnp.einsum("bsec,bech->bsh", combine, out)


class MoEBlock(nn.Module):
  config: MoEConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    x = x + Attention(c, name="attn")(_norm(c, "ln_attn")(x))
    return x + Experts(c, name="experts")(_norm(c, "ln_mlp")(x))


class MoETransformer(nn.Module):
  """Token ids -> logits; blocks alternate :class:`DenseBlock` and :class:`MoEBlock`."""
  config: MoEConfig

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    embed = nn.Embed(c.vocab_size, c.hidden, dtype=c.dtype, param_dtype=c.param_dtype,
                     name="embed")
    x = embed(tokens)
    for i in range(c.num_blocks):
      x = (MoEBlock if i % 2 else DenseBlock)(c)(x)
    x = _norm(c, "ln_f")(x)
    return embed.attend(x)
