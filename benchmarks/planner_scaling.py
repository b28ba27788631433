"""Planner scaling: plan time against GPU count and layer count.

Three GPU types in the proportions of the issue's largest case (a quarter V100-32G, a quarter
A100-40G, half H100-80G; hosts of up to 8 devices; 400 Gbps inside the H100 subcluster, 200
Gbps inside the others, ``--gbps`` between subclusters), a GPT-39B-like model (hidden 8192,
sequence 1024, microbatch 8, fp16, recomputation; ``3 * blocks + 2`` layers), ``B = 128``.

Two sweeps, each printed as a table:

1. GPUs 16, 32, ..., 1024 at 146 layers (48 blocks);
2. layers 50, 100, ..., 300 at ``--layer-gpus`` GPUs (default 128).

``--money`` adds the money objective's case: ``max_throughput_per_dollar`` on 12 GPUs (2 hosts x
4 V100-32G at 2.55 per GPU-hour + 1 host x 4 A100-40G at 4.05; 100 Gbps inside, 25 Gbps
between), a 146-layer GPT (hidden 4096, sequence 1024, one sequence per microbatch, 48 blocks),
``B = 1024``.

``--zero`` gives the tables the optimizer state's share (mixed-precision Adam: 12 of 16 bytes
per parameter) and a 25 GB/s link to host memory, so the planner chooses a ZeRO level (0-3)
and the offload of the optimizer state and of the residuals per stage (the issue's "ZeRO levels
and offload in the tables"); with ``--compare-with`` it applies to the ``--gpus`` rows.

``--compare-with DIR`` times each case (``--gpus`` rows and ``--money``) side by side with the
planner of another checkout (``git archive <commit> | tar -x -C DIR``): both run in fresh
worker processes, one after the other, each warmed up first, best of ``--repeat`` runs (wall
and CPU seconds: on a shared machine the CPU seconds of the worker are the steadier of the
two), and the table says whether the two plans are identical.

Each row: entries of the sparse index, period candidates, DP runs (window and feasibility),
the plan time of :func:`harpjax.compiler.plan.solve` (warm: Numba kernels compiled before),
with the default cost model (the simulator judges) and, with ``--eq12``, the paper's, the
simulated iteration time, whether the bounded exact search proved the optimum, and the
devices the plan uses.

The tables charge the data-parallel gradient all-reduce and the optimizer update once per
iteration, after each stage's last backward (their end times: what the profiler builds and
the runtime runs). ``--amortised`` adds, per row, the plan time on tables that instead spread
the all-reduce over the ``B`` microbatches of the stage time (the model before gradients were
synchronised once per step), measured right after, for comparison. ``--sync-rule DIR`` times, in fresh worker processes,
the ``--gpus`` rows (default 512) on once-per-step tables and on amortised ones with this
checkout's planner and on amortised ones with DIR's (the tree before once-per-step sync): the
20% rule of issue 22 in CPU seconds.

Usage::

  .venv/bin/python benchmarks/planner_scaling.py [--gbps 100] [--max-gpus 1024]
      [--gpus 512] [--layer-gpus 128] [--max-layers 300] [--eq12] [--amortised]
      [--backend sequential] [--money] [--zero] [--compare-with DIR] [--repeat 3]
      [--sync-rule DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A worker of --compare-with imports the planner of another checkout.
sys.path.insert(0, os.environ.get("PLANNER_SCALING_ROOT") or _REPO)

from harpjax.cluster import Link  # noqa: E402
from harpjax.compiler import plan as planner  # noqa: E402
from harpjax.compiler.profile import (CostTables, SubclusterSpec,  # noqa: E402
                                      synthetic_gpt_profile)

GiB = 2.0 ** 30
GBPS = 1e9 / 8  # bytes per second in one Gbit/s
B = 128


OFFLOAD_BYTES_PER_S = 25e9   # device to host memory (PCIe) with --zero
OPTIMIZER_SHARE = 0.75       # mixed-precision Adam: 12 of 16 bytes per parameter


def _spec(name: str, gpus: int, mem_gib: float, tflops: float, link_gbps: float,
          host_gbps: float, zero: bool = False) -> SubclusterSpec:
  per_host = min(8, gpus)
  return SubclusterSpec(name, gpus // per_host, per_host, mem_gib * GiB, link_gbps * GBPS,
                        peak_flops=tflops * 1e12, efficiency=0.5, latency_s=5e-6,
                        host_bandwidth_bytes_per_s=host_gbps, host_latency_s=2e-6,
                        offload_bandwidth_bytes_per_s=OFFLOAD_BYTES_PER_S if zero else None)


def three_type_tables(num_gpus: int, num_layers: int = 146, gbps: float = 100.0,
                      end_cost: bool = True, zero: bool = False) -> CostTables:
  """GPT-39B-like tables on ``num_gpus`` GPUs: 1/4 V100-32G, 1/4 A100-40G, 1/2 H100-80G;
  with ``zero`` the optimizer state's share (ZeRO levels 0-3 for the planner) and a host link
  (offload of the optimizer state and of the residuals)."""
  if num_gpus % 16:
    raise SystemExit(f"--gpus {num_gpus}: use a multiple of 16")
  blocks = max(1, round((num_layers - 2) / 3))
  prof = synthetic_gpt_profile(num_blocks=blocks, hidden=8192, seq_len=1024, microbatch=8)
  q = num_gpus // 4
  specs = [_spec("v100", q, 32, 125, 200, 150e9, zero),
           _spec("a100", q, 40, 312, 200, 300e9, zero),
           _spec("h100", 2 * q, 80, 989, 400, 900e9, zero)]
  return CostTables.from_layer_costs(prof, specs, Link(gbps * GBPS, 1e-4),
                                     grad_sync_microbatches=B, order="memory_to_compute",
                                     end_cost=end_cost,
                                     optimizer_share=OPTIMIZER_SHARE if zero else None)


MONEY_B = 1024


def money_tables(blocks: int = 48) -> CostTables:
  """The money objective's 12-GPU case: 2 x 4 V100-32G and 1 x 4 A100-40G, priced."""
  prof = synthetic_gpt_profile(num_blocks=blocks, hidden=4096, seq_len=1024, microbatch=1)

  def spec(name, hosts, mem_gib, tflops, price, host_bw):
    return SubclusterSpec(name, hosts, 4, mem_gib * GiB, 100 * GBPS, peak_flops=tflops * 1e12,
                          efficiency=0.5, latency_s=5e-6, host_bandwidth_bytes_per_s=host_bw,
                          host_latency_s=2e-6, price_per_gpu_hour=price)

  specs = [spec("v100", 2, 32, 125, 2.55, 150e9), spec("a100", 1, 40, 312, 4.05, 300e9)]
  return CostTables.from_layer_costs(prof, specs, Link(25 * GBPS, 1e-4),
                                     grad_sync_microbatches=MONEY_B, order="memory_to_compute")


