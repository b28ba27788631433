"""Head-to-head with Sailor's resource planner on Sailor's own setups and profiles.

For each setup (pools of A100-40 and V100-16 GPUs in GCP zones; OPT-350M with global batch
1024 or GPT-Neo-2.7B with 2048; Sailor's profiles, prices and measured links:
``benchmarks/data/sailor/``) both planners choose the GPUs and the plan; both plans are scored
by the same simulator on the same cost tables (``tools/sailor.py`` explains the mapping). Our
planner is :func:`harpjax.solve` run at every global microbatch ``b`` (a power of two dividing
the batch; Sailor searches its replica microbatch the same way), keeping the best; its plan
time is the sum over all ``b``, tables included. Sailor's is its whole search.

    python benchmarks/sailor.py                       # every setup, each setup's objective
    python benchmarks/sailor.py --objective min_time  # one objective for every setup
    python benchmarks/sailor.py --oracle              # also Sailor's candidates judged by us
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harpjax.compiler.plan import SolveOptions, solve  # noqa: E402
from harpjax.errors import InfeasiblePlanError  # noqa: E402
from tools.sailor import Pool, load_model, sailor_plan, sailor_tables  # noqa: E402

ZONE_A, ZONE_B, WEST = "us-central1-a", "us-central1-b", "us-west1-b"

# name -> (model, pools, objective, bound: budget per hour or time limit per iteration); hosts
# of 4 GPUs as the paper's VMs.
SETUPS = {
    # Fig. 7: A100s only, one zone.
    "a100x32": ("OPT-350", [Pool("a100", "A100-40", ZONE_A, 8)], "min_time", None),
    # Fig. 8b / 10: V100:A100 = 2:1 in one zone.
    "a100x16+v100x32": ("OPT-350", [Pool("a100", "A100-40", ZONE_A, 4),
                         Pool("v100", "V100-16", ZONE_A, 8)], "min_time", None),
    # Fig. 11/12: A100s in two regions.
    "a100x16 x2 regions": ("OPT-350", [Pool("a100@central", "A100-40", ZONE_A, 4),
                            Pool("a100@west", "A100-40", WEST, 4)], "min_time", None),
    # §5.2.4 scenario 1: two zones of one region, each with A100s and V100s; the cheapest
    # iteration within a time (seconds per iteration).
    "2 zones, <= 20 s": ("OPT-350", [Pool("a100@a", "A100-40", ZONE_A, 2),
                          Pool("v100@a", "V100-16", ZONE_A, 4),
                          Pool("a100@b", "A100-40", ZONE_B, 2),
                          Pool("v100@b", "V100-16", ZONE_B, 4)],
                         "min_cost_within_time", 20.0),
    # §5.2.4 scenario 2: the best throughput within a budget (USD per hour).
    "2 zones, budget 100/h": ("OPT-350", [Pool("a100@a", "A100-40", ZONE_A, 2),
                               Pool("v100@a", "V100-16", ZONE_A, 4),
                               Pool("a100@b", "A100-40", ZONE_B, 2),
                               Pool("v100@b", "V100-16", ZONE_B, 4)],
                              "min_time_within_budget", 100.0),
    # Fig. 9: GPT-Neo-2.7B on A100s and V100s in one zone (V100:A100 = 3:1), and within a
    # budget over two zones.
    "neo: a100x16+v100x48": ("GPT-Neo-2.7", [Pool("a100", "A100-40", ZONE_A, 4),
                                             Pool("v100", "V100-16", ZONE_A, 12)],
                             "min_time", None),
    "neo: 2 zones, budget 150/h": ("GPT-Neo-2.7", [Pool("a100@a", "A100-40", ZONE_A, 2),
                                                   Pool("v100@a", "V100-16", ZONE_A, 4),
                                                   Pool("a100@b", "A100-40", ZONE_B, 2),
                                                   Pool("v100@b", "V100-16", ZONE_B, 4)],
                                   "min_time_within_budget", 150.0),
}


def microbatch_choices(G: int) -> list[int]:
  return [b for b in (2 ** p for p in range(0, 12)) if b <= G and G % b == 0]


def _bounds(objective: str, bound: float | None) -> dict:
  if objective == "min_time_within_budget":
    return {"budget_per_hour": bound}
  if objective == "min_cost_within_time":
    return {"time_limit_s": bound}
  return {}


def ours(model, pools, objective: str, bound: float | None, microbatches=None):
  """Best of :func:`solve` over the global microbatches; ``(result, b, seconds)``."""
  G = model.global_batch
  start = time.perf_counter()
  best, best_key, best_b = None, math.inf, None
  for b in microbatches or microbatch_choices(G):
    tables = sailor_tables(model, pools, b)
    try:
      r = solve(tables, G // b, options=SolveOptions(objective=objective,
                                                     **_bounds(objective, bound)))
    except InfeasiblePlanError:
      continue
    key = r.cost_per_iteration if objective in ("max_throughput_per_dollar",
                                                "min_cost_within_time") else r.iteration_s
    if key < best_key:
      best, best_key, best_b = r, key, b
  return best, best_b, time.perf_counter() - start


def warm_up(model) -> None:
  """Compiles the planner's kernels once (not part of any plan time)."""
  pools = [Pool("a100", "A100-40", ZONE_A, 1), Pool("v100", "V100-16", ZONE_A, 1)]
  for objective, bound in (("min_time", None), ("max_throughput_per_dollar", None),
                           ("min_time_within_budget", 1e6), ("min_cost_within_time", 1e6)):
    try:
      solve(sailor_tables(model, pools, 16), model.global_batch // 16,
            options=SolveOptions(objective=objective, **_bounds(objective, bound)))
    except InfeasiblePlanError:
      pass


