"""Fault injection over every phase of a training run: the engine of ``tests/faults`` and of
``benchmarks/faults.py``.

A *trial* trains a small float64 model (the zoo's ``loop`` net, dropout on, AdamW) for a few
steps with checkpoints, resuming the way a user's script does
(``state = step.restore(like=state)``), and injects one fault in one phase:

* ``sigint``: Ctrl-C (a real ``SIGINT`` to this process) at a moment of the phase, then a
  retry of the same call in this process;
* ``kill_worker``: ``kill -9`` of a stage's Ray actor, which elastic recovery absorbs;
* ``kill_process``: ``kill -9`` of the whole training process (a child), then a restart in a
  new process (:mod:`tests.faults.child`).

A *moment* of a phase is the ``calls``-th Python function call of the main thread inside it
(finalizers the garbage collector runs are not counted), or ``seconds`` after it began,
whichever comes first (:class:`Moment`): seeded, so that a failing trial runs again the same
way (calls are deterministic; seconds depend on the machine).

Every trial then checks what the issue promises: the interrupt surfaced as
``KeyboardInterrupt`` (and how long after the signal); the state at the end equals
``jax.jit``'s in float64; no checkpoint that was saved before the fault is lost and the newest
ones restore to the state of their step; no temporary directory is left; no thread, process or
Ray actor started by the trial outlives it. :class:`Outcome` holds the figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

import harpjax
from harpjax.errors import INTERRUPT_MESSAGE
from harpjax.runtime import handles
from tests import zoo
from tests.equivalence import DEMO_CLUSTER, max_rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 1e-10   # float64, against jax.jit (sums in another order)

# A two-stage plan of the zoo's net cut automatically into its 6 layers.
PLAN = harpjax.ManualPlan([((0, 2), "v100", (1, 2), (2, 1)),
                           ((3, 5), "a100", (1, 2))]).replace(layer_source="auto")
SMALLER = ["a100-0", "a100-1"]   # hosts replan() takes away (the V100 host is left)

# Where each phase is entered: (owner, attribute); the first call of the attribute during the
# trial opens the phase. "auto" plans are needed for profile and plan.
PHASES: dict[str, tuple[str, str]] = {
    "trace": ("harpjax.api", "trace_phase"),
    "profile": ("harpjax.phases", "profile_step"),
    "plan": ("harpjax.phases", "solve"),
    "compile": ("harpjax.api", "compile_phase"),
    "start": ("harpjax.runtime", "ray_runner"),
    "step": ("harpjax.runtime", "run_step"),
    "step_ray": ("harpjax.runtime.runner:PipelineRunner", "__call__"),
    "save": ("harpjax.runtime.checkpoint:Checkpointer", "save"),
    "restore": ("harpjax.runtime.checkpoint:Checkpointer", "restore_newest"),
    "gather": ("harpjax.runtime.handles", "gather"),
    "replan": ("harpjax.api:ParallelStep", "replan"),
    "recovery": ("harpjax.runtime.elastic:Elastic", "_recover"),
}


@dataclasses.dataclass(frozen=True)
class Scenario:
  """What a trial trains and how.

  Attributes:
    runtime: ``"local"`` or ``"ray"``.
    plan: ``"manual"`` (:data:`PLAN`) or ``"auto"`` (traced, profiled and searched).
    steps: training steps.
    every, keep, asynchronous: the checkpoints.
    resume_from: steps trained and checkpointed by an earlier run before this one resumes
      (the restore phase).
    replan_at: before this step, the step moves to the cluster without :data:`SMALLER`.
    elastic: lost workers are recovered (Ray).
    planner: ``SolveOptions.backend`` of automatic planning (``"process"``: worker processes,
      every candidate of the window searched there).
  """
  runtime: str = "local"
  plan: str = "manual"
  steps: int = 3
  every: int = 1
  keep: int = 2
  asynchronous: bool = False
  resume_from: int = 0
  replan_at: int | None = None
  elastic: bool = False
  planner: str = "auto"


@dataclasses.dataclass(frozen=True)
class Moment:
  """When the fault strikes: in the ``nth`` run of the phase, at its ``calls``-th Python call
  of the main thread, or ``seconds`` after that run began, whichever comes first."""
  nth: int = 1
  calls: int | None = None
  seconds: float | None = None

  @classmethod
  def draw(cls, rng: random.Random, max_nth: int = 1, max_calls: int | None = 2000,
           max_seconds: float | None = None) -> "Moment":
    return cls(rng.randint(1, max_nth),
               None if max_calls is None else rng.randint(1, max_calls),
               None if max_seconds is None else rng.uniform(0.0, max_seconds))


@dataclasses.dataclass
class Outcome:
  """One trial's figures (see the module docstring)."""
  phase: str
  fault: str
  seed: int
  landed: bool = False            # the fault struck inside the phase
  interrupts: int = 0             # KeyboardInterrupts the run saw (each then retried)
  swallowed: int = 0              # raised where CPython drops it (a finalizer, a GC callback)
  latency_s: float | None = None  # signal sent -> KeyboardInterrupt caught
  recovered: bool = False         # training completed after the fault
  restarts: int = 0               # new processes (kill_process)
  recoveries: int = 0             # elastic recoveries
  max_err: float = float("nan")   # final state vs jax.jit
  saved: tuple = ()               # checkpoints complete before the fault
  lost: tuple = ()                # of those, missing at the end though newer than keep allows
  checkpoints_err: float = 0.0    # newest checkpoints vs the jax.jit state of their step
  temporary: tuple = ()           # temporary entries left in the checkpoint directory
  leaked: tuple = ()              # threads, processes, actors still alive
  seconds: float = 0.0
  detail: str = ""                # what went wrong (the command line: its status and output)

  @property
  def ok(self) -> bool:
    return (self.recovered and self.max_err <= TOLERANCE and not self.lost
            and self.checkpoints_err <= TOLERANCE and not self.temporary and not self.leaked)

  def row(self) -> dict:
    return dataclasses.asdict(self) | {"ok": self.ok}


