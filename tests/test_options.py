"""The options surface: every option class exported and documented, one named error class per
kind of mistake, each bad value refused by its class with a message naming class and field."""

import ast
import dataclasses
import inspect
import math
import os
import re
import textwrap
import warnings

import pytest

import harpjax
from harpjax import errors
from harpjax.cluster import Link
from harpjax.compiler.schedule import h1f1b_counts
from harpjax.compiler.stages import resolve_plan
from harpjax.runtime.checkpoint import CheckpointError, CheckpointOptionsError
from tests.equivalence import DEMO_CLUSTER

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "options.md")

OPTION_CLASSES = ["AutoPlan", "LayerOptions", "ProfileOptions", "SolveOptions", "MixedOptions",
                  "LocalRuntime", "RayRuntime", "Emulation", "OffloadOptions",
                  "CheckpointOptions", "ElasticOptions", "ParallelOptions", "ZebraOptions"]
"""Every option class a user builds (``ParallelOptions`` is what ``auto_parallel`` builds)."""

INTERNAL = {"WorkerOptions": "the Ray runtime's knobs of one worker, from RayRuntime",
            "VariantOptions": "the planner's variants, from SolveOptions"}
"""Option classes harpjax builds itself from the user's, never given by a user."""

# (class, field, value): each a value the field cannot take.
BAD_VALUES = [
    ("LayerOptions", "z", 0), ("LayerOptions", "z", "2"), ("LayerOptions", "criterion", "size"),
    ("LayerOptions", "target_layers", 0), ("LayerOptions", "max_layers_per_module", 0),
    ("LayerOptions", "max_boundary_ratio", 0.0), ("LayerOptions", "unroll_scan", "yes"),
    ("LayerOptions", "max_unroll", -1),
    ("ProfileOptions", "source", "guess"), ("ProfileOptions", "remat", "most"),
    ("ProfileOptions", "remat", ("full",)), ("ProfileOptions", "cache_dir", 3),
    ("ProfileOptions", "use_cache", None), ("ProfileOptions", "state_bytes_per_param", 0),
    ("ProfileOptions", "optimizer_bytes_per_param", 16.0), ("ProfileOptions", "max_tp", 0),
    ("ProfileOptions", "imbalance", 0), ("ProfileOptions", "order", "fastest_first"),
    ("ProfileOptions", "repeats", 0), ("ProfileOptions", "workers", 0),
    ("ProfileOptions", "efficiencies", 0.5),
    ("SolveOptions", "eps", -0.1), ("SolveOptions", "eps", 1.5), ("SolveOptions", "eps", math.nan),
    ("SolveOptions", "backend", "gpu"), ("SolveOptions", "kernel", "cuda"),
    ("SolveOptions", "workers", 0), ("SolveOptions", "objective", "fastest"),
    ("SolveOptions", "budget_per_hour", -1.0), ("SolveOptions", "cost_model", "eq13"),
    ("SolveOptions", "fwd_fraction", 1.0), ("SolveOptions", "hidden_share", 2.0),
    ("SolveOptions", "proof_nodes", -1), ("SolveOptions", "bound_pieces", 0),
    ("SolveOptions", "zero_levels", (4,)), ("SolveOptions", "offload", "yes"),
    ("SolveOptions", "mixed_stages", "yes"), ("SolveOptions", "schedule", "zero-bubble"),
    ("SolveOptions", "timeout_s", 0), ("SolveOptions", "start_method", "clone"),
    ("SolveOptions", "keep_order", 1),
    ("MixedOptions", "microbatch_rows", 0), ("MixedOptions", "fixed_fraction", 1.0),
    ("MixedOptions", "grad_fraction", -0.5), ("MixedOptions", "grad_bytes", (1.0, -1.0)),
    ("MixedOptions", "min_link_ratio", -1.0), ("MixedOptions", "max_hosts_per_group", 0),
    ("MixedOptions", "max_members", 1), ("MixedOptions", "split_radius", 1.5),
    ("MixedOptions", "pair_candidates", -1), ("MixedOptions", "shares", "even"),
    ("MixedOptions", "sub_host", "no"), ("MixedOptions", "zebra", "yes"),
    ("MixedOptions", "zebra_options", {"max_microbatches": 4}),
    ("ZebraOptions", "max_microbatches", 0), ("ZebraOptions", "assignment_limit", -1),
    ("ZebraOptions", "fwd_fraction", 1.0), ("ZebraOptions", "local_search", "no"),
    ("LocalRuntime", "compile_workers", -1), ("LocalRuntime", "compilation_cache", 3),
    ("LocalRuntime", "progress", "auto"),
    ("RayRuntime", "backend", "processes"), ("RayRuntime", "transport", "udp"),
    ("RayRuntime", "fetch", "most"), ("RayRuntime", "emulation", 2.0),
    ("RayRuntime", "step_timeout_s", 0), ("RayRuntime", "retain_steps", 0),
    ("RayRuntime", "num_cpus", 0), ("RayRuntime", "actor_env", ["X=1"]),
    ("RayRuntime", "pin_hosts", "yes"), ("RayRuntime", "address", 6379),
    ("RayRuntime", "interrupt_grace_s", -1.0), ("RayRuntime", "compilation_cache", 3),
    ("Emulation", "time_scale", 0), ("Emulation", "bytes_scale", math.inf),
    ("Emulation", "fwd_fraction", 0.0), ("Emulation", "end_s", (1.0, -1.0)),
    ("Emulation", "links", {(0, 1): "10 Gbps"}),
    ("ElasticOptions", "policy", "grow"), ("ElasticOptions", "max_recoveries", -1),
    ("CheckpointOptions", "every", 0), ("CheckpointOptions", "keep", 0),
    ("CheckpointOptions", "asynchronous", "yes"),
    ("AutoPlan", "solve", harpjax.ProfileOptions()),
]


