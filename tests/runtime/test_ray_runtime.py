"""The Ray runtime gives the local runtime's and ``jax.jit``'s numbers; state stays on actors;
a dead actor is a clear error, not a hang.

One local Ray instance serves the module (start-up is slow); runners reuse its actor processes.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import harpjax
from harpjax.errors import RuntimeFailure, UnsupportedError
from harpjax.models import GPT, MLP, GPTConfig
from tests.equivalence import DEMO_CLUSTER, ScanNet, max_rel_err
from tests.runtime.test_split import _gpt_case, _num_layers, host_spanning_plan, split_plan

ray = pytest.importorskip("ray")
from harpjax.runtime import ray_runtime  # noqa: E402  (after the importorskip)
from harpjax.runtime.ray_runtime import RemoteArray  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:os.fork")   # Ray starts processes

SCHEDULES = ["gpipe", "1f1b", "eager_1f1b", "h1f1b"]
RTOL = 1e-5

MLP3 = harpjax.ManualPlan([((0, 0), "v100", (1, 2), (2, 1)), ((1, 2), "a100", (1, 2), (1, 2)),
                           ((3, 3), "v100", (1, 2), (1, 2))])


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
  # This one node advertises every host of the demo cluster, as docker/launch.sh makes each
  # real node advertise its own: actors are placed by host (pin_hosts) in every test here.
  hosts = [h.name for h in harpjax.Cluster.load(DEMO_CLUSTER).hosts]
  ray_runtime.init_ray(num_cpus=4, resources={ray_runtime.HOST_RESOURCE_PREFIX + h: 100
                                               for h in hosts})
  yield
  ray_runtime.release_pool()
  ray.shutdown()


def _mlp_setup():
  model = MLP(features=(32, 32, 32))
  x = jax.random.normal(jax.random.key(0), (16, 12))
  tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))   # a cross-stage norm
  state = train_state.TrainState.create(apply_fn=model.apply,
                                        params=model.init(jax.random.key(1), x), tx=tx)

  def step(state, batch):
    def loss_fn(p):
      logits = state.apply_fn(p, batch["x"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
      return loss, {"acc": jnp.mean(logits.argmax(-1) == batch["y"])}
    (loss, aux), grads = harpjax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss, aux

  batches = [{"x": jax.random.normal(jax.random.key(20 + i), (16, 12)),
              "y": jax.random.randint(jax.random.key(30 + i), (16,), 0, 10)} for i in range(3)]
  return step, state, batches


def _three_ways(step, state, batches, *, plan, num_microbatches, schedule=None, extra=None,
                runtime_options=None, local=True):
  """Runs the Ray, local (if ``local``) and jit steps side by side; returns the worst errors
  and the Ray step."""
  if schedule is not None:
    plan = plan.replace(schedule=schedule)
  kw = dict(cluster=DEMO_CLUSTER, num_microbatches=num_microbatches, plan=plan)
  pray = harpjax.auto_parallel(step, runtime=harpjax.RayRuntime(**(runtime_options or {})),
                               **kw)
  ploc = harpjax.auto_parallel(step, **kw)
  ref = jax.jit(step)
  s_ray = s_loc = s_ref = state
  vs_local = vs_jit = 0.0
  for i, batch in enumerate(batches):
    args = (batch,) + (tuple(extra[i]) if extra else ())
    o_ray = pray(s_ray, *args)
    o_ref = ref(s_ref, *args)
    o_loc = ploc(s_loc, *args) if local else o_ref
    assert all(isinstance(x, RemoteArray) for x in jax.tree_util.tree_leaves(o_ray[0]))
    assert not any(isinstance(x, RemoteArray) for x in jax.tree_util.tree_leaves(o_ray[1:]))
    got = ray_runtime.gather(o_ray)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(o_ref)
    vs_local = max(vs_local, max_rel_err(o_loc, got))
    vs_jit = max(vs_jit, max_rel_err(o_ref, got))
    s_ray, s_loc, s_ref = o_ray[0], o_loc[0], o_ref[0]   # handles go back in: no transfer
  return vs_local, vs_jit, pray


@pytest.mark.parametrize("schedule", [s if s == "h1f1b" else pytest.param(s, marks=pytest.mark.slow)
                                      for s in SCHEDULES])   # the local twins run every schedule fast
def test_every_schedule_matches_local_and_jit(schedule):
  step, state, batches = _mlp_setup()
  vs_local, vs_jit, pstep = _three_ways(step, state, batches, plan=MLP3, num_microbatches=4,
                                        schedule=schedule)
  assert vs_local <= 1e-6, vs_local      # the same executables, the same summation order
  assert vs_jit <= RTOL, vs_jit
  runner = pstep.runner(state, batches[0])
  assert runner.last.step == 3 and len(runner.last.tasks) == 3
  runner.shutdown()


def _gpt_setup():
  cfg = GPTConfig(vocab_size=64, seq_len=8, hidden=16, num_heads=2, num_blocks=2, dropout=0.1)
  model = GPT(cfg)
  tokens = jax.random.randint(jax.random.key(0), (8, cfg.seq_len), 0, cfg.vocab_size)
  state = train_state.TrainState.create(apply_fn=model.apply,
                                        params=model.init(jax.random.key(1), tokens),
                                        tx=optax.sgd(0.5))

  def step(state, batch, rng):
    def loss_fn(p):
      logits = state.apply_fn(p, batch[:, :-1], train=True, rngs={"dropout": rng})
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  batches = [jax.random.randint(jax.random.key(10 + i), (8, cfg.seq_len + 1), 0,
                                cfg.vocab_size) for i in range(2)]
  rngs = [(jax.random.key(100 + i),) for i in range(2)]
  return step, state, batches, rngs


def test_gpt_tied_embedding_dropout_and_object_store_transport():
  # The tied embedding is read by the first and last stage (its gradient part travels to the
  # owner); dropout masks come from the full batch's random bits; a PRNG key comes from the
  # driver each step; messages take the Ray object store instead of TCP. (Compared with jit
  # only: the schedule tests cover the local runtime.)
  step, state, batches, rngs = _gpt_setup()
  plan = harpjax.ManualPlan([((0, 1), "v100", (1, 2), (2, 1)), ((2, 2), "a100", (1, 2), (1, 2)),
                             ((3, 3), "a100", (1, 2))])   # 2 devices each: pooled actors
  vs_local, vs_jit, pstep = _three_ways(step, state, batches, plan=plan, num_microbatches=4,
                                        schedule="h1f1b", extra=rngs, local=False,
                                        runtime_options={"transport": "object_store"})
  assert vs_jit <= RTOL, vs_jit
  runner = pstep.runner(state, batches[0], rngs[0][0])
  assert {r.transport for r in runner.routes.values()} == {"object_store"}
  runner.shutdown()


def test_state_stays_on_actors_gather_and_save(tmp_path):
  step, state, batches = _mlp_setup()
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=4, plan=MLP3,
                                runtime="ray")
  s1, loss, aux = pstep(state, batches[0])
  s2, _, _ = pstep(s1, batches[1])
  runner = pstep.runner(s2, batches[2])
  # The new parameters stay on their owners; the loss and aux come back as arrays.
  handles = jax.tree_util.tree_leaves(s2.params)
  assert {h.stage for h in handles} == {0, 1, 2}
  assert isinstance(loss, jax.Array) and loss.shape == () and isinstance(aux["acc"], jax.Array)
  ref = jax.jit(step)
  r1 = ref(state, batches[0])[0]
  r2 = ref(r1, batches[1])[0]
  assert max_rel_err(r2, ray_runtime.gather(s2)) <= RTOL
  assert np.asarray(handles[0]).shape == handles[0].shape           # __array__ fetches
  path = tmp_path / "state.npz"
  runner.save(path)                                                  # the last step's state
  loaded = ray_runtime.load_tree(path, like=state)
  assert max_rel_err(r2, loaded) <= RTOL
  # Older handles are released after retain_steps (2) further steps.
  pstep(s2, batches[2])
  with pytest.raises(RuntimeFailure, match="no longer holds"):
    pstep(s1, batches[0])
  runner.shutdown()


def test_killed_actor_is_a_clear_error_not_a_hang():
  step, state, batches = _mlp_setup()
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=4, plan=MLP3,
                                runtime=harpjax.RayRuntime(recv_timeout_s=20, step_timeout_s=40))
  s, _, _ = pstep(state, batches[0])
  runner = pstep.runner(s, batches[1])
  runner.kill_stage(1)
  t0 = time.time()
  with pytest.raises(RuntimeFailure, match=r"stage 1 \(host a100-0\).*died"):
    pstep(s, batches[1])
  assert time.time() - t0 < 40
  with pytest.raises(RuntimeFailure, match="failed earlier"):
    pstep(s, batches[1])
  runner.shutdown()


@pytest.mark.slow   # long; the fast suite keeps a smaller case of the same path
def test_stage_over_two_hosts_is_one_spmd_program_over_their_processes():
  # Stage 1 runs on hosts a100-0 and a100-1: one actor per host, joined by jax.distributed,
  # running the stage as one SPMD program (data parallel across the hosts).
  step, state, batches = _mlp_setup()
  plan = harpjax.ManualPlan([((0, 1), "v100", (1, 2)), ((2, 3), "a100", (2, 2), (2, 2))])
  vs_local, vs_jit, pstep = _three_ways(step, state, batches[:2], plan=plan,
                                        num_microbatches=4, schedule="h1f1b")
  assert vs_local <= 1e-6, vs_local
  assert vs_jit <= RTOL, vs_jit
  runner = pstep.runner(state, batches[0])
  members = runner._backend.actors[1]
  assert len(members) == 2 and len(runner._backend.actors[0]) == 1
  infos = ray.get([m.info.remote() for m in members])
  assert infos[0]["pid"] != infos[1]["pid"]
  assert [len(i["devices"]) for i in infos] == [4, 4]   # each sees the group's four devices
  runner.shutdown()


@pytest.mark.slow   # long; the fast suite keeps a smaller case of the same path
def test_gpt_last_stage_over_two_hosts_tensor_parallel_across_them():
  # The group's stage holds the tied head (its gradient part is gathered and sent to the
  # owner), gets the driver's PRNG key, and splits its tensors across the two processes.
  step, state, batches, rngs = _gpt_setup()
  plan = harpjax.ManualPlan([((0, 1), "v100", (1, 2)), ((2, 3), "a100", (2, 2), (1, 4))])
  vs_local, vs_jit, pstep = _three_ways(step, state, batches[:1], plan=plan,
                                        num_microbatches=2, schedule="1f1b", extra=rngs[:1],
                                        local=False)
  assert vs_jit <= RTOL, vs_jit
  runner = pstep.runner(state, batches[0], rngs[0][0])
  assert len(runner._backend.actors[1]) == 2
  runner.shutdown()


def test_stage_over_two_hosts_in_one_process_or_refused():
  step, state, batches = _mlp_setup()
  plan = harpjax.ManualPlan([((0, 1), "v100", (1, 2)), ((2, 3), "a100", (2, 2))])
  pinned = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=4, plan=plan,
                                 runtime=harpjax.RayRuntime(spmd_hosts=False))
  with pytest.raises(UnsupportedError, match=r"stage 1 spans 2 hosts.*spmd_hosts"):
    pinned(state, batches[0])
  # On one machine the stage's four fake devices can live in one actor process.
  loose = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=4, plan=plan,
                                runtime=harpjax.RayRuntime(pin_hosts=False))
  out = loose(state, batches[0])
  ref = jax.jit(step)(state, batches[0])
  assert max_rel_err(ref, ray_runtime.gather(out)) <= RTOL
  runner = loose.runner(out[0], batches[1])
  assert len(runner._backend.actors[1]) == 1
  runner.shutdown()


@pytest.mark.slow
def test_killed_member_of_a_group_is_a_clear_error_not_a_hang():
  step, state, batches = _mlp_setup()
  plan = harpjax.ManualPlan([((0, 1), "v100", (1, 2)), ((2, 3), "a100", (2, 2))])
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=4, plan=plan,
                                runtime=harpjax.RayRuntime(recv_timeout_s=20, step_timeout_s=40))
  s, _, _ = pstep(state, batches[0])
  runner = pstep.runner(s, batches[1])
  runner.kill_stage(1, rank=1)
  t0 = time.time()
  with pytest.raises(RuntimeFailure, match=r"stage 1 \(host a100-0\).*process 1 of 2.*died"):
    pstep(s, batches[1])
  assert time.time() - t0 < 40
  runner.shutdown()


def test_unknown_runtime_option():
  step, _, _ = _mlp_setup()
  with pytest.raises(TypeError, match="timeout"):
    harpjax.RayRuntime(timeout=3)
  # the spelling of earlier releases: refused when the step is made, not at its first call
  with pytest.raises(harpjax.UnknownOptionError, match="unknown runtime_options.*timeout"):
    harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=4, plan=MLP3,
                          runtime="ray", runtime_options={"timeout": 3})


def test_workers_run_the_layers_of_an_unrolled_scan():
  # A plan over automatic layers (meta "layers": "auto") cuts the region with its scan
  # unrolled (compiler.layers.layers_for_step); the workers run that program's stages.
  from harpjax.compiler import layers as layers_lib
  from harpjax.compiler.trace import trace_step
  m = ScanNet(length=2)
  x = jax.random.normal(jax.random.key(1), (8, 5))
  state = train_state.TrainState.create(apply_fn=m.apply,
                                        params=m.init(jax.random.key(0), x), tx=optax.sgd(0.1))

  def step(state, batch):
    loss, g = harpjax.value_and_grad(
        lambda p: jnp.mean((state.apply_fn(p, batch) - 1.0) ** 2))(state.params)
    return state.apply_gradients(grads=g), loss

  seq = layers_lib.layers_for_step(trace_step(step, (state, x), num_microbatches=2))
  assert seq.origin is not None and len(seq) >= 2, seq
  half = len(seq) // 2
  plan = harpjax.ManualPlan([((0, half - 1), "v100", (1, 2)),
                             ((half, len(seq) - 1), "a100", (1, 2))]).replace(
                                 layer_source="auto")
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=plan,
                                runtime=harpjax.RayRuntime(backend="threads"))
  out = pstep(state, x)
  assert len(pstep.trace(state, x).layers) == len(seq)
  assert max_rel_err(jax.jit(step)(state, x), ray_runtime.gather(out)) <= RTOL


def test_root_cause_prefers_the_dead_actor_over_its_broken_peers():
  from harpjax.runtime.runner import _root_cause
  errors = {0: RuntimeFailure("stage 0: sending to stage 1 failed earlier: [Errno 104] "
                              "Connection reset by peer"),
            1: RuntimeFailure("the actor of stage 1 died: The actor died unexpectedly"),
            2: RuntimeFailure("stage 2: aborted while waiting for the activations of "
                              "microbatch 0 (step 2) from stage 1")}
  assert _root_cause(errors) == 1
  assert _root_cause({0: errors[0], 2: ValueError("bad shape")}) == 2


@pytest.mark.parametrize("backend,when", [("threads", "before"), ("threads", "after"), ("ray", "before"),
                                          pytest.param("ray", "after", marks=pytest.mark.slow)])
def test_interrupted_step_then_immediate_retry_keeps_state(backend, when):
  # Ctrl-C reaches the driver of step 2 before its first wait for the workers, or right after
  # the first wait that brought results back (some stages, maybe all, finished the step and
  # stored its outputs): the step is aborted everywhere, KeyboardInterrupt surfaces, the
  # handles of step 1 stay valid (retain_steps=1 would have released them before), and
  # retrying at once continues exactly as jax.jit does. Wherever the workers were when the
  # interrupt came is a valid case; none is waited for.
  step, state, batches = _mlp_setup()
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=4, plan=MLP3,
                                runtime=harpjax.RayRuntime(backend=backend, retain_steps=1))
  ref = jax.jit(step)
  s_par = pstep(state, batches[0])[0]
  s_ref = ref(state, batches[0])[0]
  backend_obj = pstep.runner(state, batches[0])._backend
  real_wait, calls = backend_obj.wait_any, []

  def interrupted_wait(pending, timeout_s):
    if when == "before" and not calls:
      calls.append(1)
      raise KeyboardInterrupt
    got = real_wait(pending, timeout_s)
    if when == "after" and got and not calls:
      calls.append(1)
      raise KeyboardInterrupt
    return got

  backend_obj.wait_any = interrupted_wait
  with pytest.raises(KeyboardInterrupt):
    pstep(s_par, batches[1])
  backend_obj.wait_any = real_wait
  for batch in batches[1:]:
    s_par, s_ref = pstep(s_par, batch)[0], ref(s_ref, batch)[0]
  assert max_rel_err(s_ref, ray_runtime.gather(s_par)) <= RTOL


@pytest.mark.parametrize("backend", ["threads", "ray"])
def test_interrupted_gather_and_checkpoint_save_leave_the_runner_usable(backend, tmp_path):
  # Ctrl-C while harpjax.gather waits, then twice while the gather inside a checkpoint save
  # waits (retain_steps=1: the state of step 1 must stay held through both retries): each
  # surfaces as KeyboardInterrupt, and training then goes on exactly as jax.jit's does.
  step, state, batches = _mlp_setup()
  pstep = harpjax.auto_parallel(
      step, cluster=DEMO_CLUSTER, num_microbatches=4, plan=MLP3, runtime=harpjax.RayRuntime(backend=backend, retain_steps=1),
      checkpoint=harpjax.CheckpointOptions(str(tmp_path / "ck"), every=2, asynchronous=False))
  ref = jax.jit(step)
  s_par, s_ref = pstep(state, batches[0])[0], ref(state, batches[0])[0]
  backend_obj = pstep.runner(state, batches[0])._backend
  real_submit, real_wait = backend_obj.submit, backend_obj.wait_any
  method, interrupts = [None], [3]

  def submit(stage, name, *args):
    method[0] = name
    return real_submit(stage, name, *args)

  def wait_any(pending, timeout_s):
    if method[0] == "fetch" and interrupts[0]:
      interrupts[0] -= 1
      raise KeyboardInterrupt
    return real_wait(pending, timeout_s)

  backend_obj.submit, backend_obj.wait_any = submit, wait_any
  with pytest.raises(KeyboardInterrupt):
    ray_runtime.gather(s_par)
  for _ in range(2):   # step 2 is saved: its gather is interrupted
    with pytest.raises(KeyboardInterrupt):
      pstep(s_par, batches[1])
  assert interrupts == [0] and pstep.steps_done == 1
  for batch in batches[1:]:
    s_par, s_ref = pstep(s_par, batch)[0], ref(s_ref, batch)[0]
  assert pstep.steps_done == 3 and pstep.checkpointer.steps() == [2]
  assert max_rel_err(s_ref, ray_runtime.gather(s_par)) <= RTOL


@pytest.mark.slow   # long; the fast suite keeps a smaller case of the same path
def test_lost_actor_replans_restores_and_continues_float64(tmp_path):
  # Three stages, a checkpoint every 2 steps; stage 1's actor is killed after step 3. Step 4
  # detects the lost host, re-plans automatically on the 6 devices left, restores checkpoint 2,
  # replays step 3 and runs step 4; after 6 steps the state equals jax.jit's (float64).
  from tests import zoo
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    case = zoo.linen("loop")
    batches = zoo._batches(6)
    plan = harpjax.ManualPlan([((0, 1), "v100", (1, 2), (2, 1)), ((2, 3), "a100", (1, 2)),
                               ((4, 5), "v100", (1, 2))]).replace(layer_source="auto")
    pstep = harpjax.auto_parallel(
        case.step, cluster=DEMO_CLUSTER, num_microbatches=4, plan=plan, runtime="ray",
        checkpoint=harpjax.CheckpointOptions(str(tmp_path / "ck"), every=2),
        elastic=harpjax.ElasticOptions())
    ref = jax.jit(case.step)
    s_par = s_ref = case.state
    for i, batch in enumerate(batches):
      if i == 3:
        pstep.runner(s_par, batch).kill_stage(1)
      s_par, s_ref = pstep(s_par, batch)[0], ref(s_ref, batch)[0]
    assert len(pstep.recoveries) == 1
    rec = pstep.recoveries[0]
    assert (rec.failed_step, rec.checkpoint_step, rec.replayed) == (4, 2, 1)
    assert rec.lost_hosts == ("a100-0",) and rec.num_devices == 6
    assert pstep.steps_done == 6
    assert max_rel_err(s_ref, ray_runtime.gather(s_par)) <= 1e-9
  finally:
    jax.config.update("jax_enable_x64", prev)


@pytest.mark.parametrize("offload_by", ["options", "plan"])
def test_zero_stages_on_actors_match_jit_float64(offload_by):
  # ZeRO-3 on one stage, ZeRO-1 on the other, each over dp = 2: the actors keep the split
  # parameters and optimizer state between steps (the second stage's optimizer state in host
  # memory, asked for by OffloadOptions or by the plan's StageSpec.offload) and the result
  # equals jax.jit's (float64).
  import dataclasses
  from tests import zoo
  from tests.runtime.test_zero import zero_plan
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    case = zoo.linen("loop")
    plan = zero_plan(6, [("v100", (1, 2), (2, 1), 3), ("a100", (1, 2), (2, 1), 1)])
    offload = harpjax.OffloadOptions(optimizer_state=True, stages=(1,))
    if offload_by == "plan":
      offload = None
      plan = dataclasses.replace(plan, stages=(
          plan.stages[0], dataclasses.replace(plan.stages[1], offload=True)))
    pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=4,
                                  plan=plan, runtime="ray", offload=offload)
    ref = jax.jit(case.step)
    s_par = s_ref = case.state
    for batch in case.batches[:2]:
      o_par, o_ref = pstep(s_par, batch), ref(s_ref, batch)
      assert max_rel_err(o_ref[1], o_par[1]) <= 1e-10
      s_par, s_ref = o_par[0], o_ref[0]
    assert max_rel_err(s_ref, ray_runtime.gather(s_par)) <= 1e-10
  finally:
    jax.config.update("jax_enable_x64", prev)


@pytest.mark.slow   # long; the fast suite keeps a smaller case of the same path
def test_mixed_stage_groups_on_other_hosts_run_in_processes_of_their_own(x64):
  # Both stages of the float64 GPT (dropout, tied embeddings, aux outputs) split every
  # microbatch between a V100 group (the home, in the stage's actor on its V100 host) and an
  # A100 group on an A100 host, which runs in an actor of its own, pinned to that host.
  step, state, batches, rngs = _gpt_case()
  plan = split_plan(_num_layers(step, state, batches[0], 1, *rngs[0]))
  _, vs_jit, pstep = _three_ways(step, state, batches, plan=plan, num_microbatches=1,
                                 extra=rngs, local=False)
  assert vs_jit <= 1e-12, vs_jit
  runner = pstep.runner(state, batches[0], *rngs[0])
  be = runner._backend
  assert be.remote_groups == {0: (1,), 1: (1,)}
  for s, home_devices, group_devices in [(0, 1, 2), (1, 2, 1)]:
    home = ray.get(be.actors[s][0].info.remote())
    group = ray.get(be.group_actors[s][1].info.remote())
    assert home["pid"] != group["pid"]
    assert len(home["devices"]) == home_devices and len(group["devices"]) == group_devices
  # A group's process that dies fails the step with a message naming it.
  ray.kill(be.group_actors[1][1], no_restart=True)
  with pytest.raises(RuntimeFailure, match="stage 1: group 1"):
    pstep(state, batches[0], *rngs[0])
  runner.shutdown()


@pytest.mark.slow
def test_mixed_stage_group_over_two_hosts_runs_in_an_actor_per_host():
  # The A100 group spans both A100 hosts: it runs as two groups, each in its own actor.
  step, state, batches = _mlp_setup()
  plan = host_spanning_plan(4)
  vs_local, vs_jit, pstep = _three_ways(step, state, batches[:2], plan=plan,
                                        num_microbatches=2)   # 8 rows: 2 + 4 + 2
  assert vs_local <= 1e-6 and vs_jit <= RTOL, (vs_local, vs_jit)
  runner = pstep.runner(state, batches[0])
  assert runner._backend.remote_groups == {0: (1, 2)}
  infos = [ray.get(a.info.remote()) for a in runner._backend.group_actors[0].values()]
  assert [len(i["devices"]) for i in infos] == [2, 2] and infos[0]["pid"] != infos[1]["pid"]
  runner.shutdown()
