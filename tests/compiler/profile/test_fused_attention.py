"""Attention written with ``jax.nn.dot_product_attention``: cuDNN's fused kernel
(``implementation="cudnn"``) costed as one kernel on the GPU types that have it and as the XLA
composition on the others; the composition (``implementation=None``) costed as it is, on every
type."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

from harpjax import _compat
from harpjax.cluster import GPU_CATALOG, GPUType
from harpjax.compiler.profile import calibration as calib
from harpjax.models.gpt import Attention, GPTConfig

B, T, N, H = 2, 256, 4, 64          # sequences, length, heads, head size
ITEM = 2                            # fp16 bytes


def _attention_work(attention: str, causal_cfg: GPTConfig | None = None) -> calib.Work:
  """Forward+backward Work of one GPT attention (projections included) on ``[B, T, N*H]``
  fp16, read the way the default cost source reads a layer."""
  cfg = causal_cfg or GPTConfig(seq_len=T, hidden=N * H, num_heads=N, dtype="float16",
                                param_dtype="float16", layer_marks=0, attention=attention)
  from benchmarks.moe import module_work
  with _compat.tracing_cudnn_attention():
    return module_work(Attention(cfg), (B, T, N * H))


@pytest.fixture(scope="module")
def fused():
  return _attention_work("cudnn")


def test_fused_attention_flops_and_bytes_by_hand(fused):
  # causal, T == S: the kernel computes T (T + 1) / 2 query-key pairs per head; Q K^T and P V
  # are 2 FLOPs per multiply-add each: 4 B N pairs H forward, 2.5x that backward.
  pairs = T * (T + 1) / 2
  fwd = 4 * B * N * pairs * H
  assert fused.flash_flops == pytest.approx((fwd, 2.5 * fwd))
  # forward: reads Q, K, V, writes O and the softmax statistics (fp32 [B, N, T]);
  # backward: reads Q, K, V, O, dO and the statistics, writes dQ, dK, dV. No S x S scores.
  qkvo = B * T * N * H * ITEM
  lse = B * N * T * 4
  assert fused.flash_bytes == pytest.approx((4 * qkvo + lse, 5 * qkvo + lse + 3 * qkvo))
  # the projections are the only other matmuls: 4 forward; backward the output projection's
  # input and weight gradients and the weight gradients of Q, K, V (the input is the data)
  assert len(fused.heavy_flops) == 9
  assert fused.flops == pytest.approx(sum(fused.heavy_flops) + fused.light_flops
                                      + 3.5 * fwd)


def test_composition_is_what_implementation_xla_traces_to(fused):
  # A type without the kernel runs jax.nn.dot_product_attention's XLA composition: the Work
  # standing in for the fused calls is that program's, read the same way.
  xla = _attention_work("xla")
  assert not xla.flash_flops and xla.flash_composition is None
  unfused = fused.unfused()
  assert not unfused.flash_flops
  assert sorted(unfused.heavy_flops) == pytest.approx(sorted(xla.heavy_flops))
  assert unfused.flops == pytest.approx(xla.flops, rel=0.01)
  assert unfused.bytes == pytest.approx(xla.bytes, rel=0.05)
  # ... and it writes and reads the S x S scores: far more bytes than the fused kernel
  scores = B * N * T * T * 4
  comp = fused.flash_composition
  assert comp.light_bytes + sum(comp.heavy_bytes) > max(4 * scores, 10 * sum(fused.flash_bytes))


@pytest.mark.parametrize("name", ["A100-40G", "A40", "L40S", "H100-80G", "V100-16G", "T4"])
def test_per_type_switch(fused, name):
  g = GPU_CATALOG[name]
  eff = calib.efficiency_for(name)
  t = lambda w, f: float(calib.predict_time_s(w, g.peak_flops, g.mem_bandwidth_bytes_per_s,
                                               eff, fused_attention=f))
  got = float(calib.predict_time_s(fused, g.peak_flops, g.mem_bandwidth_bytes_per_s, eff,
                                   fused_attention=g.fused_attention))
  rest = dataclasses.replace(fused, flash_flops=(), flash_bytes=(), flash_composition=None)
  peak, bw = g.peak_flops * eff.compute, g.mem_bandwidth_bytes_per_s * eff.memory
  by_hand = t(rest, False) + sum(max(f / peak, b / bw) + eff.kernel_s
                                 for f, b in zip(fused.flash_flops, fused.flash_bytes))
  if name in ("V100-16G", "T4"):
    assert not g.fused_attention
    assert got == pytest.approx(t(fused.unfused(), False))
  else:
    assert g.fused_attention
    assert got == pytest.approx(by_hand)
  assert t(fused, True) == pytest.approx(by_hand)
  assert t(fused, True) < t(fused, False)


def test_catalog_capability():
  assert {n for n, g in GPU_CATALOG.items() if not g.fused_attention} == {
      "V100-16G", "V100-32G", "T4"}
  user = GPUType.from_units("mine", 100, 16, 900, 100)
  assert user.compute_capability is None and not user.fused_attention
  assert dataclasses.replace(user, compute_capability=8.0).fused_attention


def test_work_json_and_arithmetic_keep_the_fused_calls(fused):
  back = calib.Work.from_json(fused.to_json())
  assert back == fused
  half = fused.scaled(2)
  assert half.flash_flops == pytest.approx(tuple(f / 2 for f in fused.flash_flops))
  assert half.flash_composition.flops == pytest.approx(fused.flash_composition.flops / 2)
  two = fused + fused
  assert len(two.flash_flops) == 4
  assert two.flash_composition.flops == pytest.approx(2 * fused.flash_composition.flops)


def test_plain_attention_is_not_detected():
  einsum = _attention_work("einsum")
  assert not einsum.flash_flops and einsum.flash_composition is None


# --------------------------------------------------------------------------- on CPU


@pytest.mark.slow
def test_dot_product_attention_gpt_flops_within_3_percent_of_xla():
  """On CPU ``implementation=None`` is the XLA composition, costed as such: each stage's
  FLOPs against XLA's ``cost_analysis`` of the executables the runtime compiles."""
  import harpjax
  from harpjax.compiler.profile import ProfileOptions, stage_flops
  from harpjax.compiler.stages import compile_stage
  from benchmarks.lm_step import lm_train_step
  from tests.equivalence import DEMO_CLUSTER
  step_fn, state, tokens = lm_train_step(
      GPTConfig(vocab_size=256, seq_len=32, hidden=128, num_heads=4, num_blocks=2,
                dtype="float32", param_dtype="float32", attention="xla"), 8)
  step = harpjax.auto_parallel(step_fn, cluster=DEMO_CLUSTER, num_microbatches=2,
                               plan=harpjax.AutoPlan(profile=ProfileOptions(use_cache=False)))
  plan, prof = step.plan(state, tokens), step.profile(state, tokens)
  cs = step.compile(state, tokens)
  for spec, st in zip(plan.stages, cs.stages):
    compiled = compile_stage(st)
    xla = sum(float(compiled[k].cost_analysis()["flops"]) for k in ("fwd", "bwd"))
    costs = prof.costs[(spec.subcluster, tuple(spec.submesh), tuple(spec.logical_mesh))]
    tables = float(stage_flops(costs, plan.remat_of(spec))[spec.layers[0], spec.layers[1]])
    assert abs(tables / xla - 1) <= 0.03, (spec.layers, tables, xla)