def _case(name: str):
  """``(tables, B, solve options)`` of a named case: ``money``, ``gpus:<N>:<gbps>``,
  ``zero:<N>:<gbps>`` (ZeRO levels and offload in the tables) or ``amortised:<N>:<gbps>`` (the
  gradient all-reduce spread over the microbatches: the tables before once-per-step sync)."""
  if name == "money":
    return money_tables(), MONEY_B, dict(objective="max_throughput_per_dollar")
  kind, gpus, gbps = name.split(":")
  return (three_type_tables(int(gpus), 146, float(gbps), end_cost=kind != "amortised",
                            zero=kind == "zero"), B, {})


def _worker(name: str, backend: str, repeat: int) -> None:
  """Times one case in this process (warmed up first) and prints it as JSON."""
  if name == "money":
    planner.solve(money_tables(2), MONEY_B, objective="max_throughput_per_dollar")
  planner.solve(three_type_tables(16, 20), B)
  tables, nb, kw = _case(name)
  times, cpu, res = [], [], None
  for _ in range(repeat):
    t0, c0 = time.perf_counter(), time.process_time()
    res = planner.solve(tables, nb, backend=backend, **kw)
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  stages = [[list(s.layers), s.subcluster, list(s.submesh), s.warmup, s.zero, s.offload,
             s.offload_activations] for s in res.plan.stages]
  print(json.dumps(dict(seconds=times, cpu_seconds=cpu, stages=stages,
                        iteration_s=res.iteration_s, cost=res.cost_per_iteration,
                        devices=res.num_devices)))


def _run_worker(root: str, name: str, backend: str, repeat: int) -> dict:
  env = dict(os.environ, PLANNER_SCALING_ROOT=root)
  out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name,
                        "--backend", backend, "--repeat", str(repeat)], env=env,
                       capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _compare(names: list[str], other: str, backend: str, repeat: int) -> None:
  """Each case with this checkout's planner and with ``other``'s, side by side."""
  rows = []
  for name in names:
    new = _run_worker(_REPO, name, backend, repeat)
    old = _run_worker(other, name, backend, repeat)
    label = ("max_throughput_per_dollar, 12 GPUs, B=1024" if name == "money" else
             f"min_time, {name.split(':')[1]} GPUs, B={B}"
             + (", ZeRO + offload" if name.startswith("zero") else ""))
    rows.append([label, f"{min(new['seconds']):.2f}", f"{min(old['seconds']):.2f}",
                 f"{min(old['seconds']) / min(new['seconds']):.2f}x",
                 f"{min(new['cpu_seconds']):.2f}", f"{min(old['cpu_seconds']):.2f}",
                 "yes" if new["stages"] == old["stages"] else "no",
                 f"{new['iteration_s']:.3f}", f"{old['iteration_s']:.3f}"])
    print("  ".join(rows[-1]), file=sys.stderr, flush=True)
  head = ["case", "plan s (this tree)", f"plan s ({other})", "speed-up", "CPU s (this)",
          "CPU s (other)", "same plan", "iter s (this)", "iter s (other)"]
  widths = [max(len(r[c]) for r in [head] + rows) for c in range(len(head))]
  print(f"== against {other} (best of {repeat}, warm, fresh processes) ==")
  print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
  print("  ".join("-" * w for w in widths))
  for r in rows:
    print("  ".join(x.rjust(w) for x, w in zip(r, widths)))
  print()