# --------------------------------------------------------------------------- reference


_REFERENCE: dict[int, list] = {}


def case():
  return zoo.linen("loop")


def reference(steps: int) -> list:
  """The ``jax.jit`` training states after 0..steps steps (float64)."""
  if len(_REFERENCE.get(0, ())) <= steps:
    c = case()
    states, ref = [c.state], jax.jit(c.step)
    for batch in zoo._batches(steps):
      states.append(ref(states[-1], batch)[0])
    _REFERENCE[0] = [jax.tree_util.tree_map(np.asarray, s) for s in states]
  return _REFERENCE[0][:steps + 1]


# --------------------------------------------------------------------------- the run


def make_step(scn: Scenario, directory: str):
  c = case()
  kw = {}
  runtime = scn.runtime
  if scn.runtime == "ray":
    runtime = harpjax.RayRuntime(step_timeout_s=120.0, recv_timeout_s=60.0,
                                 start_timeout_s=300.0)
  if scn.elastic:
    kw["elastic"] = harpjax.ElasticOptions()
  plan = PLAN
  if scn.plan == "auto":
    # Worker processes: without the lower bound, which leaves this small search nothing to
    # hand them (the plan is the same: the bound only skips candidates that cannot win).
    plan = harpjax.AutoPlan(solve=harpjax.SolveOptions(
        backend=scn.planner, bound_pruning=scn.planner != "process"))
  return harpjax.auto_parallel(
      c.step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=plan, runtime=runtime,
      checkpoint=harpjax.CheckpointOptions(directory, every=scn.every, keep=scn.keep,
                                           asynchronous=scn.asynchronous), **kw)


class Retrier:
  """Calls a function again after each ``KeyboardInterrupt`` (what a user at the terminal
  does), recording how long after the signal it surfaced."""

  def __init__(self, injector: "Injector | None" = None, limit: int = 20):
    self.injector, self.limit, self.interrupts = injector, limit, 0
    self.latencies: list[float] = []

  def __call__(self, fn: Callable, *args):
    for _ in range(self.limit):
      try:
        return fn(*args)
      except KeyboardInterrupt:
        self.interrupts += 1
        sent = self.injector.sent_at if self.injector else None
        if sent is not None:
          self.latencies.append(time.monotonic() - sent)
          self.injector.sent_at = None
    raise AssertionError(f"interrupted {self.limit} times in a row")


