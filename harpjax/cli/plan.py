"""``python -m harpjax plan``: plan a model on a cluster without owning the GPUs.

The model is traced from abstract shapes (nothing is allocated), cut into fine-grained layers,
costed analytically for the cluster's GPU types (compile-only XLA cost analysis and calibrated
rates), and planned by the exact DP; the schedule is the fastest of those the planner ranks
(1F1B, Eager-1F1B, H-1F1B) that fits memory on the stages found, or the one ``--schedule``
names. Prints the plan table, the chosen schedule, the predicted iteration time and the
load-balance score; ``--json`` saves the plan for ``auto_parallel(plan=...)``.
"""

from __future__ import annotations

import logging
import os
import time

import click

from harpjax.cli.checks import MAX_MICROBATCHES, Finite, check_output_dir, check_output_file, given
from harpjax.cli.model import (DATA_DIR_HELP, model_spec, profile_model, profile_options,
                               solve_options)
from harpjax.errors import HarpjaxError

log = logging.getLogger(__name__)


def _with_bandwidth(cluster, gbps: float | None, latency_us: float | None):
  """The cluster with every pair of consecutive subclusters linked at ``gbps``."""
  if gbps is None:
    return cluster
  from harpjax.cluster import Cluster, LinkOverride
  names = [s.name for s in cluster.subclusters]
  pairs = {frozenset(p) for p in zip(names, names[1:])}
  kept = [l for l in cluster.links if frozenset(l.between) not in pairs]
  lat = None if latency_us is None else latency_us * 1e-6
  new = [LinkOverride(between=(a, b), gbps=gbps, latency_s=lat) for a, b in zip(names, names[1:])]
  return Cluster(cluster.subclusters, links=tuple(kept + new), gpus=cluster.gpus,
                 name=cluster.name, transfer_fees=cluster.transfer_fees)


@click.command("plan", help="Plan a model on a cluster without owning the GPUs: trace from "
               "shapes, build fine-grained layers, profile them analytically for the cluster's "
               "GPU types, solve the DP; print the plan, its predicted iteration time and "
               "load-balance score.")
@click.option("--cluster", "cluster_path", required=True,
              type=click.Path(exists=True, dir_okay=False),
              help="Cluster YAML file (see docs/cluster.md).")
@click.option("--model", required=True,
              help="Built-in model (gpt-39b, gpt-15b, gpt-2.6b, gpt-tiny, moe-tiny, mixtral-8x7b, "
                   "mixtral-tiny) or a YAML/JSON file of config fields (family: "
                   "gpt|moe|mixtral, hidden, num_blocks, "
                   "num_heads, seq_len, vocab_size, microbatch_size, ...).")
@click.option("-B", "--microbatches", "num_microbatches",
              type=click.IntRange(1, MAX_MICROBATCHES),
              default=128, show_default=True, help="Number of microbatches per iteration.")
@click.option("--microbatch-size", type=click.IntRange(min=1), default=None,
              help="Sequences per microbatch (default: the model's, 8 for the large GPTs).")
@click.option("--bandwidth", type=Finite(min=0, min_open=True), default=None,
              help="Override the links between consecutive subclusters, Gbit/s.")
@click.option("--latency-us", type=Finite(min=0), default=None,
              help="Latency of those links, us (with --bandwidth).")
@click.option("--source", type=click.Choice(["jaxpr", "analytic", "imported"]),
              default="jaxpr", show_default=True,
              help="Cost source, no devices used: jaxpr (FLOPs and bytes of each layer's "
                   "jaxpr, seconds), analytic (XLA's statistics of each compiled layer: "
                   "slower, a refinement) or imported (published measurements).")
@click.option("--order", type=click.Choice(["memory_to_compute", "given"]),
              default="memory_to_compute", show_default=True,
              help="Subcluster order of the pipeline (HARP 5.2.1 heuristic or the file's).")
@click.option("--z", type=click.IntRange(min=1), default=None,
              help="Fewest matmuls in a repeated module.")
@click.option("--target-layers", type=click.IntRange(min=1), default=None,
              help="Layers wanted in total.")
@click.option("--eps", type=Finite(min=0, max=1), default=0.1, show_default=True,
              help="H-1F1B tolerance (2c/t_max below it needs no extra warm-up).")
@click.option("--schedule", default="rank", show_default=True,
              help="The pipeline schedule: rank (the fastest of 1f1b, eager_1f1b and h1f1b "
                   "that fits memory on the stages found) or a registered schedule's name, "
                   "which pins it (gpipe, 1f1b, eager_1f1b, h1f1b).")
