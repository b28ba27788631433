"""What the planner predicts against what runs: per zoo model and stage, and per plan.

For each model (the test zoo's ``nn.scan``, ``nn.remat``, remat-policy and Python-loop
classifiers and its top-2 MoE, the repository's GPT shaped like GPT-2 and a BERT-shaped
encoder), ``auto_parallel`` plans it on the demo cluster (4 V100 + 2 x 2 A100 as 8 fake CPU
devices) with remat off and on, and every stage of the plan is compiled as the runtime runs it.
Four tables, each with the relative error per row and the largest |error| under it:

* **FLOPs**: the cost tables' FLOPs of the stage (the profile's per-layer ``flops`` on the
  stage's (subcluster, submesh, logical mesh), summed over its layers) against XLA's
  ``cost_analysis()["flops"]`` of the stage's forward and backward executables.
* **bytes**: the bytes the time model reads (the jaxpr estimate's
  :class:`~harpjax.compiler.profile.calibration.Work` of each layer's forward+backward on the
  stage's logical mesh, with the recompute under remat; the tables keep times, not bytes) and
  :func:`~harpjax.compiler.profile.estimate.jaxpr_stats`'s ``bytes_accessed`` against XLA's
  ``cost_analysis()["bytes accessed"]`` of the same two executables.
* **memory**: the planner's peak for the stage (what :func:`~harpjax.compiler.plan.
  evaluate_plan` checks against the device: fixed bytes + in-flight microbatches' residuals,
  or the reduction and optimizer update if larger) against XLA's peak over every phase of the
  stage (:func:`~harpjax.compiler.stages.memory_report`: forward, backward, update).
* **iteration time**: for a few plans (the planner's on the demo cluster and hand-written
  ones), the planner's predicted seconds per iteration against the runtime run with emulated
  GPUs (``runtime="ray"``, ``backend="threads"``, :class:`~harpjax.runtime.emulation.
  Emulation`: each task sleeps to the tables' forward/backward time of its stage, each message
  to its link's time, each stage's end to the tables' gradient-sync + update time; durations
  multiplied by a ``time_scale`` that keeps the real CPU work below them, then divided out).

Every model runs in float32 with float32 AdamW/Adam (16 bytes of state per parameter, 8 of
them the optimizer's); the zoo's float64 is for its equivalence tests.

  python benchmarks/fidelity.py          # the default (about 6 minutes on 2 CPU cores)
  python benchmarks/fidelity.py --models gpt moe --remat off --time-plans gpt:planner gpt:dp4/dp2
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import harpjax  # noqa: E402
from harpjax.compiler.plan import evaluate_plan  # noqa: E402
from harpjax.compiler.profile import (ProfileOptions, estimate, pieces, stage_flops,  # noqa: E402
                                      tables_for_plan)
from harpjax.compiler.stages import compile_stage, memory_report  # noqa: E402
from harpjax.models import GPT, GPTConfig  # noqa: E402
from harpjax.runtime.emulation import Emulation  # noqa: E402

CLUSTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "demo_local.yaml")
MICROBATCHES = 4
# float32 Adam: weights, gradients and two moments; the moments are the optimizer's
OPTS = dict(state_bytes_per_param=16.0, optimizer_bytes_per_param=8.0, use_cache=False,
            progress=False)

# x64 stays off: the zoo's float64 requests come out float32 (JAX warns once per request)
warnings.filterwarnings("ignore", message=".*Explicitly requested dtype.*")


# --------------------------------------------------------------------------- models


@dataclasses.dataclass
class Model:
  step: object
  args: tuple       # the step's arguments: (state, batch, ...)


def _gpt(dropout: float = 0.1) -> Model:
  """The repository's GPT shaped like GPT-2 (pre-LayerNorm, GELU, tied embedding, dropout
  0.1, no cuts marked) at a small width."""
  from harpjax.examples.demo import counting_batch, make_step
  cfg = GPTConfig(vocab_size=512, seq_len=32, hidden=64, num_heads=4, num_blocks=2,
                  dropout=dropout, layer_marks=0)
  model = GPT(cfg)
  params = model.init(jax.random.key(0), jnp.zeros((16, cfg.seq_len), jnp.int32))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(1e-3))
  tokens = counting_batch(jax.random.key(1), 16, cfg.seq_len, cfg.vocab_size)
  return Model(make_step(), (state, tokens, jax.random.key(2)))


def _bert() -> Model:
  """The BERT-shaped encoder of ``benchmarks/first_step.py`` (post-LayerNorm, bidirectional
  attention, masked-LM head tied to the embedding, dropout 0.1) at a small width."""
  from benchmarks.first_step import _bert_module
  bert, _ = _bert_module()
  model = bert(vocab=512, seq=32, hidden=64, heads=4, layers=2)
  seq = model.seq
  params = model.init(jax.random.key(0), jnp.zeros((16, seq), jnp.int32))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(1e-3))
  tokens = jax.random.randint(jax.random.key(1), (16, seq), 1, model.vocab)

  def step(state, tokens, rng):
    def loss_fn(params):
      masked = (jnp.arange(seq) % 7 == 3)[None, :]
      logits = state.apply_fn(params, jnp.where(masked, 0, tokens), train=True,
                              rngs={"dropout": rng})
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
      return (ce * masked).sum() / (masked.sum() * tokens.shape[0])
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss
  return Model(step, (state, tokens, jax.random.key(2)))


def _zoo(name: str) -> Model:
  from tests import zoo
  if name == "moe":
    case = zoo.moe_capacity(False)        # top-2, every token fits (no drops)
  elif name == "batch_stats":
    case = zoo.batch_stats()
  elif name == "nnx":
    case = zoo.nnx_model()
  else:
    case = zoo.linen(name)
  return Model(case.step, (case.state, case.batches[0]))


MODELS = {
    "gpt": _gpt, "gpt-nodropout": lambda: _gpt(dropout=0.0), "bert": _bert,
    **{k: (lambda k=k: _zoo(k)) for k in ("loop", "scan", "remat", "scan_remat",
                                           "remat_policy", "while", "cond", "jit", "scan_jit",
                                           "moe", "batch_stats", "nnx")},
}
DEFAULT_MODELS = ("gpt", "bert", "loop", "scan", "remat", "remat_policy", "moe")


def _manual(L: int, name: str) -> harpjax.Plan:
  """Hand-written plans over ``L`` layers."""
  if name == "dp4/dp2":         # V100s data-parallel, then one A100 host data-parallel
    return harpjax.ManualPlan([dict(layers=(0, L // 2 - 1), subcluster="v100", submesh=(1, 4),
                                    logical_mesh=(4, 1)),
                               dict(layers=(L // 2, L - 1), subcluster="a100", submesh=(1, 2),
                                    logical_mesh=(2, 1))])
  if name == "dp4/dp2/dp2":     # three stages, one per host
    a, b = L // 3, 2 * L // 3
    return harpjax.ManualPlan([dict(layers=(0, a - 1), subcluster="v100", submesh=(1, 4),
                                    logical_mesh=(4, 1)),
                               dict(layers=(a, b - 1), subcluster="a100", submesh=(1, 2),
                                    logical_mesh=(2, 1)),
                               dict(layers=(b, L - 1), subcluster="a100", submesh=(1, 2),
                                    logical_mesh=(2, 1))])
  raise SystemExit(f"unknown plan {name!r}")


PLANS = ("planner", "dp4/dp2", "dp4/dp2/dp2")
DEFAULT_TIME_PLANS = ("gpt:planner", "gpt:dp4/dp2", "gpt:dp4/dp2/dp2", "bert:planner")


# --------------------------------------------------------------------------- per stage


def _xla_costs(compiled) -> tuple[float, float]:
  """FLOPs and bytes accessed of a stage's forward and backward executables (per device)."""
  flops = nbytes = 0.0
  for k in ("fwd", "bwd"):
    ca = compiled[k].cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    flops += float(ca.get("flops", 0.0))
    nbytes += float(ca.get("bytes accessed", 0.0))
  return flops, nbytes


