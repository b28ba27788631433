"""The decorator's contract: same API as JAX outside auto_parallel, clear errors for bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import harpjax
from harpjax.errors import (MicrobatchError, NotEnoughDevicesError, OptionsError, PlanError,
                            TraceError)
from harpjax.models import MLP
from tests.equivalence import DEMO_CLUSTER


def _setup():
  model = MLP(features=(16, 16, 16), num_classes=4)
  x = jnp.ones((8, 6))
  state = train_state.TrainState.create(apply_fn=model.apply,
                                        params=model.init(jax.random.key(0), x),
                                        tx=optax.sgd(0.1))

  def step(state, batch):
    def loss_fn(p):
      logits = state.apply_fn(p, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  batch = {"x": jax.random.normal(jax.random.key(1), (8, 6)), "y": jnp.arange(8) % 4}
  return step, state, batch


PLAN = harpjax.ManualPlan([((0, 1), "v100", (1, 2)), ((2, 3), "a100", (1, 2))])


def test_value_and_grad_and_grad_are_jax_outside_auto_parallel():
  f = lambda p, x: jnp.sum(jnp.tanh(p * x)) ** 2
  p, x = jnp.arange(3.0), jnp.ones(3)
  for ours, theirs in [(harpjax.value_and_grad(f), jax.value_and_grad(f)),
                       (harpjax.grad(f, argnums=(0, 1)), jax.grad(f, argnums=(0, 1)))]:
    a, b = ours(p, x), theirs(p, x)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
      np.testing.assert_array_equal(u, v)
  assert harpjax.mark_layer_boundary(x) is x
  jaxpr = jax.make_jaxpr(lambda x: harpjax.mark_layer_boundary(x) * 2)(x)
  assert "harpjax" not in str(jaxpr)


def test_step_returns_same_structure_and_plan_table():
  step, state, batch = _setup()
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=PLAN)
  out = pstep(state, batch)
  ref = jax.jit(step)(state, batch)
  assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(ref)
  plan = pstep.plan(state, batch)
  table = str(plan)
  assert "Layer Range" in table and "[0, 1]" in table and "a100" in table
  assert plan.num_layers == 4 and plan.warmups == (3, 1)
  assert [len(s.devices) for s in plan.stages] == [2, 2]


def test_batch_not_divisible_into_microbatches():
  step, state, batch = _setup()
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=3, plan=PLAN)
  with pytest.raises(MicrobatchError, match=r"8 rows.*num_microbatches=3"):
    pstep(state, batch)


@pytest.mark.parametrize("plan, match", [
    (harpjax.ManualPlan([((0, 1), "v100", (1, 4)), ((2, 3), "v100", (1, 2))]), "fit|left"),
    (harpjax.ManualPlan([((0, 1), "v100", (1, 4)), ((2, 3), "a100", (2, 4))]), "submesh|devices"),
    (harpjax.ManualPlan([((0, 1), "h100", (1, 1)), ((2, 3), "a100", (1, 1))]), "h100"),
    (harpjax.ManualPlan([((0, 1), "v100", (1, 2)), ((2, 2), "a100", (1, 2))]), "4 layers"),
    (harpjax.ManualPlan([harpjax.StageSpec((0, 1), "v100", (1, 2), devices=(0, 1)),
                         harpjax.StageSpec((2, 3), "v100", (1, 2), devices=(1, 2))]),
     "both use device 1"),
    (harpjax.ManualPlan([harpjax.StageSpec((0, 1), "v100", (1, 2), devices=(4, 5)),
                         harpjax.StageSpec((2, 3), "a100", (1, 2))]), "not in subcluster"),
], ids=["too-many-in-subcluster", "bad-shape", "unknown-subcluster", "not-covering",
        "overlap", "wrong-subcluster"])
def test_bad_plans(plan, match):
  step, state, batch = _setup()
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=plan)
  with pytest.raises(PlanError, match=match):
    pstep(state, batch)


def test_plan_construction_errors():
  with pytest.raises(PlanError, match="contiguous"):
    harpjax.ManualPlan([((0, 1), "v100", (1, 2)), ((3, 3), "a100", (1, 2))])
  with pytest.raises(PlanError, match="layer 0"):
    harpjax.ManualPlan([((1, 3), "v100", (1, 2))])
  with pytest.raises(PlanError, match="logical_mesh"):
    harpjax.ManualPlan([((0, 3), "v100", (1, 2), (3, 1))])


def test_step_without_value_and_grad():
  _, state, batch = _setup()

  def step(state, batch):
    grads = jax.grad(lambda p: jnp.sum(state.apply_fn(p, batch["x"])))(state.params)
    return state.apply_gradients(grads=grads)

  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=PLAN)
  with pytest.raises(TraceError, match="never calls harpjax.value_and_grad"):
    pstep(state, batch)


def test_cluster_larger_than_machine():
  step, state, batch = _setup()
  cluster = harpjax.Cluster.simple([("a", "A100-40G", 2, 8)])
  plan = harpjax.ManualPlan([((0, 3), "a", (1, 2))])
  pstep = harpjax.auto_parallel(step, cluster=cluster, num_microbatches=2, plan=plan)
  with pytest.raises(NotEnoughDevicesError, match="16"):
    pstep(state, batch)


def test_unknown_schedule_and_missing_microbatches():
  step, _, _ = _setup()
  with pytest.raises(PlanError, match="schedule"):
    harpjax.ManualPlan(PLAN.stages, schedule="zero-bubble")
  with pytest.raises(OptionsError, match="schedule"):   # the spelling of earlier releases
    harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=PLAN,
                          schedule="zero-bubble")
  with pytest.raises(MicrobatchError):
    harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=0, plan=PLAN)


def test_plan_json_round_trip(tmp_path):
  plan = harpjax.ManualPlan([((0, 1), "v100", (1, 2), (1, 2)), ((2, 3), "a100", (2, 2))],
                            num_microbatches=4)
  path = tmp_path / "plan.json"
  plan.save(path)
  assert harpjax.load_plan(path) == plan


@pytest.fixture
def fresh_compilation_cache():
  """No persistent compilation cache configured; the settings before are restored after."""
  from jax.experimental.compilation_cache import compilation_cache as cc
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  before = {n: jax.config.values[n] for n in names}
  jax.config.update("jax_compilation_cache_dir", None)
  cc.reset_cache()
  try:
    yield
  finally:
    for n, v in before.items():
      jax.config.update(n, v)
    cc.reset_cache()


def test_compiled_executables_are_kept_for_the_next_process(tmp_path, caplog,
                                                            fresh_compilation_cache):
  # A new step over the same program after JAX's in-memory caches are cleared (as in a new
  # process) loads every executable from the directory instead of compiling it.
  step, state, batch = _setup()
  where = tmp_path / "executables"
  out = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=PLAN,
                              runtime=harpjax.LocalRuntime(compilation_cache=str(where)))(
                                  state, batch)
  assert jax.config.values["jax_compilation_cache_dir"] == str(where)
  kept = {p.name for p in where.rglob("*") if p.is_file()}
  assert kept
  jax.clear_caches()
  with caplog.at_level("DEBUG", logger="jax._src.compiler"):
    again = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=PLAN,
                                  compilation_cache=str(tmp_path / "elsewhere"))(  # old spelling
                                      state, batch)
  hits = [r for r in caplog.records if "Persistent compilation cache hit" in r.getMessage()]
  misses = [r.getMessage() for r in caplog.records
            if "Persistent compilation cache miss" in r.getMessage()]
  # The directory set first stays in effect (a configured one is never replaced); both
  # stages' forward and backward are hits, nothing is compiled.
  assert jax.config.values["jax_compilation_cache_dir"] == str(where)
  names = [r.args[0] for r in hits]
  assert names.count("jit_fwd") == names.count("jit_bwd") == 2 and not misses, (names, misses)
  for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_compilation_cache_option_is_checked_and_can_be_off(fresh_compilation_cache):
  step, state, batch = _setup()
  with pytest.raises(OptionsError, match="compilation_cache"):
    harpjax.LocalRuntime(compilation_cache=3)
  with pytest.raises(OptionsError, match="compilation_cache"):
    harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, plan=PLAN, compilation_cache=3)
  harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=PLAN,
                        runtime=harpjax.LocalRuntime(compilation_cache=False))(state, batch)
  assert jax.config.values["jax_compilation_cache_dir"] is None


def test_too_few_devices_is_said_before_any_tracing(monkeypatch):
  step, state, batch = _setup()
  cluster = harpjax.Cluster.simple([("a", "A100-40G", 2, 8)])

  def traced(*args, **kwargs):
    raise AssertionError("traced before the device count was checked")

  monkeypatch.setattr(harpjax.phases, "trace_step", traced)
  pstep = harpjax.auto_parallel(step, cluster=cluster, num_microbatches=2)   # automatic plan
  with pytest.raises(NotEnoughDevicesError, match="needs 16 devices"):
    pstep(state, batch)
  with pytest.raises(NotEnoughDevicesError, match="needs 16 devices"):
    pstep.compile(state, batch)


def test_num_microbatches_is_an_integer_that_agrees_with_the_plan(tmp_path):
  step, state, batch = _setup()
  for bad in (2.0, True, "2"):
    with pytest.raises(MicrobatchError, match="positive integer"):
      harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=bad, plan=PLAN)
  path = tmp_path / "plan.json"
  PLAN.replace(num_microbatches=4).save(path)
  with pytest.raises(PlanError, match="num_microbatches=2 but the plan given was made for B=4"):
    harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=str(path))(
        state, batch)
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, plan=str(path))   # the plan's B
  assert pstep.plan(state, batch).num_microbatches == 4


def test_a_plan_file_cut_short_is_replaced_by_planning(tmp_path, caplog):
  step, state, batch = _setup()
  path = tmp_path / "plan.json"
  PLAN.replace(num_microbatches=2).save(path)
  path.write_bytes(path.read_bytes()[:40])   # an interrupted save of an older version
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=str(path))
  out, ref = pstep(state, batch), jax.jit(step)(state, batch)
  assert float(abs(out[1] - ref[1])) <= 1e-5 * abs(float(ref[1]))
  warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert len([w for w in warned if "planning automatically instead" in w]) == 1, warned
  path.write_text('{"stages": [{"layers": [0, 1]}]}')   # readable but wrong: a mistake
  with pytest.raises(PlanError, match="plan file"):
    harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=str(path))(
        state, batch)


def test_ctrl_c_while_compiling_cancels_the_stages_not_started(monkeypatch, sigint):
  # Two compile threads, four stages: Ctrl-C while the first two compile returns at once and
  # the other two never start (they used to, after the first two, before the interrupt
  # surfaced).
  import concurrent.futures
  import os
  import signal
  import threading
  step, state, batch = _setup()
  plan = harpjax.ManualPlan([((k, k), "v100" if k < 2 else "a100", (1, 1)) for k in range(4)])
  started, release = [], threading.Event()
  real_as_completed = concurrent.futures.as_completed

  from harpjax.compiler.stages import aot

  def compiling(stage):
    started.append(stage)
    release.wait(timeout=120)   # released at the end of the test (a bound for a hung one)

  def as_completed(jobs):   # every stage submitted: Ctrl-C while the driver waits for them
    os.kill(os.getpid(), signal.SIGINT)
    return real_as_completed(jobs)

  monkeypatch.setattr(aot, "_stage", compiling)
  monkeypatch.setattr(concurrent.futures, "as_completed", as_completed)
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=plan,
                                runtime=harpjax.LocalRuntime(compile_workers=2))
  try:
    with pytest.raises(KeyboardInterrupt):
      pstep.compile(state, batch)
    assert len(started) <= 2, started
  finally:
    release.set()


def test_an_unwritable_profile_cache_is_one_warning(tmp_path, caplog):
  from harpjax.compiler.profile import ProfileOptions
  step, state, batch = _setup()
  (tmp_path / "file").write_text("x")   # the cache directory would be inside a file
  options = ProfileOptions(cache_dir=str(tmp_path / "file" / "cache"), progress=False)
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2,
                                plan=harpjax.AutoPlan(profile=options))
  assert pstep.profile(state, batch).stats.computed > 1
  warned = [r for r in caplog.records if r.levelname == "WARNING"
            and "could not write profile cache" in r.getMessage()]
  assert len(warned) == 1, [r.getMessage() for r in warned]


def test_an_interrupted_plan_save_leaves_the_file_as_it_was(tmp_path, monkeypatch):
  import json
  import os
  path = tmp_path / "plan.json"
  PLAN.save(path)
  before = path.read_bytes()

  def cut(obj, f, **kwargs):
    f.write('{"stages": [')
    raise KeyboardInterrupt

  monkeypatch.setattr(json, "dump", cut)
  with pytest.raises(KeyboardInterrupt):
    PLAN.replace(num_microbatches=8).save(path)
  monkeypatch.undo()
  assert path.read_bytes() == before and os.listdir(tmp_path) == ["plan.json"]


# --------------------------------------------------------------------------- the options


def test_each_phase_result_advances_itself():
  # step.trace(*a).plan().layout().compile() walks the same cached phases as the step's own
  # methods, and the compiled step computes what jax.jit does.
  step, state, batch = _setup()
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=PLAN)
  traced = pstep.trace(state, batch)
  planned = traced.plan()
  laid = planned.layout()
  compiled = laid.compile()
  assert isinstance(planned, harpjax.Planned) and isinstance(laid, harpjax.LaidOut)
  assert planned.traced is traced and planned.plan == pstep.plan(state, batch)
  assert laid.program is pstep.layout(state, batch) and compiled is pstep.compile(state, batch)
  assert len(laid.lower().stages) == PLAN.num_stages
  out, ref = pstep(state, batch), jax.jit(step)(state, batch)
  assert float(abs(out[1] - ref[1])) <= 1e-5 * abs(float(ref[1]))
  with pytest.raises(harpjax.HarpjaxError, match="not made by a harpjax.ParallelStep"):
    harpjax.Traced(traced.step, traced.layers).plan()
  # The results hold the step weakly: dropping the step frees it (and what it owns, Ray
  # workers included) at once, not when the garbage collector next runs.
  import gc
  import weakref
  alive = weakref.ref(pstep)
  gc.disable()
  try:
    del pstep
    assert alive() is None
  finally:
    gc.enable()
  with pytest.raises(harpjax.HarpjaxError, match="no longer exists"):
    harpjax.Traced(traced.step, traced.layers, traced._advance).plan()


def test_every_option_class_is_exported_and_frozen():
  import dataclasses
  names = ["AutoPlan", "LayerOptions", "ProfileOptions", "SolveOptions", "MixedOptions",
           "LocalRuntime", "RayRuntime", "Emulation", "OffloadOptions", "CheckpointOptions",
           "ElasticOptions", "ParallelOptions"]
  for name in names:
    cls = getattr(harpjax, name)
    assert name in harpjax.__all__ and dataclasses.is_dataclass(cls), name
    assert cls.__dataclass_params__.frozen, name
  assert harpjax.RunnerOptions is harpjax.RayRuntime   # the former name


def test_one_place_per_choice_and_the_earlier_spellings():
  step, _, _ = _setup()
  make = lambda **kw: harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2,
                                            **kw).options
  # Plain spellings of the typed choices.
  opts = make(runtime="ray")
  assert opts.plan == harpjax.AutoPlan() and opts.runtime == harpjax.RayRuntime()
  assert make(plan="auto").plan == harpjax.AutoPlan()
  # The spellings of earlier releases land in their one place, with a DeprecationWarning.
  with pytest.warns(DeprecationWarning, match="AutoPlan"):
    opts = make(schedule="1f1b", eps=0.2)
  assert (opts.plan.solve.schedule, opts.plan.solve.eps) == ("1f1b", 0.2)
  with pytest.warns(DeprecationWarning, match="ManualPlan"):
    opts = make(plan=PLAN, schedule="1f1b", eps=0.2)
  assert (opts.plan.schedule, opts.plan.eps) == ("1f1b", 0.2)
  with pytest.warns(DeprecationWarning, match="LocalRuntime"):
    assert make(plan=PLAN, runtime_options={"compile_workers": 0}).runtime == \
        harpjax.LocalRuntime(compile_workers=0)
  with pytest.warns(DeprecationWarning, match="AutoPlan"):
    opts = make(solve_options=harpjax.SolveOptions(objective="max_throughput_per_dollar"))
  assert opts.plan.solve.objective == "max_throughput_per_dollar"
  # An option where it does not apply, or one choice given twice, is refused.
  conflicts = [
      dict(plan=PLAN, solve_options=harpjax.SolveOptions()),
      dict(plan=PLAN, profile_options=harpjax.ProfileOptions()),
      dict(plan=harpjax.AutoPlan(solve=harpjax.SolveOptions(schedule="gpipe")),
           schedule="1f1b"),
      dict(solve_options=harpjax.SolveOptions(eps=0.3), eps=0.2),
      dict(plan=harpjax.AutoPlan(solve=harpjax.SolveOptions(eps=0.3)), eps=0.2),
      dict(runtime=harpjax.LocalRuntime(compilation_cache=False), compilation_cache="/tmp/c"),
      dict(plan=PLAN, elastic=harpjax.ElasticOptions(), checkpoint="/tmp/x"),
      dict(plan=PLAN, runtime="ray", elastic=harpjax.ElasticOptions()),
      dict(runtime=harpjax.RayRuntime(), runtime_options={"fetch": "all"}),
  ]
  for kw in conflicts:
    with pytest.raises(harpjax.OptionConflictError):
      make(**kw)
  for kw, match in [(dict(runtime="tpu"), "runtime='tpu'"), (dict(plan=3), "plan=3")]:
    with pytest.raises(OptionsError, match=match):
      make(**kw)
  with pytest.raises(OptionsError, match="AutoPlan.solve"):
    harpjax.AutoPlan(solve=harpjax.ProfileOptions())
  with pytest.raises(harpjax.UnknownOptionError, match="fetch.*options of runtime='ray'"):
    make(plan=PLAN, runtime_options={"fetch": "all"})


def test_plan_files_written_before_keep_loading(tmp_path):
  # Earlier versions kept what a plan means in meta: read into the fields, meta keeps the rest.
  import json
  data = PLAN.replace(num_microbatches=2).to_json()
  for key in ("eps", "remat", "layer_source", "layer_options", "microbatch_size"):
    del data[key]
  data["meta"] = {"eps": 0.2, "remat": True, "layers": "auto", "microbatch_size": 4,
                  "model": "gpt-tiny"}
  path = tmp_path / "old.json"
  path.write_text(json.dumps(data))
  plan = harpjax.load_plan(path)
  assert (plan.eps, plan.remat, plan.layer_source, plan.microbatch_size) == (0.2, "full",
                                                                             "auto", 4)
  assert dict(plan.meta) == {"model": "gpt-tiny"}
  assert all(plan.remat_of(s) == "full" for s in plan.stages)
  assert harpjax.Plan.from_json(plan.to_json()) == plan
  with pytest.raises(PlanError, match="layer_options"):
    PLAN.replace(layer_options=harpjax.LayerOptions(z=3))   # marked layers have no options
