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

* **Sailor's search** (:func:`sailor_plan`), a port of the code path of Sailor's public C++
  planner (eth-easl/sailor ``cpp_src/planner.cpp`` and ``planner_utils.cpp``; where its code
  and paper disagree this follows the code): pipeline degrees ``P`` from 1 up, its layer split
  (extra layers on the last stages; 34 layers in 5 stages as 5, 7, 7, 7, 8), every profiled
  replica microbatch; per GPU type and stage the tensor degree is the larger of the memory
  minimum (1F1B's ``P - i`` in flight) and the speed-up rule (raise it while a stage runs
  1.5x faster), except that the first type (A100-40) takes the minimum alone when the cluster
  has two types; zones of one region are one (H6), zones ordered by their GPU count, a stage's
  replicas filling one zone and then the next, types mixed within a stage; a pipeline crosses
  to the next region once (H5), regions ordered by the fitted link between them; every
  data-parallel degree ``D`` at which ``ceil(G / (mbs D))`` changes (not only divisors),
  largest first until the estimate stops improving (H3), or for cost smallest first until the
  cost stops falling (H4); the per-stage dynamic program of its Listing 1 with its estimate
  ``Tpp = (N_b - 1) straggler + sum t + 2 sum c + max sync`` (one stage: ``N_b t + sync +
  update``), a cut timed as the slowest replica pair, each pair on its own fitted link
  (bandwidth a polynomial in the log of the message size, ``network.json``), the
  synchronisation a bucketed ring all-reduce on the fitted link; its cost per iteration
  ``Tpp * price + fees`` with fees per GB between zones (0.01 USD) and regions (0.02 USD) on
  every cut, forward and back, and on syncs whose replicas span zones; its budget per
  iteration. Its quirks are kept and marked ``Sailor:`` in the code: under the cost objectives
  only single-stage plans survive (its non-last stages pass only under the throughput
  objective); the budget test of a non-last stage sees the fees alone; the memo key ignores
  ``P``; a non-last stage's fees count only its first zone.

**The mapping.** Where every stage's replicas are one GPU type in one pool with one tensor
degree and ``D * tp`` is a submesh, the plan *is* one of ours: stage ``i`` on ``D * tp_i``
devices with logical mesh ``(D, tp_i)``, global microbatch ``b = D * mbs`` and
``ceil(G / b)`` microbatches; :func:`score_plan` scores it with
:func:`~harpjax.compiler.plan.evaluate_plan` (1F1B, as Sailor runs it, and H-1F1B) on the
same tables as our planner. Other plans (a stage mixing types or zones) keep Sailor's estimate
only. The tables carry Sailor's zones, regions and fees (:func:`pool_fees`), so
:func:`~harpjax.compiler.plan.evaluate_plan` counts a plan's fees as Sailor does (every cut
between zones or regions, forward and back, per microbatch) and
:func:`~harpjax.compiler.plan.solve` ranks our plans and holds them to a budget with them;
:func:`transfer_fees_usd` is that count for a plan given by its pools.

**Left out**: links whose sender sits in a zone not transcribed (us-west1-b) use the reverse
link, and inside such a zone us-central1-a's links; an unprofiled (microbatch, tensor degree)
pair, which Sailor's code reads out of bounds, is skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import time
from typing import Sequence

import numpy as np

from harpjax.cluster import Link, paper_submeshes
from harpjax.compiler.plan import PlanEvaluation, evaluate_plan
from harpjax.cluster import TransferFees
from harpjax.compiler.profile import CostTables, LinkFees, assemble_tables, cuts_transfer
from harpjax.compiler.profile.collectives import allreduce_time_s
from harpjax.compiler.profile.tables import range_sums
from harpjax.errors import PlanError

__all__ = ["DATA_DIR", "SailorModel", "Pool", "load_model", "sailor_tables", "grad_bytes",
           "SailorNetwork",
           "load_network", "SailorPlan", "sailor_plan", "sailor_stages", "score_plan",
           "stage_entry", "transfer_fees_usd", "pool_fees"]

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
                                                  tables.boundary_bytes),
                          fees=pool_fees(pools), microbatch_rows=int(microbatch))
  return tables


