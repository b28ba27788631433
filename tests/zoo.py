"""A zoo of small models as people write them, for float64 equivalence with ``jax.jit``.

Each builder returns a :class:`Case`: a train step (no layer markers), its initial state (all
floating leaves float64) and a few batches. Random draws sit everywhere a real model puts them:
at the top level, inside ``nn.scan``, ``nn.remat``, both, a ``while`` loop, a ``cond`` branch,
a nested ``jax.jit``; state flows through ``has_aux`` (mutable collections) and NNX.
Call the builders with ``jax_enable_x64`` on (see the ``x64`` fixture in ``test_zoo.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

import harpjax

WIDTH, HIDDEN, CLASSES, BATCH, BLOCKS = 12, 16, 5, 16, 4


@dataclasses.dataclass
class Case:
  step: Callable
  state: Any
  batches: list
  num_blocks: int = BLOCKS


def _f64(tree):
  return jax.tree_util.tree_map(
      lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _batches(n=3):
  return [{"x": jax.random.normal(jax.random.key(20 + i), (BATCH, WIDTH), jnp.float64),
           "y": jax.random.randint(jax.random.key(30 + i), (BATCH,), 0, CLASSES),
           "rng": jax.random.key(40 + i)} for i in range(n)]


def _dropout(module: nn.Module, x, rate=0.3):
  return nn.Dropout(rate, deterministic=False)(x)


# --------------------------------------------------------------------------- blocks


class Block(nn.Module):
  """Dense - tanh - dropout - Dense, residual."""

  @nn.compact
  def __call__(self, x):
    h = _dropout(self, nn.tanh(nn.Dense(2 * HIDDEN)(x)))
    return x + nn.Dense(x.shape[-1])(h)


class ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return Block()(x), None


class WhileBlock(nn.Module):
  """Block, then a mask drawn over a data-dependent number of rounds (a ``while`` loop)."""

  @nn.compact
  def __call__(self, x):
    x = Block()(x)
    key = self.make_rng("dropout")
    w = self.param("mix", nn.initializers.normal(0.3), (x.shape[-1], x.shape[-1]))
    rounds = 2 + (jnp.sum(jnp.abs(w)) > 0).astype(jnp.int32)   # 3, unknown statically

    def body(carry):
      i, mask = carry
      return i + 1, mask * jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, mask.shape)

    _, mask = lax.while_loop(lambda c: c[0] < rounds, body, (0, jnp.ones_like(x)))
    return x + jnp.tanh(x @ w) * mask


class CondBlock(nn.Module):
  """Block whose dropout sits in one branch of a traced ``cond``."""

  @nn.compact
  def __call__(self, x):
    key = self.make_rng("dropout")
    dense = nn.Dense(2 * HIDDEN)
    h = nn.tanh(dense(x))
    drop = lambda h: jnp.where(jax.random.bernoulli(key, 0.7, h.shape), h, 0.0) / 0.7
    # A predicate of the parameters: one over the batch's values would tie its examples
    # together (tests/test_coupling.py).
    h = lax.cond(jnp.sum(dense.variables["params"]["kernel"]) > -1e30, drop, lambda h: h, h)
    return x + nn.Dense(x.shape[-1])(h)


class JitBlock(nn.Module):
  """Block whose dropout runs in a nested ``jax.jit``."""

  @nn.compact
  def __call__(self, x):
    key = self.make_rng("dropout")
    h = nn.tanh(nn.Dense(2 * HIDDEN)(x))
    h = jax.jit(lambda k, h: jnp.where(jax.random.bernoulli(k, 0.7, h.shape), h, 0.0) / 0.7)(
        key, h)
    return x + nn.Dense(x.shape[-1])(h)


class ScanJitBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return JitBlock()(x), None


class Net(nn.Module):
  """Dense in, ``BLOCKS`` blocks arranged as ``kind`` says, Dense out."""
  kind: str = "loop"

  @nn.compact
  def __call__(self, x):
    x = _dropout(self, nn.Dense(HIDDEN)(x), 0.1)
    scan_kw = dict(variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                   length=BLOCKS)
    if self.kind == "loop":
      for i in range(BLOCKS):
        x = Block(name=f"block_{i}")(x)
    elif self.kind == "remat":
      for i in range(BLOCKS):
        x = nn.remat(Block)(name=f"block_{i}")(x)
    elif self.kind == "scan":
      x, _ = nn.scan(ScanBlock, **scan_kw)(name="blocks")(x, None)
    elif self.kind == "scan_remat":
      x, _ = nn.scan(nn.remat(ScanBlock), **scan_kw)(name="blocks")(x, None)
    elif self.kind == "remat_policy":
      policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
      for i in range(BLOCKS):
        x = nn.remat(Block, policy=policy)(name=f"block_{i}")(x)
    elif self.kind == "while":
      for i in range(BLOCKS):
        x = WhileBlock(name=f"block_{i}")(x)
    elif self.kind == "cond":
      for i in range(BLOCKS):
        x = CondBlock(name=f"block_{i}")(x)
    elif self.kind == "jit":
      for i in range(BLOCKS):
        x = JitBlock(name=f"block_{i}")(x)
    elif self.kind == "scan_jit":
      x, _ = nn.scan(ScanJitBlock, **scan_kw)(name="blocks")(x, None)
    else:
      raise ValueError(self.kind)
    return nn.Dense(CLASSES)(x)


KINDS = ("loop", "remat", "scan", "scan_remat", "remat_policy", "while", "cond", "jit",
         "scan_jit")


def linen(kind: str, tx=None) -> Case:
  """A :class:`Net` of ``kind`` trained with AdamW, dropout on."""
  return _classifier(Net(kind), tx or optax.adamw(1e-2))


def _classifier(model: nn.Module, tx) -> Case:
  """A softmax classifier step of ``model`` with the batch's dropout key."""
  batches = _batches()
  params = _f64(model.init({"params": jax.random.key(1), "dropout": jax.random.key(2)},
                           batches[0]["x"]))

  def step(state, batch):
    params, opt_state = state

    def loss_fn(p):
      logits = model.apply(p, batch["x"], rngs={"dropout": batch["rng"]})
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = harpjax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return Case(step, (params, tx.init(params)), batches)


