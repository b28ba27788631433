"""Zero-redundant profiling of a GPT-39B-like model on 32 V100 + 32 A100 (analytic costs).

Prints: the layer construction, the unique profiling tasks against naive enumeration, the
time to build the cost tables cold (empty cache) and warm (same cache), the calibrated
analytic model's error against the published per-layer measurements per GPU type, and the
plan the planner finds on the tables.

    python benchmarks/profile.py                 # GPT-39B, hetero_64 cluster
    python benchmarks/profile.py --calibrate     # also refit and print the constants
    python benchmarks/profile.py --blocks 8      # a shorter model
    python benchmarks/profile.py --source jaxpr --compare   # the default source, and its plan
                                                 # scored on the compiled (analytic) tables
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harpjax.cluster import Cluster  # noqa: E402
from harpjax.compiler import profile as profile_lib  # noqa: E402
from harpjax.compiler.profile import calibration as calib  # noqa: E402
from harpjax.models import BUILTIN_MODELS  # noqa: E402
from tools import calibration as calibration_tool  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"


def layer_speed(depth: int = 1450) -> None:
  """Seconds to cut a straight-line program of over 10,000 ops into layers."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from harpjax.compiler import layers as layers_lib
  from harpjax.compiler.trace import from_closed_jaxpr

  def f(ws, x):
    for w in ws:
      x = x + jnp.sin(jnp.tanh(x @ w) @ w.T) * 0.5
    return jnp.sum(x)
  ws = [jax.ShapeDtypeStruct((16, 16), jnp.float32)] * depth
  prog = from_closed_jaxpr(jax.make_jaxpr(f)(ws, jax.ShapeDtypeStruct((4, 16), jnp.float32)))
  t0 = time.perf_counter()
  seq = layers_lib.construct_layers(prog, ["param"] * depth + ["split"])
  print(f"layer construction speed: {len(prog.ops):,} ops cut into {len(seq)} layers in "
        f"{time.perf_counter() - t0:.2f} s")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--model", default="gpt-39b")
  p.add_argument("--blocks", type=int, default=None, help="override the number of blocks")
  p.add_argument("--cluster", default=str(CONFIGS / "hetero_64.yaml"))
  p.add_argument("--microbatches", type=int, default=128, help="B for the planner")
  p.add_argument("--no-remat", action="store_true",
                 help="keep all activations (GPT-39B then does not fit 64 GPUs)")
  p.add_argument("--cache-dir", default=None, help="profile cache (default: a fresh temp dir)")
  p.add_argument("--calibrate", action="store_true", help="refit the efficiency factors")
  p.add_argument("--data-dir", default=None, help="directory of the Zorse measurements")
  p.add_argument("--no-plan", action="store_true", help="skip the planner")
  p.add_argument("--source", default="analytic", choices=profile_lib.SOURCES[:2],
                 help="cost source (analytic: XLA compiles each layer; jaxpr: no compilation)")
  p.add_argument("--compare", action="store_true",
                 help="also cost with the other source; score both plans on the analytic "
                      "tables")
  p.add_argument("-v", "--verbose", action="store_true")
  args = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                      format="%(asctime)s %(name)s: %(message)s")

  cluster = Cluster.load(args.cluster)
  overrides = {"num_blocks": args.blocks} if args.blocks else {}
  # B >= 2 lets the trace tell the batch inputs (split per microbatch) from the others; the
  # costs are per microbatch and do not depend on B.
  spec = BUILTIN_MODELS[args.model](num_microbatches=2, **overrides)
  cfg = spec.config
  print(f"# {args.model}: {cfg.num_blocks} blocks, hidden {cfg.hidden}, {cfg.num_heads} heads, "
        f"sequence {cfg.seq_len}, microbatch {spec.microbatch_size}, {cfg.dtype}; "
        f"{cfg.num_params / 1e9:.1f}B parameters")
  print(f"# cluster {cluster.name}:\n" + "\n".join(f"#   {line}"
                                                  for line in cluster.summary().splitlines()))
  tmp = None
  cache = args.cache_dir
  if cache is None:
    tmp = tempfile.TemporaryDirectory(prefix="harpjax-profile-")
    cache = tmp.name
  opts = profile_lib.ProfileOptions(cache_dir=cache, remat=not args.no_remat,
                                    source=args.source)

  def run(opts=opts):
    t0 = time.perf_counter()
    res = profile_lib.profile_step(spec.step_fn, spec.args, cluster,
                                   num_microbatches=spec.num_microbatches, options=opts)
    return res, time.perf_counter() - t0

  cold, t_cold = run()
  warm, t_warm = run()
  st = cold.stats
  print("\n## Layer construction\n")
  print(f"{cold.layers.summary}")
  print(f"{st.distinct_layers} distinct layer signatures; {st.layers_per_repeat} layers per "
        "repeated block")
  layer_speed()
  print("\n## Zero-redundant profiling\n")
  print("| quantity | count |\n|---|---|")
  print(f"| (subcluster, submesh, logical mesh) configurations | {st.configs} |")
  print(f"| naive: stages x submeshes, L(L+1)/2 x sum_k S_k | {st.naive_stage_submesh:,} |")
  print(f"| naive: stages x submeshes x logical meshes | {st.naive_stage_mesh:,} |")
  print(f"| per-layer candidates, L x configurations | {st.candidates:,} |")
  print(f"| unique profiling tasks (signature x GPU x submesh x mesh x microbatch) | "
        f"{st.unique_tasks} |")
  print(f"| unique compilations (signature x tp x local microbatch) | {st.unique_compiles} |")
  print(f"| ratio naive stage x submesh / unique tasks | {st.reduction:,.0f}x |")
  print(f"| unique tasks per configuration / layers per block | "
        f"{st.unique_tasks / st.configs:.0f} / {st.layers_per_repeat} |")
  print(f"| pruned entries: OOM / imbalanced | {st.pruned_oom:,} / {st.pruned_imbalance:,} |")
  print("\n## Building the cost tables on this machine\n")
  print("| cache | seconds | computed tasks | cached tasks |\n|---|---|---|---|")
  print(f"| cold | {t_cold:.1f} | {cold.stats.computed} | {cold.stats.cache_hits} |")
  print(f"| warm | {t_warm:.1f} | {warm.stats.computed} | {warm.stats.cache_hits} |")
  t = cold.tables
  for k, name in enumerate(t.subcluster_names):
    blk = cold.costs[(name, (1, 1), (1, 1))]["time_s"][1:1 + st.layers_per_repeat].sum()
    print(f"\none block on one {cluster.subcluster(name).gpu.name}: {blk * 1e3:.1f} ms "
          "forward+backward")

  print("\n## Analytic model against published per-layer measurements (Zorse, fp16)\n")
  if args.calibrate:
    rep = calibration_tool.calibrate(args.data_dir)
    print(rep.table())
    print("\n" + rep.as_python())
  else:
    rows = ["| GPU type | samples | compute | memory | per kernel | mean error | "
            "leave-one-model-out |", "|---|---|---|---|---|---|---|"]
    for name, e in calib.CALIBRATION.items():
      rows.append(f"| {name} | {e.samples} | {e.compute:.3f} | {e.memory:.2f} | "
                  f"{e.kernel_s * 1e6:.0f} us | {100 * e.mape:.1f}% | "
                  f"{100 * e.cv_mape:.1f}% |")
    print("\n".join(rows))
    print("\n(stored constants; --calibrate refits them)")

  if not args.no_plan:
    from harpjax.compiler.plan import solve
    t0 = time.perf_counter()
    result = solve(cold.tables, args.microbatches)
    print(f"\n## Plan (B={args.microbatches}, {time.perf_counter() - t0:.1f} s search)\n")
    print(result.table())
    if args.compare:
      from harpjax.compiler.plan import evaluate_plan
      other_src = "jaxpr" if args.source == "analytic" else "analytic"
      other, t_other = run(dataclasses.replace(opts, source=other_src))
      print(f"\n## The {other_src} source: tables in {t_other:.1f} s (cold)\n")
      plans = {args.source: result.plan, other_src: solve(other.tables, args.microbatches).plan}
      compiled = (cold if args.source == "analytic" else other).tables
      own = {args.source: cold.tables, other_src: other.tables}
      print("| plan from | stages | predicted on its own tables | on the analytic tables |\n"
            "|---|---|---|---|")
      for src, plan in plans.items():
        ev = evaluate_plan(compiled, plan, args.microbatches)
        mine = evaluate_plan(own[src], plan, args.microbatches)
        print(f"| {src} | {plan.num_stages} | {mine.iteration_s:.4f} s | "
              f"{ev.iteration_s:.4f} s{'' if ev.feasible else ' (infeasible)'} |")
  if tmp is not None:
    tmp.cleanup()
  return 0


if __name__ == "__main__":
  sys.exit(main())
