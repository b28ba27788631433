"""Workers run under the driver's JAX settings: a float64 step on Ray actors without
``actor_env``; a setting that still differs is an error naming it, not a failed call.

The Ray instance is started once for the module (start-up is slow) and serves two runners.
"""

import pickle

import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import harpjax
from harpjax import _compat
from harpjax.compiler.stages import LoweredStage, LoweredStep
from harpjax.errors import RuntimeFailure
from harpjax.models import MLP
from harpjax.runtime.worker import StageWorker, WorkerSpec, apply_settings
from tests.equivalence import DEMO_CLUSTER, max_rel_err

PLAN = harpjax.ManualPlan([((0, 1), "v100", (1, 2), (2, 1)), ((2, 3), "a100", (1, 2))])


@pytest.fixture
def restore_settings():
  """Puts back every JAX setting a test changes."""
  before = _compat.jax_settings()
  yield
  _compat.apply_jax_settings(before)
  assert not _compat.differing_jax_settings(before)


def _mlp_step(dtype):
  model = MLP(features=(32, 32, 32))
  x = jax.random.normal(jax.random.key(0), (16, 12), dtype)
  params = jax.tree_util.tree_map(lambda a: a.astype(dtype),
                                  model.init(jax.random.key(1), x))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(1e-2))

  def step(state, batch):
    def loss_fn(p):
      return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  batches = [{"x": jax.random.normal(jax.random.key(20 + i), (16, 12), dtype),
              "y": jax.random.normal(jax.random.key(30 + i), (16, 10), dtype)}
             for i in range(2)]
  return step, state, batches


def _spec(settings: dict, env_settings=frozenset(), stage: int = 0) -> WorkerSpec:
  """A worker spec holding only what :func:`apply_settings` reads."""
  lowered = LoweredStep(None, None, None, "cpu", (LoweredStage(0, b"", b"", b"", {}),),
                        tuple(sorted(settings.items())))
  return WorkerSpec(stage=stage, lowered=lowered, consts=(), host="h", take_settings=True,
                    env_settings=env_settings)


# ---------------------------------------------------------------------- capture and apply


def test_settings_are_captured_as_plain_values_context_managers_included():
  got = _compat.jax_settings()
  assert set(got) <= set(_compat.JAX_SETTINGS)
  assert {"jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
          "jax_threefry_partitionable", "jax_numpy_rank_promotion",
          "jax_numpy_dtype_promotion", "jax_softmax_custom_jvp"} <= set(got)
  assert got["jax_numpy_dtype_promotion"] == "standard"      # an enum, by its value
  assert pickle.loads(pickle.dumps(got)) == got
  with jax.enable_x64(True), jax.default_matmul_precision("highest"):
    inside = _compat.jax_settings()
  assert inside["jax_enable_x64"] is True
  assert inside["jax_default_matmul_precision"] == "highest"
  assert _compat.jax_settings() == got


def test_apply_sets_the_driver_settings_keeps_the_environment_and_reports_the_rest(
    restore_settings):
  driver = dict(_compat.jax_settings(), jax_enable_x64=True,
                jax_default_matmul_precision="highest", jax_numpy_dtype_promotion="strict")
  assert _compat.apply_jax_settings(driver) == {}
  assert _compat.differing_jax_settings(driver) == {}
  assert jax.numpy.zeros(2).dtype == jnp.float64
  # A name the process keeps is left as it is, and still differs; an unknown one is refused.
  jax.config.update("jax_enable_x64", False)
  refused = _compat.apply_jax_settings({**driver, "jax_no_such_setting": 1},
                                       keep={"jax_enable_x64"})
  assert list(refused) == ["jax_no_such_setting"] and "Unrecognized" in refused[
      "jax_no_such_setting"]
  assert _compat.differing_jax_settings({**driver, "jax_no_such_setting": 1}) == {
      "jax_enable_x64": (True, False), "jax_no_such_setting": (1, None)}
  assert _compat.setting_env_var("jax_enable_x64") == "JAX_ENABLE_X64"


