"""Checks that need a real GPU: a pipelined step compiled for it equals ``jax.jit`` in float64,
and per-layer times measured on it against the cost model.

Two parts, each in its own process (``--part``):

``equal``
  Models of the test zoo (a Python loop, ``nn.remat``, ``nn.scan``, a remat policy) and a GPT
  with dropout, each cut into a pipeline of 2-3 stages (H-1F1B, 4 microbatches) by a hand-made
  plan, laid out by harpjax, compiled for the local accelerator and run by the local runtime,
  against ``jax.jit`` of the same step, float64, a few steps each. With one GPU every stage sits
  on that GPU (the runtime's messages between stages are device-local copies there); the
  programs, the schedule and the interpreter are the ones a multi-GPU run executes.

``times``
  Forward+backward of one transformer block of the models ``tools/calibration.py`` rebuilds
  (the Zorse repository's DeepSpeed GPT and LLaMA shapes, fp16), timed on the accelerator
  (median over repetitions of back-to-back calls, so host dispatch hides behind the device),
  per whole block and per layer of harpjax's layer construction; XLA's FLOPs of each compiled
  layer beside. The JSON it writes is read by ``python benchmarks/gpu_check.py --fit FILE``,
  which pairs each time with the :class:`~harpjax.compiler.profile.calibration.Work` read off
  the same program (no GPU needed), prints the cost model's error with the roofline default and
  fits the GPU type's factors (``tools/calibration.py``'s ``fit``).

Run ``python benchmarks/gpu_check.py --part equal --part times --out DIR`` on the GPU machine
(``--budget-s`` bounds the timing part), then ``--fit DIR/times.json --gpu H200`` anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

# (model, seq) blocks timed whole, at these microbatch sizes; per layer on the first few.
BLOCKS = [("deepspeedgpt_1.3b", 1024), ("deepspeedgpt_2.7b", 1024), ("deepspeedgpt_6.7b", 1024),
          ("deepspeedllama_7b", 1024), ("deepspeedllama_13b", 1024),
          ("deepspeedgpt_1.3b", 2048), ("deepspeedllama_3b", 2048), ("deepspeedgpt_6.7b", 2048)]
MBS = (1, 2, 4, 8)
PER_LAYER = {("deepspeedgpt_1.3b", 1024), ("deepspeedgpt_6.7b", 1024), ("deepspeedllama_7b", 1024)}


def _env() -> dict:
  import jax
  out = {"python": platform.python_version(), "jax": jax.__version__,
         "devices": [str(d) for d in jax.devices()],
         "device_kind": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform}
  for name in ("jaxlib", "flax", "optax", "numba", "numpy"):
    try:
      out[name] = __import__(name).__version__
    except Exception as e:  # noqa: BLE001 - reported, not fatal
      out[name] = f"missing ({e})"
  return out


# --------------------------------------------------------------------------- equal


def _cluster_file(path: str, gpu: str, devices: int) -> str:
  with open(path, "w") as f:
    f.write(f"name: one-gpu\nsubclusters:\n  - name: gpu\n    gpu: {gpu}\n    hosts: 1\n"
            f"    devices_per_host: {devices}\n    nics:\n"
            f"      - {{name: eth0, kind: ethernet, gbps: 100, network: dc}}\n")
  return path


def _cuts(num_layers: int, stages: int):
  bounds = [round(num_layers * k / stages) for k in range(stages + 1)]
  return [(bounds[k], bounds[k + 1] - 1) for k in range(stages)]


def _equal_case(name, step, state, batches, extra, stages, gpu, tmp, remat="none"):
  import jax

  import harpjax
  from harpjax.compiler.stages import compile_step
  from harpjax.runtime import run_step
  from tests.equivalence import max_rel_err

  cluster = _cluster_file(os.path.join(tmp, f"{name}.yaml"), gpu, stages)
  first = (state, batches[0]) + tuple(extra[0])
  layers = harpjax.auto_parallel(step, cluster=cluster, num_microbatches=4).trace(*first).layers
  plan = dataclasses.replace(
      harpjax.ManualPlan([((i, j), "gpu", (1, 1)) for i, j in _cuts(len(layers), stages)]),
      layer_source="auto", remat=remat)   # the layers the automatic construction finds
  pstep = harpjax.auto_parallel(step, cluster=cluster, num_microbatches=4, plan=plan)
  program = pstep.layout(*first)
  dev = jax.devices()[0]
  t0 = time.perf_counter()
  cs = compile_step(program, [[dev] for _ in program.plan.stages])
  ref = jax.jit(step)
  s_ref = s_par = state
  errs = []
  for i, batch in enumerate(batches):
    args = (batch,) + tuple(extra[i])
    out_ref = ref(s_ref, *args)
    out_par = run_step(cs, (s_par,) + args)
    errs.append(max_rel_err(out_ref, out_par))
    s_ref, s_par = out_ref[0], out_par[0]
  leaves = jax.tree_util.tree_leaves(s_par)
  return {"case": name, "remat": remat, "layers": len(layers), "stages": [list(c) for c in _cuts(len(layers), stages)],
          "microbatches": 4, "schedule": str(program.plan.schedule), "steps": len(batches),
          "max_rel_err": errs, "devices_of_state": sorted({str(d) for x in leaves
                                                           for d in x.devices()}),
          "dtype": str(leaves[0].dtype), "seconds": time.perf_counter() - t0}


def part_equal(out_dir: str, gpu: str) -> list[dict]:
  import jax
  jax.config.update("jax_enable_x64", True)
  import optax
  from flax.training import train_state
  import jax.numpy as jnp

  import harpjax
  from harpjax.models import GPT, GPTConfig
  from tests import zoo

  results = []
  tmp = tempfile.mkdtemp(prefix="gpu_check_")   # the cluster files
  for kind in ("loop", "remat", "scan", "remat_policy"):
    try:
      case = zoo.linen(kind)
      results.append(_equal_case(f"zoo-{kind}", case.step, case.state, case.batches,
                                 [()] * len(case.batches), 2, gpu, tmp))
    except Exception:  # noqa: BLE001 - every case reports
      results.append({"case": f"zoo-{kind}", "error": traceback.format_exc()})
    print(json.dumps(results[-1]), flush=True)

  try:
    cfg = GPTConfig(vocab_size=64, seq_len=8, hidden=16, num_heads=2, num_blocks=4, dropout=0.1,
                    dtype="float64", param_dtype="float64")
    model = GPT(cfg)
    tokens = jax.random.randint(jax.random.key(0), (8, cfg.seq_len), 0, cfg.vocab_size)
    params = model.init(jax.random.key(1), tokens)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adamw(1e-2, eps=1e-3))

    def step(state, batch, rng):
      def loss_fn(p):
        logits = state.apply_fn(p, batch[:, :-1], train=True, rngs={"dropout": rng})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
      loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), loss

    batches = [jax.random.randint(jax.random.key(10 + i), (8, cfg.seq_len + 1), 0,
                                  cfg.vocab_size) for i in range(3)]
    extra = [(jax.random.key(100 + i),) for i in range(3)]
    for remat in ("none", "full", "dots"):
      try:
        results.append(_equal_case("gpt-dropout", step, state, batches, extra, 3, gpu, tmp,
                                   remat))
      except Exception:  # noqa: BLE001
        results.append({"case": "gpt-dropout", "remat": remat, "error": traceback.format_exc()})
      print(json.dumps(results[-1]), flush=True)
  except Exception:  # noqa: BLE001
    results.append({"case": "gpt-dropout", "error": traceback.format_exc()})
    print(json.dumps(results[-1]), flush=True)
  return results


# --------------------------------------------------------------------------- times


def _timed(fn, args, calls: int = 10, reps: int = 5, warmup: int = 2) -> float:
  """Median seconds per call of ``fn`` over ``reps`` runs of ``calls`` back-to-back calls."""
  import jax
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  per = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    per.append((time.perf_counter() - t0) / calls)
  return float(statistics.median(per))


def _random_like(tree, seed: int):
  import jax
  import jax.numpy as jnp
  import numpy as np
  rng = np.random.default_rng(seed)

  def one(s):
    if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
      keys = jax.random.split(jax.random.key(seed), max(1, int(np.prod(s.shape))))
      return keys[0] if s.shape == () else keys.reshape(s.shape)
    if jnp.issubdtype(s.dtype, jnp.floating):
      return jnp.asarray(rng.standard_normal(s.shape) * 0.1, dtype=s.dtype)
    return jnp.zeros(s.shape, s.dtype)
  return jax.tree_util.tree_map(one, tree)


def _flops(compiled) -> float:
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else {}
  return float((ca or {}).get("flops", 0.0))


def _block_fwd_bwd(model: str, seq: int, mbs: int):
  """``(fn, args)``: the block's forward and its VJP (parameters and input), plain JAX."""
  import jax
  import jax.numpy as jnp

  from harpjax.compiler.trace import ops_function
  from tools.calibration import block_program
  program, kinds = block_program(model, seq, mbs)
  ins = list(program.invars)
  run = ops_function(program.ops, ins, list(program.outvars))
  avals = [jax.ShapeDtypeStruct(tuple(program.avals[v].shape), program.avals[v].dtype)
           for v in ins]
  n_static = kinds.count("static")
  outs = [jax.ShapeDtypeStruct(tuple(program.avals[v].shape), program.avals[v].dtype)
          for v in program.outvars]
  consts = _random_like(avals[:n_static], 0)

  def fwd_bwd(params_and_x, cts):
    _, vjp = jax.vjp(lambda *a: run(*consts, *a), *params_and_x)
    return vjp(cts)
  args = (_random_like(tuple(avals[n_static:]), 1), tuple(_random_like(tuple(outs), 2)))
  del jnp
  return jax.jit(fwd_bwd), args


