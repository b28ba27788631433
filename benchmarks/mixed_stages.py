"""Mixed-type stages: the best plan with and without them, simulated, on asymmetric clusters.

For each cluster and model: the planner's plan without mixed-type stages (every stage on one
submesh of one subcluster) and with them (``SolveOptions(mixed_stages="on")``: a stage may
also run on hosts of several subclusters, data-parallel, each microbatch's rows split by
speed; :mod:`harpjax.compiler.plan.mixed`), both simulated (H-1F1B, the same cost tables),
with the GPUs each uses; then the same with every GPU in use (``use_all_devices``, HARP's
rule: the contiguous-submesh plan that must place every GPU); the mixed stages of the plan
with them and the search times. Groups inside one host are searched on clusters of up to 32
GPUs (on cluster B's 8-GPU hosts they multiply the fusions: about a minute per search).

Per-layer times are Zorse's published measurements (``/work/shared/data``, MIT licence): the
linear fits of a LLaMA layer's forward and backward milliseconds against the microbatch size
on each GPU type, at the microbatch of the instance, spread over a submesh's devices as the
analytic tables do (``CostTables.from_layer_costs``; data-parallel gradient all-reduce once
per iteration, ring model on the host or subcluster link). A layer keeps 16 bytes of state
per parameter (fp16 weights and gradients, fp32 Adam) and its input per microbatch in flight
(activation checkpointing), and its time charges the recomputation that checkpointing costs:
forward twice plus backward (as Zorse's own latency model does; an earlier version timed
forward plus backward only). The mixed-stage time model takes ``fixed_fraction`` from the same
fits (the intercept's share at 4 rows per device, the median over the GPU types).

Clusters:

* ``6 A100 + 5 V100 + 3 T4``: A100-40G hosts of 2, V100-16G and T4 hosts of 1 (and with hosts
  of 2/1/3 devices), 100 Gbps between all hosts.
* ``8 A100 + 4 V100 + 2 T4``: one host each (8, 4, 2 devices), 100 Gbps.
* Zorse's ten model/cluster rows (``tools/zorse.py``): cluster A (2 hosts x 2 H100-NVL + 2
  hosts x 8 A100-80G, 50 Gbps between hosts) with LLaMA 7B to 65B, cluster B (8 A100-40G + 2 x
  8 A10G + 2 x 8 V100-16G + 3 x 8 T4, 25 Gbps between hosts) and cluster C (two regions: 2 x 8
  A10G + 6 x 8 T4, and 2 x 8 V100-16G + 6 x 8 T4; 25 Gbps inside a region, 5 Gbps between
  them; ``mixed_stages="auto"``, which fuses only inside a region) with 7B to 33B, at its
  global batch of 1M tokens and sequence lengths 4096 (A), 1024 (B) and 512 (C). "Zorse s" is
  the iteration time Zorse measured (its Table 5 TFLOPs under its own FLOP count,
  :func:`tools.zorse.zorse_iteration_s`); these plans use no ZeRO, offload or interleaving
  (``benchmarks/peers.py`` compares with ZeRO and offload chosen). The link speeds of B and C
  are ours: the paper gives 50 Gbps for A only.

The last column says which searches proved their optimum (plain, mixed, and the two with every
GPU placed; ``y``/``n``): on the large instances none does, and a difference between two
unproved searches may be the search's as much as the plans'.

Usage::

  .venv/bin/python benchmarks/mixed_stages.py [--quick] [-v]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from harpjax.cluster import Link  # noqa: E402
from harpjax.compiler import plan as planner  # noqa: E402
from harpjax.compiler.profile import CostTables, LayerProfile, SubclusterSpec  # noqa: E402
from harpjax.compiler.profile.calibration import (default_zorse_dir, load_zorse,  # noqa: E402
                                                  zorse_fit_ms)
from harpjax import errors as planner_errors  # noqa: E402
from tools import zorse as zorse_lib  # noqa: E402

GiB = 2.0 ** 30
GBPS = 1e9 / 8

# GPU type: (Zorse key, memory GiB, peak fp16 FLOP/s, bandwidth inside a host in bytes/s).
GPUS = {
    "A100-40G": ("a100x40", 40, 312e12, 300e9),
    "A100-80G": ("a100x80", 80, 312e12, 300e9),
    "H100-NVL": ("h100-nvl", 94, 989e12, 450e9),
    "V100-16G": ("v100x16", 16, 125e12, 150e9),
    "A10G": ("a10g", 24, 125e12, 32e9),
    "T4": ("t4", 16, 65e12, 16e9),
}


def layer_ms(data: dict, model: str, gpu: str, seq: int, rows: int) -> tuple[float, float]:
  """``(ms of one layer's forward, recomputation and backward at `rows` sequences, intercept
  share of forward+backward at 4 rows)`` from Zorse's linear fits (fp16)."""
  entry = data[model][GPUS[gpu][0]][str(seq)]["float16"]
  icpt = zorse_fit_ms(entry, 0)
  fwd_s, bwd_s = zorse_lib.layer_fits_s(data, model, gpu, seq, rows)
  # Forward, recomputed forward, backward: the recomputation checkpointing costs.
  return 1e3 * (2 * fwd_s + bwd_s), max(0.0, icpt) / zorse_fit_ms(entry, 4)


