"""HARP's inter-op planner: the DP of Eq. 13-19 over every candidate ``t_max`` (§5.2).

:func:`solve` takes :class:`~harpjax.compiler.cost_tables.CostTables` and the number of
microbatches ``B`` and returns the plan minimising Eq. 12,
``sum_i (t_i + 2 c_i) + (B - 1) max_i t_i``, over plans that place stages in subcluster order,
use every device, keep each stage's submesh inside one subcluster (packed onto its hosts,
:func:`device_states`), satisfy ``C(j) <= t_max``
and fit memory with the H-1F1B warm-up counts their own bottleneck implies
(``mem_p + min(N_i, B) mem_a <= mem_device``). The DP for one candidate lives in
:mod:`harpjax.compiler._dp_kernels` (state and exactness argument there).

The search over ``t_max`` (§5.2.4):

1. *Sparse index*: the (range, submesh) entries that fit a device with one microbatch in
   flight, grouped by (subcluster, first layer) and sorted by time; at candidate ``tau`` the
   active entries are a prefix of each group.
2. *Candidates*: the sorted unique stage times. *Binary search* for the smallest ``t_S`` at
   which some plan has every stage within it (feasibility is monotone in ``tau``).
3. *Incumbent*: the exact DP (bottleneck exactly ``tau``) from ``t_S`` up until a plan is
   found, objective ``T``. *Drop* every ``tau > T / B`` (the bottleneck stage alone then
   costs ``B tau > T``). Further (exact) pruning: with ``G(tau)``, the cheapest
   ``sum (t_i + 2 c_i)`` of any plan with stages ``<= tau``, non-increasing in ``tau``, a
   candidate needs ``(B - 1) tau + max(G(tau_E), tau) <= T``.
4. *Batched parallel evaluation* of the rest: batches balanced by their number of active
   entries, run sequentially, in local worker processes, or on Ray actors
   (``backend="ray"``); every backend returns the identical plan (ties broken by the smaller
   ``t_max``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import multiprocessing
import os
import threading
import time
from typing import Any, Sequence

import numpy as np

from harpjax.compiler import _dp_kernels
from harpjax.compiler.cost_tables import CostTables
from harpjax.compiler.plan import Plan, StageSpec
from harpjax.compiler.schedules import warmup_delta
from harpjax.errors import InfeasiblePlanError, PlanError, RuntimeFailure

__all__ = ["SolveOptions", "SearchStats", "PlannedStage", "PlanResult", "SparseIndex", "solve",
           "evaluate_plan", "PlanEvaluation", "pack_submeshes", "device_states"]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "sequential", "process", "thread", "ray")


@dataclasses.dataclass(frozen=True)
class SolveOptions:
  """Options of :func:`solve`.

  Attributes:
    eps: H-1F1B tolerance of :func:`~harpjax.compiler.schedules.warmup_delta` (the runtime
      must use the same value; it is recorded in the plan's ``meta``).
    backend: ``"auto"`` (sequential for small searches, else ``"process"``), ``"sequential"``,
      ``"process"`` (local worker processes), ``"thread"`` (threads; the Numba kernel releases
      the GIL) or ``"ray"`` (Ray actors).
    workers: parallel workers (default: CPUs available).
    kernel: ``"numba"`` or ``"numpy"`` (the twin; slow, for cross-checks).
    bound_pruning: apply the exact lower-bound pruning beyond the paper's ``T(t_S) / B``.
    parallel_min_work: ``"auto"`` goes parallel when the candidates left hold at least this
      many active entries in total.
    timeout_s: limit on waiting for a worker or actor, seconds.
    start_method: multiprocessing start method of ``"process"``; default ``"fork"`` when no
      other Python thread runs, else ``"forkserver"`` (a script then needs the usual
      ``if __name__ == "__main__":`` guard).
  """
  eps: float = 0.1
  backend: str = "auto"
  workers: int | None = None
  kernel: str = "numba"
  bound_pruning: bool = True
  parallel_min_work: int = 3_000_000
  timeout_s: float = 3600.0
  start_method: str | None = None

  def __post_init__(self):
    if not (self.eps >= 0 and math.isfinite(self.eps)):
      raise PlanError(f"SolveOptions.eps={self.eps} must be finite and >= 0")
    if self.backend not in BACKENDS:
      raise PlanError(f"SolveOptions.backend={self.backend!r}; choose one of {BACKENDS}")
    if self.kernel not in ("numba", "numpy"):
      raise PlanError(f"SolveOptions.kernel={self.kernel!r}; choose 'numba' or 'numpy'")
    if self.workers is not None and int(self.workers) < 1:
      raise PlanError(f"SolveOptions.workers={self.workers} must be >= 1")


@dataclasses.dataclass(frozen=True)
class SearchStats:
  """What the search did (for logs and benchmarks).

  Attributes:
    num_entries: feasible (range, submesh) entries in the sparse index.
    num_candidates: distinct ``t_max`` candidates.
    t_s, t_e: smallest feasible candidate and the paper's upper cut ``T(t_S) / B``.
    num_window: candidates between the incumbent and ``t_E``.
    num_pruned_by_bound: of those, dropped by the lower bound ``(B-1) tau + G(t_E)``.
    num_evaluated: exact DP runs (incumbent search and window).
    num_feasibility_runs: DP runs of the binary search and the lower bound.
    backend, workers: how the window was evaluated.
    seconds: wall time of :func:`solve`.
  """
  num_entries: int
  num_candidates: int
  t_s: float
  t_e: float
  num_window: int
  num_pruned_by_bound: int
  num_evaluated: int
  num_feasibility_runs: int
  backend: str
  workers: int
  seconds: float


@dataclasses.dataclass(frozen=True)
class PlannedStage:
  """One stage of a planned pipeline, with the numbers behind it.

  Attributes:
    layers: inclusive ``(first, last)`` layer indices.
    subcluster: index ``k`` in the tables' order; ``subcluster_name`` its name.
    submesh_index: ``s``; ``submesh`` its shape ``(n, m)``; ``logical_mesh`` ``(dp, tp)``.
    device_offset: first device of the stage in the DP's numbering (subcluster by subcluster).
    hosts: ``((host, first_device, num_devices), ...)`` inside the subcluster: a packing of
      the subcluster's stages onto its hosts.
    time_s: forward+backward seconds per microbatch ``t_i``.
    comm_s: seconds of the cut after the stage ``c_i`` (0 for the last stage).
    warmup: H-1F1B warm-up count ``N_i``; ``inflight = min(N_i, B)``.
    param_bytes, act_bytes: per device; ``peak_mem_bytes = param + inflight * act``.
    device_memory_bytes: the device's memory.
  """
  layers: tuple[int, int]
  subcluster: int
  subcluster_name: str
  submesh_index: int
  submesh: tuple[int, int]
  logical_mesh: tuple[int, int]
  device_offset: int
  hosts: tuple[tuple[int, int, int], ...]
  time_s: float
  comm_s: float
  warmup: int
  inflight: int
  param_bytes: float
  act_bytes: float
  peak_mem_bytes: float
  device_memory_bytes: float


@dataclasses.dataclass(frozen=True)
class PlanResult:
  """What :func:`solve` returns.

  Attributes:
    plan: the :class:`~harpjax.compiler.plan.Plan` (H-1F1B, warm-ups, ``t_max``, Eq. 12 time).
    objective_s: Eq. 12, ``sum (t_i + 2 c_i) + (B - 1) t_max``, seconds per iteration.
    t_max_s: the plan's bottleneck stage time.
    stages: the :class:`PlannedStage` list.
    warmups: H-1F1B warm-up counts ``N_i`` (from ``t_max_s`` and ``eps``).
    num_microbatches: ``B``.
    eps: the H-1F1B tolerance used.
    stats: :class:`SearchStats`.
  """
  plan: Plan
  objective_s: float
  t_max_s: float
  stages: tuple[PlannedStage, ...]
  warmups: tuple[int, ...]
  num_microbatches: int
  eps: float
  stats: SearchStats

  def table(self) -> str:
    return self.plan.table()


# --------------------------------------------------------------------------- device states


def device_states(tables: CostTables, max_states: int = 200_000
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The DP's device states: what earlier stages took of the subcluster the next one uses.

  Subclusters whose single-host widths divide each other and ``M`` pack any mix of stages
  adding up to at most ``N * M`` devices (first-fit decreasing), so their state is the device
  count and the state id is the paper's GPU offset. For other shapes (``(1, 4)`` on hosts of
  6) the state is the multiset of shapes used so far, kept while it packs onto the hosts and
  can still be completed to fill every device.

  Returns:
    ``st_sub [G]`` (subcluster of each state; state 0 is the empty first subcluster, ``G`` the
    terminal "every device used"), ``st_next [G, S_max]`` (state after a stage on submesh
    ``s``, ``-1`` if it does not fit) and ``st_exh [G, S_max]`` (that stage completes the
    subcluster: its cut uses the link to the next one).

  Raises:
    PlanError: a subcluster with non-dividing widths has more than ``max_states`` states.
  """
  K = tables.num_subclusters
  S_max = max(len(s) for s in tables.submeshes)
  per = []  # per subcluster: (transitions {state: {s: (state' | None for complete)}}, count)
  for k in range(K):
    N, M = tables.num_hosts[k], tables.devices_per_host[k]
    shapes = tables.submeshes[k]
    cap = N * M
    if _is_chain(M, shapes):
      trans = []
      for u in range(cap):
        row = {}
        for s, (n, m) in enumerate(shapes):
          if u + n * m < cap:
            row[s] = u + n * m
          elif u + n * m == cap:
            row[s] = None
        trans.append(row)
      per.append(trans)
      continue
    widths = sorted({m for n, m in shapes if n == 1 and m < M})

    def add(key, shape):
      n, m = shape
      if n > 1 or m == M:
        return (key[0] + n,) + key[1:]
      x = 1 + widths.index(m)
      return key[:x] + (key[x] + 1,) + key[x + 1:]

    def total(key):
      return key[0] * M + sum(c * w for c, w in zip(key[1:], widths))

    @functools.lru_cache(maxsize=None)
    def packs(key):
      items = [w for c, w in zip(key[1:], widths) for _ in range(c)]
      return key[0] <= N and _bin_pack(items, N - key[0], M) is not None

    @functools.lru_cache(maxsize=None)
    def completable(key):
      if not packs(key):
        return False
      if total(key) == cap:
        return True
      return any(total(key) + n * m <= cap and completable(add(key, (n, m)))
                 for n, m in shapes)

    empty = (0,) * (1 + len(widths))
    ids, order = {empty: 0}, [empty]
    trans = []
    while len(trans) < len(order):
      key = order[len(trans)]
      row = {}
      for s, shape in enumerate(shapes):
        nxt = add(key, shape)
        if total(nxt) > cap or not completable(nxt):
          continue
        if total(nxt) == cap:
          row[s] = None
        else:
          if nxt not in ids:
            ids[nxt] = len(order)
            order.append(nxt)
            if len(order) > max_states:
              raise PlanError(
                  f"subcluster {tables.subcluster_names[k]!r}: submeshes {list(shapes)} on "
                  f"{N} hosts of {M} have more than {max_states} packing states; use "
                  "single-host widths that divide each other and M")
          row[s] = ids[nxt]
      trans.append(row)
    per.append(trans)
  starts = np.concatenate([[0], np.cumsum([len(t) for t in per])]).astype(np.int64)
  G = int(starts[-1])
  st_sub = np.empty(G, np.int64)
  st_next = np.full((G, S_max), -1, np.int64)
  st_exh = np.zeros((G, S_max), np.bool_)
  for k, trans in enumerate(per):
    for u, row in enumerate(trans):
      g = starts[k] + u
      st_sub[g] = k
      for s, v in row.items():
        if v is None:
          st_next[g, s] = starts[k + 1]
          st_exh[g, s] = True
        else:
          st_next[g, s] = starts[k] + v
  return st_sub, st_next, st_exh


def _is_chain(M: int, shapes) -> bool:
  widths = sorted({m for n, m in shapes if n == 1} | {M})
  return all(b % a == 0 for a, b in zip(widths, widths[1:]))


def _bin_pack(items: Sequence[int], num_bins: int, capacity: int) -> list[int] | None:
  """Exact bin packing: a bin per item (items taken largest first), or ``None``."""
  order = sorted(range(len(items)), key=lambda x: -items[x])
  free = [capacity] * num_bins
  out = [0] * len(items)

  def place(x):
    if x == len(order):
      return True
    w, seen = items[order[x]], set()
    for b in range(num_bins):
      if free[b] >= w and free[b] not in seen:
        seen.add(free[b])
        free[b] -= w
        out[order[x]] = b
        if place(x + 1):
          return True
        free[b] += w
    return False

  return out if sum(items) <= num_bins * capacity and place(0) else None


# --------------------------------------------------------------------------- sparse index


@dataclasses.dataclass(frozen=True, eq=False)
class SparseIndex:
  """The feasible (range, submesh) entries as flat arrays (the kernels' input).

  Entries of subcluster ``k`` starting at layer ``i`` are ``ptr[k, i] .. ptr[k, i + 1] - 1``,
  sorted by time, so at candidate ``tau`` the active ones are a prefix of each group. ``E``
  entries.

  Attributes:
    num_layers: ``L``.
    offsets: ``[K + 1]`` device offsets.
    st_sub, st_next, st_exh: the device states (:func:`device_states`).
    ptr: ``[K, L + 1]``.
    ent_k, ent_i, ent_j, ent_s, ent_m: ``[E]`` subcluster, first/last layer, submesh index,
      devices.
    ent_t, ent_p, ent_a: ``[E]`` seconds, parameter bytes, activation bytes per microbatch.
    mem: ``[K]`` device memory, bytes.
    c_intra, c_inter: ``[K, L]`` cut costs, seconds.
    candidates: sorted unique ``ent_t``: the ``t_max`` candidates.
    sorted_t: sorted ``ent_t`` (active-entry counts per candidate).
  """
  num_layers: int
  offsets: np.ndarray
  st_sub: np.ndarray
  st_next: np.ndarray
  st_exh: np.ndarray
  ptr: np.ndarray
  ent_k: np.ndarray
  ent_i: np.ndarray
  ent_j: np.ndarray
  ent_s: np.ndarray
  ent_m: np.ndarray
  ent_t: np.ndarray
  ent_p: np.ndarray
  ent_a: np.ndarray
  mem: np.ndarray
  c_intra: np.ndarray
  c_inter: np.ndarray
  candidates: np.ndarray
  sorted_t: np.ndarray

  @classmethod
  def build(cls, tables: CostTables, mem_scale: float = 1.0) -> "SparseIndex":
    """Indexes the entries that fit with one in-flight microbatch (``mem`` scaled)."""
    L, K = tables.num_layers, tables.num_subclusters
    mem = np.asarray(tables.device_memory_bytes, dtype=np.float64) * mem_scale
    cols = {n: [] for n in ("k", "i", "j", "s", "m", "t", "p", "a")}
    for k in range(K):
      t, p, a = tables.stage_time_s[k], tables.param_mem_bytes[k], tables.act_mem_bytes[k]
      ok = np.isfinite(t) & (p + 1.0 * a <= mem[k])
      ok &= np.triu(np.ones((L, L), bool))[:, :, None]
      i, j, s = np.nonzero(ok)
      sizes = np.array([n * m for n, m in tables.submeshes[k]], dtype=np.int64)
      for name, v in (("k", np.full(i.size, k)), ("i", i), ("j", j), ("s", s), ("m", sizes[s]),
                      ("t", t[i, j, s]), ("p", p[i, j, s]), ("a", a[i, j, s])):
        cols[name].append(v)
    c = {n: np.concatenate(v) for n, v in cols.items()}
    order = np.lexsort((c["s"], c["j"], c["t"], c["i"], c["k"]))
    c = {n: np.ascontiguousarray(v[order]) for n, v in c.items()}
    for n in ("k", "i", "j", "s", "m"):
      c[n] = c[n].astype(np.int64)
    keys = c["k"] * (L + 1) + c["i"]
    bounds = np.arange(K)[:, None] * (L + 1) + np.arange(L + 1)[None, :]
    ptr = np.searchsorted(keys, bounds, side="left").astype(np.int64)
    st_sub, st_next, st_exh = device_states(tables)
    return cls(num_layers=L, offsets=tables.device_offsets, st_sub=st_sub, st_next=st_next,
               st_exh=st_exh, ptr=np.ascontiguousarray(ptr),
               ent_k=c["k"], ent_i=c["i"], ent_j=c["j"], ent_s=c["s"], ent_m=c["m"],
               ent_t=c["t"].astype(np.float64), ent_p=c["p"].astype(np.float64),
               ent_a=c["a"].astype(np.float64), mem=mem,
               c_intra=np.ascontiguousarray(tables.intra_comm_s),
               c_inter=np.ascontiguousarray(tables.inter_comm_s),
               candidates=np.unique(c["t"]), sorted_t=np.sort(c["t"]))

  @property
  def num_entries(self) -> int:
    return int(self.ent_t.size)

  def active_entries(self, tau: float) -> int:
    return int(np.searchsorted(self.sorted_t, tau, side="right"))

  def n_cap(self, num_microbatches: int, check_comm: bool = True) -> int:
    """Largest warm-up count a state can need: ``<= B``, ``1 + 3 (S - 1)``, memory."""
    B = int(num_microbatches)
    D = int(self.offsets[-1])
    n = B if not check_comm else min(B, 1 + 3 * (min(self.num_layers, D) - 1))
    if self.num_entries:
      a = self.ent_a
      room = self.mem[self.ent_k] - self.ent_p
      with np.errstate(divide="ignore", invalid="ignore"):
        per = np.where(a > 0, np.floor(room / np.where(a > 0, a, 1.0)) + 1, B)
      n = min(n, int(min(B, per.max())))
    return max(1, n)

  def run(self, tau: float, num_microbatches: int, eps: float, *, require_hit: bool,
          bound: float = math.inf, check_comm: bool = True, kernel: str = "numba",
          n_cap: int | None = None) -> tuple[float, np.ndarray]:
    """Runs the DP at ``tau``; see :func:`harpjax.compiler._dp_kernels.solve_tau`."""
    fn = _dp_kernels.solve_tau if kernel == "numba" else _dp_kernels.solve_tau_numpy
    if n_cap is None:
      n_cap = self.n_cap(num_microbatches, check_comm)
    return fn(tau, num_microbatches, eps, n_cap, require_hit, check_comm, bound,
              self.num_layers, self.st_sub, self.st_next, self.st_exh, self.ptr, self.ent_j,
              self.ent_s, self.ent_t, self.ent_p, self.ent_a, self.mem, self.c_intra,
              self.c_inter)


# --------------------------------------------------------------------------- batch evaluation


def _evaluate_batch(index: SparseIndex, taus: Sequence[int], num_microbatches: int,
                    eps: float, kernel: str, bound: float, sigma_lb: float
                    ) -> tuple[list[tuple[int, float, np.ndarray]], int]:
  """Exact DP at candidates ``taus`` (ascending indices), tightening ``bound`` as it goes.

  Returns:
    ``(candidate index, objective, path)`` for every candidate with a plan within the bound,
    and the number of DP runs.
  """
  B = num_microbatches
  n_cap = index.n_cap(B)
  out, runs = [], 0
  for idx in sorted(taus):
    tau = float(index.candidates[idx])
    if (B - 1) * tau + max(sigma_lb, tau) > bound * (1.0 + _dp_kernels.BOUND_SLACK):
      continue
    runs += 1
    log.debug("planner: DP at t_max=%.6g s (%d active entries), bound %.6g s", tau,
              index.active_entries(tau), bound)
    value, path = index.run(tau, B, eps, require_hit=True, bound=bound, kernel=kernel,
                            n_cap=n_cap)
    if math.isfinite(value):
      obj = value + (B - 1) * tau
      out.append((idx, obj, path))
      bound = min(bound, obj)
  return out, runs


_WORKER_INDEX: dict[str, SparseIndex] = {}  # per worker process: the index it was started with


def _worker_init(index: SparseIndex) -> None:
  _WORKER_INDEX["index"] = index


def _worker_batch(args) -> tuple[list[tuple[int, float, np.ndarray]], int]:
  return _evaluate_batch(_WORKER_INDEX["index"], *args)


class _DPWorker:
  """Plain class; wrapped as a Ray actor at launch (holds the index, evaluates batches)."""

  def __init__(self, index: SparseIndex):
    self._index = index

  def run(self, *args):
    return _evaluate_batch(self._index, *args)


def _balanced_batches(index: SparseIndex, cand: Sequence[int], num_batches: int
                      ) -> list[list[int]]:
  """Longest-processing-time split of candidates by their number of active entries."""
  work = [(index.active_entries(index.candidates[c]), c) for c in cand]
  work.sort(key=lambda x: (-x[0], x[1]))
  batches = [[] for _ in range(max(1, min(num_batches, len(work))))]
  load = [0] * len(batches)
  for w, c in work:
    b = int(np.argmin(load))
    batches[b].append(c)
    load[b] += w
  return [sorted(b) for b in batches if b]


def _default_start_method() -> str:
  """``fork`` (children inherit the compiled kernel, no ``__main__`` guard needed) unless
  other Python threads run (Ray, user code), then ``forkserver``. Native library threads
  (BLAS, XLA) do not matter: the children only run the kernel on NumPy arrays."""
  methods = multiprocessing.get_all_start_methods()
  if "fork" in methods and threading.active_count() == 1:
    return "fork"
  return "forkserver" if "forkserver" in methods else "spawn"


def _run_parallel(index: SparseIndex, batches: list[list[int]], args: tuple, backend: str,
                  workers: int, timeout_s: float, start_method: str | None
                  ) -> tuple[list[tuple[int, float, np.ndarray]], int]:
  outs = []
  if backend in ("thread", "process"):
    if backend == "thread":
      ex = concurrent.futures.ThreadPoolExecutor(workers)
      futs = [ex.submit(_evaluate_batch, index, b, *args) for b in batches]
    else:
      ctx = multiprocessing.get_context(start_method or _default_start_method())
      ex = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx,
                                                  initializer=_worker_init, initargs=(index,))
      futs = [ex.submit(_worker_batch, (b, *args)) for b in batches]
    for n, f in enumerate(futs):
      try:
        outs.append(f.result(timeout=timeout_s))
      except concurrent.futures.TimeoutError:
        ex.shutdown(wait=False, cancel_futures=True)
        raise RuntimeFailure(f"planner {backend} worker on batch {n} of {len(batches)} timed "
                             f"out after {timeout_s} s") from None
    ex.shutdown(wait=True)
  elif backend == "ray":
    import ray  # noqa: PLC0415 - optional, only when asked for
    owned = not ray.is_initialized()
    if owned:
      ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
               configure_logging=False)
    actors = []
    try:
      actor_cls = ray.remote(num_cpus=1)(_DPWorker)
      ref = ray.put(index)
      actors = [actor_cls.remote(ref) for _ in range(min(workers, len(batches)))]
      futs = [actors[n % len(actors)].run.remote(b, *args) for n, b in enumerate(batches)]
      for n, f in enumerate(futs):
        try:
          outs.append(ray.get(f, timeout=timeout_s))
        except ray.exceptions.GetTimeoutError:
          raise RuntimeFailure(f"planner actor {n % len(actors)} (batch {n} of "
                               f"{len(batches)}) timed out after {timeout_s} s") from None
    finally:
      for a in actors:
        ray.kill(a)
      if owned:
        ray.shutdown()
  else:
    raise AssertionError(backend)
  return [r for o in outs for r in o[0]], sum(o[1] for o in outs)


