"""Demo: train a small GPT pipelined over two emulated subclusters on 8 fake CPU devices.

Run with ``make demo`` (which sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8``), or::

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m harpjax.examples.demo
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import harpjax
from harpjax.models import GPT, GPTConfig

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CLUSTER = os.path.join(HERE, "demo_cluster.yaml")


def counting_batch(key, batch: int, seq: int, vocab: int):
  """Sequences that count up by a per-sequence stride: learnable, so the loss falls."""
  k1, k2 = jax.random.split(key)
  start = jax.random.randint(k1, (batch, 1), 0, vocab)
  stride = jax.random.randint(k2, (batch, 1), 1, 4)
  return (start + stride * jnp.arange(seq + 1)[None]) % vocab


def make_step():
  def train_step(state, tokens, rng):
    def loss_fn(params):
      logits = state.apply_fn(params, tokens[:, :-1], train=True, rngs={"dropout": rng})
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss
  return train_step


def train(step, state, args, cfg, batch: int, title: str) -> None:
  """Runs ``args.steps`` steps of ``step`` next to ``jax.jit`` of the same step."""
  print(f"=== {title}")
  reference = jax.jit(make_step())
  key = jax.random.key(42)
  ref_state = state
  times = []
  for i in range(args.steps):
    key, kb, kd = jax.random.split(key, 3)
    tokens = counting_batch(kb, batch, cfg.seq_len, cfg.vocab_size)
    t0 = time.perf_counter()
    step_args = (state, tokens, kd)
    state, loss = step(*step_args)
    loss = float(loss)
    times.append(time.perf_counter() - t0)
    ref_state, ref_loss = reference(ref_state, tokens, kd)
    if i == 0:
      print(f"layers: {step.trace(*step_args).layers}")
      profile = step.profile(*step_args)
      if profile is not None:
        print(f"profile: {profile.stats.describe()}")
      print()
      print(step.plan(*step_args).table(), "\n")
    print(f"step {i}: loss {loss:.4f}   (jax.jit: {float(ref_loss):.4f})   "
          f"{times[-1] * 1e3:7.1f} ms{'  (trace, plan, compile)' if i == 0 else ''}")
  pairs = list(zip(jax.tree_util.tree_leaves(ref_state.params),
                   jax.tree_util.tree_leaves(state.params)))
  num = sum(float(jnp.sum((a - b) ** 2)) for a, b in pairs) ** 0.5
  den = sum(float(jnp.sum(a ** 2)) for a, _ in pairs) ** 0.5
  steady = sorted(times[2:]) or times
  print(f"\nafter {args.steps} steps: |params - params(jax.jit)| / |params(jax.jit)| = "
        f"{num / den:.1e} (float32 summation order); median step "
        f"{steady[len(steady) // 2] * 1e3:.1f} ms\n")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--cluster", default=DEFAULT_CLUSTER)
  parser.add_argument("--microbatches", type=int, default=4)
  parser.add_argument("--plan", choices=["both", "auto", "manual"], default="both",
                      help="manual: a fixed 3-stage plan; auto: layers, profile and DP "
                           "planner; both (default): one after the other")
  args = parser.parse_args(argv)
  if jax.device_count() < 8:
    raise SystemExit("the demo needs 8 devices: set XLA_FLAGS=--xla_force_host_platform_"
                     "device_count=8 before starting Python (make demo does)")

  cfg = GPTConfig(vocab_size=256, seq_len=32, hidden=64, num_heads=4, num_blocks=4,
                  dropout=0.1, layer_marks=2)
  model = GPT(cfg)
  batch = 16
  params = model.init(jax.random.key(0), jnp.zeros((batch, cfg.seq_len), jnp.int32))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(3e-3))
  cluster = harpjax.Cluster.load(args.cluster)
  print(cluster.summary(), "\n")

  if args.plan in ("manual", "both"):
    # embed | 4 blocks x (attention | MLP) | head  ->  10 layers, 3 stages of different shapes.
    plan = harpjax.ManualPlan([
        ((0, 3), "v100", (1, 4), (2, 2)),   # 4 V100: 2-way data x 2-way tensor parallel
        ((4, 6), "a100", (1, 2), (2, 1)),   # 2 A100 on one host, data parallel
        ((7, 9), "a100", (1, 2), (1, 2)),   # 2 A100 on the other host, tensor parallel
    ], schedule="h1f1b")
    step = harpjax.auto_parallel(make_step(), cluster=cluster,
                                 num_microbatches=args.microbatches, plan=plan)
    train(step, state, args, cfg, batch, "a manual 3-stage plan")
  if args.plan in ("auto", "both"):
    step = harpjax.auto_parallel(make_step(), cluster=cluster,
                                 num_microbatches=args.microbatches)
    train(step, state, args, cfg, batch,
          "planned automatically (layers, jaxpr costs for V100/A100, DP; the profile is "
          "cached on disk)")


if __name__ == "__main__":
  main()
