"""Sailor's resource planner (Strati et al., SOSP'25, §4.2) as a baseline on our cost tables.

A developer tool (``benchmarks/sailor.py`` runs it against :func:`harpjax.compiler.plan.solve`),
not part of the library. Two parts:

* **Sailor's inputs as our tables.** :func:`load_model` reads the numbers taken from Sailor's
  repository (``benchmarks/data/sailor/``: per-layer forward/backward/update seconds of
  OPT-350M and GPT-Neo-2.7B per GPU type, microbatch size and tensor-parallel degree;
  parameters and activations per layer; GPU memory and prices; measured link bandwidths) and
  :func:`sailor_tables` turns a cluster of pools (:class:`Pool`: one GPU type in one zone) into
  a :class:`~harpjax.compiler.profile.CostTables` for one *global* microbatch ``b`` (sequences
  per microbatch across a stage's data-parallel replicas): an entry (layers ``i..j``, submesh
  of ``g`` devices, logical mesh ``(dp, tp)``) runs ``b / dp`` sequences per replica, which
  must be a profiled microbatch size, costs the profile's forward+backward seconds at that
  size and ``tp``, holds ``24`` bytes per parameter plus Sailor's framework overhead and the
  profile's activations, and ends the iteration with the gradient all-reduce over ``dp``
  (host link inside one host, else the pool's link) and the profiled optimizer update
  (``end_time_s``). Cuts carry the block output of the global microbatch over the link between
  the two pools. Prices are Sailor's per GPU-hour.

* **Sailor's search** (:func:`sailor_plan`), re-implemented from the paper's description:
  for every profiled microbatch size ``mbs`` and pipeline degree ``P`` the layers are split
  evenly (the last stages get the extra layers, as Sailor's ``get_stages``); per GPU type and
  stage the smallest tensor-parallel degree whose stage fits memory with its 1F1B in-flight
  count ``P - i`` (H2; within one host, H1); then data-parallel degrees ``D`` from the largest
  the pools allow downwards until the estimate stops improving (H3; for cost, upwards until the
  cost stops falling, H4); for each ``D`` a dynamic program over the stages gives each stage a
  pool with ``D * tp`` devices, minimising Sailor's iteration estimate
  ``(N_b - 1) max_i (t_i + c_i) + sum_i t_i + 2 sum_i c_i + max_i e_i`` (its Eq. 1 and
  ``T_total``: the 1F1B steady state set by the straggler stage, the fill and drain, the
  pipeline transfers and the slowest gradient synchronisation), with ``N_b = G / (mbs D)``
  microbatches per pipeline. Objectives: ``"min_time"`` (throughput),
  ``"max_throughput_per_dollar"`` (cost per iteration), ``"min_time_within_budget"`` (a limit
  per hour; Sailor states its budget per iteration, the same constraint for a fixed time),
  ``"min_cost_within_time"`` (its §5.2.4 scenario 1: the cheapest iteration within a time).
  The best configuration by Sailor's own estimate is returned (``rank="simulator"`` instead
  returns the best of its candidates by our simulator, an oracle that flatters it).

**The mapping.** A Sailor plan is ``D`` replicas of a ``P``-stage pipeline; stage ``i``'s
replicas run on ``D * tp_i`` GPUs. With the ``D`` replicas of a stage taken as the data-parallel
dimension of one stage, the plan *is* one of ours: stage ``i`` on a submesh of ``D * tp_i``
devices of its pool with logical mesh ``(D, tp_i)``, global microbatch ``b = D * mbs`` and
``B = G / b`` microbatches. It is scored by :func:`~harpjax.compiler.plan.evaluate_plan` (the
simulator, 1F1B as Sailor runs it, and H-1F1B) on the same tables as our planner, with each of
its stages' entries at the logical mesh Sailor chose (:func:`score_plan`).

**Simplifications** (each stated where it matters): every replica of a stage uses one GPU type
and one pool (Sailor may mix GPU types among a stage's replicas; our plan type has no mixed
stage); ``D * mbs`` must divide the global batch and ``D * tp`` be a submesh size (a power of
two below the host size or whole hosts); links are constant bandwidths (Sailor fits bandwidth
against message size) and data-transfer fees between zones are left out of the cost; the tensor
degree is H2's minimum (Sailor raises it for faster GPU types where that speeds a stage up).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from typing import Sequence

import numpy as np

from harpjax.cluster import Link, paper_submeshes
from harpjax.compiler.plan import PlanEvaluation, evaluate_plan
from harpjax.compiler.profile import CostTables, assemble_tables
from harpjax.compiler.profile.collectives import allreduce_time_s
from harpjax.compiler.profile.tables import range_sums
from harpjax.errors import PlanError

__all__ = ["DATA_DIR", "SailorModel", "Pool", "load_model", "sailor_tables", "SailorPlan",
           "sailor_plan", "score_plan", "stage_entry"]

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "benchmarks", "data", "sailor")

BYTES_PER_PARAM = 24          # Sailor's memory multiplier: Adam (8), model (4), gradients (4),
                              # communication (4), extra (4); fp32 training
FLOAT_BYTES = 4
GiB = 2 ** 30


def overhead_bytes(tp: int) -> float:
  """Sailor's framework memory per GPU: 2e9 bytes, 3e9 with tensor parallelism."""
  return 2e9 if tp == 1 else 3e9


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class SailorModel:
  """A model as Sailor profiles it: ``L`` layers of four kinds (embedding, first block,
  block, head).

  Attributes:
    name: model name.
    num_layers: ``L``.
    global_batch: sequences per iteration ``G``.
    kinds: ``[L]`` kind index of each layer (0 embedding, 1 first block, 2 block, 3 head).
    times: ``{gpu: {mbs: {tp: [4, 3] array}}}`` seconds of forward, backward, update per kind.
    memory: ``{tp: [4, 2] array}`` parameters and activation floats per sequence per kind.
    act_output_floats: floats one sequence's block output holds (what a cut sends).
    gpu_memory_bytes, price_per_gpu_hour, intra_host_bytes_per_s: ``{gpu: value}``.
    links: named link bandwidths, bytes/s.
  """
  name: str
  num_layers: int
  global_batch: int
  kinds: tuple[int, ...]
  times: dict
  memory: dict
  act_output_floats: float
  gpu_memory_bytes: dict
  price_per_gpu_hour: dict
  intra_host_bytes_per_s: dict
  links: dict

  def mbs_options(self, gpu: str, tp: int) -> tuple[int, ...]:
    return tuple(sorted(m for m, by_tp in self.times[gpu].items() if tp in by_tp))

  def layer_costs(self, gpu: str, mbs: int, tp: int) -> tuple[np.ndarray, ...] | None:
    """``[L]`` arrays: forward+backward seconds, update seconds, parameter floats, activation
    floats per sequence, at microbatch ``mbs`` and tensor degree ``tp`` (``None`` if not
    profiled)."""
    by = self.times[gpu].get(mbs, {}).get(tp)
    if by is None:
      return None
    k = np.asarray(self.kinds)
    mem = self.memory[tp]
    return by[k, 0] + by[k, 1], by[k, 2], mem[k, 0], mem[k, 1]