# --------------------------------------------------------------------------- solve


def solve(tables: CostTables, num_microbatches: int, *, options: SolveOptions | None = None,
          **overrides: Any) -> PlanResult:
  """Finds the plan minimising Eq. 12 (HARP §5.2).

  Args:
    tables: the cost tables (subclusters in pipeline order).
    num_microbatches: ``B``.
    options: :class:`SolveOptions`; keyword arguments override its fields
      (``solve(t, 128, backend="ray")``).

  Returns:
    The :class:`PlanResult`: stages (layer range, subcluster, submesh, logical mesh), H-1F1B
    warm-up counts, ``t_max``, the objective and search statistics.

  Raises:
    InfeasiblePlanError: no plan fits; the message names the constraint and by how much
      (its ``constraint`` attribute is ``"memory"``, ``"communication"``, ``"devices"`` or
      ``"layers"``).
  """
  if not isinstance(tables, CostTables):
    raise PlanError(f"solve needs CostTables, got {type(tables).__name__}")
  opts = dataclasses.replace(options or SolveOptions(), **overrides)
  B = int(num_microbatches)
  if B != num_microbatches or B < 1:
    raise PlanError(f"num_microbatches={num_microbatches} must be a positive integer")
  start = time.perf_counter()
  index = SparseIndex.build(tables)
  cand = index.candidates
  M = cand.size
  eps, kernel = opts.eps, opts.kernel
  log.info("planner: %d layers, %d devices, %d feasible entries, %d t_max candidates",
           tables.num_layers, tables.total_devices, index.num_entries, M)

  n_g = [0]

  def g(idx):  # G-feasibility: any plan with every stage <= tau (monotone in tau)
    n_g[0] += 1
    return index.run(float(cand[idx]), B, eps, require_hit=False, kernel=kernel)

  if M == 0 or not math.isfinite(g(M - 1)[0]):
    raise _infeasible(tables, B, eps)
  lo, hi = 0, M - 1
  while lo < hi:
    mid = (lo + hi) // 2
    if math.isfinite(g(mid)[0]):
      hi = mid
    else:
      lo = mid + 1
  t_s_idx = lo
  best = None
  for idx in range(t_s_idx, M):  # usually one step: t_S is a plan's own bottleneck
    tau = float(cand[idx])
    value, path = index.run(tau, B, eps, require_hit=True, kernel=kernel)
    if math.isfinite(value):
      best = (value + (B - 1) * tau, idx, path)
      break
  if best is None:  # every plan within t_max fails at its own bottleneck
    raise _infeasible(tables, B, eps)
  n_incumbent = best[1] - t_s_idx + 1
  bound = best[0]
  slack = 1.0 + _dp_kernels.BOUND_SLACK
  window = [c for c in range(best[1] + 1, M) if B * cand[c] <= bound * slack]
  t_e = float(cand[window[-1]]) if window else float(cand[best[1]])
  sigma_lb = 0.0
  num_window = len(window)
  if opts.bound_pruning and window:
    sigma_lb = g(window[-1])[0]
    window = [c for c in window
              if (B - 1) * cand[c] + max(sigma_lb, cand[c]) <= bound * slack]
  log.info("planner: t_S=%.6g s (candidate %d), incumbent %.6g s, %d candidates up to "
           "t_E=%.6g s, %d left after the lower bound", cand[t_s_idx], t_s_idx, bound,
           num_window, t_e, len(window))
  workers = opts.workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                             else os.cpu_count() or 1)
  backend = opts.backend
  work = sum(index.active_entries(cand[c]) for c in window)
  if backend == "auto":
    backend = "process" if (workers > 1 and len(window) > 1
                            and work >= opts.parallel_min_work) else "sequential"
  args = (B, eps, kernel, bound, sigma_lb)
  if backend == "sequential" or not window:
    results, runs = _evaluate_batch(index, window, *args)
    workers_used = 1
  else:
    batches = _balanced_batches(index, window, workers)
    results, runs = _run_parallel(index, batches, args, backend, workers, opts.timeout_s,
                                  opts.start_method)
    workers_used = min(workers, len(batches))
  for obj, idx, path in [(o, i, p) for i, o, p in results]:
    if (obj, idx) < (best[0], best[1]):
      best = (obj, idx, path)
  objective, idx, path = best
  stats = SearchStats(num_entries=index.num_entries, num_candidates=M, t_s=float(cand[t_s_idx]),
                      t_e=t_e, num_window=num_window,
                      num_pruned_by_bound=num_window - len(window),
                      num_evaluated=runs + n_incumbent, num_feasibility_runs=n_g[0],
                      backend=backend, workers=workers_used,
                      seconds=time.perf_counter() - start)
  result = _assemble(tables, index, path, B, eps, float(cand[idx]), objective, stats)
  log.info("planner: %d stages, t_max=%.6g s, objective %.6g s, %.2f s search (%s)",
           len(result.stages), result.t_max_s, objective, stats.seconds, backend)
  return result


