"""The memory model of a stage: what one device holds in each phase of a step, at every ZeRO
level, with the optimizer state or the residuals in host memory (the formulas of
:mod:`harpjax.compiler.profile.zero`'s docstring). One function, :func:`stage_memory`, serves
the planner (:func:`harpjax.compiler.plan.variants.memory_model`, the profiler's tables) and
the compiled stages' report (:func:`harpjax.compiler.stages.memory_report`); it takes numbers
or arrays of them."""

from __future__ import annotations

import dataclasses

import numpy as np

from harpjax.errors import HarpjaxError

__all__ = ["ZERO_LEVELS", "StageMemory", "stage_memory", "check_level",
           "stage_draw_workspace_bytes", "runs_replicas"]

ZERO_LEVELS = (0, 1, 2, 3)


def check_level(zero: int, dp: int) -> None:
  """Raises :class:`~harpjax.errors.HarpjaxError` unless ``zero`` is a ZeRO level and ``dp``
  a positive integer (or an array of them)."""
  if zero not in ZERO_LEVELS:
    raise HarpjaxError(f"zero={zero!r}: choose one of {ZERO_LEVELS}")
  d = np.asarray(dp)
  if d.dtype == object or not np.all((np.floor(d) == d) & (d >= 1)):
    raise HarpjaxError(f"dp={dp!r} must be a positive integer")


def runs_replicas(dp, rows: int | None = None, ep=1):
  """Whether a stage's ``dp`` replicas accumulate their own gradients and reduce them once per
  step (:mod:`harpjax.compiler.stages.replicas`), as the runtime decides it at ZeRO levels 0
  and 1: more than one replica, no expert parallelism, and microbatch rows that split evenly
  over the replicas. Otherwise the stage runs as one SPMD program whose backward all-reduces
  the whole gradient every microbatch (the zoo's first layer on four devices with two rows
  per microbatch).

  Args:
    dp: the data-parallel degree (a number or an array).
    rows: the microbatch's rows (``b``); ``None``: unknown, taken to split evenly.
    ep: the expert-parallel degree (a number or an array like ``dp``).

  Returns:
    A bool, or a bool array shaped like ``dp``.
  """
  d = np.asarray(dp)
  ok = (d > 1) & (np.asarray(ep) == 1)
  if rows is not None:
    ok = ok & (np.mod(int(rows), np.where(d >= 1, d, 1).astype(np.int64)) == 0)
  return bool(ok) if np.ndim(ok) == 0 else ok


