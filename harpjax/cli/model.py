"""What the commands share about the model and its costs: the model named on the command line,
the profiler's and the planner's options (one set of defaults with :func:`harpjax.auto_parallel`,
docs/planner.md "One set of defaults"), and profiling a model on a cluster with the tracing and
the costing timed apart.
"""

from __future__ import annotations

import dataclasses
import math
import os

import click

__all__ = ["model_spec", "config_problem", "profile_options", "solve_options",
           "profile_model", "DATA_DIR_HELP"]

DATA_DIR_HELP = ("Directory of the published measurements (zorse_model_latencies.json and "
                 "zorse_model_stats.json) for --source imported; default ../shared/data beside "
                 "the repository.")


def model_spec(model: str, num_microbatches: int, microbatch_size: int | None):
  from harpjax.models import BUILTIN_MODELS, make_lm_spec
  if model in BUILTIN_MODELS:
    return BUILTIN_MODELS[model](num_microbatches=num_microbatches,
                                 microbatch_size=microbatch_size)
  if not os.path.exists(model):
    raise click.BadParameter(f"{model!r} is neither a built-in model "
                             f"({', '.join(sorted(BUILTIN_MODELS))}) nor a config file",
                             param_hint="--model")
  if os.path.isdir(model):
    raise click.BadParameter(f"{model!r} is a directory; give a YAML/JSON file of GPT config "
                             "fields", param_hint="--model")
  import yaml
  from harpjax.models import GPT, GPT_39B, MIXTRAL_8X7B, Mixtral, MoEConfig, MoETransformer
  try:
    with open(model) as f:
      cfg = yaml.safe_load(f) or {}
  except (yaml.YAMLError, OSError, UnicodeDecodeError) as e:
    raise click.BadParameter(f"{model}: not valid YAML/JSON: {e}", param_hint="--model")
  if not isinstance(cfg, dict):
    raise click.BadParameter(f"{model}: expected a mapping of GPT config fields",
                             param_hint="--model")
  cfg = dict(cfg)
  family = cfg.pop("family", "gpt")
  if "microbatch_size" in cfg and microbatch_size is not None and \
      cfg["microbatch_size"] != microbatch_size:
    raise click.UsageError(f"{model} sets microbatch_size: {cfg['microbatch_size']!r} and "
                           f"--microbatch-size is {microbatch_size}; give it once")
  mbs = cfg.pop("microbatch_size", microbatch_size or 8)
  if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
    raise click.BadParameter(f"{model}: microbatch_size={mbs!r} must be an integer >= 1",
                             param_hint="--model")
  # Fields not given are GPT-39B's (the paper's model: fp16, automatic layers), or
  # Mixtral-8x7B's for the Mixtral family.
  classes = {"gpt": (GPT_39B, GPT),
             "moe": (MoEConfig(**dataclasses.asdict(GPT_39B)), MoETransformer),
             "mixtral": (MIXTRAL_8X7B, Mixtral)}
  if not isinstance(family, str) or family not in classes:
    raise click.BadParameter(f"{model}: family {family!r}; choose one of {sorted(classes)}",
                             param_hint="--model")
  base, model_cls = classes[family]
  fields = {f.name for f in dataclasses.fields(base)}
  unknown = sorted(set(cfg) - fields)
  if unknown:
    raise click.BadParameter(f"{model}: unknown fields {unknown}; known: {sorted(fields)}",
                             param_hint="--model")
  for name, value in cfg.items():
    problem = config_problem(name, value, getattr(base, name))
    if problem:
      raise click.BadParameter(f"{model}: {name}={value!r} {problem}", param_hint="--model")
  try:
    config = dataclasses.replace(base, **cfg)
  except (TypeError, ValueError) as e:
    raise click.BadParameter(f"{model}: {e}", param_hint="--model") from None
  if config.hidden % config.num_heads:
    raise click.BadParameter(f"{model}: hidden={config.hidden} must be a multiple of "
                             f"num_heads={config.num_heads}", param_hint="--model")
  name = os.path.splitext(os.path.basename(model))[0]
  return make_lm_spec(name, model_cls(config), config, microbatch_size=int(mbs),
                      num_microbatches=num_microbatches)


