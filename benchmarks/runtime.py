"""Emulated heterogeneous runs of the Ray runtime against the simulator.

A 3-stage plan over two emulated subclusters (stage 0 on two "V100"s, stages 1 and 2 on two
"A100" hosts joined by a 200 Gbps RDMA fabric) with a slow Ethernet link between the
subclusters, for each schedule and cross-subcluster bandwidth: the measured iteration time of
the Ray runtime with emulation on, next to the simulator's prediction for the same numbers, and
the H-1F1B speed-up over 1F1B both ways.

The emulated workload: per microbatch, stage times (forward + backward, split 1:2) of
60 / 54 / 60 ms and an 8 MiB activation crossing each cut (a tiny MLP actually runs;
``bytes_scale`` stands for the larger model), scaled by ``--time-scale`` to keep runs short.

  python benchmarks/runtime.py                       # schedules x bandwidths table
  python benchmarks/runtime.py --backend threads     # the same workers without Ray
  python benchmarks/runtime.py --spmd                # A100 stages over two processes each

On a real cluster (``docker/launch.sh`` starts Ray over the hosts)::

  python benchmarks/runtime.py cluster --cluster my_cluster.yaml --address auto [--plan p.json]

trains a GPT with ``runtime="ray"`` on the cluster file's hosts (one stage per host unless a
plan is given) and prints the step times; the driver itself needs no GPU (it traces and lowers
each stage for the workers' platform with ``jax.export``; the actors compile and run them on
their hosts' GPUs).

"measured" is the driver's wall time per step (median over ``--steps`` after two warm-up
steps), "pipeline" the workers' own span from the first forward to the last backward, which is
what the simulator models (it leaves out the optimizer update and the driver's call).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time



def _driver_devices(argv) -> int:
  """Fake CPU devices the driver needs: 8, or the cluster file's device count (``cluster``)."""
  if argv and argv[0] == "cluster" and "--cluster" in argv:
    import yaml  # pylint: disable=import-outside-toplevel
    with open(argv[argv.index("--cluster") + 1]) as f:
      spec = yaml.safe_load(f)
    return sum(s["hosts"] * s["devices_per_host"] for s in spec["subclusters"])
  return 8


if __name__ == "__main__":   # the driver traces on fake CPU devices, set before JAX starts
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                             f"device_count={_driver_devices(sys.argv[1:])}").strip()
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import harpjax  # noqa: E402
from harpjax.models import GPT, MLP, GPTConfig
from harpjax.runtime.emulation import Emulation, annotate_plan  # noqa: E402

STAGE_TIMES_S = (0.060, 0.054, 0.060)     # forward + backward per microbatch, emulated GPUs
ACT_BYTES = 8 * 2**20                     # emulated activation bytes per microbatch
WIDTH, BATCH, MICROBATCHES = 256, 64, 8
BANDWIDTHS_GBPS = (1.5, 2.5, 5.0, 10.0)


def make_cluster(gbps: float) -> harpjax.Cluster:
  """1 host x 4 V100 and 2 hosts x 2 A100; RDMA inside each, ``gbps`` Ethernet between."""
  return harpjax.Cluster.simple([("v100", "V100-32G", 1, 4), ("a100", "A100-40G", 2, 2)],
                                inter_gbps=gbps, intra_gbps=200.0)