def load_model(name: str = "OPT-350", data_dir: str = DATA_DIR) -> SailorModel:
  """Reads Sailor's numbers for ``name`` from ``benchmarks/data/sailor/cluster.json`` and the
  per-GPU profile files it names."""
  with open(os.path.join(data_dir, "cluster.json")) as f:
    cl = json.load(f)
  m = cl["models"][name]
  L = int(m["num_layers"])
  kinds = (0, 1) + (2,) * (L - 3) + (3,)
  times = {}
  for gpu, fname in m["profiles"].items():
    with open(os.path.join(data_dir, fname)) as f:
      prof = json.load(f)["times"]
    times[gpu] = {int(mbs): {int(tp): np.asarray(v, np.float64) for tp, v in by.items()}
                  for mbs, by in prof.items()}
  memory = {int(tp): np.asarray(v, np.float64) for tp, v in m["memory"].items()}
  gpus = cl["gpus"]
  return SailorModel(
      name=name, num_layers=L, global_batch=int(m["global_batch_size"]), kinds=kinds,
      times=times, memory=memory, act_output_floats=float(m["act_output_floats"]),
      gpu_memory_bytes={g: v["memory_gb"] * GiB for g, v in gpus.items()},
      price_per_gpu_hour={g: v["price_per_gpu_hour"] for g, v in gpus.items()},
      intra_host_bytes_per_s={g: v["intra_host_bytes_per_s"] for g, v in gpus.items()},
      links={k: v for k, v in cl["links_bytes_per_s"].items() if k != "note"})


