"""Failure to the next completed step: a Ray actor killed mid-training, elastic recovery.

A GPT (the demo model's family) trains on the demo cluster (4 "V100"s on one host, two
"A100" hosts of 2) with three stages, ``runtime="ray"``, a checkpoint every ``--every`` steps
and ``ElasticOptions()``. Before step ``--kill-at`` the actor of stage ``--stage`` is killed;
that step detects the lost host, re-plans automatically on the devices left (profile from
the cache when warm), restores the newest checkpoint, replays the steps since it and completes.
Printed: each part of the recovery (detection, re-plan, worker start and compilation,
restore, replay, the failed step itself) and the total, next to a normal step's time and to
Sailor's reported ~11 s reconfiguration (its whole one: planning 0.1 s, the rest cleanup,
broadcast and NCCL set-up; Sailor's paper §5.5). After the run the parameters are
compared with ``jax.jit`` run for the same steps (the numbers do not depend on the plan).

With ``--random N`` it runs N trials in float64 instead, each killing a random stage's actor at
a random moment (from a timer thread: between steps, inside a step, while a checkpoint is
gathered, …), and checks after every trial that the parameters and optimizer state equal
``jax.jit``'s within 1e-9. ``--interrupts N`` does the same with SIGINT (Ctrl-C) at a random
moment of a random step, followed by an immediate retry of that step.

  python benchmarks/elastic.py [--steps 6] [--kill-at 4] [--every 2] [--cold]
  python benchmarks/elastic.py --random 5 [--seed 0]
  python benchmarks/elastic.py --interrupts 20 [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import harpjax  # noqa: E402
from benchmarks.lm_step import lm_train_step  # noqa: E402
from harpjax.models import GPTConfig  # noqa: E402
from harpjax.runtime import ray_runtime  # noqa: E402

CLUSTER = os.path.join(os.path.dirname(__file__), "configs", "demo_local.yaml")
SAILOR_REPLAN_S = 11.0


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--kill-at", type=int, default=4, help="the step whose attempt finds the "
                  "actor dead (1-based)")
  ap.add_argument("--stage", type=int, default=1)
  ap.add_argument("--every", type=int, default=2)
  ap.add_argument("--cold", action="store_true", help="an empty profile cache (the re-plan "
                  "profiles the surviving GPU types again)")
  ap.add_argument("--random", type=int, default=0, metavar="N",
                  help="N float64 trials, each killing an actor at a random moment")
  ap.add_argument("--interrupts", type=int, default=0, metavar="N",
                  help="N float64 trials, each with SIGINT at a random moment, then a retry")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  if args.cold:
    os.environ["HARPJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="harpjax-cache-")
  if args.random or args.interrupts:
    jax.config.update("jax_enable_x64", True)

  dtype = "float64" if args.random or args.interrupts else "float32"
  cfg = GPTConfig(vocab_size=256, seq_len=32, hidden=64, num_heads=4, num_blocks=4, dtype=dtype,
                  param_dtype=dtype)
  step, state, tokens = lm_train_step(cfg, 16)

  batches = [jax.random.randint(jax.random.key(10 + i), tokens.shape, 0, cfg.vocab_size)
             for i in range(args.steps)]
  layers = harpjax.auto_parallel(step, cluster=CLUSTER, num_microbatches=4).trace(
      state, batches[0]).layers
  n = len(layers)
  a, b = n // 3, 2 * n // 3
  plan = harpjax.ManualPlan([((0, a - 1), "v100", (1, 2), (2, 1)), ((a, b - 1), "a100", (1, 2)),
                             ((b, n - 1), "v100", (1, 2))]).replace(meta={"layers": "auto"})
  ray_runtime.init_ray(num_cpus=4, resources={
      ray_runtime.HOST_RESOURCE_PREFIX + h.name: 100
      for h in harpjax.Cluster.load(CLUSTER).hosts})
  ref = jax.jit(step)
  if args.random or args.interrupts:
    (_random_kills if args.random else _random_interrupts)(args, step, ref, plan, state,
                                                           batches)
    ray_runtime.release_pool()
    return
  pstep = _elastic_step(step, plan, args.every)
  s_par = s_ref = state
  times = []
  for i, batch in enumerate(batches):
    if i + 1 == args.kill_at:
      pstep.runner(s_par, batch).kill_stage(args.stage)
    t0 = time.perf_counter()
    s_par = pstep(s_par, batch)[0]
    jax.block_until_ready(ray_runtime.gather(s_par).params)
    times.append(time.perf_counter() - t0)
    s_ref = ref(s_ref, batch)[0]
  rec = pstep.recoveries[0]
  normal = [t for k, t in enumerate(times) if k + 1 not in (1, args.kill_at)]
  print(f"layers: {layers.summary}")
  print(f"killed stage {args.stage} before step {args.kill_at}; lost {list(rec.lost_hosts)}; "
        f"continued on {rec.num_devices} devices (checkpoint {rec.checkpoint_step}, "
        f"{rec.replayed} step(s) replayed)")
  print(f"{'part':<34}{'seconds':>9}")
  for name, v in [("detect (failing attempt + probes)", rec.detect_s),
                  ("re-plan (trace, profile, search)", rec.replan_s),
                  ("start workers + compile", rec.start_s), ("restore checkpoint", rec.restore_s),
                  ("replay", rec.replay_s), ("the failed step, new plan", rec.step_s),
                  ("failure -> next completed step", rec.total_s)]:
    print(f"{name:<34}{v:>9.2f}")
  print(f"a normal step: {np.median(normal):.2f} s; Sailor's reported reconfiguration: "
        f"{SAILOR_REPLAN_S:.0f} s (all of it; its planning 0.1 s)")
  err = _max_rel_err(s_ref.params, s_par.params)
  print(f"parameters vs jax.jit after {args.steps} steps: max relative difference {err:.2g}")
  ray_runtime.release_pool()


def _elastic_step(step, plan, every: int):
  ckpt_dir = tempfile.mkdtemp(prefix="harpjax-ckpt-")
  return harpjax.auto_parallel(
      step, cluster=CLUSTER, num_microbatches=4, plan=plan, runtime="ray",
      checkpoint=harpjax.CheckpointOptions(os.path.join(ckpt_dir, "ck"), every=every),
      elastic=harpjax.ElasticOptions())


def _max_rel_err(ref, got) -> float:
  got = ray_runtime.gather(got)
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) /
             max(float(np.max(np.abs(np.asarray(x)))), 1e-30)
             for x, y in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got))
             if np.issubdtype(np.asarray(x).dtype, np.floating))


def _random_interrupts(args, step, ref, plan, state, batches) -> None:
  """Trials with SIGINT at a random moment of a step, then an immediate retry of the step."""
  rng = random.Random(args.seed)
  expected = state
  for batch in batches:
    expected = ref(expected, batch)[0]
  pstep = harpjax.auto_parallel(step, cluster=CLUSTER, num_microbatches=4, plan=plan,
                                runtime="ray")
  s_par = pstep(state, batches[0])[0]
  t_step = time.perf_counter()
  pstep(s_par, batches[1])
  t_step = time.perf_counter() - t_step
  for trial in range(args.interrupts):
    s_par, interrupted = pstep(state, batches[0])[0], 0
    target = rng.randrange(1, len(batches))
    for i, batch in enumerate(batches[1:], start=1):
      timer = None
      if i == target:
        delay = rng.uniform(0, 1.2 * t_step)
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
      while True:
        try:
          out = pstep(s_par, batch)
          if timer is not None:
            timer.join()   # a late signal still lands below, in the retry
          break
        except KeyboardInterrupt:
          interrupted += 1
      s_par = out[0]
    err = _max_rel_err(expected, s_par)
    print(f"trial {trial}: SIGINT {delay:.2f} s into step {target + 1} "
          f"({'interrupted, retried' if interrupted else 'after the step'}); state vs jax.jit "
          f"{err:.2g}", flush=True)
    assert err <= 1e-9, err


def _random_kills(args, step, ref, plan, state, batches) -> None:
  """Trials that kill a random stage's actor at a random moment after the first step."""
  rng = random.Random(args.seed)
  expected = state
  for batch in batches:
    expected = ref(expected, batch)[0]
  timing = _elastic_step(step, plan, args.every)
  s_par = timing(state, batches[0])[0]
  t_step = time.perf_counter()
  timing(s_par, batches[1])   # a normal step's time, to place the kills
  t_step = time.perf_counter() - t_step
  timing.replan(CLUSTER)      # shuts its workers down
  for trial in range(args.random):
    pstep = _elastic_step(step, plan, args.every)
    s_par = pstep(state, batches[0])[0]
    # The kill lands somewhere in steps 2 .. N-1 (or between them); step N starts after it,
    # so the final state is always on live workers.
    stage, delay = rng.randrange(3), rng.uniform(0, t_step * (len(batches) - 2))
    runner = pstep.runner(s_par, batches[1])
    killer = threading.Timer(delay, runner.kill_stage, (stage,))
    killer.start()
    t0 = time.perf_counter()
    for i, batch in enumerate(batches[1:], start=1):
      if i == len(batches) - 1:
        killer.join()
      s_par = pstep(s_par, batch)[0]
    err = _max_rel_err(expected, s_par)
    rec = pstep.recoveries[0] if pstep.recoveries else None
    assert rec is not None, "the kill was not noticed"
    where = (f"recovered at step {rec.failed_step} in {rec.total_s:.1f} s "
             f"(checkpoint {rec.checkpoint_step}, {rec.replayed} replayed)")
    print(f"trial {trial}: killed stage {stage} {delay:.2f} s into steps 2..{len(batches) - 1} "
          f"({time.perf_counter() - t0:.1f} s); {where}; state vs jax.jit {err:.2g}",
          flush=True)
    assert err <= 1e-9, err


if __name__ == "__main__":
  main()