def test_a_worker_takes_the_settings_or_names_the_one_that_differs(restore_settings,
                                                                   monkeypatch):
  driver = dict(_compat.jax_settings(), jax_enable_x64=True)
  apply_settings(_spec(driver))
  assert jax.config.jax_enable_x64 is True
  jax.config.update("jax_enable_x64", False)
  monkeypatch.setenv("JAX_ENABLE_X64", "0")
  with pytest.raises(RuntimeFailure, match=r"stage 3: .*jax_enable_x64 is True in the driver "
                     r"but False here; RayRuntime.actor_env sets JAX_ENABLE_X64='0'"):
    apply_settings(_spec(driver, frozenset({"jax_enable_x64"}), stage=3))
  with pytest.raises(RuntimeFailure, match=r"jax_no_such_setting is 1 in the driver but None "
                     r"here; it could not be set here \(AttributeError"):
    apply_settings(_spec({"jax_no_such_setting": 1}))


def test_loading_under_other_settings_names_them():
  lowered = _spec({"jax_enable_x64": not jax.config.jax_enable_x64}).lowered
  with pytest.raises(RuntimeFailure, match=r"stage 0 was lowered under other JAX settings.*"
                     r"jax_enable_x64 is True in the lowered step but False here"):
    lowered.load(0, jax.devices()[:1])


def test_a_worker_whose_build_failed_still_takes_aborts_and_messages():
  w = StageWorker()
  w.abort("another stage failed")
  with pytest.raises(RuntimeFailure, match="stage 0"):
    w.build(_spec({"jax_no_such_setting": 1}))
  w.abort("another stage failed")                 # no AttributeError: the mailbox exists
  w.deliver(1, ("value", 0), 1, {})
  w.shutdown()


def test_threads_backend_reports_the_setting_not_a_missing_mailbox():
  # Workers in threads share the process, but not the driver thread's context managers: the
  # stages were lowered under matmul precision "highest", the worker threads load under the
  # default; every stage fails its build, and the error names the setting.
  step, state, batches = _mlp_step(jnp.float32)
  with jax.default_matmul_precision("highest"):
    pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=PLAN,
                                  runtime=harpjax.RayRuntime(backend="threads"))
    with pytest.raises(RuntimeFailure) as info:
      pstep(state, batches[0])
  msg = str(info.value)
  assert "starting the stage workers failed" in msg, msg
  assert "jax_default_matmul_precision is 'highest' in the lowered step but None here" in msg
  assert "mailbox" not in msg and "AttributeError" not in msg, msg


# ---------------------------------------------------------------------- on Ray actors


@pytest.fixture(scope="module")
def ray_instance():
  ray = pytest.importorskip("ray")
  from harpjax.runtime import ray_runtime
  ray_runtime.init_ray(num_cpus=4)
  yield ray_runtime
  ray_runtime.release_pool()
  ray.shutdown()


@pytest.mark.filterwarnings("ignore:os.fork")
def test_float64_step_on_ray_equals_jit_without_actor_env(ray_instance, restore_settings):
  ray_runtime = ray_instance
  jax.config.update("jax_enable_x64", True)
  step, state, batches = _mlp_step(jnp.float64)
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=PLAN,
                                runtime="ray")
  ref = jax.jit(step)
  s_ray = s_ref = state
  for batch in batches:
    o_ray, o_ref = pstep(s_ray, batch), ref(s_ref, batch)
    got = ray_runtime.gather(o_ray)
    assert jax.tree_util.tree_leaves(got[0].params)[0].dtype == jnp.float64
    err = max_rel_err(o_ref, got)   # dtypes must match too
    assert err <= 1e-12, err
    s_ray, s_ref = o_ray[0], o_ref[0]
  pstep.runner(s_ray, batches[0]).shutdown()   # its actors go back to the pool

  # The same processes, if reused, take the driver's settings again: x64 off.
  jax.config.update("jax_enable_x64", False)
  step, state, batches = _mlp_step(jnp.float32)
  pstep = harpjax.auto_parallel(step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=PLAN,
                                runtime="ray")
  out = ray_runtime.gather(pstep(state, batches[0]))
  assert jax.tree_util.tree_leaves(out[0].params)[0].dtype == jnp.float32
  assert max_rel_err(jax.jit(step)(state, batches[0]), out) <= 1e-5
  pstep.runner(out[0], batches[0]).shutdown()
