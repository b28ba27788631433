"""A Mixtral-shaped mixture-of-experts transformer (Flax linen).

Every block is RMSNorm → causal self-attention (rotary positions, grouped-query attention
when ``num_kv_heads < num_heads``) → RMSNorm → a routed feed-forward layer
(:class:`MoEFeedForward`): a router picks the top ``k`` of ``num_experts`` SwiGLU experts per
token, tokens are dispatched to them with a capacity, and their outputs are combined weighted
by the router's probabilities. The model returns the logits and the load-balancing auxiliary
loss; :func:`mixtral_loss` adds it to the token cross-entropy with ``aux_loss_coef``.

**Routing** (:func:`route`, a pure function tested against a NumPy reference). Tokens are
routed in *groups*: ``routing_group="batch"`` makes all tokens of the batch one group (Switch,
Mixtral), ``"sequence"`` makes each sequence a group (GShard's groups). In each group of ``S``
tokens:

* ``probs = softmax(router(x))`` over the experts; each token takes its ``k`` most probable
  experts; its weights are their probabilities renormalised over the ``k`` (Mixtral) when
  ``k = 2``, the probability itself when ``k = 1`` (Switch; renormalising one weight would
  give 1 and no gradient to the router).
* Each expert has ``capacity = min(S, ceil(capacity_factor * S * k / num_experts))`` slots
  (``capacity_factor=None``: ``S``, so that nothing can be dropped). A token's position in its
  expert is a cumulative sum over the group's tokens in order, first choices of every token
  before second choices (GShard); a choice whose position is ``>= capacity`` is dropped: it
  contributes nothing, and the token's other choice keeps its weight (not renormalised again).
  A token with every choice dropped passes through the block's residual unchanged.
* The auxiliary loss is the Switch form per group, ``E * sum_e f_e * P_e`` with ``f_e`` the
  fraction of the group's ``S * k`` choices that went to expert ``e`` (before capacity) and
  ``P_e`` the mean router probability of ``e``; 1 for a perfectly balanced router. It is
  averaged over the groups and over the blocks. (For ``k = 2`` this is half of the value
  Hugging Face's Mixtral ``load_balancing_loss_func`` computes per layer, which counts each
  choice rank's fractions separately and so is ``k`` at balance.)

**Dispatch tensor, not gather/scatter.** Dispatch and combine are one-hot tensors
``[groups, tokens, experts, capacity]`` contracted with ``einsum`` (GShard, Mesh TensorFlow),
rather than a gather of token rows by index and a scatter-add back. An expert axis shards the
``experts`` dimension of these einsums and of the expert weights, and XLA's partitioner turns
the contraction over tokens into the all-to-all of expert parallelism; the same einsums are
matmuls that harpjax's layer construction, tensor-parallel rules and cost model already read
(a gather or scatter with data-dependent indices is partitioned by replicating its operand).
The price is memory: ``tokens * experts * capacity`` per group, quadratic in the group's size,
which ``routing_group="sequence"`` bounds by the sequence length.

**Examples of a batch.** With ``routing_group="batch"`` the capacity, the positions in the
experts and the auxiliary loss are decided over all the batch's tokens: a pipeline computes
them per microbatch, and harpjax says so (docs/microbatches.md). With ``"sequence"`` every
example is routed on its own and the auxiliary loss is a mean over the examples: the model
pipelines exactly, drops and auxiliary loss included.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from harpjax.models.gpt import check_attention, dot_product_attention

__all__ = ["MixtralConfig", "Mixtral", "MixtralBlock", "MoEFeedForward", "GQAttention",
           "Routing", "route", "expert_capacity", "mixtral_loss", "MIXTRAL_8X7B",
           "MIXTRAL_TINY"]

ROUTING_GROUPS = ("batch", "sequence")


@dataclasses.dataclass(frozen=True)
class MixtralConfig:
  """Shape and options of a Mixtral-shaped MoE transformer.

  Attributes:
    vocab_size, seq_len, hidden, num_heads, num_blocks: the usual.
    num_kv_heads: key/value heads (grouped-query attention); ``None``: ``num_heads``.
    ffn_hidden: hidden size of each SwiGLU expert.
    num_experts: experts per block (``E``).
    top_k: experts per token, 1 (Switch) or 2 (Mixtral).
    capacity_factor: slots per expert are ``ceil(capacity_factor * S * top_k / E)`` for a
      group of ``S`` tokens, at most ``S``; ``None``: ``S`` (nothing is ever dropped).
    routing_group: ``"batch"`` (all tokens of the batch route together: Switch, Mixtral) or
      ``"sequence"`` (each sequence routes on its own: GShard groups).
    aux_loss_coef: weight of the load-balancing loss in :func:`mixtral_loss` (Mixtral's
      ``router_aux_loss_coef``, 0.02).
    rope_theta: base of the rotary position frequencies.
    norm_eps: RMSNorm epsilon.
    dtype: computation dtype.
    param_dtype: parameter dtype.
    router_dtype: dtype of the router's logits and softmax; ``None``: ``dtype`` promoted to
      at least float32.
    attention: ``"einsum"`` (the default), ``"xla"`` or ``"cudnn"``:
      ``jax.nn.dot_product_attention`` with ``implementation=None`` or ``"cudnn"``, as
      ``GPTConfig.attention`` says.
  """
  vocab_size: int = 128
  seq_len: int = 16
  hidden: int = 32
  num_heads: int = 4
  num_kv_heads: int | None = None
  num_blocks: int = 2
  ffn_hidden: int = 64
  num_experts: int = 8
  top_k: int = 2
  capacity_factor: float | None = 1.25
  routing_group: str = "batch"
  aux_loss_coef: float = 0.02
  rope_theta: float = 1e6
  norm_eps: float = 1e-5
  dtype: str = "float32"
  param_dtype: str = "float32"
  router_dtype: str | None = None
  attention: str = "einsum"

  def __post_init__(self):
    def positive_int(name, value):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MixtralConfig.{name}={value!r} must be an integer >= 1")
    for name in ("vocab_size", "seq_len", "hidden", "num_heads", "num_blocks", "ffn_hidden",
                 "num_experts"):
      positive_int(name, getattr(self, name))
    if self.num_kv_heads is not None:
      positive_int("num_kv_heads", self.num_kv_heads)
    if self.top_k not in (1, 2) or isinstance(self.top_k, bool):
      raise ValueError(f"MixtralConfig.top_k={self.top_k!r}: use 1 or 2")
    if self.top_k > self.num_experts:
      raise ValueError(f"MixtralConfig.top_k={self.top_k} exceeds num_experts="
                       f"{self.num_experts}")
    if self.hidden % self.num_heads or (self.hidden // self.num_heads) % 2:
      raise ValueError(f"MixtralConfig.hidden={self.hidden} must be num_heads="
                       f"{self.num_heads} times an even head size (rotary positions)")
    if self.num_heads % self.kv_heads:
      raise ValueError(f"MixtralConfig.num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.kv_heads}")
    cf = self.capacity_factor
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float))
                           or not math.isfinite(cf) or cf <= 0):
      raise ValueError(f"MixtralConfig.capacity_factor={cf!r} must be a number > 0, or None "
                       "for no drops")
    check_attention(self.attention, "MixtralConfig.attention")
    if self.routing_group not in ROUTING_GROUPS:
      raise ValueError(f"MixtralConfig.routing_group={self.routing_group!r}: use one of "
                       f"{ROUTING_GROUPS}")
    coef = self.aux_loss_coef
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) \
        or coef < 0:
      raise ValueError(f"MixtralConfig.aux_loss_coef={coef!r} must be a number >= 0")

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def num_params(self) -> int:
    h, f, E, hd = self.hidden, self.ffn_hidden, self.num_experts, self.hidden // self.num_heads
    attn = 2 * h * h + 2 * h * self.kv_heads * hd
    block = attn + E * 3 * h * f + h * E + 2 * h
    return self.num_blocks * block + 2 * self.vocab_size * h + h


MIXTRAL_8X7B = MixtralConfig(vocab_size=32000, seq_len=4096, hidden=4096, num_heads=32,
                             num_kv_heads=8, num_blocks=32, ffn_hidden=14336,
                             dtype="bfloat16", param_dtype="bfloat16")
"""Mixtral 8x7B's shape (46.7 B parameters), top-2 of 8 experts, capacity factor 1.25."""

