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

**Expert parallelism.** A logical mesh may carry a third axis, ``"ep"``
(:class:`LogicalMesh`): ``dp * ep * tp`` devices laid out ``(dp, ep, tp)``, ``tp`` innermost.
The ``ep`` devices are also data-parallel for everything but the experts (GShard, Switch):
batch-carrying values are split on ``("dp", "ep")``. A parameter read by a matmul as its
*batch* dimension (an expert's weights ``[experts, in, out]`` contracted per expert,
``einsum("egch,ehf->egcf")``) is split on ``ep`` along that dimension (:func:`ep_dims`), so
each device holds ``experts / ep`` experts; XLA's partitioner then moves the tokens to the
experts' devices and back with all-to-all (the dispatch and combine einsums' contraction over
tokens) instead of gathering the weights.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P

from harpjax.compiler.trace import Lit, Op, Program

__all__ = ["DP", "TP", "EP", "LogicalMesh", "abstract_mesh", "ep_dims", "expert_exchange_bytes",
           "expert_counts", "logical_meshes", "submesh_logical_meshes", "make_mesh", "param_specs",
           "batch_spec", "zero_spec", "without_dp", "ZERO_LEVELS", "TPPlan", "tp_plan"]

DP, TP, EP = "dp", "tp", "ep"

_SAME_DIMS = frozenset({"convert_element_type", "copy", "copy_p", "slice", "dynamic_slice",
                        "stop_gradient", "optimization_barrier", "reduce_precision"})


@dataclasses.dataclass(frozen=True)
class LogicalMesh:
  """How a stage views its ``dp * tp * ep`` devices.

  Plans, tables and layouts carry a logical mesh as a tuple, ``(dp, tp)`` (``ep == 1``, the
  form every plan file had) or ``(dp, tp, ep)``; :meth:`of` reads either, :meth:`as_tuple`
  writes the shortest.

  Attributes:
    dp: data-parallel degree (replicas of everything).
    tp: tensor-parallel degree (Megatron splits, inside a host).
    ep: expert-parallel degree: experts split over ``ep`` devices, which are data-parallel
      for the rest of the stage.
  """
  dp: int
  tp: int
  ep: int = 1

  def __post_init__(self):
    for name in ("dp", "tp", "ep"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"LogicalMesh.{name}={v!r} must be an integer >= 1")
      object.__setattr__(self, name, int(v))

  @classmethod
  def of(cls, mesh) -> "LogicalMesh":
    """A :class:`LogicalMesh` from itself or a ``(dp, tp)`` / ``(dp, tp, ep)`` tuple."""
    if isinstance(mesh, LogicalMesh):
      return mesh
    t = tuple(int(x) for x in mesh)
    if len(t) not in (2, 3):
      raise ValueError(f"logical mesh {mesh!r} must be (dp, tp) or (dp, tp, ep)")
    return cls(*t)

  def as_tuple(self) -> tuple[int, ...]:
    """``(dp, tp)`` when ``ep == 1``, else ``(dp, tp, ep)``."""
    return (self.dp, self.tp) if self.ep == 1 else (self.dp, self.tp, self.ep)

  @property
  def size(self) -> int:
    """Devices: ``dp * tp * ep``."""
    return self.dp * self.tp * self.ep

  @property
  def batch_ways(self) -> int:
    """Ways the batch is split: ``dp * ep``."""
    return self.dp * self.ep

  @property
  def axis_names(self) -> tuple[str, ...]:
    """``("dp", "tp")``, or ``("dp", "ep", "tp")`` with ``ep > 1``."""
    return (DP, TP) if self.ep == 1 else (DP, EP, TP)

  @property
  def shape(self) -> tuple[int, ...]:
    """The mesh's shape, in :attr:`axis_names` order."""
    return (self.dp, self.tp) if self.ep == 1 else (self.dp, self.ep, self.tp)

  @property
  def batch_axes(self):
    """The mesh axes a batch dimension is split on: ``"dp"``, or ``("dp", "ep")``."""
    return DP if self.ep == 1 else (DP, EP)


def abstract_mesh(logical_mesh):
  """The device-free ``AbstractMesh`` of a logical mesh (a :class:`LogicalMesh` or tuple)."""
  lm = LogicalMesh.of(logical_mesh)
  return AbstractMesh(lm.shape, lm.axis_names)


