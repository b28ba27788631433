"""A lowered step (what a Ray worker receives) computes what the in-process step computes, bit
for bit, and survives pickling."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harpjax
from harpjax.compiler.stages import CompiledStep, LoweredStep
from harpjax.runtime import run_step
from tests.equivalence import DEMO_CLUSTER, max_rel_err
from tests.runtime.test_equivalence import GPT3, _gpt_setup


def _loaded(pstep, args) -> CompiledStep:
  """The step rebuilt from its lowered form, every stage on the devices the local step uses."""
  compiled = pstep.compile(*args)
  lowered = pickle.loads(pickle.dumps(pstep.lower(*args)))
  assert isinstance(lowered, LoweredStep)
  stages, group_fns = [], [None] * len(compiled.group_fns)
  for s, local in enumerate(compiled.stages):
    mine = lowered.for_stage(s)
    assert all(st is None for i, st in enumerate(mine.stages) if i != s)
    ex, groups = mine.load(s, list(local.mesh.devices.flat))
    assert ex.mesh.devices.shape == local.mesh.devices.shape
    stages.append(ex)
    for gi, fn in groups.items():
      assert group_fns[gi] is None, "a placement group has one home stage"
      group_fns[gi] = fn
  assert all(fn is not None for fn in group_fns), "every placement group is lowered"
  return CompiledStep(compiled.program, tuple(stages), tuple(group_fns))


def test_lowered_step_is_bitwise_the_local_step():
  step, state, batches, _ = _gpt_setup()
  rng = jax.random.key(7)
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=4, plan=GPT3)
  args = (state, batches[0], rng)
  loaded = _loaded(pstep, args)
  ref = run_step(pstep.compile(*args), args)
  out = run_step(loaded, args)
  assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(ref)
  for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(out)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # And both are the undecorated step.
  assert max_rel_err(jax.jit(step)(*args), out) <= 1e-5


def test_lowered_stage_refuses_a_stage_it_does_not_hold():
  step, state, batches, _ = _gpt_setup()
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=GPT3)
  args = (state, batches[0], jax.random.key(0))
  one = pstep.lower(*args).for_stage(1)
  with pytest.raises(ValueError, match="stage 0"):
    one.load(0, jax.devices()[:2])


def test_host_callback_cannot_be_lowered_and_says_so():
  from harpjax.errors import UnsupportedError
  from tests.test_api import PLAN, _setup
  step, state, batch = _setup()

  def printing_step(state, batch):
    def loss_fn(p):
      logits = state.apply_fn(p, batch["x"])
      jax.debug.print("logits {}", logits.sum())
      return jnp.mean(logits ** 2)
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  pstep = harpjax.auto_parallel(printing_step, cluster=DEMO_CLUSTER, num_microbatches=2,
                                plan=PLAN)
  with pytest.raises(UnsupportedError, match=r"stage \d+ .*runtime='local'"):
    pstep.lower(state, batch)
