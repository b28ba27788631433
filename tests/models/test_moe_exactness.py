"""The MoE models trained through ``auto_parallel`` (local runtime, pipeline plans with
microbatches, one plan splitting the MoE blocks across stages) against ``jax.jit`` in float64.

Where routing couples the examples of a microbatch (capacity and positions decided over the
batch's tokens, the load-balancing loss over them) the reference is ``jax.jit`` of each
microbatch and harpjax says so; where every example routes on its own (groups of one
sequence, the interleaved model) the reference is ``jax.jit`` of the whole batch and nothing is
reported; with nothing dropped and no auxiliary loss both references agree.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import harpjax
from harpjax.models import MoEConfig, MoETransformer, gpt
from harpjax.models.mixtral import Mixtral, MixtralConfig, mixtral_loss
from tests import zoo
from tests.equivalence import DEMO_CLUSTER, max_rel_err

RTOL = 1e-10
B = 4          # microbatches
ROWS = 8       # sequences per batch

# Mixtral, 2 blocks: layers embed 0 · block_0 1-3 · block_1 4-6 · head 7; in each block
# attention | output projection | routed experts.
BETWEEN_BLOCKS = harpjax.ManualPlan([((0, 3), "v100", (1, 2), (2, 1)),
                                     ((4, 7), "a100", (1, 2), (1, 2))])
INSIDE_BLOCKS = harpjax.ManualPlan([((0, 2), "v100", (1, 2), (2, 1)),
                                    ((3, 5), "v100", (1, 2), (1, 2)),
                                    ((6, 7), "a100", (1, 2), (2, 1))])


def _small(**kw) -> MixtralConfig:
  fields = dict(vocab_size=64, seq_len=8, hidden=16, num_heads=4, num_kv_heads=2,
                num_blocks=2, ffn_hidden=24, num_experts=4, top_k=2, dtype="float64",
                param_dtype="float64")
  return MixtralConfig(**{**fields, **kw})


def _case(model, loss, seq_len: int, vocab: int, seed: int = 0) -> zoo.CoupledCase:
  """A train step over ``(params, {}, adam state)`` in float64, in the zoo's form."""
  rng = np.random.default_rng(seed)
  batches = [{"tokens": jnp.asarray(rng.integers(0, vocab, (ROWS, seq_len)), jnp.int32),
              "labels": jnp.asarray(rng.integers(0, vocab, (ROWS, seq_len)), jnp.int32)}
             for _ in range(2)]
  shapes = jax.eval_shape(model.init, jax.random.key(0), batches[0]["tokens"])["params"]
  params = jax.tree_util.tree_map(
      lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.3, jnp.float64), shapes)
  tx = optax.adam(1e-2)

  def loss_fn(p, extra, batch):
    return loss(model.apply({"params": p}, batch["tokens"]), batch["labels"]), (extra, {})

  def step(state, batch):
    p, extra, opt = state
    (value, (extra, aux)), grads = harpjax.value_and_grad(
        lambda q: loss_fn(q, extra, batch), has_aux=True)(p)
    updates, opt = tx.update(grads, opt, p)
    return (optax.apply_updates(p, updates), extra, opt), (value, aux)
  return zoo.CoupledCase(step, (params, {}, tx.init(params)), batches, loss_fn, tx, exact=False)


def _mixtral(cfg: MixtralConfig) -> zoo.CoupledCase:
  return _case(Mixtral(cfg), lambda out, y: mixtral_loss(out, y, cfg.aux_loss_coef),
               cfg.seq_len, cfg.vocab_size)


def _run(case, plan, references, steps=2):
  """Worst relative error of the pipelined step against each reference over ``steps`` steps,
  and the coupling warnings."""
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=B,
                                  plan=dataclasses.replace(plan, layer_source="auto"))
    states = [case.state] * (len(references) + 1)
    worst = [0.0] * len(references)
    for batch in case.batches[:steps]:
      out = pstep(states[0], batch)
      outs = [ref(s, batch) for ref, s in zip(references, states[1:])]
      for i, o in enumerate(outs):
        worst[i] = max(worst[i], max_rel_err(o, out))
      states = [out[0]] + [o[0] for o in outs]
  layers = pstep.trace(case.state, case.batches[0]).layers
  coupling = [str(w.message) for w in seen if issubclass(w.category, harpjax.BatchCouplingWarning)]
  return worst, coupling, layers


def _routed_layers(layers) -> list[int]:
  return [l.index for l in layers if layers.modules[l.module_index].routed]