@dataclasses.dataclass(frozen=True)
class Pool:
  """GPUs of one type in one zone (a subcluster of the tables).

  Attributes:
    name: subcluster name (``"a100@a"``).
    gpu: GPU type as in the profiles (``"A100-40"``).
    zone: zone name; zones of one region share the region prefix before the last ``-``.
    num_hosts: hosts (VMs) of ``devices_per_host`` GPUs.
    devices_per_host: GPUs per host (4, as the paper's VMs).
  """
  name: str
  gpu: str
  zone: str
  num_hosts: int
  devices_per_host: int = 4

  @property
  def region(self) -> str:
    return self.zone.rsplit("-", 1)[0]

  @property
  def num_devices(self) -> int:
    return self.num_hosts * self.devices_per_host


def _pool_link(model: SailorModel, pool: Pool) -> float:
  return model.links["same_zone_a100" if pool.gpu.startswith("A100") else "same_zone_v100"]


def _pair_link(model: SailorModel, a: Pool, b: Pool) -> float:
  if a.region != b.region:
    return model.links["other_region"]
  if a.zone != b.zone:
    return model.links["other_zone"]
  return min(_pool_link(model, a), _pool_link(model, b))


_ENTRY_CACHE: dict = {}


def _entry_arrays(model: SailorModel, pool: Pool, g: int, n: int, dp: int, tp: int,
                  microbatch: int):
  key = (id(model), pool, g, n, dp, tp, microbatch)
  if key not in _ENTRY_CACHE:
    _ENTRY_CACHE[key] = _entry_arrays_uncached(model, pool, g, n, dp, tp, microbatch)
  return _ENTRY_CACHE[key]


def _entry_arrays_uncached(model: SailorModel, pool: Pool, g: int, n: int, dp: int, tp: int,
                           microbatch: int):
  """``[L, L]`` time, parameter bytes, activation bytes and end seconds of every range on ``g``
  devices with logical mesh ``(dp, tp)`` at global microbatch ``microbatch``; ``None`` when the
  replica microbatch ``microbatch / dp`` was not profiled."""
  if microbatch % dp:
    return None
  mbs = microbatch // dp
  costs = model.layer_costs(pool.gpu, mbs, tp)
  if costs is None:
    return None
  t, upd, params, act = costs
  overhead = overhead_bytes(tp)
  link = Link(model.intra_host_bytes_per_s[pool.gpu]) if n == 1 else Link(
      _pool_link(model, pool))
  p_sum = range_sums(params)
  with np.errstate(invalid="ignore"):   # inf below the diagonal
    end = allreduce_time_s(p_sum * FLOAT_BYTES, dp, link) + range_sums(upd)
  return (range_sums(t), p_sum * BYTES_PER_PARAM + overhead,
          range_sums(act) * mbs * FLOAT_BYTES, end)


