"""Steps whose loss or model ties the examples of a batch together (``tests/zoo.py``, coupled
section): equal to ``jax.jit`` where microbatches can reproduce the batch (losses normalised by
the batch's token count, weights normalised over the batch), and, where they cannot (in-batch
contrastive losses, batch norm, capacity decided over the batch's tokens), equal to the
average of ``jax.jit`` on each microbatch with a ``BatchCouplingWarning`` naming the place."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import harpjax
from harpjax.compiler.trace import trace_step
from tests import zoo
from tests.equivalence import DEMO_CLUSTER, max_rel_err

RTOL = 1e-10
B = 4


def _two_stages(case) -> harpjax.Plan:
  probe = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=B,
                                batch_coupling="per_microbatch")
  n = len(probe.trace(case.state, case.batches[0]).layers)
  if n == 1:
    plan = harpjax.ManualPlan([((0, 0), "a100", (1, 2), (2, 1))])
  else:
    plan = harpjax.ManualPlan([((0, n // 2 - 1), "v100", (1, 2), (2, 1)),
                               ((n // 2, n - 1), "a100", (1, 2), (1, 2))])
  return dataclasses.replace(plan, layer_source="auto")


def _run(case, references, steps=2, **kwargs):
  """Runs the pipelined step and each reference from the case's state; returns the worst
  relative error against each reference and the coupling warnings seen."""
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=B,
                                  plan=_two_stages(case), **kwargs)
    states = [case.state] * (len(references) + 1)
    worst = [0.0] * len(references)
    for batch in case.batches[:steps]:
      out = pstep(states[0], batch)
      outs = [ref(s, batch) for ref, s in zip(references, states[1:])]
      for i, o in enumerate(outs):
        assert jax.tree_util.tree_structure(o) == jax.tree_util.tree_structure(out)
        worst[i] = max(worst[i], max_rel_err(o, out))
      states = [out[0]] + [o[0] for o in outs]
  coupling = [w for w in seen if issubclass(w.category, harpjax.BatchCouplingWarning)]
  return worst, coupling


def _jit_state_and_loss(step):
  """``jax.jit`` of the step, its aux outputs dropped (a coupled step's aux differ)."""
  return jax.jit(lambda s, b: (step(s, b)[0], step(s, b)[1][0]))


@pytest.mark.parametrize("name", ["masked_lm", "weighted_sequences"])
def test_batch_normalised_losses_equal_jit_float64(x64, name, **kwargs):
  case = zoo.COUPLED[name]()
  (err,), coupling = _run(case, [jax.jit(case.step)], **kwargs)
  assert not coupling, [str(w.message) for w in coupling]
  assert err <= RTOL, err


@pytest.mark.slow
def test_label_smoothing_equals_jit_float64(x64):
  test_batch_normalised_losses_equal_jit_float64(x64, "label_smoothing")


@pytest.mark.slow
def test_batch_normalised_loss_on_ray_equals_jit_float64(x64):
  # The whole batch's token count computed before the pipeline, sent to the stages' actors.
  test_batch_normalised_losses_equal_jit_float64(x64, "masked_lm", runtime=harpjax.RayRuntime(num_cpus=2))


def _coupled(name):
  case = zoo.COUPLED[name]()
  (err,), coupling = _run(case, [zoo.per_microbatch_reference(case, B)])
  assert len(coupling) == 1, [str(w.message) for w in coupling]
  assert err <= RTOL, err
  return str(coupling[0].message)


def test_in_batch_contrastive_loss_runs_per_microbatch_and_says_so(x64):
  message = _coupled("contrastive")
  assert "dot_general" in message and "zoo.py" in message and "in-batch" in message


def test_ntxent_with_targets_from_positions_runs_per_microbatch_and_says_so(x64):
  # Targets (arange(2n) + n) % 2n index the microbatch's own 2b rows (not refused), and the
  # two views concatenated along the batch are the microbatch's, as jax.jit of it has them.
  message = _coupled("ntxent")
  assert "concatenate" in message


def test_batch_norm_runs_per_microbatch_and_says_so(x64):
  message = _coupled("batch_norm")
  assert "BatchNorm" in message and "zoo.py" in message


@pytest.mark.slow
def test_moe_with_drops_runs_per_microbatch_and_says_so(x64):
  message = _coupled("moe_drops")
  assert "cumsum" in message and "Top2Experts" in message


def test_moe_capacity_from_the_batch_without_drops_equals_jit_and_per_microbatch(x64):
  # Capacity computed from the batch's tokens: its slots are not examples and are never
  # sliced; with every token fitting, no token depends on another, so jax.jit of the batch and
  # of each microbatch agree, and so does the pipeline (which says where tokens meet).
  case = zoo.moe_capacity(drops=False)
  (e_jit, e_mb), coupling = _run(case, [jax.jit(case.step),
                                        zoo.per_microbatch_reference(case, B)])
  assert len(coupling) == 1 and "cumsum" in str(coupling[0].message)
  assert e_jit <= RTOL and e_mb <= RTOL, (e_jit, e_mb)


# --------------------------------------------------------------------------- modes, refusals


def _trace(case, **kw):
  return trace_step(case.step, (case.state, case.batches[0]), num_microbatches=B, **kw)


def test_error_mode_refuses_a_coupled_step_and_names_the_place(x64):
  case = zoo.contrastive()
  with pytest.raises(harpjax.BatchCouplingError, match=r"dot_general at tests/zoo\.py:\d+"):
    _trace(case, batch_coupling="error")


def test_acknowledged_coupling_is_silent_and_exact_steps_pass_every_mode(x64):
  with warnings.catch_warnings():
    warnings.simplefilter("error", harpjax.BatchCouplingWarning)
    ts = _trace(zoo.contrastive(), batch_coupling="per_microbatch")
    assert ts.couplings and ts.output_flows[0].kind == "coupled"
    for mode in (None, "per_microbatch", "error"):
      assert not _trace(zoo.masked_lm(), batch_coupling=mode).couplings


def test_labels_from_the_data_that_index_the_batch_are_refused(x64):
  case = zoo.contrastive(labels_from_data=True)
  for mode in (None, "per_microbatch"):
    with pytest.raises(harpjax.BatchCouplingError, match="out of range"):
      _trace(case, batch_coupling=mode)


def test_batch_coupling_option_is_checked():
  with pytest.raises(harpjax.HarpjaxError, match="batch_coupling"):
    harpjax.auto_parallel(lambda s, b: s, cluster=DEMO_CLUSTER, num_microbatches=2,
                          batch_coupling="sometimes")


# --------------------------------------------------------------------------- the analysis


N, D, V = 8, 6, 5


def _step_of(loss_fn):
  def step(p, batch):
    loss, g = harpjax.value_and_grad(loss_fn)(p, batch)
    return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), loss
  return step