def _assemble(tables: CostTables, index: SparseIndex, path: np.ndarray, B: int, eps: float,
              tau: float, objective: float, stats: SearchStats) -> PlanResult:
  e = np.asarray(path, dtype=np.int64)
  quads = [(int(index.ent_i[x]), int(index.ent_j[x]), int(index.ent_k[x]), int(index.ent_s[x]))
           for x in e]
  ev = evaluate_plan(tables, quads, B, "h1f1b", eps=eps, simulator=False)
  # The DP's own bookkeeping and the evaluator must agree (an internal invariant).
  assert ev.t_max_s == tau, (ev.t_max_s, tau)
  assert ev.feasible and ev.comm_ok and ev.uses_all_devices, ev.violations
  assert math.isclose(ev.eq12_s, objective, rel_tol=1e-9), (ev.eq12_s, objective)
  stages = ev.stages
  specs = tuple(StageSpec(layers=s.layers, subcluster=s.subcluster_name, submesh=s.submesh,
                          logical_mesh=s.logical_mesh, warmup=s.warmup, time_s=s.time_s,
                          comm_s=s.comm_s) for s in stages)
  plan = Plan(stages=specs, num_microbatches=B, schedule="h1f1b", num_layers=tables.num_layers,
              t_max_s=tau, predicted_iteration_s=objective, eta=ev.eta,
              meta={"planner": "harpjax.dp", "eps": eps, "cost_model": "eq12"})
  return PlanResult(plan=plan, objective_s=objective, t_max_s=tau, stages=stages,
                    warmups=ev.warmups, num_microbatches=B, eps=eps, stats=stats)