@pytest.mark.slow
def test_mixtral_routed_per_sequence_equals_jit_of_the_batch(x64):
  # Capacity drops and the auxiliary loss decided per sequence: no example meets another, so
  # the pipeline equals jax.jit of the whole batch, and nothing is reported.
  case = _mixtral(_small(routing_group="sequence", capacity_factor=1.0))
  (err,), coupling, layers = _run(case, BETWEEN_BLOCKS, [jax.jit(case.step)])
  assert not coupling, coupling
  assert err <= RTOL, err
  assert len(layers) == 8 and _routed_layers(layers) == list(range(1, 7))


@pytest.mark.slow
def test_mixtral_routed_per_sequence_split_inside_blocks_equals_jit(x64):
  case = _mixtral(_small(routing_group="sequence", capacity_factor=1.0, top_k=1))
  (err,), coupling, _ = _run(case, INSIDE_BLOCKS, [jax.jit(case.step)])
  assert not coupling, coupling
  assert err <= RTOL, err


@pytest.mark.slow
@pytest.mark.parametrize("plan", [BETWEEN_BLOCKS, INSIDE_BLOCKS], ids=["between", "inside"])
def test_mixtral_routed_over_the_batch_equals_jit_per_microbatch_and_says_so(x64, plan):
  # Capacity 1.0 over the microbatch's 16 tokens drops some, and the load-balancing loss is a
  # product of means over them: each microbatch routes its own tokens, as jax.jit of it does.
  cfg = _small(capacity_factor=1.0)
  case = _mixtral(cfg)
  (err,), coupling, _ = _run(case, plan, [zoo.per_microbatch_reference(case, B)])
  # Named: the positions in the experts and the auxiliary loss's product of two means.
  assert len(coupling) == 1, coupling
  assert "cumsum" in coupling[0] and "(route) in Mixtral/block_0/moe" in coupling[0]
  assert "multiplies two sums over the examples" in coupling[0]
  assert err <= RTOL, err
  # The whole batch routes differently: the reference is not the same as jax.jit of it.
  full = jax.jit(case.step)(case.state, case.batches[0])
  per_mb = zoo.per_microbatch_reference(case, B)(case.state, case.batches[0])
  assert max_rel_err(full, per_mb) > 1e-6


@pytest.mark.slow
def test_mixtral_without_drops_or_aux_loss_equals_jit_and_per_microbatch(x64):
  # Nothing dropped (capacity = the group's tokens) and no auxiliary loss: no token depends on
  # another, so both references agree; the analysis still sees the cumulative sum over the
  # batch's tokens and says so (docs/microbatches.md, "Limits").
  case = _mixtral(_small(capacity_factor=None, aux_loss_coef=0.0))
  (e_jit, e_mb), coupling, _ = _run(case, INSIDE_BLOCKS,
                                    [jax.jit(case.step), zoo.per_microbatch_reference(case, B)])
  assert len(coupling) == 1 and "cumsum" in coupling[0], coupling
  assert e_jit <= RTOL and e_mb <= RTOL, (e_jit, e_mb)


# The interleaved model, 4 blocks: embed 0 · DenseBlock 1-3 · MoEBlock 4-6 · DenseBlock 7-9 ·
# MoEBlock 10-12 · ln_f 13.
INTERLEAVED_BETWEEN = harpjax.ManualPlan([((0, 6), "v100", (1, 2), (2, 1)),
                                          ((7, 13), "a100", (1, 2), (1, 2))])
INTERLEAVED_INSIDE = harpjax.ManualPlan([((0, 4), "v100", (1, 2), (2, 1)),
                                         ((5, 10), "v100", (1, 2), (1, 2)),
                                         ((11, 13), "a100", (1, 2), (2, 1))])


def _interleaved(**kw) -> zoo.CoupledCase:
  cfg = MoEConfig(vocab_size=64, seq_len=8, hidden=16, num_heads=4, num_blocks=4,
                  dtype="float64", param_dtype="float64", key_bias=False, layer_marks=0,
                  num_experts=4, **kw)
  return _case(MoETransformer(cfg), gpt.lm_loss, cfg.seq_len, cfg.vocab_size)


@pytest.mark.slow
@pytest.mark.parametrize("plan", [INTERLEAVED_BETWEEN, INTERLEAVED_INSIDE],
                         ids=["between", "inside"])
def test_interleaved_moe_equals_jit_of_the_batch(x64, plan):
  # Top-1 routing per sequence with capacity 0.5 (drops), no auxiliary loss: exact.
  case = _interleaved(capacity_factor=0.5)
  (err,), coupling, layers = _run(case, plan, [jax.jit(case.step)])
  assert not coupling, coupling
  assert err <= RTOL, err
  assert [m.name for m in layers.routed_modules()] == ["MoEBlock"] * 2
  assert [l.index for l in layers if layers.modules[l.module_index].routed] == \
      [4, 5, 6, 10, 11, 12]