# --------------------------------------------------------------------------- mutable state


class Tracked(nn.Module):
  """A block that keeps, in a mutable ``batch_stats`` collection, the running mean of its
  input (per-batch state updated from a batch mean: the microbatches' average is exact)."""

  @nn.compact
  def __call__(self, x):
    mean = self.variable("batch_stats", "mean", jnp.zeros, (x.shape[-1],), jnp.float64)
    out = Block()(x - mean.value)
    if not self.is_initializing():
      mean.value = 0.9 * mean.value + 0.1 * jnp.mean(x, axis=0)
    return out


class Stack(nn.Module):
  """Dense in, ``BLOCKS`` blocks of ``block`` (a module class), Dense out."""
  block: Any

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(HIDDEN)(x)
    for i in range(BLOCKS):
      x = self.block(name=f"block_{i}")(x)
    return nn.Dense(CLASSES)(x)


def batch_stats(tx=None) -> Case:
  """``has_aux`` returning a mutable collection and per-example logits; SGD with momentum."""
  model = Stack(Tracked)
  batches = _batches()
  variables = _f64(model.init({"params": jax.random.key(1), "dropout": jax.random.key(2)},
                              batches[0]["x"]))
  tx = tx or optax.sgd(0.1, momentum=0.9)

  def step(state, batch):
    params, stats, opt_state = state

    def loss_fn(p):
      logits, mutated = model.apply({"params": p, "batch_stats": stats}, batch["x"],
                                    rngs={"dropout": batch["rng"]}, mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
      return loss, (mutated["batch_stats"], logits)

    (loss, (stats, logits)), grads = harpjax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), stats, opt_state), (loss, logits)

  params = variables["params"]
  return Case(step, (params, variables["batch_stats"], tx.init(params)), batches)


# --------------------------------------------------------------------------- NNX