# --------------------------------------------------------------------------- evaluation


@dataclasses.dataclass(frozen=True)
class PlanEvaluation:
  """A plan scored on cost tables (:func:`evaluate_plan`).

  Attributes:
    schedule: the schedule evaluated.
    num_microbatches: ``B``.
    stages: :class:`PlannedStage` per stage (warm-ups of ``schedule``).
    warmups: warm-up counts ``N_i`` of ``schedule``.
    t_max_s: bottleneck stage time.
    eq12_s: Eq. 12, ``sum (t_i + 2 c_i) + (B - 1) t_max`` (the DP's objective; exact for
      H-1F1B when every cut's communication is hidden).
    steady_period_s: seconds per microbatch in the steady phase:
      ``max(t_max, max_i c_i, max_i (t_i + t_{i+1} + 2 c_i) / (delta_i + 1))`` with
      ``delta_i = min(N_i, B) - min(N_{i+1}, B)`` (the K-block bound of Eq. 7-9 per cut, and
      each link direction carrying one microbatch at a time).
    iteration_s: predicted seconds per iteration: the simulator's when available, else
      ``sum (t_i + 2 c_i) + (B - 1) steady_period_s``.
    model: ``"simulator"`` or ``"analytic"``.
    eta: load-balance score of Eq. 20.
    mem_ok: every stage fits ``mem_p + min(N_i, B) mem_a <= mem_device``.
    comm_ok: every ``c_i <= t_max`` (H-1F1B's condition for Eq. 12).
    devices_ok: no subcluster is over-subscribed and its stages pack onto its hosts.
    uses_all_devices: every device of every subcluster is in some stage.
    violations: human-readable list of what fails.
  """
  schedule: str
  num_microbatches: int
  stages: tuple[PlannedStage, ...]
  warmups: tuple[int, ...]
  t_max_s: float
  eq12_s: float
  steady_period_s: float
  iteration_s: float
  model: str
  eta: float
  mem_ok: bool
  comm_ok: bool
  devices_ok: bool
  uses_all_devices: bool
  violations: tuple[str, ...]

  @property
  def feasible(self) -> bool:
    """Runs without running out of memory on the devices it claims."""
    return self.mem_ok and self.devices_ok


