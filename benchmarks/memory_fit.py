"""The largest GPT that fits a memory-poor cluster, with and without sharding and offload.

Cluster: one host of 8 V100-16G (NVLink) and one host of 4 T4 (16 GiB, PCIe Gen3), 25 Gbps
between them, each device 12 GB/s to its host's memory (PCIe Gen3 x16 in practice). Model:
the analytic GPT of :func:`harpjax.compiler.profile.synthetic_gpt_profile` (hidden 4096, 32
heads' worth of FLOPs, sequence 2048, 2 sequences per microbatch, vocabulary 51200, fp16
activations with recomputation at layer boundaries, mixed-precision Adam: 16 bytes of state
per parameter of which 12 are optimizer state), planned at one layer per transformer block,
``B = 8`` microbatches per iteration (a global batch of 16 sequences). Data parallelism only
inside a stage (``max_tp=1``; the rows with "tp" allow tensor parallelism up to 8 inside a
host, for comparison).

For each memory option the number of blocks is grown until no plan fits (a gallop, then a
bisection); the table gives the largest model, its plan and the simulated iteration time:

* no sharding: every device of a stage holds all of the stage's state (``zero_levels=(0,),
  offload=False``);
* ZeRO chosen by the planner (levels 0-3 per stage, no offload);
* ZeRO + offload chosen by the planner (levels 0-3 and host offload of the optimizer state,
  per stage);
* residuals in host memory chosen by the planner (per stage, level 0, the optimizer state on
  the devices), and with ZeRO and both offloads;
* interleaving (Zorse's ministages): :func:`harpjax.compiler.plan.choose_interleaving` over
  the ZeRO + offload search, ``v`` in 2-4 chunks per device group with and without parameter
  offload (prefetch), the optimizer updates interleaved in the drain; where no plain plan
  fits, the stages are searched on devices 1.1-2x larger and re-cut.

Usage::

  .venv/bin/python benchmarks/memory_fit.py [--hidden 4096] [--max-blocks 256]
      [--only-interleaved] [-v]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harpjax.cluster import GPU_CATALOG, Link  # noqa: E402
from harpjax.compiler import plan as planner  # noqa: E402
from harpjax.compiler.profile import (CostTables, SubclusterSpec,  # noqa: E402
                                      synthetic_gpt_profile)
from harpjax.errors import InfeasiblePlanError  # noqa: E402
from tools.baselines import join_runs  # noqa: E402

GBPS = 1e9 / 8
B = 8
SEQ, MICROBATCH, VOCAB = 2048, 2, 51200

NO_RES = dict(offload_activations=False)
MODES = [
    ("no sharding", dict(zero_levels=(0,), offload=False, **NO_RES), 1),
    ("tensor parallel (tp <= 8)", dict(zero_levels=(0,), offload=False, **NO_RES), None),
    ("ZeRO (planner's choice)", dict(offload=False, **NO_RES), 1),
    ("ZeRO + offload (planner's choice)", dict(NO_RES), 1),
    ("ZeRO + offload, tp <= 8", dict(NO_RES), None),
    ("residuals in host memory (planner's choice)", dict(zero_levels=(0,), offload=False), 1),
    ("ZeRO + both offloads (planner's choice)", dict(), 1),
    ("ZeRO + offload + interleaving (choose_interleaving)", dict(NO_RES), 1, "interleave"),
    ("ZeRO + both offloads + interleaving (choose_interleaving)", dict(), 1, "interleave"),
]
CHUNKS = (2, 3, 4)
RELAX = (1.1, 1.25, 1.5, 2.0)


def cluster_specs(offload_bw: float = 12e9) -> list[SubclusterSpec]:
  """8 V100-16G on one host, 4 T4 on one host, from the GPU catalog."""
  out = []
  for name, gpu, count in (("v100", "V100-16G", 8), ("t4", "T4", 4)):
    g = GPU_CATALOG[gpu]
    out.append(SubclusterSpec(name, 1, count, g.memory_bytes, 25 * GBPS,
                              peak_flops=g.peak_flops, efficiency=0.5,
                              host_bandwidth_bytes_per_s=g.intra_host_bytes_per_s,
                              host_latency_s=2e-6,
                              mem_bandwidth_bytes_per_s=g.mem_bandwidth_bytes_per_s,
                              offload_bandwidth_bytes_per_s=offload_bw))
  return out


def gpt_tables(blocks: int, hidden: int, max_tp: int | None) -> CostTables:
  """One layer per block (embedding and head join the first and last block)."""
  prof = synthetic_gpt_profile(num_blocks=blocks, hidden=hidden, seq_len=SEQ,
                               microbatch=MICROBATCH, vocab=VOCAB)
  fine = CostTables.from_layer_costs(prof, cluster_specs(), Link(25 * GBPS, 1e-4),
                                     max_tp=max_tp, end_cost=True, optimizer_share=0.75,
                                     order="memory_to_compute")
  L = fine.num_layers
  return fine.coarsen([3 * (b + 1) for b in range(blocks - 1)] + [L - 1])


def num_params(blocks: int, hidden: int) -> float:
  """Parameters of the synthetic GPT (weights and biases)."""
  h = float(hidden)
  return (VOCAB + SEQ) * h + blocks * (12 * h * h + 13 * h) + h * VOCAB + 2 * h


def plan_or_none(blocks: int, hidden: int, options: dict, max_tp, how: str = "solve"):
  """The planner's result (``.plan``) for the model, or ``None`` where nothing fits; ``how``:
  ``"solve"`` or ``"interleave"`` (:func:`~harpjax.compiler.plan.choose_interleaving`)."""
  tables = gpt_tables(blocks, hidden, max_tp)
  try:
    if how == "interleave":
      return planner.choose_interleaving(tables, B, chunks=CHUNKS, relax_memory=RELAX,
                                         **options)
    return planner.solve(tables, B, **options)
  except InfeasiblePlanError:
    return None


def largest(hidden: int, options: dict, max_tp, max_blocks: int, how: str = "solve"):
  """``(blocks, result, solves, seconds)`` of the largest model with a plan."""
  t0, solves = time.perf_counter(), 0
  best, lo, hi = None, 0, None
  n = 1
  while n <= max_blocks:             # gallop
    solves += 1
    res = plan_or_none(n, hidden, options, max_tp, how)
    if res is None:
      hi = n
      break
    best, lo = (n, res), n
    n *= 2
  if hi is None:
    hi = max_blocks + 1
  while hi - lo > 1:                 # bisect: lo fits, hi does not
    mid = (lo + hi) // 2
    solves += 1
    res = plan_or_none(mid, hidden, options, max_tp, how)
    if res is None:
      hi = mid
    else:
      best, lo = (mid, res), mid
  return best, solves, time.perf_counter() - t0


def describe(plan) -> str:
  """Stages as ``subcluster(n,m)[tp]:blocks:level``, runs of equal stages as ``k x ...``
  (``+par``: parameters in host memory; an interleaved plan starts with its schedule)."""
  parts = [plan.schedule + ":"] if plan.schedule.startswith("interleaved") else []
  for s in plan.stages:
    tp = f"tp{s.logical_mesh[1]}" if s.logical_mesh[1] > 1 else ""
    state = f"z{s.zero}" + ("+off" if s.offload else "") + (
        "+res" if s.offload_activations else "") + ("+par" if s.offload_params else "")
    parts.append(f"{s.subcluster}({s.submesh[0]},{s.submesh[1]}){tp}:"
                 f"{s.layers[1] - s.layers[0] + 1}:{state}")
  return join_runs(parts)


def _table(head, rows) -> None:
  widths = [max(len(r[c]) for r in [head] + rows) for c in range(len(head))]
  fmt = lambda r: " | ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()
  print(fmt(head))
  print("-|-".join("-" * w for w in widths))
  for r in rows:
    print(fmt(r))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--hidden", type=int, default=4096)
  ap.add_argument("--max-blocks", type=int, default=256)
  ap.add_argument("--only-interleaved", action="store_true",
                  help="only the interleaving rows (and the ZeRO + offload row to compare)")
  ap.add_argument("-v", action="store_true")
  args = ap.parse_args()
  modes = [m for m in MODES if not args.only_interleaved or len(m) > 3
           or m[0].startswith("ZeRO + offload (")]
  logging.basicConfig(level=logging.INFO if args.v else logging.WARNING)
  plan_or_none(2, args.hidden, {}, 1)   # compile / load the kernels once
  print(f"== Largest GPT on 8 V100-16G + 4 T4-16G (hidden {args.hidden}, seq {SEQ}, "
        f"microbatch {MICROBATCH}, B={B}, 16 B/param) ==")
  head = ["memory option", "blocks", "parameters", "plan (stage: blocks: ZeRO level)",
          "iteration s", "search s"]
  rows, sizes = [], []
  for name, options, max_tp, *how in modes:
    best, solves, dt = largest(args.hidden, options, max_tp, args.max_blocks, *how)
    if best is None:
      rows.append([name, "0", "-", "no plan", "-", f"{dt:.1f}"])
      continue
    blocks, res = best
    sizes.append(blocks)
    rows.append([name, str(blocks), f"{num_params(blocks, args.hidden) / 1e9:.2f} B",
                 describe(res.plan), f"{res.plan.predicted_iteration_s:.3f}",
                 f"{dt:.1f} ({solves} solves)"])
  _table(head, rows)
  total = sum(s.memory_bytes * s.num_devices for s in cluster_specs())
  print(f"(all device memory / 16 B per parameter: {total / 16 / 1e9:.2f} B parameters; the "
        "optimizer update holds a stage's whole state on its devices, offloaded or not)")
  if not sizes:
    return
  blocks = sizes[0]
  print(f"\n== The largest model without sharding ({blocks} blocks): each option's plan ==")
  rows = []
  for name, options, max_tp, *how in modes:
    res, dt = None, time.perf_counter()
    res = plan_or_none(blocks, args.hidden, options, max_tp, *how)
    dt = time.perf_counter() - dt
    rows.append([name, "no plan" if res is None else describe(res.plan),
                 "-" if res is None else f"{res.plan.predicted_iteration_s:.3f}",
                 f"{dt:.2f}"])
  _table(["memory option", "plan", "iteration s", "search s"], rows)


if __name__ == "__main__":
  main()
