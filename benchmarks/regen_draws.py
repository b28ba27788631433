"""Dropout's random bits per microbatch: each microbatch's rows alone against the whole batch's.

A stage draws a batch-sized random value as its microbatch's rows of the full batch's draw, so
that its numbers are ``jax.jit``'s (``harpjax.compiler.trace.regen``). With threefry keys (drawn
by position) it hashes those rows alone; the baseline here is the earlier way, the full
batch's draw then a ``dynamic_slice`` (what ``regen`` still does for ``rbg`` keys), obtained by
treating the keys as not drawn by position. Side by side, in one process, on the GPT of
``benchmarks/fidelity.py`` (GPT-2-shaped, dropout 0.1, 16 sequences of 32 tokens) at B
microbatches on the demo cluster's planner plan, or on ``--plan dp4/dp2``:

* per stage, XLA's own account of the forward and backward executables the runtime compiles
  (``cost_analysis`` FLOPs, ``memory_analysis`` temporaries);
* the planner's predicted iteration time for the plan (the tables as this version costs
  them: each microbatch's own rows);
* the wall time of a step on this machine's CPUs emulating the cluster's devices
  (``--xla_force_host_platform_device_count``), median over ``--steps`` after one warm-up,
  and the loss of the first step of each (equal: the bits are the same).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
      python benchmarks/regen_draws.py --microbatches 8 --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import harpjax  # noqa: E402
from harpjax import _compat  # noqa: E402
from harpjax.compiler.profile import ProfileOptions  # noqa: E402
from harpjax.compiler.stages import compile_stage  # noqa: E402


@contextlib.contextmanager
def whole_batch_draws():
  """The baseline: no key draws by position, so every redrawn draw is the full batch's,
  sliced (the runtime's behaviour before draws by position, and its behaviour for ``rbg``)."""
  saved = _compat.threefry_key_words
  _compat.threefry_key_words = lambda keys: None
  try:
    yield
  finally:
    _compat.threefry_key_words = saved


def _xla(stage) -> dict:
  compiled = compile_stage(stage)
  out = {}
  for k in ("fwd", "bwd"):
    ca = compiled[k].cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    out[k] = (float(ca.get("flops", 0.0)), int(compiled[k].memory_analysis().temp_size_in_bytes))
  return out


def run(label: str, model, plan, microbatches: int, steps: int) -> dict:
  step = harpjax.auto_parallel(model.step, cluster=CLUSTER, num_microbatches=microbatches,
                               plan=plan)
  cs = step.compile(*model.args)
  stages = [_xla(st) for st in cs.stages]
  args = model.args
  walls, first_loss = [], None
  for k in range(steps + 1):
    t0 = time.perf_counter()
    out = step(*args)
    jax.block_until_ready(out)
    if k == 0:
      first_loss = float(out[1])
    else:
      walls.append(time.perf_counter() - t0)
    args = (out[0],) + tuple(args[1:])
  return dict(label=label, plan=cs.plan, stages=stages, wall_s=statistics.median(walls),
              loss=first_loss)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--microbatches", type=int, default=8)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--plan", default="planner", choices=("planner", "dp4/dp2"))
  a = p.parse_args(argv)
  model = fidelity.MODELS["gpt"]()
  probe = harpjax.auto_parallel(model.step, cluster=CLUSTER, num_microbatches=a.microbatches,
                                plan=harpjax.AutoPlan(profile=ProfileOptions(**fidelity.OPTS)))
  if a.plan == "planner":
    plan = probe.plan(*model.args)
  else:
    L = len(probe.profile(*model.args).layers)
    plan = dataclasses.replace(fidelity._manual(L, a.plan), num_microbatches=a.microbatches,
                               layer_source="auto")
  print(f"GPT (dropout 0.1), batch 16, B = {a.microbatches}, plan {a.plan}: " + "; ".join(
      f"{s.layers[0]}-{s.layers[1]} {s.subcluster} {tuple(s.logical_mesh)}"
      for s in plan.stages))
  print(f"planner's predicted iteration: {plan.predicted_iteration_s * 1e3:.3f} ms"
        if plan.predicted_iteration_s else "")
  rows = []
  with whole_batch_draws():
    rows.append(run("whole batch drawn, sliced", model, plan, a.microbatches, a.steps))
  rows.append(run("own rows drawn", model, plan, a.microbatches, a.steps))
  print("\n| draws | stage | fwd FLOPs | bwd FLOPs | fwd temp (B) | bwd temp (B) |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    for s, st in enumerate(r["stages"]):
      print(f"| {r['label']} | {s} | {st['fwd'][0]:.0f} | {st['bwd'][0]:.0f} | "
            f"{st['fwd'][1]} | {st['bwd'][1]} |")
  print("\n| draws | step wall (ms, median) | first loss |")
  print("|---|---|---|")
  for r in rows:
    print(f"| {r['label']} | {r['wall_s'] * 1e3:.1f} | {r['loss']:.6f} |")


from benchmarks import fidelity  # noqa: E402

CLUSTER = fidelity.CLUSTER

if __name__ == "__main__":
  main()
