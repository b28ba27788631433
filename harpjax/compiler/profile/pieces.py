"""Layer pieces: a layer range as a standalone forward+backward function, and what XLA says.

A :class:`Piece` is layers ``first..last`` of a :class:`~harpjax.compiler.layers.LayerSequence`
cut out of the program: its inputs are parameters (slices of a stacked parameter count as the
slice), float activations from earlier layers (differentiated), and other inputs (data,
integer activations); its outputs are the float values read later. ``fwd_bwd`` runs the
forward under ``jax.vjp`` and the backward with given cotangents: one microbatch of the
stage's work. :func:`xla_stats` compiles it (from ``jax.ShapeDtypeStruct`` s: nothing is
allocated) on ``tp`` devices and reads XLA's cost and memory analysis and the collectives of
the partitioned HLO.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from harpjax import _compat
from harpjax.compiler.layers import LayerSequence, sharding
from harpjax.compiler.trace import (apply_site, checkpointed, Lit, Program, ops_function,
                                    primitives, regen)

__all__ = ["Piece", "build_piece", "batch_dependent", "XlaStats", "xla_stats",
           "parse_collectives", "make_functions", "abstract_inputs", "shardings", "redraws",
           "redraw_hook", "batch_draws", "position_draws"]


@dataclasses.dataclass(frozen=True, eq=False)
class Piece:
  """A layer range as a function.

  Attributes:
    program: the program the ops index.
    ops: the range's ops, views of parameters removed (their results are parameter inputs).
    param_ids: parameter inputs (whole parameters or slices of stacked ones).
    act_ids: float activations read from earlier layers (differentiated).
    aux_ids: other inputs (data, integer activations, constants), not differentiated.
    out_ids: float values produced here and read later (they receive cotangents).
    batch_ids: inputs and outputs whose axis 0 is the batch.
    param_bytes: bytes of ``param_ids``.
    num_params: elements of ``param_ids``.
    extra_out_ids: values produced here and read later that receive no cotangent (PRNG keys
      split for later layers, integer or boolean activations): the stage's forward computes
      and sends them, so their ops are costed with the forward's.
  """
  program: Program
  ops: tuple
  param_ids: tuple
  act_ids: tuple
  aux_ids: tuple
  out_ids: tuple
  batch_ids: frozenset
  param_bytes: int
  num_params: int
  extra_out_ids: tuple = ()


def batch_dependent(program: Program, input_kinds: Sequence[str] | None) -> frozenset:
  """Value ids that depend on a batch-split input (``"split"``)."""
  if input_kinds is None:
    return frozenset()
  return frozenset(program.dependents(
      v for v, k in zip(program.invars, input_kinds) if k == "split"))


def build_piece(seq: LayerSequence, first: int, last: int, batch_dep: frozenset) -> Piece:
  """Cuts layers ``first..last`` (inclusive) out of ``seq.program``."""
  prog = seq.program
  a, b = seq.op_range(first, last)
  kinds = seq.input_kinds or ("whole",) * len(prog.invars)
  params = {v for v, k in zip(prog.invars, kinds) if k == "param"}
  param_like = set(params)
  ops = []
  defined = set()
  for op in prog.ops[a:b]:
    src = op.invars[0] if op.invars else None
    if (primitives.is_view(op.name) and src is not None and not isinstance(src, Lit)
        and src in param_like and all(isinstance(v, Lit) for v in op.invars[1:])):
      param_like.update(o for o in op.outvars if o >= 0)
      continue
    ops.append(op)
    defined.update(o for o in op.outvars if o >= 0)
  reads: list[int] = []
  seen = set()
  for op in ops:
    for v in op.in_ids():
      if v not in defined and v not in seen:
        seen.add(v)
        reads.append(v)
  invars = set(prog.invars)
  p_ids = tuple(v for v in reads if v in param_like)
  acts = tuple(v for v in reads if v not in param_like and v not in invars
               and primitives.is_float(prog.avals[v]))
  aux = tuple(v for v in reads if v not in p_ids and v not in acts)
  last_use: dict[int, int] = {}
  for op in prog.ops[b:]:
    for v in op.in_ids():
      last_use[v] = op.index
  outset = {v for v in prog.outvars if not isinstance(v, Lit)}
  read_later = [v for v in defined if v in last_use or v in outset]
  outs = tuple(sorted(v for v in read_later if primitives.is_float(prog.avals[v])))
  extra = tuple(sorted(v for v in read_later if not primitives.is_float(prog.avals[v])))
  if not outs:   # a dead-end range still costs its forward; give it one output
    floats = [o for op in ops for o in op.outvars if o >= 0 and primitives.is_float(prog.avals[o])]
    outs = tuple(floats[-1:])
  pbytes = sum(prog.nbytes(v) for v in p_ids)
  nparams = sum(primitives.aval_size(prog.avals[v]) for v in p_ids)
  batch = frozenset(v for v in acts + aux + outs if v in batch_dep)
  return Piece(prog, tuple(ops), p_ids, acts, aux, outs, batch, int(pbytes), int(nparams),
               extra)


def batch_draws(piece: Piece) -> dict:
  """The piece's batch-sized random draws: op index -> the axis of its result that carries the
  microbatch's rows. A draw is batch-sized when its result has the shape of a value the piece
  computes from its batch inputs (the activation a dropout masks) and the microbatch's rows
  along some axis (the first such); the piece's layers do not keep the full batch's trace, so
  the shape decides as the full trace would."""
  batch_in = [v for v in piece.act_ids + piece.aux_ids if v in piece.batch_ids]
  rows = {int(piece.program.avals[v].shape[0]) for v in batch_in
          if len(piece.program.avals[v].shape) >= 1}
  if len(rows) != 1:
    return {}
  (b,) = rows
  dep = set(batch_in)
  shapes = set()
  for op in piece.ops:
    if any(v in dep for v in op.in_ids()):
      for o in op.outvars:
        if o >= 0:
          dep.add(o)
          shapes.add(tuple(piece.program.avals[o].shape))
  out = {}
  for op in piece.ops:
    if op.name not in regen.RANDOM_PRIMITIVES or "shape" not in op.params:
      continue
    shape = tuple(op.params["shape"])
    outs = [o for o in op.outvars if o >= 0]
    if not outs or tuple(piece.program.avals[outs[0]].shape) not in shapes:
      continue
    axis = next((i for i, d in enumerate(shape) if d == b), None)
    if axis is not None:
      out[op.index] = axis
  return out


def redraws(piece: Piece, num_microbatches: int | None) -> dict:
  """The piece's random draws a stage redraws at the full batch: op index ->
  :class:`~harpjax.compiler.trace.regen.Redraw`.

  A stage draws a batch-sized random value (a dropout mask, :func:`batch_draws`) as the rows
  of a draw at the full batch's shape (:mod:`~harpjax.compiler.trace.regen`), so that its
  numbers are ``jax.jit``'s: with threefry keys (drawn by position) it hashes only the rows it
  keeps (:func:`~harpjax.compiler.trace.regen.redraw_slice`); with other PRNGs every
  microbatch's forward (and its recomputation under remat) hashes ``num_microbatches`` times
  the elements it keeps.
  """
  if not num_microbatches or num_microbatches <= 1:
    return {}
  out = {}
  ops = {op.index: op for op in piece.ops}
  for i, axis in batch_draws(piece).items():
    op = ops[i]
    shape = tuple(op.params["shape"])
    full = dict(op.params)
    full["shape"] = shape[:axis] + (shape[axis] * int(num_microbatches),) + shape[axis + 1:]
    out[i] = regen.Redraw(axis, full)
  return out


def position_draws(piece: Piece) -> frozenset:
  """``(shape, bit width)`` of the piece's batch-sized ``random_bits`` draws that a stage
  computes by position (threefry keys: :func:`~harpjax._compat.threefry_key_words`): a
  microbatch's, or a data-parallel replica's, rows of the full batch's draw, hashing those
  rows alone. Their cost is a draw of the piece's (the slice's) shape; the count of its
  counters differs from ``random_bits`` ' own
  (:func:`~harpjax.compiler.profile.estimate.position_draw_flops`)."""
  out = set()
  ops = {op.index: op for op in piece.ops}
  for i in batch_draws(piece):
    op = ops[i]
    if op.name == "random_bits" and _compat.draws_by_position(
        piece.program.avals[op.invars[0]]):
      out.add((tuple(int(d) for d in op.params["shape"]), int(op.params["bit_width"])))
  return frozenset(out)


def redraw_hook(piece: Piece, num_microbatches: int | None, stand_in: bool = False):
  """An :func:`~harpjax.compiler.trace.eval_ops` hook drawing :func:`redraws` ' draws as a
  stage does (the first microbatch's rows of the full batch's draw); ``None`` if none. With
  ``stand_in``, a draw the stage computes by position is left as the piece's own draw at the
  microbatch's shape, which hashes the same elements in the same temporaries (what the jaxpr
  estimate costs: a ``random_bits`` it knows, :func:`position_draws`)."""
  sites = redraws(piece, num_microbatches)
  if stand_in:
    ops = {op.index: op for op in piece.ops}
    sites = {i: site for i, site in sites.items()
             if not (ops[i].name in ("random_bits", "random_split")
                     and _compat.draws_by_position(piece.program.avals[ops[i].invars[0]]))}
  if not sites:
    return None
  avals = piece.program.avals

  def hook(op, invals):
    site = sites.get(op.index)
    if site is None:
      return None
    return apply_site(op.primitive, op.params, invals, site, 0,
                      [avals[o] if o >= 0 else None for o in op.outvars])
  return hook


def make_functions(piece: Piece, remat: bool | str = False,
                   num_microbatches: int | None = None, stand_in: bool = False):
  """``(fwd_bwd, fwd_residuals)`` of a piece.

  ``fwd_bwd(params, acts, aux, cts) -> (param_grads, act_grads)``;
  ``fwd_residuals(params, acts, aux) -> (outputs, residual leaves)``. ``remat``
  (:data:`~harpjax.compiler.trace.REMAT_MODES`, ``True`` is ``"full"``): the forward is
  rematerialised in the backward as the runtime's stage does it (``"full"``: only the inputs
  are kept; ``"dots"``: the matmuls' outputs too). With ``num_microbatches``, batch-sized
  random draws are the first microbatch's rows of the full batch's, as a stage draws them
  (:func:`redraws`; ``stand_in`` as in :func:`redraw_hook`).
  """
  run = ops_function(piece.ops, piece.param_ids + piece.act_ids + piece.aux_ids, piece.out_ids)
  hook = redraw_hook(piece, num_microbatches, stand_in)
  primal = checkpointed(remat)(lambda params, acts, aux: run(*params, *acts, *aux, hook=hook))

  def fwd_bwd(params, acts, aux, cts):
    _, vjp = jax.vjp(lambda p, a: primal(p, a, aux), params, acts)
    return vjp(cts)

  def fwd_residuals(params, acts, aux):
    outs, vjp = jax.vjp(lambda p, a: primal(p, a, aux), params, acts)
    return outs, jax.tree_util.tree_leaves(vjp)

  return fwd_bwd, fwd_residuals


def abstract_inputs(piece: Piece) -> tuple:
  """``(params, acts, aux, cts)`` as ``jax.ShapeDtypeStruct`` s."""
  sds = lambda v: jax.ShapeDtypeStruct(tuple(piece.program.avals[v].shape),
                                       piece.program.avals[v].dtype)
  return (tuple(sds(v) for v in piece.param_ids), tuple(sds(v) for v in piece.act_ids),
          tuple(sds(v) for v in piece.aux_ids), tuple(sds(v) for v in piece.out_ids))


def shardings(piece: Piece, mesh: Mesh) -> tuple:
  """In-shardings ``(params, acts, aux, cts)`` of a piece on a ``(dp, tp)`` mesh."""
  dp, tp = mesh.devices.shape
  specs = sharding.param_specs(piece.program, piece.ops, piece.param_ids, tp)
  ns = lambda spec: NamedSharding(mesh, spec)
  data = lambda v: ns(sharding.batch_spec(piece.program.avals[v].shape, 0, dp)
                      if v in piece.batch_ids else P())
  return (tuple(ns(specs[v]) for v in piece.param_ids), tuple(data(v) for v in piece.act_ids),
          tuple(data(v) for v in piece.aux_ids), tuple(data(v) for v in piece.out_ids)), specs


# --------------------------------------------------------------------------- XLA analysis


@dataclasses.dataclass(frozen=True)
class XlaStats:
  """Per-device facts about a piece's compiled forward+backward (one microbatch).

  Attributes:
    flops: FLOPs (XLA cost analysis).
    bytes_accessed: bytes read and written (XLA cost analysis).
    transcendentals: transcendental ops.
    collective_bytes: ``{kind: [bytes, count]}`` of all-reduce, all-gather,
      reduce-scatter, all-to-all and collective-permute results in the partitioned HLO.
    temp_bytes: XLA's temporary buffer (workspace) size.
    fwd_temp_bytes, bwd_temp_bytes: the workspace of the forward and of the backward where
      they run as two executables, as the runtime runs them (default ``temp_bytes``: the
      joint forward+backward's serves as both).
    residual_bytes: bytes of the forward's residuals kept for the backward (inputs that are
      merely forwarded excluded): activation memory per in-flight microbatch.
    draw_bytes, draw_max_bytes: the sum and the largest of the forward's random draws'
      bytes (the jaxpr estimate; ``0``: not known).
    remat_held_bytes: of a rematerialising backward's recomputed values, the bytes it keeps
      for its backward proper (the jaxpr estimate; ``0``: none or not known).
    param_bytes: bytes of this device's shard of the parameters.
    num_params: elements of this device's shard of the parameters.
    compile_s: seconds spent compiling.
  """
  flops: float
  bytes_accessed: float
  transcendentals: float
  collective_bytes: dict
  temp_bytes: float
  residual_bytes: float
  param_bytes: float
  num_params: float
  compile_s: float = 0.0
  fwd_temp_bytes: float | None = None
  bwd_temp_bytes: float | None = None
  draw_bytes: float = 0.0
  draw_max_bytes: float = 0.0
  remat_held_bytes: float = 0.0

  def __post_init__(self):
    for f in ("fwd_temp_bytes", "bwd_temp_bytes"):
      if getattr(self, f) is None:
        object.__setattr__(self, f, self.temp_bytes)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> "XlaStats":
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


_COLLECTIVE = re.compile(
    r"=\s*(?P<type>.*?)\s(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(?P<start>-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}


def parse_collectives(hlo_text: str) -> dict[str, list]:
  """``{kind: [bytes, count]}`` of the collectives in an HLO module's text (result sizes)."""
  out: dict[str, list] = {}
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.search(line)
    if not m or "-done" in line.split("=")[0]:
      continue
    sizes = []
    for dt, dims in _SHAPE.findall(m.group("type")):
      if dt not in _DTYPE_BYTES:
        continue
      n = int(np.prod([int(x) for x in dims.split(",") if x], dtype=np.int64)) if dims else 1
      sizes.append(n * _DTYPE_BYTES[dt])
    if not sizes:
      continue
    nbytes = max(sizes) if m.group("start") else sum(sizes)
    acc = out.setdefault(m.group("kind"), [0.0, 0])
    acc[0] += float(nbytes)
    acc[1] += 1
  return out