def _plain(fn, *args):
  return fn(*args)


def train(scn: Scenario, directory: str, retry: Callable = _plain,
          on_step: Callable | None = None, step=None):
  """Trains ``scn.steps`` steps into ``directory`` the way a user's script does: resume from
  the newest intact checkpoint, then step (and replan) until done; ``on_step(step)`` after
  the resume and after each step. Returns ``(step, state)`` with the state gathered."""
  c, batches = case(), zoo._batches(scn.steps)
  step = step or make_step(scn, directory)
  state = retry(step.restore, c.state)
  if on_step is not None:
    on_step(step)
  while step.steps_done < scn.steps:
    k = step.steps_done
    if scn.replan_at == k + 1 and step.cluster.num_devices == 8:
      state = retry(step.replan, step.cluster.without_hosts(SMALLER), state)
    state = retry(step, state, batches[k])[0]
    if on_step is not None:
      on_step(step)
  return step, retry(_gather, state)


def _gather(state):
  return handles.gather(state)   # looked up at each call: the "gather" phase patches it


def prepare(scn: Scenario, directory: str) -> None:
  """The checkpoints an earlier run left (``scn.resume_from`` steps), for restore trials."""
  if scn.resume_from:
    earlier = dataclasses.replace(scn, steps=scn.resume_from, replan_at=None)
    step, _ = train(earlier, directory)
    step.checkpointer.wait()
    _shutdown(step)


def _shutdown(step) -> None:
  step._release_retired()
  for p in step._cache.values():
    if p.runner is not None:
      p.runner.shutdown()


# --------------------------------------------------------------------------- injection


def _resolve(owner: str):
  module, _, cls = owner.partition(":")
  obj = __import__(module, fromlist=["_"])
  return getattr(obj, cls) if cls else obj


def _finalizer(code) -> bool:
  """Code the garbage collector may run (a weakref callback, ``__del__``): an exception
  raised there is printed and dropped by CPython, so a signal is not sent from there."""
  return code.co_filename.endswith("weakref.py") or code.co_name == "__del__"


class Injector:
  """Sends one ``SIGINT`` at a :class:`Moment` of a phase (see the module docstring).

  Each call of the phase's entry point from the main thread is a run of the phase; in the
  ``nth`` one, the signal is sent from the main thread's profile hook (``calls``) or from a
  timer thread (``seconds``), and only while the phase runs; it is handled before the entry
  point returns. ``snapshot()`` is called just before the signal is sent.
  """

  def __init__(self, phase: str, moment: Moment, snapshot: Callable = lambda: None,
               action: Callable[[], bool] | None = None):
    self.phase, self.moment, self.snapshot = phase, moment, snapshot
    self.action = action   # instead of SIGINT to this process; returns whether it struck
    self.landed = False
    self.sent_at: float | None = None
    self.saved: Any = None
    self._lock = threading.Lock()
    self._active = self._done = False
    self._runs = self._calls = 0
    self._timer: threading.Timer | None = None
    self._handled = threading.Event()
    self.calls = 0            # main-thread calls of the run struck at (all of it if missed)
    self.seconds = 0.0        # how long that run lasted

  def _fire(self) -> None:
    with self._lock:
      if not self._active or self._done:
        return
      self._done = True
      self.saved = self.snapshot()
      if self.action is not None:
        self.landed = self.action()
        return
      self.landed = True
      self.sent_at = time.monotonic()
      os.kill(os.getpid(), signal.SIGINT)

  def _profile(self, frame, event, arg):
    # Calls of finalizers are not counted: where the garbage collector runs them varies, and
    # a signal is not sent from them (a phase that ends by dropping objects would otherwise
    # count calls at which no fault can strike).
    if event == "call" and not _finalizer(frame.f_code):
      self._calls += 1
      if self.moment.calls is not None and self._calls >= self.moment.calls:
        sys.setprofile(None)
        self._fire()

  def _on_sigint(self, signum, frame):
    self._handled.set()
    raise KeyboardInterrupt

  def _entry(self, real):
    injector = self

    def entry(*args, **kwargs):
      if injector._done or injector._active or threading.current_thread() is not \
          threading.main_thread():
        return real(*args, **kwargs)
      injector._runs += 1
      if injector._runs != injector.moment.nth:
        return real(*args, **kwargs)
      injector._active = True
      if injector.moment.seconds is not None:
        injector._timer = threading.Timer(injector.moment.seconds, injector._fire)
        injector._timer.daemon = True
        injector._timer.start()
      if injector.moment.calls is not None or injector.moment.seconds is None:
        sys.setprofile(injector._profile)   # (without a moment: counting, to calibrate)
      t0 = time.monotonic()
      try:
        return real(*args, **kwargs)
      finally:
        sys.setprofile(None)
        injector.calls, injector.seconds = injector._calls, time.monotonic() - t0
        with injector._lock:
          injector._active = False
        if injector._timer is not None:
          injector._timer.cancel()
        # A signal sent is taken here at the latest, inside the phase.
        deadline = time.monotonic() + 5.0
        while injector.landed and injector.action is None and not injector._handled.is_set() and \
            time.monotonic() < deadline:
          time.sleep(0.001)
    return entry

  @contextlib.contextmanager
  def installed(self):
    owner, name = PHASES[self.phase]
    target = _resolve(owner)
    real = getattr(target, name)
    setattr(target, name, self._entry(real))
    previous = signal.signal(signal.SIGINT, self._on_sigint)
    try:
      yield self
    finally:
      setattr(target, name, real)
      if self._timer is not None:
        self._timer.cancel()
      signal.signal(signal.SIGINT, previous)