def _make(cls_name, field, value):
  cls = getattr(harpjax, cls_name)
  if cls_name == "CheckpointOptions":
    return cls("/tmp/harpjax-ckpt", **{field: value})
  return cls(**{field: value})


@pytest.mark.parametrize("cls_name,field,value", BAD_VALUES,
                         ids=[f"{c}.{f}={v!r}" for c, f, v in BAD_VALUES])
def test_a_bad_value_is_an_invalid_option_naming_class_and_field(cls_name, field, value):
  with pytest.raises(errors.InvalidOptionError) as info:
    _make(cls_name, field, value)
  assert f"{cls_name}.{field}" in str(info.value), str(info.value)


def test_the_defaults_and_good_values_are_taken():
  for name in OPTION_CLASSES:
    if name == "CheckpointOptions":
      harpjax.CheckpointOptions("/tmp/harpjax-ckpt")
    elif name != "ParallelOptions":
      getattr(harpjax, name)()
  # values at the edges of what each field takes
  harpjax.LayerOptions(z=1, max_unroll=0, target_layers=None)
  harpjax.ProfileOptions(imbalance=math.inf, remat=("none", "full"), order=["a", "b"],
                         optimizer_bytes_per_param=None, cache_dir="/tmp/c")
  harpjax.SolveOptions(eps=0, hidden_share=1.0, proof_nodes=0, timeout_s=math.inf,
                       objective="min_time_within_budget", budget_per_hour=3.0,
                       start_method="spawn", mixed_options=harpjax.MixedOptions())
  harpjax.SolveOptions(eps=1)
  harpjax.MixedOptions(min_link_ratio=math.inf, grad_bytes=[0, 1e6], microbatch_rows=4)
  harpjax.Emulation(fwd_s=(1.0, 2.0), bwd_s=(2, 4), links={(0, 1): Link(1e9, 1e-5)})
  harpjax.RayRuntime(recv_timeout_s=1, num_cpus=2, actor_env={"X": "1"}, pin_hosts=None)
  harpjax.CheckpointOptions("/tmp/harpjax-ckpt", keep=None, state_output=None)
  harpjax.ElasticOptions(policy=lambda failure: "stop", max_recoveries=0)


def test_one_error_class_per_kind_of_mistake():
  kinds = [errors.InvalidOptionError, errors.UnknownOptionError, errors.OptionConflictError]
  for kind in kinds:
    assert issubclass(kind, errors.OptionsError) and kind.__doc__
    assert getattr(harpjax, kind.__name__) is kind and kind.__name__ in harpjax.__all__
  assert not any(issubclass(a, b) for a in kinds for b in kinds if a is not b)
  # `except PlanError` (what the planner's and runtime's options raised before) still catches
  # a bad value; `except CheckpointError` a bad CheckpointOptions value.
  assert issubclass(errors.InvalidOptionError, errors.PlanError)
  assert issubclass(errors.InvalidOptionError, ValueError)
  with pytest.raises(errors.PlanError, match="RayRuntime.fetch"):
    harpjax.RayRuntime(fetch="most")
  with pytest.raises(errors.PlanError, match="Emulation.time_scale"):
    harpjax.Emulation(time_scale=-1.0)
  with pytest.raises(CheckpointError, match="CheckpointOptions.every"):
    harpjax.CheckpointOptions("/tmp/harpjax-ckpt", every=0)
  assert issubclass(CheckpointOptionsError, errors.InvalidOptionError)
  # two options that contradict are a conflict, not a bad value
  with pytest.raises(errors.OptionConflictError, match="fwd_s"):
    harpjax.Emulation(fwd_s=(1.0,))
  with pytest.raises(errors.OptionConflictError, match="fwd_s has 2 stages, bwd_s 1"):
    harpjax.Emulation(fwd_s=(1.0, 1.0), bwd_s=(1.0,))


