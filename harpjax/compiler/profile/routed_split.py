"""The expert part of each routed layer's cost: what a zebra stage needs to cut a
mixture-of-experts block between two groups of GPUs (HeterMoE §4.1).

A routed layer (a layer of a module the layer construction marks routed,
:attr:`~harpjax.compiler.layers.Module.routed`) costs, in :class:`CostTables`, its attention
side (attention, norms, router) and its experts together. A zebra stage runs the two on
different GPUs (:mod:`harpjax.compiler.plan.zebra_stages`), so it needs them apart.
:class:`RoutedSplit` is that split, carried by the tables (``CostTables.routed_split``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from harpjax.compiler.layers import sharding
from harpjax.compiler.profile import calibration as calib
from harpjax.compiler.profile import estimate
from harpjax.compiler.trace import Lit, Program, aval_nbytes, aval_size
from harpjax.errors import CostTablesError

__all__ = ["RoutedSplit", "ROUTED_SPLIT_VERSION", "ExpertCost", "expert_weights",
           "expert_op_indices", "expert_forward_ops", "expert_cost"]


def _per_layer(v, where: str, L: int) -> np.ndarray:
  a = np.array(v, dtype=np.float64).reshape(-1)
  if a.shape == (1,):
    a = np.full(L, float(a[0]))
  if a.shape != (L,) or not np.isfinite(a).all() or (a < 0).any():
    raise CostTablesError(f"RoutedSplit.{where} must be [num_layers={L}] finite values >= 0, "
                          f"got shape {a.shape}")
  a.setflags(write=False)
  return a


@dataclasses.dataclass(frozen=True, eq=False)
class RoutedSplit:
  """Per layer, the experts' share of a routed layer's cost (zeros for a layer that routes
  nothing).

  Attributes:
    num_experts: ``[L]`` experts of each layer's routed block; ``0``: the layer routes nothing.
    expert_time_s: ``[K]`` arrays ``[L, S_k]``: seconds (forward + backward of one microbatch)
      of layer ``l``'s experts inside ``stage_time_s[k][l, l, s]`` (the rest of that entry is
      the layer's attention side). ``0`` where the layer routes nothing.
    expert_state_bytes: ``[L]`` training state (parameters, gradients, optimizer state) of all
      of layer ``l``'s experts together, bytes.
    expert_act_bytes: ``[L]`` residual bytes of one microbatch's experts of layer ``l``, all
      experts together.
    routed_bytes: ``[L]`` bytes of one microbatch's routed token copies (``tokens * top_k *
      hidden * dtype bytes``): what the dispatch all-to-all moves, and the combine back.
  """
  num_experts: Sequence[int]
  expert_time_s: Sequence[np.ndarray]
  expert_state_bytes: Sequence[float]
  expert_act_bytes: Sequence[float]
  routed_bytes: Sequence[float]

  def __post_init__(self):
    try:
      n = tuple(int(x) for x in self.num_experts)
    except (TypeError, ValueError):
      raise CostTablesError(f"RoutedSplit.num_experts={self.num_experts!r} must be integers "
                            ">= 0, one per layer") from None
    if not n or min(n) < 0:
      raise CostTablesError(f"RoutedSplit.num_experts={n} must be integers >= 0, one per layer")
    object.__setattr__(self, "num_experts", n)
    L = len(n)
    for name in ("expert_state_bytes", "expert_act_bytes", "routed_bytes"):
      object.__setattr__(self, name, _per_layer(getattr(self, name), name, L))
    arrs = []
    for k, a in enumerate(self.expert_time_s):
      a = np.array(a, dtype=np.float64)
      if a.ndim != 2 or a.shape[0] != L or not np.isfinite(a).all() or (a < 0).any():
        raise CostTablesError(f"RoutedSplit.expert_time_s[{k}] must be [num_layers={L}, "
                              f"num_submeshes] finite seconds >= 0, got shape {a.shape}")
      if (a[np.array(n) == 0] > 0).any():
        raise CostTablesError(f"RoutedSplit.expert_time_s[{k}]: a layer with no experts has "
                              "expert time")
      a.setflags(write=False)
      arrs.append(a)
    object.__setattr__(self, "expert_time_s", tuple(arrs))

  @property
  def num_layers(self) -> int:
    return len(self.num_experts)

  def routed(self, layer: int) -> bool:
    """Whether layer ``layer`` holds a routed block."""
    return self.num_experts[layer] > 0

  def check(self, tables) -> None:
    """Checks the split against its tables: one array per subcluster, one column per submesh
    choice, each expert time at most its layer's whole time.

    Raises:
      CostTablesError: naming the entry that does not fit.
    """
    L, K = tables.num_layers, tables.num_subclusters
    if self.num_layers != L or len(self.expert_time_s) != K:
      raise CostTablesError(f"routed_split covers {self.num_layers} layers and "
                            f"{len(self.expert_time_s)} subclusters; the tables {L} and {K}")
    for k in range(K):
      a = self.expert_time_s[k]
      if a.shape != (L, len(tables.submeshes[k])):
        raise CostTablesError(f"routed_split.expert_time_s[{k}] has shape {a.shape}, expected "
                              f"[num_layers, num_submeshes] = {[L, len(tables.submeshes[k])]}")
      whole = np.stack([tables.stage_time_s[k][l, l] for l in range(L)])
      over = np.isfinite(whole) & (a > whole * (1 + 1e-12))
      if over.any():
        l, s = (int(x) for x in np.argwhere(over)[0])
        raise CostTablesError(f"routed_split.expert_time_s[{k}][{l}, {s}] = {a[l, s]} exceeds "
                              f"the layer's whole time {whole[l, s]}; it is a part of it")


# --------------------------------------------------------------------------- profiling the split

ROUTED_SPLIT_VERSION = "1"
"""Bumped when what :func:`expert_cost` counts changes (part of its profile database key)."""


def expert_weights(program, ops, param_ids) -> dict[int, int]:
  """``{parameter id: its experts' dimension}`` of the expert weights ``ops`` read
  (:func:`~harpjax.compiler.layers.sharding.ep_dims`: parameters a ``dot_general`` reads with
  a batch dimension against an activation)."""
  return sharding.ep_dims(program, ops, param_ids, 1)


def expert_forward_ops(ops, weights, const) -> set[int]:
  """The indices of the ``ops`` that are views of the expert ``weights``, expert matmuls (a
  ``dot_general`` reading a weight or a view of one) or the expert side (any other op reading
  only what those made), in one pass in program order; ``const(r)`` tells the operands that
  depend on no input (literals, constants), which are ignored."""
  views, side, out = set(weights), set(), set()
  for op in ops:
    ins = [r for r in op.invars if not const(r)]
    outs = [o for o in op.outvars if o >= 0]
    if not ins or not outs:
      continue
    if op.name == "dot_general":
      if any(r in views for r in ins):
        out.add(op.index)
        side.update(outs)
      continue
    if all(r in views for r in ins):
      out.add(op.index)
      views.update(outs)
    elif all(r in views or r in side for r in ins):
      out.add(op.index)
      side.update(outs)
  return out


def expert_op_indices(prog: Program, weights, grads=()) -> set[int]:
  """The ops of ``prog`` (a layer's forward, or its forward+backward) that belong to its
  experts.

  * *views* of the expert weights (``weights``: the program's inputs that are expert weights):
    ops reading nothing but them and constants (a cast to the computation dtype);
  * the *expert matmuls*: a ``dot_general`` reading an expert weight (or a view of one): the
    forward's per-expert matmuls and, in the backward, their inputs' gradients;
  * the *expert side*: any other op, not a ``dot_general``, reading only values the two
    above made (and constants): the activation between the matmuls (SwiGLU's ``silu`` and
    product, a GELU) and its derivative in the backward;
  * the *weight gradients*: ops all of whose results go only to such ops or to the
    gradients ``grads`` of the expert weights (the matmul of the dispatched tokens with the
    cotangent that makes an expert weight's gradient, its transposes and casts).

  The dispatch and the combine (the einsums of the dispatch and combine tensors with the
  tokens, or gathers and scatters) read no expert weight and mix the experts' values with the
  router's: they belong to the routing, which runs beside the attention (a zebra stage's
  attention group computes them and the all-to-all moves their results), and so does their
  transpose in the backward.
  """
  weights = set(weights)
  variable = prog.dependents([v for v in prog.invars])
  const = lambda r: isinstance(r, Lit) or r not in variable
  ops = expert_forward_ops(prog.ops, weights, const)
  # the weight gradients: ops feeding nothing but weight gradients, walked backwards
  sink = {g for g in grads if not isinstance(g, Lit)}
  others = {v for v in prog.outvars if not isinstance(v, Lit)} - sink
  only_grads: set = set()
  readers: dict = {}
  for op in prog.ops:
    for v in op.in_ids():
      readers.setdefault(v, []).append(op.index)
  for op in reversed(prog.ops):
    outs = [o for o in op.outvars if o >= 0]
    if not outs or any(o in others for o in outs):
      continue
    used = [o for o in outs if o in sink or readers.get(o)]
    if used and all(all(r in only_grads for r in readers.get(o, ())) for o in outs):
      only_grads.add(op.index)
  return ops | only_grads


def _expert_residual_bytes(traced, weights) -> float:
  """Bytes (whole microbatch, one device) of the forward's residuals that the experts keep:
  those only expert ops read (the dispatched tokens, the activation's inputs), or, read by
  nothing in the forward, made by an expert op."""
  fr = traced.fwd_res
  inputs = fr.invars[fr.num_consts:]
  n_p = len(traced.piece.param_ids)
  w = {inputs[k] for k, v in enumerate(traced.piece.param_ids) if v in weights}
  mine = expert_op_indices(fr, w)
  readers: dict = {}
  made: dict = {}
  for op in fr.ops:
    for v in op.in_ids():
      readers.setdefault(v, set()).add(op.index)
    for o in op.outvars:
      if o >= 0:
        made[o] = op.index
  params = set(inputs[:n_p])
  total, seen = 0.0, set()
  for v in fr.outvars[traced.num_outputs:]:
    if isinstance(v, Lit) or v in seen or v in params:
      continue
    seen.add(v)
    rs = readers.get(v, set())
    if (rs and rs <= mine) or (not rs and made.get(v) in mine):
      total += float(fr.nbytes(v))
  return total


def _routed_token_bytes(traced, weights) -> float:
  """Bytes of one microbatch's tokens dispatched to the experts: the activations the expert
  matmuls of the forward read that no expert op made (each once): with dispatch einsums, the
  experts' capacity slots, ``tokens * top_k * capacity_factor * hidden``."""
  fr = traced.fwd_res
  inputs = fr.invars[fr.num_consts:]
  w = {inputs[k] for k, v in enumerate(traced.piece.param_ids) if v in weights}
  mine = expert_op_indices(fr, w)
  made = {o for op in fr.ops if op.index in mine for o in op.outvars if o >= 0}
  views = set(w) | {o for op in fr.ops if op.index in mine and all(
      isinstance(r, Lit) or r in w for r in op.invars) for o in op.outvars if o >= 0}
  tokens = set()
  for op in fr.ops:
    if op.index in mine and op.name == "dot_general":
      tokens.update(r for r in op.in_ids() if r not in views and r not in made)
  return float(sum(fr.nbytes(v) for v in tokens))


@dataclasses.dataclass(frozen=True)
class ExpertCost:
  """The experts' part of one layer's cost on one device of a logical mesh.

  Attributes:
    num_experts: the experts of the layer's routed block (0: it routes nothing).
    time_s: seconds (forward + backward of one microbatch) of the experts inside the layer's
      ``time_s``: their ops' work (:func:`expert_op_indices`) and the add of their weights'
      gradients into the accumulator, at the GPU type's calibrated rates (the layer's own
      time model); the routing and its collectives are not in it.
    matmul_flops: FLOPs per device of the expert matmuls (forward and backward).
    flops: FLOPs per device of all the experts' work (matmuls, activations, accumulation).
    state_bytes: training state of all the layer's expert weights (``state_bytes_per_param``
      per parameter), whole.
    act_bytes: the experts' residuals of one microbatch, whole.
    routed_bytes: one microbatch's dispatched tokens, whole.
  """
  num_experts: int
  time_s: float
  matmul_flops: float
  flops: float
  state_bytes: float
  act_bytes: float
  routed_bytes: float

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> "ExpertCost":
    return cls(int(d["num_experts"]), *(float(d[f.name]) for f in dataclasses.fields(cls)[1:]))


def expert_cost(traced, mesh: tuple[int, int], gpu, efficiencies,
                state_bytes_per_param: float, scale_to_s: float | None = None) -> ExpertCost:
  """The experts' part of a traced layer on a ``(dp, tp)`` logical mesh of ``gpu``.

  Args:
    traced: the layer's :class:`~harpjax.compiler.profile.estimate.TracedPiece` at the full
      microbatch (what the jaxpr source costs).
    mesh: ``(dp, tp)``.
    gpu: the :class:`~harpjax.cluster.GPUType`.
    efficiencies: the time model's overrides (``ProfileOptions.efficiencies``).
    state_bytes_per_param: weights + gradients + optimizer state per parameter.
    scale_to_s: for a source that does not time the layer by this model (analytic on XLA's
      statistics, measured, imported): the layer's seconds by that source; the experts then
      take the share of them this model gives them. ``None``: this model's seconds.
  """
  piece = traced.piece
  weights = expert_weights(piece.program, piece.ops, piece.param_ids)
  if not weights:
    return ExpertCost(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
  counts = {int(piece.program.avals[p].shape[d]) for p, d in weights.items()}
  lv = traced.live if traced.live is not None else traced.fwd_bwd
  inputs = lv.invars[lv.num_consts:]
  n_p = len(piece.param_ids)
  n_out = traced.num_outputs if traced.live is not None else 0
  w = {inputs[k] for k, v in enumerate(piece.param_ids) if v in weights}
  grads = [g for k, g in enumerate(lv.outvars[n_out:n_out + n_p])
           if piece.param_ids[k] in weights]
  ops = expert_op_indices(lv, w, grads)
  tp = mesh[1]
  work = estimate.live_ops_work(traced, mesh, ops)
  # the add of the experts' gradients into the accumulator (as the layer's, on this device)
  specs = sharding.param_specs(piece.program, piece.ops, piece.param_ids, tp)
  n = nbytes = 0.0
  for p in weights:
    div = tp if specs[p] != sharding.P() else 1
    n += aval_size(piece.program.avals[p]) / div
    nbytes += aval_nbytes(piece.program.avals[p]) / div
  acc = calib.Work((), (), n, 3.0 * nbytes, 0.0)
  time_s = _seconds(work + acc, gpu, efficiencies)
  if scale_to_s is not None:
    n_all, b_all = estimate.accumulated_params(traced, mesh)
    model_s = _seconds(estimate.jaxpr_work(traced, mesh)
                       + calib.Work((), (), n_all, 3.0 * b_all, 0.0), gpu, efficiencies)
    time_s = scale_to_s * min(1.0, time_s / model_s) if model_s > 0 else 0.0
  state = sum(aval_size(piece.program.avals[p]) for p in weights) * state_bytes_per_param
  return ExpertCost(
      num_experts=max(counts), time_s=float(time_s), matmul_flops=float(sum(work.heavy_flops)),
      flops=float(work.flops + n), state_bytes=float(state),
      act_bytes=_expert_residual_bytes(traced, weights),
      routed_bytes=_routed_token_bytes(traced, weights))


def _seconds(work: calib.Work, gpu, efficiencies) -> float:
  """Seconds of ``work`` on one device of ``gpu``: the calibrated time model, as
  :func:`~harpjax.compiler.profile.sources.compute_time_s` times a layer."""
  return float(calib.predict_time_s(work, gpu.peak_flops, gpu.mem_bandwidth_bytes_per_s,
                                    calib.efficiency_for(gpu.name, efficiencies),
                                    fused_attention=gpu.fused_attention))


def profile_routed_split(layers, found, results: dict, tables, *, trace, db=None,
                         efficiencies=None, state_bytes_per_param: float = 16.0,
                         jaxpr_timed: bool = True) -> RoutedSplit | None:
  """The :class:`RoutedSplit` of profiled tables: each routed layer's experts costed apart
  (:func:`expert_cost`) on the logical mesh each single-layer entry keeps.

  Args:
    layers: the :class:`~harpjax.compiler.layers.LayerSequence` profiled.
    found: the profiler's :class:`~harpjax.compiler.profile.profiler.ProfileTasks` (the
      configurations, each layer's task on each, their cache keys).
    results: task id -> its :class:`~harpjax.compiler.profile.sources.LayerCost`.
    tables: the :class:`CostTables` built from them (one rematerialisation mode).
    trace: ``task -> TracedPiece`` of the task's layer at the full microbatch.
    db: the profile database (``None``: no cache); an entry per task, beside its cost.
    efficiencies, state_bytes_per_param: the profiler's options.
    jaxpr_timed: the tables' seconds are the jaxpr source's (the experts' seconds are then
      their work's at the same rates); ``False``: another source's, of which the experts get
      the share the jaxpr time model gives them.

  Returns:
    The split, or ``None`` where no layer of a routed module reads expert weights (a dense
    model).
  """
  L = len(layers)
  routed = [l.index for l in layers if layers.modules[l.module_index].routed]
  if not routed:
    return None
  config_of: dict = {}
  for c, cfg in enumerate(found.configs):
    config_of[(cfg.subcluster, cfg.submesh_index,
               sharding.LogicalMesh.of(cfg.mesh).as_tuple())] = c
  memo: dict = {}

  def cost_of(kid) -> ExpertCost:
    if kid in memo:
      return memo[kid]
    task = found.tasks[kid]
    key = {**found.keys[kid], "what": "routed-split", "routed_split": ROUTED_SPLIT_VERSION}
    hit = db.get(key) if db is not None else None
    got = None
    if hit is not None:
      try:
        got = ExpertCost.from_json(hit)
      except (KeyError, TypeError, ValueError):
        got = None
    if got is None:
      got = expert_cost(trace(task), tuple(task.mesh), task.gpu, efficiencies,
                        state_bytes_per_param,
                        None if jaxpr_timed else float(results[kid].time_s))
      if db is not None:
        db.put(key, got.to_json())
    memo[kid] = got
    return got

  num_experts = np.zeros(L, dtype=np.int64)
  state, act, routed_b = np.zeros(L), np.zeros(L), np.zeros(L)
  times = [np.zeros((L, len(tables.submeshes[k]))) for k in range(tables.num_subclusters)]
  for l in routed:
    kids = [row[l] for row in found.assign if row[l] is not None]
    if not kids or cost_of(kids[0]).num_experts == 0:
      continue
    first = cost_of(kids[0])
    num_experts[l] = first.num_experts
    state[l], act[l], routed_b[l] = first.state_bytes, first.act_bytes, first.routed_bytes
    for k in range(tables.num_subclusters):
      for s in range(len(tables.submeshes[k])):
        whole = float(tables.stage_time_s[k][l, l, s])
        c = config_of.get((k, s, tables.logical_mesh_of(k, l, l, s)))
        kid = None if c is None else found.assign[c][l]
        if not np.isfinite(whole) or kid is None:
          continue
        times[k][l, s] = cost_of(kid).time_s
  if not num_experts.any():
    return None
  return RoutedSplit(num_experts=tuple(int(x) for x in num_experts), expert_time_s=times,
                     expert_state_bytes=state, expert_act_bytes=act, routed_bytes=routed_b)