def part_times(out_dir: str, budget_s: float, quick: bool = False) -> list[dict]:
  import jax

  from harpjax.compiler.layers import LayerOptions, construct_layers
  from harpjax.compiler.profile import pieces as pieces_lib
  from tools.calibration import block_program

  start = time.perf_counter()
  rows = []
  path = os.path.join(out_dir, "times.json")

  def save():
    with open(path, "w") as f:
      json.dump({"env": _env(), "rows": rows}, f, indent=1)

  blocks, sizes = (BLOCKS[:1], MBS[:1]) if quick else (BLOCKS, MBS)
  for model, seq in blocks:
    for mbs in sizes:
      if time.perf_counter() - start > budget_s:
        print(f"budget of {budget_s:.0f} s spent: stopping", flush=True)
        save()
        return rows
      row = {"model": model, "seq": seq, "mbs": mbs}
      try:
        fn, args = _block_fwd_bwd(model, seq, mbs)
        compiled = fn.lower(*args).compile()
        row["block_s"] = _timed(compiled, args)
        row["block_xla_flops"] = _flops(compiled)
        if ((model, seq) in PER_LAYER and mbs in (1, 4)) or quick:
          program, kinds = block_program(model, seq, mbs)
          layers = construct_layers(program, kinds, options=LayerOptions())
          dep = pieces_lib.batch_dependent(program, kinds)
          per = []
          for i in range(len(layers)):
            piece = pieces_lib.build_piece(layers, i, i, dep)
            fwd_bwd, _ = pieces_lib.make_functions(piece)
            a = _random_like(pieces_lib.abstract_inputs(piece), 10 + i)
            c = jax.jit(fwd_bwd).lower(*a).compile()
            per.append({"layer": i, "seconds": _timed(c, a), "xla_flops": _flops(c)})
          row["layers"] = per
      except Exception:  # noqa: BLE001 - every row reports
        row["error"] = traceback.format_exc()[-2000:]
      rows.append(row)
      print(json.dumps({k: v for k, v in row.items() if k != "layers"}), flush=True)
      save()
  save()
  return rows


