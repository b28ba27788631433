"""GPT (decoder-only transformer) in Flax linen, without hand-placed layer boundaries.

The paper's GPT-39B (48 blocks, hidden 8192, 64 heads, sequence 1024) and GPT-2.6B (32 blocks,
hidden 2560, 32 heads) are :data:`GPT_39B` and :data:`GPT_2_6B`. Blocks are pre-LayerNorm with
a GELU MLP of ratio 4; the LM head is tied to the token embedding. Parameters are kept in
``param_dtype`` (fp16 for the big configs: mixed-precision optimizer state is accounted for by
the profiler's ``state_bytes_per_param``).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["GPTConfig", "GPT", "Block", "Attention", "GPT_39B", "GPT_2_6B", "GPT_TINY"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape of a GPT.

  Attributes:
    vocab_size, seq_len, hidden, num_heads, num_blocks, mlp_ratio: the usual.
    dtype: computation dtype.
    param_dtype: parameter dtype.
    fused_qkv: one ``[hidden, 3 * hidden]`` projection (Megatron/DeepSpeed) instead of three.
  """
  vocab_size: int = 51200
  seq_len: int = 1024
  hidden: int = 8192
  num_heads: int = 64
  num_blocks: int = 48
  mlp_ratio: int = 4
  dtype: str = "float16"
  param_dtype: str = "float16"
  fused_qkv: bool = False

  @property
  def num_params(self) -> int:
    h = self.hidden
    block = 12 * h * h + 13 * h
    return self.num_blocks * block + (self.vocab_size + self.seq_len) * h + 2 * h


GPT_39B = GPTConfig()
GPT_2_6B = GPTConfig(hidden=2560, num_heads=32, num_blocks=32)
GPT_TINY = GPTConfig(vocab_size=256, seq_len=16, hidden=32, num_heads=4, num_blocks=4,
                     dtype="float32", param_dtype="float32")


class Attention(nn.Module):
  """Causal multi-head self-attention."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    b, t, d = x.shape
    hd = d // c.num_heads
    dense = lambda n, name: nn.Dense(n, dtype=c.dtype, param_dtype=c.param_dtype, name=name)
    if c.fused_qkv:
      q, k, v = jnp.split(dense(3 * d, "qkv")(x), 3, axis=-1)
    else:
      q, k, v = dense(d, "query")(x), dense(d, "key")(x), dense(d, "value")(x)
    q, k, v = (y.reshape(b, t, c.num_heads, hd) for y in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(c.dtype)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    logits = jnp.where(causal[None, None], logits, jnp.finfo(logits.dtype).min)
    weights = nn.softmax(logits.astype(jnp.float32), axis=-1).astype(c.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
    return dense(d, "out")(out)


class Block(nn.Module):
  """Pre-LayerNorm transformer block: attention and a GELU MLP, each with a residual."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    ln = lambda name: nn.LayerNorm(dtype=c.dtype, param_dtype=c.param_dtype, name=name)
    x = x + Attention(c, name="attn")(ln("ln_attn")(x))
    h = nn.Dense(c.hidden * c.mlp_ratio, dtype=c.dtype, param_dtype=c.param_dtype,
                 name="fc_in")(ln("ln_mlp")(x))
    h = nn.gelu(h)
    return x + nn.Dense(c.hidden, dtype=c.dtype, param_dtype=c.param_dtype, name="fc_out")(h)


class GPT(nn.Module):
  """Token ids ``[batch, seq]`` -> logits ``[batch, seq, vocab]``."""
  config: GPTConfig

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    embed = nn.Embed(c.vocab_size, c.hidden, dtype=c.dtype, param_dtype=c.param_dtype,
                     name="embed")
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (c.seq_len, c.hidden),
                     c.param_dtype)
    x = embed(tokens) + pos[None, : tokens.shape[1]].astype(c.dtype)
    for i in range(c.num_blocks):
      x = Block(c, name=f"block_{i}")(x)
    x = nn.LayerNorm(dtype=c.dtype, param_dtype=c.param_dtype, name="ln_f")(x)
    return embed.attend(x)


def lm_loss(logits, labels):
  """Mean token cross-entropy, computed in float32."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()
