"""Example Flax models that mark their layer cuts with :func:`harpjax.mark_layer_boundary`.

They are ordinary Flax linen modules: outside :func:`harpjax.auto_parallel` the markers are the
identity, so the same code runs under plain ``jax.jit``.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from harpjax.compiler.trace import mark_layer_boundary

__all__ = ["GPTConfig", "GPT", "MLP", "DropoutMLP"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """A GPT: token + position embedding, pre-LayerNorm blocks, LM head tied to the embedding."""
  vocab_size: int = 128
  seq_len: int = 16
  hidden: int = 32
  num_heads: int = 4
  num_blocks: int = 4
  mlp_ratio: int = 4
  dropout: float = 0.0
  dtype: str = "float32"
  cut_blocks_in: int = 1   # layers per block: 1 (one cut per block) or 2 (attention | MLP)


class CausalSelfAttention(nn.Module):
  """Multi-head causal self-attention. The key projection has no bias: a key bias only adds a
  per-query constant to the logits, which the softmax cancels, so its gradient is zero in exact
  arithmetic and pure rounding noise in floating point (Whisper omits it for the same reason)."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x, train: bool):
    c = self.config
    b, t, d = x.shape
    hd = d // c.num_heads
    q = nn.Dense(d, dtype=c.dtype, name="query")(x).reshape(b, t, c.num_heads, hd)
    k = nn.Dense(d, dtype=c.dtype, use_bias=False, name="key")(x).reshape(b, t, c.num_heads, hd)
    v = nn.Dense(d, dtype=c.dtype, name="value")(x).reshape(b, t, c.num_heads, hd)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(c.dtype)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    logits = jnp.where(causal[None, None], logits, jnp.finfo(logits.dtype).min)
    weights = nn.Dropout(c.dropout, deterministic=not train)(nn.softmax(logits, axis=-1))
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
    return nn.Dense(d, dtype=c.dtype, name="out")(out)


class Block(nn.Module):
  config: GPTConfig

  @nn.compact
  def __call__(self, x, train: bool):
    c = self.config
    h = nn.LayerNorm(dtype=c.dtype, name="ln_attn")(x)
    h = CausalSelfAttention(c, name="attn")(h, train)
    x = x + nn.Dropout(c.dropout, deterministic=not train)(h)
    if c.cut_blocks_in == 2:
      x = mark_layer_boundary(x)
    h = nn.LayerNorm(dtype=c.dtype, name="ln_mlp")(x)
    h = nn.Dense(c.hidden * c.mlp_ratio, dtype=c.dtype, name="fc_in")(h)
    h = nn.gelu(h)
    h = nn.Dense(c.hidden, dtype=c.dtype, name="fc_out")(h)
    return x + nn.Dropout(c.dropout, deterministic=not train)(h)


class GPT(nn.Module):
  """Returns logits ``[batch, seq, vocab]``; layers: embed · blocks · head."""
  config: GPTConfig

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    c = self.config
    embed = nn.Embed(c.vocab_size, c.hidden, dtype=c.dtype, name="embed")
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (c.seq_len, c.hidden))
    x = embed(tokens) + pos[None, : tokens.shape[1]].astype(c.dtype)
    x = nn.Dropout(c.dropout, deterministic=not train)(x)
    x = mark_layer_boundary(x)
    for i in range(c.num_blocks):
      x = Block(c, name=f"block_{i}")(x, train)
      x = mark_layer_boundary(x)
    x = nn.LayerNorm(dtype=c.dtype, name="ln_f")(x)
    return embed.attend(x)


class MLP(nn.Module):
  """A plain MLP with a cut after every hidden layer."""
  features: tuple = (32, 32, 32)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    for i, f in enumerate(self.features):
      x = nn.relu(nn.Dense(f, name=f"dense_{i}")(x))
      x = mark_layer_boundary(x)
    return nn.Dense(self.num_classes, name="head")(x)


class DropoutMLP(nn.Module):
  """An MLP with dropout in every layer (checks that random numbers match ``jax.jit``)."""
  features: tuple = (32, 32, 32)
  num_classes: int = 10
  rate: float = 0.2

  @nn.compact
  def __call__(self, x, train: bool = True):
    for i, f in enumerate(self.features):
      x = nn.relu(nn.Dense(f, name=f"dense_{i}")(x))
      x = nn.Dropout(self.rate, deterministic=not train)(x)
      x = mark_layer_boundary(x)
    return nn.Dense(self.num_classes, name="head")(x)