def _resolve_stages(tables: CostTables, stages) -> list[tuple[int, int, int, int]]:
  if isinstance(stages, Plan):
    stages = stages.stages
  out = []
  for st in stages:
    if isinstance(st, StageSpec):
      k = tables.subcluster_index(st.subcluster)
      out.append((st.layers[0], st.layers[1], k, tables.submesh_index(k, st.submesh)))
    elif isinstance(st, PlannedStage):
      out.append((st.layers[0], st.layers[1], st.subcluster, st.submesh_index))
    else:
      i, j, k, s = st
      k = tables.subcluster_index(k)
      if not 0 <= int(s) < len(tables.submeshes[k]):
        raise PlanError(f"stage {st}: submesh index {s} out of range")
      out.append((int(i), int(j), k, int(s)))
  if not out:
    raise PlanError("a plan needs at least one stage")
  if out[0][0] != 0 or out[-1][1] != tables.num_layers - 1 or any(
      b[0] != a[1] + 1 for a, b in zip(out, out[1:])) or any(i > j for i, j, _, _ in out):
    raise PlanError(f"stage layer ranges {[(i, j) for i, j, _, _ in out]} must cover layers "
                    f"0..{tables.num_layers - 1} contiguously")
  for a, b in zip(out, out[1:]):
    if b[2] not in (a[2], a[2] + 1):
      raise PlanError(f"stage on layers {b[:2]} is on subcluster {b[2]} right after one on "
                      f"subcluster {a[2]}: stages follow the tables' subcluster order "
                      "without skipping (only links between consecutive subclusters are known)")
  return out


