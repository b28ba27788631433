"""The zero-redundant profiler (HARP §5.1): cost tables from a layer sequence and a cluster.

Candidates are (layer range, subcluster, submesh, logical mesh). A stage's cost is composed
from its layers' costs, so what is profiled is one *layer* per (subcluster, submesh, logical
mesh), and layers with equal signatures (every repeat of a block) are costed once: the unique
tasks are the distinct layer signatures times the mesh configurations, a small multiple of
one block's layers instead of ``L (L + 1) / 2`` stages per submesh. Candidates that cannot fit
(the parameters alone exceed the device) are skipped before costing; stage ranges that do not
fit one microbatch, or whose share of the work is hopelessly out of proportion to the
submesh's share of compute, are marked infeasible in the tables.

Four cost sources sit behind one interface (:mod:`~harpjax.compiler.profile.sources`):
``"jaxpr"`` (the default: FLOPs, bytes, collectives and memory read off each layer's
forward+backward jaxpr + calibrated GPU rates; nothing is compiled), ``"analytic"`` (the same
time model on XLA's cost/memory analysis and collectives of each layer compiled from
``jax.ShapeDtypeStruct`` s; costs a 39B-parameter model on a laptop, in minutes),
``"measured"`` (run on the submesh's devices) and ``"imported"`` (published per-layer
measurements). Results are cached on disk by signature, GPU type, submesh, logical mesh,
microbatch size and library version (:mod:`~harpjax.compiler.profile.cache`); profiling shows
a progress bar and logs its phases.

:func:`profile_layers` reads as its three steps: :func:`enumerate_tasks` (pure),
:func:`cost_tasks` (cache, compilation, measurement) and :func:`tables_from_layer_costs`.

Typical use::

    result = profile_step(step_fn, (state, batch), cluster, num_microbatches=8)
    plan_input = result.tables          # CostTables for the planner
    print(result.stats.describe())
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from harpjax.cluster import Link
from harpjax.compiler.layers import (LayerOptions, LayerSequence, layers_for_step, relayer,
                                     sharding, unroll_scans)
from harpjax.compiler.profile import cache, calibration, pieces, sources
from harpjax.compiler.profile.collectives import (all_to_all_time_s, allgather_time_s,
                                                  allreduce_time_s, update_time_s)
from harpjax.compiler.profile.memory import (runs_replicas, stage_draw_workspace_bytes,
                                            stage_memory)
from harpjax.compiler.profile.routes import host_link, node_link, replica_link
from harpjax.compiler.profile.assemble import assemble_tables
from harpjax.compiler.profile.remat_choice import in_remat_mode, with_remat_choice
from harpjax.compiler.profile.routed_split import profile_routed_split
from harpjax.compiler.profile.tables import CostTables, range_max, range_sums
from harpjax.compiler.trace import (REMAT_MODES, Lit, TracedStep, aval_nbytes, remat_mode,
                                   trace_step)
from harpjax.errors import ClusterSpecError, HarpjaxError, PlanError

log = logging.getLogger(__name__)

__all__ = ["ProfileOptions", "ProfileStats", "ProfileResult", "MeshConfig", "ProfileTasks",
           "profile_layers", "profile_step", "enumerate_tasks", "cost_tasks", "layer_costs",
           "tables_from_layer_costs", "ordered_subclusters", "SOURCES", "COST_FIELDS",
           "microbatch_size", "dp_link", "tables_for_plan",
           "progress_bar", "inner_range_sums", "stage_flops", "stage_times"]

_SOURCE_CLASSES = {"jaxpr": sources.JaxprSource, "analytic": sources.AnalyticSource,
                   "measured": sources.MeasuredSource, "imported": sources.ImportedSource}
SOURCES = tuple(_SOURCE_CLASSES)


def _local_trace(source: str) -> bool:
  """Whether the source costs a task from its piece at the local microbatch."""
  return _SOURCE_CLASSES[source].local_trace


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
  """Options of the profiler.

  Attributes:
    source: ``"jaxpr"`` (default: costs read off each layer's forward+backward jaxpr with the
      calibrated GPU rates; nothing is compiled, a model is costed in about a second),
      ``"analytic"`` (the same time model on XLA's statistics of each layer compiled at the
      local microbatch: tens of seconds for a small model, what a user asks for to refine a
      plan), ``"measured"`` (timed on the cluster's local devices) or ``"imported"``.
    cache_dir: profile database directory; ``None``: ``$HARPJAX_CACHE_DIR`` or
      ``~/.cache/harpjax/profiles``.
    use_cache: read and write the database.
    progress: show progress bars while profiling; ``None``: when stderr is a terminal
      (compiling the stages has its own: ``harpjax.LocalRuntime(progress=...)``).
    state_bytes_per_param: weights + gradients + optimizer state per parameter (16: fp16
      weights and gradients, fp32 master weights and two Adam moments; or fp32 Adam).
    max_tp: largest tensor-parallel degree (default: the hosts' device count).
    imbalance: a multi-layer stage whose share of the model's FLOPs exceeds this many times
      its submesh's share of the cluster's peak FLOP/s is pruned (``inf`` disables).
    order: subcluster pipeline order: ``None`` (the cluster's), ``"memory_to_compute"``
      (§5.2.1) or a sequence of names.
    repeats: timed runs per measured task (median).
    efficiencies: GPU name -> :class:`~harpjax.compiler.profile.calibration.Efficiency`
      overriding the calibrated factors (analytic and imported sources).
    imported_model: Zorse model whose per-layer measurements stand for the repeated block
      (``"deepspeedgpt_2.7b"``), for ``source="imported"``; ``None`` (default): the published
      model of the block's shape (hidden size and parameters per layer), or a
      :class:`~harpjax.errors.PublishedDataError` when there is none.
    imported_module: module kind name of that block (default: the most repeated kind).
    imported_data_dir: directory of ``zorse_model_latencies.json`` and
      ``zorse_model_stats.json`` (default: ``../shared/data`` beside the repository).
    workers: threads compiling analytic tasks in parallel.
    remat: what the backward of the costed layers recomputes
      (:data:`~harpjax.compiler.trace.REMAT_MODES`): ``"none"``/``False`` (the default, as
      ``harpjax plan``; docs/planner.md, "One set of defaults"), ``"full"``/``True`` (only
      layer inputs kept per in-flight microbatch, the forward recomputed: activation
      recomputation as HARP/Alpa run large GPTs; GPT-39B on 32 GB devices needs it) or
      ``"dots"`` (the matmuls' outputs kept too). The runtime then rematerialises the same
      way (the plan says so). ``"choose"``: every layer is costed in every mode and the tables
      let the planner choose per stage (:func:`~harpjax.compiler.profile.with_remat_choice`;
      the plan's stages say which); a tuple of two or more modes chooses among those.
    optimizer_bytes_per_param: the optimizer state's part of ``state_bytes_per_param`` (12 of
      16 for mixed-precision Adam, 8 of 16 for float32 Adam); given, the tables carry it
      (``CostTables.opt_mem_bytes``) and the weights' all-gather time over each entry's
      ``dp`` replicas, so the planner chooses a ZeRO level per stage
      (:mod:`harpjax.compiler.plan.variants`); a layer too large for one device at level 0
      is then still costed when its ``dp`` share fits. Default 12, with the default
      ``state_bytes_per_param``; ``None``: every stage at level 0.
  """
  source: str = "jaxpr"
  cache_dir: str | None = None
  use_cache: bool = True
  progress: bool | None = None
  state_bytes_per_param: float = 16.0
  max_tp: int | None = None
  imbalance: float = 4.0
  order: Any = None
  repeats: int = 5
  efficiencies: Any = None
  imported_model: str | None = None
  imported_module: str | None = None
  imported_data_dir: str | None = None
  workers: int = 1
  remat: bool | str = False
  optimizer_bytes_per_param: float | None = 12.0

  @property
  def remat_modes(self) -> tuple[str, ...]:
    """The rematerialisation modes the layers are costed in (one, or those the planner
    chooses among)."""
    if self.remat == "choose":
      return REMAT_MODES
    if isinstance(self.remat, (tuple, list)):
      return tuple(remat_mode(m) for m in self.remat if isinstance(m, str))
    return (remat_mode(self.remat),)

  def __post_init__(self):
    from harpjax.errors import (InvalidOptionError, check_choice, check_count, check_flag,
                                check_number)
    try:
      modes = self.remat_modes
    except HarpjaxError:
      modes = ()
    if not modes or len(set(modes)) != len(modes) or (
        isinstance(self.remat, tuple) and len(modes) < 2):
      raise InvalidOptionError(
          f"ProfileOptions.remat={self.remat!r}; choose one of {REMAT_MODES} (True is 'full', "
          "False 'none'), 'choose' (the planner picks one per stage) or a tuple of two or more "
          "distinct modes to choose among")
    check_choice("ProfileOptions.source", self.source, SOURCES)
    for name in ("cache_dir", "imported_data_dir"):
      v = getattr(self, name)
      if v is not None and not (isinstance(v, str) or hasattr(v, "__fspath__")):
        raise InvalidOptionError(f"ProfileOptions.{name}={v!r} must be a directory (a str "
                                 "or path) or None")
    for name in ("imported_model", "imported_module"):
      v = getattr(self, name)
      if v is not None and not isinstance(v, str):
        raise InvalidOptionError(f"ProfileOptions.{name}={v!r} must be a name (a str) or None")
    check_flag("ProfileOptions.use_cache", self.use_cache)
    if self.progress is not None:
      check_flag("ProfileOptions.progress", self.progress)
    check_number("ProfileOptions.state_bytes_per_param", self.state_bytes_per_param, 0,
                 low_open=True)
    check_number("ProfileOptions.optimizer_bytes_per_param", self.optimizer_bytes_per_param,
                 0, self.state_bytes_per_param, high_open=True, allow_none=True)
    check_count("ProfileOptions.max_tp", self.max_tp, 1, allow_none=True)
    check_number("ProfileOptions.imbalance", self.imbalance, 0, low_open=True, finite=False)
    order = self.order
    if order is not None and order != "memory_to_compute" and (
        isinstance(order, (str, bytes)) or not isinstance(order, (tuple, list))
        or not all(isinstance(n, str) for n in order)):
      raise InvalidOptionError(f"ProfileOptions.order={order!r}: None (the cluster's order), "
                               "'memory_to_compute' or a sequence of subcluster names")
    if self.efficiencies is not None and not hasattr(self.efficiencies, "items"):
      raise InvalidOptionError(f"ProfileOptions.efficiencies={self.efficiencies!r} must be a "
                               "dict of GPU name -> Efficiency, or None")
    check_count("ProfileOptions.repeats", self.repeats, 1)
    check_count("ProfileOptions.workers", self.workers, 1)


@dataclasses.dataclass(frozen=True)
class ProfileStats:
  """What the profiler did.

  Attributes:
    num_layers: ``L``.
    distinct_layers: distinct layer signatures.
    layers_per_repeat: layers of one instance of the most repeated module (0 if none).
    configs: (subcluster, submesh, logical mesh) configurations enumerated.
    candidates: (layer, configuration) pairs enumerated.
    unique_tasks: distinct pieces costed (signature x GPU type x submesh x logical mesh x
      microbatch size): the profiling tasks.
    unique_compiles: distinct compilations behind them (signature at the local batch x
      ``tp``) for the analytic source; 0 for the jaxpr source (nothing is compiled).
    computed: tasks costed in this call (the rest came from the cache).
    cache_hits: database hits.
    pruned_tasks: candidates skipped before costing (parameters alone exceed the device).
    pruned_oom: table entries infeasible by memory.
    pruned_imbalance: table entries pruned as hopelessly imbalanced.
    naive_stage_submesh: ``L (L + 1) / 2`` stages x submeshes (what per-stage profiling
      enumerates).
    naive_stage_mesh: the same x logical meshes.
    seconds: wall time, tracing included.
    dp_approximated: some data-parallel costs were scaled from the full microbatch (no trace
      at the local batch was given).
    trace_s: of ``seconds``, tracing the step and cutting it into layers (at the full
      microbatch and, for sources that cost one replica, at the local ones).
  """
  num_layers: int
  distinct_layers: int
  layers_per_repeat: int
  configs: int
  candidates: int
  unique_tasks: int
  unique_compiles: int
  computed: int
  cache_hits: int
  pruned_tasks: int
  pruned_oom: int
  pruned_imbalance: int
  naive_stage_submesh: int
  naive_stage_mesh: int
  seconds: float
  dp_approximated: bool = False
  trace_s: float = 0.0

  @property
  def cost_s(self) -> float:
    """Seconds spent costing (``seconds`` without the tracing)."""
    return max(self.seconds - self.trace_s, 0.0)

  @property
  def reduction(self) -> float:
    """Naive stage x submesh enumeration over unique tasks."""
    return self.naive_stage_submesh / max(self.unique_tasks, 1)

  def describe(self) -> str:
    return (f"{self.num_layers} layers ({self.distinct_layers} distinct, "
            f"{self.layers_per_repeat} per repeat); {self.configs} mesh configurations; "
            f"{self.unique_tasks} unique tasks ({self.unique_compiles} compilations, "
            f"{self.computed} computed, {self.cache_hits} cached) vs "
            f"{self.naive_stage_submesh} stage x submesh candidates "
            f"({self.reduction:.0f}x fewer); pruned {self.pruned_tasks} tasks, "
            f"{self.pruned_oom} OOM and {self.pruned_imbalance} imbalanced entries; "
            f"tracing {self.trace_s:.1f} s, costing {self.cost_s:.1f} s")


@dataclasses.dataclass(frozen=True, eq=False)
class ProfileResult:
  """Tables, the layers they index, and per-layer costs.

  Attributes:
    tables: the planner's input.
    layers: the layer sequence (full microbatch).
    stats: :class:`ProfileStats`.
    costs: ``{(subcluster, submesh, (dp, tp)): {"time_s", "comm_s", "param_mem_bytes",
      "act_mem_bytes", "temp_bytes", "flops": [L] arrays}}`` (``inf`` time: pruned).
    cluster: the cluster profiled; options: the :class:`ProfileOptions` (what
      :func:`tables_for_plan` rebuilds the tables with).
    remat_costs: when the planner chooses the rematerialisation per stage
      (``ProfileOptions(remat="choose")``), each mode's per-layer costs, by mode name
      (``costs``: the first mode's, ``"none"`` where costed).
    replica_programs: ``{dp: whether the step traced at the microbatch's rows / dp is the
      same program}`` (:func:`replica_programs`): where it is not, the runtime runs a
      data-parallel stage as one program that all-reduces its gradients every microbatch
      instead of replicas that accumulate their own (``None``: not known, taken as the same).
  """
  tables: CostTables
  layers: LayerSequence
  stats: ProfileStats
  costs: dict
  cluster: Any = None
  options: Any = None
  remat_costs: dict[str, dict] | None = None
  replica_programs: dict[int, bool] | None = None


def microbatch_size(layers: LayerSequence) -> int | None:
  """Leading size of the batch-split inputs (``None`` without any)."""
  if layers.input_kinds is None:
    return None
  for v, k in zip(layers.program.invars, layers.input_kinds):
    shape = layers.program.avals[v].shape
    if k == "split" and shape:
      return int(shape[0])
  return None


def ordered_subclusters(cluster, order) -> list:
  """The cluster's subclusters in pipeline order: ``order`` is ``None`` (the cluster's),
  ``"memory_to_compute"`` (§5.2.1) or a sequence of names."""
  subs = list(cluster.subclusters)
  if order is None:
    return subs
  if order == "memory_to_compute":
    return list(cluster.ordered_by_memory_to_compute().subclusters)
  names = [str(x) for x in order]
  if sorted(names) != sorted(s.name for s in subs):
    raise HarpjaxError(f"order={names} must list each subcluster "
                       f"{[s.name for s in subs]} once")
  return [cluster.subcluster(n) for n in names]


def _make_source(opts: ProfileOptions, db, num_microbatches: int | None = None):
  remat = opts.remat_modes[0]
  if opts.source == "jaxpr":
    return sources.JaxprSource(opts.efficiencies, opts.state_bytes_per_param, remat=remat,
                               num_microbatches=num_microbatches)
  analytic = sources.AnalyticSource(db, opts.efficiencies, opts.state_bytes_per_param,
                                    remat=remat, num_microbatches=num_microbatches)
  if opts.source == "analytic":
    return analytic
  if opts.source == "measured":
    return sources.MeasuredSource(db, opts.repeats,
                                  state_bytes_per_param=opts.state_bytes_per_param,
                                  remat=remat)
  return sources.ImportedSource(analytic, opts.imported_model,
                                calibration.load_zorse(opts.imported_data_dir),
                                opts.imported_module,
                                calibration.load_zorse_stats(opts.imported_data_dir))


def progress_bar(total: int, enabled: bool | None, desc: str, unit: str = "task"):
  """A progress bar (``enabled=None``: when stderr is a terminal), as a context manager."""
  from tqdm.auto import tqdm
  if enabled is None:
    enabled = sys.stderr.isatty()
  return tqdm(total=total, disable=not enabled, desc=desc, unit=unit, leave=False)


# --------------------------------------------------------------------------- enumeration


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """One (subcluster, submesh, logical mesh) configuration a layer is costed on.

  Attributes:
    subcluster: index ``k`` in pipeline order.
    submesh_index: ``s``; submesh: its shape ``(n, m)``.
    mesh: the logical mesh ``(dp, tp)``.
  """
  subcluster: int
  submesh_index: int
  submesh: tuple[int, int]
  mesh: tuple[int, int]


@dataclasses.dataclass(frozen=True, eq=False)
class ProfileTasks:
  """What :func:`enumerate_tasks` found to cost (no cost computed yet).

  Attributes:
    configs: every :class:`MeshConfig`.
    tasks: unique task id -> :class:`~harpjax.compiler.profile.sources.LayerTask`.
    keys: task id -> its cache key.
    assign: per configuration, per layer, the task id costing it (``None``: pruned, the
      parameters alone do not fit the device).
    pruned: number of pruned (configuration, layer) pairs.
    expert_parallel: ``(configuration, layer) -> (seconds, state bytes, gradient bytes)``
      for the routed layers of ``(dp, tp, ep)`` configurations, whose task is the
      ``(dp * ep, tp)`` one's: the all-to-all seconds it adds per microbatch, and the expert
      weights' state and gradient bytes per device it saves (:func:`expert_parallel_costs`).
  """
  configs: tuple[MeshConfig, ...]
  tasks: dict
  keys: dict
  assign: tuple[tuple[str | None, ...], ...]
  pruned: int
  expert_parallel: dict = dataclasses.field(default_factory=dict)


def expert_parallel_costs(piece, mesh, link: Link, state_bytes_per_param: float
                          ) -> tuple[float, float, float]:
  """What a ``(dp, tp, ep)`` mesh changes in a layer's costs against ``(dp * ep, tp)``.

  Args:
    piece: the layer's piece at the full microbatch.
    mesh: the logical mesh (``ep > 1``).
    link: the link the ``ep`` devices share.
    state_bytes_per_param: weights + gradients + optimizer state per parameter.

  Returns:
    ``(all-to-all seconds, state bytes saved, gradient bytes saved)`` per device and
    microbatch: the forward's dispatch and combine all-to-alls (the tokens' bytes read off the
    program, :func:`~harpjax.compiler.layers.sharding.expert_exchange_bytes`,
    ``1 / (dp * ep)`` per device) and the backward's, twice as many bytes (the cotangents of
    both, and the experts' outputs and tokens again for the combine weights' and the
    dispatched tokens' gradients, as XLA partitions them: the compiled stage's HLO moves
    ``3x`` the forward's bytes in all, ``tests/models/test_expert_parallel.py``); the expert
    weights split ``ep`` ways instead of held whole.
  """
  lm = sharding.LogicalMesh.of(mesh)
  prog, ops, ids = piece.program, piece.ops, piece.param_ids
  per_device = sharding.expert_exchange_bytes(prog, ops, ids) / lm.batch_ways
  seconds = 3.0 * all_to_all_time_s(per_device, lm.ep, link)

  def held(specs):
    elements = nbytes = 0.0
    for v, spec in specs.items():
      shape, ways = prog.avals[v].shape, 1
      for e in spec:
        for ax in (e if isinstance(e, tuple) else (e,)):
          ways *= {sharding.TP: lm.tp, sharding.EP: lm.ep}.get(ax, 1)
      n = float(np.prod(shape)) / ways
      elements, nbytes = elements + n, nbytes + n * prog.avals[v].dtype.itemsize
    return elements, nbytes
  e0, b0 = held(sharding.param_specs(prog, ops, ids, lm.tp))
  e1, b1 = held(sharding.param_specs(prog, ops, ids, lm))
  return seconds, (e0 - e1) * state_bytes_per_param, b0 - b1


class _Pieces:
  """The piece of each distinct layer of a layer sequence, built once."""

  def __init__(self):
    self._deps: dict = {}
    self._pieces: dict = {}

  def __call__(self, seq: LayerSequence, i: int):
    key = (seq, seq[i].signature)
    if key not in self._pieces:
      if seq not in self._deps:
        self._deps[seq] = pieces.batch_dependent(seq.program, seq.input_kinds)
      self._pieces[key] = pieces.build_piece(seq, i, i, self._deps[seq])
    return self._pieces[key]


def enumerate_tasks(layers: LayerSequence, cluster, subs, opts: ProfileOptions, source_name: str,
                    extra: dict, local_layers) -> ProfileTasks:
  """The unique profiling tasks: every layer on every configuration, deduplicated by key.

  Pure bookkeeping: nothing is traced, compiled or read from disk (a task's local-batch piece
  is resolved only when it is costed).

  Args:
    layers: the layers at the full microbatch.
    cluster: the cluster (links, devices).
    subs: its subclusters in pipeline order.
    opts: the options.
    source_name, extra: the cost source's name and extra key (part of each cache key).
    local_layers: ``dp -> layers at microbatch / dp`` or ``None``, and whether a local trace
      exists for ``dp`` (see :func:`profile_layers`).
  """
  L = len(layers)
  b = microbatch_size(layers) or 1
  local_seq, has_local = local_layers
  measured = opts.source == "measured"
  local_trace = _local_trace(opts.source)
  piece = _Pieces()
  devices_of = _measured_devices(cluster) if measured else None
  # Routed blocks (Module.routed) add the expert-parallel meshes their expert counts allow.
  experts = sharding.expert_counts(layers.program, layers.program.ops,
                                   _param_ids(layers)) if layers.routed_modules() else ()
  configs = tuple(MeshConfig(k, s, tuple(nm), mesh)
                  for k, sub in enumerate(subs)
                  for s, nm in enumerate(sub.submesh_shapes())
                  for mesh in sharding.submesh_logical_meshes(nm, microbatch_size=b,
                                                              max_tp=opts.max_tp,
                                                              experts=experts))
  tasks: dict[str, sources.LayerTask] = {}
  keys: dict[str, dict] = {}
  assign = []
  pruned = 0
  expert_parallel, ep_memo = {}, {}
  routed = {l.index for l in layers if layers.modules[l.module_index].routed}
  for c, cfg in enumerate(configs):
    sub = subs[cfg.subcluster]
    lm = sharding.LogicalMesh.of(cfg.mesh)
    # An expert-parallel mesh costs as its data-parallel twin (dp * ep, tp), plus the
    # routed layers' all-to-all and minus their expert weights' share (expert_parallel).
    dp, tp = lm.batch_ways, lm.tp
    host, node = host_link(sub), node_link(cluster, sub)
    ep_link = host if lm.ep * lm.tp <= cfg.submesh[1] else node
    scaled = local_trace and not has_local(dp)
    # what a device holds of a parameter's state: with ZeRO data, its share at level 3
    # (a layer the planner can place only at that level is still costed), else all of it
    per_param = _state_bytes_per_param(opts, dp)
    row = []
    for i in range(L):
      full = piece(layers, i)
      if lm.ep > 1 and i in routed:
        memo = (layers[i].signature, cfg.mesh, ep_link)
        if memo not in ep_memo:
          ep_memo[memo] = expert_parallel_costs(full, lm, ep_link, opts.state_bytes_per_param)
        expert_parallel[(c, i)] = ep_memo[memo]
      saved = expert_parallel.get((c, i), (0.0, 0.0, 0.0))[1]
      if full.num_params / tp * per_param - saved > sub.memory_bytes:
        row.append(None)
        pruned += 1
        continue

      def resolve(dp=dp, i=i):
        seq = local_seq(dp) if local_trace else None
        seq = layers if seq is None else seq
        return seq, piece(seq, i)
      task = sources.LayerTask(
          layer=i, signature=layers[i].signature, local=resolve, full_piece=full,
          gpu=sub.gpu, submesh=cfg.submesh, mesh=(dp, tp), microbatch=b,
          local_batch=b if (measured or scaled) else b // dp, host_link=host, node_link=node,
          devices=devices_of(sub, cfg.submesh) if devices_of else None, dp_scaled=scaled)
      key = task.key(source_name, extra)
      kid = json.dumps(key, sort_keys=True, default=str)
      if kid not in tasks:
        tasks[kid], keys[kid] = task, key
      row.append(kid)
    assign.append(tuple(row))
  return ProfileTasks(configs, tasks, keys, tuple(assign), pruned, expert_parallel)


def _state_bytes_per_param(opts: ProfileOptions, dp: int) -> float:
  """Bytes per parameter a device of ``dp`` replicas holds at the least: ZeRO-3's split of
  the state (:func:`~harpjax.compiler.profile.stage_memory`'s, weights and gradients sharing
  what is not optimizer state) where the options give the optimizer's share, else level 0's
  (the whole state)."""
  opt = opts.optimizer_bytes_per_param
  w = (opts.state_bytes_per_param - (opt or 0.0)) / 2.0
  return float(stage_memory(param_bytes=w, grad_bytes=w, opt_bytes=opt or 0.0, act_bytes=0.0,
                            dp=dp, zero=0 if opt is None else 3).state_bytes)


def _param_ids(layers: LayerSequence) -> tuple:
  """The parameter inputs of the layers' program."""
  kinds = layers.input_kinds or ()
  return tuple(v for v, kind in zip(layers.program.invars, kinds) if kind == "param")


def _measured_devices(cluster):
  """``(subcluster, (n, m)) -> its local JAX devices`` for the measured source."""
  try:
    local_devs = cluster.local_devices()
  except HarpjaxError as e:
    raise HarpjaxError(f"measured profiling runs on the cluster's devices: {e}") from None

  def devices_of(sub, nm):
    base = cluster.devices_of(sub.name).start
    n, m = nm
    return tuple(local_devs[base + h * sub.devices_per_host + d]
                 for h in range(n) for d in range(m))
  return devices_of


# --------------------------------------------------------------------------- costing


def cost_tasks(found: ProfileTasks, source, db, opts: ProfileOptions, layers: LayerSequence
               ) -> tuple[dict, list[str], bool]:
  """Costs the unique tasks: from the cache, else with the source (analytic compilations in
  ``opts.workers`` threads), writing what it computed to the cache. A task whose trace at the
  local batch failed is replaced in ``found`` by its full-microbatch approximation.

  Returns:
    ``(results, computed, dp_approximated)``: task id -> :class:`LayerCost`, the ids computed
    in this call, and whether some data-parallel cost was scaled from the full microbatch.
  """
  b = microbatch_size(layers) or 1
  results: dict[str, sources.LayerCost] = {}
  todo = []
  for kid, key in found.keys.items():
    hit = db.get(key)
    if hit is not None:
      try:
        results[kid] = sources.LayerCost.from_json(hit)
        continue
      except (KeyError, TypeError, ValueError):
        pass
    todo.append(kid)
  log.info("profiling: %d layers, %d configurations, %d unique tasks (%d cached)", len(layers),
           len(found.configs), len(found.tasks), len(found.tasks) - len(todo))
  dp_approx = False
  tasks, keys = found.tasks, found.keys
  for kid in todo:   # a local trace that failed falls back to scaling the full microbatch
    t = tasks[kid]
    if (not t.dp_scaled and t.mesh[0] > 1 and _local_trace(opts.source)
        and t.seq is layers):
      tasks[kid] = t = dataclasses.replace(t, dp_scaled=True, local_batch=b)
      keys[kid] = t.key(source.name, source.cache_extra())
    dp_approx |= t.dp_scaled
  analytic = getattr(source, "base", source)
  compile_keys = {}
  if isinstance(analytic, sources.AnalyticSource):
    for kid in todo:
      t = tasks[kid]
      compile_keys.setdefault((t.signature, t.mesh[1], t.local_batch, t.dp_scaled), t)
  with progress_bar(len(compile_keys) + len(todo), opts.progress, "profiling") as bar:
    if compile_keys:
      if opts.workers > 1:
        with concurrent.futures.ThreadPoolExecutor(opts.workers) as ex:
          for _ in ex.map(analytic.stats, compile_keys.values()):
            bar.update(1)
      else:
        for t in compile_keys.values():
          analytic.stats(t)
          bar.update(1)
    for kid in todo:
      cost = source.cost(tasks[kid])
      db.put(keys[kid], cost.to_json())
      results[kid] = cost
      bar.update(1)
  return results, todo, dp_approx


# --------------------------------------------------------------------------- tables


COST_FIELDS = ("time_s", "comm_s", "param_mem_bytes", "act_mem_bytes", "temp_bytes", "flops",
               "grad_bytes", "fwd_temp_bytes", "bwd_temp_bytes", "draw_bytes",
               "draw_max_bytes", "remat_held_bytes", "inner_remat_flops",
               "inner_remat_time_s")


def layer_costs(found: ProfileTasks, results: dict, num_layers: int) -> list[dict]:
  """Per configuration, ``{field: [L] array}`` of :data:`COST_FIELDS` (``inf`` time: pruned)."""
  out = []
  for c_ix, row in enumerate(found.assign):
    arr = {f: np.zeros(num_layers) for f in COST_FIELDS}
    for i, kid in enumerate(row):
      if kid is None:
        arr["time_s"][i] = np.inf
        continue
      c = results[kid]
      for f in COST_FIELDS:
        arr[f][i] = getattr(c, f)
      if (c_ix, i) in found.expert_parallel:   # the routed layer of a (dp, tp, ep) mesh
        a2a, state, grads = found.expert_parallel[(c_ix, i)]
        arr["time_s"][i] += a2a
        arr["comm_s"][i] += a2a
        arr["param_mem_bytes"][i] -= state
        arr["grad_bytes"][i] -= grads
    out.append(arr)
  return out


def dp_link(cluster, sub, submesh: Sequence[int]) -> Link:
  """The link between a submesh's data-parallel replicas on subcluster ``sub`` of
  ``cluster``: :func:`~harpjax.compiler.profile.replica_link` of its host and node links."""
  return replica_link(submesh, host_link(sub), node_link(cluster, sub))


def _range_union_bytes(items: dict, L: int) -> np.ndarray:
  """``[L, L]`` bytes of the items a layer range reads, each once: ``items`` maps ``(after,
  readers)`` (the item exists from layer ``after + 1`` on; the increasing layers reading it)
  to bytes; range ``i..j`` reads it iff ``i > after`` and a reader lies in ``i..j``."""
  out = np.zeros((L, L))
  single = np.zeros(L)
  for (after, readers), b in items.items():
    if len(readers) == 1 and after < readers[0]:
      if after == -1:
        single[readers[0]] += b
      else:
        out[after + 1:readers[0] + 1, readers[0]:] += b
      continue
    k = 0
    for i in range(after + 1, readers[-1] + 1):
      while readers[k] < i:
        k += 1
      out[i, readers[k]:] += b
  return out + np.where(np.arange(L)[None, :] >= np.arange(L)[:, None], range_sums(single), 0.0)


def param_holding(layers: LayerSequence) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """What a stage on layers ``i..j`` holds of the parameters, against what its layers' costs
  charge, as ``[L, L]`` arrays of bytes (one device, no tensor-parallel split):

  * ``held``: every parameter some layer of the range reads, whole and once (a stacked
    ``nn.scan`` parameter each of whose layers reads a slice, an embedding a later head reads
    again): the stage's executables take it, and its gradient accumulator, whole;
  * ``owned``: of those, the parameters whose first reader is in the range: the runtime's
    owner (the first stage reading a parameter) alone holds its optimizer state and updates
    it (:func:`harpjax.compiler.stages.compile_step`);
  * ``charged``: the sum of the layers' own parameter bytes (:attr:`Layer.param_bytes`: a
    slice of a stacked parameter counts the slice), what the per-layer costs charge.

  Exact for the planner's ranges: a range holds a parameter iff one of its layers reads it,
  owns it iff its first reader is in the range."""
  L = len(layers)
  prog = layers.program
  kinds = layers.input_kinds or ()
  param_vids = {prog.invars[k] for k, kind in enumerate(kinds) if kind == "param"
                and not isinstance(prog.invars[k], Lit)}
  readers: dict[int, list[int]] = {}
  for l, layer in enumerate(layers):
    for op in prog.ops[layer.start:layer.end]:
      for v in op.in_ids():
        if v in param_vids and (v not in readers or readers[v][-1] != l):
          readers.setdefault(v, []).append(l)
  held_items: dict = {}
  first = np.zeros(L)
  for v, rs in readers.items():
    b = float(aval_nbytes(prog.avals[v]))
    key = (-1, tuple(rs))
    held_items[key] = held_items.get(key, 0.0) + b
    first[rs[0]] += b
  upper = np.arange(L)[None, :] >= np.arange(L)[:, None]
  held = _range_union_bytes(held_items, L)
  owned = np.where(upper, range_sums(first), 0.0)
  charged = np.where(upper, range_sums([l.param_bytes for l in layers]), 0.0)
  return held, owned, charged


def stage_input_bytes(layers: LayerSequence) -> np.ndarray:
  """``[L, L]`` bytes a stage on layers ``i..j`` takes in besides its parameters, each value
  once: the activations of earlier layers and the step's non-parameter inputs its layers read
  (values of ops computing constants alone are recomputed in the stage, not taken). Under
  full rematerialisation this is all a stage keeps of a microbatch for its backward (the
  runtime checkpoints the stage's forward as a whole); the per-layer costs charge each layer's
  inputs, so a value two layers of a stage read from outside, or one layer passes the next,
  is charged twice or needlessly."""
  L = len(layers)
  prog = layers.program
  kinds = layers.input_kinds or ()
  params = {prog.invars[k] for k, kind in enumerate(kinds) if kind == "param"}
  invars = set(prog.invars)
  layer_of, static = {}, set()
  for l, layer in enumerate(layers):
    for op in prog.ops[layer.start:layer.end]:
      outs = [o for o in op.outvars if o >= 0]
      for o in outs:
        layer_of[o] = l
      if op.params.get("jaxpr") is None and all(
          isinstance(v, Lit) or v in static for v in op.invars) and "random" not in op.name:
        static.update(outs)
  readers: dict[int, list[int]] = {}
  for l, layer in enumerate(layers):
    for op in prog.ops[layer.start:layer.end]:
      for v in op.in_ids():
        if v in params or v in static or (v not in invars and layer_of.get(v, l) >= l):
          continue
        if v not in readers or readers[v][-1] != l:
          readers.setdefault(v, []).append(l)
  items: dict = {}
  for v, rs in readers.items():
    key = (layer_of.get(v, -1), tuple(rs))
    items[key] = items.get(key, 0.0) + float(aval_nbytes(prog.avals[v]))
  return _range_union_bytes(items, L)

def stage_workspaces(arr: Mapping, remat: str = "none") -> tuple[np.ndarray, np.ndarray]:
  """``[L, L]`` workspaces of a stage's forward and backward executables on layers ``i..j``
  from its layers' costs ``arr`` (``{field: [L] array}`` of :data:`COST_FIELDS`; missing
  fields are taken as ``temp_bytes`` or ``0``):

  * each executable needs at least its largest layer's (``fwd_temp_bytes``,
    ``bwd_temp_bytes``);
  * where the stage rematerialises (``remat`` not ``"none"``), its random draws run
    together, ahead of what reads them, in its forward and again in its backward: their
    workspace is :func:`~harpjax.compiler.profile.memory.stage_draw_workspace_bytes`.
    (Without rematerialisation XLA:CPU overlapped them in the forward of every
    data-parallel stage run as replicas, and of a data-parallel stage on four devices run
    as one program, and not on one device nor in one such program on two devices; the
    model keeps the layers' largest there: docs/fidelity.md, "Peak memory".)
  * a backward that recomputes the stage's forward as a whole holds each layer's recomputed
    values (``remat_held_bytes``) from the recompute to that layer's backward: while layer
    ``l``'s backward runs (its own recompute included, ``bwd_temp_bytes[l]``), those of
    layers ``i..l-1`` are alive. ``max over l of (sum(held[i..l-1]) + bwd[l])``: exact for
    every range (a range maximum of prefix sums, no approximation across ranges).
  * that backward runs the draws' hashes where the recompute first reads a draw, in the
    stage's first layer ``f`` that draws: the recomputed values held by then stay alive
    beside the draws' workspace, those of the layers ``i..f-1`` and what ``f`` itself keeps
    for its backward besides its draws' state (``held[f] - 2 * draw_bytes[f]``). The GPT's
    second stage under remat (an attention layer, then a layer norm with dropout): the
    draws' 1280 KiB and the attention's 259.5 KiB of normalised input, heads and scores,
    XLA's backward temporaries 1539.4 KiB.
  """
  temp = np.asarray(arr["temp_bytes"], np.float64)
  fwd = np.asarray(arr.get("fwd_temp_bytes", temp), np.float64)
  bwd = np.asarray(arr.get("bwd_temp_bytes", temp), np.float64)
  if remat_mode(remat) == "none":
    return range_max(fwd), range_max(bwd)
  L = fwd.size
  zero = np.zeros(L)
  upper = np.arange(L)[None, :] >= np.arange(L)[:, None]
  draws = np.where(upper, stage_draw_workspace_bytes(
      range_sums(arr.get("draw_bytes", zero)), range_max(arr.get("draw_max_bytes", zero))), 0.0)
  work_f = np.maximum(range_max(fwd), draws)
  held = np.asarray(arr.get("remat_held_bytes", zero), np.float64)
  before = np.concatenate([[0.0], np.cumsum(held)[:-1]])   # sum(held[0..l-1])
  work_b = np.where(upper, range_max(before + bwd) - before[:, None], 0.0)
  # the recomputed values alive where the draws run: up to the first drawing layer f(i)
  drawn = np.asarray(arr.get("draw_bytes", zero), np.float64)
  first = np.full(L, L)
  for l in range(L - 1, -1, -1):
    first[l] = l if drawn[l] > 0 else (first[l + 1] if l + 1 < L else L)
  f = np.minimum(first, L - 1)
  alive = np.where(first < L, before[f] - before + np.maximum(held[f] - 2.0 * drawn[f], 0.0),
                   0.0)
  return work_f, np.maximum(work_b, np.where(draws > 0, draws + alive[:, None], 0.0))


def inner_range_sums(x) -> np.ndarray:
  """``[L, L]`` sums of ``x[i..j-1]``: a stage's layers but its last (0 on the diagonal,
  ``inf`` below it), added left to right as :func:`~harpjax.compiler.profile.tables.range_sums`
  adds them."""
  x = np.asarray(x, dtype=np.float64)
  L = x.size
  out = np.full((L, L), np.inf)
  for i in range(L):
    out[i, i] = 0.0
    out[i, i + 1:] = np.cumsum(x[i:L - 1])
  return out


def _stage_sums(arr: Mapping, field: str, inner: str, remat: str) -> np.ndarray:
  """``[L, L]`` range sums of ``arr[field]``, plus, where the stage rematerialises, the inner
  sums of ``arr[inner]`` (see :func:`stage_times`)."""
  total = range_sums(arr[field])
  if remat_mode(remat) == "none" or inner not in arr:
    return total
  return total + inner_range_sums(arr[inner])


def stage_times(arr: Mapping, remat: str = "none") -> np.ndarray:
  """``[L, L]`` forward+backward seconds of a stage on layers ``i..j`` per microbatch, from
  its layers' costs ``arr`` (``{field: [L] array}`` of :data:`COST_FIELDS`): the sum of their
  times and, where the stage rematerialises (``remat`` not ``"none"``), of
  ``inner_remat_time_s`` over ``i..j-1``. The stage's backward recomputes its forward from the
  stage's own inputs, so each layer but the last also recomputes what makes its outputs (the
  next layer's recomputation reads them), which its own rematerialised backward, costed alone,
  does not (:func:`~harpjax.compiler.profile.estimate.outputs_recompute_ops`). Exact for every
  range: a term of the stage, not of the layer, which cannot know whether it ends its stage."""
  return _stage_sums(arr, "time_s", "inner_remat_time_s", remat)


def stage_flops(arr: Mapping, remat: str = "none") -> np.ndarray:
  """``[L, L]`` FLOPs per device of a stage's forward and backward executables on layers
  ``i..j`` per microbatch, as :func:`stage_times` sums the seconds (what XLA's
  ``cost_analysis`` of the two executables counts)."""
  return _stage_sums(arr, "flops", "inner_remat_flops", remat)


def tables_from_layer_costs(layers: LayerSequence, cluster, subs, configs, costs,
                            imbalance: float, zero: tuple[float, float] | None = None,
                            num_microbatches: int | None = None, remat: str = "none",
                            replica_programs: Mapping[int, bool] | None = None
                            ) -> tuple[CostTables, dict]:
  """The cost tables of per-configuration layer costs: a stage costs the sum of its layers'
  times and residuals, and the sum of their parameter state plus the largest XLA workspace
  among them (:func:`~harpjax.compiler.profile.assemble.assemble_tables` picks the logical
  mesh, the end time spread over ``num_microbatches``). Once per iteration, after its last
  backward (:attr:`~harpjax.compiler.profile.CostTables.end_time_s`), a stage all-reduces its
  gradients among its ``dp`` replicas (one ring all-reduce of the stage's gradient bytes on
  the link between them, :attr:`~harpjax.compiler.profile.CostTables.sync_time_s`) and
  updates its state (read and written once at the device's memory bandwidth). With
  ``zero = (state_bytes_per_param, optimizer_bytes_per_param)`` the tables also
  carry the optimizer state's bytes and the weights' all-gather seconds of every entry (the
  planner's ZeRO variants): the parameters are the state bytes over ``state_bytes_per_param``,
  the weights half of what is not optimizer state.

  Where several layers of a stage read one parameter (an ``nn.scan`` stack, a tied
  embedding) the stage holds it, and its gradient, once and whole, and its optimizer state
  only if it is the parameter's first reader (:func:`param_holding`). Under ``remat="full"``
  a stage keeps of each microbatch only what it takes in (:func:`stage_input_bytes`); under
  any rematerialisation its time is :func:`stage_times`' (each layer but its last also
  recomputes what makes its outputs).

  A data-parallel stage's replicas accumulate their own gradients where the runtime can run
  them so (:func:`~harpjax.compiler.profile.memory.runs_replicas`, and ``replica_programs``:
  the step traced at the replicas' rows is the same program); elsewhere its backward writes
  the whole gradient and its all-reduce every microbatch, which the tables'
  ``grad_out_bytes`` then carry (twice the gradient) for the ZeRO variants."""
  by_submesh: dict[tuple[int, int], list] = {}
  for cfg, arr in zip(configs, costs):
    by_submesh.setdefault((cfg.subcluster, cfg.submesh_index), []).append((cfg.mesh, arr))

  L = len(layers)
  # what a stage ending at layer j sends on per microbatch (nothing after the last layer)
  out = np.array([l.boundary_bytes for l in layers], np.float64)
  out[-1] = 0.0
  out = np.broadcast_to(out[None, :], (L, L))
  # parameters read by several layers (scan stacks, tied weights): held whole by each stage
  # reading them, their optimizer state by the first (ratios to what the layers charge)
  held, owned, charged = param_holding(layers)
  with np.errstate(invalid="ignore", divide="ignore"):
    held_ratio = np.where(charged > 0, held / np.where(charged > 0, charged, 1.0), 1.0)
    owned_ratio = np.where(charged > 0, owned / np.where(charged > 0, charged, 1.0), 1.0)
  inputs = stage_input_bytes(layers) if remat_mode(remat) == "full" else None
  rows = microbatch_size(layers)

  def mesh_costs(k: int, s: int):
    sub = subs[k]
    link = dp_link(cluster, sub, sub.submesh_shapes()[s])
    for mesh, arr in by_submesh.get((k, s), []):
      dp = sharding.LogicalMesh.of(mesh).batch_ways   # the replicas of the non-expert part
      state = range_sums(arr["param_mem_bytes"])
      grads = range_sums(arr["grad_bytes"])
      sync = allreduce_time_s(grads, dp, link)
      update = update_time_s(state, sub.gpu.mem_bandwidth_bytes_per_s)
      with np.errstate(invalid="ignore", divide="ignore"):
        entry = _entry_costs(mesh, arr, state, grads, sync, update, zero, dp, link, out)
      yield entry

  def _entry_costs(mesh, arr, state, grads, sync, update, zero, dp, link, out):
    if zero is not None:
      per, opt_per = zero
      opt = state / per * opt_per
      weights = (state - opt) / 2.0
    else:
      weights = np.minimum(grads, state / 2.0)
      opt = state - 2.0 * weights
    opt = opt * owned_ratio
    # the largest layer's gradient, in the state's bytes per parameter: a layer reading a
    # slice of a stacked parameter writes the slice's gradient, which XLA adds into the
    # (donated) accumulator of the whole stack in place
    gout = range_max(arr["grad_bytes"]) * np.where(grads > 0, weights / np.where(
        grads > 0, grads, 1.0), 1.0)
    shared = weights * np.maximum(held_ratio - owned_ratio, 0.0)
    weights = weights * held_ratio
    zero_cols = (opt, allgather_time_s(weights, dp, link)) if zero is not None else (None, None)
    # the forward's and the backward's workspaces apart (two executables), at stage level
    work_f, work_b = stage_workspaces(arr, remat)
    act = range_sums(arr["act_mem_bytes"]) if inputs is None else np.where(
        np.isfinite(range_sums(arr["time_s"])), inputs / dp, np.inf)
    # the replicas accumulate their own gradients where the runtime runs them so; elsewhere
    # the backward writes the whole gradient and all-reduces it every microbatch
    lm = sharding.LogicalMesh.of(mesh)
    rep = runs_replicas(dp, rows, lm.ep) and (replica_programs or {}).get(dp, True)
    mem = stage_memory(param_bytes=weights, grad_bytes=weights, opt_bytes=opt,
                       act_bytes=act, dp=dp, zero=0,
                       out_bytes=out / dp, workspace_bytes=work_f, replicas=rep,
                       grad_out_bytes=gout, shared_param_bytes=shared,
                       bwd_workspace_bytes=work_b)
    # The tables carry one workspace beside the larger of the outputs and what the backward
    # writes besides its temporaries (what the ZeRO variants rebuild the model from): the
    # one giving the same level-0 pipeline.
    written = gout if dp <= 1 or rep else 2.0 * weights
    work = np.maximum(out / dp + work_f, written + work_b) - np.maximum(out / dp, written)
    return (mesh, stage_times(arr, remat), mem.fixed_bytes(),
            act, sync + update, *zero_cols, sync, work,
            mem.step_bytes(), written)

  intra = [cluster.intra_subcluster_link(sub.name) for sub in subs]
  inter = [cluster.inter_subcluster_link(a.name, c.name) for a, c in zip(subs, subs[1:])]
  pair = [[None if a is c else _link_or_none(cluster, a.name, c.name) for c in subs]
          for a in subs]
  prices = [getattr(sub, "price_per_gpu_hour", None) for sub in subs]
  prices = None if any(p is None for p in prices) else prices
  host = [getattr(sub, "host_memory_bytes_per_s", None) for sub in subs]
  host = None if any(h is None for h in host) else host
  return assemble_tables(
      names=[sub.name for sub in subs], num_hosts=[sub.num_hosts for sub in subs],
      devices_per_host=[sub.devices_per_host for sub in subs],
      memory_bytes=[float(sub.memory_bytes) for sub in subs],
      submeshes=[tuple(sub.submesh_shapes()) for sub in subs], mesh_costs=mesh_costs,
      num_microbatches=num_microbatches,
      boundary_bytes=[l.boundary_bytes for l in layers], intra_links=intra, inter_links=inter,
      peak_flops=[sub.gpu.peak_flops for sub in subs], layer_flops=[l.flops for l in layers],
      imbalance=imbalance, layer_names=[l.name for l in layers], pair_links=pair,
      price_per_gpu_hour=prices, offload_bandwidth_bytes_per_s=host,
      host_links=[host_link(sub) for sub in subs])


def _link_or_none(cluster, a: str, b: str):
  """The link between two subclusters, ``None`` when they share no network."""
  try:
    return cluster.inter_subcluster_link(a, b)
  except ClusterSpecError:
    return None


def replica_programs(layers: LayerSequence, configs, db, check: Callable[[int], bool] | None
                     ) -> dict[int, bool] | None:
  """``{dp: whether the step traced at the microbatch's rows / dp is the same program}`` for
  the data-parallel degrees of ``configs`` whose replicas could accumulate their own gradients
  (:func:`~harpjax.compiler.profile.memory.runs_replicas`); ``None`` without ``check``.

  The runtime runs such a stage's replicas on the step traced at their rows and falls back to
  one program that all-reduces the gradients every microbatch where that trace is another
  program (the step's structure depends on the batch size: an index over one row traced as a
  reshape, say), which holds the whole gradient and its reduction in every backward. ``check``
  traces the step at those rows (:func:`profile_step` does it with the trace it costs the
  replica from); each answer is kept in the profile database (``db``)."""
  if check is None:
    return None
  rows = microbatch_size(layers)
  out: dict[int, bool] = {}
  digest = hashlib.sha256("|".join(map(str, layers.signatures)).encode()).hexdigest()[:32]
  for cfg in configs:
    lm = sharding.LogicalMesh.of(cfg.mesh)
    dp = lm.batch_ways
    if dp in out or not runs_replicas(dp, rows, lm.ep):
      continue
    key = {"kind": "replica_program", "layers": digest, "rows": rows, "dp": dp}
    hit = db.get(key) if db is not None else None
    if hit is not None and isinstance(hit.get("same"), bool):
      out[dp] = hit["same"]
      continue
    out[dp] = bool(check(dp))
    if db is not None:
      db.put(key, {"same": out[dp]})
  return out


# --------------------------------------------------------------------------- the profiler


def profile_layers(layers: LayerSequence, cluster, *, options: ProfileOptions | None = None,
                   local_layers: Mapping[int, LayerSequence] | None = None,
                   num_microbatches: int | None = None,
                   replica_check: Callable[[int], bool] | None = None) -> ProfileResult:
  """Profiles a layer sequence on a cluster and builds its :class:`CostTables`.

  Three steps: :func:`enumerate_tasks` (the unique tasks), :func:`cost_tasks` (cache, then the
  cost source) and :func:`tables_from_layer_costs`.

  Args:
    layers: the layers at the full microbatch (from :func:`~harpjax.compiler.layers.
      layers_for_step`; its ``input_kinds`` say which inputs are parameters and batch).
    cluster: a :class:`harpjax.Cluster`.
    options: :class:`ProfileOptions`.
    local_layers: ``{dp: layers}`` traced at microbatch ``/ dp`` (same cuts, e.g. from
      :func:`~harpjax.compiler.layers.relayer`), or a function ``dp -> layers | None``
      called only when a task misses the cache; the analytic source costs one data-parallel
      replica from them. Missing ones are approximated by scaling the full microbatch's
      batch-proportional costs by ``1 / dp`` (:func:`profile_step` traces them lazily).
    num_microbatches: the iteration's microbatches, if known: a stage's once-per-iteration
      end time (gradient all-reduce, update) is spread over them when its logical mesh is
      chosen (``None``: meshes are compared by time per microbatch alone).
    replica_check: ``dp -> whether the step traced at the microbatch's rows / dp is the same
      program`` (:func:`replica_programs`; ``None``: taken as the same).

  Returns:
    The :class:`ProfileResult`.
  """
  opts = options or ProfileOptions()
  if len(opts.remat_modes) > 1:   # each mode, one set of tables: the planner chooses per stage
    each = {m: profile_layers(layers, cluster, local_layers=local_layers,
                              options=dataclasses.replace(opts, remat=m),
                              num_microbatches=num_microbatches, replica_check=replica_check)
            for m in opts.remat_modes}
    first = each[opts.remat_modes[0]]
    st = first.stats
    stats = dataclasses.replace(
        st, unique_tasks=sum(r.stats.unique_tasks for r in each.values()),
        computed=sum(r.stats.computed for r in each.values()),
        cache_hits=sum(r.stats.cache_hits for r in each.values()),
        seconds=sum(r.stats.seconds for r in each.values()),
        trace_s=sum(r.stats.trace_s for r in each.values()))
    return ProfileResult(with_remat_choice(**{m: r.tables for m, r in each.items()}), layers,
                         stats, first.costs, cluster, opts,
                         remat_costs={m: r.costs for m, r in each.items()},
                         replica_programs=first.replica_programs)
  t0 = time.perf_counter()
  L = len(layers)
  if L == 0:
    raise HarpjaxError("cannot profile an empty layer sequence")
  subs = ordered_subclusters(cluster, opts.order)
  if opts.source != "measured":
    _warn_uncalibrated([sub.gpu.name for sub in subs], opts.efficiencies)
  root = (opts.cache_dir if opts.cache_dir is not None else cache.default_cache_dir()) \
      if opts.use_cache else None
  db = cache.ProfileDB(root)
  source = _make_source(opts, db, num_microbatches)
  if isinstance(source, sources.ImportedSource):
    source.choose(layers)   # no published model of this shape: say so before any work
  found = enumerate_tasks(layers, cluster, subs, opts, source.name, source.cache_extra(),
                          _local_layers(layers, local_layers))
  results, computed, dp_approx = cost_tasks(found, source, db, opts, layers)
  costs = layer_costs(found, results, L)
  same = replica_programs(layers, found.configs, db, replica_check)
  tables, counts = _build_tables(layers, cluster, subs, found.configs, costs, opts,
                                 num_microbatches, replica_programs=same)
  tables = in_remat_mode(tables, opts.remat_modes[0])
  split = _routed_split(layers, found, results, tables, source, db, opts, num_microbatches)
  if split is not None:
    tables = tables.replace(routed_split=split)
  naive_ss = L * (L + 1) // 2 * sum(len(sub.submesh_shapes()) for sub in subs)
  stats = ProfileStats(
      num_layers=L, distinct_layers=len(set(layers.signatures)),
      layers_per_repeat=_layers_per_repeat(layers), configs=len(found.configs),
      candidates=len(found.configs) * L, unique_tasks=len(found.tasks),
      unique_compiles=0 if opts.source == "jaxpr" else len(
          {(t.signature, t.mesh[1], t.local_batch) for t in found.tasks.values()}),
      computed=len(computed), cache_hits=len(found.tasks) - len(computed),
      pruned_tasks=found.pruned, pruned_oom=counts["oom"], pruned_imbalance=counts["imbalance"],
      naive_stage_submesh=naive_ss, naive_stage_mesh=L * (L + 1) // 2 * len(found.configs),
      seconds=time.perf_counter() - t0, dp_approximated=dp_approx)
  log.info("profiling done: %s", stats.describe())
  by_config = {(subs[c.subcluster].name, c.submesh, c.mesh): arr
               for c, arr in zip(found.configs, costs)}
  return ProfileResult(tables, layers, stats, by_config, cluster, opts, replica_programs=same)


def _build_tables(layers: LayerSequence, cluster, subs, configs, costs,
                  opts: ProfileOptions, num_microbatches: int | None = None,
                  remat: str | None = None,
                  replica_programs: Mapping[int, bool] | None = None
                  ) -> tuple[CostTables, dict]:
  """:func:`tables_from_layer_costs` with the options' ZeRO data and the microbatch's rows, in
  rematerialisation mode ``remat`` (default: the options' first)."""
  zero = None if opts.optimizer_bytes_per_param is None else (
      opts.state_bytes_per_param, opts.optimizer_bytes_per_param)
  tables, counts = tables_from_layer_costs(layers, cluster, subs, configs, costs,
                                           opts.imbalance, zero, num_microbatches,
                                           remat=opts.remat_modes[0] if remat is None
                                           else remat, replica_programs=replica_programs)
  if microbatch_size(layers) is not None:
    tables = dataclasses.replace(tables, microbatch_rows=microbatch_size(layers))
  return tables, counts


def _routed_split(layers: LayerSequence, found: ProfileTasks, results: dict, tables: CostTables,
                  source, db, opts: ProfileOptions, num_microbatches: int | None):
  """The tables' :class:`~harpjax.compiler.profile.RoutedSplit` (each routed layer's experts
  costed apart, :func:`~harpjax.compiler.profile.routed_split.profile_routed_split`), or
  ``None`` for a model without routed layers. The experts' work is read off the layer's jaxpr
  (the jaxpr source's trace, reused when it is the source)."""
  if not layers.routed_modules():
    return None
  jaxpr = source if isinstance(source, sources.JaxprSource) else sources.JaxprSource(
      opts.efficiencies, opts.state_bytes_per_param, remat=opts.remat_modes[0],
      num_microbatches=num_microbatches)
  return profile_routed_split(layers, found, results, tables, trace=jaxpr.traced, db=db,
                              efficiencies=opts.efficiencies,
                              state_bytes_per_param=opts.state_bytes_per_param,
                              jaxpr_timed=opts.source == "jaxpr")


def tables_for_plan(result: ProfileResult, plan) -> CostTables:
  """The profile's tables with every (subcluster, submesh) a stage of ``plan`` uses costed on
  that stage's own logical mesh (and its groups' on theirs), so that
  :func:`~harpjax.compiler.plan.evaluate_plan` scores the meshes a hand-written plan asks
  for instead of the fastest ones.

  Raises:
    PlanError: two stages on the same submesh of a subcluster ask for different logical
      meshes, or a mesh was not profiled (the message lists those that were).
  """
  pins: dict = {}
  for st in plan.stages:
    for g in st.all_groups if st.groups else (st,):
      key = (g.subcluster, tuple(g.submesh))
      mesh = tuple(g.logical_mesh)
      if pins.setdefault(key, mesh) != mesh:
        raise PlanError(f"two stages on {g.subcluster} {key[1]} ask for logical meshes "
                        f"{pins[key]} and {mesh}: one set of tables holds one mesh per "
                        "submesh; cost them in two plans")
      if (g.subcluster, key[1], mesh) not in result.costs:
        have = sorted(m for n, sm, m in result.costs if (n, sm) == key)
        raise PlanError(f"stage on layers {st.layers}: {g.subcluster} {key[1]} was profiled "
                        f"with logical meshes {have}, not {mesh}")
  opts = result.options
  subs = ordered_subclusters(result.cluster, opts.order)

  def build(by_config, mode):
    configs, costs = [], []
    for k, sub in enumerate(subs):
      for s, nm in enumerate(sub.submesh_shapes()):
        for (name, sm, mesh), arr in by_config.items():
          if name == sub.name and sm == tuple(nm) and pins.get((name, sm), mesh) == mesh:
            configs.append(MeshConfig(k, s, tuple(nm), mesh))
            costs.append(arr)
    return _build_tables(result.layers, result.cluster, subs, configs, costs, opts,
                         remat=mode, replica_programs=result.replica_programs)[0]
  if result.remat_costs is not None:
    return with_remat_choice(**{m: in_remat_mode(build(c, m), m)
                                for m, c in result.remat_costs.items()})
  return in_remat_mode(build(result.costs, opts.remat_modes[0]), opts.remat_modes[0])


def _warn_uncalibrated(gpu_names, overrides) -> None:
  """One warning naming the GPU types timed with the roofline default."""
  missing = calibration.uncalibrated(gpu_names, overrides)
  if missing:
    d = calibration.DEFAULT_EFFICIENCY
    log.warning(
        "no published measurements for %s: timed with the roofline default (%.0f%% of peak "
        "FLOP/s in matmuls, memory at %gx the bytes counted, %.0f us per kernel; "
        "docs/cost_model.md); give ProfileOptions(efficiencies={name: Efficiency(...)}) if you "
        "have better numbers", ", ".join(missing), 100 * d.compute, d.memory,
        d.kernel_s * 1e6)


def _local_layers(layers: LayerSequence, local_layers):
  """``(dp -> layers at microbatch / dp or None, dp -> whether one may exist)``, memoised."""
  given = local_layers if callable(local_layers) else dict(local_layers or {}).get
  memo: dict = {1: layers}

  def local_seq(dp):
    if dp not in memo:
      memo[dp] = given(dp)
    return memo[dp]

  if callable(local_layers):
    return local_seq, (lambda dp: True)
  return local_seq, (lambda dp: dp == 1 or dp in (local_layers or {}))


def _layers_per_repeat(layers: LayerSequence) -> int:
  kinds = layers.module_kinds()
  if not kinds:
    return 0
  name = max(kinds, key=kinds.get)
  inst = layers.instances(name)
  return inst[0].num_layers if inst else 0


def profile_step(step_fn: Callable, args: tuple, cluster, *, num_microbatches: int,
                 batch_argnums: Sequence[int] = (1,), layer_options: LayerOptions | None = None,
                 options: ProfileOptions | None = None,
                 layers: LayerSequence | None = None,
                 traced: TracedStep | None = None) -> ProfileResult:
  """Traces a train step, constructs its layers and profiles them on ``cluster``.

  The step's region is traced once more per data-parallel degree at the local microbatch
  size (only where a task misses the cache), rewritten as the step's own
  (:func:`~harpjax.compiler.trace.trace_step` with ``like``): the program one replica runs.

  Args:
    step_fn: the train step (uses :func:`harpjax.value_and_grad`).
    args: example arguments; ``jax.ShapeDtypeStruct`` s are enough.
    cluster: the :class:`harpjax.Cluster`.
    num_microbatches: B.
    batch_argnums: positions of the batch arguments.
    layer_options: :class:`~harpjax.compiler.layers.LayerOptions`.
    options: :class:`ProfileOptions`.
    layers: the step's layers (:func:`~harpjax.compiler.layers.layers_for_step` of its trace
      at ``num_microbatches``), if the caller has them; else the step is traced here.
    traced: the trace ``layers`` were cut from (with ``layers``; without it the step is
      traced again at full batch for each local microbatch size).
  """
  opts = options or ProfileOptions()
  traced_s = [0.0]
  if layers is None:
    t0 = time.perf_counter()
    traced = trace_step(step_fn, args, num_microbatches=num_microbatches,
                        batch_argnums=batch_argnums)
    layers = layers_for_step(traced, layer_options)
    traced_s[0] = time.perf_counter() - t0
    log.info("traced and cut the step in %.1f s: %s", traced_s[0], layers.summary)
  b = microbatch_size(layers)
  if b is None:
    log.warning("no input of the step is split into microbatches (num_microbatches=%d), so "
                "data parallelism cannot be costed; trace with num_microbatches >= 2",
                num_microbatches)
    b = 1
  lopts = layer_options or LayerOptions()
  traced_at: dict[int, object] = {}
  same: dict[int, bool] = {}

  def local(dp: int):
    """The layers traced at microbatch ``b / dp`` (only on a cache miss)."""
    if dp not in traced_at:
      traced_at[dp] = _local(dp)
    return traced_at[dp]

  def same_program(dp: int) -> bool:
    """Whether the step traced at microbatch ``b / dp`` is the step's program op for op."""
    if dp not in same:
      local(dp)
    return same.get(dp, False)

  def _local(dp: int):
    t1 = time.perf_counter()
    try:
      # The region at b / dp rows, rewritten as the step's (only the region is traced).
      ts_dp = trace_step(step_fn, args, num_microbatches=num_microbatches * dp,
                         batch_argnums=batch_argnums, batch_coupling="per_microbatch",
                         like=traced, factor=num_microbatches * dp if traced else None)
      program = ts_dp.region
      if layers.origin is not None:
        program, _ = unroll_scans(program, z=lopts.z, max_length=lopts.max_unroll)
      same[dp] = len(program.ops) == len(layers.program.ops) and all(
          a.name == b.name for a, b in zip(program.ops, layers.program.ops))
      seq = relayer(layers, program, [inp.kind for inp in ts_dp.inputs])
      log.info("traced the step at microbatch %d / %d in %.1f s", b, dp,
               time.perf_counter() - t1)
      return seq
    except (HarpjaxError, ValueError) as e:
      log.info("no trace at microbatch %d / %d (%s); scaling instead", b, dp, e)
      return None
    finally:
      traced_s[0] += time.perf_counter() - t1

  t_first = traced_s[0]
  result = profile_layers(layers, cluster, options=opts, local_layers=local,
                          num_microbatches=num_microbatches, replica_check=same_program)
  stats = dataclasses.replace(result.stats, trace_s=traced_s[0],
                              seconds=result.stats.seconds + t_first)
  return dataclasses.replace(result, stats=stats)