def make_step():
  def step(state, batch):
    def loss_fn(p):
      logits = state.apply_fn(p, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss
  return step


def make_state_and_batch():
  model = MLP(features=(WIDTH,) * 3, num_classes=10)
  x = jax.random.normal(jax.random.key(0), (BATCH, WIDTH))
  state = train_state.TrainState.create(apply_fn=model.apply,
                                        params=model.init(jax.random.key(1), x),
                                        tx=optax.adam(1e-3))
  batch = {"x": x, "y": jax.random.randint(jax.random.key(2), (BATCH,), 0, 10)}
  return state, batch


BASE_PLAN = harpjax.ManualPlan([
    harpjax.StageSpec((0, 0), "v100", (1, 2), devices=(0, 1)),
    harpjax.StageSpec((1, 1), "a100", (1, 2), devices=(4, 5)),
    harpjax.StageSpec((2, 3), "a100", (1, 2), devices=(6, 7)),
], num_microbatches=MICROBATCHES)

# --spmd: stages 1 and 2 each span both A100 hosts (one device on each), so each runs as one
# SPMD program over two processes (runtime option spmd_hosts).
SPMD_PLAN = harpjax.ManualPlan([
    harpjax.StageSpec((0, 0), "v100", (1, 2), devices=(0, 1)),
    harpjax.StageSpec((1, 1), "a100", (2, 1), devices=(4, 6)),
    harpjax.StageSpec((2, 3), "a100", (2, 1), devices=(5, 7)),
], num_microbatches=MICROBATCHES)


def fidelity_case(schedule: str, gbps: float, *, backend: str = "ray", steps: int = 5,
                  time_scale: float = 1.0, runtime_options: dict | None = None,
                  spmd: bool = False) -> dict:
  """Runs ``steps`` emulated steps (after two warm-up steps) and simulates the same numbers.

  Returns:
    ``{"measured": median wall s, "pipeline": median worker span s, "simulated": s,
    "warmups": [...], "overruns": n, "last": the last MeasuredStep, "sim": the SimResult}``.
  """
  cluster = make_cluster(gbps)
  state, batch = make_state_and_batch()
  step = make_step()
  base = SPMD_PLAN if spmd else BASE_PLAN
  plan = base.with_stages([dataclasses.replace(s, time_s=t)
                           for s, t in zip(base.stages, STAGE_TIMES_S)])
  probe = harpjax.auto_parallel(step, cluster=cluster, plan=plan)
  layers = probe.trace(state, batch).layers
  act = layers[plan.stages[0].layers[1]].boundary_bytes
  emulation = Emulation(time_scale=time_scale, bytes_scale=ACT_BYTES / act)
  plan = annotate_plan(plan, layers, cluster, emulation)
  opts = {"backend": backend, "emulation": emulation}
  if spmd:
    opts["spmd_hosts"] = True
  opts.update(runtime_options or {})
  pstep = harpjax.auto_parallel(step, cluster=cluster, plan=plan.replace(schedule=schedule),
                                runtime=harpjax.RayRuntime(**opts))
  s = state
  walls, spans, overruns = [], [], 0
  for i in range(steps + 2):
    s, _ = pstep(s, batch)
    runner = pstep.runner(s, batch)
    if i >= 2:
      walls.append(runner.last.wall_s)
      spans.append(runner.last.iteration_time)
      overruns += sum(runner.last.overruns)
  sim = runner.simulate()
  out = {"measured": statistics.median(walls), "pipeline": statistics.median(spans),
         "simulated": sim.iteration_time, "warmups": list(pstep.plan(state, batch).warmups or ()),
         "overruns": overruns, "last": runner.last, "sim": sim}
  runner.shutdown()
  return out


def fidelity_main(args) -> None:
  print(f"3 stages (V100 | A100 | A100), B={MICROBATCHES}, t = "
        f"{'/'.join(f'{t * 1e3:.0f}' for t in STAGE_TIMES_S)} ms, {ACT_BYTES / 2**20:.0f} MiB "
        f"activations, time scale {args.time_scale}; backend {args.backend}"
        + ("; stages 1 and 2 each over both A100 hosts (SPMD groups)" if args.spmd else "")
        + "; times in ms")
  head = (f"{'Gbps':>6} {'schedule':>8} {'warm-ups':>10} {'simulated':>10} {'measured':>9} "
          f"{'err':>6} {'pipeline':>9} {'err':>6}")
  print(head)
  print("-" * len(head))
  t0 = time.time()
  for gbps in args.gbps:
    res = {}
    for schedule in ("1f1b", "h1f1b"):
      r = fidelity_case(schedule, gbps, backend=args.backend, steps=args.steps,
                        time_scale=args.time_scale, spmd=args.spmd)
      res[schedule] = r
      err = r["measured"] / r["simulated"] - 1
      perr = r["pipeline"] / r["simulated"] - 1
      print(f"{gbps:6g} {schedule:>8} {str(r['warmups']):>10} {r['simulated'] * 1e3:10.1f} "
            f"{r['measured'] * 1e3:9.1f} {err * 100:+5.1f}% {r['pipeline'] * 1e3:9.1f} "
            f"{perr * 100:+5.1f}%" + (f"  ({r['overruns']} overruns)" if r["overruns"] else ""))
      if args.trace:
        from harpjax.compiler.schedule import timeline
        os.makedirs(args.trace, exist_ok=True)
        for kind, obj in (("measured", r["last"]), ("simulated", r["sim"])):
          timeline.save_chrome_trace(obj, os.path.join(
              args.trace, f"{schedule}_{gbps:g}gbps_{kind}.json"))
    sim_speedup = res["1f1b"]["simulated"] / res["h1f1b"]["simulated"]
    meas_speedup = res["1f1b"]["measured"] / res["h1f1b"]["measured"]
    print(f"{'':6} H-1F1B speed-up: simulated {sim_speedup:.3f}x, measured {meas_speedup:.3f}x "
          f"(difference {100 * (meas_speedup - sim_speedup):+.1f} points)")
  print(f"total {time.time() - t0:.0f} s")


def cluster_main(args) -> None:
  """A GPT trained with runtime="ray" on the hosts of a real cluster file."""
  cluster = harpjax.Cluster.load(args.cluster)
  cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, hidden=args.hidden,
                  num_heads=max(1, args.hidden // 64), num_blocks=args.blocks)
  model = GPT(cfg)
  tokens = jax.random.randint(jax.random.key(1), (args.batch, cfg.seq_len + 1), 0, cfg.vocab_size)
  params = model.init(jax.random.key(0), jnp.zeros((args.batch, cfg.seq_len), jnp.int32))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(3e-4))

  def step(state, tokens):
    def loss_fn(p):
      logits = state.apply_fn(p, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  if args.plan:
    plan = harpjax.load_plan(args.plan)
  else:   # one stage per host, layers split evenly
    hosts = [h for sc in cluster.subclusters for h in sc.hosts]
    num_layers = cfg.num_blocks + 2
    if len(hosts) > num_layers:
      raise SystemExit(f"{len(hosts)} hosts but only {num_layers} layers: give --plan")
    bounds = [round(i * num_layers / len(hosts)) for i in range(len(hosts) + 1)]
    plan = harpjax.ManualPlan([((a, b - 1), h.subcluster, (1, h.num_devices))
                               for h, a, b in zip(hosts, bounds, bounds[1:])])
  opts = {"address": args.address}
  if args.nic_addresses:
    import yaml  # pylint: disable=import-outside-toplevel
    with open(args.nic_addresses) as f:
      opts["nic_addresses"] = yaml.safe_load(f)
  if args.schedule is not None:
    plan = plan.replace(schedule=args.schedule)
  pstep = harpjax.auto_parallel(step, cluster=cluster, plan=plan,
                                num_microbatches=args.microbatches,
                                runtime=harpjax.RayRuntime(**opts))
  s = state
  for i in range(args.steps):
    t = time.perf_counter()
    s, loss = pstep(s, tokens)
    print(f"step {i}: loss {float(loss):.4f}, {time.perf_counter() - t:.3f} s", flush=True)
  runner = pstep.runner(s, tokens)
  print(pstep.plan(s, tokens))
  for r in runner.routes.values():
    print(" ", r.describe(), "-", r.reason)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = ap.add_subparsers(dest="mode")
  fid = sub.add_parser("fidelity", help="emulated runs vs the simulator (default)")
  for p in (ap, fid):
    p.add_argument("--backend", default="ray", choices=("ray", "threads"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="emulated times x this (below 1, fixed Python and Ray overheads weigh "
                        "more)")
    p.add_argument("--gbps", type=float, nargs="*", default=list(BANDWIDTHS_GBPS))
    p.add_argument("--trace", help="directory for Chrome traces of measured and simulated runs")
    p.add_argument("--spmd", action="store_true",
                   help="stages 1 and 2 each span both A100 hosts: one process per host")
  cl = sub.add_parser("cluster", help="a GPT on a real Ray cluster")
  cl.add_argument("--cluster", required=True)
  cl.add_argument("--address", default="auto")
  cl.add_argument("--plan")
  cl.add_argument("--nic-addresses", help="YAML {host: {nic: ip}}")
  cl.add_argument("--schedule", default="h1f1b")
  cl.add_argument("--steps", type=int, default=10)
  cl.add_argument("--batch", type=int, default=32)
  cl.add_argument("--microbatches", type=int, default=8)
  cl.add_argument("--hidden", type=int, default=1024)
  cl.add_argument("--blocks", type=int, default=8)
  cl.add_argument("--seq-len", type=int, default=512)
  cl.add_argument("--vocab", type=int, default=32000)
  args = ap.parse_args(argv)
  if args.mode == "cluster":
    cluster_main(args)
  else:
    fidelity_main(args)


if __name__ == "__main__":
  main()
