"""Fault injection over every phase (issue 26): Ctrl-C at seeded moments of each phase then a
retry in the same process, kill -9 of workers (Ray actors, the planner's processes) and of the
whole process then a restart; after each, training ends in the state ``jax.jit`` reaches
(float64), no checkpoint saved before the fault is lost, no temporary directory and no thread,
process or actor is left. See :mod:`tests.faults.harness`; ``benchmarks/faults.py`` runs the
long version with timings.

The fast part (local runtime, one trial per phase and one kill -9 of the process) asserts
nothing about wall-clock time: each moment is a count of Python calls inside the phase, so a
trial strikes at the same place on any machine; a failure names its seed.
"""

import random
import zlib

import jax
import pytest

from tests.faults import harness as h

pytestmark = pytest.mark.filterwarnings("ignore:os.fork")


@pytest.fixture(scope="module", autouse=True)
def float64():
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  h.reference(4)
  yield
  jax.config.update("jax_enable_x64", prev)


def _seed(*parts) -> int:
  return zlib.crc32(repr(parts).encode())


def _check(out: h.Outcome) -> None:
  assert out.landed, f"the fault missed its phase: {out.row()}"
  assert out.interrupts + out.swallowed == 1, out.row()
  assert out.ok, out.row()


# (phase, scenario, the phase's run in which to strike, fewest main-thread calls of that run):
# the counts are about half of those measured, so that every drawn moment is inside it.
LOCAL = [
    ("trace", h.Scenario(), 1, 100_000),
    ("profile", h.Scenario(plan="auto"), 1, 4000),
    ("plan", h.Scenario(plan="auto"), 1, 2000),
    ("compile", h.Scenario(), 1, 1000),
    ("step", h.Scenario(), 2, 1500),
    ("save", h.Scenario(), 2, 600),
    ("save", h.Scenario(asynchronous=True), 2, 600),
    ("restore", h.Scenario(resume_from=2), 1, 1500),
    ("replan", h.Scenario(replan_at=2), 1, 8),
]


@pytest.mark.parametrize("phase,scn,nth,calls", LOCAL,
                         ids=[f"{p}{'-async' * s.asynchronous}" for p, s, _, _ in LOCAL])
def test_ctrl_c_in_each_phase_then_retry(phase, scn, nth, calls):
  seed = _seed(phase, scn)
  moment = h.Moment(nth=nth, calls=random.Random(seed).randint(1, calls))
  _check(h.in_process_trial(phase, scn, seed, moment))


@pytest.mark.slow
def test_kill_9_of_the_process_then_a_new_one_resumes():
  seed = _seed("kill_process")
  out = h.kill_process_trial(h.Scenario(steps=4, asynchronous=True), seed,
                             kill_at_line=random.Random(seed).randint(2, 4), delay_s=0.0)
  assert out.landed and out.ok, out.row()


def test_ctrl_c_inside_a_nogil_numba_kernel_is_a_keyboard_interrupt(sigint):
  # Ctrl-C while a kernel that released the GIL runs: Numba's dispatcher, boxing the arrays
  # it returns (as the planner's kernels do), runs the signal's handler and returns with the
  # interrupt pending, which CPython turns into a SystemError; the planner's kernels are
  # called through interruptible_kernel, which raises the KeyboardInterrupt itself.
  # The kernel runs until the signal has been sent (flags[1]), however slowly either thread
  # is scheduled; its wait is a libc call, which the compiler cannot hoist the flag out of.
  import ctypes
  import os
  import signal
  import threading
  import numba
  import numpy as np
  from harpjax.errors import interruptible_kernel

  usleep = ctypes.CDLL(None).usleep
  usleep.argtypes, usleep.restype = [ctypes.c_uint], ctypes.c_int

  @numba.njit(nogil=True)
  def spin(flags, limit):
    flags[0] = 1   # started: the GIL is released
    n = 0
    while flags[1] == 0 and n < limit:
      usleep(1000)
      n += 1
    return n, np.zeros(3)

  spin(np.array([0, 1]), 1)   # compiled before the signal
  flags = np.zeros(2, np.int64)

  def ctrl_c():
    while not flags[0]:
      threading.Event().wait(0.001)
    os.kill(os.getpid(), signal.SIGINT)
    flags[1] = 1

  for fn, expected in [(spin, SystemError), (interruptible_kernel(spin), KeyboardInterrupt)]:
    flags[:] = 0
    sender = threading.Thread(target=ctrl_c)
    sender.start()
    with pytest.raises(expected):
      fn(flags, 600_000)   # at most ten minutes: a sender that never ran
      sender.join()
    sender.join()


def test_an_interrupt_anywhere_in_the_chain_is_told_and_other_system_errors_pass():
  from harpjax.errors import interrupted, interrupts_as_keyboard

  def chained(link):
    try:
      raise KeyboardInterrupt
    except KeyboardInterrupt as ki:
      e = SystemError("returned a result with an exception set")
      if link == "cause":
        e.__cause__ = ki
      elif link == "context":
        e.__context__ = ki
      elif link == "deeper":
        mid = SystemError("inner")
        mid.__cause__ = ki
        e.__cause__ = mid
      return e

  for link in ("cause", "context", "deeper"):
    assert interrupted(chained(link)), link
    with pytest.raises(KeyboardInterrupt):
      with interrupts_as_keyboard():
        raise chained(link)
  assert not interrupted(SystemError("unrelated")) and not interrupted(KeyboardInterrupt())
  with pytest.raises(SystemError, match="unrelated"):
    with interrupts_as_keyboard():
      raise SystemError("unrelated")


