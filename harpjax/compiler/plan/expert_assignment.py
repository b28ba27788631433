"""Asymmetric expert assignment of a zebra stage (HeterMoE §4.2): which experts run on the
attention GPUs, per layer.

A zebra stage (:mod:`harpjax.compiler.schedule.zebra`) puts the ``n`` experts of each layer on
its ``N`` expert GPUs, ``n / N`` each. When the expert GPUs are the bottleneck the attention
GPUs wait; moving ``o_l`` experts of each expert GPU's share of layer ``l`` onto the ``M``
attention GPUs (``N o_l / M`` each) takes ``o_l / (n / N)`` of the expert GPUs' work off them
and adds it, at the attention GPUs' speed, to the attention GPUs (an ``X`` task after the
layer's attention). Tokens are dispatched unevenly: the fraction ``N o_l / n`` of the routed
tokens goes to the attention GPUs.

``o_l`` moves in *chunks*: every attention GPU must take a whole number of experts, so ``o_l``
is a multiple of ``n2 = M / gcd(M, N)`` and each attention GPU takes ``n1 = N n2 / M`` per
chunk (the paper's ``n1 = max(1, N / M)``, ``n2 = n1 M / N`` when one of ``M``, ``N`` divides
the other, which the paper requires).

Three optimizers, all scored by the same simulator:

* :func:`gather_and_squeeze`: the paper's Algorithm 1 (with its memory coefficients ``alpha``,
  ``beta``), from forward times alone;
* :func:`local_search`: from any start (default Algorithm 1), moves of one chunk in one layer
  or of one chunk between two layers, while the simulated iteration gets shorter;
* :func:`exhaustive_assignment`: every assignment (small instances), simulated unless a lower
  bound shows it slower than the best found.

The simulator is :func:`~harpjax.compiler.schedule.zebra.theorem1_iteration_time` (one
assignment) or :func:`~harpjax.compiler.schedule.zebra.theorem1_iteration_times` (a batch, one
kernel call), equal to ``simulate_zebra`` of :meth:`ExpertAssignmentProblem.costs`.

Tested in ``tests/compiler/plan/test_expert_assignment.py``; figures in docs/moe.md.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
from typing import Sequence

import numpy as np

from harpjax.cluster import Link
from harpjax.compiler.schedule import (bipartite_all_to_all_time_s, theorem1_iteration_time,
                                       theorem1_iteration_times, ZebraCosts)
from harpjax.errors import PlanError

log = logging.getLogger(__name__)

__all__ = ["ExpertAssignmentProblem", "AssignmentResult", "gather_and_squeeze",
           "local_search", "exhaustive_assignment", "optimize_assignment", "repair_assignment"]


def _per_layer(name: str, value, n: int) -> tuple[float, ...]:
  arr = np.asarray(value, dtype=np.float64)
  if arr.ndim == 0:
    arr = np.full(n, float(arr))
  if arr.shape != (n,) or not np.all(np.isfinite(arr)) or np.any(arr < 0):
    raise PlanError(f"ExpertAssignmentProblem.{name}: expected {n} finite seconds >= 0, "
                    f"got {np.asarray(value).tolist()}")
  return tuple(float(x) for x in arr)


@dataclasses.dataclass(frozen=True)
class ExpertAssignmentProblem:
  """A zebra stage whose expert assignment is to be chosen (times per microbatch, seconds).

  Attributes:
    num_experts: ``n`` experts per layer.
    num_attn: ``M`` attention GPUs.
    num_expert: ``N`` expert GPUs (must divide ``n``).
    num_microbatches: ``R``.
    attn_fwd_s, attn_bwd_s: ``[L + 1]`` attention side on an attention GPU (``T_A^Attn``;
      entry ``L``: the stage's tail).
    expert_fwd_s, expert_bwd_s: ``[L]`` an expert GPU's share (``n / N`` experts' tokens) on
      an expert GPU (``T_E^Exp``).
    expert_on_attn_fwd_s, expert_on_attn_bwd_s: ``[L]`` the same tokens on an attention GPU
      (``T_E^Attn``).
    routed_bytes: ``[L]`` bytes of routed token copies of one microbatch (all attention GPUs
      together: ``tokens * top_k * hidden * dtype bytes``); ``0``: communication is free.
    link: every GPU's link (all-to-all cost: :func:`~harpjax.compiler.schedule.zebra.
      bipartite_all_to_all_time_s`); ``None`` with ``routed_bytes = 0``.
    min_offload: ``n_min``, the fewest experts per expert GPU, summed over layers, that must
      move (the expert GPUs' memory); ``0``: none.
    max_offload: ``n_max``, the most that may (the attention GPUs' memory); ``None``: all.
  """
  num_experts: int
  num_attn: int
  num_expert: int
  num_microbatches: int
  attn_fwd_s: Sequence[float]
  attn_bwd_s: Sequence[float]
  expert_fwd_s: Sequence[float]
  expert_bwd_s: Sequence[float]
  expert_on_attn_fwd_s: Sequence[float]
  expert_on_attn_bwd_s: Sequence[float]
  routed_bytes: Sequence[float] = 0.0
  link: Link | None = None
  min_offload: int = 0
  max_offload: int | None = None

  def __post_init__(self):
    for name in ("num_experts", "num_attn", "num_expert", "num_microbatches"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise PlanError(f"ExpertAssignmentProblem.{name}={v!r}: must be an integer >= 1")
    if self.num_experts % self.num_expert:
      raise PlanError(f"ExpertAssignmentProblem: num_expert={self.num_expert} expert GPUs must "
                      f"divide num_experts={self.num_experts}; choose a divisor")
    L = len(self.expert_fwd_s)
    if L < 1:
      raise PlanError("ExpertAssignmentProblem: needs at least one layer (expert_fwd_s)")
    for name in ("attn_fwd_s", "attn_bwd_s"):
      object.__setattr__(self, name, _per_layer(name, getattr(self, name), L + 1))
    for name in ("expert_fwd_s", "expert_bwd_s", "expert_on_attn_fwd_s",
                 "expert_on_attn_bwd_s", "routed_bytes"):
      object.__setattr__(self, name, _per_layer(name, getattr(self, name), L))
    if any(self.routed_bytes) and self.link is None:
      raise PlanError("ExpertAssignmentProblem: routed_bytes > 0 needs the link between the "
                      "GPUs (link=harpjax.cluster.Link.from_gbps(...))")
    hi = self.max_offload if self.max_offload is not None else L * self.per_gpu
    if not 0 <= self.min_offload <= hi:
      raise PlanError(f"ExpertAssignmentProblem: min_offload={self.min_offload} must be in "
                      f"[0, max_offload={hi}]: the expert GPUs cannot hold what the attention "
                      "GPUs must give back; add expert GPUs or memory")

  @property
  def num_layers(self) -> int:
    return len(self.expert_fwd_s)

  @property
  def per_gpu(self) -> int:
    """``n / N``: experts of a layer on each expert GPU without offloading."""
    return self.num_experts // self.num_expert

  @property
  def chunk(self) -> tuple[int, int]:
    """``(n1, n2)``: experts each attention GPU takes, and each expert GPU gives, per chunk."""
    n2 = self.num_attn // math.gcd(self.num_attn, self.num_expert)
    return self.num_expert * n2 // self.num_attn, n2

  @property
  def max_chunks(self) -> int:
    """The most chunks one layer can move (all of an expert GPU's share)."""
    return self.per_gpu // self.chunk[1]

  def feasible(self, offload: Sequence[int]) -> bool:
    """Whether ``offload`` (experts per expert GPU, per layer) is whole chunks within memory."""
    n2 = self.chunk[1]
    total = sum(offload)
    hi = self.max_offload if self.max_offload is not None else math.inf
    return (len(offload) == self.num_layers
            and all(0 <= o <= self.per_gpu and o % n2 == 0 for o in offload)
            and self.min_offload <= total <= hi)

  def _times(self, offload: Sequence[int]) -> tuple[np.ndarray, ...]:
    """``(expert_fwd, expert_bwd, comm, offload_fwd, offload_bwd)`` seconds ``[L]`` under
    ``offload``: the one computation :meth:`costs` and :meth:`iteration_time` share."""
    if len(offload) != self.num_layers:
      raise PlanError(f"offload has {len(offload)} layers, the stage {self.num_layers}")
    n, M, N = self.num_experts, self.num_attn, self.num_expert
    keep = np.array([(self.per_gpu - o) / self.per_gpu for o in offload])
    moved = 1.0 - keep                         # fraction of the routed tokens on attention GPUs
    # Each attention GPU computes N o / M experts' tokens: (N o / M) / (n / N) expert shares.
    share = np.array([N * o / M / self.per_gpu for o in offload])
    comm = np.zeros(self.num_layers)
    for l, nbytes in enumerate(self.routed_bytes):
      if nbytes > 0:
        comm[l] = bipartite_all_to_all_time_s(nbytes, M, N, 1.0 - moved[l], self.link)
    v = self._vectors
    return (v[0] * keep, v[1] * keep, comm, v[2] * share, v[3] * share)

  @functools.cached_property
  def _vectors(self) -> tuple[np.ndarray, ...]:
    return tuple(np.array(getattr(self, name)) for name in (
        "expert_fwd_s", "expert_bwd_s", "expert_on_attn_fwd_s", "expert_on_attn_bwd_s",
        "attn_fwd_s", "attn_bwd_s"))

  def costs(self, offload: Sequence[int]) -> ZebraCosts:
    """The zebra stage's task times under ``offload`` (``o_l`` experts per expert GPU)."""
    e_f, e_b, comm, x_f, x_b = self._times(offload)
    return ZebraCosts(
        self.num_layers, self.num_microbatches, self.attn_fwd_s, self.attn_bwd_s, e_f, e_b,
        dispatch_fwd_s=comm, combine_fwd_s=comm, dispatch_bwd_s=comm, combine_bwd_s=comm,
        offload_fwd_s=x_f, offload_bwd_s=x_b)

  @functools.cached_property
  def _layer_s(self) -> np.ndarray:
    """``[8, L, n / N + 1]`` seconds of each layer's ``X``, ``E``, dispatch and combine tasks
    (forward, backward) under each offload ``o`` (:meth:`_times`'s numbers, by the same
    operations)."""
    L, P = self.num_layers, self.per_gpu
    out = np.zeros((8, L, P + 1))
    for o in range(P + 1):
      e_f, e_b, comm, x_f, x_b = self._times([o] * L)
      out[:, :, o] = (x_f, x_b, e_f, e_b, comm, comm, comm, comm)
    return out

  def iteration_times(self, offloads) -> np.ndarray:
    """:meth:`iteration_time` of each row of ``offloads`` (``[K, L]``, each ``0 <= o_l <= n /
    N``), one kernel call per set of layers with ``X`` tasks: equal to it row by row.

    Returns:
      ``[K]`` seconds.
    """
    o = np.asarray(offloads, np.int64).reshape(-1, self.num_layers)
    if o.size and (o.min() < 0 or o.max() > self.per_gpu):
      raise PlanError(f"offloads must be 0..{self.per_gpu} experts per layer, got "
                      f"{o.min()}..{o.max()}")
    v = self._vectors
    return theorem1_iteration_times(self.num_microbatches, v[4], v[5], self._layer_s, o)

  def lower_bounds(self, offloads) -> np.ndarray:
    """``[K]`` a lower bound of each row's iteration time: the busier compute stream's
    seconds (tasks on one stream do not overlap; every task starts at or after 0)."""
    o = np.asarray(offloads, np.int64).reshape(-1, self.num_layers)
    ls, v, R = self._layer_s, self._vectors, self.num_microbatches
    idx = np.arange(self.num_layers)[None, :]
    attn = float(np.sum(v[4]) + np.sum(v[5])) + (ls[0][idx, o] + ls[1][idx, o]).sum(axis=1)
    expert = (ls[2][idx, o] + ls[3][idx, o]).sum(axis=1)
    return R * np.maximum(attn, expert)

  def iteration_time(self, offload: Sequence[int]) -> float:
    """Simulated iteration time (Theorem 1's order) under ``offload``: that of
    ``simulate_zebra(self.costs(offload))``, computed by
    :func:`~harpjax.compiler.schedule.zebra.theorem1_iteration_time` (the array kernel; equal,
    not approximately: tests check it)."""
    e_f, e_b, comm, x_f, x_b = self._times(offload)
    v = self._vectors
    return theorem1_iteration_time(self.num_microbatches, v[4], v[5], e_f, e_b, comm, comm,
                                   comm, comm, x_f, x_b)


@dataclasses.dataclass(frozen=True)
class AssignmentResult:
  """An expert assignment and its simulated iteration.

  Attributes:
    offload: ``[L]`` experts moved off each expert GPU, per layer.
    iteration_time: seconds.
    evaluated: assignments simulated to find it.
    method: ``"gather_and_squeeze"``, ``"local_search"`` or ``"exhaustive"``.
  """
  offload: tuple[int, ...]
  iteration_time: float
  evaluated: int
  method: str


def gather_and_squeeze(problem: ExpertAssignmentProblem) -> AssignmentResult:
  """HeterMoE's Algorithm 1: gather attention-GPU bubbles layer by layer, squeeze them with
  whole chunks of experts.

  Per layer, the forward bubble of an attention GPU is ``T_gather = T_E^Exp - T_A^Attn``; one
  chunk removes ``T_squeeze = n2 N T_E^Exp / n + n1 N T_E^Attn / n`` of it (what the expert GPU
  no longer computes plus what the attention GPU now does; the paper's line 4 prints the
  ``n1``/``n2`` factors the other way round and ``T_A^Attn`` for ``T_E^Attn``, against its own
  text). The accumulated bubble is squeezed by ``floor(t_bubble / T_squeeze)`` chunks as soon
  as it allows one; ``alpha`` and ``beta`` scale ``T_gather`` to respect the memory bounds
  ``max_offload`` and ``min_offload`` (the paper's §4.2). A layer never moves more than its
  experts.
  """
  p = problem
  n, N, L = p.num_experts, p.num_expert, p.num_layers
  n1, n2 = p.chunk
  gather = [p.expert_fwd_s[l] - p.attn_fwd_s[l] for l in range(L)]
  squeeze = [n2 * N * p.expert_fwd_s[l] / n + n1 * N * p.expert_on_attn_fwd_s[l] / n
             for l in range(L)]
  total_gather = sum(gather)
  mean_squeeze = sum(squeeze) / L
  alpha = beta = 1.0
  if total_gather > 0 and mean_squeeze > 0:
    if p.max_offload is not None:
      alpha = min((p.max_offload // n2) * mean_squeeze / total_gather, 1.0)
    beta = max(math.ceil(p.min_offload / n2) * mean_squeeze / total_gather, 1.0)
  bubble = 0.0
  offload = []
  for l in range(L):
    bubble += alpha * beta * gather[l]
    o = 0
    if squeeze[l] > 0 and bubble >= squeeze[l]:
      chunks = min(int(bubble // squeeze[l]), p.max_chunks)
      bubble -= chunks * squeeze[l]
      o = chunks * n2
    offload.append(o)
  offload = repair_assignment(p, offload)
  return AssignmentResult(tuple(offload), p.iteration_time(offload), 1, "gather_and_squeeze")


def repair_assignment(p: ExpertAssignmentProblem, offload: Sequence[int]) -> list[int]:
  """Moves whole chunks until the memory bounds hold (rounding can leave them off by one);
  from all zeros: the least offload the bounds allow."""
  n2 = p.chunk[1]
  hi = p.max_offload if p.max_offload is not None else math.inf
  offload = list(offload)
  while sum(offload) > hi:
    l = max(range(len(offload)), key=lambda k: offload[k])
    offload[l] -= n2
  while sum(offload) < p.min_offload:
    l = min(range(len(offload)), key=lambda k: offload[k])
    if offload[l] + n2 > p.per_gpu:
      break
    offload[l] += n2
  return offload


def local_search(problem: ExpertAssignmentProblem,
                 start: Sequence[int] | None = None) -> AssignmentResult:
  """Best-improvement descent on the simulated iteration time.

  Neighbours of an assignment: one more or one fewer chunk in one layer, or one chunk moved
  from one layer to another, within the memory bounds. Stops when no neighbour is faster.

  Args:
    problem: the stage.
    start: the first assignment; default :func:`gather_and_squeeze`'s.
  """
  p = problem
  n2 = p.chunk[1]
  cur = list(start) if start is not None else list(gather_and_squeeze(p).offload)
  if not p.feasible(cur):
    raise PlanError(f"local_search: start {cur} is not whole chunks of {n2} within the bounds")
  memo: dict[tuple[int, ...], float] = {}

  def time_of(o):
    key = tuple(o)
    if key not in memo:
      memo[key] = p.iteration_time(key)
    return memo[key]

  best_t = time_of(cur)
  L = p.num_layers
  while True:
    moves = []
    for l in range(L):
      for d in (n2, -n2):
        o = list(cur)
        o[l] += d
        moves.append(o)
    for a, b in itertools.permutations(range(L), 2):
      o = list(cur)
      o[a] -= n2
      o[b] += n2
      moves.append(o)
    moves = [o for o in moves if p.feasible(o)]
    fresh = list(dict.fromkeys(tuple(o) for o in moves if tuple(o) not in memo))
    if fresh:       # one kernel call for the neighbours not simulated yet
      for key, t in zip(fresh, p.iteration_times(fresh)):
        memo[key] = float(t)
    improved = None
    for o in moves:
      t = time_of(o)
      if t < best_t * (1 - 1e-12):
        best_t, improved = t, o
    if improved is None:
      break
    cur = improved
  return AssignmentResult(tuple(cur), best_t, len(memo), "local_search")


def exhaustive_assignment(problem: ExpertAssignmentProblem,
                          limit: int = 200_000) -> AssignmentResult:
  """The fastest assignment (whole chunks, within the memory bounds), the first in the order
  of ``itertools.product`` among equally fast ones: what simulating every assignment gives.
  Assignments are simulated in batches in order of :meth:`ExpertAssignmentProblem.
  lower_bounds`, and those whose bound exceeds the best time found are skipped (they cannot
  be faster, nor tie); ``evaluated`` counts those simulated.

  Raises:
    PlanError: more than ``limit`` assignments (``(max_chunks + 1) ** L``).
  """
  p = problem
  n2 = p.chunk[1]
  count = (p.max_chunks + 1) ** p.num_layers
  if count > limit:
    raise PlanError(f"exhaustive_assignment: {count} assignments exceed limit={limit}; use "
                    "local_search, or raise the limit")
  grid = np.array(list(itertools.product(range(p.max_chunks + 1), repeat=p.num_layers)),
                  np.int64).reshape(-1, p.num_layers) * n2
  total = grid.sum(axis=1)
  hi = p.max_offload if p.max_offload is not None else math.inf
  grid = grid[(total >= p.min_offload) & (total <= hi)]    # in enumeration order
  if not len(grid):
    raise PlanError("exhaustive_assignment: no assignment satisfies the memory bounds")
  # Simulate in order of a lower bound, in blocks, until the next bound exceeds the best time
  # found (with a margin for rounding): every assignment left is slower than the best, so the
  # result, the first fastest in enumeration order, is that of simulating them all.
  bounds = p.lower_bounds(grid) * (1.0 - 1e-9)
  order = np.argsort(bounds, kind="stable")
  times = np.full(len(grid), math.inf)
  best_t, pos, block = math.inf, 0, 64
  while pos < len(order) and bounds[order[pos]] <= best_t:
    rows = order[pos:pos + block]
    rows = rows[bounds[rows] <= best_t]
    times[rows] = p.iteration_times(grid[rows])
    best_t = min(best_t, float(times[rows].min()))
    pos += block
    block *= 2
  k = int(np.argmin(times))         # the first of the fastest
  evaluated = int(np.isfinite(times).sum())
  return AssignmentResult(tuple(int(x) for x in grid[k]), float(times[k]), evaluated,
                          "exhaustive")


def optimize_assignment(problem: ExpertAssignmentProblem,
                        exhaustive_limit: int = 4096) -> AssignmentResult:
  """Exhaustive search when at most ``exhaustive_limit`` assignments, else :func:`local_search`
  from Algorithm 1's assignment and from the least offload the memory allows, the faster of
  the two (from Algorithm 1 alone: within 2% of exhaustive on every instance tested,
  docs/moe.md)."""
  if (problem.max_chunks + 1) ** problem.num_layers <= exhaustive_limit:
    return exhaustive_assignment(problem, exhaustive_limit)
  least = repair_assignment(problem, [0] * problem.num_layers)
  a, b = local_search(problem), local_search(problem, least)
  best = a if a.iteration_time <= b.iteration_time else b
  return dataclasses.replace(best, evaluated=a.evaluated + b.evaluated)