# --------------------------------------------------------------------------- fit


def fit_file(path: str, gpu_name: str) -> dict:
  """Pairs the measured times with the jaxpr's :class:`Work` and fits ``gpu_name``'s
  factors; prints the error of the roofline default and of the fit, per block and per layer."""
  import numpy as np

  from harpjax.cluster import GPU_CATALOG
  from harpjax.compiler.layers import LayerOptions, construct_layers
  from harpjax.compiler.profile import calibration as calib
  from harpjax.compiler.profile import estimate
  from harpjax.compiler.profile import pieces as pieces_lib
  from tools.calibration import Sample, block_program, block_work, errors, fit

  data = json.load(open(path))
  gpu = GPU_CATALOG[gpu_name]
  peak, bw = gpu.peak_flops, gpu.mem_bandwidth_bytes_per_s
  work_of = block_work()
  samples, layer_rows = [], []
  for r in data["rows"]:
    if "block_s" not in r:
      continue
    w = work_of(r["model"], r["seq"], r["mbs"])
    samples.append(Sample(gpu_name, r["model"], r["seq"], r["mbs"], r["block_s"], w))
    if "layers" in r:
      program, kinds = block_program(r["model"], r["seq"], r["mbs"])
      layers = construct_layers(program, kinds, options=LayerOptions())
      dep = pieces_lib.batch_dependent(program, kinds)
      for lr in r["layers"]:
        traced = estimate.trace_piece(pieces_lib.build_piece(layers, lr["layer"], lr["layer"],
                                                             dep))
        lw = estimate.jaxpr_work(traced, (1, 1))
        layer_rows.append((r["model"], r["seq"], r["mbs"], lr, lw))
  default = calib.DEFAULT_EFFICIENCY
  fitted = fit(samples, peak, bw, source=f"measured on one {data['env'].get('device_kind')}")
  out = {"gpu": gpu_name, "env": data["env"], "samples": len(samples),
         "default_block_errors": errors(samples, default, peak, bw),
         "fitted": {"compute": fitted.compute, "memory": fitted.memory,
                    "kernel_s": fitted.kernel_s, "mape": fitted.mape, "cv_mape": fitted.cv_mape,
                    "max_error": fitted.max_error},
         "fitted_block_errors": errors(samples, fitted, peak, bw)}
  print(f"{gpu_name}: {len(samples)} block measurements on {data['env'].get('device_kind')}")
  print("| model | seq | mbs | measured ms | default ms | fitted ms | XLA TFLOP/s |")
  print("|---|---|---|---|---|---|---|")
  for s, r in zip(samples, [r for r in data["rows"] if "block_s" in r]):
    d = float(calib.predict_time_s(s.work, peak, bw, default))
    f = float(calib.predict_time_s(s.work, peak, bw, fitted))
    print(f"| {s.model} | {s.seq} | {s.mbs} | {1e3 * s.measured_s:.3f} | {1e3 * d:.3f} | "
          f"{1e3 * f:.3f} | {r['block_xla_flops'] / s.measured_s / 1e12:.0f} |")
  de, fe = np.abs(out["default_block_errors"]), np.abs(out["fitted_block_errors"])
  print(f"block error, roofline default: mean {100 * de.mean():.1f}%, max {100 * de.max():.1f}%")
  print(f"block error, fitted: mean {100 * fe.mean():.1f}%, max {100 * fe.max():.1f}%, "
        f"leave-one-model-out {100 * (fitted.cv_mape or 0):.1f}%")
  print(f"fitted: compute={fitted.compute:.4f} memory={fitted.memory:.4f} "
        f"kernel_s={fitted.kernel_s:.3e}")
  lay = []
  for model, seq, mbs, lr, lw in layer_rows:
    d = float(calib.predict_time_s(lw, peak, bw, default))
    f = float(calib.predict_time_s(lw, peak, bw, fitted))
    lay.append({"model": model, "seq": seq, "mbs": mbs, "layer": lr["layer"],
                "measured_s": lr["seconds"], "default_s": d, "fitted_s": f,
                "jaxpr_flops": lw.flops, "xla_flops": lr["xla_flops"]})
  if lay:
    print("\nper layer: | model | seq | mbs | layer | measured us | default us | fitted us | "
          "jaxpr/XLA FLOPs |")
    for x in lay:
      ratio = x["jaxpr_flops"] / x["xla_flops"] if x["xla_flops"] else float("nan")
      print(f"| {x['model']} | {x['seq']} | {x['mbs']} | {x['layer']} | "
            f"{1e6 * x['measured_s']:.1f} | {1e6 * x['default_s']:.1f} | "
            f"{1e6 * x['fitted_s']:.1f} | {ratio:.3f} |")
    le = np.abs([x["fitted_s"] / x["measured_s"] - 1 for x in lay])
    print(f"per-layer error with the block fit: mean {100 * le.mean():.1f}%, "
          f"max {100 * le.max():.1f}%")
    sums = {}
    for x in lay:
      k = (x["model"], x["seq"], x["mbs"])
      m, p = sums.get(k, (0.0, 0.0))
      sums[k] = (m + x["measured_s"], p + x["fitted_s"])
    for k, (m, p) in sums.items():
      blk = next(s.measured_s for s in samples if (s.model, s.seq, s.mbs) == k)
      print(f"{k}: sum of layers measured {1e3 * m:.3f} ms vs block {1e3 * blk:.3f} ms "
            f"({m / blk:.3f}x); fitted sum {1e3 * p:.3f} ms")
  out["layers"] = lay
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--part", action="append", choices=["equal", "times"], default=[])
  ap.add_argument("--out", default="gpu_check_out")
  ap.add_argument("--gpu", default="H200", help="catalog name of the GPU (cluster file, --fit)")
  ap.add_argument("--budget-s", type=float, default=200.0,
                  help="stop starting new timings after this many seconds")
  ap.add_argument("--fit", metavar="TIMES_JSON", help="fit the cost model to a times.json")
  ap.add_argument("--quick", action="store_true", help="one block, one size (a smoke run)")
  ap.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.fit:
    res = fit_file(a.fit, a.gpu)
    with open(os.path.splitext(a.fit)[0] + f"_fit_{a.gpu}.json", "w") as f:
      json.dump(res, f, indent=1)
    return 0
  os.makedirs(a.out, exist_ok=True)
  if a.in_process:
    (part,) = a.part
    if part == "equal":
      res = part_equal(a.out, a.gpu)
      with open(os.path.join(a.out, "equal.json"), "w") as f:
        json.dump({"env": _env(), "cases": res}, f, indent=1)
    else:
      part_times(a.out, a.budget_s, a.quick)
    return 0
  rc = 0
  for part in a.part or ["equal", "times"]:
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--out", a.out,
           "--gpu", a.gpu, "--budget-s", str(a.budget_s), "--in-process"] + (
        ["--quick"] if a.quick else [])
    print(f"== {part}", flush=True)
    rc |= subprocess.call(cmd, cwd=ROOT)
  return rc


if __name__ == "__main__":
  sys.exit(main())
