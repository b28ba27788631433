"""Cost sources behind one interface: jaxpr, analytic, measured, imported.

A source turns a :class:`LayerTask` (one layer's piece on one submesh with one logical mesh of
one GPU type) into a :class:`LayerCost` (forward+backward seconds of one microbatch including
its collectives and the data-parallel gradient all-reduce, and per-device memory).

* :class:`JaxprSource` (the default) reads FLOPs, bytes, collectives and memory off the
  piece's forward+backward jaxpr (:mod:`~harpjax.compiler.profile.estimate`; nothing is
  compiled) and applies the GPU type's calibrated rates as the analytic source does.
* :class:`MeasuredSource` compiles the piece on the submesh's devices and times it (median).
* :class:`AnalyticSource` compiles the piece of one data-parallel replica (local batch) on
  ``tp`` devices from ``jax.ShapeDtypeStruct`` s, and applies the GPU type's calibrated rates
  (:mod:`~harpjax.compiler.profile.calibration`) to XLA's FLOPs and bytes, its collectives to
  the host link, and a ring all-reduce of the gradients to the link between the replicas.
* :class:`ImportedSource` scales the analytic compute of the layers of the model's repeated
  block so that one block takes what a published measurement says (the Zorse per-layer data).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from harpjax.cluster import Link
from harpjax.compiler.layers import sharding
from harpjax.compiler.profile import calibration as calib
from harpjax.compiler.profile import estimate
from harpjax.compiler.profile import pieces as pieces_lib
from harpjax.compiler.profile.collectives import collective_time_s
from harpjax.compiler.trace import remat_mode
from harpjax.errors import HarpjaxError, PublishedDataError

log = logging.getLogger(__name__)

__all__ = ["LayerTask", "LayerCost", "CostSource", "cost_from_stats", "compute_time_s",
           "MIN_TIME_S", "JaxprSource",
           "AnalyticSource", "MeasuredSource", "ImportedSource"]


MIN_TIME_S = 1e-9
"""Seconds of a layer with no work of its own (integer bookkeeping XLA fuses into its
neighbours): stage times must be positive."""


@dataclasses.dataclass(frozen=True, eq=False)
class LayerTask:
  """One layer to cost on one submesh / logical mesh of one GPU type.

  Attributes:
    layer: layer index.
    signature: the layer's signature at the full microbatch; with ``local_batch`` it
      identifies the piece one replica runs (what deduplicates).
    local: ``() -> (layer sequence at the local batch, piece of the layer)``, called only
      when the task is actually costed (a trace at the local batch may be needed).
    full_piece: the layer at the full microbatch (what a measurement runs).
    gpu: the subcluster's :class:`~harpjax.cluster.GPUType`.
    submesh: ``(n, m)``.
    mesh: ``(dp, tp)``.
    microbatch: the full microbatch size.
    local_batch: ``microbatch / dp``.
    host_link: the link inside a host (tensor-parallel collectives; data parallelism when
      ``n == 1``).
    node_link: the link between hosts of the subcluster.
    devices: the submesh's JAX devices (measured source only).
    dp_scaled: the piece is at the full microbatch although ``dp > 1`` (no local trace):
      scale batch-proportional costs by ``1 / dp``.
  """
  layer: int
  signature: str
  local: Any
  full_piece: Any
  gpu: Any
  submesh: tuple
  mesh: tuple
  microbatch: int
  local_batch: int
  host_link: Link
  node_link: Link
  devices: tuple | None = None
  dp_scaled: bool = False

  @functools.cached_property
  def _resolved(self):
    return self.local()

  @property
  def seq(self):
    """The layer sequence at the local batch."""
    return self._resolved[0]

  @property
  def piece(self):
    """The layer at the local batch (one data-parallel replica's share)."""
    return self._resolved[1]

  def key(self, source: str, extra: dict | None = None) -> dict:
    """The cache key: signature, GPU type, submesh, logical mesh, microbatch size, source."""
    g = self.gpu
    k = {"source": source, "signature": self.signature, "gpu": g.name,
         "gpu_rates": [g.peak_flops, g.mem_bandwidth_bytes_per_s, g.memory_bytes],
         "submesh": list(self.submesh), "mesh": list(self.mesh),
         "microbatch": self.local_batch, "dp_scaled": self.dp_scaled,
         "links": [self.host_link.bandwidth_bytes_per_s, self.host_link.latency_s,
                   self.node_link.bandwidth_bytes_per_s, self.node_link.latency_s]}
    k.update(extra or {})
    return k


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """Per-microbatch costs of one layer on one device of a submesh.

  Attributes:
    time_s: forward+backward seconds with the tensor-parallel collectives; not the
      gradient all-reduce among data-parallel replicas, which runs once per iteration (the
      tables' end time, from :attr:`grad_bytes`).
    comm_s: the part of ``time_s`` spent in collectives (analytic sources).
    param_mem_bytes: weights + gradients + optimizer state of this device's shard.
    act_mem_bytes: residuals kept per in-flight microbatch.
    temp_bytes: XLA's workspace (the larger of the forward's and the backward's).
    fwd_temp_bytes, bwd_temp_bytes: the forward's and the backward's workspace, which the
      runtime runs as two executables (default ``temp_bytes``).
    flops: FLOPs per device.
    grad_bytes: bytes of this device's gradient shard (what the data-parallel replicas
      reduce).
    draw_bytes, draw_max_bytes: the sum and the largest of the forward's random draws
      (:func:`~harpjax.compiler.profile.memory.stage_draw_workspace_bytes`).
    remat_held_bytes: what a rematerialising backward keeps of its recomputed forward for
      its backward proper (what the layer holds while later layers of its stage run theirs).
    inner_remat_flops, inner_remat_time_s: what the layer adds to a stage that
      rematerialises as a whole when it is not the stage's last layer: the FLOPs and seconds
      of recomputing what makes its outputs, which the next layer's recomputation reads and
      its own backward does not need
      (:func:`~harpjax.compiler.profile.estimate.outputs_recompute_work`; the tables charge
      them for layers ``i..j-1`` of a stage on ``i..j``). 0 without rematerialisation, and
      for the sources that do not read the layer's jaxpr.
  """
  time_s: float
  comm_s: float
  param_mem_bytes: float
  act_mem_bytes: float
  temp_bytes: float
  flops: float
  grad_bytes: float = 0.0
  fwd_temp_bytes: float | None = None
  bwd_temp_bytes: float | None = None
  draw_bytes: float = 0.0
  draw_max_bytes: float = 0.0
  remat_held_bytes: float = 0.0
  inner_remat_flops: float = 0.0
  inner_remat_time_s: float = 0.0

  def __post_init__(self):
    for f in ("fwd_temp_bytes", "bwd_temp_bytes"):
      if getattr(self, f) is None:
        object.__setattr__(self, f, self.temp_bytes)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> "LayerCost":
    return cls(**{f.name: float(d[f.name]) for f in dataclasses.fields(cls) if f.name in d})


class CostSource(Protocol):
  """What a cost source provides.

  ``local_trace``: the source costs a task from its piece at the local microbatch
  (:attr:`LayerTask.piece`, which may trace the step again at ``microbatch / dp``); ``False``:
  from the full microbatch's piece alone.
  """
  name: str
  local_trace: bool

  def cache_extra(self) -> dict:
    """Anything beyond the task that the result depends on (part of the cache key)."""

  def cost(self, task: LayerTask) -> LayerCost:
    """Costs one task."""


def cost_from_stats(st: pieces_lib.XlaStats, work: calib.Work, task: LayerTask,
                    efficiencies: dict | None, state_bytes_per_param: float,
                    scale: float = 1.0, accumulated: tuple[float, float] | None = None,
                    inner_remat: calib.Work | None = None) -> LayerCost:
  """A task's :class:`LayerCost` from per-device statistics of its piece: the calibrated time
  model of the GPU type on its :class:`~harpjax.compiler.profile.calibration.Work`, the
  tensor-parallel collectives on the host link; the gradients' bytes for the all-reduce over
  ``dp`` the tables charge once per iteration; batch-proportional statistics divided by
  ``scale``. The stage's backward adds each gradient into its (donated) accumulator, which the
  piece's forward+backward does not: one FLOP per parameter element of the device, reading
  the gradient and the accumulator and writing the sum; ``accumulated`` (elements, bytes)
  says which, default all of them (a gradient a scatter-add produces, an embedding's, is
  added into the accumulator by the scatter itself:
  :func:`~harpjax.compiler.profile.estimate.accumulated_params`). ``inner_remat``: the work a
  stage rematerialising as a whole adds for the layer when it is not the stage's last
  (:attr:`LayerCost.inner_remat_flops`), timed by the same model (no floor, no collective)."""
  dp, tp = task.mesh
  n_acc, b_acc = accumulated if accumulated is not None else (st.num_params, st.param_bytes)
  acc = calib.Work((), (), float(n_acc), 3.0 * float(b_acc), 0.0)
  t_comp = max(compute_time_s(work.scaled(scale) + acc, task, efficiencies), MIN_TIME_S)
  t_coll = collective_time_s({k: [b / scale, c] for k, (b, c) in st.collective_bytes.items()},
                             tp, task.host_link)
  return LayerCost(time_s=t_comp + t_coll, comm_s=t_coll,
                   param_mem_bytes=st.num_params * state_bytes_per_param,
                   act_mem_bytes=st.residual_bytes / scale, temp_bytes=st.temp_bytes / scale,
                   fwd_temp_bytes=st.fwd_temp_bytes / scale,
                   bwd_temp_bytes=st.bwd_temp_bytes / scale,
                   flops=st.flops / scale + acc.light_flops, grad_bytes=st.param_bytes,
                   draw_bytes=st.draw_bytes / scale, draw_max_bytes=st.draw_max_bytes / scale,
                   remat_held_bytes=st.remat_held_bytes / scale,
                   **_inner_remat(inner_remat, scale, task, efficiencies))


def _inner_remat(work: calib.Work | None, scale: float, task: LayerTask,
                 efficiencies: dict | None) -> dict:
  """:class:`LayerCost`'s ``inner_remat_*`` fields of ``work`` (none: zeros)."""
  if work is None or not (work.flops or work.kernels or work.bytes):
    return {}
  w = work.scaled(scale)
  return dict(inner_remat_flops=w.flops,
              inner_remat_time_s=compute_time_s(w, task, efficiencies))


def compute_time_s(work: calib.Work, task: LayerTask, efficiencies: dict | None) -> float:
  """Seconds of ``work`` on one device of the task's GPU type (the calibrated time model)."""
  g = task.gpu
  return float(calib.predict_time_s(work, g.peak_flops, g.mem_bandwidth_bytes_per_s,
                                    calib.efficiency_for(g.name, efficiencies),
                                    fused_attention=g.fused_attention))


def _efficiency_key(efficiencies: dict | None) -> dict:
  table = calib.efficiency_table(efficiencies)
  table["*"] = calib.DEFAULT_EFFICIENCY
  return {k: list(dataclasses.astuple(v)[:3]) for k, v in sorted(table.items())}


def remat_key(remat) -> bool | str:
  """A remat mode as the profile cache keys it: ``False``/``True`` for ``"none"``/``"full"``
  (the keys of caches written before the other modes), the mode's name otherwise."""
  mode = remat_mode(remat)
  return {"none": False, "full": True}.get(mode, mode)


class JaxprSource:
  """Costs from the piece's jaxpr and calibrated GPU rates: nothing is compiled.

  The piece's forward+backward is traced once per layer signature (milliseconds) and read per
  logical mesh by :func:`~harpjax.compiler.profile.estimate.jaxpr_stats`: FLOPs, bytes under
  an XLA-like fusion model, the all-reduces of its tensor-parallel rules, residuals, workspace
  and the parameter shard, per device. The data-parallel share comes from which values carry
  the batch, so the step is never traced again at the local microbatch. The time model is the
  analytic source's (:func:`cost_from_stats`).

  Args:
    efficiencies: GPU name -> :class:`~harpjax.compiler.profile.calibration.Efficiency`;
      default the calibrated table.
    state_bytes_per_param: weights + gradients + optimizer state per parameter.
    remat: cost a forward rematerialised in the backward (a mode of
      :data:`~harpjax.compiler.trace.REMAT_MODES`; ``True`` is ``"full"``).
    num_microbatches: the step's microbatches (B): a stage draws its batch-sized random
      numbers at the full batch and slices its rows
      (:func:`~harpjax.compiler.profile.pieces.redraws`); ``None``: as the microbatch.
  """
  name = "jaxpr"
  local_trace = False

  def __init__(self, efficiencies: dict | None = None, state_bytes_per_param: float = 16.0,
               remat: bool | str = False, num_microbatches: int | None = None):
    self.efficiencies = efficiencies
    self.state_bytes_per_param = float(state_bytes_per_param)
    self.remat = remat_key(remat)
    self.num_microbatches = num_microbatches
    self._traced: dict = {}
    self._stats: dict = {}

  def cache_extra(self) -> dict:
    return {"state_bytes_per_param": self.state_bytes_per_param,
            "efficiencies": _efficiency_key(self.efficiencies), "remat": self.remat,
            "estimate": estimate.ESTIMATE_VERSION, "model": calib.COST_MODEL_VERSION,
            "num_microbatches": self.num_microbatches, "backend": jax.default_backend()}

  def traced(self, task: LayerTask) -> estimate.TracedPiece:
    """The task's piece at the full microbatch, traced (once per signature)."""
    k = (task.signature, task.microbatch)
    got = self._traced.get(k)
    if got is None:
      got = self._traced[k] = estimate.trace_piece(task.full_piece, self.remat,
                                                   self.num_microbatches)
    return got

  def stats(self, task: LayerTask) -> tuple[pieces_lib.XlaStats, calib.Work]:
    """Per-device statistics and work on the task's logical mesh (cached by signature and
    mesh)."""
    k = (task.signature, task.microbatch, tuple(task.mesh))
    got = self._stats.get(k)
    if got is None:
      got = self._stats[k] = estimate.jaxpr_costs(self.traced(task), tuple(task.mesh))
    return got

  def cost(self, task: LayerTask) -> LayerCost:
    st, work = self.stats(task)
    traced = self.traced(task)
    acc = estimate.accumulated_params(traced, tuple(task.mesh))
    return cost_from_stats(st, work, task, self.efficiencies, self.state_bytes_per_param,
                           accumulated=acc,
                           inner_remat=estimate.outputs_recompute_work(traced,
                                                                       tuple(task.mesh)))


class AnalyticSource:
  """XLA cost/memory analysis at the local batch + calibrated GPU rates (no arrays).

  Args:
    db: the :class:`~harpjax.compiler.profile.cache.ProfileDB` (for the compile-level statistics).
    efficiencies: GPU name -> :class:`~harpjax.compiler.profile.calibration.Efficiency`; default the
      calibrated table.
    state_bytes_per_param: weights + gradients + optimizer state per parameter.
    devices: devices to compile on (default ``jax.devices()``); ``tp`` must not exceed them.
    num_microbatches: the step's microbatches (B): batch-sized random draws drawn at the full
      batch and sliced, as a stage draws them (:func:`~harpjax.compiler.profile.pieces.redraws`).
  """
  name = "analytic"
  local_trace = True

  def __init__(self, db, efficiencies: dict | None = None, state_bytes_per_param: float = 16.0,
               devices=None, remat: bool | str = False, num_microbatches: int | None = None):
    self.db = db
    self.remat = remat_key(remat)
    self.num_microbatches = num_microbatches
    self.efficiencies = efficiencies
    self.state_bytes_per_param = float(state_bytes_per_param)
    self.devices = list(devices) if devices is not None else None
    self._memo: dict = {}
    self.compiles = 0

  def cache_extra(self) -> dict:
    return {"state_bytes_per_param": self.state_bytes_per_param,
            "efficiencies": _efficiency_key(self.efficiencies), "remat": self.remat,
            "estimate": estimate.ESTIMATE_VERSION, "model": calib.COST_MODEL_VERSION}

  def stats(self, task: LayerTask) -> pieces_lib.XlaStats:
    """XLA statistics of the task's piece on ``tp`` devices (cached by signature)."""
    tp = task.mesh[1]
    key = {"what": "xla-stats", "signature": task.signature, "tp": tp,
           "microbatch": task.local_batch, "remat": self.remat,
           "num_microbatches": self.num_microbatches}
    k = (task.signature, tp, task.local_batch, self.remat)
    got = self._memo.get(k)
    if got is not None:
      return got
    cached = self.db.get(key)
    if cached is not None:
      try:
        got = pieces_lib.XlaStats.from_json(cached)
      except (KeyError, TypeError):
        got = None
    if got is None:
      devices = self.devices if self.devices is not None else jax.devices()
      if tp > len(devices):
        raise HarpjaxError(
            f"the analytic profiler compiles a tp={tp} layer on {tp} local devices but only "
            f"{len(devices)} exist; set XLA_FLAGS=--xla_force_host_platform_device_count={tp} "
            "before JAX is imported, or pass max_tp")
      got = pieces_lib.xla_stats(task.piece, devices[:tp], remat=self.remat,
                                 num_microbatches=self.num_microbatches)
      self.compiles += 1
      self.db.put(key, got.to_json())
    self._memo[k] = got
    return got

  def work(self, task: LayerTask) -> calib.Work:
    """The :class:`~harpjax.compiler.profile.calibration.Work` of the piece one replica runs
    (its jaxpr at the local batch on ``(1, tp)``; cached by signature)."""
    tp = task.mesh[1]
    k = ("work", task.signature, tp, task.local_batch)
    got = self._memo.get(k)
    if got is None:
      got = self._memo[k] = estimate.jaxpr_work(estimate.trace_piece(task.piece), (1, tp))
    return got

  def compute_time_s(self, task: LayerTask) -> float:
    """Seconds of the task's compute on one device (no collectives)."""
    scale = task.mesh[0] if task.dp_scaled else 1
    return compute_time_s(self.work(task).scaled(scale), task, self.efficiencies)

  def cost(self, task: LayerTask) -> LayerCost:
    return cost_from_stats(self.stats(task), self.work(task), task, self.efficiencies,
                           self.state_bytes_per_param, task.mesh[0] if task.dp_scaled else 1)


class MeasuredSource:
  """Compiles each piece on the submesh's devices and times it (median of ``repeats``).

  Memory comes from XLA's memory analysis of the same sharded program.
  """
  name = "measured"
  local_trace = False

  def __init__(self, db, repeats: int = 5, warmup: int = 1, state_bytes_per_param: float = 16.0,
               seed: int = 0, remat: bool | str = False):
    self.db = db
    self.remat = remat_key(remat)
    self.repeats = max(1, int(repeats))
    self.warmup = max(0, int(warmup))
    self.state_bytes_per_param = float(state_bytes_per_param)
    self.seed = seed

  def cache_extra(self) -> dict:
    return {"repeats": self.repeats, "state_bytes_per_param": self.state_bytes_per_param,
            "platform": jax.devices()[0].platform, "remat": self.remat}

  def cost(self, task: LayerTask) -> LayerCost:
    if task.devices is None:
      raise HarpjaxError("the measured profiler needs the submesh's devices; the cluster "
                         "must map onto local JAX devices (Cluster.local_devices)")
    piece = task.full_piece
    mesh = sharding.make_mesh(task.devices, task.mesh)
    in_sh, _ = pieces_lib.shardings(piece, mesh)
    fwd_bwd, _ = pieces_lib.make_functions(piece, self.remat)
    abstract = pieces_lib.abstract_inputs(piece)
    rng = np.random.default_rng(self.seed)
    args = jax.tree_util.tree_map(lambda s, sh: jax.device_put(_random(s, rng), sh),
                                  abstract, in_sh)
    fn = jax.jit(fwd_bwd, in_shardings=in_sh).lower(*args).compile()
    for _ in range(self.warmup):
      jax.block_until_ready(fn(*args))
    times = []
    for _ in range(self.repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - t0)
    st = pieces_lib.xla_stats(piece, task.devices, task.mesh, compiled=fn, remat=self.remat)
    return LayerCost(time_s=float(statistics.median(times)), comm_s=0.0,
                     param_mem_bytes=st.num_params * self.state_bytes_per_param,
                     act_mem_bytes=st.residual_bytes, temp_bytes=st.temp_bytes, flops=st.flops,
                     grad_bytes=st.param_bytes, fwd_temp_bytes=st.fwd_temp_bytes,
                     bwd_temp_bytes=st.bwd_temp_bytes)


def _random(s, rng):
  """A random array of ``s``'s shape and dtype (zeros for integers: valid indices)."""
  if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
    keys = jax.random.split(jax.random.key(0), max(1, int(np.prod(s.shape))))
    return keys[0] if s.shape == () else keys.reshape(s.shape)
  if jnp.issubdtype(s.dtype, jnp.floating):
    return jnp.asarray(rng.standard_normal(s.shape) * 0.1, dtype=s.dtype)
  return jnp.zeros(s.shape, s.dtype)


class ImportedSource:
  """Published per-layer measurements (Zorse) for the repeated block, analytic elsewhere.

  The layers of the model's most repeated module kind (or ``module``) are one transformer
  block. The published model is chosen by the block's shape: the one whose hidden size equals
  the block's and whose parameters per layer are within :attr:`PARAMS_TOLERANCE` of the
  block's (``zorse_model_stats.json``), among those measured in fp16; the block's analytic
  compute times on the GPU type at the local batch are scaled so that they add up to that
  model's published forward+backward time of one layer at that microbatch size (at the
  published sequence length nearest the model's, with the microbatch scaled by the ratio of
  sequence lengths). Collectives, the gradient all-reduce and memory stay analytic; GPU types
  without data fall back to the analytic estimate.

  Args:
    base: the :class:`AnalyticSource`.
    model: Zorse model name (``"deepspeedgpt_2.7b"``); ``None``: chosen by the block's shape.
      A model whose shape is not the block's is refused.
    data: parsed Zorse latencies (default:
      :func:`~harpjax.compiler.profile.calibration.load_zorse`).
    module: module kind name of the block (default: the most repeated kind).
    stats: parsed Zorse model shapes (default:
      :func:`~harpjax.compiler.profile.calibration.load_zorse_stats`).

  Raises:
    PublishedDataError: the data is missing, or (when a task is costed) no published model
      has the block's shape.
  """
  name = "imported"
  local_trace = True
  PARAMS_TOLERANCE = 0.05

  def __init__(self, base: AnalyticSource, model: str | None = None, data: dict | None = None,
               module: str | None = None, stats: dict | None = None):
    self.base = base
    self.model = model
    self.data = data if data is not None else calib.load_zorse()
    self.stats = stats if stats is not None else calib.load_zorse_stats()
    if model is not None and model not in self.data:
      raise PublishedDataError(f"no published measurements for model {model!r}; known: "
                               f"{', '.join(sorted(self.data))}")
    self.module = module
    self._ratio: dict = {}
    self._chosen: dict = {}

  def cache_extra(self) -> dict:
    return {"imported_model": self.model, "module": self.module, **self.base.cache_extra()}

  def _block(self, seq) -> list[int]:
    kinds = seq.module_kinds()
    if not kinds:
      return []
    name = self.module or max(kinds, key=kinds.get)
    inst = seq.instances(name)
    return list(range(inst[0].first_layer, inst[0].last_layer + 1)) if inst else []

  def _measured(self) -> dict[str, tuple[int, int]]:
    """Published models with fp16 measurements -> ``(hidden size, parameters per layer)``."""
    out = {}
    for name, by_gpu in self.data.items():
      shape = self.stats.get(name)
      if not isinstance(shape, dict) or "hidden_size" not in shape:
        continue
      if any("float16" in d for by_seq in by_gpu.values() for d in by_seq.values()):
        out[name] = (int(shape["hidden_size"]), int(shape["parameters_per_layer"]))
    return out

  def choose(self, seq) -> str | None:
    """The published model whose shape is the block's (``None``: the model has no repeated
    block, so everything is analytic).

    Raises:
      PublishedDataError: no published model has the block's shape, or the one given does
        not.
    """
    key = id(seq)
    if key in self._chosen:
      return self._chosen[key][1]
    block = self._block(seq)
    got = None
    if block:
      dep = pieces_lib.batch_dependent(seq.program, seq.input_kinds)
      pieces = [pieces_lib.build_piece(seq, i, i, dep) for i in block]
      params = sum(p.num_params for p in pieces)
      hidden = _hidden_size(pieces[0])
      measured = self._measured()
      fits = lambda m: (measured[m][0] == hidden and abs(measured[m][1] - params)
                        <= self.PARAMS_TOLERANCE * params)
      if self.model is not None:
        if self.model in measured and fits(self.model):
          got = self.model
        else:
          h, p = measured.get(self.model, (None, None))
          raise PublishedDataError(
              f"the published model {self.model!r} (hidden {h}, {_millions(p)} parameters "
              f"per layer) does not have this model's block shape (hidden {hidden}, "
              f"{_millions(params)} per block): drop imported_model to choose by shape, or "
              "profile with source='jaxpr'")
      else:
        cands = sorted((m for m in measured if fits(m)),
                       key=lambda m: abs(measured[m][1] - params))
        if not cands:
          near = sorted(measured, key=lambda m: (abs(measured[m][0] - hidden),
                                                 abs(measured[m][1] - params)))[:4]
          raise PublishedDataError(
              f"no published measurements of a block of hidden {hidden} with "
              f"{_millions(params)} parameters (the nearest: "
              + ", ".join(f"{m} {measured[m][0]}/{_millions(measured[m][1])}" for m in near)
              + "); profile with source='jaxpr'")
        got = cands[0]
        log.info("imported costs: the repeated block (hidden %d, %s parameters) is timed by "
                 "the published %s", hidden, _millions(params), got)
    self._chosen[key] = (seq, got)   # the sequence kept alive: its id stays its own
    return got

  def _measured_s(self, model: str, gpu_name: str, seq_len: int, mbs: int) -> float | None:
    for key in calib.ZORSE_GPU_KEYS.get(gpu_name, ()):
      by_seq = self.data[model].get(key)
      if not by_seq:
        continue
      seqs = [int(s) for s, d in by_seq.items() if "float16" in d]
      if not seqs:
        continue
      s = min(seqs, key=lambda x: abs(np.log(x / seq_len)))
      entry = by_seq[str(s)]["float16"]
      eff_mbs = mbs * seq_len / s
      ms = calib.zorse_fit_ms(entry, eff_mbs)
      if ms is None:
        table = calib.zorse_layer_ms(entry)
        if table:
          xs = sorted(table)
          ms = float(np.interp(eff_mbs, xs, [table[x] for x in xs]))
      if ms is not None and ms > 0:
        return ms * 1e-3
    return None

  def cost(self, task: LayerTask) -> LayerCost:
    model = self.choose(task.seq)   # first: a model without published data fails at once
    c = self.base.cost(task)
    block = self._block(task.seq)
    if model is None:
      return c
    lay = task.seq[task.layer]
    first = task.seq[block[0]]
    if lay.module != first.module:
      return c
    key = (task.gpu.name, task.local_batch)
    if key not in self._ratio:
      seq_len = _seq_len(task.piece)
      measured = self._measured_s(model, task.gpu.name, seq_len, task.local_batch)
      if measured is None:
        log.info("no published %s measurement for %s; using the analytic estimate", model,
                 task.gpu.name)
        self._ratio[key] = 1.0
      else:
        total = 0.0
        for i in block:
          t1 = dataclasses.replace(task, layer=i, signature=task.seq[i].signature,
                                   local=lambda i=i: (task.seq, _piece(task, i)),
                                   mesh=(1, 1))
          total += _compute_s(self.base.cost(t1))
        self._ratio[key] = measured / total
    r = self._ratio[key]
    # the published forward+backward includes adding each gradient into its accumulator (a
    # framework's backward writes into .grad): the analytic compute scaled includes it too
    return dataclasses.replace(c, time_s=c.time_s + _compute_s(c) * (r - 1.0))


def _compute_s(c: LayerCost) -> float:
  """A layer cost's compute seconds (its time less its collectives)."""
  return c.time_s - c.comm_s


def _hidden_size(piece) -> int:
  """The last dimension of the block's first activation input (its hidden size)."""
  for v in piece.act_ids + piece.aux_ids:
    shape = piece.program.avals[v].shape
    if len(shape) >= 2:
      return int(shape[-1])
  return 0


def _millions(n) -> str:
  return "?" if n is None else f"{n / 1e6:.1f}M"


def _piece(task: LayerTask, i: int):
  dep = pieces_lib.batch_dependent(task.seq.program, task.seq.input_kinds)
  return pieces_lib.build_piece(task.seq, i, i, dep)


def _seq_len(piece) -> int:
  for v in piece.act_ids + piece.aux_ids:
    shape = piece.program.avals[v].shape
    if len(shape) >= 2:
      return int(shape[1])
  return 1