# --------------------------------------------------------------------------- the long part


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("phase,scn,nth,calls", LOCAL,
                         ids=[f"{p}{'-async' * s.asynchronous}" for p, s, _, _ in LOCAL])
def test_ctrl_c_in_each_phase_more_seeds(phase, scn, nth, calls, seed):
  rng = random.Random(_seed(phase, scn, seed))
  moment = h.Moment(nth=rng.randint(1, nth), calls=rng.randint(1, calls))
  _check(h.in_process_trial(phase, scn, seed, moment))


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigint", "kill_worker"])
def test_planner_worker_processes(fault):
  seed = _seed("planner", fault)
  moment = h.Moment(calls=None, seconds=0.0)
  out = h.in_process_trial("plan", h.Scenario(plan="auto", planner="process"), seed, moment,
                           fault=fault)
  assert out.ok and (out.landed or fault == "sigint"), out.row()


@pytest.mark.slow
@pytest.mark.parametrize("line", [1, 3, 5])
def test_kill_9_of_the_process_at_more_moments(line):
  out = h.kill_process_trial(h.Scenario(steps=4, every=2, keep=1), _seed("kill", line),
                             kill_at_line=line)
  assert out.landed and out.ok, out.row()


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.5, 2.0, 3.5])
def test_ctrl_c_at_the_command_line(delay_s):
  out = h.cli_trial(_seed("cli", delay_s), delay_s)
  assert out.ok, out.row()


RAY = [
    ("start", h.Scenario(runtime="ray"), h.Moment(calls=300)),
    ("step_ray", h.Scenario(runtime="ray"), h.Moment(nth=2, calls=200)),
    ("gather", h.Scenario(runtime="ray"), h.Moment(calls=100)),
    ("save", h.Scenario(runtime="ray"), h.Moment(nth=2, calls=None, seconds=0.0)),
    ("save", h.Scenario(runtime="ray", asynchronous=True), h.Moment(nth=2, calls=50)),
    ("restore", h.Scenario(runtime="ray", resume_from=2), h.Moment(calls=2000)),
    ("replan", h.Scenario(runtime="ray", replan_at=2), h.Moment(calls=None, seconds=0.0)),
    ("recovery", h.Scenario(runtime="ray", elastic=True, steps=4), h.Moment(calls=500)),
]


@pytest.fixture(scope="module")
def ray_instance():
  ray = pytest.importorskip("ray")
  h.ensure_ray()
  yield
  from harpjax.runtime import ray_runtime
  ray_runtime.release_pool()
  ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("phase,scn,moment", RAY,
                         ids=[f"{p}{'-async' * s.asynchronous}" for p, s, _ in RAY])
def test_ctrl_c_in_each_phase_on_ray(ray_instance, phase, scn, moment):
  out = h.in_process_trial(phase, scn, _seed("ray", phase, scn), moment, kill_after_s=0.0)
  _check(out)
  if phase == "recovery":
    assert out.recoveries == 1, out.row()


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [0.0, 0.05, 0.3])
def test_kill_9_of_a_stage_actor_then_elastic_recovery(ray_instance, after_s):
  out = h.in_process_trial("run", h.Scenario(runtime="ray", elastic=True, steps=4),
                           _seed("actor", after_s), fault="kill_worker", kill_after_s=after_s)
  assert out.landed and out.recoveries == 1 and out.ok, out.row()


@pytest.mark.slow
def test_ctrl_c_in_the_planners_search_on_a_large_model(sigint):
  # The exact search for GPT-39B on 64 GPUs (recomputing, as it must on 32 GB devices; Numba
  # kernels that release the GIL, in this process), interrupted at five moments of it: a
  # KeyboardInterrupt each time it strikes, never Numba's SystemError.
  import time
  from harpjax import phases
  from harpjax.cluster import Cluster
  from harpjax.compiler.plan import SolveOptions
  from harpjax.compiler.profile import ProfileOptions, profile_step
  from harpjax.models import BUILTIN_MODELS
  spec = BUILTIN_MODELS["gpt-39b"](num_microbatches=128)
  tables = profile_step(spec.step_fn, spec.args, Cluster.load(f"{h.ROOT}/benchmarks/configs/"
                                                              "hetero_64.yaml"),
                        num_microbatches=128, batch_argnums=spec.batch_argnums,
                        options=ProfileOptions(progress=False, remat=True)).tables
  opts = SolveOptions(backend="sequential")
  t0 = time.monotonic()
  phases.solve(tables, 128, options=opts)
  whole = time.monotonic() - t0
  struck = 0
  for frac in (0.1, 0.3, 0.5, 0.7, 0.9):
    injector = h.Injector("plan", h.Moment(seconds=frac * whole))
    raised = None
    with injector.installed():
      try:
        phases.solve(tables, 128, options=opts)
      except BaseException as e:  # noqa: BLE001 -- what it raises is the point
        raised = e
    assert raised is None or type(raised) is KeyboardInterrupt, repr(raised)
    struck += raised is not None
  assert struck >= 3, struck
