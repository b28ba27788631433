"""Checkpoints: atomic, checked on restore, periodic from the step, plan-independent."""

from __future__ import annotations

import logging
import os
import shutil
import signal
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
from harpjax.runtime import CheckpointError, CheckpointOptions, Checkpointer, save_checkpoint
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


# --------------------------------------------------------------------------- faults


@pytest.mark.parametrize("when", ["commit", "prune"])
def test_ctrl_c_during_a_synchronous_save_then_retry_continues(x64, tmp_path, monkeypatch,
                                                               sigint, when):
  # Ctrl-C arrives while the call of step 2 waits for its checkpoint: the moment checkpoint 2
  # is renamed into place ("commit"), or while checkpoint 1 is removed after it (keep=1,
  # "prune"). KeyboardInterrupt, and retrying that call continues exactly: the checkpoint on
  # disk already holds its state, the step counts once, one checkpoint is kept.
  case = zoo.linen("loop")
  batches = zoo._batches(4)
  step = harpjax.auto_parallel(
      case.step, cluster=DEMO_CLUSTER, num_microbatches=2,
      plan=harpjax.ManualPlan([((0, 0), "v100", (1, 2), (2, 1))]),
      checkpoint=CheckpointOptions(str(tmp_path / "ck"), every=1, keep=1, asynchronous=False))
  module, name, target = (os, "rename", "2") if when == "commit" else (shutil, "rmtree", "1")
  real, armed = getattr(module, name), [True]

  def interrupted(path, *args, **kwargs):
    out = real(path, *args, **kwargs)
    if armed[0] and os.path.basename(os.fspath(args[0] if args else path)).split(".")[0] == \
        target:
      armed[0] = False
      os.kill(os.getpid(), signal.SIGINT)
    return out

  monkeypatch.setattr(module, name, interrupted)
  ref = jax.jit(case.step)
  s_par = s_ref = case.state
  interrupted_calls = 0
  for batch in batches:
    while True:
      try:
        s_par = step(s_par, batch)[0]
        break
      except KeyboardInterrupt:
        interrupted_calls += 1
    s_ref = ref(s_ref, batch)[0]
  monkeypatch.undo()
  assert interrupted_calls == 1 and not armed[0]
  assert step.steps_done == 4
  step.checkpointer.wait()
  assert sorted(os.listdir(tmp_path / "ck")) == ["4"]
  assert max_rel_err(s_par, s_ref) <= 1e-10
  assert max_rel_err(harpjax.restore_checkpoint(tmp_path / "ck", case.state), s_par) == 0.0


@pytest.mark.parametrize("where", ["before the thread starts", "inside Thread.start"])
def test_ctrl_c_while_the_disk_thread_starts_then_retry(tmp_path, monkeypatch, where):
  # Ctrl-C while the checkpointer starts its disk thread (a restore's read, an asynchronous
  # save's write): KeyboardInterrupt, and the next call runs the work queued (it used to find
  # a thread object never started: "cannot join thread before it is started", or a wait
  # forever for a job no thread runs).
  import threading
  state = _state()
  real_start, armed = threading.Thread.start, []

  def start(self):
    if self.name == "harpjax-checkpoint" and armed:
      armed.pop()
      if where == "inside Thread.start":
        real_start(self)
      raise KeyboardInterrupt
    return real_start(self)

  monkeypatch.setattr(threading.Thread, "start", start)
  with Checkpointer(tmp_path / "ck", keep=None) as ckpt:
    ckpt.save(1, state)
    armed.append(True)
    with pytest.raises(KeyboardInterrupt):
      ckpt.restore_newest(state)
    step, back = ckpt.restore_newest(state)
    assert step == 1 and max_rel_err(back, state) == 0.0
  with Checkpointer(tmp_path / "ck", keep=None, asynchronous=True) as ckpt:
    armed.append(True)
    with pytest.raises(KeyboardInterrupt):
      ckpt.save(2, state)
    ckpt.save(2, state)   # the retry: the interrupted write, queued, runs first
    ckpt.wait()
    assert ckpt.steps() == [1, 2]
    assert max_rel_err(ckpt.restore(state, step=2), state) == 0.0
  for t in threading.enumerate():   # each ends once its work is done (a bound: 60 s)
    if t.name == "harpjax-checkpoint":
      t.join(60)
  assert not [t for t in threading.enumerate() if t.name == "harpjax-checkpoint"]
  assert sorted(os.listdir(tmp_path / "ck")) == ["1", "2"]