def nnx_model(tx=None) -> Case:
  """A Flax NNX model with dropout (``nnx.Dropout`` fed an ``nnx.Rngs`` of the batch's key),
  trained functionally: ``nnx.split`` outside the step, ``nnx.merge`` inside the loss."""
  from flax import nnx

  class NBlock(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(HIDDEN, 2 * HIDDEN, rngs=rngs, param_dtype=jnp.float64)
      self.b = nnx.Linear(2 * HIDDEN, HIDDEN, rngs=rngs, param_dtype=jnp.float64)
      self.drop = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x, rngs):
      return x + self.b(self.drop(jnp.tanh(self.a(x)), rngs=rngs))

  class NNet(nnx.Module):
    def __init__(self, rngs):
      self.inp = nnx.Linear(WIDTH, HIDDEN, rngs=rngs, param_dtype=jnp.float64)
      self.blocks = nnx.List([NBlock(rngs) for _ in range(BLOCKS)])
      self.out = nnx.Linear(HIDDEN, CLASSES, rngs=rngs, param_dtype=jnp.float64)

    def __call__(self, x, rngs):
      x = self.inp(x)
      for b in self.blocks:
        x = b(x, rngs)
      return self.out(x)

  model = NNet(nnx.Rngs(params=1, dropout=2))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = tx or optax.adam(1e-2)
  batches = _batches()

  def step(state, batch):
    params, rest, opt_state = state

    def loss_fn(p, rest):
      m = nnx.merge(graphdef, p, rest)
      logits = m(batch["x"], nnx.Rngs(dropout=batch["rng"]))
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
      return loss, {"logits": logits}

    (loss, aux), grads = harpjax.value_and_grad(loss_fn, has_aux=True)(params, rest)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), rest, opt_state), (loss, aux)

  return Case(step, (params, rest, tx.init(params)), batches)


# --------------------------------------------------------------------------- custom_vjp


@jax.custom_vjp
def custom_dropout(x, key):
  return jnp.where(jax.random.bernoulli(key, 0.7, x.shape), x, 0.0) / 0.7


def _custom_fwd(x, key):
  keep = jax.random.bernoulli(key, 0.7, x.shape)
  return jnp.where(keep, x, 0.0) / 0.7, keep


def _custom_bwd(keep, g):
  return jnp.where(keep, g, 0.0) / 0.7, None


custom_dropout.defvjp(_custom_fwd, _custom_bwd)


class CustomBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = custom_dropout(nn.tanh(nn.Dense(2 * HIDDEN)(x)), self.make_rng("dropout"))
    return x + nn.Dense(x.shape[-1])(h)


def custom_vjp(tx=None) -> Case:
  """Dropout inside a ``jax.custom_vjp`` function (cannot be aligned: a warning says so)."""
  return _classifier(Stack(CustomBlock), tx or optax.sgd(0.1))


# --------------------------------------------------------------------------- coupled batches
#
# Steps whose loss or model ties the examples of a batch together. Each is a
# :class:`CoupledCase`: ``loss_fn(params, extra, batch) -> (loss, (extra, aux))`` (``extra``: a
# mutable collection such as batch statistics, ``{}`` when there is none), the step built from
# it, and whether harpjax must reproduce ``jax.jit`` of the whole batch exactly (``exact``) or
# the average of ``jax.jit`` run on each microbatch, with a ``BatchCouplingWarning``.

SEQ, VOCAB, EXPERTS = 6, 11, 4


@dataclasses.dataclass
class CoupledCase:
  step: Callable
  state: Any
  batches: list
  loss_fn: Callable
  tx: Any
  exact: bool


def _coupled_step(loss_fn, tx):
  def step(state, batch):
    params, extra, opt_state = state
    (loss, (extra, aux)), grads = harpjax.value_and_grad(
        lambda p: loss_fn(p, extra, batch), has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), extra, opt_state), (loss, aux)
  return step