def llama_tables(model: str, cluster: list[tuple], seq: int, rows: int, B: int,
                 inter_gbps: float, data: dict, stats: dict, cross_gbps: float = 5.0
                 ) -> tuple[CostTables, float, float]:
  """Tables of a LLaMA model (transformer layers only) on ``cluster`` = ``[(name, gpu, hosts,
  devices per host[, region])]`` (``inter_gbps`` between hosts of a region, ``cross_gbps``
  between regions); returns ``(tables, fixed_fraction, model FLOPs per iteration)``."""
  st = stats[model]
  L, h, params = st["num_layers"], st["hidden_size"], st["parameters_per_layer"]
  x = rows * seq * h * 2.0
  tokens = rows * seq
  prof = LayerProfile(flops=np.full(L, 8.0 * params * tokens),
                      param_bytes=np.full(L, 2.0 * params),
                      param_mem_bytes=np.full(L, 16.0 * params), act_bytes=np.full(L, x),
                      boundary_bytes=np.full(L, x))
  subs, times, shares = [], {}, []
  for name, gpu, n, m, *_ in cluster:
    _, mem, peak, host_bw = GPUS[gpu]
    subs.append(SubclusterSpec(name, n, m, mem * GiB, inter_gbps * GBPS, peak_flops=peak,
                               latency_s=1e-5, host_bandwidth_bytes_per_s=host_bw,
                               host_latency_s=2e-6))
    ms, share = layer_ms(data, model, gpu, seq, rows)
    times[name] = np.full(L, ms * 1e-3)
    shares.append(share)
  region = {c[0]: (c[4] if len(c) > 4 else 0) for c in cluster}
  links = {(a, b): Link(inter_gbps * GBPS, 1e-5) if region[a] == region[b]
           else Link(cross_gbps * GBPS, 1e-3) for a in region for b in region if a < b}
  tables = CostTables.from_layer_costs(prof, subs, links, layer_time_s=times, end_cost=True)
  # Model FLOPs of one iteration (forward + backward, 6 per parameter per token), as Zorse.
  flops = 6.0 * params * L * tokens * B
  return tables, float(statistics.median(shares)), flops


_C1 = [("a100", "A100-40G", 3, 2), ("v100", "V100-16G", 5, 1), ("t4", "T4", 3, 1)]
_C2 = [("a100", "A100-40G", 3, 2), ("v100", "V100-16G", 5, 1), ("t4", "T4", 1, 3)]
_C3 = [("a100", "A100-40G", 1, 8), ("v100", "V100-16G", 1, 4), ("t4", "T4", 1, 2)]

INSTANCES = [
    # (label, model, cluster, seq, rows, B, inter Gbps, Zorse row or None); rows x B x seq
    # is Zorse's global batch of 1M tokens.
    ("6 A100 + 5 V100 + 3 T4, hosts 2/1/1", "deepspeedllama_7b", _C1, 1024, 32, 32, 100.0,
     None),
    ("6 A100 + 5 V100 + 3 T4, hosts 2/1/1", "deepspeedllama_7b", _C1, 1024, 64, 16, 100.0,
     None),
    ("6 A100 + 5 V100 + 3 T4, hosts 2/1/3", "deepspeedllama_7b", _C2, 1024, 64, 16, 100.0,
     None),
    ("8 A100 + 4 V100 + 2 T4, hosts 8/4/2", "deepspeedllama_7b", _C3, 1024, 32, 32, 100.0,
     None),
    ("8 A100 + 4 V100 + 2 T4, hosts 8/4/2", "deepspeedllama_7b", _C3, 1024, 64, 16, 100.0,
     None),
]


# Zorse's ten rows, microbatches of 16 (A), 32 (B) and 64 (C) sequences.
_ZORSE_ROWS = {"A": 16, "B": 32, "C": 64}
INSTANCES += [
    (f"Zorse {r.cluster}: {zorse_lib.CLUSTERS[r.cluster].label}", r.model,
     [(p.name, p.gpu, p.num_hosts, p.devices_per_host, p.region)
      for p in zorse_lib.CLUSTERS[r.cluster].pools],
     zorse_lib.CLUSTERS[r.cluster].seq_len, _ZORSE_ROWS[r.cluster],
     zorse_lib.CLUSTERS[r.cluster].global_batch // _ZORSE_ROWS[r.cluster],
     zorse_lib.CLUSTERS[r.cluster].inter_gbps, r)
    for r in zorse_lib.ROWS]


