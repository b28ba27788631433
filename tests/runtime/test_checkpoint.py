"""Checkpoints: atomic, checked on restore, periodic from the step, plan-independent."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import harpjax
from harpjax.errors import HarpjaxError
from harpjax.runtime import CheckpointError, CheckpointOptions, Checkpointer
from harpjax.runtime.handles import load_tree, save_tree
from tests import zoo
from tests.equivalence import DEMO_CLUSTER, max_rel_err


def _state():
  params = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4)}
  tx = optax.adamw(1e-2)
  return (params, tx.init(params), jax.random.key(3), jnp.int32(7))


def test_roundtrip_keeps_newest_and_types(tmp_path):
  state = _state()
  with Checkpointer(tmp_path / "ck", keep=2) as ckpt:
    for step in (1, 2, 3):
      bumped = jax.tree_util.tree_map(
          lambda x: x + step if jnp.issubdtype(x.dtype, jnp.floating) else x, state,
          is_leaf=lambda x: hasattr(x, "dtype") and not jnp.issubdtype(x.dtype, jnp.floating))
      ckpt.save(step, bumped)
    assert ckpt.steps() == [2, 3]
    back = ckpt.restore(state)
  assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(state)
  assert max_rel_err(back, bumped) == 0.0
  np.testing.assert_array_equal(jax.random.key_data(back[2]), jax.random.key_data(state[2]))


@pytest.mark.parametrize("change", ["shape", "dtype", "structure"])
def test_restore_names_the_differing_leaf(tmp_path, change):
  state = _state()
  harpjax.save_checkpoint(tmp_path / "ck", state, step=5)
  params = dict(state[0])
  if change == "shape":
    params["b"] = jnp.ones(5)
  elif change == "dtype":
    params["b"] = jnp.ones(4, jnp.int32)
  else:
    params["c"] = jnp.ones(1)
  with pytest.raises(CheckpointError, match=r"step 5" + (r".*\['b'\]" if change != "structure"
                                                         else "")):
    harpjax.restore_checkpoint(tmp_path / "ck", (params,) + state[1:])


def test_restore_without_checkpoint_and_bad_directory(tmp_path):
  with pytest.raises(CheckpointError, match="no complete checkpoint"):
    harpjax.restore_checkpoint(tmp_path / "empty", _state())
  with pytest.raises(CheckpointError, match="does not exist"):
    Checkpointer(tmp_path / "missing" / "deeper")
  with pytest.raises(CheckpointError, match="every"):
    CheckpointOptions(str(tmp_path), every=0)


_KILLED_SAVE = textwrap.dedent("""
    import sys, numpy as np
    from harpjax.runtime import Checkpointer
    ckpt = Checkpointer(sys.argv[1], keep=None)
    ckpt.save(1, {"x": np.ones(8)})
    print("saved 1", flush=True)
    ckpt.save(2, {"x": np.full((4096, 4096), 2.0)})   # killed while this is written
    ckpt.close()
    print("saved 2", flush=True)
""")


def test_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
  # The child is killed as soon as it reports checkpoint 1; the write of checkpoint 2 is cut at
  # whatever point it reached (or had finished): either way the newest complete checkpoint
  # restores, and an incomplete one is never listed.
  directory = str(tmp_path / "ck")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, directory], env=env,
                          stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "saved 1"
    proc.kill()
  finally:
    proc.wait(timeout=120)
  with Checkpointer(directory, keep=None) as ckpt:
    steps = ckpt.steps()
    assert steps and steps[0] == 1
    back = ckpt.restore({"x": np.ones((4096, 4096)) if steps[-1] == 2 else np.ones(8)})
  assert float(np.asarray(back["x"]).ravel()[0]) == float(steps[-1])


_EXIT_AFTER_ASYNC_SAVE = textwrap.dedent("""
    import sys, numpy as np
    from harpjax.runtime import Checkpointer
    ckpt = Checkpointer(sys.argv[1], keep=None, asynchronous=True)
    ckpt.save(1, {"x": np.full((1024, 1024), 1.0)})
    ckpt.save(2, {"x": np.full((1024, 1024), 2.0)})
    print("returned", flush=True)                       # ... and the script ends at once
