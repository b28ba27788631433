"""The ZeRO level, the optimizer state's place and the residuals' place as per-stage choices of
the planner.

Tables that carry :attr:`~harpjax.compiler.profile.CostTables.opt_mem_bytes` (and optionally
:attr:`~harpjax.compiler.profile.CostTables.gather_time_s`) and/or
:attr:`~harpjax.compiler.profile.CostTables.offload_bandwidth_bytes_per_s` describe, for every
(layer range, subcluster, submesh) entry, what each ZeRO level and host offload would cost.
:func:`expand_variants` turns them into tables whose submesh choices are *variants*
(submesh, ZeRO level, offload, residual offload): a submesh's shape repeats once per variant,
so the device states, the DP, the bounded exact search, the simulator and the brute force see
one more choice per stage and nothing else changes; the plan's stages carry the level and the
offloads of the variant they use (:attr:`~harpjax.compiler.plan.StageSpec.zero`,
:attr:`~harpjax.compiler.plan.StageSpec.offload`,
:attr:`~harpjax.compiler.plan.StageSpec.offload_activations`).

**A variant's numbers** (:func:`variant_arrays`; per device, ``dp`` the entry's data-parallel
degree, ``P`` its ``param_mem_bytes``, ``O`` its ``opt_mem_bytes``, weights and gradients
``W = G = (P - O) / 2``, ``A`` its ``act_mem_bytes``, ``g`` its ``gather_time_s``, ``t`` and
``e`` its stage and end times, ``bw`` the subcluster's ``offload_bandwidth_bytes_per_s``;
:mod:`harpjax.compiler.profile.zero` for the levels, whose functions compute every number
below: the split by :func:`~harpjax.compiler.profile.stage_memory`, the times by
:func:`~harpjax.compiler.profile.zero_stage_times`, the transfers to host memory by
:func:`~harpjax.compiler.profile.offload_time_s`):

* state held: ``W_z + G_z + O_z`` with ``O_z = O / dp`` from level 1, ``G_z = G / dp`` from
  level 2, ``W_z = W / dp`` at level 3; with offload the pipeline holds ``W_z + G_z`` only,
  and the variant is allowed only where ``W_z + G_z + O_z`` fits the device (the update
  brings the state in). Tables that carry the layers' workspace and largest gradient
  (:attr:`~harpjax.compiler.profile.CostTables.workspace_bytes`,
  :attr:`~harpjax.compiler.profile.CostTables.grad_out_bytes`, as the profiler's do) get the
  memory model's numbers instead (:func:`memory_model`, the one
  :func:`~harpjax.compiler.profile.stage_memory`): the fixed bytes at the level (state and
  the pipeline's workspace: a forward's outputs and temporaries, a backward's gradient, its
  reduction and the weights gathered), and the variant is allowed only where the phases after
  the pipeline (the replicas' reduction, the update) fit;
* time per microbatch: ``t``, plus ``2 g`` at level 3 (the weights gathered in the forward
  and again in the backward), plus, from level 2, the gradient's reduce-scatter after every
  backward, ``g`` (the same bytes as the weights' all-gather on the same link) where the
  tables give the once-per-step all-reduce ``y`` (:attr:`~harpjax.compiler.profile.
  CostTables.sync_time_s`; without it the tables' time already holds a gradient reduction
  per microbatch, which is charged for it);
* end of iteration (the simulator's end cost): ``e``, less ``y`` from level 2 (nothing left
  to all-reduce), plus ``g`` at levels 1 and 2 (the updated weights gathered once), plus
  ``2 O_z / bw`` with offload (the state brought in for the update and written back,
  :func:`~harpjax.compiler.profile.offload_time_s`);
* activations per in-flight microbatch: ``A``;
* with the residuals' offload (any level, with or without the optimizer state's; only where
  the tables give ``bw``, and ``opt_mem_bytes`` are not needed): the residuals wait for their
  backward in host memory and the device holds at most two microbatches' worth
  (:func:`~harpjax.compiler.profile.stage_memory` with ``offload_activations=True``). In the
  tables' form, (fixed bytes, bytes per microbatch in flight), that is ``2 A`` more fixed
  bytes and ``0`` per microbatch: exact with two or more microbatches in flight, ``A`` too
  many with one (conservative: such a stage gains nothing from it anyway). The time per
  microbatch grows by ``2 A / bw``
  (:func:`~harpjax.compiler.profile.activation_offload_time_s`: written after the forward,
  read back before the backward; an upper bound, the copies are asynchronous).

**Only the variants that can matter** are kept (:func:`expand_variants` with
``num_microbatches``): a variant is dropped at an entry when another variant of the same
entry has the same time per microbatch, no larger end time and holds at least as many
microbatches in flight (each by its own fixed and per-microbatch bytes, at most ``B`` and
``1 + 3 S`` with ``S`` the most stages that can follow it: one per later layer and per device
left). This is exact: swapping the dropped variant for that one leaves the plan's period and
warm-ups as they were, fits wherever it fitted, and simulates no slower (the simulated time
does not decrease when an end time grows). Variants with a different time per microbatch
(level 3, the residuals' offload) are all kept where they fit: a slower bottleneck stage can
lower the warm-ups of the others and so make a plan fit (the planner's bottleneck rule). Among
the residuals' variants of an entry (all ``0`` bytes per microbatch, so all holding every
microbatch where they fit) this keeps one per time per microbatch: the least end time, so
level 0 without the optimizer state's offload wherever it fits, and level 3's. The first
variant (level 0 without offload, unless excluded) keeps every entry as it is. Where level 0
already holds every microbatch a stage can need, only level 3 and the residuals' offload are
added; tables without ``offload_bandwidth_bytes_per_s`` get no residual variant at all (the
same expanded tables and plans as without the option).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from harpjax.compiler.profile import (activation_offload_time_s, CostTables, offload_time_s,
                                      stage_memory, zero_stage_times)
from harpjax.errors import PlanError
from harpjax.compiler.trace import REMAT_MODES

__all__ = ["expand_variants", "variant_arrays", "variant_step_bytes", "variant_slot",
           "tables_for_stages", "memory_model",
           "has_variant_data", "variant_of", "base_index", "VariantOptions"]


@dataclasses.dataclass(frozen=True)
class VariantOptions:
  """Which variants the planner considers.

  Attributes:
    zero_levels: ZeRO levels a stage may use (a subset of ``(0, 1, 2, 3)``; needs the tables'
      ``opt_mem_bytes`` for anything but ``(0,)``).
    offload: a stage may keep its optimizer state in host memory (needs the tables'
      ``offload_bandwidth_bytes_per_s`` too).
    offload_activations: a stage may keep its residuals in host memory between forward and
      backward (needs the tables' ``offload_bandwidth_bytes_per_s``; not ``opt_mem_bytes``).
  """
  zero_levels: tuple[int, ...] = (0, 1, 2, 3)
  offload: bool = True
  offload_activations: bool = True

  def __post_init__(self):
    try:
      levels = tuple(sorted({int(z) for z in self.zero_levels}))
    except (TypeError, ValueError):
      levels = ()
    if not levels or any(z not in (0, 1, 2, 3) for z in levels) or any(
        isinstance(z, bool) or int(z) != z for z in self.zero_levels):
      raise PlanError(f"zero_levels={self.zero_levels!r} must be a non-empty subset of "
                      "(0, 1, 2, 3)")
    object.__setattr__(self, "zero_levels", levels)
    for name in ("offload", "offload_activations"):
      if not isinstance(getattr(self, name), bool):
        raise PlanError(f"{name}={getattr(self, name)!r} must be True or False")

  def pairs(self, tables: CostTables) -> list[tuple[int, bool, bool]]:
    """The ``(zero, offload, offload_activations)`` variants these options allow on
    ``tables`` (level 0 without offload first when allowed)."""
    levels = self.zero_levels if tables.opt_mem_bytes is not None else (0,)
    host = tables.offload_bandwidth_bytes_per_s is not None
    offload = [False] + ([True] if self.offload and host and tables.opt_mem_bytes is not None
                         else [])
    residuals = [False] + ([True] if self.offload_activations and host else [])
    return [(z, o, r) for r in residuals for o in offload for z in levels]


def has_variant_data(tables: CostTables) -> bool:
  """Whether ``tables`` carry what a variant needs (the optimizer state's bytes, or the link
  to host memory for the residuals) and are not expanded."""
  return tables.variants is None and (tables.opt_mem_bytes is not None
                                      or tables.offload_bandwidth_bytes_per_s is not None)


def variant_arrays(tables: CostTables, k: int, zero: int, offload: bool,
                   offload_activations: bool = False
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """``(time, state bytes, activation bytes, end time, allowed)`` ``[L, L, S_k]`` of every
  entry of subcluster ``k`` under ZeRO level ``zero``, ``offload`` (the optimizer state) and
  ``offload_activations`` (the residuals; the module docstring's equations). ``allowed`` is
  ``False`` where the stage time is not finite, and where the phases after the pipeline (the
  gradient reduction, the optimizer update) do not fit the device: by
  :meth:`~harpjax.compiler.profile.StageMemory.step_bytes` where the tables carry
  ``step_mem_bytes``, else, with offload, where the state does not fit for the update.

  Raises:
    PlanError: the tables lack ``opt_mem_bytes`` (and the level is not 0, or ``offload``), or
      ``offload_bandwidth_bytes_per_s`` with either offload.
  """
  return _variant(tables, k, zero, offload, offload_activations)[:5]


def variant_step_bytes(tables: CostTables, k: int, zero: int, offload: bool = False
                       ) -> np.ndarray | None:
  """``[L, L, S_k]`` peak per device after the pipeline (the gradient reduction, the
  optimizer update) of every entry of subcluster ``k`` at ``zero`` / ``offload`` (``None``:
  the tables do not carry :attr:`~harpjax.compiler.profile.CostTables.step_mem_bytes`)."""
  return _variant(tables, k, zero, offload, False)[5]


def _variant(tables: CostTables, k: int, zero: int, offload: bool, offload_activations: bool):
  t0 = tables.stage_time_s[k]
  P = tables.param_mem_bytes[k]
  a = tables.act_mem_bytes[k]
  e0 = tables.end_time_s[k] if tables.end_time_s is not None else np.zeros_like(P)
  finite = np.isfinite(t0)
  mem = tables.device_memory_bytes[k]
  step = tables.step_mem_bytes[k] if tables.step_mem_bytes is not None else None
  if step is not None:
    finite = finite & (step <= mem)
  if zero == 0 and not offload and not offload_activations:
    return t0, P, a, e0, finite, step
  if (zero or offload) and tables.opt_mem_bytes is None:
    raise PlanError(f"zero={zero}, offload={offload} needs the tables' opt_mem_bytes (the "
                    "optimizer state's part of param_mem_bytes); build the tables with "
                    "optimizer_share=..., or plan with zero 0 and no offload")
  if (offload or offload_activations) and tables.offload_bandwidth_bytes_per_s is None:
    raise PlanError("offload needs the tables' offload_bandwidth_bytes_per_s (the device's "
                    "link to host memory); give SubclusterSpec.offload_bandwidth_bytes_per_s "
                    "(host_memory_gbps in a cluster file)")
  t, state, e, allowed = t0, P, e0, finite
  y = tables.sync_time_s[k] if tables.sync_time_s is not None else None
  if zero or offload:
    O = tables.opt_mem_bytes[k]
    W = G = np.maximum(P - O, 0.0) / 2.0
    L = tables.num_layers
    S = len(tables.submeshes[k])
    if tables.logical_mesh is not None:
      dp = tables.logical_mesh[k][..., 0].astype(np.float64)
    else:
      dp = np.broadcast_to(np.array([n * m for n, m in tables.submeshes[k]], np.float64),
                           (L, L, S))
    g = tables.gather_time_s[k] if tables.gather_time_s is not None else np.zeros_like(P)
    model = memory_model(tables, k, dp, zero, offload)
    # the level's split of the state over dp (the one of stage_memory)
    split = stage_memory(param_bytes=W, grad_bytes=G, opt_bytes=O, act_bytes=0.0, dp=dp,
                         zero=zero)
    state = split.state_bytes if model is None else model.fixed_bytes()
    t, e = zero_stage_times(t0, e0, g, y, zero)
    if model is not None:   # the memory model's reduction and update
      step = model.step_bytes()
      allowed = np.isfinite(t0) & (step <= mem)
    elif offload:
      allowed = finite & (state <= mem)
    if offload:
      e = e + offload_time_s(split.opt_bytes, tables.offload_bandwidth_bytes_per_s[k])
      if model is None:
        state = split.param_bytes + split.grad_bytes
  if offload_activations:
    # At most two microbatches' residuals on the device, as fixed bytes; none per microbatch
    # in flight; both trips over the host link per microbatch.
    t = t + activation_offload_time_s(a, tables.offload_bandwidth_bytes_per_s[k])
    state = state + 2.0 * a
    a = np.zeros_like(a)
  return t, state, a, e, allowed, step


def memory_model(tables: CostTables, k: int, dp: np.ndarray, zero: int, offload: bool = False):
  """The memory model (:func:`~harpjax.compiler.profile.stage_memory`) of every entry of
  subcluster ``k`` at ``zero`` / ``offload``, as ``[L, L, S_k]`` arrays, where the tables carry
  what it needs (:attr:`~harpjax.compiler.profile.CostTables.workspace_bytes` and
  :attr:`~harpjax.compiler.profile.CostTables.grad_out_bytes` beside ``opt_mem_bytes``;
  ``None`` otherwise). The level-0 fixed bytes are ``param_mem_bytes``: the state is what
  remains of them once the workspace is taken off, weights and gradients half each.

  An entry whose ``grad_out_bytes`` exceed its gradient is a data-parallel stage whose
  replicas cannot accumulate their own gradients (the profiler writes twice the gradient
  there: the backward writes the whole gradient and its all-reduce every microbatch). Its
  backward then writes the same at every level (``2 W`` and its temporaries), so the level-0
  workspace ``M = P - O - 2 W`` (the larger of the forward's and the backward's) is kept as
  each phase's at every level. The forward writes neither the gradient nor its reduction:
  it is charged what remains of ``M`` beside them (``M - 2 W``, the backward's temporaries
  or the forward's excess over the backward's writes), and at level 3 the gathered
  parameters besides, which the backward holds in place of the reduction's buffer
  (``max(reduced, gathered)``): the loop model's first stage on four V100s at ZeRO 3 (one
  row per replica) charged ``M + W`` in its forward, 22.7% over XLA's peak (its backward)."""
  if tables.workspace_bytes is None or tables.grad_out_bytes is None or \
      tables.opt_mem_bytes is None:
    return None
  L = tables.num_layers
  P, O = tables.param_mem_bytes[k], tables.opt_mem_bytes[k]
  ws, gout = tables.workspace_bytes[k], tables.grad_out_bytes[k]
  out = np.broadcast_to(tables.boundary_bytes[None, :, None], P.shape).copy()
  out[:, L - 1, :] = 0.0   # the last stage sends nothing on
  with np.errstate(divide="ignore", invalid="ignore"):
    out = out / dp
  W = np.maximum(P - O - np.maximum(out + ws, gout + ws), 0.0) / 2.0
  spmd = (np.asarray(dp) > 1) & (gout > W * (1 + 1e-9))   # all-reduces every microbatch
  M = np.maximum(out, gout) + ws                              # the level-0 workspace
  return stage_memory(param_bytes=W, grad_bytes=W, opt_bytes=O, act_bytes=0.0, dp=dp,
                      zero=zero, out_bytes=np.where(spmd, 0.0, out),
                      workspace_bytes=np.where(spmd, np.maximum(M - 2.0 * W, 0.0), ws),
                      replicas=~spmd,
                      grad_out_bytes=gout if zero <= 1 else None,
                      bwd_workspace_bytes=np.where(spmd, np.maximum(M - 2.0 * W, 0.0), ws),
                      offload_optimizer=offload)


def _capacity(p: np.ndarray, a: np.ndarray, mem: float, cap) -> np.ndarray:
  """Microbatches in flight an entry holds (``0``: not even one), at most ``cap`` (a scalar
  or an array like ``p``)."""
  with np.errstate(divide="ignore", invalid="ignore"):
    n = np.where(a > 0, np.floor((mem - p) / np.where(a > 0, a, 1.0)), cap)
  n = np.where(p <= mem, n, 0)
  return np.clip(n, 0, cap).astype(np.int64)


def expand_variants(tables: CostTables, options: VariantOptions = VariantOptions(),
                    num_microbatches: int | None = None) -> CostTables:
  """Tables whose submesh choices are (submesh, ZeRO level, offload, residual offload)
  variants.

  Args:
    tables: tables with :attr:`~harpjax.compiler.profile.CostTables.opt_mem_bytes` or
      :attr:`~harpjax.compiler.profile.CostTables.offload_bandwidth_bytes_per_s` (else they
      are returned as they are).
    options: the variants allowed.
    num_microbatches: ``B``; given, only the variants that can matter are kept (module
      docstring); ``None`` keeps every variant that fits one microbatch (what the tests'
      brute force enumerates).

  Returns:
    The expanded tables (:attr:`~harpjax.compiler.profile.CostTables.variants` set), or
    ``tables`` itself when nothing but their own entries would be kept.
  """
  if tables.variants is not None:
    raise PlanError("the tables are already expanded into variants")
  pairs = options.pairs(tables)
  if pairs == [(0, False, False)]:
    return tables
  L, K = tables.num_layers, tables.num_subclusters
  B = None if num_microbatches is None else int(num_microbatches)
  changed = pairs[0] != (0, False, False)
  new = {f: [] for f in ("submeshes", "stage_time_s", "param_mem_bytes", "act_mem_bytes",
                         "end_time_s", "logical_mesh", "variants")
         + (("sync_time_s",) if tables.sync_time_s is not None else ())
         + (("step_mem_bytes",) if tables.step_mem_bytes is not None else ())
         + (("remat_modes",) if tables.remat_modes is not None else ())}
  for k in range(K):
    mem = tables.device_memory_bytes[k]
    full = [_variant(tables, k, *var) for var in pairs]
    arrs = [x[:5] for x in full]
    steps = [x[5] for x in full]
    keep = [ok & (p + a <= mem) for _, p, a, _, ok in arrs]
    if B is not None:
      # The most microbatches a stage on layers i..j can hold: B, and 1 + 3 per later stage
      # (at most one per later layer and per device left).
      after = (L - 1 - np.arange(L))[None, :, None]
      left = tables.total_devices - np.array([n * m for n, m in tables.submeshes[k]])
      cap = np.minimum(B, 1 + 3 * np.minimum(after, left[None, None, :]))
      n = [_capacity(p, a, mem, cap).ravel() for _, p, a, _, _ in arrs]
      # Variant v of an entry goes where another variant u of it is as fast, ends no later
      # and holds as many microbatches (strictly better in one, or the earlier of two equal):
      # compared on the entries v still keeps, the equal times first (the rare case).
      keep = [np.array(x).ravel() for x in keep]
      flat_t = [x[0].ravel() for x in arrs]
      flat_e = [x[3].ravel() for x in arrs]
      for v in range(len(pairs)):
        idx = np.flatnonzero(keep[v])
        tv, ev, nv = flat_t[v][idx], flat_e[v][idx], n[v][idx]
        dominated = np.zeros(idx.size, np.bool_)
        for u in range(len(pairs)):
          if u == v:
            continue
          z = np.flatnonzero(flat_t[u][idx] == tv)
          if not z.size:
            continue
          y = idx[z]
          eu, nu = flat_e[u][y], n[u][y]
          strict = (eu < ev[z]) | (nu > nv[z])
          dominated[z] |= keep[u][y] & (eu <= ev[z]) & (nu >= nv[z]) & (strict | (u < v))
        keep[v][idx[dominated]] = False
      keep = [x.reshape(arrs[0][0].shape) for x in keep]
    shapes_k = tables.submeshes[k]
    shapes, labels, parts = [], [], {f: [] for f in new
                                     if f not in ("submeshes", "variants", "remat_modes")}
    modes = []
    lm = tables.logical_mesh[k] if tables.logical_mesh is not None else np.broadcast_to(
        np.array([[n * m, 1] for n, m in shapes_k]), (L, L, len(shapes_k), 2))
    for v, var in enumerate(pairs):
      # The first variant keeps every entry as it is (what no plan can use, the index drops;
      # an infeasible instance is explained by its footprints); the others only what matters.
      slots = [s for s in range(len(shapes_k)) if v == 0 or keep[v][:, :, s].any()]
      if not slots:
        continue
      changed |= v > 0
      t, p, a, e, ok = arrs[v]
      mask = (ok if v == 0 else keep[v])[:, :, slots]
      shapes += [shapes_k[s] for s in slots]
      labels += [var] * len(slots)
      if tables.remat_modes is not None:
        modes += [tables.remat_modes[k][s] for s in slots]
      parts["stage_time_s"].append(np.where(mask, t[:, :, slots], np.inf))
      parts["param_mem_bytes"].append(np.where(mask, p[:, :, slots], 0.0))
      parts["act_mem_bytes"].append(a[:, :, slots])
      parts["end_time_s"].append(np.where(mask, e[:, :, slots], 0.0))
      parts["logical_mesh"].append(lm[:, :, slots])
      if tables.sync_time_s is not None:   # the part of the end time still an all-reduce
        y = tables.sync_time_s[k] if var[0] < 2 else np.zeros_like(e)
        parts["sync_time_s"].append(np.where(mask, np.minimum(y, e)[:, :, slots], 0.0))
      if tables.step_mem_bytes is not None:
        parts["step_mem_bytes"].append(np.where(mask, steps[v][:, :, slots], 0.0))
    new["submeshes"].append(tuple(shapes))
    new["variants"].append(tuple(labels))
    if tables.remat_modes is not None:
      new["remat_modes"].append(tuple(modes))
    for f, col in parts.items():
      arr = np.concatenate(col, axis=2)
      arr.setflags(write=False)   # the tables take it as it is (it is theirs alone)
      new[f].append(arr)
  if not changed:
    return tables
  # Each variant's memory is in its state bytes and its allowed entries (the reduction and
  # the update checked there), so the level-0 split of the bytes goes.
  return tables.replace(opt_mem_bytes=None, gather_time_s=None, workspace_bytes=None,
                        grad_out_bytes=None, **{f: tuple(v) for f, v in new.items()})


def variant_slot(tables: CostTables, k: int, shape: Sequence[int], zero: int = 0,
                 offload: bool = False, offload_activations: bool = False,
                 remat: str | None = None) -> int:
  """Index in ``tables.submeshes[k]`` of submesh ``shape`` under ``(zero, offload,
  offload_activations)`` and, where the tables cost both (:attr:`~harpjax.compiler.profile.
  CostTables.remat_modes`), the remat mode ``remat`` (``None``: ``"none"``; ignored by tables
  of one mode, which price the stage in theirs).

  Raises:
    PlanError: the tables have no such entry (not expanded, or the variant was not kept).
  """
  shape = tuple(int(x) for x in shape)
  want = (int(zero), bool(offload), bool(offload_activations))
  mode = "none" if remat is None else str(remat)
  modes = tables.remat_modes[k] if tables.remat_modes is not None else None
  if modes is not None and len(set(modes)) == 1:
    modes = None   # tables of one mode
  if modes is not None and mode not in modes:
    have = [m for m in REMAT_MODES if m in modes]
    raise PlanError(f"remat={remat!r}: these tables cost {' and '.join(map(repr, have))} only")
  if tables.variants is None:
    if want != (0, False, False):
      _cannot_price(*want)
    if modes is None:
      return tables.submesh_index(k, shape)
    for s, sh in enumerate(tables.submeshes[k]):
      if sh == shape and modes[s] == mode:
        return s
    return tables.submesh_index(k, shape)   # raises: no such shape
  for s, (sh, var) in enumerate(zip(tables.submeshes[k], tables.variants[k])):
    if sh == shape and var == want and (modes is None or modes[s] == mode):
      return s
  hint = ""
  if (offload or offload_activations) and tables.offload_bandwidth_bytes_per_s is None:
    hint = ("; offload needs the tables' offload_bandwidth_bytes_per_s (the device's link to "
            "host memory: host_memory_gbps in a cluster file)")
  raise PlanError(f"subcluster {tables.subcluster_names[k]!r}: submesh {shape} has no variant "
                  f"zero={zero}, offload={offload}, offload_activations={offload_activations} "
                  f"in these tables{hint}")


def tables_for_stages(tables: CostTables, stages) -> CostTables:
  """``tables``, expanded into every variant (none dropped) when a stage of ``stages`` asks
  for a ZeRO level or an offload the tables do not list as a variant."""
  if tables.variants is not None or not has_variant_data(tables):
    return tables
  stages = getattr(stages, "stages", stages)
  wants = [(getattr(st, "zero", 0), getattr(st, "offload", False),
            getattr(st, "offload_activations", False)) for st in stages]
  if not any(z or o or r for z, o, r in wants):
    return tables
  for z, o, r in wants:   # what these tables cannot price says what they lack
    if (z or o) and tables.opt_mem_bytes is None or (o or r) and \
        tables.offload_bandwidth_bytes_per_s is None:
      _cannot_price(z, o, r)
  return expand_variants(tables, VariantOptions(), None)


def _cannot_price(zero: int, offload: bool, offload_activations: bool) -> None:
  raise PlanError(f"zero={zero}, offload={offload}, offload_activations={offload_activations}: "
                  "these tables cannot price it; they need opt_mem_bytes (the optimizer "
                  "state's bytes: CostTables.from_layer_costs(..., optimizer_share=...)) for a "
                  "ZeRO level or the optimizer state's offload, and "
                  "offload_bandwidth_bytes_per_s (host_memory_gbps in a cluster file) for "
                  "either offload")


def variant_of(tables: CostTables, k: int, s: int) -> tuple[int, bool, bool]:
  """``(zero, offload, offload_activations)`` of submesh choice ``s`` of subcluster ``k``."""
  if tables.variants is None:
    return (0, False, False)
  return tables.variants[k][s]


def base_index(tables: CostTables, k: int, s: int) -> int:
  """Index of submesh choice ``s``'s shape among the distinct shapes of subcluster ``k`` (its
  index in the tables before :func:`expand_variants`)."""
  if tables.variants is None:
    return s
  modes = tables.remat_modes[k] if tables.remat_modes is not None else \
      (None,) * len(tables.submeshes[k])
  distinct = list(dict.fromkeys(zip(tables.submeshes[k], modes)))
  return distinct.index((tables.submeshes[k][s], modes[s]))
