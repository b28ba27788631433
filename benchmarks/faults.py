"""Fault injection over every phase, the long version of ``tests/faults`` (issue 26).

For each phase — trace, profile, plan (Numba in this process, and worker processes), compile,
step, gather, checkpoint save (synchronous and asynchronous), restore, replan, and on Ray the
workers' start and elastic recovery — ``--trials`` trials strike once at a random moment:
half at the k-th Python call of the main thread inside the phase, half t seconds into it (k
and t drawn uniformly over the phase's own calls and duration, measured first in an
undisturbed run). Faults: Ctrl-C (SIGINT to the process, then a retry in the same process),
``kill -9`` of a worker (a planner process t seconds after the first one started, a stage's
Ray actor: elastic recovery), ``kill -9``
of the whole training process (then a new process resumes from the newest intact checkpoint),
and Ctrl-C of ``python -m harpjax plan``.

Checked on every trial (:mod:`tests.faults.harness`): the interrupt surfaces as
``KeyboardInterrupt`` within ``--latency`` seconds (2 by default; the command line: exit 130
with one line); training then ends in the state ``jax.jit`` reaches in float64 (relative
difference at most 1e-10); no checkpoint complete before the fault is lost, every one left
restores to its step's ``jax.jit`` state; no temporary directory is left; no thread, process
or Ray actor started by the trial outlives it. The table has one row per phase and fault:
trials, those whose fault struck inside the phase, those that then completed training,
interrupts CPython dropped in a finalizer, the largest state difference, checkpoints lost,
temporaries and leftovers, and the longest time from the signal to ``KeyboardInterrupt``.

  python benchmarks/faults.py [--trials 10] [--seed 0] [--no-ray] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

from tests.faults import harness as h  # noqa: E402

S = h.Scenario
# (phase, label, scenario, the run of the phase struck: 1 .. nth)
LOCAL = [
    ("trace", "trace", S(), 1),
    ("profile", "profile", S(plan="auto"), 1),
    ("plan", "plan (Numba)", S(plan="auto", planner="sequential"), 1),
    ("plan", "plan (worker processes)", S(plan="auto", planner="process"), 1),
    ("compile", "compile", S(), 1),
    ("step", "step", S(), 3),
    ("save", "save (sync)", S(), 3),
    ("save", "save (async)", S(asynchronous=True), 3),
    ("restore", "restore", S(resume_from=2), 1),
    ("replan", "replan", S(replan_at=2), 1),
]
RAY = [
    ("start", "start workers (Ray)", S(runtime="ray"), 1),
    ("step_ray", "step (Ray)", S(runtime="ray"), 3),
    ("gather", "gather (Ray)", S(runtime="ray"), 1),
    ("save", "save (sync, Ray)", S(runtime="ray"), 3),
    ("save", "save (async, Ray)", S(runtime="ray", asynchronous=True), 3),
    ("restore", "restore (Ray)", S(runtime="ray", resume_from=2), 1),
    ("replan", "replan (Ray)", S(runtime="ray", replan_at=2), 1),
    ("recovery", "elastic recovery (Ray)", S(runtime="ray", elastic=True, steps=4), 1),
]


def _moments(rng: random.Random, n: int, nth: int, calls: int, seconds: float) -> list:
  half = (n + 1) // 2
  return ([h.Moment(nth=rng.randint(1, nth), calls=rng.randint(1, max(1, calls)))
           for _ in range(half)] +
          [h.Moment(nth=rng.randint(1, nth), seconds=rng.uniform(0.0, seconds))
           for _ in range(n - half)])


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--trials", type=int, default=10, help="trials per phase and fault")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--no-ray", action="store_true", help="leave out the Ray runtime")
  ap.add_argument("--latency", type=float, default=2.0,
                  help="longest accepted time from Ctrl-C to KeyboardInterrupt, seconds")
  ap.add_argument("--json", default=None, help="write every trial's figures here")
  args = ap.parse_args(argv)
  rng = random.Random(args.seed)
  h.reference(4)
  outcomes: list[tuple[str, h.Outcome]] = []

  def record(label: str, out: h.Outcome) -> None:
    outcomes.append((label, out))
    bad = [] if out.ok else ["FAILED"]
    if out.latency_s is not None and out.latency_s > args.latency:
      bad.append(f"late: {out.latency_s:.2f} s")
    print(f"{label:<28} {out.fault:<12} seed {out.seed:<10} landed {int(out.landed)} "
          f"interrupts {out.interrupts} latency "
          f"{'-' if out.latency_s is None else f'{out.latency_s:.3f}'} s err {out.max_err:.1e} "
          f"{out.seconds:5.1f} s {' '.join(bad)}", flush=True)
    if not out.ok:
      print("   ", out.row(), flush=True)

  phases = LOCAL + ([] if args.no_ray else RAY)
  durations = {}
  for phase, label, scn, nth in phases:
    calls, seconds = durations[label] = h.calibrate(phase, scn, nth)
    for moment in _moments(rng, args.trials, nth, calls, seconds):
      record(label, h.in_process_trial(phase, scn, rng.randrange(2**31), moment,
                                       kill_after_s=rng.uniform(0.0, 0.3)))
  for _ in range(args.trials):   # kill -9 of a planner worker process, t after the first starts
    record("plan (worker processes)", h.in_process_trial(
        "plan", S(plan="auto", planner="process"), rng.randrange(2**31),
        h.Moment(seconds=0.0), fault="kill_worker",
        kill_after_s=rng.uniform(0.0, durations["plan (worker processes)"][1])))
  if not args.no_ray:
    for _ in range(args.trials):   # kill -9 of a stage actor, elastic recovery
      record("run (Ray)", h.in_process_trial(
          "run", S(runtime="ray", elastic=True, steps=4), rng.randrange(2**31),
          fault="kill_worker", kill_after_s=rng.uniform(0.0, 0.5)))
  for _ in range(args.trials):   # kill -9 of the training process, a new one resumes
    scn = S(steps=4, every=rng.choice([1, 2]), asynchronous=rng.random() < 0.5)
    record("run (process)", h.kill_process_trial(
        scn, rng.randrange(2**31), kill_at_line=rng.randint(1, scn.steps + 1),
        delay_s=rng.uniform(0.0, 0.5)))
  cli_s = h.cli_seconds()
  for _ in range(args.trials):   # Ctrl-C of the command line, anywhere in its run
    record("command line (plan)", h.cli_trial(rng.randrange(2**31), rng.uniform(0.0, cli_s)))

  rows = _table([o for _, o in outcomes], [l for l, _ in outcomes], args.latency)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"rows": rows, "trials": [dict(label=l, **o.row()) for l, o in outcomes]},
                f, indent=1, default=str)
  if args.trials and "ray" in sys.modules:
    from harpjax.runtime import ray_runtime
    ray_runtime.release_pool()


def _table(outcomes, labels, latency: float) -> list[dict]:
  rows: dict[tuple, dict] = {}
  for label, o in zip(labels, outcomes):
    r = rows.setdefault((label, o.fault), dict(phase=label, fault=o.fault, trials=0, landed=0,
                                               completed=0, dropped=0, max_err=0.0, lost=0,
                                               left=0, latency_s=0.0, late=0))
    r["trials"] += 1
    r["landed"] += o.landed
    r["completed"] += o.recovered
    r["dropped"] += o.swallowed
    r["max_err"] = max(r["max_err"], o.max_err, o.checkpoints_err)
    r["lost"] += len(o.lost)
    r["left"] += len(o.temporary) + len(o.leaked)
    r["latency_s"] = max(r["latency_s"], o.latency_s or 0.0)
    r["late"] += (o.latency_s or 0.0) > latency
  print("\n| phase | fault | trials | struck inside | completed | dropped by CPython | "
        "max state diff | checkpoints lost | left behind | longest Ctrl-C → KeyboardInterrupt |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows.values():
    print(f"| {r['phase']} | {r['fault']} | {r['trials']} | {r['landed']} | {r['completed']} | "
          f"{r['dropped']} | {r['max_err']:.1e} | {r['lost']} | {r['left']} | "
          f"{r['latency_s']:.2f} s |")
  total = sum(r["trials"] for r in rows.values())
  bad = sum(1 for o in outcomes if not o.ok)
  late = sum(r["late"] for r in rows.values())
  print(f"\n{total} trials: {bad} failed a property, {late} interrupts later than {latency:g} s")
  return list(rows.values())


if __name__ == "__main__":
  main()
