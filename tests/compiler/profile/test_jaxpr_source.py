"""The jaxpr cost source: FLOPs, memory and plans against the XLA-compiled analytic source."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import harpjax
from harpjax.cluster import Cluster
from harpjax.compiler.layers import layers_for_step
from harpjax.compiler.plan import evaluate_plan, solve
from harpjax.compiler.profile import CACHE_DIR_ENV, estimate, pieces
from harpjax.compiler.profile import profiler as P
from harpjax.compiler.trace import mark_layer_boundary, trace_step
from harpjax.examples.demo import make_step
from harpjax.models import GPT, GPTConfig

SMALL = Cluster.simple([("v100", "V100-32G", 1, 2), ("a100", "A100-40G", 1, 2)])
B, D, K = 8, 32, 48   # microbatch, features in, features out


class _Dense(nn.Module):
  """Dense layers without bias, each followed by a ReLU and a layer cut."""

  @nn.compact
  def __call__(self, x):
    for i, f in enumerate((D, K, K)):
      x = mark_layer_boundary(nn.relu(nn.Dense(f, use_bias=False, name=f"dense_{i}")(x)))
    return x.sum()


def _dense_layers():
  model = _Dense()
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, D)))

  def step(params, x):
    loss, grads = harpjax.value_and_grad(lambda p: model.apply(p, x))(params)
    return jax.tree_util.tree_map(lambda a, g: a - g, params, grads), loss

  ts = trace_step(step, (params, jax.ShapeDtypeStruct((2 * B, D), jnp.float32)),
                  num_microbatches=2)
  return layers_for_step(ts)


def test_dense_layer_flops_are_the_formula():
  seq = _dense_layers()
  dep = pieces.batch_dependent(seq.program, seq.input_kinds)
  piece = pieces.build_piece(seq, 1, 1, dep)   # dense_1: [B, D] @ [D, K], then ReLU
  traced = estimate.trace_piece(piece)
  one = estimate.jaxpr_stats(traced, (1, 1))
  # forward x @ W, backward dL/dW = x^T g and dL/dx = g W^T: 3 matmuls of 2 B D K FLOPs each;
  # the ReLU and its gradient a few FLOPs per output element
  assert 6 * B * D * K <= one.flops <= 6 * B * D * K + 4 * B * K
  xla = pieces.xla_stats(piece, jax.devices()[:1])
  assert one.flops == pytest.approx(xla.flops, rel=0.02)
  # one data-parallel replica does half; tensor parallelism splits the matmuls
  assert estimate.jaxpr_stats(traced, (2, 1)).flops == pytest.approx(one.flops / 2)
  tp = estimate.jaxpr_stats(traced, (1, 2))
  assert 3 * B * D * K <= tp.flops <= 3 * B * D * K + 4 * B * K
  assert tp.num_params == D * K / 2 and one.num_params == D * K
  # residuals: the layer's input (kept for dL/dW), the ReLU's output and mask, as XLA keeps
  assert one.residual_bytes == xla.residual_bytes == B * D * 4 + B * K * (4 + 1)
  # rematerialised, only the input is kept, and the backward recomputes the forward's matmul
  remat = estimate.jaxpr_stats(estimate.trace_piece(piece, remat=True), (1, 1))
  xla_remat = pieces.xla_stats(piece, jax.devices()[:1], remat=True)
  assert remat.residual_bytes == B * D * 4 == xla_remat.residual_bytes
  assert 2 * B * D * K <= remat.flops - one.flops <= 2 * B * D * K + 4 * B * K
  # (XLA's account of the runtime's rematerialised stages: tests/compiler/profile/test_fidelity.py)


def _demo_args():
  cfg = GPTConfig(vocab_size=256, seq_len=32, hidden=64, num_heads=4, num_blocks=4,
                  dropout=0.1, layer_marks=2)
  model = GPT(cfg)
  state = jax.eval_shape(lambda: train_state.TrainState.create(
      apply_fn=model.apply, params=model.init(jax.random.key(0), jnp.zeros((16, 32), int)),
      tx=optax.adamw(3e-3)))
  return (state, jax.ShapeDtypeStruct((16, 33), jnp.int32),
          jax.eval_shape(lambda: jax.random.key(2)))


@pytest.fixture(scope="module")
def demo_profiles(tmp_path_factory):
  """The demo GPT costed by both sources (the compiled one takes seconds)."""
  cache = str(tmp_path_factory.mktemp("profiles"))
  return {src: P.profile_step(make_step(), _demo_args(), SMALL, num_microbatches=4,
                              options=P.ProfileOptions(source=src, cache_dir=cache,
                                                       progress=False))
          for src in ("jaxpr", "analytic")}


def test_jaxpr_source_compiles_nothing_and_traces_once(demo_profiles):
  st = demo_profiles["jaxpr"].stats
  assert st.unique_compiles == 0 and st.computed == st.unique_tasks
  assert not st.dp_approximated
  assert demo_profiles["analytic"].stats.unique_compiles > 0


def test_memory_model_is_the_compiled_one(demo_profiles):
  cheap, compiled = demo_profiles["jaxpr"].costs, demo_profiles["analytic"].costs
  assert cheap.keys() == compiled.keys()
  for key in cheap:
    a, b = cheap[key], compiled[key]
    # parameter state per device (tensor-parallel shards included) is exact
    np.testing.assert_allclose(a["param_mem_bytes"], b["param_mem_bytes"], rtol=1e-9)
    # residuals per in-flight microbatch: the same leaves, divided over dp and tp
    np.testing.assert_allclose(a["act_mem_bytes"], b["act_mem_bytes"], rtol=0.25)
    # the workspace is an estimate of XLA's buffer assignment
    assert np.all(a["temp_bytes"] <= 3 * b["temp_bytes"] + 1024)
    assert np.all(a["temp_bytes"] >= b["temp_bytes"] / 3 - 1024)
    np.testing.assert_allclose(a["time_s"], b["time_s"], rtol=0.05)
  one = cheap[("a100", (1, 1), (1, 1))]["act_mem_bytes"]
  dp2 = cheap[("a100", (1, 2), (2, 1))]["act_mem_bytes"]
  assert np.all(dp2[1:-1] < 0.6 * one[1:-1])


def test_plan_from_cheap_tables_is_as_good(demo_profiles):
  cheap, compiled = demo_profiles["jaxpr"].tables, demo_profiles["analytic"].tables
  B = 4
  plan_cheap = solve(cheap, B).plan
  plan_compiled = solve(compiled, B).plan
  on_compiled = evaluate_plan(compiled, plan_cheap, B)
  best = evaluate_plan(compiled, plan_compiled, B)
  assert on_compiled.feasible
  assert on_compiled.iteration_s <= 1.03 * best.iteration_s
  # the cheap tables predict what the compiled ones do for the plan they chose
  on_cheap = evaluate_plan(cheap, plan_cheap, B)
  assert on_cheap.iteration_s == pytest.approx(on_compiled.iteration_s, rel=0.03)


def test_auto_parallel_plans_with_the_jaxpr_source(monkeypatch, tmp_path):
  assert P.ProfileOptions().source == "jaxpr"

  def no_compiling(*args, **kwargs):
    raise AssertionError("the default profile compiled a layer")
  monkeypatch.setattr(pieces, "xla_stats", no_compiling)
  monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
  step = harpjax.auto_parallel(make_step(), cluster=SMALL, num_microbatches=4)
  args = _demo_args()
  plan = step.plan(*args)
  assert plan.predicted_iteration_s > 0
  assert step.profile(*args).stats.unique_compiles == 0