MIXTRAL_TINY = MixtralConfig(vocab_size=256, seq_len=16, hidden=32, num_heads=4,
                             num_kv_heads=2, num_blocks=4, ffn_hidden=64)
"""A small Mixtral (4 blocks, hidden 32, GQA 4/2 heads, top-2 of 8 experts) for tests."""


# --------------------------------------------------------------------------- routing


class Routing(NamedTuple):
  """What :func:`route` decides for ``G`` groups of ``S`` tokens, ``E`` experts, ``C`` slots.

  Attributes:
    dispatch: ``[G, S, E, C]`` 1 where a token occupies an expert's slot, else 0.
    combine: ``[G, S, E, C]`` the token's weight for that expert where it occupies the slot.
    probs: ``[G, S, E]`` router probabilities.
    experts: ``[G, S, k]`` chosen experts, most probable first.
    aux_loss: scalar: the load-balancing loss averaged over the groups.
  """
  dispatch: jax.Array
  combine: jax.Array
  probs: jax.Array
  experts: jax.Array
  aux_loss: jax.Array


def expert_capacity(tokens: int, num_experts: int, top_k: int,
                    capacity_factor: float | None) -> int:
  """Slots per expert for a group of ``tokens``: ``min(tokens, ceil(factor * tokens * k /
  E))``, or ``tokens`` when ``capacity_factor`` is ``None``."""
  if capacity_factor is None:
    return tokens
  return max(1, min(tokens, int(math.ceil(capacity_factor * tokens * top_k / num_experts))))