def pack_submeshes(num_hosts: int, devices_per_host: int, shapes: Sequence[tuple[int, int]]
                   ) -> list[tuple[tuple[int, int, int], ...]] | None:
  """Places submeshes on the hosts of one subcluster (exactly: ``None`` only if impossible).

  Multi-host shapes ``(n, M)`` and ``(1, M)`` take whole hosts; the others are bin-packed.

  Returns:
    Per shape ``((host, first_device, num_devices), ...)``, or ``None`` if they do not fit.
  """
  M = devices_per_host
  out: list = [None] * len(shapes)
  host = 0
  for idx, (n, m) in enumerate(shapes):
    if n > 1 or m == M:
      if host + n > num_hosts:
        return None
      out[idx] = tuple((h, 0, m) for h in range(host, host + n))
      host += n
  small = [x for x in range(len(shapes)) if out[x] is None]
  bins = _bin_pack([shapes[x][1] for x in small], num_hosts - host, M)
  if bins is None:
    return None
  fill = [0] * num_hosts
  for x, b in zip(small, bins):
    h = host + b
    out[x] = ((h, fill[h], shapes[x][1]),)
    fill[h] += shapes[x][1]
  return out


def evaluate_plan(tables: CostTables, stages, num_microbatches: int, schedule: str = "h1f1b",
                  *, eps: float = 0.1, simulator: bool | None = None,
                  fwd_fraction: float = 1.0 / 3.0) -> PlanEvaluation:
  """Scores a plan on cost tables: Eq. 12, steady period, memory, links, packing.

  Args:
    tables: the cost tables.
    stages: a :class:`~harpjax.compiler.plan.Plan`, its :class:`StageSpec` list, a
      :class:`PlannedStage` list, or tuples ``(first_layer, last_layer, subcluster, submesh
      index)`` (subcluster by index or name).
    num_microbatches: ``B``.
    schedule: ``"h1f1b"``, ``"1f1b"``, ``"eager_1f1b"`` or ``"gpipe"``.
    eps: H-1F1B tolerance.
    simulator: use ``harpjax.compiler.simulator.simulate`` for ``iteration_s``: ``None`` if
      importable, ``True`` required, ``False`` never.
    fwd_fraction: share of a stage's time spent in the forward pass (for the simulator).

  Returns:
    The :class:`PlanEvaluation`.

  Raises:
    PlanError: the stages do not cover the layers contiguously or skip a subcluster.
  """
  B = int(num_microbatches)
  quads = _resolve_stages(tables, stages)
  S = len(quads)
  key = schedule.lower().replace("-", "_")
  t = [float(tables.stage_time_s[k][i, j, s]) for i, j, k, s in quads]
  c = []
  for a, b in zip(quads, quads[1:]):
    c.append(float(tables.intra_comm_s[a[2], a[1]] if b[2] == a[2]
                   else tables.inter_comm_s[a[2], a[1]]))
  c.append(0.0)
  t_max = max(t)
  violations = []
  if not math.isfinite(t_max):
    bad = [q for q, x in zip(quads, t) if not math.isfinite(x)]
    violations.append(f"stages {bad} have no finite time in the tables")
  if key == "h1f1b":
    # h1f1b_warmups's counts, without its warning for links slower than t_max (reported here).
    warm = [1]
    for x in reversed(c[:-1]):
      warm.append(warm[-1] + (warmup_delta(x, t_max, eps) if math.isfinite(t_max) else 1))
    warm = tuple(reversed(warm))
  elif key == "1f1b":
    warm = tuple(S - x for x in range(S))
  elif key == "eager_1f1b":
    warm = tuple(2 * (S - 1 - x) + 1 for x in range(S))
  elif key == "gpipe":
    warm = (B,) * S
  else:
    raise PlanError(f"unknown schedule {schedule!r}")
  inflight = [min(w, B) for w in warm]
  # Devices: over-subscription and packing per subcluster.
  devices_ok, uses_all = True, True
  hosts: dict[int, tuple] = {}
  for k in range(tables.num_subclusters):
    mine = [x for x, q in enumerate(quads) if q[2] == k]
    shapes = [tables.submeshes[k][quads[x][3]] for x in mine]
    used = sum(n * m for n, m in shapes)
    uses_all &= used == tables.subcluster_devices[k]
    packed = pack_submeshes(tables.num_hosts[k], tables.devices_per_host[k], shapes)
    if packed is None:
      devices_ok = False
      violations.append(f"subcluster {tables.subcluster_names[k]!r}: submeshes {shapes} "
                        f"({used} devices) do not pack onto {tables.num_hosts[k]} hosts of "
                        f"{tables.devices_per_host[k]}")
    else:
      hosts.update(zip(mine, packed))
  mem_ok = True
  planned, offset = [], 0
  for x, (i, j, k, s) in enumerate(quads):
    p = float(tables.param_mem_bytes[k][i, j, s])
    a = float(tables.act_mem_bytes[k][i, j, s])
    peak = p + inflight[x] * a
    dev_mem = tables.device_memory_bytes[k]
    if not peak <= dev_mem:
      mem_ok = False
      violations.append(
          f"stage {x} (layers {i}..{j}, {tables.subcluster_names[k]} {tables.submeshes[k][s]}) "
          f"needs {peak / 2**30:.3f} GiB ({p / 2**30:.3f} GiB parameters + {inflight[x]} x "
          f"{a / 2**30:.3f} GiB activations) > {dev_mem / 2**30:.3f} GiB device memory")
    n, m = tables.submeshes[k][s]
    offset = max(offset, int(tables.device_offsets[k]))
    planned.append(PlannedStage(
        layers=(i, j), subcluster=k, subcluster_name=tables.subcluster_names[k],
        submesh_index=s, submesh=(n, m), logical_mesh=tables.logical_mesh_of(k, i, j, s),
        device_offset=offset, hosts=hosts.get(x, ()), time_s=t[x], comm_s=c[x],
        warmup=int(warm[x]), inflight=int(inflight[x]), param_bytes=p, act_bytes=a,
        peak_mem_bytes=peak, device_memory_bytes=dev_mem))
    offset += n * m
  comm_ok = all(x <= t_max for x in c)
  if not comm_ok:
    worst = int(np.argmax(c))
    violations.append(f"cut after stage {worst} takes {c[worst]:.6g} s > t_max {t_max:.6g} s")
  head = sum(x + 2.0 * y for x, y in zip(t, c))
  eq12 = head + (B - 1) * t_max
  period = max(t_max, max(c))  # a link sends one microbatch per direction at a time
  for x in range(S - 1):
    delta = inflight[x] - inflight[x + 1]
    if delta >= 1:
      period = max(period, (t[x] + t[x + 1] + 2.0 * c[x]) / (delta + 1))
  iteration, model = head + (B - 1) * period, "analytic"
  if simulator is not False and math.isfinite(t_max):
    sim = _simulate(t, c, key, B, warm, fwd_fraction, required=bool(simulator))
    if sim is not None:
      iteration, model = sim, "simulator"
  return PlanEvaluation(schedule=key, num_microbatches=B, stages=tuple(planned),
                        warmups=tuple(int(w) for w in warm), t_max_s=t_max, eq12_s=eq12,
                        steady_period_s=period, iteration_s=iteration, model=model,
                        eta=_eta(tables, planned, t_max), mem_ok=mem_ok, comm_ok=comm_ok,
                        devices_ok=devices_ok, uses_all_devices=uses_all,
                        violations=tuple(violations))


