"""Intra-op parallelism inside one submesh: logical meshes and sharding rules.

A submesh of ``n * m`` devices is viewed as a logical mesh ``(dp, tp)`` with axes named
``"dp"`` and ``"tp"`` (:func:`logical_meshes`). Batch-carrying values are split on ``dp``
(:func:`batch_spec`). Parameters are split on ``tp`` by rules derived from the jaxpr
(:func:`tp_plan`), Megatron-style: the program is walked once, tracking which activation
dimension is split on ``tp``; a matmul (or convolution) whose activation operand is not split
on a contracted dimension splits its weight's output (column) dimension, so its result comes
out split; one whose activation *is* split on the contracted dimension splits the weight's
matching (row) dimension, so the pair needs a single reduction. Splits flow through
elementwise ops, reshapes that keep the split dimension outermost (hidden -> heads), transposes,
broadcasts and reductions over other dimensions; a bias added to a split result is split with
it. XLA's sharding propagation fills in everything else and inserts the collectives, so any
choice computes the unsharded function (up to summation order).

Training state can also be split on ``dp`` (ZeRO, :func:`zero_spec`): a value's largest
dimension that is not already split and divides by ``dp`` is split on it.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from harpjax.compiler.trace import Lit, Op, Program

__all__ = ["DP", "TP", "logical_meshes", "submesh_logical_meshes", "make_mesh", "param_specs",
           "batch_spec", "zero_spec", "without_dp", "ZERO_LEVELS", "TPPlan", "tp_plan"]

DP, TP = "dp", "tp"

_SAME_DIMS = frozenset({"convert_element_type", "copy", "copy_p", "slice", "dynamic_slice",
                        "stop_gradient", "optimization_barrier", "reduce_precision"})


def logical_meshes(num_devices: int) -> list[tuple[int, int]]:
  """All ``(dp, tp)`` with ``dp * tp == num_devices``, data-parallel first."""
  out = [(num_devices // t, t) for t in range(1, num_devices + 1) if num_devices % t == 0]
  return out


def submesh_logical_meshes(submesh: tuple[int, int], *, microbatch_size: int | None = None,
                           max_tp: int | None = None) -> list[tuple[int, int]]:
  """Logical meshes worth considering on a ``(n, m)`` submesh.

  Tensor parallelism stays inside a host (``tp`` divides ``m``: its collectives run on the
  host link), and data parallelism must split the microbatch (``dp`` divides
  ``microbatch_size`` when given).

  Returns:
    ``[(dp, tp)]`` with ``dp * tp == n * m``, data-parallel first.
  """
  n, m = submesh
  out = []
  for dp, tp in logical_meshes(n * m):
    if m % tp or (max_tp is not None and tp > max_tp):
      continue
    if microbatch_size is not None and dp > 1 and microbatch_size % dp:
      continue
    out.append((dp, tp))
  return out


def make_mesh(devices: Sequence, logical_mesh: tuple[int, int] | None = None) -> Mesh:
  """A ``Mesh`` over ``devices`` with axes ``("dp", "tp")`` of sizes ``logical_mesh``
  (default ``(1, len(devices))``)."""
  shape = logical_mesh or (1, len(devices))
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), (DP, TP))


def batch_spec(shape: Sequence[int], axis: int, dp: int) -> P:
  """Shards ``axis`` on ``dp`` when it divides evenly, else replicates."""
  if dp > 1 and len(shape) > axis >= 0 and shape[axis] % dp == 0:
    return P(*([None] * axis + [DP]))
  return P()


ZERO_LEVELS = (0, 1, 2, 3)
"""ZeRO levels of a stage: what it shards over ``dp`` (``StageSpec.zero``): nothing, the
optimizer state, also the gradient accumulator, also the parameters."""


def without_dp(spec: P) -> P:
  """``spec`` with its ``"dp"`` entries dropped (what one data-parallel replica holds)."""
  def strip(e):
    if isinstance(e, tuple):
      e = tuple(x for x in e if x != DP)
      return e[0] if len(e) == 1 else (e or None)
    return None if e == DP else e
  return P(*[strip(e) for e in spec])


def zero_spec(shape: Sequence[int], spec: P, dp: int, tp: int = 1) -> P:
  """``spec`` with the value also split on ``dp`` (ZeRO).

  The dimension split is the largest one that ``spec`` leaves whole and whose size divides by
  ``dp`` (the first of equals); failing that, a dimension split on ``tp`` alone whose size
  divides by ``tp * dp`` is split on both (``("tp", "dp")``: each device keeps a part of its
  ``tp`` block, so nothing crosses ``tp``). A value with neither (a scalar, a ``[3]`` bias on
  ``dp = 2``) keeps ``spec``: it stays replicated over ``dp``.

  Args:
    shape: the value's shape.
    spec: its ``PartitionSpec`` over ``("dp", "tp")`` without ZeRO (``tp`` splits only).
    dp: data-parallel degree.
    tp: tensor-parallel degree (for dimensions ``spec`` splits on ``tp``).

  Returns:
    The ``PartitionSpec`` with ``"dp"`` added, or ``spec``.
  """
  entries = list(spec) + [None] * (len(shape) - len(spec))
  if dp <= 1 or any(e == DP or (isinstance(e, tuple) and DP in e) for e in entries):
    return spec
  largest = lambda ds: max(ds, key=lambda i: (shape[i], -i))
  free = [d for d in range(len(shape)) if entries[d] is None and shape[d] % dp == 0]
  on_tp = [d for d in range(len(shape)) if entries[d] == TP and shape[d] % (tp * dp) == 0]
  if free:
    entries[largest(free)] = DP
  elif on_tp:
    entries[largest(on_tp)] = (TP, DP)
  else:
    return spec
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


@dataclasses.dataclass(frozen=True)
class TPPlan:
  """Tensor-parallel decisions for a run of ops.

  Attributes:
    param_dims: parameter id -> dimension split on ``tp`` (absent: replicated).
    act_dims: activation id -> dimension split on ``tp`` (the propagation's view of the
      result; only a hint, XLA decides).
    row_ops: indices of the matmuls/convolutions whose weight is split on a contracted
      dimension (each needs one reduction of its result).
  """
  param_dims: dict
  act_dims: dict
  row_ops: tuple


def param_specs(program: Program, ops: Iterable[Op], param_ids: Sequence[int],
                tp: int) -> dict[int, P]:
  """Tensor-parallel specs for the parameters read by ``ops``.

  Args:
    program: the program the ops belong to (for shapes).
    ops: the stage's ops, in order.
    param_ids: value ids of the parameters.
    tp: tensor-parallel degree; ``1`` replicates everything.

  Returns:
    value id -> ``PartitionSpec`` for every id of ``param_ids`` (``P()`` when not split).
  """
  specs = {pid: P() for pid in param_ids}
  if tp <= 1:
    return specs
  plan = tp_plan(program, ops, param_ids, tp)
  for pid, d in plan.param_dims.items():
    specs[pid] = P(*([None] * d + [TP]))
  return specs


# --------------------------------------------------------------------------- propagation


def tp_plan(program: Program, ops: Iterable[Op], param_ids: Sequence[int], tp: int) -> TPPlan:
  """Walks ``ops`` once and decides which parameter dimensions to split on ``tp``."""
  pset = set(param_ids)
  decided: dict[int, int | None] = {}     # param id -> split dim (None: keep replicated)
  view: dict[int, tuple[int, dict]] = {}  # value id -> (param id, value dim -> param dim)
  split: dict[int, int] = {}              # activation id -> split dim
  row_ops = []
  shape = lambda r: tuple(np.shape(r.value)) if isinstance(r, Lit) else program.avals[r].shape

  def as_view(r):
    if isinstance(r, Lit):
      return None
    if r in pset:
      return (r, {d: d for d in range(len(shape(r)))})
    return view.get(r)

  def decide(v, dim_in_view) -> bool:
    """Splits the parameter behind view ``v`` at the view's dim; False if impossible."""
    pid, vm = v
    pdim = vm.get(dim_in_view)
    if pdim is None:
      return False
    if pid in decided:
      return decided[pid] == pdim
    if program.avals[pid].shape[pdim] % tp:
      return False
    decided[pid] = pdim
    return True

  for op in ops:
    ins, outs = op.invars, [o for o in op.outvars if o >= 0]
    first = as_view(ins[0]) if ins else None
    if first is not None and len(outs) == 1 and _is_view_op(op):
      vm = _map_dims(op, shape(ins[0]), program.avals[outs[0]].shape, tp, inverse=True)
      if vm is not None:
        view[outs[0]] = (first[0], {d: first[1][s] for d, s in vm.items() if s in first[1]})
        continue
    if op.name == "dot_general":
      _dot(op, program, as_view, split, decide, row_ops)
      continue
    if op.name == "conv_general_dilated":
      _conv(op, program, as_view, split, decide, row_ops)
      continue
    if not outs:
      continue
    out_shape = program.avals[outs[0]].shape
    if _elementwise(op, program, shape):
      a = next((r for r in ins if not isinstance(r, Lit) and r in split
                and shape(r)[split[r]] == out_shape[split[r]]), None)
      if a is None:
        continue
      src = split[a]
      for o in outs:
        if program.avals[o].shape == out_shape:
          split[o] = src
      for r in ins:   # a bias or scale added to a split result is split with it
        v = as_view(r)
        if v is not None and len(shape(r)) == len(out_shape) and \
            shape(r)[src] == out_shape[src]:
          decide(v, src)
      continue
    a = next((r for r in ins if not isinstance(r, Lit) and r in split), None)
    if a is None:
      continue
    src = split[a]
    vm = _map_dims(op, shape(a), out_shape, tp)
    if vm is not None and src in vm and len(outs) == 1:
      split[outs[0]] = vm[src]
  return TPPlan({p: d for p, d in decided.items() if d is not None}, split, tuple(row_ops))