# --------------------------------------------------------------------------- checks


def temporary_entries(directory: str) -> tuple:
  return tuple(sorted(n for n in os.listdir(directory) if not n.isdigit())) \
      if os.path.isdir(directory) else ()


def complete_steps(directory: str) -> tuple:
  if not os.path.isdir(directory):
    return ()
  return tuple(sorted(int(n) for n in os.listdir(directory) if n.isdigit() and all(
      os.path.isdir(os.path.join(directory, n, d)) for d in ("arrays", "meta"))))


def check_checkpoints(out: Outcome, scn: Scenario, directory: str, saved: tuple) -> None:
  """Fills ``lost``, ``checkpoints_err`` and ``temporary``: every checkpoint complete before
  the fault and among the newest ``keep`` at the end is there; each there restores to the
  ``jax.jit`` state of its step."""
  refs = reference(scn.steps)
  there = complete_steps(directory)
  keep_from = sorted(set(saved) | set(there))[-scn.keep:] if scn.keep else ()
  out.lost = tuple(s for s in saved if s in keep_from and s not in there)
  c = case()
  for s in there:
    got = harpjax.restore_checkpoint(directory, c.state, step=s)
    out.checkpoints_err = max(out.checkpoints_err, max_rel_err(refs[s], got))
  out.temporary = temporary_entries(directory)


def _threads() -> set:
  return {t for t in threading.enumerate() if t.is_alive()}


def _children() -> set[int]:
  """Child processes still running (an exited one not yet reaped is not)."""
  try:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
      pids = {int(p) for p in f.read().split()}
  except OSError:
    return set()
  return {p for p in pids if _running(p)}


def _running(pid: int) -> bool:
  """Running, and not one of multiprocessing's per-process servers (its fork server and
  resource tracker, started on first use and kept until exit)."""
  try:
    with open(f"/proc/{pid}/status") as f:
      if "\nState:\tZ" in f.read():
        return False
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      cmdline = f.read()
  except OSError:
    return False
  return not re.search(rb"multiprocessing\.(forkserver|resource_tracker)", cmdline)


def leftovers(threads_before: set, children_before: set, wait_s: float = 120.0) -> tuple:
  """Threads and child processes started since the snapshot and still alive after up to
  ``wait_s`` (a compilation already running when Ctrl-C came finishes in its thread first)."""
  deadline = time.monotonic() + wait_s
  while True:
    threads = [t for t in _threads() - threads_before if not _ignored(t)]
    procs = sorted(_children() - children_before)
    if (not threads and not procs) or time.monotonic() > deadline:
      return tuple([f"thread {t.name}" for t in threads] + [f"process {p}" for p in procs])
    time.sleep(0.05)


