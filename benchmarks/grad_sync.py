"""Gradient synchronisation of data-parallel stages: once per step (replicas) vs every microbatch.

For a GPT whose first stage is data-parallel (``dp`` replicas), the stage is compiled twice as
the runtime runs it: with its replicas accumulating their own gradients and reducing them once
per step (``harpjax/compiler/stages/replicas.py``, what ``auto_parallel`` does), and as one SPMD
program over the replicas (``layout_step`` without the step traced at the replicas' rows),
whose backward all-reduces every microbatch. From XLA's optimized HLO it counts the all-reduces
and the bytes they move per step, and it times both steps side by side (median of several, the
same process; fake CPU devices, so the times say little about a GPU's network, the bytes do).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/grad_sync.py
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import harpjax  # noqa: E402
from benchmarks.lm_step import lm_train_step  # noqa: E402
from harpjax.compiler.stages import compile_stage, compile_step, layout_step  # noqa: E402
from harpjax.models import GPTConfig  # noqa: E402
from harpjax.runtime import run_step  # noqa: E402

CLUSTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "demo_local.yaml")
_BYTES = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "s32": 4, "u32": 4}


def all_reduce_bytes(hlo: str) -> tuple[int, int]:
  """``(count, bytes)`` of the all-reduce results in an optimized HLO module."""
  count = total = 0
  for line in hlo.splitlines():
    if " all-reduce(" not in line and " all-reduce-start(" not in line:
      continue
    result = line.split(" = ", 1)[1].split(" all-reduce", 1)[0]
    count += 1
    for dtype, dims in re.findall(r"([a-z]+[0-9]+)\[([0-9,]*)\]", result):
      n = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
      total += n * _BYTES.get(dtype, 4)
  return count, total


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--microbatches", type=int, default=4)
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args(argv)
  B = args.microbatches
  cfg = GPTConfig(vocab_size=512, seq_len=32, hidden=128, num_heads=4, num_blocks=4,
                  layer_marks=2)
  step_fn, state, tokens = lm_train_step(cfg, batch=8 * B)
  batches = [tokens] * args.steps
  n_layers = 2 + 2 * cfg.num_blocks
  plan = harpjax.ManualPlan([((0, n_layers // 2 - 1), "v100", (1, 4), (4, 1)),
                             ((n_layers // 2, n_layers - 1), "a100", (2, 2), (2, 2))])
  step = harpjax.auto_parallel(step_fn, cluster=CLUSTER, num_microbatches=B, plan=plan)
  cs = step.compile(state, batches[0])
  prog = cs.program
  plain = compile_step(layout_step(prog.traced, prog.layers, prog.plan, prog.schedule),
                       [list(st.mesh.devices.flat) for st in cs.stages])
  print(f"GPT hidden {cfg.hidden}, {cfg.num_blocks} blocks; B={B}; stage 1 on 4 V100 as "
        "(dp, tp) = (4, 1), stage 2 on 2 x 2 A100 as (2, 2)\n")
  print("| stage | sync | all-reduces per step | bytes per device per step | median step (ms) |")
  print("|---|---|---|---|---|")
  for name, compiled in (("once per step (replicas)", cs), ("every microbatch", plain)):
    times = []
    s = state
    for batch in batches:
      t0 = time.perf_counter()
      out = run_step(compiled, (s, batch))
      jax.block_until_ready(out)
      times.append(time.perf_counter() - t0)
      s = out[0]
    for k, st in enumerate(compiled.stages):
      c = compile_stage(st)
      n_b, bytes_b = all_reduce_bytes(c["bwd"].as_text())
      n_r, bytes_r = all_reduce_bytes(c["reduce"].as_text()) if "reduce" in c else (0, 0)
      print(f"| {k + 1} | {name} | {B * n_b + n_r} | {B * bytes_b + bytes_r} | "
            f"{np.median(times[1:]) * 1e3:.1f} |")


if __name__ == "__main__":
  main()