def _is_view_op(op: Op) -> bool:
  return op.name in _SAME_DIMS or op.name in ("reshape", "squeeze", "broadcast_in_dim",
                                              "transpose", "expand_dims")


def _elementwise(op: Op, program: Program, shape) -> bool:
  outs = [o for o in op.outvars if o >= 0]
  if not outs or op.name in ("reshape", "broadcast_in_dim", "transpose", "squeeze"):
    return False
  out_shape = program.avals[outs[0]].shape

  def fits(r):   # equal shape, a scalar, or size-1 dimensions broadcast implicitly
    s = shape(r)
    return len(s) == 0 or (len(s) == len(out_shape) and
                           all(a == b or a == 1 for a, b in zip(s, out_shape)))
  return all(fits(r) for r in op.invars)


def _map_dims(op: Op, in_shape, out_shape, tp: int, inverse: bool = False) -> dict | None:
  """Operand dim -> result dim for a dimension split into ``tp`` contiguous blocks.

  With ``inverse`` the map is result dim -> operand dim (for views of parameters). ``None``
  when the op does not preserve dimensions.
  """
  name = op.name
  fwd: dict[int, int] = {}
  if name in _SAME_DIMS:
    if len(in_shape) != len(out_shape):
      return None
    fwd = {d: d for d in range(len(in_shape))}
  elif name == "transpose":
    perm = op.params["permutation"]
    fwd = {int(p): j for j, p in enumerate(perm)}
  elif name == "broadcast_in_dim":
    fwd = {i: int(j) for i, j in enumerate(op.params["broadcast_dimensions"])}
  elif name in ("reshape", "squeeze", "expand_dims"):
    pre_in = np.concatenate([[1], np.cumprod(in_shape)]) if len(in_shape) else np.array([1])
    pre_out = np.concatenate([[1], np.cumprod(out_shape)]) if len(out_shape) else np.array([1])
    for d, size in enumerate(in_shape):
      if size % tp or size == 1:
        continue
      hits = np.flatnonzero(pre_out[:-1] == pre_in[d])
      for e in hits:
        if out_shape[e] != 1 and out_shape[e] % tp == 0:
          fwd[d] = int(e)
          break
  elif name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
                "reduce_and", "reduce_or"):
    axes = set(int(a) for a in op.params.get("axes", ()))
    kept = [d for d in range(len(in_shape)) if d not in axes]
    fwd = {d: j for j, d in enumerate(kept)}
  elif name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "rev"):
    fwd = {d: d for d in range(len(in_shape))}
  else:
    return None
  return {v: k for k, v in fwd.items()} if inverse else fwd