@click.option("--objective", type=click.Choice(["min_time", "max_throughput_per_dollar",
                                               "min_time_within_budget",
                                               "min_cost_within_time"]),
              default="min_time", show_default=True,
              help="What to optimise; all but min_time need price_per_gpu_hour on every "
                   "subcluster of the cluster file.")
@click.option("--budget", type=Finite(min=0, min_open=True), default=None,
              help="Budget per hour (currency of the prices) of min_time_within_budget.")
@click.option("--time-limit", type=Finite(min=0, min_open=True), default=None,
              help="Longest iteration, seconds, of min_cost_within_time.")
@click.option("--cost-model", type=click.Choice(["simulator", "eq12"]), default="simulator",
              show_default=True,
              help="Rank plans by the simulator's iteration time of the schedule that runs "
                   "(link-bound plans admitted), or by the paper's Eq. 12 with c <= t_max.")
@click.option("--use-all-devices", is_flag=True,
              help="Use every device in the order given by --order (HARP's planner); by default "
                   "the plan may leave devices or subclusters unused and chooses the order.")
@click.option("--mixed-stages", type=click.Choice(["off", "auto", "on"]), default="auto",
              show_default=True,
              help="Also consider stages that run on hosts of several subclusters, "
                   "data-parallel with each microbatch's rows split by speed (auto: only "
                   "subclusters joined by links as fast as their own; on: any linked pair).")