@dataclasses.dataclass(frozen=True)
class StageMemory:
  """Per-device bytes of one stage at one ZeRO level (see the module docstring).

  Attributes:
    param_bytes: parameters held.
    grad_bytes: gradient accumulator held.
    opt_bytes: optimizer state held.
    act_bytes: residuals of one in-flight microbatch.
    fwd_workspace_bytes: what a forward writes besides its residuals (outputs, temporaries).
    bwd_workspace_bytes: what a backward writes besides the accumulator (gradient, its
      reduction, activation cotangents, temporaries).
    update_workspace_bytes: the update's temporaries (its results counted apart).
    shared_bytes: of ``param_bytes``, what another stage owns and updates (so much the same
      share of ``grad_bytes``).
    opt_offloaded: the optimizer state stays in host memory between updates: the pipeline
      holds none of it on the device; the update brings it in and writes it back.
    act_offloaded: the residuals of the microbatches in flight stay in host memory between
      their forward and their backward: the device holds at most two (the one a forward
      writes or a backward reads, and the one on its way).
    updates: the devices run the optimizer update (not so a mixed-type stage's groups but
      the first, which receive the parameters the first group updated).
    replicas: the ``dp`` replicas accumulate their own gradients and reduce them once per
      step (:mod:`harpjax.compiler.stages.replicas`): the backward writes no reduction, and the
      step's reduction writes the reduced gradients beside the accumulator (a bool, or a bool
      array where the other fields are arrays).
  """
  param_bytes: float
  grad_bytes: float
  opt_bytes: float
  act_bytes: float
  fwd_workspace_bytes: float
  bwd_workspace_bytes: float
  update_workspace_bytes: float
  shared_bytes: float = 0.0
  opt_offloaded: bool = False
  act_offloaded: bool = False
  updates: bool = True
  replicas: bool | np.ndarray = False

  @property
  def state_bytes(self) -> float:
    """Parameters, accumulator and optimizer state (wherever it is held)."""
    return self.param_bytes + self.grad_bytes + self.opt_bytes

  def pipeline_bytes(self, in_flight: int) -> float:
    """Peak while the pipeline runs with ``in_flight`` microbatches' residuals held."""
    held = self.state_bytes - (self.opt_bytes if self.opt_offloaded else 0.0)
    if self.act_offloaded:
      in_flight = min(in_flight, 2)
    return held + in_flight * self.act_bytes + np.maximum(self.fwd_workspace_bytes,
                                                          self.bwd_workspace_bytes)

  def update_bytes(self) -> float:
    """Peak of the optimizer update: the state, and the new parameters and optimizer state."""
    with np.errstate(divide="ignore", invalid="ignore"):
      own = np.where(self.param_bytes > 0,
                     1.0 - self.shared_bytes / np.where(self.param_bytes > 0,
                                                        self.param_bytes, 1.0), 1.0)
    return (2 * own * self.param_bytes + own * self.grad_bytes + 2 * self.opt_bytes
            + self.update_workspace_bytes)

  def reduce_bytes(self) -> float:
    """Peak of the replicas' reduction after the last backward: the state, and the reduced
    gradients (0 without :attr:`replicas`)."""
    if not np.any(self.replicas):
      return 0.0
    held = self.state_bytes - (self.opt_bytes if self.opt_offloaded else 0.0)
    return np.where(self.replicas, held + self.grad_bytes, 0.0)

  def peak_bytes(self, in_flight: int) -> float:
    """The stage's per-device peak over a step."""
    pipeline = np.maximum(self.pipeline_bytes(in_flight), self.reduce_bytes())
    if not self.updates:
      return pipeline
    return np.maximum(pipeline, self.update_bytes())

  def fixed_bytes(self) -> float:
    """What the pipeline holds besides the residuals of the microbatches in flight (the
    planner's fixed bytes of a stage: :meth:`pipeline_bytes` is ``fixed_bytes() + N *
    act_bytes``, at most two microbatches' with the residuals offloaded, counted here)."""
    if self.act_offloaded:
      return self.pipeline_bytes(0) + 2 * self.act_bytes
    return self.pipeline_bytes(0)

  def step_bytes(self) -> float:
    """The peak of the phases that hold no residual: the replicas' reduction and the
    optimizer update (where the devices run it)."""
    return np.maximum(self.reduce_bytes(), self.update_bytes() if self.updates else 0.0)