def _ignored(t: threading.Thread) -> bool:
  # Threads of libraries started once per process on first use (not per run): Ray's client,
  # JAX's and asyncio's executors that stay for reuse.
  return bool(re.match(r"(ray_|Thread-\d+ \(_run_loop\)|.*ray.*|.*jax_.*|tqdm_monitor)",
                       t.name or ""))


# --------------------------------------------------------------------------- trials


def calibrate(phase: str, scn: Scenario, nth: int = 1) -> tuple[int, float]:
  """``(main-thread calls, seconds)`` of the ``nth`` run of ``phase`` in undisturbed trials
  (two counting the calls, one timing the phase without counting, which slows it): the
  ranges moments are drawn from."""
  if scn.runtime == "ray":
    ensure_ray()
  figures = []
  # Counted twice (the first run also fills the process's caches, as the trials before a
  # trial do: the fewer calls are kept), then timed.
  for moment in (Moment(nth=nth), Moment(nth=nth), Moment(nth=nth, seconds=1e9)):
    root = tempfile.mkdtemp(prefix="harpjax-faults-")
    directory = os.path.join(root, "ck")
    injector = Injector(phase, moment)
    step = None
    try:
      prepare(scn, directory)
      with injector.installed():
        step, _ = train(scn, directory)
      step.checkpointer.wait()
    finally:
      if step is not None:
        _shutdown(step)
      shutil.rmtree(root, ignore_errors=True)
    figures.append(injector)
  return min(figures[0].calls, figures[1].calls), figures[2].seconds


def ensure_ray() -> None:
  """Ray started once for this process (its own threads and processes are not a trial's)."""
  from harpjax.runtime import ray_runtime
  ray_runtime.init_ray(num_cpus=4)


def in_process_trial(phase: str, scn: Scenario, seed: int, moment: Moment | None = None,
                     fault: str = "sigint", kill_after_s: float | None = None) -> Outcome:
  """One trial in this process, retried until training completes (see the module docstring):
  ``sigint`` in ``phase`` (in ``"recovery"``, after a stage's actor was killed ``kill_after_s``
  into the second step), or ``kill_worker`` during the run (in ``"plan"``: a planner worker
  process, ``kill_after_s`` after the first one started, from the moment on)."""
  rng = random.Random(seed)
  moment = moment or Moment.draw(rng)
  out = Outcome(phase, fault, seed)
  if scn.runtime == "ray":
    ensure_ray()
  threads, children, actors = _threads(), _children(), _live_actors()
  root = tempfile.mkdtemp(prefix="harpjax-faults-")
  directory = os.path.join(root, "ck")
  t0 = time.monotonic()
  step = None
  try:
    prepare(scn, directory)
    saved = complete_steps(directory)
    if fault == "sigint":
      injector = Injector(phase, moment, lambda: complete_steps(directory))
      retry = Retrier(injector)
      killer = (_ActorKiller(rng, kill_after_s, lambda: None, scn.steps)
                if phase == "recovery" else None)
      with injector.installed():
        step, state = train(scn, directory, retry, killer and killer.step_done)
      if killer is not None:
        killer.stop()
      out.landed, out.interrupts = injector.landed, retry.interrupts
      out.swallowed = int(injector._handled.is_set() and not retry.interrupts)
      out.latency_s = max(retry.latencies) if retry.latencies else None
      saved = injector.saved if injector.landed else saved
    elif phase == "plan":   # kill_worker: a planner worker process killed (kill -9)
      injector = Injector(phase, moment,
                          action=lambda: _kill_planner_worker(after_s=kill_after_s or 0.0))
      with injector.installed():
        step, state = train(scn, directory)
      out.landed = injector.landed
    else:   # kill_worker: a stage's actor killed (kill -9) at a moment of the run
      killer = _ActorKiller(rng, kill_after_s, lambda: complete_steps(directory), scn.steps)
      step, state = train(scn, directory, on_step=killer.step_done)
      killer.stop()
      out.landed = killer.killed
      saved = killer.saved if killer.killed else saved
    out.saved = saved or ()
    out.recovered = step.steps_done == scn.steps
    out.recoveries = len(getattr(step, "recoveries", ()))
    step.checkpointer.wait()
    out.max_err = max_rel_err(reference(scn.steps)[-1], state)
    check_checkpoints(out, scn, directory, saved)
  finally:
    if step is not None:
      _shutdown(step)
    if scn.runtime == "ray":
      from harpjax.runtime import ray_runtime
      ray_runtime.release_pool()
    out.leaked = leftovers(threads, children) + tuple(
        name for key, name in _live_actors().items() if key not in actors)
    shutil.rmtree(root, ignore_errors=True)
    out.seconds = time.monotonic() - t0
  return out


