"""Runtime overhead: one pipelined step vs one ``jax.jit`` step on the same devices.

Measured side by side in one process, interleaved, median of repeats. The pipelined step is the
demo's (small GPT, 3 stages over 8 fake CPU devices, B microbatches); the references are
``jax.jit`` of the undecorated step with the batch sharded over the same 8 devices (pure data
parallelism) and on one device.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/overhead.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import harpjax
from harpjax.examples.demo import DEFAULT_CLUSTER, counting_batch, make_step
from harpjax.models import GPT, GPTConfig


def _time(fn, n):
  out = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(time.perf_counter() - t0)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=15)
  ap.add_argument("--microbatches", type=int, default=4)
  ap.add_argument("--hidden", type=int, default=64)
  args = ap.parse_args(argv)
  cfg = GPTConfig(vocab_size=256, seq_len=32, hidden=args.hidden, num_heads=4, num_blocks=4,
                  layer_marks=2)
  model = GPT(cfg)
  batch = 16
  params = model.init(jax.random.key(0), jnp.zeros((batch, cfg.seq_len), jnp.int32))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(3e-3))
  tokens = counting_batch(jax.random.key(1), batch, cfg.seq_len, cfg.vocab_size)
  rng = jax.random.key(2)
  plan = harpjax.ManualPlan([((0, 3), "v100", (1, 4), (2, 2)), ((4, 6), "a100", (1, 2), (2, 1)),
                             ((7, 9), "a100", (1, 2), (1, 2))])
  pstep = harpjax.auto_parallel(make_step(), cluster=DEFAULT_CLUSTER,
                                num_microbatches=args.microbatches, plan=plan)
  mesh = Mesh(np.array(jax.devices()[:8]), ("dp",))
  dp_state = jax.device_put(state, NamedSharding(mesh, P()))
  dp_tokens = jax.device_put(tokens, NamedSharding(mesh, P("dp")))
  jit8 = jax.jit(make_step())
  one = jax.devices()[0]
  jit1 = jax.jit(make_step())
  one_state, one_tokens = jax.device_put(state, one), jax.device_put(tokens, one)

  # Each run feeds its state back, as a training loop does.
  states = {"pipelined (3 stages, 8 devices)": state,
            "jax.jit, data parallel on 8 devices": dp_state, "jax.jit, 1 device": one_state}
  steps = {"pipelined (3 stages, 8 devices)": (pstep, tokens),
           "jax.jit, data parallel on 8 devices": (jit8, dp_tokens),
           "jax.jit, 1 device": (jit1, one_tokens)}

  def runner(name):
    fn, toks = steps[name]

    def go():
      states[name], loss = fn(states[name], toks, rng)
      return loss
    return go

  runs = {name: runner(name) for name in steps}
  for fn in runs.values():   # compile and warm up (twice: optimizer groups may recompile once)
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
  samples = {k: [] for k in runs}
  for _ in range(args.repeats):
    for k, fn in runs.items():
      samples[k] += _time(fn, 1)
  med = {k: statistics.median(v) for k, v in samples.items()}
  base = med["pipelined (3 stages, 8 devices)"]
  print(f"GPT hidden={args.hidden}, 10 layers, batch {batch}, B={args.microbatches}; median of "
        f"{args.repeats} interleaved steps")
  for k, v in med.items():
    print(f"  {k:40s} {v * 1e3:8.2f} ms   pipelined / this = {base / v:5.2f}")


if __name__ == "__main__":
  main()