class _Estimates:
  """The jaxpr estimate of each layer's forward+backward (traced once per signature)."""

  def __init__(self, layers, remat: bool):
    self.layers, self.remat = layers, remat
    self.dep = pieces.batch_dependent(layers.program, layers.input_kinds)
    self.traced: dict = {}

  def bytes(self, first: int, last: int, mesh) -> tuple[float, float]:
    """``(time model's bytes, jaxpr_stats's bytes_accessed)`` summed over the layers."""
    work = stats = 0.0
    for i in range(first, last + 1):
      sig = self.layers[i].signature
      if sig not in self.traced:
        self.traced[sig] = estimate.trace_piece(
            pieces.build_piece(self.layers, i, i, self.dep), self.remat, MICROBATCHES)
      st, w = estimate.jaxpr_costs(self.traced[sig], tuple(mesh))
      work += w.bytes
      stats += st.bytes_accessed
    return work, stats


# Plain stages only: these rows compare each stage's tables with XLA's account of its
# compiled programs; a zebra stage (attention and experts on two groups, which the planner now
# considers for routed models by default) has its own report (``memory_report``, docs/moe.md).
PLAIN = harpjax.SolveOptions(mixed_options=harpjax.MixedOptions(zebra="off"))


def measure_stages(name: str, remat: bool, plan_name: str = "planner") -> list[dict]:
  """Per stage of a plan (the planner's, or a hand-written one): tables vs XLA for FLOPs,
  bytes and peak memory."""
  m = MODELS[name]()
  opts = ProfileOptions(remat=remat, **OPTS)
  step = harpjax.auto_parallel(m.step, cluster=CLUSTER, num_microbatches=MICROBATCHES,
                               plan=harpjax.AutoPlan(profile=opts, solve=PLAIN))
  prof = step.profile(*m.args)
  if plan_name != "planner":
    plan = dataclasses.replace(_manual(len(prof.layers), plan_name),
                               num_microbatches=MICROBATCHES, layer_source="auto",
                               remat="full" if remat else "none")
    step = harpjax.auto_parallel(m.step, cluster=CLUSTER, num_microbatches=MICROBATCHES,
                                 plan=plan)
  plan = step.plan(*m.args)
  cs = step.compile(*m.args)
  tables = tables_for_plan(prof, cs.plan)
  ev = evaluate_plan(tables, cs.plan, MICROBATCHES, schedule=cs.plan.schedule)
  est = _Estimates(prof.layers, remat)
  rows = []
  for s, (spec, st) in enumerate(zip(cs.plan.stages, cs.stages)):
    compiled = compile_stage(st)
    xla_flops, xla_bytes = _xla_costs(compiled)
    i, j = spec.layers
    costs = prof.costs[(spec.subcluster, tuple(spec.submesh), tuple(spec.logical_mesh))]
    work_bytes, stats_bytes = est.bytes(i, j, spec.logical_mesh)
    r = memory_report(cs, s, compiled=compiled)
    ps = ev.stages[s]
    rows.append(dict(
        model=name if plan_name == "planner" else f"{name} [{plan_name}]",
        remat=cs.plan.remat_of(spec), stage=s, layers=f"{i}-{j}",
        where=f"{spec.subcluster} {tuple(spec.logical_mesh)}", zero=spec.zero,
        flops=(float(stage_flops(costs, cs.plan.remat_of(spec))[i, j]), xla_flops),
        bytes=(work_bytes, stats_bytes, xla_bytes),
        mem=(ps.peak_mem_bytes, r.xla_peak_bytes, max(r.phases, key=r.phases.get),
             ps.inflight, r.in_flight)))
  return rows