def logical_meshes(num_devices: int) -> list[tuple[int, int]]:
  """All ``(dp, tp)`` with ``dp * tp == num_devices``, data-parallel first."""
  out = [(num_devices // t, t) for t in range(1, num_devices + 1) if num_devices % t == 0]
  return out


def submesh_logical_meshes(submesh: tuple[int, int], *, microbatch_size: int | None = None,
                           max_tp: int | None = None, experts: Sequence[int] = ()
                           ) -> list[tuple[int, ...]]:
  """Logical meshes worth considering on a ``(n, m)`` submesh.

  Tensor parallelism stays inside a host (``tp`` divides ``m``: its collectives run on the
  host link), and data parallelism must split the microbatch (``dp`` divides
  ``microbatch_size`` when given). With ``experts`` (the expert counts of the model's routed
  blocks, :func:`expert_counts`), also every ``(dp, tp, ep)`` with ``ep > 1`` dividing each
  count and ``dp * ep`` splitting the microbatch.

  Returns:
    ``[(dp, tp)]`` with ``dp * tp == n * m``, data-parallel first; then the
    ``(dp, tp, ep)``, by ``tp`` then ``ep``.
  """
  n, m = submesh
  out = []
  for dp, tp in logical_meshes(n * m):
    if m % tp or (max_tp is not None and tp > max_tp):
      continue
    if microbatch_size is not None and dp > 1 and microbatch_size % dp:
      continue
    out.append((dp, tp))
  for dp, tp in list(out) if experts else ():
    for ep in range(2, n * m // tp + 1):
      ways = n * m // tp
      if ways % ep or any(e % ep for e in experts):
        continue
      if microbatch_size is not None and microbatch_size % ways:
        continue
      if (ways // ep, tp, ep) not in out and dp == ways:
        out.append((ways // ep, tp, ep))
  return out


def make_mesh(devices: Sequence, logical_mesh=None) -> Mesh:
  """A ``Mesh`` over ``devices`` with the axes of ``logical_mesh`` (a :class:`LogicalMesh`,
  ``(dp, tp)`` or ``(dp, tp, ep)``; default ``(1, len(devices))``): ``("dp", "tp")``, or
  ``("dp", "ep", "tp")`` with ``ep > 1``, ``tp`` innermost (neighbouring devices)."""
  lm = LogicalMesh.of(logical_mesh or (1, len(devices)))
  return Mesh(np.asarray(devices, dtype=object).reshape(lm.shape), lm.axis_names)


def batch_spec(shape: Sequence[int], axis: int, dp) -> P:
  """Shards ``axis`` on ``dp`` (an int) or on a logical mesh's batch axes (``("dp", "ep")``
  with ``ep > 1``) when it divides evenly, else replicates."""
  if isinstance(dp, (int, np.integer)):
    ways, axes = int(dp), DP
  else:
    lm = LogicalMesh.of(dp)
    ways, axes = lm.batch_ways, lm.batch_axes
  if ways > 1 and len(shape) > axis >= 0 and shape[axis] % ways == 0:
    return P(*([None] * axis + [axes]))
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
                tp, ep: int = 1) -> dict[int, P]:
  """Tensor- and expert-parallel specs for the parameters read by ``ops``.

  Args:
    program: the program the ops belong to (for shapes).
    ops: the stage's ops, in order.
    param_ids: value ids of the parameters.
    tp: tensor-parallel degree (``1`` splits nothing on ``tp``), or a :class:`LogicalMesh`
      (then its ``tp`` and ``ep``).
    ep: expert-parallel degree: the experts' dimension of expert weights (:func:`ep_dims`)
      is split on ``"ep"``.

  Returns:
    value id -> ``PartitionSpec`` for every id of ``param_ids`` (``P()`` when not split).
  """
  if not isinstance(tp, (int, np.integer)):
    lm = LogicalMesh.of(tp)
    tp, ep = lm.tp, lm.ep
  ops = list(ops)
  specs = {pid: P() for pid in param_ids}
  entries = {pid: [None] * len(program.avals[pid].shape) for pid in param_ids}
  if tp > 1:
    for pid, d in tp_plan(program, ops, param_ids, tp).param_dims.items():
      entries[pid][d] = TP
  if ep > 1:
    for pid, d in ep_dims(program, ops, param_ids, ep).items():
      if entries[pid][d] is None:
        entries[pid][d] = EP
  for pid, e in entries.items():
    while e and e[-1] is None:
      e = e[:-1]
    specs[pid] = P(*e)
  return specs


def expert_counts(program: Program, ops: Iterable[Op], param_ids: Sequence[int]) -> tuple:
  """The sizes of the experts' dimensions of the expert weights read by ``ops``
  (:func:`ep_dims`), sorted and distinct: ``(8,)`` for a model of 8-expert blocks."""
  return tuple(sorted({int(program.avals[p].shape[d])
                       for p, d in ep_dims(program, ops, param_ids, 1).items()}))


def expert_exchange_bytes(program: Program, ops: Iterable[Op], param_ids: Sequence[int]
                          ) -> float:
  """Bytes the forward of ``ops`` moves between the tokens' and the experts' devices under
  expert parallelism, at the program's batch: the tokens dispatched to the experts (the
  activations the expert matmuls read that no expert matmul produced) and the experts'
  outputs combined back (values an expert matmul produced, through elementwise ops, that a
  matmul with no expert weight reads). Under a ``(dp, tp, ep)`` mesh each device holds
  ``1 / (dp * ep)`` of each and sends ``(ep - 1) / ep`` of that to the other experts'
  devices; the backward moves their cotangents, as many bytes."""
  ops = list(ops)
  experts = ep_dims(program, ops, param_ids, 1)
  if not experts:
    return 0.0
  pset = set(param_ids)
  view: dict[int, int] = {}                 # value id -> parameter it views
  side: set[int] = set()                    # values computed on the experts' side
  dispatched: set[int] = set()
  combined: set[int] = set()
  nbytes = lambda v: float(np.prod(program.avals[v].shape)) * program.avals[v].dtype.itemsize
  for op in ops:
    ins = [r for r in op.invars if not isinstance(r, Lit)]
    outs = [o for o in op.outvars if o >= 0]
    base = lambda r: r if r in pset else view.get(r)
    if ins and len(outs) == 1 and _is_view_op(op) and base(ins[0]) is not None:
      view[outs[0]] = base(ins[0])
      continue
    if op.name == "dot_general":
      w = [r for r in ins if base(r) is not None]
      acts = [r for r in ins if base(r) is None]
      if any(base(r) in experts for r in w):
        dispatched.update(a for a in acts if a not in side)
        side.update(outs)
      else:
        combined.update(a for a in acts if a in side)
      continue
    acts = [r for r in ins if base(r) is None]
    if acts and all(a in side for a in acts):
      side.update(outs)
  return sum(nbytes(v) for v in dispatched | combined)


def ep_dims(program: Program, ops: Iterable[Op], param_ids: Sequence[int],
            ep: int) -> dict[int, int]:
  """The experts' dimension of each expert weight read by ``ops``.

  An expert weight is a parameter (or a view of one: a cast, a reshape) that a
  ``dot_general`` reads with a *batch* dimension against an activation, as the per-expert
  matmuls of a routed block do (``einsum("egch,ehf->egcf", tokens, w)``: dimension ``0`` of
  ``w``). The first such dimension whose size divides by ``ep`` is the one split.

  Returns:
    parameter id -> its experts' dimension (parameters without one are absent).
  """
  pset = set(param_ids)
  view: dict[int, tuple[int, dict]] = {}
  out: dict[int, int] = {}
  shape = lambda r: _shape_of(program, r)
  as_view = lambda r: _param_view(program, pset, view, r)

  for op in ops:
    ins, outs = op.invars, [o for o in op.outvars if o >= 0]
    first = as_view(ins[0]) if ins else None
    if first is not None and len(outs) == 1 and _is_view_op(op):
      vm = _map_dims(op, shape(ins[0]), program.avals[outs[0]].shape, ep, inverse=True)
      if vm is not None:
        view[outs[0]] = (first[0], {d: first[1][s] for d, s in vm.items() if s in first[1]})
      continue
    if op.name != "dot_general":
      continue
    (_, _), (lb, rb) = op.params["dimension_numbers"]
    for w_ref, a_ref, batch in ((ins[1], ins[0], rb), (ins[0], ins[1], lb)):
      w = as_view(w_ref)
      if w is None or as_view(a_ref) is not None or isinstance(a_ref, Lit):
        continue
      pid, vm = w
      if pid in out:
        continue
      for d in batch:
        pd = vm.get(int(d))
        if pd is not None and program.avals[pid].shape[pd] % ep == 0:
          out[pid] = pd
          break
  return out


# --------------------------------------------------------------------------- propagation


def tp_plan(program: Program, ops: Iterable[Op], param_ids: Sequence[int], tp: int) -> TPPlan:
  """Walks ``ops`` once and decides which parameter dimensions to split on ``tp``."""
  pset = set(param_ids)
  decided: dict[int, int | None] = {}     # param id -> split dim (None: keep replicated)
  view: dict[int, tuple[int, dict]] = {}  # value id -> (param id, value dim -> param dim)
  split: dict[int, int] = {}              # activation id -> split dim
  row_ops = []
  shape = lambda r: _shape_of(program, r)
  as_view = lambda r: _param_view(program, pset, view, r)

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


def _shape_of(program, r) -> tuple:
  """The shape of value or literal ``r``."""
  return tuple(np.shape(r.value)) if isinstance(r, Lit) else program.avals[r].shape


def _param_view(program, pset, view, r):
  """``(parameter id, value dim -> parameter dim)`` when ``r`` is a parameter or a view of one
  recorded in ``view``; ``None`` otherwise."""
  if isinstance(r, Lit):
    return None
  if r in pset:
    return (r, {d: d for d in range(len(_shape_of(program, r)))})
  return view.get(r)


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
