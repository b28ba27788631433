"""Time to the end of the first step: executables compiled ahead in threads vs lazily.

``auto_parallel``'s local runtime compiles every stage's forward, backward and zeros
executables and the placement groups when the step is compiled, one stage per thread
(``runtime=harpjax.LocalRuntime(compile_workers=n)``); ``compile_workers=0`` leaves them to ``jax.jit``,
one after another during the first call. Each measurement runs in a fresh process (JAX caches
compilations per process); modes are interleaved and the median of the repeats is reported.

  python benchmarks/compile.py [--repeats 3] [--hidden 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PLAN = [((0, 2), "v100", (1, 2), (2, 1)), ((3, 4), "v100", (1, 2), (1, 2)),
        ((5, 7), "a100", (1, 2), (2, 1)), ((8, 9), "a100", (1, 2), (1, 2))]


def child(workers: int, hidden: int) -> dict:
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  import jax
  import jax.numpy as jnp
  import optax
  from flax.training import train_state

  import harpjax
  from harpjax.examples.demo import DEFAULT_CLUSTER, counting_batch, make_step
  from harpjax.models import GPT, GPTConfig

  cfg = GPTConfig(vocab_size=256, seq_len=32, hidden=hidden, num_heads=4, num_blocks=4,
                  layer_marks=2)
  model = GPT(cfg)
  params = model.init(jax.random.key(0), jnp.zeros((16, cfg.seq_len), jnp.int32))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(3e-3))
  tokens = counting_batch(jax.random.key(1), 16, cfg.seq_len, cfg.vocab_size)
  rng = jax.random.key(2)
  pstep = harpjax.auto_parallel(make_step(), cluster=DEFAULT_CLUSTER, num_microbatches=4,
                                plan=harpjax.ManualPlan(PLAN),
                                runtime=harpjax.LocalRuntime(compile_workers=workers))
  jax.block_until_ready((state, tokens))
  t0 = time.perf_counter()
  pstep.compile(state, tokens, rng)
  t1 = time.perf_counter()
  out = pstep(state, tokens, rng)
  jax.block_until_ready(out)
  t2 = time.perf_counter()
  out = pstep(out[0], tokens, rng)
  jax.block_until_ready(out)
  t3 = time.perf_counter()
  return {"compile_s": t1 - t0, "first_step_s": t2 - t1, "to_first_s": t2 - t0,
          "second_step_s": t3 - t2}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--hidden", type=int, default=64)
  ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child is not None:
    print(json.dumps(child(args.child, args.hidden)))
    return
  cpus = os.cpu_count() or 1
  modes = {"lazy (jit on first call)": 0, "ahead, 1 thread": 1,
           f"ahead, {min(cpus, len(PLAN))} threads": min(cpus, len(PLAN))}
  runs = {m: [] for m in modes}
  for _ in range(args.repeats):
    for name, w in modes.items():
      res = subprocess.run([sys.executable, __file__, "--child", str(w), "--hidden",
                            str(args.hidden)], capture_output=True, text=True, check=True)
      runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
  base = statistics.median(r["to_first_s"] for r in runs["lazy (jit on first call)"])
  print(f"{len(PLAN)} stages, GPT hidden={args.hidden}, {cpus} CPUs, median of {args.repeats} "
        "fresh processes\n")
  print(f"{'mode':<28}{'compile s':>11}{'first step s':>14}{'to first s':>12}{'ratio':>8}"
        f"{'second step s':>15}")
  for name, rs in runs.items():
    med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    print(f"{name:<28}{med['compile_s']:>11.2f}{med['first_step_s']:>14.2f}"
          f"{med['to_first_s']:>12.2f}{med['to_first_s'] / base:>8.2f}"
          f"{med['second_step_s']:>15.3f}")


if __name__ == "__main__":
  main()
