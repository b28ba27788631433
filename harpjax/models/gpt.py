"""GPT (decoder-only transformer) in Flax linen: the examples' small models and the paper's.

One model for every use. By default it is a small fp32 GPT that marks its layer cuts with
:func:`harpjax.mark_layer_boundary` (embedding | one layer per block | head, or two per block
with ``layer_marks=2``), has dropout when asked, and runs under plain ``jax.jit`` too (the
markers are the identity outside :func:`harpjax.auto_parallel`). The paper's GPT-39B (48 blocks,
hidden 8192, 64 heads, sequence 1024) and GPT-2.6B (32 blocks, hidden 2560, 32 heads) are
:data:`GPT_39B`, :data:`GPT_15B` (48 blocks of hidden 5120, the size Alpa and HARP report) and
:data:`GPT_2_6B`: fp16, fused or separate QKV with biases, softmax in fp32,
no markers (harpjax finds the layers). Blocks are pre-LayerNorm with a GELU MLP; the LM head is
tied to the token embedding.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from harpjax.compiler.trace import mark_layer_boundary

__all__ = ["GPTConfig", "GPT", "Block", "Attention", "GPT_39B", "GPT_15B", "GPT_2_6B",
           "GPT_TINY", "lm_loss", "ATTENTION_IMPLEMENTATIONS", "dot_product_attention"]

ATTENTION_IMPLEMENTATIONS = ("einsum", "xla", "cudnn")
"""How the built-in models may write attention (``GPTConfig.attention``,
``MixtralConfig.attention``)."""


def check_attention(value: str, where: str) -> None:
  if value not in ATTENTION_IMPLEMENTATIONS:
    raise ValueError(f"{where}={value!r}: use one of {ATTENTION_IMPLEMENTATIONS}")


def dot_product_attention(q, k, v, implementation: str):
  """Causal ``jax.nn.dot_product_attention`` of ``[B, T, N, H]`` queries and ``[B, S, K, H]``
  keys and values: ``implementation`` ``"xla"`` (``None`` to jax: the XLA composition in jax
  0.10 on every backend) or ``"cudnn"`` (cuDNN's fused kernel)."""
  return jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation=None if implementation == "xla" else "cudnn")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape and options of a GPT.

  Attributes:
    vocab_size, seq_len, hidden, num_heads, num_blocks, mlp_ratio: the usual.
    dropout: dropout rate after the embedding, on the attention weights and on each residual
      branch (active with ``train=True``).
    dtype: computation dtype.
    param_dtype: parameter dtype.
    fused_qkv: one ``[hidden, 3 * hidden]`` projection (Megatron/DeepSpeed) instead of three.
    key_bias: whether the key projection has a bias. A key bias only adds a per-query constant
      to the logits, which the softmax cancels: its gradient is zero in exact arithmetic and
      rounding noise in floating point (Whisper omits it for the same reason).
    softmax_dtype: dtype the attention softmax is computed in (``None``: ``dtype``).
    layer_marks: layer cuts marked per block: ``0`` (none: harpjax finds the layers), ``1``
      (after the embedding and after every block) or ``2`` (also between attention and MLP).
    attention: how attention is written: ``"einsum"`` (two einsums and a softmax, the
      default), ``"xla"`` (``jax.nn.dot_product_attention``, ``implementation=None``: the
      same composition, softmax in fp32) or ``"cudnn"`` (``implementation="cudnn"``: cuDNN's
      fused kernel, traceable only with cuDNN present or under
      :func:`harpjax._compat.tracing_cudnn_attention`; costed fused on GPU types with
      ``fused_attention``, docs/cost_model.md). The last two take no attention dropout.
  """
  vocab_size: int = 128
  seq_len: int = 16
  hidden: int = 32
  num_heads: int = 4
  num_blocks: int = 4
  mlp_ratio: int = 4
  dropout: float = 0.0
  dtype: str = "float32"
  param_dtype: str = "float32"
  fused_qkv: bool = False
  key_bias: bool = False
  softmax_dtype: str | None = None
  layer_marks: int = 1
  attention: str = "einsum"

  def __post_init__(self):
    if self.layer_marks not in (0, 1, 2):
      raise ValueError(f"GPTConfig.layer_marks={self.layer_marks}: use 0, 1 or 2")
    check_attention(self.attention, "GPTConfig.attention")
    if self.attention != "einsum" and self.dropout:
      raise ValueError(f"GPTConfig.attention={self.attention!r} takes no attention dropout "
                       f"(dropout={self.dropout}): use attention='einsum' or dropout=0")

  @property
  def num_params(self) -> int:
    h = self.hidden
    block = 12 * h * h + 13 * h
    return self.num_blocks * block + (self.vocab_size + self.seq_len) * h + 2 * h


GPT_39B = GPTConfig(vocab_size=51200, seq_len=1024, hidden=8192, num_heads=64, num_blocks=48,
                    dtype="float16", param_dtype="float16", key_bias=True,
                    softmax_dtype="float32", layer_marks=0)
GPT_15B = dataclasses.replace(GPT_39B, hidden=5120, num_heads=40)
GPT_2_6B = dataclasses.replace(GPT_39B, hidden=2560, num_heads=32, num_blocks=32)
GPT_TINY = dataclasses.replace(GPT_39B, vocab_size=256, seq_len=16, hidden=32, num_heads=4,
                               num_blocks=4, dtype="float32", param_dtype="float32")


class Attention(nn.Module):
  """Causal multi-head self-attention."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x, train: bool = False):
    c = self.config
    b, t, d = x.shape
    hd = d // c.num_heads
    dense = lambda n, name, bias=True: nn.Dense(n, dtype=c.dtype, param_dtype=c.param_dtype,
                                                use_bias=bias, name=name)
    if c.fused_qkv:
      q, k, v = jnp.split(dense(3 * d, "qkv")(x), 3, axis=-1)
    else:
      q, k, v = dense(d, "query")(x), dense(d, "key", c.key_bias)(x), dense(d, "value")(x)
    q, k, v = (y.reshape(b, t, c.num_heads, hd) for y in (q, k, v))
    if c.attention != "einsum":
      out = dot_product_attention(q, k, v, c.attention).reshape(b, t, d)
      return dense(d, "out")(out)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(c.dtype)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    logits = jnp.where(causal[None, None], logits, jnp.finfo(logits.dtype).min)
    if c.softmax_dtype is None:
      weights = nn.softmax(logits, axis=-1)
    else:
      weights = nn.softmax(logits.astype(c.softmax_dtype), axis=-1).astype(c.dtype)
    weights = nn.Dropout(c.dropout, deterministic=not train)(weights)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
    return dense(d, "out")(out)


