"""How often the planner's choice of schedule beats H-1F1B, and by how much.

On seeded random instances (the planner tests' generator, ``tests/compiler/plan/oracle.py``:
2-3 subclusters, 2-8 layers, ``B`` in 2..32) and on the same instances with the links between
subclusters 5-20x slower (link-bound plans), :func:`harpjax.compiler.plan.solve` runs twice:
ranking the schedules (the default) and with H-1F1B pinned. The stages are the same; the
script counts which schedule each plan runs, the largest gain over H-1F1B, the microbatches in
flight saved or added, and the instances where a faster schedule did not fit memory.

  python benchmarks/schedule_choice.py                 # 600 + 600 instances, ~20 s
  python benchmarks/schedule_choice.py --instances 100 --seed 3
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from harpjax.compiler import plan as planner  # noqa: E402
from harpjax.compiler.schedule import ranked_schedules  # noqa: E402
from harpjax.errors import InfeasiblePlanError  # noqa: E402
from tests.compiler.plan import oracle  # noqa: E402


def _slow_links(tables, factor: float):
  matrix = tables.link_bandwidth_bytes_per_s
  return tables.replace(
      inter_bandwidth_bytes_per_s=tuple(b * factor for b in tables.inter_bandwidth_bytes_per_s),
      link_bandwidth_bytes_per_s=None if matrix is None else tuple(
          tuple(b * factor for b in row) for row in matrix))


def corpus(seed: int, n: int, link_bound: bool) -> dict:
  rng = np.random.default_rng(seed)
  chosen = collections.Counter()
  gains = collections.defaultdict(list)
  inflight = collections.defaultdict(list)
  blocked = feasible = 0
  for _ in range(n):
    tables = oracle.random_tables(rng)
    if link_bound:
      tables = _slow_links(tables, float(rng.choice([0.05, 0.1, 0.2])))
    B = int(rng.choice([2, 4, 8, 16, 32]))
    try:
      res = planner.solve(tables, B, backend="sequential")
    except InfeasiblePlanError:
      continue
    base = planner.solve(tables, B, backend="sequential", schedule="h1f1b")
    feasible += 1
    chosen[res.plan.schedule] += 1
    if res.plan.schedule != "h1f1b":
      gains[res.plan.schedule].append(1.0 - res.iteration_s / base.iteration_s)
      inflight[res.plan.schedule].append(
          sum(s.inflight for s in res.stages) - sum(s.inflight for s in base.stages))
    for kind in ranked_schedules():
      ev = planner.evaluate_plan(tables, base.plan, B, kind)
      if not ev.mem_ok and ev.iteration_s < res.iteration_s:
        blocked += 1
        break
  return dict(feasible=feasible, chosen=chosen, gains=gains, inflight=inflight,
              blocked=blocked)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--instances", type=int, default=600)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  for link_bound in (False, True):
    t0 = time.perf_counter()
    r = corpus(args.seed, args.instances, link_bound)
    name = "link-bound" if link_bound else "random"
    print(f"{name}: {args.instances} instances, {r['feasible']} feasible, "
          f"{time.perf_counter() - t0:.1f} s")
    for sched in ("h1f1b", "eager_1f1b", "1f1b"):
      line = f"  {sched:<11} chosen {r['chosen'][sched]:>4}"
      if r["gains"][sched]:
        g, d = r["gains"][sched], r["inflight"][sched]
        line += (f"   faster than H-1F1B by up to {100 * max(g):.1f}% (median "
                 f"{100 * float(np.median(g)):.1f}%); microbatches in flight, summed over "
                 f"stages, {min(d):+d} to {max(d):+d}")
      print(line)
    print(f"  a faster schedule did not fit memory on {r['blocked']}")


if __name__ == "__main__":
  main()
