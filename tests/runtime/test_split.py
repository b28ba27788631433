"""Mixed-type stages: a stage split over groups of devices of two GPU types, each group on its
own share of every microbatch's rows, equals ``jax.jit`` in float64 (dropout included).

The plans put both stages on a V100 group and an A100 group with uneven shares (2 rows next to
6, 6 next to 2, a group with tensor parallelism), on the local and Ray runtimes; models: the
zoo's MLP with dropout in a Python loop and in an ``nn.scan``, a GPT with dropout, tied
embeddings (a parameter two stages read) and an averaged auxiliary output, and a model whose
mutable collection is a batch mean (an averaged auxiliary output of the loss).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import harpjax
from harpjax.compiler.plan import Plan, StageGroup, StageSpec, row_shares
from harpjax.errors import PlanError
from harpjax.models import GPT, GPTConfig
from tests import zoo
from tests.equivalence import DEMO_CLUSTER, cluster_yaml, max_rel_err

RTOL = 1e-12


def split_plan(num_layers: int, second_tp: bool = False) -> Plan:
  """Two stages, each on a V100 group and an A100 group of uneven shares."""
  half = num_layers // 2
  return dataclasses.replace(harpjax.ManualPlan([
      dict(layers=(0, half - 1), subcluster="v100", submesh=(1, 1), share=1,
           groups=[dict(subcluster="a100", submesh=(1, 2), share=2)]),
      dict(layers=(half, num_layers - 1), subcluster="v100", submesh=(1, 2), share=3,
           logical_mesh=(1, 2) if second_tp else (2, 1),
           groups=[dict(subcluster="a100", submesh=(1, 1), share=1)])]),
      layer_source="auto")


def run_both(step, state, batches, plan, B, extra=(), **kw):
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=B, plan=plan, **kw)
  ref = jax.jit(step)
  s_ref = s_par = state
  for i, batch in enumerate(batches):
    args = (batch,) + tuple(extra[i] if extra else ())
    out_ref, out_par = ref(s_ref, *args), pstep(s_par, *args)
    err = max_rel_err(out_ref, out_par)
    assert err <= RTOL, f"step {i}: {err:.3g}"
    s_ref, s_par = out_ref[0], out_par[0]
  return pstep


def _num_layers(step, state, batch, B, *extra):
  probe = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=B)
  return len(probe.trace(state, batch, *extra).layers)


@pytest.mark.parametrize("kind", ["loop", "scan"])
def test_split_stages_match_jit_float64(x64, kind):
  case = zoo.linen(kind)
  B = 2   # 8 rows per microbatch: stage 0 splits them 2 + 6, stage 1 6 + 2
  plan = split_plan(_num_layers(case.step, case.state, case.batches[0], B))
  pstep = run_both(case.step, case.state, case.batches[:2], plan, B)
  resolved = pstep.plan(case.state, case.batches[0])
  assert [s.group_rows(8) for s in resolved.stages] == [(2, 6), (6, 2)]
  # Every group ran on its own devices: 1 + 2 V100s, 2 + 1 A100s, none shared.
  devices = [d for s in resolved.stages for d in s.all_devices]
  assert len(devices) == len(set(devices)) == 6
  assert {g.subcluster for s in resolved.stages for g in s.all_groups} == {"v100", "a100"}


def test_split_stage_with_tensor_parallel_group_and_batch_mean_state(x64):
  case = zoo.batch_stats()
  B = 2
  plan = split_plan(_num_layers(case.step, case.state, case.batches[0], B), second_tp=True)
  run_both(case.step, case.state, case.batches[:2], plan, B)


def _gpt_case(batch=8):
  cfg = GPTConfig(vocab_size=64, seq_len=8, hidden=16, num_heads=2, num_blocks=2, dropout=0.1,
                  dtype="float64", param_dtype="float64")
  model = GPT(cfg)
  tokens = jax.random.randint(jax.random.key(0), (batch, cfg.seq_len), 0, cfg.vocab_size)
  params = model.init(jax.random.key(1), tokens)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(1e-2))

  def step(state, batch, rng):
    def loss_fn(p):
      logits = state.apply_fn(p, batch[:, :-1], train=True, rngs={"dropout": rng})
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
      return loss, {"logits_norm": jnp.mean(logits ** 2), "per_example": logits[:, 0, 0]}
    (loss, aux), grads = harpjax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss, aux

  batches = [jax.random.randint(jax.random.key(10 + i), (batch, cfg.seq_len + 1), 0,
                                cfg.vocab_size) for i in range(2)]
  rngs = [(jax.random.key(50 + i),) for i in range(2)]
  return step, state, batches, rngs


@pytest.mark.parametrize("runtime", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_split_gpt_with_dropout_and_aux_matches_jit_float64(x64, runtime):
  step, state, batches, rngs = _gpt_case()
  B = 1   # one microbatch of 8 rows
  L = _num_layers(step, state, batches[0], B, *rngs[0])
  plan = split_plan(L)
  kw = {"runtime": harpjax.RayRuntime(num_cpus=2)} if runtime == "ray" else {}
  run_both(step, state, batches, plan, B, extra=rngs, **kw)


# --------------------------------------------------------------------------- the plan type


def test_row_shares_are_proportional_in_whole_quanta():
  assert row_shares(7, [5, 2]) == (5, 2)
  assert row_shares(14, [5, 2]) == (10, 4)
  assert row_shares(8, [1, 2], [1, 2]) == (2, 6)
  assert row_shares(8, [3, 1], [2, 1]) == (6, 2)
  for rows in range(2, 40):
    for shares in ([1, 1], [5, 2], [3, 1, 2]):
      split = row_shares(rows, shares) if rows >= len(shares) else None
      if split is None:
        continue
      assert sum(split) == rows and min(split) >= 1
      exact = [rows * s / sum(shares) for s in shares]
      assert max(abs(a - b) for a, b in zip(split, exact)) < 1 + 1e-9
  with pytest.raises(PlanError, match="cannot be split"):
    row_shares(1, [5, 2])
  with pytest.raises(PlanError, match="cannot be split"):
    row_shares(5, [1, 1], [2, 2])


def test_split_stage_round_trips_through_a_plan_file(tmp_path):
  stage = StageSpec((0, 3), "a100", (1, 2), share=5, groups=(StageGroup("v100", (1, 1),
                                                                         share=2),))
  plan = Plan((stage, StageSpec((4, 5), "a100", (1, 1))))
  assert stage.num_devices == 3 and stage.mixed and not plan.stages[1].mixed
  path = tmp_path / "plan.json"
  plan.save(path)
  assert harpjax.load_plan(path) == plan
  assert "a100+v100 5:2" in plan.table()
  with pytest.raises(PlanError, match="groups\\[0\\].share"):
    Plan.from_json({"stages": [{"layers": [0, 1], "subcluster": "a", "submesh": [1, 1],
                                "groups": [{"subcluster": "b", "submesh": [1, 1],
                                            "share": 0}]}]})
  zeroed = StageSpec((0, 1), "a", (1, 2), zero=2, offload=True,
                     groups=(StageGroup("b", (1, 1)),))
  assert StageSpec.from_json(zeroed.to_json()) == zeroed


def test_split_stage_errors_name_what_to_change(x64):
  case = zoo.linen("loop")
  B = 8   # 2 rows per microbatch: the second stage's groups (quantum 2 and 1) cannot split
  L = _num_layers(case.step, case.state, case.batches[0], B)
  pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=B,
                                plan=split_plan(L))
  with pytest.raises(PlanError, match="cannot be split among the stage's groups"):
    pstep(case.state, case.batches[0])
  clash = split_plan(L)
  stages = list(clash.stages)
  stages[1] = dataclasses.replace(stages[1], devices=(0, 1))   # the first stage's V100
  pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=2,
                                plan=clash.with_stages(stages))
  with pytest.raises(PlanError, match="device 0"):
    pstep.plan(case.state, case.batches[0])
  np.testing.assert_equal(len(pstep.trace(case.state, case.batches[0]).layers), L)


ASYMMETRIC = cluster_yaml("asym8", (("a100", "A100-40G", 2, 2), ("v100", "V100-16G", 3, 1),
                                    ("t4", "T4", 1, 1)))


def test_planner_chooses_mixed_stages_and_they_train_like_jit(x64, tmp_path):
  # 4 A100 + 3 V100 + 1 T4 on a fast network: the automatic plan puts A100s and V100s in the
  # same stages (rows split by speed); the step equals jax.jit.
  path = tmp_path / "asym.yaml"
  path.write_text(ASYMMETRIC)
  step, state, batches, rngs = _gpt_case(batch=16)
  pstep = harpjax.auto_parallel(step, cluster=str(path), num_microbatches=2,
                                plan=harpjax.AutoPlan(solve=harpjax.SolveOptions(
                                    mixed_stages="on")))
  plan = pstep.plan(state, batches[0], *rngs[0])
  mixed = [s for s in plan.stages if s.mixed]
  assert mixed, plan
  assert all(len({g.subcluster for g in s.all_groups}) == 2 for s in mixed)
  assert all(len(set(s.group_rows(8))) > 1 for s in mixed), "uneven shares"
  out_ref = jax.jit(step)(state, batches[0], *rngs[0])
  assert max_rel_err(out_ref, pstep(state, batches[0], *rngs[0])) <= RTOL


def test_automatic_plan_falls_back_when_rows_cannot_split(x64, tmp_path, monkeypatch, caplog):
  # When the step cannot split a mixed stage's rows (simulated here), the automatic path plans
  # again without mixed stages, warns, and still trains like jax.jit.
  from harpjax.compiler.stages import compile as compile_lib

  def refuse(*a, **k):
    raise PlanError("stage 0 computes a value ... (a statistic over the batch)")
  monkeypatch.setattr(compile_lib, "split_stage", refuse)
  path = tmp_path / "asym.yaml"
  path.write_text(ASYMMETRIC)
  step, state, batches, rngs = _gpt_case(batch=16)
  pstep = harpjax.auto_parallel(step, cluster=str(path), num_microbatches=2,
                                plan=harpjax.AutoPlan(solve=harpjax.SolveOptions(
                                    mixed_stages="on")))
  out_ref = jax.jit(step)(state, batches[0], *rngs[0])
  assert max_rel_err(out_ref, pstep(state, batches[0], *rngs[0])) <= RTOL
  assert not any(s.mixed for s in pstep.plan(state, batches[0], *rngs[0]).stages)
  assert "planning without them" in caplog.text


def host_spanning_plan(num_layers: int) -> Plan:
  """Stage 0 on a V100 pair and an A100 group over both A100 hosts; stage 1 on V100s."""
  half = num_layers // 2
  return dataclasses.replace(harpjax.ManualPlan([
      dict(layers=(0, half - 1), subcluster="v100", submesh=(1, 2), share=1,
           groups=[dict(subcluster="a100", submesh=(2, 2), share=3)]),
      dict(layers=(half, num_layers - 1), subcluster="v100", submesh=(1, 2))]),
      layer_source="auto")


def test_group_over_two_hosts_runs_as_one_group_per_host(x64):
  case = zoo.linen("loop")
  B = 2
  plan = host_spanning_plan(_num_layers(case.step, case.state, case.batches[0], B))
  pstep = run_both(case.step, case.state, case.batches[:2], plan, B)
  stage = pstep.plan(case.state, case.batches[0]).stages[0]
  cluster = harpjax.Cluster.load(DEMO_CLUSTER)
  hosts = [{cluster.host_of_device(d).name for d in g.devices} for g in stage.all_groups]
  assert hosts == [{"v100-0"}, {"a100-0"}, {"a100-1"}]
  assert [g.submesh for g in stage.all_groups] == [(1, 2)] * 3
  assert [g.share for g in stage.all_groups] == [2, 3, 3]   # the A100 share, halved per host
  assert sum(stage.group_rows(8)) == 8


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_memory_model_of_each_group_of_a_mixed_stage(x64, zero):
  # Every group's peak per device, XLA's account of its executables beside the model: the
  # first group holds the optimizer state and runs the update, the others do not.
  from harpjax.compiler.stages import memory_report
  case = zoo.linen("loop")
  B = 2
  L = _num_layers(case.step, case.state, case.batches[0], B)
  plan = dataclasses.replace(harpjax.ManualPlan([
      dict(layers=(0, L // 2 - 1), subcluster="v100", submesh=(1, 2), share=1, zero=zero,
           groups=[dict(subcluster="a100", submesh=(1, 2), share=3)]),
      dict(layers=(L // 2, L - 1), subcluster="v100", submesh=(1, 2), zero=zero)]),
      layer_source="auto")
  pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=B, plan=plan)
  cs = pstep.compile(case.state, case.batches[0])
  home, other = memory_report(cs, 0, group=0), memory_report(cs, 0, group=1)
  assert home.opt_bytes > 0 and other.opt_bytes == 0
  assert any(k.startswith("update") for k in home.phases)
  assert not any(k.startswith("update") for k in other.phases)
  assert other.act_bytes > home.act_bytes   # 6 rows of every 8 against 2
  for r in (home, other):
    assert abs(r.error) <= 0.10, (r.phases, r.predicted)
  with pytest.raises(harpjax.errors.UnsupportedError, match="has 2 groups"):
    memory_report(cs, 0, group=2)


def test_split_stages_with_a_loss_normalised_by_the_batch_match_jit_float64(x64):
  # The token count is the whole batch's (computed before the pipeline); each group's part of
  # the masked sum comes out in mean-exact form for its own rows.
  case = zoo.masked_lm()
  B = 2
  plan = split_plan(_num_layers(case.step, case.state, case.batches[0], B))
  run_both(case.step, case.state, case.batches, plan, B)
