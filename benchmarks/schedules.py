"""GPipe, 1F1B, Eager-1F1B and H-1F1B on the HARP case study, across cross-cluster bandwidths.

The case study of HARP §2.2.2/§2.3.2 (Table 1, fine-grained plan, Fig. 3): a 3-stage GPT
pipeline, stage 1 on V100(1,2), stages 2-3 on A100(1,2) submeshes, 5 Gbps Ethernet between the
V100 and A100 subclusters and 200 Gbps InfiniBand inside the A100 one
(``benchmarks/configs/case_study.yaml``). Every schedule is run through the simulator
(:mod:`harpjax.compiler.schedule.simulator`) at the paper's 5 Gbps and over a sweep of the
cross-subcluster bandwidth; the script prints a table, writes it as Markdown and CSV, plots
iteration time and activation memory against bandwidth, and draws the 5 Gbps timelines like
the paper's Fig. 3.

  python benchmarks/schedules.py                     # or: make bench
  python benchmarks/schedules.py --microbatches 64 --out out/bench_schedules
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from harpjax.compiler.schedule import timeline
from harpjax.compiler.schedule import simulate  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "eager_1f1b", "h1f1b", "h1f1b_eps0")
LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "eager_1f1b": "Eager-1F1B", "h1f1b": "H-1F1B",
          "h1f1b_eps0": "H-1F1B eps=0"}
SWEEP_GBPS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 15, 20, 30, 50, 75, 100)

# Table 1 (#L = 128): cost of each stage in units of t, and its share of the layers.
STAGE_COST_T = (1.13, 1.10, 1.10)
LAYER_SHARE = (0.172, 0.414, 0.414)


def case_study(t_ref_s: float, act_bytes: float, cross_gbps: float, intra_gbps: float,
               bwd_ratio: float):
  """Per-stage forward/backward seconds and per-link transfer seconds of the case study."""
  f = np.array(STAGE_COST_T) * t_ref_s
  b = bwd_ratio * f
  c = np.array([act_bytes * 8 / (cross_gbps * 1e9), act_bytes * 8 / (intra_gbps * 1e9)])
  return f, b, c


def eq12(f, b, c, B):
  t = f + b
  return float(t.sum() + 2 * c.sum() + (B - 1) * t.max())


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--microbatches", "-B", type=int, default=128,
                  help="microbatches per iteration (the paper's case study uses 128)")
  ap.add_argument("--t-ref-ms", type=float, default=40.0,
                  help="Table 1's t: forward ms of one microbatch on an A100(1,2) stage of "
                  "the coarse plan")
  ap.add_argument("--bwd-ratio", type=float, default=2.0, help="backward / forward time")
  ap.add_argument("--micro-batch-size", type=int, default=8)
  ap.add_argument("--seq-len", type=int, default=1024)
  ap.add_argument("--hidden", type=int, default=4096)
  ap.add_argument("--bytes-per-elem", type=int, default=2, help="2 for fp16/bf16")
  ap.add_argument("--cross-gbps", type=float, default=5.0, help="the case study's bandwidth")
  ap.add_argument("--intra-gbps", type=float, default=200.0, help="A100 InfiniBand")
  ap.add_argument("--eps", type=float, default=0.1, help="H-1F1B tolerance (Eq. 17 form)")
  ap.add_argument("--timeline-microbatches", type=int, default=12,
                  help="B of the Fig. 3-like timelines (few, to stay readable)")
  ap.add_argument("--out", default=os.path.join("out", "bench_schedules"))
  args = ap.parse_args(argv)
  # c > t_max below ~4 Gbps: H-1F1B warns that it is link-bound; the table shows c/t_max.
  logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
  t_start = time.perf_counter()
  B = args.microbatches
  t_ref = args.t_ref_ms * 1e-3
  act_bytes = args.micro_batch_size * args.seq_len * args.hidden * args.bytes_per_elem
  os.makedirs(args.out, exist_ok=True)

  f, b, c = case_study(t_ref, act_bytes, args.cross_gbps, args.intra_gbps, args.bwd_ratio)
  t = f + b
  print("Assumptions")
  print(f"  stages: V100(1,2) {STAGE_COST_T[0]}t, A100(1,2) {STAGE_COST_T[1]}t, A100(1,2) "
        f"{STAGE_COST_T[2]}t forward per microbatch (HARP Table 1, #L=128), t = "
        f"{args.t_ref_ms:g} ms; backward = {args.bwd_ratio:g} x forward")
  print(f"  -> t_i = f_i + b_i = {', '.join(f'{x * 1e3:.1f}' for x in t)} ms; "
        f"t_max = {t.max() * 1e3:.1f} ms (the V100 stage, index 0)")
  print(f"  boundary activation (and its gradient): {args.micro_batch_size} x {args.seq_len} x "
        f"{args.hidden} x {args.bytes_per_elem} B = {act_bytes / 2**20:.0f} MiB")
  print(f"  links: V100 -> A100 stage crosses subclusters at {args.cross_gbps:g} Gbps -> c_1 = "
        f"{c[0] * 1e3:.1f} ms ({c[0] / t.max():.2f} t_max); A100 -> A100 InfiniBand "
        f"{args.intra_gbps:g} Gbps -> c_2 = {c[1] * 1e3:.2f} ms; no latency term")
  print(f"  B = {B} microbatches; H-1F1B eps = {args.eps:g}; activation memory per in-flight "
        f"microbatch proportional to the stage's layers {LAYER_SHARE}; no end-of-iteration "
        "cost")
  print()

  # ------------------------------------------------------------------ sweep
  rows = []
  results = {}
  for gbps in sorted(set(SWEEP_GBPS) | {args.cross_gbps}):
    f, b, c = case_study(t_ref, act_bytes, gbps, args.intra_gbps, args.bwd_ratio)
    for name in SCHEDULES:
      r = simulate(f, b, c, name.replace("_eps0", ""), num_microbatches=B,
                   eps=0.0 if name.endswith("_eps0") else args.eps,
                   act_bytes=np.array(LAYER_SHARE))
      results[gbps, name] = r
      rows.append({
          "gbps": gbps, "schedule": name, "c1_ms": c[0] * 1e3, "c1_over_tmax": c[0] / r.t_max,
          "iteration_s": r.iteration_time,
          "warmups": "/".join(map(str, r.schedule.table_warmups())),
          "peak_inflight": "/".join(map(str, r.peak_inflight)),
          "peak_held": "/".join(map(str, r.peak_held)),
          "act_mem": float(r.peak_activation_bytes.sum()),
          "bottleneck_bubble_s": float(max(r.bubble[s] for s in r.bottleneck_stages)),
          "overlap_link1": float(r.overlap_ratio[0]),
          "eq12_s": eq12(f, b, c, B) if name.startswith("h1f1b") else float("nan"),
      })
  for row in rows:
    base = results[row["gbps"], "1f1b"].iteration_time
    eager = results[row["gbps"], "eager_1f1b"].peak_activation_bytes.sum()
    row["speedup_vs_1f1b"] = base / row["iteration_s"]
    row["act_mem_vs_eager"] = row["act_mem"] / eager

  head = ["Gbps", "c_1 (ms)", "c_1/t_max", "schedule", "iter (s)", "vs 1F1B", "warm-ups",
          "peak in-flight", "act mem vs Eager", "bottleneck bubble (s)", "link-1 overlap",
          "Eq.12 (s)"]
  table = []
  for row in rows:
    table.append([f"{row['gbps']:g}", f"{row['c1_ms']:.1f}", f"{row['c1_over_tmax']:.2f}",
                  LABELS[row["schedule"]],
                  f"{row['iteration_s']:.3f}", f"{row['speedup_vs_1f1b']:.3f}x",
                  row["warmups"], row["peak_inflight"], f"{row['act_mem_vs_eager']:.3f}",
                  f"{row['bottleneck_bubble_s']:.3f}", f"{100 * row['overlap_link1']:.1f}%",
                  "" if np.isnan(row["eq12_s"]) else f"{row['eq12_s']:.3f}"])
  widths = [max(len(r[i]) for r in [head] + table) for i in range(len(head))]
  fmt = lambda r: "| " + " | ".join(x.rjust(w) for x, w in zip(r, widths)) + " |"
  lines = [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
  lines += [fmt(r) for r in table]
  print("\n".join(lines))
  print()

  # ------------------------------------------------------------------ headline numbers
  g = args.cross_gbps
  h, one, eager, h0 = (results[g, n] for n in ("h1f1b", "1f1b", "eager_1f1b", "h1f1b_eps0"))
  speed = one.iteration_time / h.iteration_time
  speed_e = eager.iteration_time / h.iteration_time
  mem = h.peak_activation_bytes.sum() / eager.peak_activation_bytes.sum()
  headline = [
      f"At {g:g} Gbps (c_1 = {c_of(results, g) * 1e3:.1f} ms = "
      f"{c_of(results, g) / h.t_max:.2f} t_max):",
      f"  H-1F1B warm-ups {list(h.schedule.table_warmups())} vs Eager-1F1B "
      f"{list(eager.schedule.table_warmups())} vs 1F1B {list(one.schedule.table_warmups())}",
      f"  H-1F1B iteration {h.iteration_time:.3f} s: {speed:.3f}x faster than 1F1B "
      f"({one.iteration_time:.3f} s), {speed_e:.3f}x faster than Eager-1F1B "
      f"({eager.iteration_time:.3f} s)",
      f"  H-1F1B activation memory = {mem:.3f} x Eager-1F1B's (peak in-flight "
      f"{list(h.peak_inflight)} vs {list(eager.peak_inflight)}, weighted by layers per stage); "
      f"bottleneck bubble {h.bubble[0] * 1e3:.3f} ms vs {eager.bubble[0] * 1e3:.1f} ms",
      f"  Eq. 12 predicts {eq12(h.fwd_s[:, 0], h.bwd_s[:, 0], h.comm_fwd_s[:, 0], B):.3f} s "
      f"for H-1F1B; simulated {h.iteration_time:.3f} s",
      f"  H-1F1B with eps=0 (Eq. 10 exactly): warm-ups {list(h0.schedule.table_warmups())}, "
      f"{h0.iteration_time:.3f} s ({one.iteration_time / h0.iteration_time:.3f}x vs 1F1B), "
      f"memory {h0.peak_activation_bytes.sum() / eager.peak_activation_bytes.sum():.3f} x "
      "Eager's",
  ]
  print("\n".join(headline))

  md = os.path.join(args.out, "schedules.md")
  with open(md, "w") as fh:
    fh.write("# Schedules on the HARP case study\n\n" + "\n".join(lines) + "\n\n"
             + "\n".join(headline) + "\n")
  with open(os.path.join(args.out, "schedules.csv"), "w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)

  plot = _plot(results, sorted(set(SWEEP_GBPS) | {args.cross_gbps}), g, args.out)
  # Fig. 3-like timelines at the case study's bandwidth, with few microbatches.
  f, b, c = case_study(t_ref, act_bytes, g, args.intra_gbps, args.bwd_ratio)
  for name in SCHEDULES[:4]:
    r = simulate(f, b, c, name, num_microbatches=args.timeline_microbatches, eps=args.eps)
    timeline.save_gantt(r, os.path.join(args.out, f"timeline_{name}.png"),
                        title=f"{LABELS[name]} at {g:g} Gbps, B={r.num_microbatches}: "
                        f"{r.iteration_time * 1e3:.0f} ms")
    timeline.save_chrome_trace(r, os.path.join(args.out, f"timeline_{name}.trace.json"))
  print()
  print(f"wrote {md}, schedules.csv, {os.path.basename(plot)} and timeline_*.png / "
        f"*.trace.json to {args.out} in {time.perf_counter() - t_start:.1f} s")
  simulator_speed()
  return 0


def simulator_speed(stages: int = 64, microbatches: int = 512) -> None:
  """Seconds to simulate a large H-1F1B pipeline: the Numba kernel, the same kernel
  interpreted by Python and the discrete-event reference, side by side in one run."""
  from harpjax.compiler import schedule as sched
  rng = np.random.default_rng(0)
  f, b = rng.uniform(1, 2, stages), rng.uniform(2, 4, stages)
  c = rng.uniform(0, 3, stages - 1)
  table = sched.make_schedule("h1f1b", stages, microbatches,
                              sched.h1f1b_warmups(c, (f + b).max(), 0))
  simulate(f[:2], b[:2], c[:1], "h1f1b", num_microbatches=4)   # compile / load the kernel
  times = {}
  for backend in ("numba", "python", "reference"):
    t0 = time.perf_counter()
    r = simulate(f, b, c, table, backend=backend)
    times[backend] = time.perf_counter() - t0
    times.setdefault("T", r.iteration_time)
  t0 = time.perf_counter()
  simulate(f, b, c, "h1f1b", num_microbatches=microbatches, eps=0)
  with_table = time.perf_counter() - t0
  print(f"\nSimulator speed, {stages} stages x {microbatches} microbatches: Numba "
        f"{times['numba']:.3f} s ({with_table:.3f} s with building the table), Python "
        f"{times['python']:.2f} s ({times['python'] / times['numba']:.0f}x), reference "
        f"{times['reference']:.2f} s ({times['reference'] / times['numba']:.0f}x)")


def c_of(results, gbps) -> float:
  return float(results[gbps, "h1f1b"].comm_fwd_s[0, 0])


def _plot(results, gbps_list, mark_gbps, out_dir) -> str:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
  styles = {"gpipe": ("#8172B2", "s"), "1f1b": ("#4C72B0", "o"),
            "eager_1f1b": ("#DD8452", "^"), "h1f1b": ("#55A868", "D"),
            "h1f1b_eps0": ("#2F6B3C", "x")}
  x = np.array(gbps_list, float)
  for name in SCHEDULES:
    color, marker = styles[name]
    it = [results[g, name].iteration_time for g in gbps_list]
    mem = [results[g, name].peak_activation_bytes.sum()
           / results[g, "eager_1f1b"].peak_activation_bytes.sum() for g in gbps_list]
    inflight = [results[g, name].peak_inflight[0] for g in gbps_list]
    axes[0].plot(x, it, marker=marker, color=color, label=LABELS[name], ms=4)
    axes[1].plot(x, inflight, marker=marker, color=color, label=LABELS[name], ms=4)
    axes[2].plot(x, mem, marker=marker, color=color, label=LABELS[name], ms=4)
  ideal = [results[g, "h1f1b"].t_max * results[g, "h1f1b"].num_microbatches for g in gbps_list]
  axes[0].plot(x, ideal, ":", color="gray", label="B x t_max")
  for ax, title, ylabel in [
      (axes[0], "Iteration time", "seconds"),
      (axes[1], "Peak in-flight microbatches, V100 stage (index 0)", "microbatches"),
      (axes[2], "Activation memory vs Eager-1F1B", "ratio (all stages)")]:
    ax.set_xscale("log")
    ax.set_xlabel("cross-subcluster bandwidth (Gbps)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.axvline(mark_gbps, color="gray", lw=0.8, ls="--")
    ax.grid(alpha=0.3)
  axes[1].set_yscale("log")
  axes[2].set_yscale("log")
  axes[0].set_yscale("log")
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  path = os.path.join(out_dir, "schedules.png")
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


if __name__ == "__main__":
  sys.exit(main())
