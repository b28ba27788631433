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
    h = nn.tanh(nn.Dense(2 * HIDDEN)(x))
    drop = lambda h: jnp.where(jax.random.bernoulli(key, 0.7, h.shape), h, 0.0) / 0.7
    h = lax.cond(jnp.sum(h) > -1e30, drop, lambda h: h, h)
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