class Block(nn.Module):
  """Pre-LayerNorm transformer block: attention and a GELU MLP, each with a residual."""
  config: GPTConfig

  @nn.compact
  def __call__(self, x, train: bool = False):
    c = self.config
    ln = lambda name: nn.LayerNorm(dtype=c.dtype, param_dtype=c.param_dtype, name=name)
    dense = lambda n, name: nn.Dense(n, dtype=c.dtype, param_dtype=c.param_dtype, name=name)
    h = ln("ln_attn")(x)
    h = Attention(c, name="attn")(h, train)
    x = x + nn.Dropout(c.dropout, deterministic=not train)(h)
    if c.layer_marks == 2:
      x = mark_layer_boundary(x)
    h = ln("ln_mlp")(x)
    h = nn.gelu(dense(c.hidden * c.mlp_ratio, "fc_in")(h))
    h = dense(c.hidden, "fc_out")(h)
    return x + nn.Dropout(c.dropout, deterministic=not train)(h)


class GPT(nn.Module):
  """Token ids ``[batch, seq]`` -> logits ``[batch, seq, vocab]``."""
  config: GPTConfig

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    c = self.config
    embed = nn.Embed(c.vocab_size, c.hidden, dtype=c.dtype, param_dtype=c.param_dtype,
                     name="embed")
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (c.seq_len, c.hidden),
                     c.param_dtype)
    x = embed(tokens) + pos[None, : tokens.shape[1]].astype(c.dtype)
    x = nn.Dropout(c.dropout, deterministic=not train)(x)
    if c.layer_marks:
      x = mark_layer_boundary(x)
    for i in range(c.num_blocks):
      x = Block(c, name=f"block_{i}")(x, train)
      if c.layer_marks:
        x = mark_layer_boundary(x)
    x = nn.LayerNorm(dtype=c.dtype, param_dtype=c.param_dtype, name="ln_f")(x)
    return embed.attend(x)


def lm_loss(logits, labels):
  """Mean token cross-entropy, computed in float32 (in float64 for float64 logits)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)),
                            axis=-1)
  return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()