def _analysis(loss_fn, batch=None):
  w = jnp.ones((D, V), jnp.float32)
  batch = batch or {"x": jnp.ones((N, D)), "y": jnp.zeros((N,), jnp.int32),
                    "m": jnp.ones((N,))}
  return trace_step(_step_of(loss_fn), (w, batch), num_microbatches=2,
                    batch_coupling="per_microbatch")


def test_a_mean_loss_keeps_its_program_and_a_sum_loss_comes_out_mean_exact():
  ce = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(b["x"] @ p, b["y"])
  mean = _analysis(lambda p, b: ce(p, b).mean())
  assert mean.output_flows[0].kind == "sum" and not mean.couplings
  assert not mean.structure.rescales and not mean.structure.hoisted
  assert len(mean.region.ops) == len(mean.flow.mb.ops)   # nothing inserted
  total = _analysis(lambda p, b: ce(p, b).sum())
  assert len(total.structure.rescales) == 1   # the sum, times the number of microbatches
  per_example = _analysis(lambda p, b: jnp.sum(ce(p, b) / b["x"].shape[0]))
  assert not per_example.structure.rescales   # x / n with the batch's n: its scale is tracked


def test_a_denominator_from_the_data_is_hoisted_out_of_the_region():
  ts = _analysis(lambda p, b: jnp.sum(jax.nn.log_softmax(b["x"] @ p)[:, 0] * b["m"])
                 / jnp.sum(b["m"]))
  assert len(ts.structure.hoisted) == 1 and not ts.couplings
  hoisted = ts.inputs[-1]
  assert hoisted.kind == "whole"
  assert ts.outer.ops[ts.region_op - 1].name == "reduce_sum"   # computed before the region


def test_positions_index_the_microbatch_and_positions_as_data_are_the_batch():
  pick = _analysis(lambda p, b: -jax.nn.log_softmax(b["x"] @ p)[jnp.arange(b["x"].shape[0]),
                                                                 b["y"]].mean())
  assert not pick.couplings and not pick.regen_ops   # x[arange(n), y]: own rows, no redraw
  weighted = _analysis(lambda p, b: jnp.sum((b["x"] @ p)[:, 0] * jnp.arange(b["x"].shape[0])))
  assert not weighted.couplings
  assert any(op.name == "iota" for i, op in enumerate(weighted.region.ops)
             if i in weighted.regen_ops)   # the batch's positions, sliced per microbatch