class _ActorKiller:
  """Kills one stage actor's process (SIGKILL) ``after_s`` into the run after the first step
  (between steps or inside one), before the last step begins (the state the run ends with is
  on live workers: a lost worker is recovered inside a step)."""

  def __init__(self, rng: random.Random, after_s: float | None, snapshot: Callable,
               steps: int):
    self.rng, self.after_s, self.snapshot, self.steps = rng, after_s, snapshot, steps
    self.killed, self.saved = False, None
    self._timer: threading.Timer | None = None

  def step_done(self, step) -> None:
    if step.steps_done == self.steps - 1:
      self.stop()
    if self._timer is not None or step.steps_done < 1:
      return
    runner = next(p.runner for p in step._cache.values() if p.runner is not None)
    stage = self.rng.randrange(runner.num_stages)
    delay = self.after_s if self.after_s is not None else self.rng.uniform(0.0, 0.5)
    self._timer = threading.Timer(delay, self._kill, (_actor_pid(runner, stage),))
    self._timer.daemon = True
    self._timer.start()

  def _kill(self, pid: int) -> None:
    self.saved = self.snapshot()
    os.kill(pid, signal.SIGKILL)
    self.killed = True

  def stop(self) -> None:
    if self._timer is not None:
      self._timer.join()


def _kill_planner_worker(wait_s: float = 10.0, after_s: float = 0.0) -> bool:
  """Kills (SIGKILL) a worker process of the planner's pool ``after_s`` after the first one
  runs; whether one was still running then."""
  import multiprocessing
  deadline = time.monotonic() + wait_s
  while time.monotonic() < deadline:
    if multiprocessing.active_children():
      if after_s > 0:
        time.sleep(after_s)
      for p in multiprocessing.active_children():
        try:
          os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:   # it ended in between
          continue
        return True
      return False
    time.sleep(0.001)
  return False


def _actor_pid(runner, stage: int) -> int:
  import ray
  return ray.get(runner._backend.actors[stage][0].info.remote(), timeout=60)["pid"]


def _live_actors() -> dict:
  """Actor id -> ``"actor <class>"`` of the actors this Ray instance runs (a trial's leak is
  one alive after it that was not before it: an earlier test of the same process may have
  left its own)."""
  if "ray" not in sys.modules:
    return {}
  import ray
  if not ray.is_initialized():
    return {}
  try:
    from ray.util.state import list_actors
    alive = [a for a in list_actors(filters=[("state", "=", "ALIVE")], timeout=30)]
  except Exception:  # noqa: BLE001 -- the state API needs Ray's dashboard: count by hand
    alive = [a for a in ray._private.state.actors().values() if a.get("State") == "ALIVE"]
  key = lambda a: getattr(a, "actor_id", None) or a.get("ActorID") or id(a)
  return {key(a): f"actor {getattr(a, 'class_name', None) or a.get('ActorClassName')}"
          for a in alive}


# --------------------------------------------------------------------------- kill -9


CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child.py")


def child_env() -> dict:
  return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path),
              JAX_PLATFORMS="cpu",
              XLA_FLAGS="--xla_force_host_platform_device_count=8")