def _option_classes_defined():
  """Every class named like an option class in the package's modules (name -> class)."""
  import pkgutil
  import importlib
  found = {}
  for info in pkgutil.walk_packages(harpjax.__path__, "harpjax."):
    if ".cli" in info.name or "examples" in info.name or info.name.endswith("ray_runtime"):
      continue
    module = importlib.import_module(info.name)
    for name, obj in vars(module).items():
      if (inspect.isclass(obj) and obj.__module__ == module.__name__ and
          re.search(r"(Options|Runtime|^Emulation|^AutoPlan)$", obj.__name__) and
          not issubclass(obj, BaseException)):
        found[obj.__name__] = obj
  return found


def test_every_option_class_is_exported_and_in_the_docs_table():
  defined = _option_classes_defined()
  assert set(OPTION_CLASSES) <= set(defined)
  assert set(defined) - set(INTERNAL) == set(OPTION_CLASSES), set(defined) ^ set(OPTION_CLASSES)
  with open(DOCS) as f:
    docs = f.read()
  rows = set(re.findall(r"^\| `(?:harpjax\.)?(\w+)` \|", docs, re.M))
  for name in OPTION_CLASSES:
    cls = getattr(harpjax, name)
    assert name in harpjax.__all__ and dataclasses.is_dataclass(cls), name
    assert cls.__dataclass_params__.frozen, name
    assert name in rows, f"{name} has no row in docs/options.md"
  for kind in ("InvalidOptionError", "UnknownOptionError", "OptionConflictError"):
    assert f"`{kind}`" in docs


def _raised_names(cls) -> list[tuple[str, int]]:
  """The names of the exception classes ``cls.__post_init__`` raises (``raise X(...)``)."""
  src = textwrap.dedent(inspect.getsource(cls.__post_init__))
  out = []
  for node in ast.walk(ast.parse(src)):
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
      func = node.exc.func
      out.append((func.id if isinstance(func, ast.Name) else ast.unparse(func), node.lineno))
  return out


ALSO_RAISED = {"ParallelOptions": {"MicrobatchError"}}
"""Errors of another kind an option class may raise: ``num_microbatches`` that is not a positive
integer is the batch split's own error (as a batch that does not split)."""


@pytest.mark.parametrize("name", OPTION_CLASSES)
def test_an_option_class_raises_only_option_errors(name):
  cls = getattr(harpjax, name)
  module = inspect.getmodule(cls)
  for raised, line in _raised_names(cls):
    if raised in ALSO_RAISED.get(name, ()):
      continue
    exc = getattr(module, raised, None) or getattr(errors, raised, None)
    assert inspect.isclass(exc) and issubclass(exc, errors.OptionsError), (
        f"{name}.__post_init__ line {line} raises {raised}, not an OptionsError")


def test_solve_options_and_plans_take_the_same_eps():
  # The plan records the tolerance the planner used: a value one takes, the other takes too.
  for eps in (-0.1, 0, 0.1, 1, 1.01, math.inf, math.nan, True):
    def takes(make):
      try:
        make()
        return True
      except errors.HarpjaxError:
        return False
    assert takes(lambda: harpjax.SolveOptions(eps=eps)) == takes(
        lambda: harpjax.ManualPlan([((0, 1), "v100", (1, 2))], eps=eps)), eps


def test_a_given_plans_recorded_warmups_follow_the_eps_asked_for():
  # Stage times 1 s and a 0.3 s cut: H-1F1B gives the first stage 1 + 2 warm-ups at eps 0.1,
  # 1 + 1 at eps 0.7 (delta = ceil(2c / t_max - eps) + 1). A plan that records the first set
  # given with eps=0.7 must run the second, not keep the counts of the tolerance it replaces.
  plan = harpjax.ManualPlan([
      harpjax.StageSpec((0, 1), "v100", (1, 2), warmup=3, time_s=1.0, comm_s=0.3),
      harpjax.StageSpec((2, 3), "a100", (1, 2), warmup=1, time_s=1.0)], eps=0.1,
      num_microbatches=4)
  cluster = harpjax.Cluster.load(DEMO_CLUSTER)
  assert resolve_plan(plan, cluster, 4, 4)[0].warmups == (3, 1) == h1f1b_counts([0.3], 1.0, 0.1)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    options = harpjax.options.parallel_options(cluster=DEMO_CLUSTER, plan=plan, eps=0.7)
  given = options.given(options.plan)
  assert given.eps == 0.7
  assert resolve_plan(given, cluster, 4, 4)[0].warmups == h1f1b_counts([0.3], 1.0, 0.7) == (2, 1)
  # the same eps leaves the plan as it is
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    same = harpjax.options.parallel_options(cluster=DEMO_CLUSTER, plan=plan, eps=0.1)
  assert same.given(same.plan) == plan


def test_auto_plan_takes_mixed_options_only_of_their_class():
  with pytest.raises(errors.InvalidOptionError, match="SolveOptions.mixed_options"):
    harpjax.AutoPlan(solve=harpjax.SolveOptions(mixed_options={"microbatch_rows": 8}))
  auto = harpjax.AutoPlan(solve=harpjax.SolveOptions(
      mixed_options=harpjax.MixedOptions(microbatch_rows=8)))
  assert auto.solve.mixed_options.microbatch_rows == 8
