"""User-facing errors.

Every mistake a user can make (a malformed cluster file, a plan that does not fit, a batch that
does not split into microbatches) raises a subclass of :class:`HarpjaxError` whose message says
which object, which value and what to change. ``assert`` is kept for internal invariants.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import sys

INTERRUPTED = 130
"""Exit status of the command line after Ctrl-C (128 + SIGINT, what shells report)."""

INTERRUPT_MESSAGE = "interrupted (Ctrl-C): stopped"
"""The one line the command line prints on Ctrl-C."""


def exit_on_interrupt_while_starting() -> None:
  """``python -m harpjax``: Ctrl-C while the package is imported (JAX, Flax: seconds) ends the
  process at once with :data:`INTERRUPTED` and :data:`INTERRUPT_MESSAGE`, as it does once the
  command runs (``harpjax.cli.run`` then takes Ctrl-C over); otherwise nothing."""
  argv = list(getattr(sys, "orig_argv", ()))
  if "-m" not in argv or argv[argv.index("-m") + 1:argv.index("-m") + 2] != ["harpjax"]:
    return
  if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:   # a background job: keep it so
    return

  def stop(signum, frame):
    os.write(2, (INTERRUPT_MESSAGE + "\n").encode())
    os._exit(INTERRUPTED)

  signal.signal(signal.SIGINT, stop)


class HarpjaxError(Exception):
  """Base class of every error harpjax raises for bad input."""


class ClusterSpecError(HarpjaxError, ValueError):
  """The cluster description is malformed.

  The message names the offending field (``subclusters[1].gpu``, ``links[0].between``...).
  Fix the YAML file or the arguments of :class:`harpjax.Cluster`.
  """


class BandwidthCurveError(ClusterSpecError):
  """A link's bandwidth by message size is malformed.

  A ``links`` entry's ``gbps_by_size`` is a list of ``[bytes, gbps]`` pairs, sizes strictly
  increasing, both finite and > 0 (e.g. ``[[1.0e6, 2.5], [1.0e8, 9.4]]``); between two sizes
  the bandwidth is interpolated linearly in ``log2(bytes)``, beyond them it is the nearest
  point's (docs/cluster.md, "Bandwidth by message size").
  """


class UnknownGPUError(ClusterSpecError):
  """A GPU type is not in the built-in catalog and was not declared by the user.

  Use one of the catalog names (``harpjax.cluster.GPU_CATALOG``) or declare the GPU under
  ``gpus:`` in the cluster file with its peak TFLOP/s, memory and memory bandwidth.
  """


class OptionsError(HarpjaxError, ValueError):
  """A mistake in the options: the base of the three kinds, each its own class.

  * :class:`InvalidOptionError`: a field has a value it cannot take;
  * :class:`UnknownOptionError`: an option was given by a name its class does not have;
  * :class:`OptionConflictError`: two options contradict, or one was given where it does
    not apply.

  The message names the option's class and field (``RayRuntime.fetch='most'``) and what to
  change. The option classes are exported from :mod:`harpjax` and listed, with the phase that
  reads each, in ``docs/options.md``.
  """


class PlanError(HarpjaxError, ValueError):
  """A pipeline plan is invalid: layer ranges, submeshes, logical meshes or devices."""


class InvalidOptionError(OptionsError, PlanError):
  """A field of an option class has a value it cannot take (``SolveOptions.eps=-1``,
  ``LayerOptions.criterion='size'``, ``Emulation.time_scale=0``).

  Every option class raises it from its constructor, its message naming the class, the field,
  the value given and the values it takes (``"ProfileOptions.source='guess'; choose one of
  jaxpr, analytic, measured, imported"``). Change that field.

  It is also a :class:`PlanError`: the planner's and the runtime's option classes raised
  ``PlanError`` for a bad value in earlier releases, and ``except PlanError`` keeps catching
  it (as ``except OptionsError`` and ``except ValueError`` do).
  """


def check_count(where: str, value, minimum: int = 0, *, allow_none: bool = False) -> None:
  """Raises :class:`InvalidOptionError` unless ``value`` is an integer (not a bool) of at
  least ``minimum`` (or ``None`` where ``allow_none``); ``where`` names the option
  (``"LayerOptions.z"``)."""
  if value is None and allow_none:
    return
  try:
    ok = not isinstance(value, bool) and int(value) == value and value >= minimum
  except (TypeError, ValueError, OverflowError):
    ok = False
  if not ok:
    raise InvalidOptionError(f"{where}={value!r} must be an integer >= {minimum}"
                             + (" or None" if allow_none else ""))


def check_number(where: str, value, low: float, high: float = math.inf, *,
                 low_open: bool = False, high_open: bool = False, finite: bool = True,
                 allow_none: bool = False) -> None:
  """Raises :class:`InvalidOptionError` unless ``value`` is a real number (not a bool) in the
  interval from ``low`` to ``high`` (each end closed unless ``*_open``), finite unless
  ``finite=False`` (then ``inf`` is allowed where ``high`` is), or ``None`` where
  ``allow_none``; ``where`` names the option (``"SolveOptions.eps"``)."""
  if value is None and allow_none:
    return
  try:
    v = float(value)
    ok = (not isinstance(value, bool) and v == value and not math.isnan(v)
          and (not finite or math.isfinite(v))
          and (low < v if low_open else low <= v) and (v < high if high_open else v <= high))
  except (TypeError, ValueError, OverflowError):
    ok = False
  if not ok:
    if high == math.inf:
      span = f"a {'finite ' if finite else ''}number {'>' if low_open else '>='} {low:g}"
    else:
      span = (f"a number in {'(' if low_open else '['}{low:g}, {high:g}"
              f"{')' if high_open else ']'}")
    raise InvalidOptionError(f"{where}={value!r} must be {span}"
                             + (" or None" if allow_none else ""))


def check_choice(where: str, value, choices) -> None:
  """Raises :class:`InvalidOptionError` unless ``value`` is one of ``choices``."""
  try:
    ok = value in tuple(choices)
  except (TypeError, ValueError):
    ok = False
  if not ok:
    raise InvalidOptionError(f"{where}={value!r}; choose one of {tuple(choices)}")


def check_flag(where: str, value) -> None:
  """Raises :class:`InvalidOptionError` unless ``value`` is ``True`` or ``False``."""
  if not isinstance(value, bool):
    raise InvalidOptionError(f"{where}={value!r} must be True or False")


class UnknownOptionError(OptionsError, TypeError):
  """An option was given by a name its class does not have (a key of a ``runtime_options``
  dict, a keyword of an option class). The message lists the names it has; an option of
  another phase belongs on that phase's class (planning: :class:`harpjax.AutoPlan`; running:
  :class:`harpjax.LocalRuntime` or :class:`harpjax.RayRuntime`)."""


class OptionConflictError(OptionsError):
  """Two options contradict, or an option was given where it does not apply.

  Every choice is made in one place: the planner's options (``AutoPlan``) apply only when
  there is no plan to follow, a given plan's schedule and H-1F1B tolerance are the plan's own
  (``ManualPlan(schedule=..., eps=...)``), elastic recovery needs the Ray runtime and a
  checkpoint. The message names both options and says which one to keep.
  """


class NotEnoughDevicesError(HarpjaxError):
  """The cluster (or a plan) needs more devices than this machine provides."""


class ScheduleError(HarpjaxError, ValueError):
  """A schedule table is invalid or deadlocks; the message shows the table and the bad step."""


class MicrobatchError(HarpjaxError, ValueError):
  """The batch cannot be split into the requested number of microbatches."""


class TraceError(HarpjaxError, ValueError):
  """The train step cannot be traced into a pipelined region and an apply-gradient part.

  Typical causes: the step never calls ``harpjax.value_and_grad``/``harpjax.grad``, calls it
  more than once, or the loss function behaves differently for a microbatch than for the batch.
  """


class BatchCouplingError(TraceError):
  """The step's examples meet in a way microbatches cannot reproduce, and exactness was asked
  for (``auto_parallel(batch_coupling="error")``), or the per-microbatch result would be
  meaningless (values from the batch's data used as positions of the batch's examples, such as
  the labels of an in-batch contrastive loss passed in with the data).

  The message names each place (operation, the model's source line, module path) and what
  differs. Make the loss a sum or mean over examples (a denominator computed from the batch's
  data alone is fine: harpjax computes it on the whole batch), compute in-batch targets from
  positions inside the loss function, or accept per-microbatch semantics with
  ``batch_coupling="per_microbatch"``.
  """


class BatchCouplingWarning(UserWarning):
  """The step's examples meet where microbatches cannot reproduce the whole batch (an in-batch
  contrastive loss, batch statistics, a capacity decided over the batch's tokens): each
  microbatch computes those over its own examples, as any pipeline does, and the step equals
  the average of ``jax.jit`` run on each microbatch rather than ``jax.jit`` of the batch. The
  message names each place. Silence it with ``auto_parallel(batch_coupling="per_microbatch")``
  once this is what you want."""


class UnsupportedError(HarpjaxError, NotImplementedError):
  """The model uses a construct harpjax does not support yet; the message names it."""


class MemoryKindError(UnsupportedError):
  """Values were to be kept in a memory the devices do not have.

  Keeping a stage's optimizer state (or residuals) in host memory (``StageSpec(offload=True)``,
  ``harpjax.OffloadOptions(optimizer_state=True).apply(plan)``, or the planner's choice) needs
  the ``"pinned_host"`` memory kind on the stage's devices (JAX's memory kinds: GPUs and TPUs
  have it, and so do CPUs in recent jaxlib). The message names the stage, its devices' platform
  and the memory kinds they have. Turn the offload off for that stage (its
  ``StageSpec.offload``, or ``SolveOptions(offload=False)`` for the planner) or run on a
  backend with host memory.
  """


class ZebraPlanOnlyError(UnsupportedError):
  """The plan has a zebra stage (attention and experts on two groups of GPUs,
  :attr:`harpjax.compiler.plan.StageSpec.zebra`) in a form the planner can choose and score
  but the runtime does not run yet: on the Ray runtime, under an interleaved schedule, with a
  ZeRO level or offloaded optimizer state or residuals, or with experts moved onto its
  attention group (a non-zero ``ZebraGroup.offload``) that cannot run on a part of them (a
  parameter or an output without an experts' axis). The local runtime runs the rest
  (:mod:`harpjax.compiler.stages.zebra`). The message names the stage and what to change;
  or plan without zebra stages (``MixedOptions(zebra="off")``, the default of
  ``auto_parallel``), or keep the plan to read (``harpjax plan``)."""


class InfeasiblePlanError(HarpjaxError):
  """No plan satisfies the constraints; the message says which constraint and by how much."""


class CostTablesError(HarpjaxError, ValueError):
  """Cost tables are malformed (wrong shapes, negative times, ...)."""


class PublishedDataError(HarpjaxError, FileNotFoundError):
  """Published measurements (the Zorse per-layer data behind ``source="imported"`` and the
  calibration) are missing, unreadable, or hold none for the model asked.

  ``ProfileOptions(imported_data_dir=...)`` (``harpjax plan --data-dir``) names the directory
  of ``zorse_model_latencies.json`` and ``zorse_model_stats.json`` (by default
  ``../shared/data`` beside the repository); the models they measure are listed in the
  message. Profile with ``source="jaxpr"`` (the default) when there are none for your model.
  """


class RuntimeFailure(HarpjaxError, RuntimeError):
  """A stage worker failed or timed out; the message names the stage."""


def interruptible_kernel(fn):
  """Decorates a Python function that runs a Numba kernel compiled with ``nogil=True``.

  Ctrl-C while such a kernel runs is handled when it gives the GIL back, inside Numba's
  dispatcher, which then returns its result with the ``KeyboardInterrupt`` pending: CPython
  reports ``SystemError: CPUDispatcher(...) returned a result with an exception set``, chained
  to it. The decorated function raises the ``KeyboardInterrupt`` itself.
  """
  @functools.wraps(fn)
  def call(*args, **kwargs):
    with interrupts_as_keyboard():
      return fn(*args, **kwargs)
  return call


def interrupted(e: BaseException) -> bool:
  """Whether ``e`` is a ``SystemError`` of a C callback or Numba dispatcher that returned with
  a ``KeyboardInterrupt`` pending (the interrupt anywhere in its chain of causes)."""
  seen = set()
  x = e if isinstance(e, SystemError) else None
  while x is not None and id(x) not in seen:
    seen.add(id(x))
    if isinstance(x, KeyboardInterrupt):
      return True
    x = x.__cause__ or x.__context__
  return False


@contextlib.contextmanager
def interrupts_as_keyboard():
  """Raises ``KeyboardInterrupt`` for a Ctrl-C that came back as such a ``SystemError``
  (:func:`interrupted`), inside the block; other errors pass unchanged."""
  try:
    yield
  except SystemError as e:
    if interrupted(e):
      raise KeyboardInterrupt from None
    raise