def _eta(tables: CostTables, stages: Sequence[PlannedStage], t_max: float) -> float:
  """Eq. 20: ``1 - sum_d (t_max - t_d) F_d / (t_max sum_d F_d)`` over devices ``d``."""
  if not (math.isfinite(t_max) and t_max > 0):
    return 0.0
  num = den = 0.0
  for s in stages:
    flops = tables.peak_flops[s.subcluster] if tables.peak_flops else 1.0
    devs = s.submesh[0] * s.submesh[1]
    num += devs * (t_max - s.time_s) * flops
    den += devs * t_max * flops
  return 1.0 - num / den


_SIM_WARNED: list[bool] = []


def _simulate(t, c, schedule, B, warmups, fwd_fraction: float, required: bool) -> float | None:
  """Iteration time from ``harpjax.compiler.simulator`` if it is there (optional, lazy)."""
  try:
    from harpjax.compiler import simulator  # noqa: PLC0415 - optional, written separately
    from harpjax.compiler.schedules import make_schedule  # noqa: PLC0415
  except ImportError:
    if required:
      raise
    return None
  fwd = [x * fwd_fraction for x in t]
  bwd = [x - f for x, f in zip(t, fwd)]
  try:
    sched = make_schedule(schedule, len(t), B, warmups if schedule == "h1f1b" else None)
    return float(simulator.simulate(fwd, bwd, list(c[:-1]), sched).iteration_time)
  except Exception as e:  # noqa: BLE001 - its API may still move; fall back, loudly
    if required:
      raise
    if not _SIM_WARNED:
      _SIM_WARNED.append(True)
      log.warning("simulator unusable (%s: %s); using the analytic model", type(e).__name__, e)
    return None


