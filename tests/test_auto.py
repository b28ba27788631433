"""Fully automatic planning: auto_parallel with no plan, saved plans, and the plan CLI."""


import jax
import jax.numpy as jnp
import optax
import pytest
from click.testing import CliRunner
from flax.training import train_state

import harpjax
from harpjax.cli import main as cli_main
from harpjax.compiler.profile import ProfileOptions
from harpjax.errors import InfeasiblePlanError
from harpjax.models import GPT, GPTConfig
from tests.equivalence import CONFIGS, compare_steps


def _gpt(tx):
  cfg = GPTConfig(vocab_size=64, seq_len=8, hidden=16, num_heads=2, num_blocks=2)
  model = GPT(cfg)
  params = model.init(jax.random.key(0), jnp.zeros((8, cfg.seq_len), jnp.int32))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def step(state, tokens):
    def loss_fn(p):
      logits = state.apply_fn(p, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  batches = [jax.random.randint(jax.random.key(i), (8, cfg.seq_len + 1), 0, 64)
             for i in range(2)]
  return step, state, batches


@pytest.fixture(scope="module")
def auto_step(tmp_path_factory):
  """One automatically planned step, shared (profiling costs seconds)."""
  cache = str(tmp_path_factory.mktemp("profiles"))
  step, state, batches = _gpt(optax.sgd(0.1))
  pstep = compare_steps(step, state, batches, num_microbatches=4, plan=harpjax.AutoPlan(
      profile=ProfileOptions(cache_dir=cache, progress=False)))
  return pstep, cache, (state, batches[0])


def test_auto_plan_matches_jit_and_describes_itself(auto_step):
  pstep, _, args = auto_step
  plan = pstep.plan(*args)
  assert plan.predicted_iteration_s > 0 and 0 < plan.eta <= 1 and plan.t_max_s > 0
  assert plan.num_layers == len(pstep.trace(*args).layers)
  assert plan.warmups is not None and plan.warmups[-1] == 1
  assert "predicted iteration" in plan.table() and "eta=" in plan.table()
  assert pstep.profile(*args).stats.unique_tasks > 0


def test_saved_plan_is_reused_without_planning(auto_step, tmp_path):
  pstep, _, args = auto_step
  path = tmp_path / "plan.json"
  pstep.plan(*args).save(path)
  step, state, batches = _gpt(optax.sgd(0.1))
  again = compare_steps(step, state, batches[:1], plan=str(path), num_microbatches=4)
  assert again.profile(*args) is None
  assert [s.layers for s in again.plan(*args).stages] == [
      s.layers for s in pstep.plan(*args).stages]
  assert again.plan(*args).warmups == pstep.plan(*args).warmups


def test_auto_plan_with_adam_keeps_the_loss(auto_step):
  _, cache, _ = auto_step
  # Adam divides by the root of the second moment, which turns the summation-order rounding
  # of small gradients into larger parameter differences than SGD's: 1.2e-5 was seen on one
  # CPU, so the bound is a little wider than the 1e-5 of the other comparisons.
  step, state, batches = _gpt(optax.adamw(1e-2, eps=1e-3))
  compare_steps(step, state, batches, num_microbatches=4, rtol=5e-5, plan=harpjax.AutoPlan(
      profile=ProfileOptions(cache_dir=cache, progress=False)))


def test_plan_cli(tmp_path):
  out = tmp_path / "plan.json"
  res = CliRunner().invoke(cli_main, [
      "plan", "--cluster", f"{CONFIGS}/case_study.yaml", "--model", "gpt-tiny", "-B", "8",
      "--cache-dir", str(tmp_path / "db"), "--no-progress", "--json", str(out)])
  assert res.exit_code == 0, res.output
  assert "Layer Range" in res.output and "predicted iteration" in res.output
  plan = harpjax.load_plan(out)
  assert plan.num_microbatches == 8 and plan.stages[0].layers[0] == 0
  assert dict(plan.meta)["model"] == "gpt-tiny"
  # The file says what it means: automatic layers (and their options), the microbatch the
  # times are for; auto_parallel(plan=file) follows it on those same layers.
  assert plan.layer_source == "auto" and plan.layer_options == harpjax.LayerOptions()
  assert plan.microbatch_size is not None and plan.remat == "none"
  from harpjax.models import BUILTIN_MODELS
  spec = BUILTIN_MODELS["gpt-tiny"](num_microbatches=8, abstract=True)
  pstep = harpjax.auto_parallel(spec.step_fn, cluster=f"{CONFIGS}/case_study.yaml",
                                plan=str(out))
  assert len(pstep.trace(*spec.args).layers) == plan.num_layers
  assert [s.layers for s in pstep.plan(*spec.args).stages] == [s.layers for s in plan.stages]


def test_plan_cli_bad_model(tmp_path):
  res = CliRunner().invoke(cli_main, ["plan", "--cluster", f"{CONFIGS}/case_study.yaml",
                                      "--model", "gpt-1t"])
  assert res.exit_code != 0 and "neither a built-in model" in res.output


def test_model_that_cannot_fit_is_explained(tmp_path):
  tiny = harpjax.Cluster.from_dict({
      "gpus": [{"name": "toy", "tflops": 1, "memory_gb": 0.0001, "mem_bandwidth_gbs": 10}],
      "subclusters": [{"name": "a", "gpu": "toy", "hosts": 1, "devices_per_host": 2,
                       "nics": [{"name": "e", "kind": "ethernet", "gbps": 10,
                                 "network": "n"}]}]})
  step, state, batches = _gpt(optax.sgd(0.1))
  pstep = harpjax.auto_parallel(step, cluster=tiny, num_microbatches=4, plan=harpjax.AutoPlan(
      profile=ProfileOptions(cache_dir=str(tmp_path), progress=False)))
  with pytest.raises(InfeasiblePlanError, match="memory"):
    pstep(state, batches[0])


def test_model_without_markers_plans_saves_and_reloads(tmp_path):
  """Automatic layers (no mark_layer_boundary anywhere): plan, save, reload, same numbers."""
  from harpjax.models import BUILTIN_MODELS
  spec = BUILTIN_MODELS["gpt-tiny"](num_microbatches=2, abstract=False)
  adam_state, batch = spec.args
  # This GPT has a key bias, whose exact gradient is zero: it starts at 0 and holds only
  # rounding noise, so its leaves are compared against a floor of 1e-4 (the weights' scale is
  # 1e-2); SGD keeps that noise from being normalised to O(lr) as Adam would.
  state = train_state.TrainState.create(apply_fn=adam_state.apply_fn, params=adam_state.params,
                                        tx=optax.sgd(0.1))
  opts = ProfileOptions(cache_dir=str(tmp_path / "db"), progress=False)
  pstep = compare_steps(spec.step_fn, state, [batch], plan=harpjax.AutoPlan(profile=opts),
                        num_microbatches=2, floor=1e-4)
  layers = pstep.trace(state, batch).layers
  assert len(layers) > 4 and "block" in str(layers)
  path = tmp_path / "plan.json"
  pstep.plan(state, batch).save(path)
  again = compare_steps(spec.step_fn, state, [batch], plan=str(path), num_microbatches=2,
                        floor=1e-4)
  assert again.profile(state, batch) is None
  assert again.plan(state, batch).stages == pstep.plan(state, batch).stages