def grad_bytes(model: SailorModel) -> tuple[float, ...]:
  """``[L]`` bytes of each layer's gradient (fp32, one replica): what a mixed-type stage's
  cross-group gradient sum sends (``MixedOptions.grad_bytes``)."""
  params = model.memory[1][np.asarray(model.kinds), 0]
  return tuple(float(x) * FLOAT_BYTES for x in params)


def pool_fees(pools: Sequence[Pool], network: "SailorNetwork | None" = None) -> LinkFees:
  """The pools' zones and regions (Sailor's: :func:`zone_region`) and Sailor's fees per GB
  (``network.json``'s, the library's defaults), for the tables' transfer fees."""
  fee = (network or load_network()).fee_usd_per_gb
  return LinkFees(tuple((p.name, p.zone, zone_region(p.zone)) for p in pools),
                  TransferFees(fee["same_zone"], fee["other_zone"], fee["other_region"]))


# --------------------------------------------------------------------------- Sailor's network


@dataclasses.dataclass(frozen=True)
class SailorNetwork:
  """Sailor's fitted links and transfer fees (``benchmarks/data/sailor/network.json``).

  Attributes:
    fits: ``{name: (coefficients, max_bytes_per_s)}``: bandwidth in GB/s is the polynomial
      (highest power first) in ``log2(bytes) - log2(1e6)``; the maximum is what Sailor uses
      to order regions and to pick the all-reduce bottleneck.
    links: ``{sender zone: {sender GPU: {sender GPUs: {receiver zone: {receiver GPU:
      {receiver GPUs: fit name}}}}}}``.
    fee_usd_per_gb: ``same_zone``, ``other_zone``, ``other_region``.
  """
  fits: dict
  links: dict
  fee_usd_per_gb: dict

  def fit(self, s_zone: str, s_gpu: str, s_n: int, r_zone: str, r_gpu: str, r_n: int):
    """``(coefficients, max_bytes_per_s)`` of the link; a sender in a zone not transcribed
    uses the reverse link, and inside such a zone us-central1-a's own link."""
    if s_zone not in self.links:
      if r_zone == s_zone:
        s_zone = r_zone = "us-central1-a"
      else:
        s_zone, s_gpu, s_n, r_zone, r_gpu, r_n = r_zone, r_gpu, r_n, s_zone, s_gpu, s_n
    name = self.links[s_zone][s_gpu][str(s_n)][r_zone][r_gpu][str(r_n)]
    coeffs, max_bps = self.fits[name]
    return tuple(coeffs), float(max_bps)

  def fee_per_gb(self, a: str, b: str) -> float:
    """USD per GB sent from zone ``a`` to zone ``b``."""
    if a == b:
      return self.fee_usd_per_gb["same_zone"]
    if zone_region(a) == zone_region(b):
      return self.fee_usd_per_gb["other_zone"]
    return self.fee_usd_per_gb["other_region"]


def load_network(data_dir: str = DATA_DIR) -> SailorNetwork:
  with open(os.path.join(data_dir, "network.json")) as f:
    d = json.load(f)
  return SailorNetwork(fits=d["fits"], links=d["links"], fee_usd_per_gb=d["fee_usd_per_gb"])


def zone_region(zone: str) -> str:
  """Sailor's region of a zone: the name up to its second ``-`` (``us-central1-a`` ->
  ``us-central1``)."""
  parts = zone.split("-")
  return zone if len(parts) < 3 else "-".join(parts[:2])


def send_time_s(nbytes: float, coeffs) -> float:
  """Seconds to send ``nbytes`` over a fitted link (Sailor's ``estimate_send_time``)."""
  x = math.log2(nbytes) - math.log2(1e6)
  bw = 0.0
  for c in coeffs:
    bw = bw * x + c
  return nbytes / 1e9 / bw


ALLREDUCE_BUCKET_BYTES = 500_000_000   # Sailor's DeepSpeed bucket


def allreduce_time_s_fitted(nbytes: int, workers: int, coeffs) -> float:
  """Sailor's ring all-reduce in buckets: per bucket ``2 (D - 1)`` sends of ``bucket / D``."""
  if workers <= 1:
    return 0.0
  total, left = 0.0, int(nbytes)
  while left > 0:
    part = min(left, ALLREDUCE_BUCKET_BYTES)
    total += 2 * (workers - 1) * send_time_s(int(part / workers), coeffs)
    left -= part
  return total


# --------------------------------------------------------------------------- Sailor's search