# --------------------------------------------------------------------------- infeasibility


def _infeasible(tables: CostTables, B: int, eps: float) -> InfeasiblePlanError:
  """Says which constraint makes every plan infeasible, and by how much."""
  constraint, msg = _diagnose(tables, B, eps)
  err = InfeasiblePlanError(f"no pipeline plan for {tables.describe()} with B={B}: {msg}")
  err.constraint = constraint
  return err


def _diagnose(tables: CostTables, B: int, eps: float) -> tuple[str, str]:
  L, K = tables.num_layers, tables.num_subclusters
  gib = 2.0 ** 30
  if L < K:
    return "layers", (f"every subcluster needs at least one stage (all devices are used), but "
                      f"there are {L} layers for {K} subclusters")
  index = SparseIndex.build(tables)
  for k in range(K):
    if not (index.ent_k == k).any():
      best = (math.inf, None)
      for s in range(len(tables.submeshes[k])):
        fp = tables.param_mem_bytes[k][:, :, s] + tables.act_mem_bytes[k][:, :, s]
        fp = np.where(np.isfinite(tables.stage_time_s[k][:, :, s]), fp, np.inf)
        i, j = np.unravel_index(np.argmin(fp), fp.shape)
        if fp[i, j] < best[0]:
          best = (float(fp[i, j]), (int(i), int(j), tables.submeshes[k][s]))
      mem = tables.device_memory_bytes[k]
      if best[1] is None:
        return "devices", f"subcluster {tables.subcluster_names[k]!r} has no finite stage time"
      return "memory", (
          f"subcluster {tables.subcluster_names[k]!r} cannot hold any stage: the smallest, "
          f"layers {best[1][0]}..{best[1][1]} on {best[1][2]}, needs {best[0] / gib:.3f} GiB "
          f"per device with one microbatch in flight, {(best[0] - mem) / gib:.3f} GiB more "
          f"than the {mem / gib:.3f} GiB device")
  free = SparseIndex.build(tables, mem_scale=math.inf)
  top = float(free.candidates[-1])
  if not math.isfinite(free.run(top, B, eps, require_hit=False)[0]):
    value, path = free.run(top, B, eps, require_hit=False, check_comm=False)
    if not math.isfinite(value):
      return "devices", (f"the {L} layers cannot be cut into stages that use all "
                         f"{tables.total_devices} devices in subcluster order "
                         f"{list(tables.subcluster_names)} with finite stage times")
    quads = [(int(free.ent_i[e]), int(free.ent_j[e]), int(free.ent_k[e]), int(free.ent_s[e]))
             for e in path]
    ev = evaluate_plan(tables, quads, B, eps=eps, simulator=False)
    x = int(np.argmax([s.comm_s for s in ev.stages]))
    st = ev.stages[x]
    return "communication", (
        f"every plan has a cut slower than its bottleneck stage (H-1F1B needs C(j) <= t_max). "
        f"The best plan without that rule cuts after layer {st.layers[1]} "
        f"({tables.boundary_bytes[st.layers[1]]:.4g} bytes) in {st.comm_s:.6g} s while its "
        f"t_max is {ev.t_max_s:.6g} s: {st.comm_s / ev.t_max_s:.3f}x too slow")
  def fits(scale):
    idx = SparseIndex.build(tables, mem_scale=scale)
    if idx.num_entries == 0:
      return None
    value, path = idx.run(float(idx.candidates[-1]), B, eps, require_hit=False)
    return (idx, path) if math.isfinite(value) else None
  if fits(1.0) is not None:
    msg = ("plans exist whose stages all stay within some t_max, but none stays valid when "
           "t_max is its own bottleneck (more warm-ups: memory; smaller t_max: C(j) <= t_max)")
    top = float(index.candidates[-1])
    worst_link = max(range(K - 1), key=lambda k: tables.inter_comm_s[k, :L - 1].min(),
                     default=None)
    if worst_link is None:
      return "memory", msg
    j = int(np.argmin(tables.inter_comm_s[worst_link, :L - 1]))
    c = float(tables.inter_comm_s[worst_link, j])
    msg += (f". Every plan crosses from {tables.subcluster_names[worst_link]!r} to "
            f"{tables.subcluster_names[worst_link + 1]!r} once; the cheapest such cut (after "
            f"layer {j}) takes {c:.6g} s, so t_max >= {c:.6g} s, while the slowest stage that "
            f"fits takes {top:.6g} s")
    return ("communication" if c > 0.5 * top else "memory"), msg
  lo, hi = 1.0, 2.0
  while fits(hi) is None and hi < 2.0 ** 30:
    lo, hi = hi, hi * 2
  for _ in range(40):
    mid = 0.5 * (lo + hi)
    if fits(mid) is None:
      lo = mid
    else:
      hi = mid
    if hi / lo < 1 + 1e-4:
      break
  idx, path = fits(hi)
  quads = [(int(idx.ent_i[e]), int(idx.ent_j[e]), int(idx.ent_k[e]), int(idx.ent_s[e]))
           for e in path]
  ev = evaluate_plan(tables, quads, B, eps=eps, simulator=False)
  worst = max(ev.stages, key=lambda s: s.peak_mem_bytes / s.device_memory_bytes)
  return "memory", (
      f"no plan fits device memory with the H-1F1B warm-ups of its own bottleneck; the plans "
      f"that come closest need {hi:.4f}x the device memory: e.g. layers "
      f"{worst.layers[0]}..{worst.layers[1]} on {worst.subcluster_name} {worst.submesh} with "
      f"{worst.inflight} microbatches in flight need {worst.peak_mem_bytes / gib:.3f} GiB, "
      f"{(worst.peak_mem_bytes - worst.device_memory_bytes) / gib:.3f} GiB more than the "
      f"{worst.device_memory_bytes / gib:.3f} GiB device")