def kill_process_trial(scn: Scenario, seed: int, kill_at_line: int | None = None,
                       delay_s: float | None = None, timeout_s: float = 600.0) -> Outcome:
  """``kill -9`` of the training process at a seeded moment (after its ``kill_at_line``-th
  progress line, then ``delay_s``), then a new process that resumes and finishes."""
  rng = random.Random(seed)
  out = Outcome("run", "kill_process", seed)
  root = tempfile.mkdtemp(prefix="harpjax-faults-")
  directory = os.path.join(root, "ck")
  final = os.path.join(root, "final.npz")
  args = [sys.executable, CHILD, directory, final, json.dumps(dataclasses.asdict(scn))]
  t0 = time.monotonic()
  try:
    proc = subprocess.Popen(args, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    lines = []
    target = kill_at_line if kill_at_line is not None else rng.randint(1, scn.steps + 1)
    delay = delay_s if delay_s is not None else rng.uniform(0.0, 0.3)
    try:
      for line in proc.stdout:
        lines.append(line.strip())
        if len(lines) >= target:
          break
      time.sleep(delay)
      out.saved = complete_steps(directory)
      proc.kill()
      out.landed = proc.wait(timeout=60) == -signal.SIGKILL
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
    res = subprocess.run(args, env=child_env(), capture_output=True, text=True, cwd=ROOT,
                         timeout=timeout_s)
    out.restarts = 1
    if res.returncode != 0:
      raise AssertionError(f"the restarted run failed:\n{res.stderr[-4000:]}")
    resumed = int(re.search(r"resumed (\d+)", res.stdout).group(1))
    out.recovered = resumed >= max(out.saved, default=0)
    with np.load(final) as data:
      got = [data[f"leaf_{i}"] for i in range(len(data.files))]
    want = jax.tree_util.tree_leaves(reference(scn.steps)[-1])
    out.max_err = max_rel_err(want, got)
    check_checkpoints(out, scn, directory, out.saved)
    out.leaked = tuple(f"process {p}" for p in _stragglers(root))
  finally:
    shutil.rmtree(root, ignore_errors=True)
    out.seconds = time.monotonic() - t0
  return out


def _stragglers(root: str) -> list[int]:
  """Processes still running the child script on ``root``."""
  pids = []
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          if root.encode() in f.read():
            pids.append(int(pid))
      except OSError:
        pass
  return pids


# --------------------------------------------------------------------------- the command line


INTERRUPT_LINE = INTERRUPT_MESSAGE


def _plan_command(root: str) -> list[str]:
  return [sys.executable, "-m", "harpjax", "plan", "--cluster", DEMO_CLUSTER, "--model",
          "gpt-tiny", "-B", "4", "--no-progress", "--json", os.path.join(root, "plan.json")]


def cli_seconds() -> float:
  """Seconds ``python -m harpjax plan`` takes here undisturbed (what Ctrl-C delays range
  over)."""
  root = tempfile.mkdtemp(prefix="harpjax-faults-")
  t0 = time.monotonic()
  try:
    subprocess.run(_plan_command(root), env=child_env(), capture_output=True, cwd=ROOT,
                   check=True, timeout=600)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return time.monotonic() - t0


def cli_trial(seed: int, delay_s: float, timeout_s: float = 300.0) -> Outcome:
  """``python -m harpjax plan`` sent SIGINT ``delay_s`` after it started: exit 130 with one
  line (or 0 when the plan was done first), the plan file whole or absent, no process left."""
  out = Outcome("cli", "sigint", seed)
  root = tempfile.mkdtemp(prefix="harpjax-faults-")
  t0 = time.monotonic()
  try:
    proc = subprocess.Popen(_plan_command(root), env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    time.sleep(delay_s)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
      stdout, stderr = proc.communicate(timeout=timeout_s)
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.communicate()
    out.latency_s = time.monotonic() - sent
    out.landed = proc.returncode == 130
    lines = [l for l in stderr.splitlines() if l.strip()]
    quiet = "Traceback" not in stderr and (
        proc.returncode == 0 or (proc.returncode == 130 and lines.count(INTERRUPT_LINE) == 1))
    out.recovered = quiet
    out.max_err = 0.0 if quiet else float("inf")
    if not quiet:
      out.detail = f"exit status {proc.returncode}; stderr: {stderr[-3000:]}"
    plan_file = os.path.join(root, "plan.json")
    if os.path.exists(plan_file):   # written whole or not at all
      harpjax.load_plan(plan_file)
    out.leaked = tuple(f"process {p}" for p in _stragglers(root))
  finally:
    shutil.rmtree(root, ignore_errors=True)
    out.seconds = time.monotonic() - t0
  return out