def _solve_both(tables, B, mo, mode, **kw):
  """``(plain, mixed, seconds of the mixed search)``; ``None`` where no plan fits."""
  try:
    plain = planner.solve(tables, B, **kw)
  except planner_errors.InfeasiblePlanError:
    plain = None
  t0 = time.perf_counter()
  try:
    mixed = planner.solve(tables, B, mixed_stages=mode, mixed_options=mo, **kw)
  except planner_errors.InfeasiblePlanError:
    mixed = None
  return plain, mixed, time.perf_counter() - t0


def _proved(*results) -> str:
  """Whether each search proved its optimum (``y``/``n``): plain, mixed, and with all GPUs."""
  return "".join("-" if r is None else "y" if r.stats.proved else "n" for r in results)


def _cell(res) -> str:
  return "-" if res is None else f"{res.iteration_s:.3f} ({res.num_devices})"


def _gain(plain, mixed) -> str:
  if mixed is None:
    return "-"
  if plain is None:
    return "only mixed"
  return f"{100 * (plain.iteration_s / mixed.iteration_s - 1):+.1f}%"


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true",
                  help="Only the first clusters (no Zorse settings).")
  ap.add_argument("-v", "--verbose", action="store_true")
  args = ap.parse_args()
  logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
  data = load_zorse()
  with open(os.path.join(default_zorse_dir(), "zorse_model_stats.json")) as f:
    stats = json.load(f)
  instances = INSTANCES[:5] if args.quick else INSTANCES
  warm = llama_tables(*INSTANCES[0][1:3], 1024, 32, 32, 100.0, data, stats)[0]
  planner.solve(warm, 32)   # compile the kernels once
  head = ("cluster", "model", "B x rows", "plain s (GPUs)", "mixed s (GPUs)", "faster",
          "all GPUs: plain s", "all GPUs: mixed s", "faster", "Zorse s",
          "mixed stages (rows)", "mixed search s", "proved")
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  alphas = []
  for label, model, cluster, seq, rows, B, gbps, zorse in instances:
    tables, alpha, _ = llama_tables(model, cluster, seq, rows, B, gbps, data, stats)
    alphas.append(alpha)
    # Sub-host groups multiply the fusions on 8-GPU hosts: whole hosts only on cluster B.
    mo = planner.MixedOptions(microbatch_rows=rows, fixed_fraction=alpha,
                              max_hosts_per_group=3, max_members=3,
                              sub_host=tables.total_devices <= 32)
    # Cluster C: only "auto" (fusions inside a region; across the 5 Gbps link they cannot pay).
    mode = "auto" if tables.total_devices > 64 else "on"
    plain, mixed, secs = _solve_both(tables, B, mo, mode)
    plain_all, mixed_all, secs_all = _solve_both(tables, B, mo, mode, use_all_devices=True)
    for res in (mixed, mixed_all):
      if res is not None:
        ev = planner.evaluate_mixed(tables, res.plan, B, mo)
        assert ev.iteration_s == res.plan.predicted_iteration_s
    shown = mixed if mixed is not None and any(s.groups for s in mixed.plan.stages) else \
        mixed_all
    groups = [] if shown is None else [
        " + ".join(f"{g.subcluster}{list(g.submesh)}:{g.share}" for g in s.all_groups)
        for s in shown.plan.stages if s.groups]
    lines.append(
        f"| {label} | {tables.num_layers}x{model.split('_')[-1]} | {B} x {rows} | "
        f"{_cell(plain)} | {_cell(mixed)} | {_gain(plain, mixed)} | {_cell(plain_all)} | "
        f"{_cell(mixed_all)} | {_gain(plain_all, mixed_all)} | "
        f"{'-' if zorse is None else f'{zorse_lib.zorse_iteration_s(zorse, stats):.3f}'} | "
        f"{'; '.join(groups) or '-'}{'' if shown is not mixed_all or not groups else ' (all)'}"
        f" | {secs:.1f} / {secs_all:.1f} | {_proved(plain, mixed, plain_all, mixed_all)} |")
    print(f"{label}, {model}, B={B} x {rows}: plain {_cell(plain)}, mixed {_cell(mixed)}; "
          f"all GPUs {_cell(plain_all)}, {_cell(mixed_all)}", file=sys.stderr)
    for res in (mixed, mixed_all):
      if res is not None:
        print(res.plan.table(), file=sys.stderr)
  print("\n".join(lines))
  print(f"\nfixed_fraction per instance (Zorse intercepts at 4 rows per device): "
        f"{', '.join(f'{a:.3f}' for a in alphas)}")


if __name__ == "__main__":
  main()
