"""Planner scaling: plan time against GPU count and layer count.

Three GPU types in the proportions of the issue's largest case (a quarter V100-32G, a quarter
A100-40G, half H100-80G; hosts of up to 8 devices; 400 Gbps inside the H100 subcluster, 200
Gbps inside the others, ``--gbps`` between subclusters), a GPT-39B-like model (hidden 8192,
sequence 1024, microbatch 8, fp16, recomputation; ``3 * blocks + 2`` layers), ``B = 128``.

Two sweeps, each printed as a table:

1. GPUs 16, 32, ..., 1024 at 146 layers (48 blocks);
2. layers 50, 100, ..., 300 at ``--layer-gpus`` GPUs (default 128).

Each row: entries of the sparse index, period candidates, DP runs (window and feasibility),
the plan time of :func:`harpjax.compiler.plan.solve` (warm: Numba kernels compiled before),
with the default cost model (the simulator judges) and, with ``--eq12``, the paper's, the
simulated iteration time, whether the bounded exact search proved the optimum, and the
devices the plan uses.

The tables charge the data-parallel gradient all-reduce and the optimizer update once per
iteration, after each stage's last backward (their end times: what the profiler builds and
the runtime runs). ``--amortised`` adds, per row, the plan time on tables that instead spread
the all-reduce over the ``B`` microbatches of the stage time (the model before gradients were
synchronised once per step), measured right after, for comparison.

Usage::

  .venv/bin/python benchmarks/planner_scaling.py [--gbps 100] [--max-gpus 1024]
      [--gpus 512] [--layer-gpus 128] [--max-layers 300] [--eq12] [--amortised]
      [--backend sequential]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harpjax.cluster import Link  # noqa: E402
from harpjax.compiler import plan as planner  # noqa: E402
from harpjax.compiler.profile import (CostTables, SubclusterSpec,  # noqa: E402
                                      synthetic_gpt_profile)

GiB = 2.0 ** 30
GBPS = 1e9 / 8  # bytes per second in one Gbit/s
B = 128


def _spec(name: str, gpus: int, mem_gib: float, tflops: float, link_gbps: float,
          host_gbps: float) -> SubclusterSpec:
  per_host = min(8, gpus)
  return SubclusterSpec(name, gpus // per_host, per_host, mem_gib * GiB, link_gbps * GBPS,
                        peak_flops=tflops * 1e12, efficiency=0.5, latency_s=5e-6,
                        host_bandwidth_bytes_per_s=host_gbps, host_latency_s=2e-6)


def three_type_tables(num_gpus: int, num_layers: int = 146, gbps: float = 100.0,
                      end_cost: bool = True) -> CostTables:
  """GPT-39B-like tables on ``num_gpus`` GPUs: 1/4 V100-32G, 1/4 A100-40G, 1/2 H100-80G."""
  if num_gpus % 16:
    raise SystemExit(f"--gpus {num_gpus}: use a multiple of 16")
  blocks = max(1, round((num_layers - 2) / 3))
  prof = synthetic_gpt_profile(num_blocks=blocks, hidden=8192, seq_len=1024, microbatch=8)
  q = num_gpus // 4
  specs = [_spec("v100", q, 32, 125, 200, 150e9), _spec("a100", q, 40, 312, 200, 300e9),
           _spec("h100", 2 * q, 80, 989, 400, 900e9)]
  return CostTables.from_layer_costs(prof, specs, Link(gbps * GBPS, 1e-4),
                                     grad_sync_microbatches=B, order="memory_to_compute",
                                     end_cost=end_cost)


def _row(tables: CostTables, backend: str, eq12: bool,
         amortised: CostTables | None = None) -> list[str]:
  t0 = time.perf_counter()
  res = planner.solve(tables, B, backend=backend)
  dt = time.perf_counter() - t0
  st = res.stats
  cells = [str(tables.total_devices), str(tables.num_layers), f"{st.num_entries:,}",
           f"{st.num_candidates:,}", str(st.num_evaluated + st.num_feasibility_runs),
           f"{dt:.2f}"]
  if amortised is not None:
    t0 = time.perf_counter()
    planner.solve(amortised, B, backend=backend)
    cells.append(f"{time.perf_counter() - t0:.2f}")
  if eq12:
    t0 = time.perf_counter()
    old = planner.solve(tables, B, backend=backend, cost_model="eq12")
    cells.append(f"{time.perf_counter() - t0:.2f}")
    cells.append(f"{planner.evaluate_plan(tables, old.plan, B).iteration_s:.3f}")
  cells += [f"{res.iteration_s:.3f}", "yes" if st.proved else "no",
            f"{res.num_devices}/{tables.total_devices}"]
  return cells


def _print(title: str, rows: list[list[str]], eq12: bool, amortised: bool) -> None:
  head = ["GPUs", "layers", "entries", "candidates", "DP runs", "plan s"]
  if amortised:
    head += ["plan s (amortised sync)"]
  if eq12:
    head += ["plan s (Eq. 12)", "its iter s"]
  head += ["iter s (sim)", "proved", "devices used"]
  widths = [max(len(r[c]) for r in [head] + rows) for c in range(len(head))]
  print(f"== {title} ==")
  print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
  print("  ".join("-" * w for w in widths))
  for r in rows:
    print("  ".join(x.rjust(w) for x, w in zip(r, widths)))
  print()


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--gbps", type=float, default=100.0, help="link between subclusters")
  ap.add_argument("--max-gpus", type=int, default=1024)
  ap.add_argument("--layer-gpus", type=int, default=128, help="GPUs of the layer sweep")
  ap.add_argument("--max-layers", type=int, default=300)
  ap.add_argument("--eq12", action="store_true", help="also time the paper's cost model")
  ap.add_argument("--backend", default="sequential", help="solve's backend (default "
                  "sequential: one core; 'auto' may use worker processes)")
  ap.add_argument("--amortised", action="store_true",
                  help="also time the search on tables with the gradient all-reduce amortised "
                  "over the microbatches (the model before once-per-step sync)")
  ap.add_argument("--gpus", help="comma-separated GPU counts instead of 16, 32, ..., max")
  args = ap.parse_args()
  planner.solve(three_type_tables(16, 20), B)  # compile / load the kernels once
  planner.solve(three_type_tables(16, 20, end_cost=False), B)
  print(f"GPT-39B-like layers, 1/4 V100 + 1/4 A100 + 1/2 H100, {args.gbps:g} Gbps between "
        f"subclusters, B={B}, {os.cpu_count()} CPUs, backend {args.backend}\n")

  def row(gpus, layers):
    amort = (three_type_tables(gpus, layers, args.gbps, end_cost=False) if args.amortised
             else None)
    out = _row(three_type_tables(gpus, layers, args.gbps), args.backend, args.eq12, amort)
    print("  ".join(out), file=sys.stderr, flush=True)
    return out

  counts = ([int(x) for x in args.gpus.split(",")] if args.gpus else
            [16 * 2 ** p for p in range(64) if 16 * 2 ** p <= args.max_gpus])
  rows = [row(gpus, 146) for gpus in counts]
  _print("plan time against GPU count (146 layers)", rows, args.eq12, args.amortised)
  if args.gpus:
    return
  rows = [row(args.layer_gpus, layers) for layers in range(50, args.max_layers + 1, 50)]
  _print(f"plan time against layer count ({args.layer_gpus} GPUs)", rows, args.eq12,
         args.amortised)


if __name__ == "__main__":
  main()