def sailor_tables(model: SailorModel, pools: Sequence[Pool], microbatch: int,
                  max_tp: int = 4) -> CostTables:
  """The cost tables of ``pools`` at global microbatch ``microbatch`` (see the module doc).

  Each entry keeps the fastest logical mesh whose parameters and one microbatch fit
  (:func:`~harpjax.compiler.profile.assemble_tables`); prices are per GPU-hour; every pair of
  pools is linked (same zone, other zone of the region, other region).
  """
  L = model.num_layers
  submeshes = [paper_submeshes(p.num_hosts, p.devices_per_host) for p in pools]

  def mesh_costs(k: int, s: int):
    pool = pools[k]
    n, m = submeshes[k][s]
    g = n * m
    for tp in (1, 2, 4, 8):
      if tp > max_tp or m % tp or g % tp:
        continue
      arrs = _entry_arrays(model, pool, g, n, g // tp, tp, microbatch)
      if arrs is None:
        t = np.full((L, L), np.inf)
        z = np.zeros((L, L))
        yield (g // tp, tp), t, z, z, z
      else:
        yield ((g // tp, tp),) + arrs

  pair = [[None if a == b else Link(_pair_link(model, pa, pb)) for b, pb in enumerate(pools)]
          for a, pa in enumerate(pools)]
  tables, _ = assemble_tables(
      names=[p.name for p in pools], num_hosts=[p.num_hosts for p in pools],
      devices_per_host=[p.devices_per_host for p in pools],
      memory_bytes=[model.gpu_memory_bytes[p.gpu] for p in pools], submeshes=submeshes,
      mesh_costs=mesh_costs,
      boundary_bytes=np.full(L, model.act_output_floats * microbatch * FLOAT_BYTES),
      intra_links=[Link(_pool_link(model, p)) for p in pools], inter_links=[],
      pair_links=pair, price_per_gpu_hour=[model.price_per_gpu_hour[p.gpu] for p in pools])
  tables = tables.replace(boundary_bytes=np.where(np.arange(L) == L - 1, 0.0,
                                                  tables.boundary_bytes))
  return tables


# --------------------------------------------------------------------------- Sailor's search


@dataclasses.dataclass(frozen=True)
class SailorPlan:
  """A Sailor configuration and its score on the common tables.

  Attributes:
    mbs: microbatch per replica; dp: data-parallel degree ``D``; microbatch: ``D * mbs``;
    num_microbatches: ``B = G / (D * mbs)``.
    stages: ``(first, last, pool index, tp)`` per stage.
    estimate_s: Sailor's own iteration estimate.
    rate_per_hour: GPUs times price.
    quads: the plan as ``(first, last, subcluster, submesh index)`` of the tables.
    evaluation: :func:`score_plan` under 1F1B (what Sailor runs); h1f1b: under H-1F1B.
    seconds: search time; candidates: configurations estimated.
  """
  mbs: int
  dp: int
  microbatch: int
  num_microbatches: int
  stages: tuple[tuple[int, int, int, int], ...]
  estimate_s: float
  rate_per_hour: float
  quads: tuple[tuple[int, int, int, int], ...]
  evaluation: PlanEvaluation | None = None
  h1f1b: PlanEvaluation | None = None
  seconds: float = 0.0
  candidates: int = 0

  @property
  def iteration_s(self) -> float:
    ev = self.evaluation
    return ev.iteration_s if ev is not None and ev.feasible else math.inf

  @property
  def cost_per_iteration(self) -> float:
    return self.rate_per_hour * self.iteration_s / 3600.0

  @property
  def num_devices(self) -> int:
    return sum(self.dp * tp for *_, tp in self.stages)


def even_stages(num_layers: int, P: int) -> list[tuple[int, int]]:
  """Sailor's layer split: ``L // P`` layers per stage, the last ``L mod P`` stages one
  more (they hold fewer in-flight microbatches)."""
  size, extra = divmod(num_layers, P)
  out, start = [], 0
  for i in range(P):
    n = size + (1 if i >= P - extra else 0)
    out.append((start, start + n - 1))
    start += n
  return out


def stage_entry(tables: CostTables, pools: Sequence[Pool], k: int, dp: int, tp: int
                ) -> int | None:
  """Submesh index of ``dp * tp`` devices in pool ``k`` (``None`` if it is no submesh)."""
  g = dp * tp
  M = pools[k].devices_per_host
  shape = (1, g) if g < M else ((g // M, M) if g % M == 0 else None)
  if shape is None or shape not in tables.submeshes[k]:
    return None
  return tables.submeshes[k].index(shape)


def _forced(model: SailorModel, pools: Sequence[Pool], tables: CostTables, microbatch: int,
            entries) -> CostTables:
  """``tables`` with the given ``(first, last, k, s, dp, tp)`` entries at logical mesh
  ``(dp, tp)`` (Sailor's choice) instead of the tables' fastest."""
  arrs = {f: [np.array(a) for a in getattr(tables, f)]
          for f in ("stage_time_s", "param_mem_bytes", "act_mem_bytes", "end_time_s",
                    "logical_mesh")}
  for i, j, k, s, dp, tp in entries:
    n, m = tables.submeshes[k][s]
    got = _entry_arrays(model, pools[k], n * m, n, dp, tp, microbatch)
    if got is None:
      arrs["stage_time_s"][k][i, j, s] = np.inf
      continue
    for f, a in zip(("stage_time_s", "param_mem_bytes", "act_mem_bytes", "end_time_s"), got):
      arrs[f][k][i, j, s] = a[i, j]
    arrs["logical_mesh"][k][i, j, s] = (dp, tp)
  return tables.replace(**{f: tuple(v) for f, v in arrs.items()})


def score_plan(model: SailorModel, pools: Sequence[Pool], plan: SailorPlan,
               tables: CostTables | None = None) -> SailorPlan:
  """Scores a Sailor plan with the simulator on the common tables (its stages' entries at its
  own logical meshes): 1F1B (``evaluation``) and H-1F1B (``h1f1b``)."""
  if tables is None:
    tables = sailor_tables(model, pools, plan.microbatch)
  entries = [(i, j, k, s, plan.dp, tp) for (i, j, k, s), (*_, tp)
             in zip(plan.quads, plan.stages)]
  forced = _forced(model, pools, tables, plan.microbatch, entries)
  B = plan.num_microbatches
  ev = evaluate_plan(forced, plan.quads, B, "1f1b")
  h1 = evaluate_plan(forced, plan.quads, B, "h1f1b")
  return dataclasses.replace(plan, evaluation=ev, h1f1b=h1)


def sailor_plan(model: SailorModel, pools: Sequence[Pool], *, objective: str = "min_time",
                budget_per_hour: float | None = None, max_stages: int | None = None,
                rank: str = "sailor", microbatches: Sequence[int] | None = None,
                time_limit_s: float | None = None) -> SailorPlan:
  """Sailor's search (see the module doc); the plan scored by :func:`score_plan`.

  Args:
    model, pools: the inputs.
    objective: ``"min_time"``, ``"max_throughput_per_dollar"``,
      ``"min_time_within_budget"`` (with ``budget_per_hour``) or ``"min_cost_within_time"``
      (with ``time_limit_s``, seconds per iteration by Sailor's estimate).
    max_stages: largest pipeline degree ``P`` (default ``L``).
    rank: ``"sailor"`` (its own estimate picks the plan) or ``"simulator"`` (every configuration
      it estimates is scored by the simulator and the best is returned: an oracle).
    microbatches: profiled replica microbatch sizes to try (default all).

  Raises:
    PlanError: no configuration fits (memory, devices or budget).
  """
  if objective not in ("min_time", "max_throughput_per_dollar", "min_time_within_budget",
                       "min_cost_within_time"):
    raise PlanError(f"objective {objective!r} not supported by the Sailor baseline")
  if objective == "min_time_within_budget" and budget_per_hour is None:
    raise PlanError("min_time_within_budget needs budget_per_hour")
  if objective == "min_cost_within_time" and time_limit_s is None:
    raise PlanError("min_cost_within_time needs time_limit_s")
  start = time.perf_counter()
  G, L = model.global_batch, model.num_layers
  K = len(pools)
  price = [model.price_per_gpu_hour[p.gpu] for p in pools]
  cap = tuple(p.num_devices for p in pools)
  gpus = sorted({p.gpu for p in pools})
  tables_at = functools.lru_cache(maxsize=None)(
      lambda b: sailor_tables(model, pools, b))
  cost_kind = objective in ("max_throughput_per_dollar", "min_cost_within_time")
  t_limit = math.inf if time_limit_s is None else float(time_limit_s)
  limit = math.inf if budget_per_hour is None else float(budget_per_hour)
  mbs_all = sorted({m for g in gpus for m in model.times[g]})
  if microbatches is not None:
    mbs_all = [m for m in mbs_all if m in set(microbatches)]
  best, best_key, n_cand = None, math.inf, 0
  scored_best, scored_key = None, math.inf

  def key_of(T, rate):
    return rate * T if cost_kind else T

  for mbs in mbs_all:
    for P in range(1, min(L, max_stages or L) + 1):
      stages = even_stages(L, P)
      # H2 (and H1): per GPU type and stage, the smallest tp that fits with P - i in flight.
      min_tp = {}
      for gpu in gpus:
        row = []
        for i, (a, b) in enumerate(stages):
          tp_ok = None
          for tp in (1, 2, 4):
            c = model.layer_costs(gpu, mbs, tp)
            if c is None:
              continue
            _, _, params, act = c
            mem = (params[a:b + 1].sum() * BYTES_PER_PARAM + overhead_bytes(tp)
                   + (P - i) * act[a:b + 1].sum() * mbs * FLOAT_BYTES)
            if mem <= model.gpu_memory_bytes[gpu]:
              tp_ok = tp
              break
          row.append(tp_ok)
        min_tp[gpu] = row
      if all(all(x is None for x in r) for r in min_tp.values()):
        continue
      need = sum(min(min_tp[g][i] for g in gpus if min_tp[g][i] is not None)
                 if any(min_tp[g][i] is not None for g in gpus) else math.inf
                 for i in range(P))
      if not math.isfinite(need):
        continue
      d_max = sum(cap) // need
      ds = [d for d in range(1, d_max + 1) if G % (d * mbs) == 0]
      ds = ds if cost_kind else ds[::-1]   # H4: increasing for cost; H3: decreasing
      prev = math.inf
      for D in ds:
        b = D * mbs
        tables = tables_at(b)
        found = _assign(model, tables, pools, stages, min_tp, D, b, price, cap, limit,
                        cost_kind)
        if found is None:
          continue
        n_cand += 1
        T, rate, assignment = found
        if T > t_limit:
          continue   # H4: larger D until the estimate meets the time limit
        quads = tuple((a, z, k, s) for (a, z), (k, s, _) in zip(stages, assignment))
        plan = SailorPlan(mbs=mbs, dp=D, microbatch=b, num_microbatches=G // b,
                          stages=tuple((a, z, k, tp) for (a, z), (k, _, tp)
                                       in zip(stages, assignment)),
                          estimate_s=T, rate_per_hour=rate, quads=quads)
        key = key_of(T, rate)
        if key < best_key:
          best, best_key = plan, key
        if rank == "simulator":
          sp = score_plan(model, pools, plan, tables)
          if sp.evaluation.feasible and sp.rate_per_hour <= limit and \
              sp.iteration_s <= t_limit:
            sk = key_of(sp.iteration_s, sp.rate_per_hour)
            if sk < scored_key:
              scored_best, scored_key = sp, sk
        if key >= prev:
          break   # H3 / H4: stop when the objective stops improving
        prev = key
  chosen = scored_best if rank == "simulator" else best
  if chosen is None:
    raise PlanError(f"the Sailor baseline finds no configuration on {K} pools "
                    f"({objective}, budget {budget_per_hour})")
  if rank != "simulator":
    chosen = score_plan(model, pools, chosen, tables_at(chosen.microbatch))
  return dataclasses.replace(chosen, seconds=time.perf_counter() - start, candidates=n_cand)


def _assign(model: SailorModel, tables: CostTables, pools: Sequence[Pool], stages, min_tp,
            D: int, microbatch: int, price, cap, limit: float, cost_kind: bool):
  """Sailor's per-stage dynamic program (its Eq. 1, Listing 1) for fixed ``P``, ``mbs``,
  ``D``: each stage gets one pool with ``D * tp`` devices (``tp`` from H2 for the pool's GPU
  type), a pipeline leaves a pool at most once, and the suffix kept per (stage, devices left,
  pool, pools closed) is the one with the smallest ``T_total`` (with prices and a budget: the
  rate of the suffix enters the key, and suffixes over the budget are dropped).

  Returns:
    ``(estimate, rate, [(k, s, tp)])`` or ``None``.
  """
  P = len(stages)
  N_b = model.global_batch // microbatch
  comm = tables.pair_comm_s

  def stage_opts(i):
    a, b = stages[i]
    out = []
    for k, pool in enumerate(pools):
      tp = min_tp[pool.gpu][i]
      if tp is None:
        continue
      s = stage_entry(tables, pools, k, D, tp)
      if s is None:
        continue
      n, m = tables.submeshes[k][s]
      arrs = _entry_arrays(model, pool, n * m, n, D, tp, microbatch)
      if arrs is None:
        continue
      out.append((k, s, tp, n * m, float(arrs[0][a, b]), float(arrs[3][a, b])))
    return out

  opts = [stage_opts(i) for i in range(P)]

  @functools.lru_cache(maxsize=None)
  def suffix(i, left, prev, closed):
    """Best suffix from stage ``i``: ``(key, straggler, sum_t, sum_c, end, rate, choices)``."""
    if i == P:
      return (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, ())
    best = None
    for k, s, tp, g, t, e in opts[i]:
      if left[k] < g or (k != prev and k in closed):
        continue
      if not math.isfinite(t):
        continue
      nleft = list(left)
      nleft[k] -= g
      nclosed = closed if (prev is None or k == prev) else closed | frozenset([prev])
      rest = suffix(i + 1, tuple(nleft), k, nclosed)
      if rest is None:
        continue
      b = stages[i][1]
      c = 0.0
      if i + 1 < P:
        k2 = rest[6][0][0]
        c = float(comm[k, k2, b])
      straggler = max(t + c, rest[1])
      sum_t, sum_c = t + rest[2], c + rest[3]
      end = max(e, rest[4])
      rate = rest[5] + g * price[k]
      if rate > limit:
        continue
      T = (N_b - 1) * straggler + sum_t + 2 * sum_c + end
      key = rate * T if cost_kind else T
      if best is None or key < best[0]:
        best = (key, straggler, sum_t, sum_c, end, rate, ((k, s, tp),) + rest[6])
    return best

  res = suffix(0, tuple(cap), None, frozenset())
  if res is None:
    return None
  _, straggler, sum_t, sum_c, end, rate, choices = res
  T = (N_b - 1) * straggler + sum_t + 2 * sum_c + end
  return T, rate, list(choices)