def _dot(op, program, as_view, split, decide, row_ops) -> None:
  (lc, rc), (lb, rb) = op.params["dimension_numbers"]
  lhs, rhs = op.invars[0], op.invars[1]
  out = op.outvars[0]
  if out < 0:
    return
  lshape = program.avals[lhs].shape if not isinstance(lhs, Lit) else ()
  rshape = program.avals[rhs].shape if not isinstance(rhs, Lit) else ()
  lfree = [d for d in range(len(lshape)) if d not in lc and d not in lb]
  rfree = [d for d in range(len(rshape)) if d not in rc and d not in rb]

  def out_pos(side: int, d: int) -> int | None:
    batch, free = (lb, lfree) if side == 0 else (rb, rfree)
    if d in batch:
      return list(batch).index(d)
    if d in free:
      return len(lb) + (free.index(d) if side == 0 else len(lfree) + free.index(d))
    return None

  wl, wr = as_view(lhs), as_view(rhs)
  if (wl is None) == (wr is None):   # two activations (or two weights): propagate only
    for side, r in ((0, lhs), (1, rhs)):
      if not isinstance(r, Lit) and r in split:
        pos = out_pos(side, split[r])
        if pos is not None:
          split[out] = pos
          return
    return
  wside, w, a = (1, wr, lhs) if wr is not None else (0, wl, rhs)
  a_contract, w_contract = (lc, rc) if wside == 1 else (rc, lc)
  w_free = rfree if wside == 1 else lfree
  a_split = split.get(a) if not isinstance(a, Lit) else None
  if a_split is not None and a_split in a_contract:       # row-parallel
    if decide(w, int(w_contract[list(a_contract).index(a_split)])):
      row_ops.append(op.index)
    return
  if a_split is not None:                                 # activation split elsewhere
    pos = out_pos(1 - wside, a_split)
    if pos is not None:
      split[out] = pos
    return
  # column-parallel: the weight's free dims, last first (Dense kernels are [in, out])
  for d in reversed(w_free):
    if decide(w, d):
      split[out] = out_pos(wside, d)
      return


def _conv(op, program, as_view, split, decide, row_ops) -> None:
  dn = op.params["dimension_numbers"]
  lhs, rhs, out = op.invars[0], op.invars[1], op.outvars[0]
  w = as_view(rhs)
  if w is None or out < 0 or isinstance(lhs, Lit) or op.params.get("feature_group_count", 1) != 1 \
      or op.params.get("batch_group_count", 1) != 1:
    return
  lhs_feat, rhs_out, rhs_in, out_feat = dn.lhs_spec[1], dn.rhs_spec[0], dn.rhs_spec[1], \
      dn.out_spec[1]
  if split.get(lhs) == lhs_feat:
    if decide(w, rhs_in):
      row_ops.append(op.index)
    return
  if lhs in split:
    return
  if decide(w, rhs_out):
    split[out] = out_feat