@pytest.mark.slow
def test_mixtral_with_dot_product_attention_equals_jit(x64):
  """Mixtral with ``attention="xla"`` (routing per sequence: no example meets another) in
  float64 equals ``jax.jit`` of the batch."""
  from tests.models.test_moe_exactness import (BETWEEN_BLOCKS, RTOL, _mixtral, _run,
                                               _small)
  case = _mixtral(_small(routing_group="sequence", capacity_factor=1.0, attention="xla"))
  (err,), coupling, _ = _run(case, BETWEEN_BLOCKS, [jax.jit(case.step)])
  assert not coupling, coupling
  assert err <= RTOL, err


@pytest.mark.slow
def test_profile_costs_cudnn_attention_per_gpu_type():
  """The profiler's tables of a GPT written with cuDNN attention (traced without cuDNN):
  the A100 subcluster pays the fused kernel, the V100 one the composition (within 5% of the
  same GPT written with ``implementation=None``, the program it would run)."""
  import harpjax
  from harpjax.compiler.profile import ProfileOptions
  from harpjax.models import GPT
  from benchmarks.lm_step import lm_train_step
  from tests.equivalence import DEMO_CLUSTER
  cfg = GPTConfig(vocab_size=256, seq_len=512, hidden=256, num_heads=4, num_blocks=2,
                  dtype="float16", param_dtype="float16")
  step_fn, state, tokens = lm_train_step(cfg, 4)     # parameters of either: the same
  times = {}
  for att in ("cudnn", "xla"):
    st = state.replace(apply_fn=GPT(dataclasses.replace(cfg, attention=att)).apply)
    with _compat.tracing_cudnn_attention():
      step = harpjax.auto_parallel(
          step_fn, cluster=DEMO_CLUSTER, num_microbatches=2, batch_coupling="per_microbatch",
          plan=harpjax.AutoPlan(profile=ProfileOptions(use_cache=False)))
      prof = step.profile(st, tokens)
    for sub in ("a100", "v100"):
      times[att, sub] = np.asarray(prof.costs[(sub, (1, 1), (1, 1))]["time_s"])
  blocks = slice(1, 3)       # embedding | block | block | head
  assert np.all(times["cudnn", "a100"][blocks] < 0.9 * times["xla", "a100"][blocks])
  np.testing.assert_allclose(times["cudnn", "v100"][blocks], times["xla", "v100"][blocks],
                             rtol=0.05)
  for sub in ("a100", "v100"):   # embedding and head: no attention, the same
    np.testing.assert_allclose(times["cudnn", sub][[0, 3]], times["xla", sub][[0, 3]])