def route(logits: jax.Array, top_k: int, capacity: int, dtype=None) -> Routing:
  """Top-``k`` routing with capacity (see the module docstring).

  Args:
    logits: ``[G, S, E]`` router logits per group of ``S`` tokens.
    top_k: 1 or 2.
    capacity: slots per expert (:func:`expert_capacity`).
    dtype: dtype of ``dispatch`` and ``combine``; default ``logits.dtype``.

  Returns:
    The :class:`Routing`.
  """
  dtype = dtype or logits.dtype
  G, S, E = logits.shape
  probs = jax.nn.softmax(logits, axis=-1)
  top, experts = lax.top_k(probs, top_k)                             # [G, S, k]
  weights = top / jnp.sum(top, axis=-1, keepdims=True) if top_k > 1 else top
  dispatch = jnp.zeros((G, S, E, capacity), dtype)
  combine = jnp.zeros((G, S, E, capacity), dtype)
  taken = jnp.zeros((G, 1, E), jnp.int32)                            # slots already used
  chosen = jnp.zeros((G, E), probs.dtype)
  for j in range(top_k):                                             # first choices first
    onehot = jax.nn.one_hot(experts[..., j], E, dtype=jnp.int32)     # [G, S, E]
    position = jnp.sum((jnp.cumsum(onehot, axis=1) - 1 + taken) * onehot, axis=-1)   # [G, S]
    slot = jax.nn.one_hot(position, capacity, dtype=dtype) * (position < capacity)[..., None]
    placed = onehot.astype(dtype)[..., None] * slot[..., None, :]    # [G, S, E, C]
    dispatch = dispatch + placed
    combine = combine + weights[..., j, None, None].astype(dtype) * placed
    taken = taken + jnp.sum(onehot, axis=1, keepdims=True)
    chosen = chosen + jnp.sum(onehot, axis=1).astype(probs.dtype)
  fraction = chosen / (S * top_k)                                    # f_e per group
  mean_prob = jnp.mean(probs, axis=1)                                # P_e per group
  aux = jnp.mean(E * jnp.sum(fraction * mean_prob, axis=-1))
  return Routing(dispatch, combine, probs, experts, aux)


# --------------------------------------------------------------------------- layers


def _router_dtype(c: MixtralConfig):
  return jnp.dtype(c.router_dtype) if c.router_dtype else \
      jnp.promote_types(jnp.dtype(c.dtype), jnp.float32)


class MoEFeedForward(nn.Module):
  """Routed SwiGLU experts: ``[b, s, h] -> ([b, s, h], aux_loss)``.

  Router, dispatch, experts, combine: the routed block harpjax's layer construction marks
  (``Module.routed``, docs/layers.md).
  """
  config: MixtralConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    b, s, h = x.shape
    E, f = c.num_experts, c.ffn_hidden
    groups = x.reshape(1, b * s, h) if c.routing_group == "batch" else x
    G, S, _ = groups.shape
    capacity = expert_capacity(S, E, c.top_k, c.capacity_factor)
    rdtype = _router_dtype(c)
    logits = nn.Dense(E, use_bias=False, dtype=rdtype, param_dtype=c.param_dtype,
                      name="router")(groups)
    r = route(logits, c.top_k, capacity, dtype=c.dtype)
    init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2,
                                            out_axis=-1, batch_axis=(0,))
    w_gate = self.param("w_gate", init, (E, h, f), c.param_dtype).astype(c.dtype)
    w_up = self.param("w_up", init, (E, h, f), c.param_dtype).astype(c.dtype)
    w_down = self.param("w_down", init, (E, f, h), c.param_dtype).astype(c.dtype)
    xin = jnp.einsum("gsec,gsh->egch", r.dispatch, groups)              # [E, G, C, h]
    hid = nn.silu(jnp.einsum("egch,ehf->egcf", xin, w_gate)) * \
        jnp.einsum("egch,ehf->egcf", xin, w_up)
    out = jnp.einsum("egcf,efh->egch", hid, w_down)
    y = jnp.einsum("gsec,egch->gsh", r.combine, out)
    return y.reshape(b, s, h), r.aux_loss