def per_microbatch_reference(case: CoupledCase, num_microbatches: int) -> Callable:
  """The step as every pipeline runs a coupled one: ``jax.jit`` of the loss on each microbatch,
  losses, gradients and mutable collections averaged, then the update."""
  def ref(state, batch):
    params, extra, opt_state = state
    rows = next(x.shape[0] for x in jax.tree_util.tree_leaves(batch)
                if x.ndim) // num_microbatches
    outs = []
    for m in range(num_microbatches):
      part = jax.tree_util.tree_map(
          lambda x: x[m * rows:(m + 1) * rows] if x.ndim else x, batch)
      outs.append(jax.value_and_grad(lambda p: case.loss_fn(p, extra, part), has_aux=True)(
          params))
    mean = lambda *xs: sum(xs) / num_microbatches
    loss = mean(*[o[0][0] for o in outs])
    new_extra = jax.tree_util.tree_map(mean, *[o[0][1][0] for o in outs])
    aux = jax.tree_util.tree_map(mean, *[o[0][1][1] for o in outs])
    grads = jax.tree_util.tree_map(mean, *[o[1] for o in outs])
    updates, opt_state = case.tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), new_extra, opt_state), (loss, aux)
  return jax.jit(ref)


class TokenNet(nn.Module):
  """Token ids -> logits over the vocabulary: embedding, ``BLOCKS`` residual blocks with
  dropout, a dense head."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, HIDDEN, param_dtype=jnp.float64)(tokens)
    for i in range(BLOCKS):
      x = Block(name=f"block_{i}")(x)
    return nn.Dense(VOCAB)(x)


def _token_batches(n=2, seed=0):
  out = []
  for i in range(n):
    k = jax.random.split(jax.random.key(seed + 100 + i), 5)
    lengths = jax.random.randint(k[0], (BATCH,), 1, SEQ + 1)    # padded batches
    mask = (jnp.arange(SEQ)[None, :] < lengths[:, None]).astype(jnp.float64)
    out.append({"tokens": jax.random.randint(k[1], (BATCH, SEQ), 0, VOCAB),
                "labels": jax.random.randint(k[2], (BATCH, SEQ), 0, VOCAB),
                "mask": mask, "weight": jax.random.uniform(k[3], (BATCH,), jnp.float64, 0.5, 2),
                "rng": k[4]})
  return out


def _token_case(loss_of, tx=None) -> CoupledCase:
  model = TokenNet()
  batches = _token_batches()
  params = _f64(model.init({"params": jax.random.key(1), "dropout": jax.random.key(2)},
                           batches[0]["tokens"]))["params"]
  tx = tx or optax.adam(1e-2)

  def loss_fn(p, extra, batch):
    logits = model.apply({"params": p}, batch["tokens"], rngs={"dropout": batch["rng"]})
    return loss_of(logits, batch), (extra, {"tokens": jnp.sum(batch["mask"])})
  return CoupledCase(_coupled_step(loss_fn, tx), (params, {}, tx.init(params)), batches,
                     loss_fn, tx, exact=True)


def masked_lm(tx=None) -> CoupledCase:
  """A masked language-model loss over padded sequences, normalised by the batch's number of
  valid tokens: ``sum(ce * mask) / sum(mask)`` (exact: the count is the whole batch's)."""
  def loss_of(logits, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    return jnp.sum(ce * batch["mask"]) / jnp.sum(batch["mask"])
  return _token_case(loss_of, tx)


def label_smoothing(tx=None) -> CoupledCase:
  """A token-normalised loss with label smoothing (exact)."""
  def loss_of(logits, batch):
    targets = optax.smooth_labels(jax.nn.one_hot(batch["labels"], VOCAB), 0.1)
    ce = optax.softmax_cross_entropy(logits, targets)
    return jnp.sum(ce * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)
  return _token_case(loss_of, tx)


def weighted_sequences(tx=None) -> CoupledCase:
  """A sequence-level loss (each sequence's mean token loss) with per-example weights
  normalised over the batch: ``sum(w * loss) / sum(w)`` (exact)."""
  def loss_of(logits, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    per_seq = jnp.sum(ce * batch["mask"], -1) / jnp.sum(batch["mask"], -1)
    w = batch["weight"]
    return jnp.sum(w * per_seq) / jnp.sum(w)
  return _token_case(loss_of, tx)


class Tower(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(HIDDEN)(x))
    return nn.Dense(HIDDEN)(x)


class TwoTowers(nn.Module):
  """Two encoders and a learned temperature (CLIP-style)."""

  @nn.compact
  def __call__(self, x, y):
    a, b = Tower(name="left")(x), Tower(name="right")(y)
    a = a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    b = b / jnp.linalg.norm(b, axis=-1, keepdims=True)
    scale = jnp.exp(self.param("log_scale", lambda k: jnp.asarray(1.0, jnp.float64)))
    return scale * a @ b.T


def _pair_batches(n=2):
  return [{"x": jax.random.normal(jax.random.key(200 + i), (BATCH, WIDTH), jnp.float64),
           "y": jax.random.normal(jax.random.key(300 + i), (BATCH, WIDTH), jnp.float64),
           "labels": jnp.arange(BATCH)} for i in range(n)]


def contrastive(tx=None, labels_from_data: bool = False) -> CoupledCase:
  """An in-batch contrastive loss (symmetric, CLIP-style): coupled. With
  ``labels_from_data`` the targets come with the batch (``batch["labels"]``), which a
  microbatch cannot use (refused)."""
  model = TwoTowers()
  batches = _pair_batches()
  params = _f64(model.init(jax.random.key(1), batches[0]["x"], batches[0]["y"]))["params"]
  tx = tx or optax.adam(1e-2)

  def loss_fn(p, extra, batch):
    logits = model.apply({"params": p}, batch["x"], batch["y"])
    labels = batch["labels"] if labels_from_data else jnp.arange(logits.shape[0])
    ce = optax.softmax_cross_entropy_with_integer_labels
    loss = 0.5 * (ce(logits, labels).mean() + ce(logits.T, labels).mean())
    return loss, (extra, {})
  return CoupledCase(_coupled_step(loss_fn, tx), (params, {}, tx.init(params)), batches,
                     loss_fn, tx, exact=False)


def ntxent(tx=None) -> CoupledCase:
  """SimCLR's NT-Xent: both views' embeddings concatenated along the batch, similarities of
  every pair but oneself, each example's positive the other view of it (targets
  ``(arange(2n) + n) % 2n`` computed from positions): coupled."""
  model = Tower()
  batches = _pair_batches()
  params = _f64(model.init(jax.random.key(1), batches[0]["x"]))["params"]
  tx = tx or optax.adam(1e-2)

  def loss_fn(p, extra, batch):
    z = model.apply({"params": p}, jnp.concatenate([batch["x"], batch["y"]], 0))
    z = z / jnp.linalg.norm(z, axis=-1, keepdims=True)
    n = batch["x"].shape[0]
    sim = z @ z.T / 0.5 - 1e9 * jnp.eye(2 * n)
    targets = (jnp.arange(2 * n) + n) % (2 * n)
    return optax.softmax_cross_entropy_with_integer_labels(sim, targets).mean(), (extra, {})
  return CoupledCase(_coupled_step(loss_fn, tx), (params, {}, tx.init(params)), batches,
                     loss_fn, tx, exact=False)


class NormNet(nn.Module):
  """Dense (no bias: batch norm removes it, so its gradient would be rounding noise), batch
  norm in training mode, tanh, dense."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(HIDDEN, use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=False, momentum=0.9, param_dtype=jnp.float64)(x)
    x = nn.Dense(HIDDEN)(nn.tanh(x))
    return nn.Dense(CLASSES)(nn.tanh(x))


def batch_norm(tx=None) -> CoupledCase:
  """Batch norm in training mode (statistics over the batch): coupled."""
  model = NormNet()
  batches = _batches(2)
  variables = _f64(model.init(jax.random.key(1), batches[0]["x"]))
  tx = tx or optax.sgd(0.1, momentum=0.9)

  def loss_fn(p, extra, batch):
    logits, mutated = model.apply({"params": p, **extra}, batch["x"], mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, (dict(mutated), {})
  extra = {"batch_stats": variables["batch_stats"]}
  return CoupledCase(_coupled_step(loss_fn, tx), (variables["params"], extra,
                                                  tx.init(variables["params"])),
                     batches, loss_fn, tx, exact=False)


class Top2Experts(nn.Module):
  """GShard-style top-2 mixture of experts over the batch's tokens: capacity slots per
  expert computed from the number of tokens (``capacity_factor * tokens * 2 / experts``),
  positions in them by a cumulative sum over the tokens, dispatch and combine one-hots."""
  capacity_factor: float

  @nn.compact
  def __call__(self, x):
    b, s, h = x.shape
    tokens = x.reshape(b * s, h)
    T, E = tokens.shape[0], EXPERTS
    capacity = int(self.capacity_factor * T * 2 / E)
    gates = jax.nn.softmax(nn.Dense(E, use_bias=False, name="router")(tokens))
    top, idx = lax.top_k(gates, 2)
    combine = jnp.zeros((T, E, capacity), x.dtype)
    taken = jnp.zeros((E,), jnp.int32)
    for k in range(2):
      onehot = jax.nn.one_hot(idx[:, k], E, dtype=jnp.int32)
      pos = (jnp.cumsum(onehot, axis=0) - 1 + taken[None, :]) * onehot
      keep = (onehot > 0) & (pos < capacity)
      slot = jax.nn.one_hot(pos, capacity, dtype=x.dtype) * keep[..., None]
      combine = combine + top[:, k, None, None] * slot
      taken = taken + jnp.sum(onehot, axis=0)
    dispatch = (combine > 0).astype(x.dtype)
    w_in = self.param("w_in", nn.initializers.lecun_normal(), (E, h, 2 * h), jnp.float64)
    w_out = self.param("w_out", nn.initializers.lecun_normal(), (E, 2 * h, h), jnp.float64)
    expert_in = jnp.einsum("tec,th->ech", dispatch, tokens)
    hidden = nn.gelu(jnp.einsum("ech,ehf->ecf", expert_in, w_in))
    out = jnp.einsum("tec,ecf->tf", combine, jnp.einsum("ecf,efh->ech", hidden, w_out))
    return x + out.reshape(b, s, h)


class MoENet(nn.Module):
  capacity_factor: float

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(HIDDEN)(x)
    x = Top2Experts(self.capacity_factor, name="moe")(nn.tanh(x))
    return nn.Dense(CLASSES)(x)


def moe_capacity(drops: bool, tx=None) -> CoupledCase:
  """A top-2 MoE whose capacity is computed from the batch's number of tokens, without an
  auxiliary loss. Without drops (capacity factor ``EXPERTS / 2``: every token fits) no token
  depends on another, and the pipelined step equals ``jax.jit``'s as well as the per-microbatch
  reference; with drops (factor 0.5) which tokens fit depends on the microbatch."""
  model = MoENet(0.5 if drops else EXPERTS / 2)
  batches = [{"x": jax.random.normal(jax.random.key(400 + i), (BATCH, SEQ // 2, WIDTH),
                                     jnp.float64),
              "y": jax.random.randint(jax.random.key(500 + i), (BATCH, SEQ // 2), 0, CLASSES)}
             for i in range(2)]
  params = _f64(model.init(jax.random.key(1), batches[0]["x"]))["params"]
  tx = tx or optax.adam(1e-2)

  def loss_fn(p, extra, batch):
    logits = model.apply({"params": p}, batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, (extra, {})
  return CoupledCase(_coupled_step(loss_fn, tx), (params, {}, tx.init(params)), batches,
                     loss_fn, tx, exact=False)


COUPLED = {"masked_lm": masked_lm, "label_smoothing": label_smoothing,
           "weighted_sequences": weighted_sequences, "contrastive": contrastive, "ntxent": ntxent,
           "batch_norm": batch_norm, "moe_no_drops": lambda: moe_capacity(False),
           "moe_drops": lambda: moe_capacity(True)}
"""The zoo of coupled steps, by name."""