# --------------------------------------------------------------------------- iteration time


def measure_plan(name: str, plan_name: str, *, steps: int, min_task_s: float) -> dict:
  """The planner's predicted iteration against the emulated runtime's, for one plan."""
  m = MODELS[name]()
  probe = harpjax.auto_parallel(m.step, cluster=CLUSTER, num_microbatches=MICROBATCHES,
                                plan=harpjax.AutoPlan(profile=ProfileOptions(**OPTS),
                                                      solve=PLAIN))
  prof = probe.profile(*m.args)
  if plan_name == "planner":
    plan = probe.plan(*m.args)
  else:
    plan = dataclasses.replace(_manual(len(prof.layers), plan_name),
                               num_microbatches=MICROBATCHES, layer_source="auto")
  tables = tables_for_plan(prof, plan)
  ev = evaluate_plan(tables, plan, MICROBATCHES, schedule=plan.schedule)
  # The stages' times and cuts the runtime derives H-1F1B's warm-ups from, as evaluated.
  plan = plan.with_stages([dataclasses.replace(s, time_s=p.time_s,
                                               comm_s=p.comm_s if k + 1 < plan.num_stages
                                               else None)
                           for k, (s, p) in enumerate(zip(plan.stages, ev.stages))])
  fwd = tuple(p.time_s / 3 for p in ev.stages)
  bwd = tuple(p.time_s - f for p, f in zip(ev.stages, fwd))
  scale = max(1.0, min_task_s / min(fwd))
  emu = Emulation(fwd_s=fwd, bwd_s=bwd, end_s=tuple(ev.end_s) or None, time_scale=scale)
  pstep = harpjax.auto_parallel(m.step, cluster=CLUSTER, num_microbatches=MICROBATCHES,
                                plan=plan,
                                runtime=harpjax.RayRuntime(backend="threads", emulation=emu))
  args = m.args
  walls, spans, overruns = [], [], 0
  runner = None
  try:
    for k in range(steps + 2):
      out = pstep(*args)
      args = (out[0],) + tuple(args[1:])
      runner = pstep.runner(*args)
      if k >= 2:
        walls.append(runner.last.wall_s / scale)
        spans.append(runner.last.iteration_time / scale)
        overruns += sum(runner.last.overruns)
    sim = runner.simulate().iteration_time / scale
    warm = pstep.plan(*args).warmups
  finally:
    if runner is not None:
      runner.shutdown()
  return dict(model=name, plan=plan_name, stages="; ".join(
      f"{s.layers[0]}-{s.layers[1]} {s.subcluster} {tuple(s.logical_mesh)}"
      for s in plan.stages), warmups=warm, eval_warmups=ev.warmups,
      predicted=ev.iteration_s, planner=plan.predicted_iteration_s, simulated=sim,
      measured=statistics.median(walls), pipeline=statistics.median(spans),
      overruns=overruns, scale=scale)