def stage_memory(*, param_bytes: float, opt_bytes: float, act_bytes: float, dp: int,
                 zero: int, grad_bytes: float | None = None, out_bytes: float = 0.0,
                 workspace_bytes: float = 0.0, reduce_scatter: bool = False,
                 shared_param_bytes: float = 0.0,
                 offload_optimizer: bool = False,
                 offload_activations: bool = False, updates: bool = True,
                 replicas: bool = False, grad_out_bytes: float | None = None,
                 bwd_workspace_bytes: float | None = None) -> StageMemory:
  """Per-device memory of a stage at ZeRO level ``zero``.

  Args:
    param_bytes: parameter bytes a device holds at level 0 (after any ``tp`` split).
    opt_bytes: optimizer-state bytes a device holds at level 0.
    act_bytes: residual bytes of one microbatch per device.
    dp: data-parallel degree of the stage.
    zero: the level, 0 to 3.
    grad_bytes: gradient-accumulator bytes at level 0 (default ``param_bytes``).
    out_bytes: bytes of the forward's outputs per microbatch per device (what it sends on).
    workspace_bytes: the layers' temporaries (the cost tables' largest ``temp_bytes``); with
      ``bwd_workspace_bytes``, the forward's alone (the largest ``fwd_temp_bytes``).
    reduce_scatter: the backend turns "all-reduce, keep my part" into a reduce-scatter
      (XLA:GPU does; XLA:CPU does not).
    shared_param_bytes: of ``param_bytes``, the parameters another stage owns (held, with
      their gradient, through the pipeline; updated by their owner).
    offload_optimizer: the optimizer state is kept in host memory between updates
      (:class:`harpjax.OffloadOptions`).
    offload_activations: the residuals wait for their backward in host memory
      (``OffloadOptions(activations=True)``; :func:`activation_offload_time_s`).
    updates: the devices run the optimizer update (:attr:`StageMemory.updates`).
    replicas: the replicas reduce their gradients once per step (:attr:`StageMemory.replicas`;
      levels 0 and 1 only; a bool or, per entry, a bool array: :func:`runs_replicas`). Where
      ``dp > 1`` and they do not, the backward all-reduces the whole gradient every
      microbatch: it writes all of ``grad_bytes`` and the reduction beside it.
    grad_out_bytes: the most gradient bytes a backward writes beside the accumulator before
      adding them in (default: all of ``grad_bytes``). Where the accumulator is donated and
      not reduced in the backward (one device, or replicas at levels 0 and 1), XLA adds each
      layer's gradient in as it goes: the largest layer's (ignored where the backward reduces
      the gradient: it writes the whole of it).
    bwd_workspace_bytes: the backward's temporaries where they differ from the forward's (the
      largest ``bwd_temp_bytes``: the runtime runs the two as executables of their own, and
      a forward's random draws or a backward's recomputation make one much the larger);
      default ``workspace_bytes``.

  Returns:
    The :class:`StageMemory`. Everything is assumed to split evenly over ``dp``; values whose
    dimensions do not divide stay whole in the runtime (small biases, in practice).
  """
  check_level(zero, dp)
  num = lambda x: np.asarray(x, np.float64) if np.ndim(x) else float(x)
  P = num(param_bytes)
  G = P if grad_bytes is None else num(grad_bytes)
  O = num(opt_bytes)
  many = np.asarray(dp) > 1
  gathered = np.where(many, P, 0.0) if zero >= 3 else np.zeros_like(P)
  # the replicas reduce once per step, after the backwards (levels 0 and 1)
  rep = (np.asarray(replicas, bool) & many) if zero <= 1 else np.zeros_like(many)
  reduced = np.where(many & ~rep, G / dp if zero >= 2 and reduce_scatter else G, 0.0)
  # a backward that reduces the gradient writes all of it first
  g_out = np.where(many & ~rep, G, G if grad_out_bytes is None else num(grad_out_bytes))
  replicas = bool(rep) if np.ndim(rep) == 0 else rep
  ws = num(workspace_bytes)
  ws_b = ws if bwd_workspace_bytes is None else num(bwd_workspace_bytes)
  out = np.asarray(out_bytes, np.float64) if np.ndim(out_bytes) else float(out_bytes)
  scalar = not any(np.ndim(x) for x in (P, G, O, act_bytes, dp, ws, ws_b, out,
                                        shared_param_bytes,
                                        0.0 if grad_out_bytes is None else grad_out_bytes))
  return _as_floats(scalar, StageMemory(
      param_bytes=P / dp if zero >= 3 else P,
      grad_bytes=G / dp if zero >= 2 else G,
      opt_bytes=O / dp if zero >= 1 else O,
      act_bytes=np.asarray(act_bytes, np.float64) if np.ndim(act_bytes) else float(act_bytes),
      fwd_workspace_bytes=out + ws + gathered,
      bwd_workspace_bytes=g_out + np.maximum(reduced, gathered) + ws_b,
      update_workspace_bytes=np.where(many, P / dp, 0.0) if zero in (1, 2) else np.zeros_like(P),
      shared_bytes=num(shared_param_bytes) / (dp if zero >= 3 else 1),
      opt_offloaded=bool(offload_optimizer), act_offloaded=bool(offload_activations),
      updates=bool(updates), replicas=replicas))


def stage_draw_workspace_bytes(total, largest):
  """XLA:CPU's temporaries for the random draws of a stage's forward (or of a backward that
  recomputes it) whose draws add up to ``total`` bytes, the largest ``largest``: a draw
  depends on the key alone, so the scheduler computes every draw's counters (two buffers of
  the draw's size) first and runs the hash loops one after the other, each writing its two
  state halves; the draws then wait for their readers. While the ``k``-th loop runs, the
  earlier loops' results and the later loops' counters are alive: ``2 * total + 2 * b_k``
  at most, ``2 * total + 2 * largest``. Read off the buffer assignment of the GPT's and
  BERT's stage executables (one draw alone: four times its bytes, three of them temporaries
  and one its result, as :func:`~harpjax.compiler.profile.estimate.random_bits_temp_bytes`
  measures). Takes numbers or
  arrays; ``0`` where there is no draw."""
  total = np.asarray(total, np.float64)
  return np.where(total > 0, 2.0 * total + 2.0 * np.asarray(largest, np.float64), 0.0)


def _as_floats(scalar: bool, m: StageMemory) -> StageMemory:
  """``m`` with plain floats where every input was a number (arrays otherwise)."""
  if not scalar:
    return m
  return dataclasses.replace(m, **{f.name: float(getattr(m, f.name))
                                   for f in dataclasses.fields(m) if f.type == "float"})