""")


def test_script_ending_right_after_an_asynchronous_save_completes_it(tmp_path):
  directory = str(tmp_path / "ck")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-c", _EXIT_AFTER_ASYNC_SAVE, directory], env=env,
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
  with Checkpointer(directory, keep=None) as ckpt:
    assert ckpt.steps() == [1, 2]
    assert float(np.asarray(ckpt.restore({"x": np.ones((1024, 1024))})["x"])[3, 3]) == 2.0


def test_save_tree_is_atomic_and_load_tree_checks(tmp_path, monkeypatch):
  path = tmp_path / "state.npz"
  state = {"w": jnp.ones((2, 3)), "k": jax.random.key(1)}
  save_tree(path, state)
  before = path.read_bytes()

  def broken(f, **arrays):
    f.write(b"partial")
    raise KeyboardInterrupt
  monkeypatch.setattr(np, "savez", broken)
  with pytest.raises(KeyboardInterrupt):
    save_tree(path, {"w": jnp.zeros((2, 3)), "k": jax.random.key(2)})
  monkeypatch.undo()
  assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["state.npz"]
  assert float(load_tree(path, state)["w"][0, 0]) == 1.0
  with pytest.raises(HarpjaxError, match=r"\['w'\] is float32\[2, 3\] in the file but"):
    load_tree(path, {"w": jnp.ones((3, 3)), "k": jax.random.key(1)})
  path.write_bytes(before[: len(before) // 3])
  with pytest.raises(HarpjaxError, match="not a complete saved state"):
    load_tree(path, state)


def test_periodic_checkpoints_resume_on_another_plan_and_on_jit(x64, tmp_path):
  case = zoo.linen("loop")
  batches = zoo._batches(5)
  plan_a = harpjax.ManualPlan([((0, 0), "v100", (1, 2), (2, 1))])
  step_a = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=4,
                                 plan=plan_a, checkpoint=CheckpointOptions(
                                     str(tmp_path / "ck"), every=2, keep=2))
  ref = jax.jit(case.step)
  s_ref = s_par = case.state
  for batch in batches[:4]:
    s_ref, s_par = ref(s_ref, batch)[0], step_a(s_par, batch)[0]
  step_a.checkpointer.wait()
  assert step_a.checkpointer.steps() == [2, 4]
  # Resume from step 4 on a two-stage plan, and under plain jax.jit: both equal the reference.
  plan_b = harpjax.ManualPlan([((0, 0), "a100", (1, 2), (1, 2))])
  step_b = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=2,
                                 plan=plan_b, checkpoint=str(tmp_path / "ck"))
  resumed = step_b.restore(like=case.state)
  assert step_b.steps_done == 4
  assert max_rel_err(resumed, s_ref) <= 1e-12
  out_b = step_b(resumed, batches[4])
  out_jit = ref(harpjax.restore_checkpoint(tmp_path / "ck", case.state), batches[4])
  out_ref = ref(s_ref, batches[4])
  assert max_rel_err(out_b, out_ref) <= 1e-10 and max_rel_err(out_jit, out_ref) <= 1e-10
  step_b.checkpointer.wait()
  assert step_b.checkpointer.steps() == [2, 4, 5]


def test_replan_moves_the_step_to_another_cluster(x64):
  """A user-initiated change of cluster: the step re-plans on the new one (automatically) and
  training continues exactly as ``jax.jit``'s."""
  case = zoo.linen("loop")
  batches = zoo._batches(3)
  step = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=2)
  ref = jax.jit(case.step)
  s_ref = s_par = case.state
  s_ref, s_par = ref(s_ref, batches[0])[0], step(s_par, batches[0])[0]
  before = step.plan(s_par, batches[1])
  smaller = step.cluster.without_hosts(["a100-0", "a100-1"])   # the V100 host only
  s_par = step.replan(smaller, s_par)
  assert step.cluster.num_devices == 4 and step.replan(smaller) is None
  for batch in batches[1:]:
    out_ref, out_par = ref(s_ref, batch), step(s_par, batch)
    assert max_rel_err(out_par, out_ref) <= 1e-10
    s_ref, s_par = out_ref[0], out_par[0]
  after = step.plan(s_par, batches[2])
  assert {s.subcluster for s in after.stages} == {"v100"} != {s.subcluster
                                                              for s in before.stages}
