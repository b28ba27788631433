"""``python -m harpjax simulate``: simulate a plan or given stage/link times.

Examples::

  python -m harpjax simulate plan.json --out out/sim
  python -m harpjax simulate plan.json --cluster cluster.yaml --model gpt-15b -B 64
  python -m harpjax simulate --fwd 1,1,1 --bwd 2,2,2 --comm 0.5,0.1 -B 16 \\
      --schedule h1f1b,1f1b --out out/sim
  python -m harpjax simulate --time 135ms,132ms,132ms --comm 107ms,3ms -B 32 --schedule all

Times are seconds unless they carry a unit (``ms``, ``us``, ``s``). A single value stands for
every stage (or link). With ``--cluster`` and ``--model`` a plan file (written by hand or by
``harpjax plan``) is costed anew: the model is traced and costed on the cluster as ``harpjax
plan`` does, each stage on its own submesh and logical mesh, its cuts on the links between
the hosts its stages sit on, its warm-ups and end-of-iteration times from those costs; the
times the file holds are not used. Prints each schedule's per-stage breakdown (compute / exposed
communication / idle per phase, bubble, peak in-flight microbatches, link overlap) and a
comparison; with ``--out`` writes ``<schedule>.trace.json`` (open in https://ui.perfetto.dev),
``<schedule>.png`` and ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import click

from harpjax.cli.checks import MAX_MICROBATCHES, Finite, check_output_dir, given
from harpjax.cli.model import DATA_DIR_HELP
from harpjax.errors import HarpjaxError

_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUM = re.compile(r"^\s*([-+0-9.eE]+)\s*([a-zµ]*)\s*$")


def parse_times(text: str | None, what: str, positive: bool = False) -> list[float] | None:
  """``"1,2ms,300us"`` -> ``[1.0, 0.002, 0.0003]`` seconds: finite, ``>= 0`` (``> 0`` if
  ``positive``)."""
  if text is None:
    return None
  out = []
  for tok in text.split(","):
    m = _NUM.match(tok)
    if not m or m.group(2) not in _UNITS:
      raise click.BadParameter(f"{tok!r} is not a time (e.g. 0.5, 12ms, 300us)", param_hint=what)
    try:
      t = float(m.group(1)) * _UNITS[m.group(2)]
    except ValueError:
      raise click.BadParameter(f"{tok!r} is not a number", param_hint=what) from None
    if not math.isfinite(t) or t < 0 or (positive and t == 0):
      raise click.BadParameter(f"{tok!r}: times must be finite and {'>' if positive else '>='} "
                               "0", param_hint=what)
    out.append(t)
  return out


def _numbers(text: str | None, what: str) -> list[float] | None:
  """Comma-separated finite numbers ``>= 0``."""
  if text is None:
    return None
  try:
    out = [float(x) for x in text.split(",")]
  except ValueError:
    raise click.BadParameter(f"{text!r}: expected comma-separated numbers",
                             param_hint=what) from None
  bad = [x for x in out if not (math.isfinite(x) and x >= 0)]
  if bad:
    raise click.BadParameter(f"{bad[0]!r}: expected finite numbers >= 0", param_hint=what)
  return out


def _counts(text: str | None, what: str) -> list[int] | None:
  """Comma-separated integers ``>= 1``."""
  if text is None:
    return None
  try:
    out = [int(x) for x in text.split(",")]
  except ValueError:
    raise click.BadParameter(f"{text!r}: expected comma-separated integers >= 1",
                             param_hint=what) from None
  if min(out) < 1:
    raise click.BadParameter(f"{text!r}: warm-up counts must be >= 1", param_hint=what)
  return out


def _fit(values: list[float] | None, n: int, what: str) -> list[float] | None:
  if values is None:
    return None
  if len(values) == 1:
    return values * n
  if len(values) != n:
    raise click.BadParameter(f"got {len(values)} values, expected 1 or {n}", param_hint=what)
  return values


@click.command("simulate", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("plan_file", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--fwd", help="Forward time per microbatch of each stage (e.g. 1,1,1 or 40ms).")
@click.option("--bwd", help="Backward time per microbatch of each stage.")
@click.option("--time", "fb_time", help="Forward+backward time per stage (split by "
              "--bwd-ratio); what plan files hold. Not with --fwd/--bwd.")
@click.option("--bwd-ratio", type=Finite(min=0, min_open=True), default=2.0, show_default=True,
              help="Backward / forward time when only forward+backward is known.")
@click.option("--comm", help="Transfer time per microbatch of each link (S-1 values), both "
              "directions.")
@click.option("--comm-bwd", help="Gradient transfer times if they differ from --comm.")
@click.option("-B", "--microbatches", type=click.IntRange(1, MAX_MICROBATCHES),
              help="Number of microbatches.")
@click.option("--schedule", "schedules", help="Comma-separated registered schedules (gpipe, "
              "1f1b, eager_1f1b, h1f1b), or 'all'. Default: the plan's schedule, else h1f1b.")
@click.option("--warmups", help="Warm-up counts per stage of the schedule whose warm-ups follow "
              "the costs (H-1F1B; default: from the plan or from Eq. 1 with --eps).")
@click.option("--table", "table_file", type=click.Path(exists=True, dir_okay=False),
              help="A custom task table (text of format_tables: one 'stage i: F0 F1 B0 ...' "
              "line per stage), simulated as schedule 'custom'.")
@click.option("--eps", type=Finite(min=0, max=1), default=0.1, show_default=True,
              help="H-1F1B tolerance: links with 2c/t_max <= eps get no extra warm-up.")
@click.option("--end-cost", help="End-of-iteration time per stage (grad sync + update).")
@click.option("--act-bytes", help="Activation bytes per in-flight microbatch, per stage.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Directory for <schedule>.trace.json, <schedule>.png and summary.json.")
@click.option("--no-png", is_flag=True, help="With --out, skip the PNG charts.")
@click.option("--json", "as_json", is_flag=True, help="Print the summaries as JSON.")
@click.option("--cluster", "cluster_path", type=click.Path(exists=True, dir_okay=False),
              help="With --model: cost the plan file's stages on this cluster (YAML).")
@click.option("--model", help="With --cluster: the plan's model (as harpjax plan --model).")
@click.option("--microbatch-size", type=click.IntRange(min=1), default=None,
              help="With --model: sequences per microbatch (default: the plan's, else the "
                   "model's).")
@click.option("--source", type=click.Choice(["jaxpr", "analytic", "imported"]),
              default="jaxpr", show_default=True, help="With --model: the cost source.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help=DATA_DIR_HELP)
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="With --model: the profile database (as harpjax plan --cache-dir).")
@click.option("--no-cache", is_flag=True, help="With --model: cost every layer afresh.")
@click.pass_context
def command(ctx, plan_file, fwd, bwd, fb_time, bwd_ratio, comm, comm_bwd, microbatches,
            schedules, warmups, table_file, eps, end_cost, act_bytes, out_dir, no_png, as_json,
            cluster_path, model, microbatch_size, source, data_dir, cache_dir, no_cache):
  """Simulate one iteration of a pipeline plan (or of given stage/link times)."""
  # pylint: disable=import-outside-toplevel
  from harpjax.compiler import schedule as sched
  from harpjax.compiler.plan import load_plan
  from harpjax.compiler.schedule import simulate
  if fb_time is not None and (fwd is not None or bwd is not None):
    raise click.UsageError("--time is forward+backward, split by --bwd-ratio; give either "
                           "--time or --fwd and --bwd, not both")
  if no_png and out_dir is None:
    raise click.UsageError("--no-png only applies with --out (which writes the charts); give "
                           "--out or drop --no-png")
  check_output_dir(out_dir, "--out")
  costing = cluster_path is not None or model is not None
  if costing:
    if cluster_path is None or model is None or plan_file is None:
      raise click.UsageError("costing a plan needs the plan file, --cluster and --model "
                             "together")
    clash = [f"--{n.replace('_', '-')}" for n in ("fwd", "bwd", "fb_time", "comm", "comm_bwd",
                                                 "end_cost", "act_bytes", "warmups", "table_file")
             if given(ctx, n)]
    if clash:
      raise click.UsageError(f"{', '.join(clash).replace('fb-time', 'time')} would replace "
                             "what --cluster and --model cost; drop them or the costing")
    if no_cache and given(ctx, "cache_dir"):
      raise click.UsageError("--no-cache and --cache-dir contradict each other; give one")
    if not no_cache:
      check_output_dir(cache_dir, "--cache-dir")
  elif any(given(ctx, n) for n in ("microbatch_size", "source", "data_dir", "cache_dir",
                                   "no_cache")):
    raise click.UsageError("--microbatch-size, --source, --data-dir, --cache-dir and "
                           "--no-cache only apply with --cluster and --model")
  try:
    plan = load_plan(plan_file) if plan_file else None
    if plan is not None and plan.eps is not None:   # the plan's warm-ups use its own
      if given(ctx, "eps") and eps != plan.eps:
        raise click.UsageError(f"--eps {eps:g} but the plan's warm-up counts use "
                               f"eps={plan.eps:g} (its \"eps\"): drop --eps")
      eps = plan.eps
    costed = None
    if costing:
      plan, costed = _cost_plan(plan, cluster_path, model, microbatches or
                                plan.num_microbatches, microbatch_size, eps,
                                dict(source=source, data_dir=data_dir, cache_dir=cache_dir,
                                     no_cache=no_cache))
    fwd_l, bwd_l = parse_times(fwd, "--fwd", True), parse_times(bwd, "--bwd", True)
    time_l = parse_times(fb_time, "--time", True)
    comm_l, comm_b_l = parse_times(comm, "--comm"), parse_times(comm_bwd, "--comm-bwd")
    if costed is not None:
      time_l, comm_l = costed["time"], costed["comm"] or None
    table = None
    if table_file:
      try:
        with open(table_file) as f:
          table = sched.parse_tables(f.read())
      except (OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"cannot read {table_file!r}: {e}", param_hint="--table")
      if not table:
        raise click.BadParameter(f"{table_file!r} holds no 'stage i: F0 B0 ...' line",
                                 param_hint="--table")
    lengths = [len(x) for x in (fwd_l, bwd_l, time_l) if x is not None and len(x) > 1]
    lengths += [len(x) + 1 for x in (comm_l, comm_b_l) if x is not None and len(x) > 1]
    if plan is not None:
      S = plan.num_stages
    elif table is not None:
      S = len(table)
    elif lengths:
      S = max(lengths)
    else:
      S = 1
    if table is not None:
      other = S if plan is not None else max(lengths, default=len(table))
      if other != len(table):
        raise click.UsageError(f"--table has {len(table)} stages but the "
                               f"{'plan has' if plan is not None else 'times give'} {other}; "
                               "give one table line per stage")
    if S == 1:
      for name, value in (("--comm", comm), ("--comm-bwd", comm_bwd)):
        if value is not None:
          raise click.UsageError(f"{name}: a 1-stage pipeline has no links; give per-stage "
                                 "times for more stages (e.g. --time 1,1) or drop it")
    uses_ratio = time_l is not None or (plan is not None and (fwd_l is None or bwd_l is None))
    if given(ctx, "bwd_ratio") and not uses_ratio:
      raise click.UsageError("--bwd-ratio only splits forward+backward times (--time or a "
                             "plan's time_s); with --fwd and --bwd it has no effect: drop it")
    if time_l is None and plan is not None and (fwd_l is None or bwd_l is None):
      missing = [i for i, s in enumerate(plan.stages) if s.time_s is None]
      if missing:
        raise click.UsageError(f"the plan has no time_s for stages {missing}; give --fwd and "
                               "--bwd (or --time)")
      time_l = [s.time_s for s in plan.stages]
    time_l = _fit(time_l, S, "--time")
    if time_l is not None:
      fwd_l = fwd_l or [t / (1 + bwd_ratio) for t in time_l]
      bwd_l = bwd_l or [t * bwd_ratio / (1 + bwd_ratio) for t in time_l]
    if fwd_l is None or bwd_l is None:
      raise click.UsageError("give --fwd and --bwd (or --time, or a plan file with time_s)")
    fwd_l, bwd_l = _fit(fwd_l, S, "--fwd"), _fit(bwd_l, S, "--bwd")
    if comm_l is None and plan is not None:
      comm_l = [0.0 if s.comm_s is None else s.comm_s for s in plan.stages[:-1]]
    comm_l = _fit(comm_l or [0.0], S - 1, "--comm") if S > 1 else []
    comm_b_l = _fit(comm_b_l, S - 1, "--comm-bwd") if S > 1 and comm_b_l else None
    B = microbatches or (plan.num_microbatches if plan is not None else None)
    if table is not None:
      table_b = sum(1 for t in table[0] if t.kind == "F")
      if microbatches is not None and microbatches != table_b:
        raise click.UsageError(f"-B {microbatches} contradicts --table, whose stage 0 runs "
                               f"{table_b} microbatches; drop -B")
      B = table_b
    if not B:
      raise click.UsageError("give the number of microbatches with -B")
    names = _schedule_names(schedules, plan, table)
    end_l = _fit(parse_times(end_cost, "--end-cost"), S, "--end-cost") or 0.0
    ab = _fit(_numbers(act_bytes, "--act-bytes"), S, "--act-bytes")
    if costed is not None:
      end_l, ab = costed["end"], costed["act"]
    # The schedules whose warm-ups follow the costs (H-1F1B) take --warmups, or the plan's own
    # counts when the plan runs that schedule, else derive them with --eps.
    costed_names = [n for n in names if n != "custom" and sched.schedule_kind(n).uses_costs]
    given_w = _counts(warmups, "--warmups")
    if given_w is not None:
      if not costed_names:
        raise click.UsageError(f"--warmups sets H-1F1B's warm-ups but the schedules are "
                               f"{', '.join(names)}; add h1f1b to --schedule or drop --warmups")
      given_w = _fit(given_w, S, "--warmups")
    plan_w = {}
    if given_w is not None:
      plan_w = {n: given_w for n in costed_names}
    elif plan is not None and plan.warmups is not None and plan.schedule in costed_names:
      plan_w = {plan.schedule: list(plan.warmups)}
    if given(ctx, "eps") and not set(costed_names) - set(plan_w):
      why = ("no schedule is h1f1b" if not costed_names else
             "the warm-ups are given (--warmups)" if warmups else "the plan's warm-ups are used")
      raise click.UsageError(f"--eps only derives H-1F1B's warm-ups, and {why}: drop --eps")
    results = []
    for name in names:
      if name == "custom":
        schedule = sched.Schedule("custom", table, B)
      elif name in plan_w:
        schedule = sched.make_schedule(name, S, B, plan_w[name])
      else:
        schedule = name
      results.append(simulate(fwd_l, bwd_l, comm_l, schedule, num_microbatches=B,
                              comm_bwd=comm_b_l, end_cost=end_l, eps=eps, act_bytes=ab))
  except HarpjaxError as e:
    raise click.ClickException(str(e)) from None
  _report(results, as_json)
  if out_dir:
    _write(results, out_dir, no_png)


def _cost_plan(plan, cluster_path: str, model: str, num_microbatches: int | None,
               microbatch_size: int | None, eps: float, profile_kw: dict):
  """Costs a plan file's stages on a cluster: ``(plan with the costed warm-ups, per-stage
  times)`` (``time``, ``comm``, ``end``, ``act``: forward+backward, cut, end-of-iteration
  seconds and activation bytes per stage)."""
  from harpjax.cli.model import model_spec, profile_model, profile_options
  from harpjax.cluster import Cluster
  from harpjax.compiler.plan import evaluate_plan
  from harpjax.compiler.profile import tables_for_plan
  if any(s.groups for s in plan.stages):
    raise click.UsageError("the plan has mixed-type stages: score it with "
                           "harpjax.compiler.plan.evaluate_mixed")
  if any(s.zebra is not None for s in plan.stages):
    raise click.UsageError("the plan has zebra stages: score it with "
                           "harpjax.compiler.plan.evaluate_mixed on tables with a routed_split")
  if not num_microbatches:
    raise click.UsageError("give the number of microbatches with -B")
  mbs = microbatch_size or plan.microbatch_size
  spec = model_spec(model, num_microbatches, mbs)
  remat = plan.remat == "full"
  if any(s.remat is not None for s in plan.stages):   # each stage says its own mode
    remat = "choose"
  result = profile_model(spec, Cluster.load(cluster_path),
                         profile_options(remat=remat, progress=False, **profile_kw),
                         plan.layer_options)   # the layers the plan was made on
  if plan.stages[-1].layers[1] != result.tables.num_layers - 1:
    raise click.UsageError(f"the plan covers layers 0..{plan.stages[-1].layers[1]}, but "
                           f"{model} has {result.tables.num_layers} layers "
                           f"({result.layers.summary}): write the plan for these layers")
  tables = tables_for_plan(result, plan)
  ev = evaluate_plan(tables, plan, num_microbatches, eps=eps)
  click.echo(f"costed on {cluster_path}: predicted {ev.iteration_s:.4f} s per iteration, "
             f"fits memory: {'yes' if ev.mem_ok else 'NO'}"
             + ("" if ev.devices_ok else "; the stages do not fit the hosts"), err=True)
  for v in ev.violations:
    click.echo(f"  {v}", err=True)
  stages = [dataclasses.replace(s, warmup=w, time_s=p.time_s, comm_s=p.comm_s)
            for s, w, p in zip(plan.stages, ev.warmups, ev.stages)]
  return plan.with_stages(stages).replace(num_microbatches=num_microbatches), {
      "time": [p.time_s for p in ev.stages], "comm": [p.comm_s for p in ev.stages[:-1]],
      "end": list(ev.end_s) or [0.0] * len(ev.stages),
      "act": [p.act_bytes for p in ev.stages]}


def _schedule_names(schedules: str | None, plan, table) -> list[str]:
  from harpjax.compiler import schedule as sched
  if schedules is None:
    if table is not None:
      return ["custom"]
    return [sched.schedule_key(plan.schedule) if plan is not None else "h1f1b"]
  names = []
  for tok in schedules.split(","):
    tok = tok.strip()
    if tok == "all":
      names += [k.name for k in sched.registered_schedules() if k.chunks == 1]
    elif tok == "custom":
      if table is None:
        raise click.BadParameter("'custom' needs --table", param_hint="--schedule")
      names.append("custom")
    else:
      names.append(sched.schedule_key(tok))
  if table is not None and "custom" not in names:
    names.append("custom")
  return list(dict.fromkeys(names))


def _report(results, as_json: bool) -> None:
  if as_json:
    click.echo(json.dumps([r.summary() for r in results], indent=2))
    return
  for r in results:
    click.echo(r.table())
    click.echo("")
  if len(results) > 1:
    base = next((r for r in results if r.schedule.name == "1f1b"), None)
    head = f"{'schedule':<12} {'iteration (s)':>14} {'vs 1f1b':>8} {'bubble (s)':>11}  " \
           "peak in-flight per stage"
    click.echo(head)
    click.echo("-" * len(head))
    for r in results:
      speed = f"{base.iteration_time / r.iteration_time:.3f}x" if base else "-"
      click.echo(f"{r.schedule.name:<12} {r.iteration_time:>14.6g} {speed:>8} "
                 f"{r.bubble.sum():>11.4g}  {list(r.peak_inflight)}")


def _write(results, out_dir: str, no_png: bool) -> None:
  from harpjax.compiler.schedule import timeline
  os.makedirs(out_dir, exist_ok=True)
  for r in results:
    path = timeline.save_chrome_trace(r, os.path.join(out_dir, f"{r.schedule.name}.trace.json"))
    click.echo(f"wrote {path}")
    if not no_png:
      path = timeline.save_gantt(r, os.path.join(out_dir, f"{r.schedule.name}.png"))
      click.echo(f"wrote {path}")
  path = os.path.join(out_dir, "summary.json")
  with open(path, "w") as f:
    json.dump([r.summary() for r in results], f, indent=2)
  click.echo(f"wrote {path}")