@click.option("--zebra", type=click.Choice(["auto", "on", "off"]), default="auto",
              show_default=True,
              help="Also consider zebra stages of a routed model (attention and experts on two "
                   "groups of GPUs; with --mixed-stages other than off). auto: as on (the plan "
                   "file runs on the local runtime, which runs them), auto_parallel's default "
                   "too.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help=DATA_DIR_HELP)
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Profile database directory (default $HARPJAX_CACHE_DIR or "
                   "~/.cache/harpjax/profiles).")
@click.option("--no-cache", is_flag=True,
              help="Neither read nor write the profile database: cost every layer afresh.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the plan here (load it with harpjax.load_plan).")
@click.option("--simulate/--no-simulate", default=True, show_default=True,
              help="Also simulate the plan under GPipe, 1F1B, Eager-1F1B and H-1F1B.")
@click.option("--remat/--no-remat", default=False, show_default=True,
              help="Cost activation recomputation (as HARP and Alpa train large GPTs; "
                   "GPT-39B needs it): only stage inputs are kept per in-flight microbatch; "
                   "plans carry it to the runtime. Off by default, as auto_parallel's.")
@click.option("--remat-choice", is_flag=True,
              help="Cost every layer without recomputation, with it, and keeping the matmuls' "
                   "outputs (dots), and let the planner choose per stage (each stage of the "
                   "plan says which); replaces --remat.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar while profiling (default: when stderr is a terminal).")
@click.option("--zero/--no-zero", default=True, show_default=True,
              help="Let the planner shard each stage's training state over its data-parallel "
                   "devices (ZeRO level 0-3 per stage; mixed-precision Adam: 12 of the 16 "
                   "bytes per parameter are optimizer state) and, where the cluster file "
                   "gives host_memory_gbps, keep it in host memory.")
@click.option("--offload-activations/--no-offload-activations", default=None,
              help="Let the planner keep a stage's residuals (the activations waiting for "
                   "their backward) in host memory, per stage. Default: wherever the cluster "
                   "file gives host_memory_gbps; --offload-activations needs it on every "
                   "subcluster.")
@click.pass_context
def command(ctx, cluster_path, model, num_microbatches, microbatch_size, bandwidth, latency_us,
            source, order, z, target_layers, eps, schedule, objective, budget, time_limit,
            cost_model,
            use_all_devices, mixed_stages, zebra, data_dir, cache_dir, no_cache, json_path,
            simulate,
            remat, remat_choice, progress, zero, offload_activations):
  from harpjax.cluster import Cluster
  from harpjax.compiler.layers import LayerOptions
  from harpjax.compiler.plan import OBJECTIVE_REGISTRY, RANK, objective_of, solve
  from harpjax.compiler.profile import with_fees
  from harpjax.compiler.schedule import schedule_key

  # Every argument is checked before the long work (tracing, profiling, the search).
  if latency_us is not None and bandwidth is None:
    raise click.UsageError("--latency-us is the latency of the links --bandwidth overrides; "
                           "give --bandwidth too, or drop --latency-us")
  if no_cache and given(ctx, "cache_dir"):
    raise click.UsageError("--no-cache and --cache-dir contradict each other; give one")
  bounds = {"budget_per_hour": (budget, "--budget"), "time_limit_s": (time_limit, "--time-limit")}
  wanted = objective_of(objective)
  if wanted.requires is not None and bounds[wanted.requires][0] is None:
    raise click.UsageError(f"--objective {objective} needs {bounds[wanted.requires][1]}")
  for field, (value, flag) in bounds.items():
    if value is not None and field not in wanted.accepts:
      owner = next(o.name for o in OBJECTIVE_REGISTRY.values() if o.requires == field)
      raise click.UsageError(f"{flag} bounds {owner}; --objective {objective} does not use it")
  if given(ctx, "order") and not use_all_devices:
    raise click.UsageError("--order is the order --use-all-devices keeps; without it the "
                           "planner chooses the order: add --use-all-devices or drop --order")
  if mixed_stages != "off" and use_all_devices:
    if given(ctx, "mixed_stages"):
      raise click.UsageError("--mixed-stages needs the planner to choose the order of the "
                             "subclusters, which --use-all-devices fixes; drop one of them")
    mixed_stages = "off"   # HARP's planner: every device, the order given, no mixed stages
  if remat_choice and given(ctx, "remat"):
    raise click.UsageError("--remat-choice chooses per stage what --remat fixes for all; give "
                           "one of them")
  if remat_choice:
    remat = "choose"
  if schedule != RANK:
    try:
      schedule = schedule_key(schedule)
    except HarpjaxError as e:
      raise click.BadParameter(f"{e}; or 'rank' (the planner chooses)",
                               param_hint="--schedule") from None
  check_output_file(json_path, "--json")
  if not no_cache:
    check_output_dir(cache_dir, "--cache-dir")
  try:
    layer_kw = {}
    if z is not None:
      layer_kw["z"] = z
    if target_layers is not None:
      layer_kw["target_layers"] = target_layers
    layer_options = LayerOptions(**layer_kw)
    profile_opts = profile_options(source=source, cache_dir=cache_dir, no_cache=no_cache,
                                   progress=progress, remat=remat, order=order, zero=zero,
                                   data_dir=data_dir)
    cluster = _with_bandwidth(Cluster.load(cluster_path), bandwidth, latency_us)
    no_host = [s.name for s in cluster.subclusters if s.host_memory_bytes_per_s is None]
    if offload_activations and no_host:
      raise click.UsageError(f"--offload-activations needs host_memory_gbps (the link to host "
                             f"memory) on every subcluster; {no_host} of {cluster_path} have "
                             "none: add it, or drop --offload-activations")
    unpriced = [s.name for s in cluster.subclusters if s.price_per_gpu_hour is None]
    if unpriced and (objective != "min_time" or budget is not None):
      what = "--budget" if objective == "min_time" else f"--objective {objective}"
      raise click.UsageError(f"{what} needs prices: subclusters {unpriced} of "
                             f"{cluster_path} have no price_per_gpu_hour")
    spec = model_spec(model, num_microbatches, microbatch_size)
    solve_opts = solve_options(eps=eps, objective=objective, budget=budget,
                               time_limit=time_limit, use_all_devices=use_all_devices,
                               cost_model=cost_model, offload_activations=offload_activations,
                               mixed_stages=mixed_stages, microbatch_rows=spec.microbatch_size,
                               schedule=schedule, zebra=zebra)
    click.echo(f"cluster: {cluster.summary()}", err=True)
    result = profile_model(spec, cluster, profile_opts, layer_options)
    click.echo(f"planning: searching the plans of {result.tables.num_layers} layers on "
               f"{result.tables.total_devices} devices ...", err=True)
    t1 = time.perf_counter()
    tables = with_fees(result.tables, cluster)
    solved = solve(tables, num_microbatches, options=solve_opts)
    t2 = time.perf_counter()
  except HarpjaxError as e:
    raise click.ClickException(str(e)) from None
  # The plan says what it means (auto_parallel(plan=file) follows it on the same layers);
  # the model and the cluster it was made for are provenance.
  plan = solved.plan.replace(meta={**dict(solved.plan.meta), "model": spec.name,
                                   "cluster": os.path.abspath(cluster_path)},
                             microbatch_size=spec.microbatch_size,
                             remat="full" if remat is True else "none",
                             layer_source="auto", layer_options=layer_options)
  click.echo("")
  click.echo(plan.table())
  click.echo(f"\npredicted iteration: {plan.predicted_iteration_s:.3f} s (simulated; Eq. 12 "
             f"{solved.eq12_s:.3f} s), t_max {plan.t_max_s * 1e3:.2f} ms"
             + (f", link-bound at {solved.period_s * 1e3:.2f} ms" if solved.period_s >
                plan.t_max_s else "")
             + f", eta {plan.eta * 100:.1f}%; tracing {result.stats.trace_s:.1f} s, "
             f"costing {result.stats.cost_s:.1f} s, search {t2 - t1:.2f} s")
  click.echo(f"devices: {solved.num_devices} of {result.tables.total_devices}"
             + ("" if solved.rate_per_hour is None else
                f"; cost {solved.rate_per_hour:.2f} per hour, "
                f"{solved.cost_per_iteration:.4f} per iteration"))
  fees_line = _fees_line(tables, solved)
  if fees_line:
    click.echo(fees_line)
  click.echo(_schedule_line(plan, schedule))
  if any(s.groups for s in plan.stages):
    click.echo(f"mixed-type stages: {plan.schedule}, on {sum(1 for s in plan.stages if s.groups)}"
               f" of {plan.num_stages} stages")
  zebras = [x for x, s in enumerate(plan.stages) if s.zebra is not None]
  if zebras:
    click.echo(f"zebra stages (attention|experts on two groups): {[x + 1 for x in zebras]}; "
               "the local runtime runs them (the Ray runtime does not yet)")
  if simulate:
    _schedule_table(result.tables, plan, num_microbatches, solve_opts, schedule)
  if json_path:
    try:
      plan.save(json_path)
    except OSError as e:
      raise click.ClickException(f"could not write the plan to {json_path!r}: "
                                 f"{e.strerror or e}") from None
    click.echo(f"\nwrote {json_path}")


def _fees_line(tables, solved) -> str | None:
  """The plan's transfer fees and its money with them, where the cluster charges fees (the
  search ranked and budgeted the plan with them)."""
  if tables.fees is None or not tables.fees.charges:
    return None
  _, zone, region = solved.transfer_bytes
  line = (f"transfer fees: {zone / 1e9:.4g} GB between zones, {region / 1e9:.4g} GB between "
          f"regions per iteration: {solved.fees_per_iteration:.4f} per iteration")
  if solved.rate_per_hour is not None:
    line += (f"; with fees {solved.rate_with_fees_per_hour:.2f} per hour, "
             f"{solved.cost_per_iteration:.4f} per iteration")
  return line


def _schedule_line(plan, asked: str) -> str:
  """Which schedule the plan runs, and why."""
  from harpjax.compiler.plan import RANK
  from harpjax.compiler.schedule import ranked_schedules, schedule_kind
  kind = schedule_kind(plan.schedule)
  if asked == RANK:
    why = ("the fastest that fits memory of " + ", ".join(k.name for k in ranked_schedules())
           + " on these stages")
  else:
    why = "--schedule"
  return (f"schedule: {kind.name} ({kind.label}; {why}), warm-ups "
          f"{list(plan.warmups or ())}")


def _schedule_table(tables, plan, num_microbatches: int, opts, asked: str) -> None:
  """Every registered schedule on the plan's stages: warm-ups, simulated time, whether it
  fits memory; ``*`` marks the plan's."""
  from harpjax.compiler.plan import mixed_scorer, schedule_scores
  from harpjax.compiler.schedule import ranked_schedules, registered_schedules
  score = mixed_scorer(tables, num_microbatches, opts, opts.mixed_options)
  ranked = {k.name for k in ranked_schedules()}
  click.echo("\n  schedule      warm-ups              simulated iteration (s)   fits memory  "
             "ranked")
  # An interleaved schedule puts the stages on shared device groups: another plan, not these
  # stages under another order.
  kinds = [k for k in registered_schedules() if k.chunks == 1]
  for sc in schedule_scores(plan, score, kinds):
    warm = ",".join(str(w) for w in sc.warmups)
    mark = "*" if sc.schedule == plan.schedule else " "
    click.echo(f"{mark} {sc.schedule:12s}  {warm[:20]:20s}  {sc.iteration_s:>22.3f}   "
               f"{'yes' if sc.fits else 'NO':11s}  {'yes' if sc.schedule in ranked else '-'}")