SPEEDUP_THRESHOLD = 1.5      # Sailor raises the tensor degree while it speeds a stage up 1.5x
TP_DEGREES = (1, 2, 4)       # the GPU counts its link profiles hold
ZONE_FEE_ALLREDUCE = 0.01    # USD/GB its data-parallel fee uses whatever the zones


@dataclasses.dataclass(frozen=True)
class SailorPlan:
  """A configuration of Sailor's search, with Sailor's own estimate and our simulator's score.

  Attributes:
    mbs: microbatch per replica; dp: data-parallel degree ``D`` (any, not only divisors);
    num_microbatches: ``ceil(G / (mbs D))`` per pipeline, as Sailor counts them.
    layers: ``(first, last)`` per stage.
    replicas: per stage, ``D`` tuples ``(gpu, tp, zone)`` (replica ``k`` of each stage forms
      pipeline ``k``); a stage may mix GPU types and zones of one region.
    estimate_s: Sailor's iteration estimate ``Tpp``.
    compute_usd_per_s: GPUs' price per second; fees_usd: data-transfer fees per iteration
      (pipeline cuts and data-parallel syncs, as Sailor counts them).
    evaluation, h1f1b: our simulator's score under 1F1B and H-1F1B where the plan is one of
      ours (every stage on one pool), else ``None``.
    seconds: search time; candidates: configurations kept.
  """
  mbs: int
  dp: int
  num_microbatches: int
  layers: tuple[tuple[int, int], ...]
  replicas: tuple[tuple[tuple[str, int, str], ...], ...]
  estimate_s: float
  compute_usd_per_s: float
  fees_usd: float
  evaluation: PlanEvaluation | None = None
  h1f1b: PlanEvaluation | None = None
  quads: tuple[tuple[int, int, int, int], ...] | None = None
  seconds: float = 0.0
  candidates: int = 0

  @property
  def rate_per_hour(self) -> float:
    return self.compute_usd_per_s * 3600.0

  @property
  def cost_per_iteration(self) -> float:
    """Sailor's objective: ``Tpp * compute + fees`` (USD per iteration)."""
    return self.estimate_s * self.compute_usd_per_s + self.fees_usd

  @property
  def num_devices(self) -> int:
    return sum(tp for reps in self.replicas for _, tp, _ in reps)

  @property
  def microbatch(self) -> int:
    return self.mbs * self.dp

  @property
  def iteration_s(self) -> float:
    ev = self.evaluation
    return ev.iteration_s if ev is not None and ev.feasible else math.inf

  def describe(self) -> str:
    out = []
    for (a, z), reps in zip(self.layers, self.replicas):
      groups: dict = {}
      for g, tp, zone in reps:
        groups[(g, tp, zone)] = groups.get((g, tp, zone), 0) + 1
      out.append(f"{a}-{z} " + " + ".join(f"{n}x{g.split('-')[0]} tp{tp} @{zone}"
                                          for (g, tp, zone), n in groups.items()))
    return " | ".join(out)


def sailor_stages(num_layers: int, P: int) -> list[tuple[int, int]]:
  """Sailor's layer split (``get_stages``): ``L // P`` layers per stage, the last ``L mod P``
  stages one more, except its hand-made split of 34 layers into 5 stages (5, 7, 7, 7, 8)."""
  if num_layers == 34 and P == 5:
    sizes = (5, 7, 7, 7, 8)
  else:
    size, extra = divmod(num_layers, P)
    sizes = tuple(size + (1 if i >= P - extra else 0) for i in range(P))
  out, start = [], 0
  for n in sizes:
    out.append((start, start + n - 1))
    start += n
  return out


even_stages = sailor_stages


