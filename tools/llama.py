"""A LLaMA-style decoder block (RMSNorm, rotary attention, SwiGLU MLP) in Flax linen.

Used to compare the analytic cost model with published per-layer LLaMA measurements
(``deepspeedllama_*`` in the Zorse data); a full model is the GPT skeleton with these blocks.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

__all__ = ["LlamaConfig", "LlamaBlock", "RMSNorm"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  hidden: int = 4096
  num_heads: int = 32
  ffn: int = 11008
  dtype: str = "float16"
  param_dtype: str = "float16"


class RMSNorm(nn.Module):
  dtype: str = "float16"
  param_dtype: str = "float16"

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6))
    return (y * scale.astype(jnp.float32)).astype(self.dtype)


def _rotary(x):
  b, t, h, d = x.shape
  inv = 1.0 / (10000 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None]
  sin, cos = jnp.sin(ang)[None, :, None], jnp.cos(ang)[None, :, None]
  x1, x2 = x[..., ::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
  out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).reshape(x.shape)
  return out.astype(x.dtype)


class LlamaBlock(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    b, t, d = x.shape
    hd = d // c.num_heads
    dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=c.dtype,
                                     param_dtype=c.param_dtype, name=name)
    h = RMSNorm(c.dtype, c.param_dtype, name="attn_norm")(x)
    q, k, v = (dense(d, n)(h).reshape(b, t, c.num_heads, hd) for n in ("q", "k", "v"))
    q, k = _rotary(q), _rotary(k)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(c.dtype)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    logits = jnp.where(causal[None, None], logits, jnp.finfo(logits.dtype).min)
    w = nn.softmax(logits.astype(jnp.float32), axis=-1).astype(c.dtype)
    x = x + dense(d, "o")(jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, d))
    h = RMSNorm(c.dtype, c.param_dtype, name="mlp_norm")(x)
    return x + dense(d, "down")(nn.silu(dense(c.ffn, "gate")(h)) * dense(c.ffn, "up")(h))