def _rope(x, theta: float):
  """Rotary positions on ``[b, s, heads, d]`` (rotate-half form)."""
  s, d = x.shape[1], x.shape[-1]
  wide = jnp.promote_types(x.dtype, jnp.float32)
  inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=wide) / d))
  angles = jnp.arange(s, dtype=wide)[:, None] * inv[None, :]               # [s, d/2]
  cos = jnp.cos(angles).astype(x.dtype)[None, :, None, :]
  sin = jnp.sin(angles).astype(x.dtype)[None, :, None, :]
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class GQAttention(nn.Module):
  """Causal self-attention with rotary positions; ``num_kv_heads`` key/value heads shared by
  groups of query heads (grouped-query attention; plain multi-head when equal)."""
  config: MixtralConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    b, s, h = x.shape
    H, K = c.num_heads, c.kv_heads
    hd = h // H
    dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=c.dtype,
                                     param_dtype=c.param_dtype, name=name)
    q = _rope(dense(H * hd, "query")(x).reshape(b, s, H, hd), c.rope_theta)
    k = _rope(dense(K * hd, "key")(x).reshape(b, s, K, hd), c.rope_theta)
    v = dense(K * hd, "value")(x).reshape(b, s, K, hd)
    if c.attention != "einsum":   # grouped-query heads: jax groups them itself
      out = dot_product_attention(q, k, v, c.attention).reshape(b, s, H * hd)
      return dense(h, "out")(out)
    q = q.reshape(b, s, K, H // K, hd)
    logits = jnp.einsum("bqkrd,bskd->bkrqs", q, k) / jnp.sqrt(hd).astype(c.dtype)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    weights = nn.softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)),
                         axis=-1).astype(c.dtype)
    out = jnp.einsum("bkrqs,bskd->bqkrd", weights, v).reshape(b, s, H * hd)
    return dense(h, "out")(out)


class MixtralBlock(nn.Module):
  """Pre-RMSNorm block: grouped-query attention, then the routed experts; returns the block's
  output and its load-balancing loss."""
  config: MixtralConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    norm = lambda name: nn.RMSNorm(epsilon=c.norm_eps, dtype=c.dtype,
                                   param_dtype=c.param_dtype, name=name)
    x = x + GQAttention(c, name="attn")(norm("norm_attn")(x))
    y, aux = MoEFeedForward(c, name="moe")(norm("norm_moe")(x))
    return x + y, aux


class Mixtral(nn.Module):
  """Token ids ``[batch, seq]`` -> ``(logits [batch, seq, vocab], aux_loss)``; ``aux_loss``
  is the load-balancing loss averaged over the blocks (unweighted: see :func:`mixtral_loss`)."""
  config: MixtralConfig

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    x = nn.Embed(c.vocab_size, c.hidden, dtype=c.dtype, param_dtype=c.param_dtype,
                 name="embed")(tokens)
    aux = []
    for i in range(c.num_blocks):
      x, a = MixtralBlock(c, name=f"block_{i}")(x)
      aux.append(a)
    x = nn.RMSNorm(epsilon=c.norm_eps, dtype=c.dtype, param_dtype=c.param_dtype,
                   name="norm_f")(x)
    logits = nn.Dense(c.vocab_size, use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype,
                      name="lm_head")(x)
    return logits, sum(aux) / len(aux)


def mixtral_loss(outputs, labels, aux_loss_coef: float):
  """Mean token cross-entropy (in float32 or wider) plus ``aux_loss_coef`` times the
  load-balancing loss, from ``Mixtral``'s ``(logits, aux_loss)``."""
  logits, aux = outputs
  logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), -1)
  ce = -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()
  return ce + aux_loss_coef * aux.astype(ce.dtype)