@pytest.mark.parametrize("loss_fn, what", [
    (lambda p, b: jnp.max(b["x"] @ p), "maximum"),
    (lambda p, b: jnp.sum(jnp.cumsum(b["x"] @ p, axis=0)), "cumsum"),
    (lambda p, b: jnp.sum((b["x"] @ p)[::-1] * b["x"][:, :V]), "reverses"),
    (lambda p, b: jnp.var(b["x"] @ p), "statistic"),
    (lambda p, b: jnp.sum((b["x"] @ p)[0]), "some of the examples"),
    (lambda p, b: jnp.sum(b["x"] @ p) ** 2, "not linear"),
])
def test_couplings_are_found_and_named(loss_fn, what):
  ts = _analysis(loss_fn)
  assert ts.couplings, what
  assert what in " ".join(c.reason for c in ts.couplings), [c.reason for c in ts.couplings]
  assert ts.output_flows[0].kind == "coupled"


def test_a_constant_plus_a_mean_is_exact():
  ts = _analysis(lambda p, b: jnp.mean(b["x"] @ p) + 0.1 * jnp.sum(p ** 2))
  assert not ts.couplings and ts.output_flows[0].kind == "sum"


def test_flows_through_scan_and_custom_jvp_bodies():
  def loss(p, b):
    h = jax.nn.relu(b["x"] @ p)          # custom_jvp
    h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c), None), h, None, length=3)
    return jnp.mean(h)
  ts = _analysis(loss)
  assert not ts.couplings and ts.output_flows[0].kind == "sum"

  def coupled(p, b):
    h = b["x"] @ p
    h, _ = jax.lax.scan(lambda c, _: (c - jnp.mean(c, 0), None), h, None, length=2)
    return jnp.mean(h ** 2)
  assert _analysis(coupled).couplings


def test_a_microbatch_of_the_whole_batch_is_exact_whatever_the_step(x64):
  # One microbatch reproduces the batch: no warning even for batch statistics.
  case = zoo.batch_norm()
  with warnings.catch_warnings():
    warnings.simplefilter("error", harpjax.BatchCouplingWarning)
    ts = trace_step(case.step, (case.state, case.batches[0]), num_microbatches=1)
  assert ts.couplings   # known, for stages that would split the rows among groups
  np.testing.assert_equal(len(ts.region.ops), len(ts.flow.mb.ops))


def test_a_step_whose_structure_follows_the_batch_size_is_told():
  def loss(p, b):
    h = b["x"] @ p
    if b["x"].shape[0] > N // 2:   # only at the full batch
      h = jnp.tanh(h)
    return jnp.mean(h)
  with pytest.warns(harpjax.BatchCouplingWarning, match="not the same program"):
    ts = trace_step(_step_of(loss), (jnp.ones((D, V)), {"x": jnp.ones((N, D))}),
                    num_microbatches=2)
  assert ts.flow is None


def test_a_batch_size_written_as_a_number_is_a_clear_error():
  loss = lambda p, b: jnp.mean((b["x"] @ p) * jnp.arange(N)[:, None])
  with pytest.raises(harpjax.HarpjaxError, match="shapes must follow the batch"):
    trace_step(_step_of(loss), (jnp.ones((D, V)), {"x": jnp.ones((N, D))}),
               num_microbatches=2)


def test_fused_attention_keeps_each_example_apart_and_a_batch_mean_into_it_is_coupled():
  # cuDNN's fused attention (``implementation="cudnn"``, traced without cuDNN through the
  # compat shim) is one primitive per direction inside a custom_vjp: each example attends over
  # its own rows, as in the composition. A query shifted by the batch's mean is coupled.
  from harpjax import _compat
  H = 8

  def attend(centre):
    def loss(p, b):
      q = (b["x"] @ p)[:, None, None, :].astype(jnp.float16)     # (N, 1, 1, H)
      q = jnp.broadcast_to(q, (q.shape[0], 4, 1, H))              # (N, T=4, heads=1, H)
      if centre:
        q = q - jnp.mean(q, axis=0)
      out = jax.nn.dot_product_attention(q, q, q, implementation="cudnn")
      return jnp.mean(out.astype(jnp.float32) ** 2)
    return loss

  w = jnp.ones((D, H), jnp.float32)
  batch = {"x": jnp.ones((N, D)), "y": jnp.zeros((N,), jnp.int32), "m": jnp.ones((N,))}
  with _compat.tracing_cudnn_attention():
    plain, centred = (trace_step(_step_of(attend(c)), (w, batch), num_microbatches=2,
                                 batch_coupling="per_microbatch") for c in (False, True))
  assert "custom_vjp_call" in {op.name for op in plain.region.ops}
  assert not plain.couplings and plain.output_flows[0].kind == "sum"
  assert centred.couplings