# --------------------------------------------------------------------------- output


def _err(pred: float, ref: float) -> float:
  return pred / ref - 1.0 if ref else float("nan")


def _pct(x: float) -> str:
  return f"{100 * x:+.1f}%"


def _worst(errs) -> str:
  errs = [e for e in errs if np.isfinite(e)]
  return _pct(max(errs, key=abs)) if errs else "n/a"


def print_stage_tables(rows: list[dict]) -> dict:
  head = "| model | remat | stage | layers | subcluster (dp, tp) | zero |"
  sep = "|---|---|---|---|---|---|"
  key = lambda r: (f"| {r['model']} | {r['remat']} | {r['stage']} | {r['layers']} "
                   f"| {r['where']} | {r['zero']} |")
  summary = {}

  print("\n### FLOPs per device (forward + backward of one microbatch)\n")
  print("The bytes ratio is the time model's bytes (`Work.bytes`, read off the same forward, "
        "recompute and backward as the FLOPs) over XLA's `bytes accessed` of the same two "
        "executables.\n")
  print(head + " tables (MFLOP) | XLA (MFLOP) | error | bytes: time model / XLA |")
  print(sep + "---|---|---|---|")
  errs, ratios = [], []
  for r in rows:
    t, x = r["flops"]
    w, _, xb = r["bytes"]
    errs.append(_err(t, x))
    ratios.append(w / xb if xb else float("nan"))
    print(f"{key(r)} {t / 1e6:.3f} | {x / 1e6:.3f} | {_pct(errs[-1])} | {ratios[-1]:.2f} |")
  summary["flops"] = _worst(errs)
  finite = [q for q in ratios if np.isfinite(q)]
  print(f"\nLargest |FLOPs error|: {summary['flops']}; bytes ratio "
        + (f"{min(finite):.2f} to {max(finite):.2f}, median {statistics.median(finite):.2f}"
           if finite else "n/a"))

  print("\n### Bytes accessed per device (forward + backward of one microbatch)\n")
  print(head + " time model (MB) | error | jaxpr_stats (MB) | error | XLA (MB) |")
  print(sep + "---|---|---|---|---|")
  errs_w, errs_s = [], []
  for r in rows:
    w, s, x = r["bytes"]
    errs_w.append(_err(w, x))
    errs_s.append(_err(s, x))
    print(f"{key(r)} {w / 1e6:.3f} | {_pct(errs_w[-1])} | {s / 1e6:.3f} "
          f"| {_pct(errs_s[-1])} | {x / 1e6:.3f} |")
  summary["bytes"] = _worst(errs_w)
  summary["bytes_stats"] = _worst(errs_s)
  print(f"\nLargest |bytes error|: time model {summary['bytes']}, jaxpr_stats "
        f"{summary['bytes_stats']}")

  print("\n### Peak memory per device (one step)\n")
  print(head + " N (planner / runtime) | planner (MiB) | XLA peak (MiB) | XLA peaks in "
        "| error |")
  print(sep + "---|---|---|---|---|")
  errs = []
  for r in rows:
    p, x, phase, n_p, n_r = r["mem"]
    errs.append(_err(p, x))
    print(f"{key(r)} {n_p} / {n_r} | {p / 2**20:.3f} | {x / 2**20:.3f} | {phase} "
          f"| {_pct(errs[-1])} |")
  summary["memory"] = _worst(errs)
  print(f"\nLargest |memory error|: {summary['memory']}")
  return summary