def describe_ours(r) -> str:
  return " | ".join(f"{s.layers[0]}-{s.layers[1]} {s.subcluster_name} {s.submesh[0]}x"
                    f"{s.submesh[1]} {s.logical_mesh}" for s in r.stages)


def describe_sailor(p, pools) -> str:
  return " | ".join(f"{a}-{z} {pools[k].name} D{p.dp} tp{tp}" for a, z, k, tp in p.stages)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--objective", choices=("min_time", "max_throughput_per_dollar"),
                  help="one objective for every setup (default: each setup's own)")
  ap.add_argument("--setups", nargs="*", help=f"subset of {list(SETUPS)}")
  ap.add_argument("--oracle", action="store_true",
                  help="also Sailor's candidates ranked by our simulator")
  ap.add_argument("--plans", action="store_true", help="print the plans")
  args = ap.parse_args(argv)
  models = {}
  rows = []
  for name, (model_name, pools, objective, bound) in SETUPS.items():
    if args.setups and name not in args.setups:
      continue
    if model_name not in models:
      models[model_name] = load_model(model_name)
      warm_up(models[model_name])
    model = models[model_name]
    if args.objective:
      objective, bound = args.objective, None
    r, b, t_ours = ours(model, pools, objective, bound)
    entries = [("ours", r.iteration_s, r.iteration_s, r.rate_per_hour, r.num_devices, b,
                t_ours, describe_ours(r))]
    variants = [("sailor", "sailor")] + ([("sailor-oracle", "simulator")] if args.oracle
                                         else [])
    for label, rank in variants:
      try:
        sp = sailor_plan(model, pools, objective=objective, rank=rank,
                         **_bounds(objective, bound))
      except Exception as e:   # report, keep going
        entries.append((label, math.inf, math.inf, math.nan, 0, 0, math.nan, f"none: {e}"))
        continue
      h1 = sp.h1f1b.iteration_s if sp.h1f1b.feasible else math.inf
      entries.append((label, sp.iteration_s, h1, sp.rate_per_hour, sp.num_devices,
                      sp.microbatch, sp.seconds,
                      describe_sailor(sp, pools) + f" (Sailor's estimate "
                      f"{sp.estimate_s:.3f} s, under H-1F1B "
                      + (f"{sp.h1f1b.iteration_s:.3f} s)" if sp.h1f1b.feasible
                         else "out of memory)")))
    for label, T, h1, rate, gpus, mb, secs, plan in entries:
      rows.append((f"{name} ({model.name}, G={model.global_batch})", objective, label, T, h1,
                   rate, gpus, mb, secs, plan))
  print("Sailor's profiles, prices and links; simulated iteration (1F1B for Sailor's plans, "
        "H-1F1B for ours)\n")
  print("| setup | objective | planner | GPUs | b | iteration s | under H-1F1B | iter/s | USD/h "
        "| iters per USD | plan s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for name, objective, label, T, h1, rate, gpus, mb, secs, plan in rows:
    per_usd = 3600.0 / (rate * T) if math.isfinite(T) and rate > 0 else math.nan
    h1s = f"{h1:.3f}" if math.isfinite(h1) else "out of memory"
    print(f"| {name} | {objective} | {label} | {gpus} | {mb} | {T:.3f} | {h1s} | {1 / T:.4f} | "
          f"{rate:.1f} | {per_usd:.2f} | {secs:.2f} |")
  if args.plans:
    print()
    for name, objective, label, *_, plan in rows:
      print(f"{name} / {label}: {plan}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