_OPTIONAL = ("capacity_factor", "num_kv_heads")
"""Model config fields that take ``null`` (no drops; as many key/value heads as heads)."""


def config_problem(name: str, value, default) -> str | None:
  """What is wrong with a model config field's value (its type is the default's)."""
  if name.endswith("dtype"):
    if value is None and default is None:
      return None
    import jax.numpy as jnp
    try:
      jnp.dtype(value)
    except TypeError:
      return "is not a dtype name (float32, bfloat16, float16, ...)"
    return None if isinstance(value, str) else "must be a dtype name"
  if value is None and name in _OPTIONAL:
    return None
  if isinstance(default, bool):
    return None if isinstance(value, bool) else "must be true or false"
  if isinstance(default, str):
    return None if isinstance(value, str) else "must be a string"
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return "must be a number"
  if isinstance(default, int) and not isinstance(value, int):
    return "must be an integer"
  if not math.isfinite(value):
    return "must be finite"
  if name == "dropout":
    return None if 0 <= value < 1 else "must be in [0, 1)"
  if name == "layer_marks":
    return None if value in (0, 1, 2) else "must be 0, 1 or 2"
  if name == "aux_loss_coef":
    return None if value >= 0 else "must be >= 0"
  return None if value > 0 else "must be > 0"



def profile_options(*, source: str = "jaxpr", cache_dir=None, no_cache: bool = False,
                    progress=None, remat: bool | str = False,
                    order: str = "memory_to_compute",
                    zero: bool = True, data_dir=None):
  """The :class:`~harpjax.compiler.profile.ProfileOptions` of the command-line options (their
  defaults give ``ProfileOptions()``'s choices: no rematerialisation, the optimizer state's
  share given so that the planner chooses a ZeRO level per stage)."""
  from harpjax.compiler.profile import ProfileOptions
  return ProfileOptions(source=source, cache_dir=cache_dir, use_cache=not no_cache,
                        progress=progress, remat=remat,
                        order=None if order == "given" else order,
                        optimizer_bytes_per_param=12.0 if zero else None,
                        imported_data_dir=data_dir)


def solve_options(*, eps: float = 0.1, objective: str = "min_time", budget=None,
                  time_limit=None, use_all_devices: bool = False, cost_model: str = "simulator",
                  offload_activations: bool | None = None, mixed_stages: str = "auto",
                  microbatch_rows: int | None = None, schedule: str = "rank",
                  zebra: str = "auto"):
  """The :class:`~harpjax.compiler.plan.SolveOptions` of the command-line options (their
  defaults give ``SolveOptions()``'s choices; ``offload_activations=None``: where the tables
  give the host link, as ``SolveOptions`` does)."""
  from harpjax.compiler.plan import MixedOptions, SolveOptions
  opts = SolveOptions(eps=eps, objective=objective, budget_per_hour=budget,
                      time_limit_s=time_limit, use_all_devices=use_all_devices,
                      keep_order=use_all_devices, cost_model=cost_model,
                      mixed_stages=mixed_stages, schedule=schedule)
  if offload_activations is not None:
    opts = dataclasses.replace(opts, offload_activations=offload_activations)
  if mixed_stages != "off":
    opts = dataclasses.replace(opts, mixed_options=MixedOptions(microbatch_rows=microbatch_rows,
                                                                zebra=zebra))
  return opts


def profile_model(spec, cluster, options, layer_options=None):
  """Traces ``spec``'s step from shapes, cuts it into layers and costs them on ``cluster``;
  says so on stderr, with the seconds of the tracing and of the costing apart.

  Returns:
    The :class:`~harpjax.compiler.profile.ProfileResult`.
  """
  from harpjax.compiler.profile import profile_step
  click.echo(f"model {spec.name}: tracing, building layers and costing them ...", err=True)
  result = profile_step(spec.step_fn, spec.args, cluster,
                        num_microbatches=spec.num_microbatches,
                        batch_argnums=spec.batch_argnums, layer_options=layer_options,
                        options=options)
  click.echo(f"layers: {result.layers.summary}", err=True)
  click.echo(f"profile: {result.stats.describe()}", err=True)
  return result