def _cost(compiled) -> dict:
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else {}
  return dict(ca or {})


def xla_stats(piece: Piece, devices: Sequence[Any],
              mesh_shape: tuple[int, int] | None = None, compiled=None,
              remat: bool | str = False, num_microbatches: int | None = None) -> XlaStats:
  """Compiles a piece's forward+backward on ``devices`` and reads what XLA says.

  Args:
    piece: the piece, at the microbatch size to cost (for the analytic profiler: the local
      batch of one data-parallel replica).
    devices: the devices (any platform: only compilation happens).
    mesh_shape: ``(dp, tp)``; default ``(1, len(devices))``.
    compiled: the piece's forward+backward already compiled with :func:`shardings` on this
      mesh (saves a compilation).
    remat: rematerialise the forward in the backward (:func:`make_functions`).
    num_microbatches: batch-sized random draws drawn at the full batch and sliced, as a
      stage draws them (:func:`redraws`).

  Returns:
    Per-device :class:`XlaStats`.
  """
  t0 = time.perf_counter()
  mesh = sharding.make_mesh(devices, mesh_shape)
  tp = mesh.devices.shape[1]
  n_dev = mesh.devices.size
  fwd_bwd, fwd_res = make_functions(piece, remat, num_microbatches)
  args = abstract_inputs(piece)
  in_sh, specs = shardings(piece, mesh)
  if compiled is None:
    compiled = jax.jit(fwd_bwd, in_shardings=in_sh).lower(*args).compile()
  cost = _cost(compiled)
  mem = compiled.memory_analysis()
  colls = parse_collectives(compiled.as_text()) if n_dev > 1 else {}
  # Residuals: the forward's vjp leaves, per device. Parameters are held anyway; activation
  # inputs kept for the backward count (the stage holds them until then).
  closed = jax.make_jaxpr(fwd_res)(*args[:3])
  n_params = len(piece.param_ids)
  inpos = {v: i for i, v in enumerate(closed.jaxpr.invars)}
  n_out = len(piece.out_ids)
  keep, seen, kept_inputs = [], set(), 0.0
  dp = mesh.devices.shape[0]
  for i, v in enumerate(closed.jaxpr.outvars[n_out:]):
    if _compat.is_literal(v) or v in seen:
      continue
    seen.add(v)
    if v in inpos:
      if inpos[v] >= n_params:
        vid = (piece.act_ids + piece.aux_ids)[inpos[v] - n_params]
        kept_inputs += primitives.aval_nbytes(v.aval) / (dp if vid in piece.batch_ids else 1)
      continue
    keep.append(i)
  res_vars = [closed.jaxpr.outvars[n_out + i] for i in keep]
  if keep and n_dev == 1:   # one device: the residuals' own sizes
    residual = float(sum(primitives.aval_nbytes(v.aval) for v in res_vars))
  elif keep:                # sharded: what XLA keeps per device
    sel = jax.jit(lambda *a: [fwd_res(*a)[1][i] for i in keep], in_shardings=in_sh[:3])
    res_mem = sel.lower(*args[:3]).compile().memory_analysis()
    residual = float(getattr(res_mem, "output_size_in_bytes", 0))
  else:
    residual = 0.0
  residual += kept_inputs
  local_bytes, local_n = 0.0, 0.0
  for v in piece.param_ids:
    aval = piece.program.avals[v]
    div = tp if specs[v] != P() else 1
    local_bytes += primitives.aval_nbytes(aval) / div
    local_n += primitives.aval_size(aval) / div
  return XlaStats(flops=float(cost.get("flops", 0.0)),
                  bytes_accessed=float(cost.get("bytes accessed", 0.0)),
                  transcendentals=float(cost.get("transcendentals", 0.0)),
                  collective_bytes=colls,
                  temp_bytes=float(getattr(mem, "temp_size_in_bytes", 0.0)),
                  residual_bytes=residual, param_bytes=local_bytes, num_params=local_n,
                  compile_s=time.perf_counter() - t0)