def _damage(path, kind: str) -> None:
  """Damages checkpoint directory ``path`` as ``kind`` says."""
  files = sorted((os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs),
                 key=os.path.getsize)
  data = [f for f in files if os.sep + "arrays" + os.sep in f and os.sep + "d" + os.sep in f]
  if kind == "empty directory":
    shutil.rmtree(path)
    os.mkdir(path)
  elif kind == "no arrays":
    shutil.rmtree(os.path.join(path, "arrays"))
  elif kind == "meta not JSON":
    with open(os.path.join(path, "meta", "metadata"), "w") as f:
      f.write("{not json")
  elif kind == "meta missing":
    os.remove(os.path.join(path, "meta", "metadata"))
  elif kind == "array data truncated":   # every data file: the read cannot miss the damage
    for name in data:
      with open(name, "r+b") as f:
        f.truncate(os.path.getsize(name) // 2)
  elif kind == "array data flipped":
    for f in data:   # the same length, other bytes: only the checksum can tell
      blob = bytearray(open(f, "rb").read())
      blob[len(blob) // 2] ^= 0xFF
      open(f, "wb").write(bytes(blob))
  elif kind == "every file empty":
    for f in files:
      open(f, "w").close()
  elif kind == "a file":
    shutil.rmtree(path)
    open(path, "w").close()
  else:
    raise ValueError(kind)


DAMAGE = ["empty directory", "no arrays", "meta not JSON", "meta missing",
          "array data truncated", "array data flipped", "every file empty", "a file"]


def test_restore_skips_a_damaged_newest_checkpoint_with_one_warning(tmp_path, caplog):
  state = _state()
  bumped = lambda k: jax.tree_util.tree_map(
      lambda x: x + k if jnp.issubdtype(x.dtype, jnp.floating) else x, state,
      is_leaf=lambda x: hasattr(x, "dtype") and not jnp.issubdtype(x.dtype, jnp.floating))
  with Checkpointer(tmp_path / "good", keep=None) as ckpt:
    for k in (1, 2, 3):
      ckpt.save(k, bumped(k))
  for kind in DAMAGE:
    where = tmp_path / kind.replace(" ", "_")
    shutil.copytree(tmp_path / "good", where)
    _damage(str(where / "3"), kind)
    caplog.clear()
    with Checkpointer(where, keep=None) as ckpt:
      step, back = ckpt.restore_newest(state)
      with pytest.raises(CheckpointError, match="step 3 is damaged"):
        ckpt.restore(state, step=3)
    assert step == 2 and max_rel_err(back, bumped(2)) == 0.0, kind
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "step 3 (" in warned[0].getMessage(), (kind, caplog.text)
    with Checkpointer(where, keep=None) as ckpt:   # training goes on: step 3 is written again
      ckpt.save(3, bumped(3))
      assert max_rel_err(ckpt.restore(state), bumped(3)) == 0.0, kind
    assert sorted(os.listdir(where)) == ["1", "2", "3"], kind


def test_abandoned_reads_of_a_damaged_checkpoint_are_not_reported_again(tmp_path, caplog):
  # A read that fails half-way leaves others in flight; one that fails too is reported by
  # asyncio when its future is collected ("Future exception was never retrieved", often at
  # exit), after the one warning naming the damaged checkpoint: that report is dropped, and
  # only for that checkpoint.
  import asyncio
  import gc
  state = _state()
  with Checkpointer(tmp_path / "ck", keep=None) as ckpt:
    ckpt.save(1, state)
    ckpt.save(2, state)
  _damage(str(tmp_path / "ck" / "2"), "array data truncated")
  with Checkpointer(tmp_path / "ck", keep=None) as ckpt:
    assert ckpt.restore_newest(state)[0] == 1

  def collected(message):
    loop = asyncio.new_event_loop()
    fut = loop.create_future()
    fut.set_exception(ValueError(message))
    loop.close()
    del fut
    gc.collect()

  caplog.clear()
  collected(f'DATA_LOSS: Error reading local file "{tmp_path / "ck" / "2" / "arrays" / "d"}"')
  assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
  collected(f'DATA_LOSS: Error reading local file "{tmp_path / "elsewhere"}"')
  assert [r for r in caplog.records if r.name == "asyncio"], caplog.text
  # a task wrapping such a read says "Task exception was never retrieved"
  caplog.clear()
  err = ValueError(f'OUT_OF_RANGE: Error reading "leaf_00002/.zarray" at local file '
                   f'"{tmp_path / "ck" / "2" / "arrays"}/"')
  logging.getLogger("asyncio").error("Task exception was never retrieved\nfuture: <Task>",
                                     exc_info=(ValueError, err, None))
  assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


def test_step_restore_starts_fresh_then_resumes_past_a_damaged_checkpoint(x64, tmp_path,
                                                                          caplog):
  # The README's resume pattern on the first run (nothing saved yet) returns the state given;
  # after checkpoint 3 is damaged, a new run resumes from 2, with one warning, and replaces 3.
  case = zoo.linen("loop")
  batches = zoo._batches(4)
  kw = dict(cluster=DEMO_CLUSTER, num_microbatches=2,
            plan=harpjax.ManualPlan([((0, 0), "v100", (1, 2), (2, 1))]),
            checkpoint=CheckpointOptions(str(tmp_path / "ck"), every=1, keep=None))
  step = harpjax.auto_parallel(case.step, **kw)
  state = step.restore(like=case.state)
  assert state is case.state and step.steps_done == 0
  for batch in batches[:3]:
    state = step(state, batch)[0]
  step.checkpointer.wait()
  _damage(str(tmp_path / "ck" / "3"), "array data flipped")
  caplog.clear()
  again = harpjax.auto_parallel(case.step, **kw)
  state = again.restore(like=case.state)
  assert again.steps_done == 2
  assert [r.getMessage().count("step 3") for r in caplog.records
          if r.levelname == "WARNING"] == [1]
  ref = jax.jit(case.step)
  s_ref = case.state
  for batch in batches:
    s_ref = ref(s_ref, batch)[0]
  for batch in batches[2:]:
    state = again(state, batch)[0]
  again.checkpointer.wait()
  assert again.checkpointer.steps() == [1, 2, 3, 4]
  assert max_rel_err(harpjax.restore_checkpoint(tmp_path / "ck", case.state), s_ref) <= 1e-10
  with pytest.raises(CheckpointError, match="holds no complete checkpoint|ShapeDtypeStruct"):
    harpjax.auto_parallel(case.step, **{**kw, "checkpoint": str(tmp_path / "none")}).restore(
        like=jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    case.state))


_QUIET_EXITS = textwrap.dedent("""
    import sys, numpy as np
    from harpjax.runtime import Checkpointer, CheckpointError
    try:                                       # every checkpoint damaged: a named error
      Checkpointer(sys.argv[1], keep=None).restore({"x": np.ones(8)})
    except CheckpointError as e:
      print("refused", flush=True)

    def main():                                # the usual pattern: nothing outlives main()
      ckpt = Checkpointer(sys.argv[2], keep=None, asynchronous=True)
      ckpt.save(1, {"x": np.full((1024, 1024), 1.0)})
      ckpt.save(2, {"x": np.full((1024, 1024), 2.0)})
    main()
    print("returned", flush=True)
""")


def test_the_last_asynchronous_save_completes_at_exit_and_exits_are_quiet(tmp_path):
  damaged = tmp_path / "damaged"
  save_checkpoint(damaged, {"x": np.ones(8)}, step=1)
  _damage(str(damaged / "1"), "array data truncated")
  directory = str(tmp_path / "ck")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-c", _QUIET_EXITS, str(damaged), directory], env=env,
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stderr[-3000:]
  assert res.stdout.split() == ["refused", "returned"]
  for noise in ("Traceback", "Event loop is closed", "cannot schedule new futures"):
    assert noise not in res.stderr, res.stderr[-3000:]
  assert sorted(os.listdir(directory)) == ["1", "2"]
  with Checkpointer(directory, keep=None) as ckpt:
    assert float(np.asarray(ckpt.restore({"x": np.ones((1024, 1024))})["x"])[3, 3]) == 2.0