class _Search:
  """Sailor's planner (``SailorPlanner::get_sorted_plans``) on our inputs; see the module doc.

  A port of its code path, not of its code: the same enumeration order, heuristics, dynamic
  program, estimate, fees and budget rules (its quirks included, each marked ``Sailor:``).
  """

  def __init__(self, model: SailorModel, pools: Sequence[Pool], network: SailorNetwork,
               objective: str, budget: float, max_iter_time: float):
    self.m, self.net = model, network
    self.throughput = objective == "throughput"
    self.budget, self.max_iter_time = budget, max_iter_time
    self.types = sorted(model.times)                      # Sailor: its quota file's order
    self.price_s = [model.price_per_gpu_hour[g] / 3600.0 for g in self.types]
    T = len(self.types)
    # Zones per region, zones ordered by their GPU count (descending, stable).
    res: dict = {}
    for p in pools:
      counts = res.setdefault(zone_region(p.zone), {}).setdefault(p.zone, [0] * T)
      counts[self.types.index(p.gpu)] += p.num_devices
    self.resources = {r: sorted(((z, tuple(c)) for z, c in zs.items() if sum(c) > 0),
                                key=lambda zc: -sum(zc[1])) for r, zs in res.items()}
    self.regions = list(self.resources)
    used = [any(c[i] for zs in self.resources.values() for _, c in zs) for i in range(T)]
    self.homogeneous = sum(used) == 1
    self.total_gpus = sum(sum(c) for zs in self.resources.values() for _, c in zs)
    self.memo: dict = {}
    self.G, self.L = model.global_batch, model.num_layers

  # -- per-layer facts (Sailor's ``convertLLMInput``)
  @functools.lru_cache(maxsize=None)
  def stage_time(self, t: int, mbs: int, tp: int, a: int, b: int) -> float | None:
    c = self.m.layer_costs(self.types[t], mbs, tp)
    return None if c is None else float(c[0][a:b + 1].sum())

  @functools.lru_cache(maxsize=None)
  def stage_update(self, t: int, mbs: int, tp: int, a: int, b: int) -> float:
    c = self.m.layer_costs(self.types[t], mbs, tp)
    return (b - a + 1) * float(c[1].max())   # Sailor: layers times the largest update

  def params(self, tp: int, a: int, b: int) -> float:
    k = np.asarray(self.m.kinds)[a:b + 1]
    return float(self.m.memory[tp][k, 0].sum())

  def acts(self, tp: int, a: int, b: int) -> float:
    k = np.asarray(self.m.kinds)[a:b + 1]
    return float(self.m.memory[tp][k, 1].sum())

  # -- tensor degrees (H1, H2 and the speed-up rule)
  def min_tp(self, t: int, mbs: int, stages, i: int) -> int:
    a, b = stages[i]
    for tp in TP_DEGREES:
      mem = (self.params(tp, a, b) * BYTES_PER_PARAM + self.acts(tp, a, b) * mbs * FLOAT_BYTES
             * (len(stages) - i) + overhead_bytes(tp))
      if mem <= self.m.gpu_memory_bytes[self.types[t]]:
        return tp
    return -1

  def speedup_tp(self, t: int, mbs: int, a: int, b: int) -> int:
    prev, best = 1000.0, TP_DEGREES[0]
    for tp in TP_DEGREES:
      x = self.stage_time(t, mbs, tp, a, b) or 0.0   # Sailor: an unprofiled degree counts 0 s
      if (prev / x if x > 0 else math.inf) >= SPEEDUP_THRESHOLD:
        prev, best = x, tp
      else:
        break
    return best

  def tp_degrees(self, mbs: int, stages) -> list:
    """Per GPU type the tensor degree of each stage, or ``None`` when a stage fits on none:
    the larger of the memory minimum and the speed-up rule (Sailor: the first type, A100-40,
    takes the memory minimum alone when the cluster has more than one type)."""
    out = []
    for t in range(len(self.types)):
      mins = [self.min_tp(t, mbs, stages, i) for i in range(len(stages))]
      if any(x == -1 for x in mins):
        out.append(None)
        continue
      if t == 0 and not self.homogeneous:
        out.append([max(1, x) for x in mins])
      else:
        out.append([max(self.speedup_tp(t, mbs, a, b), x) for x, (a, b) in zip(mins, stages)])
    return out

  # -- regions (H5, H6)
  def region_lists(self, tps) -> list:
    req = [sum(x) if x else 0 for x in tps]
    gpus = {r: [sum(c[i] for _, c in self.resources[r]) for i in range(len(self.types))]
            for r in self.regions}

    def th(r1, r2):
      z1, z2 = self.resources[r1][0][0], self.resources[r2][0][0]
      return max(self.net.fit(z1, g1, 1, z2, g2, 1)[1] / 1e6
                 for g1 in self.types for g2 in self.types)

    cands = []
    for size in range(1, len(self.regions) + 1):
      for comb in itertools.combinations(self.regions, size):
        tot = [sum(gpus[r][i] for r in comb) for i in range(len(self.types))]
        if not any(tot[i] >= req[i] for i in range(len(self.types))):
          continue
        best, best_perm = -1.0, None
        for perm in itertools.permutations(sorted(comb)):
          v = 10000.0 if size == 1 else min(th(perm[j], perm[j + 1]) for j in range(size - 1))
          if size == 1 or v > best:
            best, best_perm = v, perm
        key = tuple((r, tuple(gpus[r])) for r in comb)
        cands.append((best, best_perm, key))
    cands.sort(key=lambda c: -c[0])
    return [(key, perm) for _, perm, key in cands]

  # -- one stage alone (``simulate_time_single_stage``)
  def single(self, stage, all_tp, zones, mbs: int, D: int) -> dict:
    a, b = stage
    t_comp, upd = 0.0, 0.0
    for t, (tp, _) in all_tp.items():
      x = self.stage_time(t, mbs, tp, a, b)
      if x is None:
        return None   # Sailor reads an unprofiled (mbs, tp) out of bounds; we drop it
      t_comp = max(t_comp, x)
      upd = max(upd, self.stage_update(t, mbs, tp, a, b))
    n_b = math.ceil(self.G / (mbs * D))
    pbytes = int(self.params(1, a, b)) * FLOAT_BYTES   # Sailor: tp-1 parameters
    ar, ar_fee = 0.0, 0.0
    if D > 1:
      bw_min, pick = 1e12, None
      for t, (tp, zone) in all_tp.items():
        for rz in sorted(zones):
          bw = self.net.fit(zone, self.types[t], tp, rz, self.types[t], tp)[1]
          if bw < bw_min:
            bw_min, pick = bw, (t, tp, zone)
      t, tp, zone = pick
      coeffs = self.net.fit(zone, self.types[t], tp, zone, self.types[t], tp)[0]
      ar = allreduce_time_s_fitted(pbytes, D, coeffs)
      if len(zones) > 1:
        ar_fee = 2 * (D - 1) * (len(zones) * pbytes / D * ZONE_FEE_ALLREDUCE) / 1e9
    return dict(straggler=t_comp, comp=t_comp, comm=0.0, ar=ar, first=t_comp,
                Tpp=n_b * t_comp + ar + upd, ar_fee=ar_fee)

  # -- joining a stage to the rest (``merge_stages_get_time``)
  def merge(self, p1: dict, p2: dict, first_stage, reps1, reps2, mbs: int, D: int):
    n_b = math.ceil(self.G / (mbs * D))
    act = self.m.act_output_floats * FLOAT_BYTES * mbs   # Sailor: the first stage's output
    c, fee = 0.0, 0.0
    for (g1, tp1, z1), (g2, tp2, z2) in zip(reps1, reps2):   # one link per replica pair
      coeffs = self.net.fit(z1, self.types[g1], tp1, z2, self.types[g2], tp2)[0]
      c = max(c, send_time_s(act, coeffs))
      fee += self.net.fee_per_gb(z1, z2) * act / 1e9 * n_b
    fee *= 2   # activations forward, gradients backward
    straggler = max(p1["straggler"] + c, p2["first"] + c, p2["straggler"])
    comm = p1["comm"] + p2["comm"] + 2 * c
    comp = p1["comp"] + p2["comp"]
    ar = max(p1["ar"], p2["ar"])
    Tpp = (n_b - 1) * straggler + comm + comp + ar   # Sailor: no update once stages merge
    merged = dict(straggler=straggler, first=p1["comp"] + c, comp=comp, comm=comm, ar=ar,
                  Tpp=Tpp, ar_fee=p1["ar_fee"])
    return merged, fee

  # -- a stage's replicas from a combination of counts per GPU type
  def place(self, region: str, resources, combo, tp_of, last: bool):
    """Sailor fills each type's replicas zone by zone. Returns ``(replicas, all_tp, zones,
    compute per second, resources left)`` or ``None``."""
    zones_r = resources[region]
    left = {z: list(c) for z, c in zones_r}
    reps, all_tp, zones, comp = [], {}, set(), 0.0
    if not last:
      zones.add(zones_r[0][0])   # Sailor: a non-last stage lists only the first zone
    for t, n in enumerate(combo):
      if n == 0:
        continue
      tp = tp_of[t]
      zi = 0
      zone = zones_r[0][0]
      all_tp[t] = (tp, zone)
      residual = zones_r[0][1][t]
      placed = 0
      while placed < n:
        if last:
          if residual < tp:   # Sailor (last stage): moves one zone on, whatever is there
            zi += 1
            if zi == len(zones_r):
              break
            residual, zone = zones_r[zi][1][t], zones_r[zi][0]
        else:
          while residual < tp:
            left[zones_r[zi][0]][t] = max(residual, 0)
            zi += 1
            if zi == len(zones_r):
              break
            residual, zone = zones_r[zi][1][t], zones_r[zi][0]
        reps.append((t, tp, zone))
        if last:
          zones.add(zone)
        residual -= tp
        if not last and residual < 0:
          break
        placed += 1
      if placed != n:
        return None
      if not last and zi < len(zones_r):
        left[zones_r[zi][0]][t] = max(residual, 0)
      comp += placed * tp * self.price_s[t]
    new_res = dict(resources)
    new_res[region] = tuple((z, tuple(left[z])) for z, _ in zones_r)
    return reps, all_tp, zones, comp, new_res

  def combos(self, limits, D: int):
    """``generate_all_combos_new``: replicas per GPU type summing to ``D``, earlier types
    counted up from 0."""
    def rec(i, d):
      mx = min(d, limits[i])
      if i == len(limits) - 1:
        return [[mx]] if mx == d else []
      out = []
      for n in range(mx + 1):
        out += [[n] + r for r in rec(i + 1, d - n)]
      return out
    return rec(0, D)

  # -- the dynamic program (``solve_dp``, Listing 1)
  def solve(self, mbs, pp, D, i, region_i, key, regions, resources, budget_str, stages, tps):
    a0 = stages[i][0]
    mk = (mbs, pp, a0, D, key, budget_str)   # Sailor's memo key (no P, no tensor degrees)
    if mk in self.memo:
      return self.memo[mk]
    self.memo[mk] = None
    region = regions[region_i]
    T = len(self.types)
    limits = [sum(c[t] // tps[t][i] for _, c in resources[region] if c[t] > 0)
              if tps[t] else 0 for t in range(T)]
    budget = float(budget_str)
    tp_of = [tps[t][i] if tps[t] else 0 for t in range(T)]
    best = None
    if pp == 1:
      prev_T, prev_cost = 1e6, 1e6
      for combo in self.combos(limits, D):
        got = self.place(region, resources, combo, tp_of, last=True)
        if got is None:
          continue
        reps, all_tp, zones, comp, _ = got
        info = self.single(stages[i], all_tp, zones, mbs, D)
        if info is None:
          continue
        cost = info["Tpp"] * comp + info["ar_fee"]
        if self.throughput:
          if info["Tpp"] < prev_T and (budget == 0.0 or cost <= budget):
            best, prev_T = (info["Tpp"], info["ar_fee"], comp, info, (tuple(reps),)), info["Tpp"]
        else:
          if cost <= prev_cost and (self.max_iter_time == 0.0
                                    or info["Tpp"] <= self.max_iter_time):
            best, prev_cost = (info["Tpp"], info["ar_fee"], comp, info, (tuple(reps),)), cost
    else:
      best_T, prev = 1e6, 1e6
      for combo in self.combos(limits, D):
        next_i = region_i
        got = self.place(region, resources, combo, tp_of, last=False)
        if got is None:
          continue
        reps, all_tp, zones, comp, new_res = got
        next_max = sum(c[t] // tps[t][i + 1] for _, c in new_res[region] for t in range(T)
                       if tps[t] and tps[t][i + 1])
        counts = [sum(c[t] for _, c in new_res[region]) for t in range(T)]
        nreg = region
        if next_max < D:
          next_i += 1   # the pipeline moves on to the next region, once
          if next_i >= len(regions):
            continue
          nreg = regions[next_i]
          counts = [sum(c[t] for _, c in resources[nreg]) for t in range(T)]
        info = self.single(stages[i], all_tp, zones, mbs, D)
        if info is None:
          continue
        cost = info["Tpp"] * comp + info["ar_fee"]
        # Sailor: a non-last stage passes only under the throughput objective.
        if not (self.throughput and (budget == 0.0 or cost <= budget)):
          continue
        if info["Tpp"] == prev:
          continue   # Sailor: skips a combination whose stage time equals the previous one
        prev = info["Tpp"]
        remaining = f"{max(budget - cost, 0.0):.2f}"
        rest = self.solve(mbs, pp - 1, D, i + 1, next_i, ("stage", nreg, tuple(counts)),
                          regions, new_res, remaining, stages, tps)
        if rest is None:
          continue
        merged, pp_fee = self.merge(info, rest[3], stages[i], reps, rest[4][0], mbs, D)
        fees = pp_fee + info["ar_fee"] + rest[1]
        comp_all = comp + rest[2]
        # Sailor: the budget test here sees the fees alone (its time term is still 0).
        if budget != 0.0 and fees > budget:
          continue
        if merged["Tpp"] < best_T:
          best_T = merged["Tpp"]
          best = (merged["Tpp"], fees, comp_all, merged, (tuple(reps),) + rest[4])
    self.memo[mk] = best
    return best

  def run(self, max_stages=None, microbatches=None):
    mbs_all = sorted({m for g in self.types for m in self.m.times[g]})
    if microbatches is not None:
      mbs_all = [m for m in mbs_all if m in set(microbatches)]
    dps = {}
    for mbs in mbs_all:
      cur, ds = math.ceil(self.G / mbs), [1]
      for d in range(2, self.total_gpus):
        n = math.ceil(self.G / (mbs * d))
        if n != cur:
          ds.append(d)
          cur = n
      dps[mbs] = ds[::-1] if self.throughput else ds
    budget_str = f"{self.budget:.2f}"
    configs = []
    for P in range(1, min(self.L, max_stages or self.L) + 1):
      stages = sailor_stages(self.L, P)
      for mbs in mbs_all:
        tps = self.tp_degrees(mbs, stages)
        for key, regions in self.region_lists(tps):
          prev_T, prev_cost = 1e6, 1000.0
          in_budget = in_time = False
          for D in dps[mbs]:
            got = self.solve(mbs, P, D, 0, 0, ("combo",) + key, list(regions),
                             self.resources, budget_str, stages, tps)
            if got is None:
              continue
            Tpp, fees, comp, _, reps = got
            cost = fees + comp * Tpp
            if self.throughput:
              if prev_T > Tpp:
                if self.budget == 0.0:
                  prev_T = Tpp
                elif cost < self.budget:
                  prev_T, in_budget = Tpp, True
              elif self.budget == 0.0 or in_budget:
                break   # H3
            else:
              if prev_cost > cost:
                if self.max_iter_time == 0.0:
                  prev_cost = cost
                elif Tpp <= self.max_iter_time:
                  prev_cost, in_time = cost, True
              elif self.max_iter_time == 0.0 or in_time:
                break   # H4
            configs.append((Tpp, cost, fees, comp, mbs, D, tuple(stages), reps))
    if self.throughput:
      if self.budget > 0.0:
        configs = [c for c in configs if c[1] < self.budget]
      configs.sort(key=lambda c: c[0])
    else:
      if self.max_iter_time > 0.0:
        configs = [c for c in configs if c[0] < self.max_iter_time]
      configs.sort(key=lambda c: c[1])
    return configs


def sailor_plan(model: SailorModel, pools: Sequence[Pool], *, objective: str = "min_time",
                budget_per_iteration: float | None = None, time_limit_s: float | None = None,
                network: SailorNetwork | None = None, max_stages: int | None = None,
                microbatches: Sequence[int] | None = None, score: bool = True) -> SailorPlan:
  """The plan Sailor's planner picks for ``pools`` (see the module doc), scored by
  :func:`score_plan` where it is one of our plans.

  Args:
    objective: ``"min_time"``, ``"min_time_within_budget"`` (with ``budget_per_iteration``,
      USD per iteration, fees included: Sailor's form), ``"max_throughput_per_dollar"`` or
      ``"min_cost_within_time"`` (with ``time_limit_s``, seconds per iteration by Sailor's
      estimate).
    network: Sailor's links and fees (default :func:`load_network`).
    max_stages, microbatches: restrict the pipeline degrees and replica microbatches tried.
    score: also score the plan with our simulator.

  Raises:
    PlanError: unknown objective, missing bound, or no configuration.
  """
  modes = {"min_time": "throughput", "min_time_within_budget": "throughput",
           "max_throughput_per_dollar": "cost", "min_cost_within_time": "cost"}
  if objective not in modes:
    raise PlanError(f"objective {objective!r} not supported by the Sailor baseline; choose one "
                    f"of {tuple(modes)}")
  if objective == "min_time_within_budget" and budget_per_iteration is None:
    raise PlanError("min_time_within_budget needs budget_per_iteration (USD per iteration)")
  if objective == "min_cost_within_time" and time_limit_s is None:
    raise PlanError("min_cost_within_time needs time_limit_s")
  start = time.perf_counter()
  search = _Search(model, pools, network or load_network(), modes[objective],
                   float(budget_per_iteration or 0.0), float(time_limit_s or 0.0))
  configs = search.run(max_stages, microbatches)
  if not configs:
    raise PlanError(f"Sailor's search finds no configuration on {len(pools)} pools "
                    f"({objective}, budget {budget_per_iteration}, time {time_limit_s})")
  Tpp, cost, fees, comp, mbs, D, stages, reps = configs[0]
  types = search.types
  plan = SailorPlan(
      mbs=mbs, dp=D, num_microbatches=math.ceil(model.global_batch / (mbs * D)),
      layers=tuple(stages),
      replicas=tuple(tuple((types[t], tp, z) for t, tp, z in r) for r in reps),
      estimate_s=Tpp, compute_usd_per_s=comp, fees_usd=fees, candidates=len(configs))
  if score:
    plan = score_plan(model, pools, plan)
  return dataclasses.replace(plan, seconds=time.perf_counter() - start)


# --------------------------------------------------------------------------- our simulator


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


def plan_quads(pools: Sequence[Pool], plan: SailorPlan, tables: CostTables):
  """The plan as ``(first, last, pool, submesh)`` per stage, or ``None`` when a stage's
  replicas mix GPU types, tensor degrees or zones (not one of our plans)."""
  quads, entries = [], []
  for (a, z), reps in zip(plan.layers, plan.replicas):
    if len(set(reps)) != 1:
      return None, None
    gpu, tp, zone = reps[0]
    ks = [k for k, p in enumerate(pools) if p.gpu == gpu and p.zone == zone]
    if not ks:
      return None, None
    s = stage_entry(tables, pools, ks[0], plan.dp, tp)
    if s is None:
      return None, None
    quads.append((a, z, ks[0], s))
    entries.append((a, z, ks[0], s, plan.dp, tp))
  return tuple(quads), entries


def score_plan(model: SailorModel, pools: Sequence[Pool], plan: SailorPlan,
               tables: CostTables | None = None) -> SailorPlan:
  """Scores a Sailor plan with our simulator on the common tables (its stages' entries at its
  own logical meshes): 1F1B (``evaluation``) and H-1F1B (``h1f1b``); unchanged when the plan
  is not one of ours (see :func:`plan_quads`)."""
  if tables is None:
    tables = sailor_tables(model, pools, plan.microbatch)
  quads, entries = plan_quads(pools, plan, tables)
  if quads is None:
    return plan
  forced = _forced(model, pools, tables, plan.microbatch, entries)
  B = plan.num_microbatches
  ev = evaluate_plan(forced, quads, B, "1f1b")
  h1 = evaluate_plan(forced, quads, B, "h1f1b")
  return dataclasses.replace(plan, evaluation=ev, h1f1b=h1, quads=quads)


def transfer_fees_usd(pools: Sequence[Pool], stages, boundary_bytes, num_microbatches: int,
                      network: SailorNetwork) -> float:
  """Data-transfer fees per iteration of one of our plans, counted as Sailor counts them and
  as our evaluation does (:func:`~harpjax.compiler.profile.plan_transfer`): every cut sends
  its boundary bytes forward and the gradient back once per microbatch, at the fee between
  the two pools' zones. Our stages sit in one pool (one zone), so their data-parallel syncs
  cost no fee.

  Args:
    stages: ``(first, last, pool)`` per stage.
    boundary_bytes: ``[L]`` bytes a cut after each layer carries per microbatch.
  """
  names = tuple(p.name for p in pools)
  return cuts_transfer(pool_fees(pools, network), names, boundary_bytes,
                       [(j, k) for _, j, k in stages], num_microbatches).fee_per_iteration