def _sync_rule(gpus: int, gbps: float, other: str, backend: str, repeat: int) -> None:
  """The 20% rule of once-per-step sync: the search on this checkout's once-per-step tables
  against the same search on amortised tables, here and in ``other`` (the tree before
  once-per-step sync, whose benchmark and profiler built amortised tables)."""
  runs = [("this tree, once per step", _REPO, f"gpus:{gpus}:{gbps:g}"),
          ("this tree, amortised", _REPO, f"amortised:{gpus}:{gbps:g}"),
          (f"{other}, amortised", other, f"amortised:{gpus}:{gbps:g}")]
  rows = []
  for label, root, name in runs:
    r = _run_worker(root, name, backend, repeat)
    rows.append((label, r))
    print(label, json.dumps(r), file=sys.stderr, flush=True)
  base = min(rows[0][1]["cpu_seconds"])
  print(f"== once-per-step sync, {gpus} GPUs, {gbps:g} Gbps, B={B} (best of {repeat}, warm, "
        f"fresh processes, one after the other) ==")
  print("| run | plan s | CPU s | once per step / this (CPU) | iteration s | stages |")
  print("|---|---|---|---|---|---|")
  for label, r in rows:
    cpu = min(r["cpu_seconds"])
    print(f"| {label} | {min(r['seconds']):.2f} | {cpu:.2f} | {base / cpu:.2f} | "
          f"{r['iteration_s']:.4f} | {len(r['stages'])} |")
  print()


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
  ap.add_argument("--money", action="store_true",
                  help="also the money objective's 12-GPU case (B=1024)")
  ap.add_argument("--compare-with", metavar="DIR",
                  help="time the --gpus rows and --money beside another checkout's planner")
  ap.add_argument("--repeat", type=int, default=3, help="runs per case of --compare-with")
  ap.add_argument("--zero", action="store_true",
                  help="tables with the optimizer state's share and a host link: the planner "
                  "chooses ZeRO levels 0-3 and offloads per stage")
  ap.add_argument("--sync-rule", metavar="DIR",
                  help="time the --gpus rows on once-per-step and amortised tables here and on "
                  "amortised tables with DIR's planner (the tree before once-per-step sync)")
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    _worker(args.worker, args.backend, args.repeat)
    return
  if args.sync_rule:
    for x in (args.gpus or "512").split(","):
      _sync_rule(int(x), args.gbps, os.path.abspath(args.sync_rule), args.backend, args.repeat)
    return
  if args.compare_with:
    kind = "zero" if args.zero else "gpus"
    names = ([f"{kind}:{int(x)}:{args.gbps:g}" for x in args.gpus.split(",")] if args.gpus
             else [])
    _compare(names + (["money"] if args.money else []), os.path.abspath(args.compare_with),
             args.backend, args.repeat)
    return
  planner.solve(three_type_tables(16, 20), B)  # compile / load the kernels once
  planner.solve(three_type_tables(16, 20, end_cost=False), B)
  print(f"GPT-39B-like layers, 1/4 V100 + 1/4 A100 + 1/2 H100, {args.gbps:g} Gbps between "
        f"subclusters, B={B}, {os.cpu_count()} CPUs, backend {args.backend}\n")

  def row(gpus, layers):
    amort = (three_type_tables(gpus, layers, args.gbps, end_cost=False) if args.amortised
             else None)
    out = _row(three_type_tables(gpus, layers, args.gbps, zero=args.zero), args.backend,
               args.eq12, amort)
    print("  ".join(out), file=sys.stderr, flush=True)
    return out

  counts = ([int(x) for x in args.gpus.split(",")] if args.gpus else
            [16 * 2 ** p for p in range(64) if 16 * 2 ** p <= args.max_gpus])
  rows = [row(gpus, 146) for gpus in counts]
  _print("plan time against GPU count (146 layers)", rows, args.eq12, args.amortised)
  if args.money:
    planner.solve(money_tables(2), MONEY_B, objective="max_throughput_per_dollar")
    tables = money_tables()
    t0 = time.perf_counter()
    res = planner.solve(tables, MONEY_B, backend=args.backend,
                        objective="max_throughput_per_dollar")
    print(f"== max_throughput_per_dollar, 12 GPUs (8 V100 + 4 A100), {tables.num_layers} "
          f"layers, B={MONEY_B} ==\nplan s {time.perf_counter() - t0:.2f}, "
          f"{res.num_devices} devices, iteration {res.iteration_s:.3f} s, "
          f"{res.rate_per_hour:.4g} per hour, {res.cost_per_iteration:.6g} per iteration, "
          f"proved: {'yes' if res.stats.proved else 'no'}\n")
  if args.gpus:
    return
  rows = [row(args.layer_gpus, layers) for layers in range(50, args.max_layers + 1, 50)]
  _print(f"plan time against layer count ({args.layer_gpus} GPUs)", rows, args.eq12,
         args.amortised)


if __name__ == "__main__":
  main()