def print_time_table(rows: list[dict]) -> str:
  print("\n### Iteration time: predicted vs the emulated runtime\n")
  print("| model | plan | stages | warm-ups | time scale | predicted (ms) "
        "| emulated run (ms) | error | pipeline span (ms) | simulated from the run (ms) "
        "| overruns |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  errs = []
  for r in rows:
    errs.append(_err(r["predicted"], r["measured"]))
    warm = ",".join(str(w) for w in (r["warmups"] or ()))
    print(f"| {r['model']} | {r['plan']} | {r['stages']} | {warm} | {r['scale']:.0f} "
          f"| {r['predicted'] * 1e3:.3f} | {r['measured'] * 1e3:.3f} | {_pct(errs[-1])} "
          f"| {r['pipeline'] * 1e3:.3f} | {r['simulated'] * 1e3:.3f} | {r['overruns']} |")
  worst = _worst(errs)
  for r in rows:
    if r["planner"] is not None and abs(_err(r["planner"], r["predicted"])) > 1e-3:
      print(f"\n{r['model']} {r['plan']}: the plan says {r['planner'] * 1e3:.3f} ms, "
            f"evaluate_plan on its own meshes {r['predicted'] * 1e3:.3f} ms")
  print(f"\nLargest |iteration time error|: {worst}")
  return worst


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS), choices=list(MODELS),
                  help="models for the per-stage tables")
  ap.add_argument("--remat", nargs="*", default=["off", "on"], choices=["off", "on"])
  ap.add_argument("--stage-plans", nargs="*", default=["planner"], choices=list(PLANS),
                  help="plans whose stages the FLOPs, bytes and memory tables measure")
  ap.add_argument("--time-plans", nargs="*", default=list(DEFAULT_TIME_PLANS),
                  help="MODEL:PLAN pairs for the iteration-time table; PLAN one of "
                       f"{', '.join(PLANS)}")
  ap.add_argument("--steps", type=int, default=3,
                  help="emulated steps timed per plan (median), after two warm-up steps")
  ap.add_argument("--min-task-ms", type=float, default=40.0,
                  help="the shortest emulated forward is stretched to this (time_scale), above "
                       "what the real work takes on CPU")
  args = ap.parse_args(argv)
  if jax.device_count() < 8:
    raise SystemExit("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
  import subprocess
  rev = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                       text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
  print(f"harpjax {rev or '?'}; demo cluster {os.path.basename(CLUSTER)}; "
        f"B = {MICROBATCHES} microbatches; float32 Adam (16 bytes of state per parameter)")
  t0 = time.perf_counter()
  rows, failed = [], []
  for name in args.models:
    for plan_name in args.stage_plans:
      for remat in args.remat:
        t = time.perf_counter()
        what = f"{name} [{plan_name}], remat {remat}"
        try:
          rows += measure_stages(name, remat == "on", plan_name)
        except Exception as e:  # noqa: BLE001 -- a model that cannot be measured is reported
          failed.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0]}")
        print(f"[{what}: {time.perf_counter() - t:.0f} s]", file=sys.stderr, flush=True)
  summary = print_stage_tables(rows) if rows else {}
  times = []
  for pair in args.time_plans:
    name, _, plan_name = pair.partition(":")
    t = time.perf_counter()
    try:
      times.append(measure_plan(name, plan_name or "planner", steps=args.steps,
                                min_task_s=args.min_task_ms / 1e3))
    except Exception as e:  # noqa: BLE001
      failed.append(f"{pair}: {type(e).__name__}: {str(e).splitlines()[0]}")
    print(f"[{pair}: {time.perf_counter() - t:.0f} s]", file=sys.stderr, flush=True)
  if times:
    summary["time"] = print_time_table(times)
  if failed:
    print("\nNot measured:")
    for f in failed:
      print(f"* {f}")
  print("\nSummary (largest |error|): " + ", ".join(f"{k} {v}" for k, v in summary.items())
        + f"; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
