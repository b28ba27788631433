"""Per-device peak memory of compiled stages at every ZeRO level: XLA vs the memory model.

For each model, plan and ZeRO level, every stage is compiled as the runtime runs it and
:func:`harpjax.compiler.stages.memory_report` follows one step on one device of it with XLA's
``memory_analysis()`` of the forward, backward and optimizer update (*XLA*). The model
(:func:`harpjax.compiler.profile.stage_memory`) predicts the peak from the stage's parameter,
gradient, optimizer-state and activation bytes without ZeRO, the level and ``dp``: *model*
takes those bytes from the stage's arrays (the activation bytes from XLA's forward), *tables*
from the cost tables the planner reads (jaxpr source: parameters per device times 4 + 4 + 8
bytes of float32 Adam, the layers' residual and workspace estimates), the rest as *model*
gets it (:func:`from_tables`), and *planner* is the number the planner itself checks the
stage with (:func:`planner_peak`: the variant's fixed bytes in the tables plus its in-flight
residuals, or the reduction's and update's peak, the profile's tables priced for float32
Adam, 16 bytes per parameter of which 8 optimizer state). Levels marked
"+ offload" keep the optimizer state in host memory between steps
(``harpjax.OffloadOptions``; XLA:CPU's host memory is the same RAM, accounted apart).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/memory.py
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import harpjax  # noqa: E402
from harpjax.compiler.layers import sharding  # noqa: E402
from harpjax.compiler.plan.variants import tables_for_stages, variant_slot  # noqa: E402
from harpjax.errors import PlanError  # noqa: E402
from harpjax.compiler.profile import (ProfileOptions, pieces, profile_step,  # noqa: E402
                                      stage_memory, tables_for_plan)
from harpjax.compiler.trace import aval_size  # noqa: E402
from harpjax.compiler.stages import memory_report  # noqa: E402
from benchmarks.lm_step import lm_train_step  # noqa: E402
from harpjax.models import GPTConfig  # noqa: E402

CLUSTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "demo_local.yaml")

MODELS = {   # name: (hidden, seq_len, vocab, blocks, batch)
    "gpt-h128-s32": (128, 32, 512, 4, 16),
    "gpt-h256-s8": (256, 8, 1024, 4, 16),
}
PLANS = {    # name: per stage (subcluster, submesh, logical mesh); layers split in half
    "dp4|dp2": [("v100", (1, 4), (4, 1)), ("a100", (1, 2), (2, 1))],
    "dp2tp2|dp4": [("v100", (1, 4), (2, 2)), ("a100", (2, 2), (4, 1))],
}


def gpt_step(hidden, seq_len, vocab, blocks, batch):
  return lm_train_step(GPTConfig(vocab_size=vocab, seq_len=seq_len, hidden=hidden,
                                 num_heads=4, num_blocks=blocks), batch)


def shared_params(layers, num_layers_range, tp):
  """Parameter elements per device that layers ``i..j`` read but an earlier stage owns (a
  tied embedding read again by the head): the stage holds them and their gradient, their
  owner their optimizer state and update."""
  i, j = num_layers_range
  if i == 0:
    return 0.0
  dep = pieces.batch_dependent(layers.program, layers.input_kinds)
  mine = pieces.build_piece(layers, i, j, dep)
  before = set(pieces.build_piece(layers, 0, i - 1, dep).param_ids)
  specs = sharding.param_specs(mine.program, mine.ops, mine.param_ids, tp)
  return float(sum(aval_size(mine.program.avals[v]) / (tp if specs[v] != P() else 1)
                   for v in mine.param_ids if v in before))


def from_tables(costs, layers, num_layers_range, mesh_key, dp, zero, in_flight, offload):
  """The model's peak from the cost tables' per-layer numbers (float32 Adam), with the other
  inputs :func:`~harpjax.compiler.stages.memory_report` gives the model: the residuals summed
  and the largest workspace over the stage's layers, what the stage's last layer sends on
  (split over ``dp``), data-parallel replicas that accumulate their own gradients and reduce
  them once per step at levels 0 and 1 (``replicas=True``, as the runtime compiles them and
  the planner's tables assume), and parameters another stage owns (:func:`shared_params`:
  their optimizer state is not this stage's; the per-layer tables charge it to every stage
  that reads them)."""
  i, j = num_layers_range
  arr = costs[mesh_key]
  n = float(np.sum(arr["param_mem_bytes"][i:j + 1])) / 16.0
  shared = shared_params(layers, num_layers_range, mesh_key[2][1])
  mem = stage_memory(param_bytes=4 * n, grad_bytes=4 * n, opt_bytes=8 * (n - shared),
                     act_bytes=float(np.sum(arr["act_mem_bytes"][i:j + 1])), dp=dp, zero=zero,
                     out_bytes=layers[j].boundary_bytes / dp if j + 1 < len(layers) else 0.0,
                     workspace_bytes=float(np.max(arr["temp_bytes"][i:j + 1])),
                     shared_param_bytes=4 * shared, offload_optimizer=offload, replicas=True)
  return mem.peak_bytes(in_flight)


def planner_peak(prof, plan, stage: int, in_flight: int, offload: bool) -> float:
  """What the planner checks stage ``stage`` of ``plan`` with: the tables' fixed bytes of its
  variant plus ``in_flight`` microbatches' residuals, or the peak after the pipeline
  (reduction, update) if larger (the one memory model, :func:`harpjax.compiler.plan.variants.
  memory_model`)."""
  stages = [dataclasses.replace(st, offload=offload) for st in plan.stages]
  try:
    tables = tables_for_stages(tables_for_plan(prof, plan), stages)
  except PlanError:   # offload without the cluster's link to host memory: not priced
    return math.nan
  spec = stages[stage]
  k = tables.subcluster_index(spec.subcluster)
  i, j = spec.layers
  v = variant_slot(tables, k, spec.submesh, spec.zero, spec.offload)
  fixed = float(tables.param_mem_bytes[k][i, j, v])
  act = float(tables.act_mem_bytes[k][i, j, v])
  step = float(tables.step_mem_bytes[k][i, j, v]) if tables.step_mem_bytes is not None else 0
  return max(fixed + in_flight * act, step)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
  ap.add_argument("--plans", nargs="*", default=list(PLANS), choices=list(PLANS))
  ap.add_argument("--microbatches", type=int, default=4)
  ap.add_argument("--offload", nargs="*", type=int, default=[0, 2],
                  help="ZeRO levels also run with the optimizer state offloaded to host memory")
  args = ap.parse_args(argv)
  cluster = harpjax.Cluster.load(CLUSTER)
  mib = lambda b: f"{b / 2**20:.2f}"
  print("| model | plan | stage | (dp, tp) | zero | N | params | grads | opt | acts/mb "
        "| XLA peak | model | error | tables | error | planner | error |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  worst = worst_planner = 0.0
  t0 = time.perf_counter()
  for mname in args.models:
    step, state, tokens = gpt_step(*MODELS[mname])
    prof = profile_step(step, (state, tokens), cluster, num_microbatches=args.microbatches,
                        options=ProfileOptions(use_cache=False, progress=False,
                                               state_bytes_per_param=16.0,
                                               optimizer_bytes_per_param=8.0))
    layers = prof.layers
    L = len(layers)
    for pname in args.plans:
      stages = PLANS[pname]
      ranges = [(0, L // 2 - 1), (L // 2, L - 1)]
      levels = [(z, False) for z in (0, 1, 2, 3)]
      levels += [(z, True) for z in args.offload]
      for zero, offload in levels:
        plan = harpjax.ManualPlan([dict(layers=r, subcluster=sc, submesh=sm, logical_mesh=lm,
                                         zero=zero) for r, (sc, sm, lm) in zip(ranges, stages)])
        pstep = harpjax.auto_parallel(step, cluster=CLUSTER, num_microbatches=args.microbatches,
                                      plan=harpjax.OffloadOptions(
                                          optimizer_state=offload).apply(plan),
                                      runtime=harpjax.LocalRuntime(compile_workers=0))
        cs = pstep.compile(state, tokens)
        for s, (sc, sm, lm) in enumerate(stages):
          r = memory_report(cs, s)
          worst = max(worst, abs(r.error))
          tab = from_tables(prof.costs, layers, ranges[s], (sc, sm, lm), lm[0], zero,
                            r.in_flight, offload)
          plan_mem = planner_peak(prof, cs.plan, s, r.in_flight, offload)
          if math.isfinite(plan_mem):
            worst_planner = max(worst_planner, abs(plan_mem / r.xla_peak_bytes - 1))
          level = f"{zero}{' + offload' if offload else ''}"
          print(f"| {mname} | {pname} | {s} | {lm} | {level} | {r.in_flight} "
                f"| {mib(r.param_bytes)} | {mib(r.grad_bytes)} | {mib(r.opt_bytes)} "
                f"| {mib(r.act_bytes)} | {mib(r.xla_peak_bytes)} "
                f"| {mib(r.predicted_peak_bytes)} | {100 * r.error:+.1f}% "
                f"| {mib(tab)} | {100 * (tab / r.xla_peak_bytes - 1):+.1f}% "
                + (f"| {mib(plan_mem)} | {100 * (plan_mem / r.xla_peak_bytes - 1):+.1f}% |"
                   if math.isfinite(plan_mem) else "| - | (no host link to price) |"),
                flush=True)
  print(f"\nMiB per device. Largest |model error|: {100 * worst:.1f}%; largest |planner "
        f"error|: {100 * worst_planner:.1f}%; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
