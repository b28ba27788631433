"""Zebra parallelism: a mixture-of-experts stage split inside each layer (HeterMoE §4.1).

A *zebra stage* runs ``L`` mixture-of-experts layers on two groups of GPUs of two types: ``M``
*attention GPUs* (one type) hold everything but the experts (attention, norms, the router, and
whatever precedes and follows the stage's MoE blocks), ``N`` *expert GPUs* (another type) hold
the experts. A batch is cut into ``R`` microbatches and every microbatch zig-zags between the
groups, so that the attention GPUs compute one microbatch while the expert GPUs compute another.

Tasks (per layer ``i``, microbatch ``j``, direction ``F``/``B``; :class:`ZebraTask`):

* ``A`` (attention side, attention GPUs): layer ``i``'s attention and router, ``i = 0 .. L-1``;
  ``A`` of layer ``L`` is the stage's *tail*, what runs after the last experts (final norm,
  head and loss on the last stage; its time may be zero). So each microbatch has ``L + 1``
  attention-side tasks and ``L`` expert tasks per direction, as in the paper, whose ``L``
  counts the attention-side tasks.
* ``E`` (experts on the expert GPUs) and, under asymmetric expert assignment, ``X`` (the
  experts of layer ``i`` moved onto the attention GPUs; :mod:`harpjax.compiler.plan.
  expert_assignment`).
* ``D`` (dispatch all-to-all) and ``C`` (combine all-to-all). Forward: ``A -> D -> E, X -> C ->
  A`` of the next layer. Backward, transposed: ``A^B(i+1) -> C^B(i) -> E^B, X^B -> D^B(i) ->
  A^B(i)``; ``A^B(L, j)`` follows ``A^F(L, j)``.

Streams (:data:`STREAMS`): one compute stream per group (``"attn"`` runs ``A`` and ``X``,
``"expert"`` runs ``E``) and two communication streams, ``"dispatch"`` (``D``, both directions)
and ``"combine"`` (``C``), which overlap each other and the computation. A task starts as soon as
its dependencies are done and its stream is free (the paper's constraints, with equality); a
compute stream runs its tasks in the order of its table, a communication stream in the order
they become ready (first in, first out), as the paper's engine enqueues them.

**Theorem 1** (HeterMoE §4.1). With every expert on the expert GPUs, data dependencies and
sequential streams as above, this per-stream order minimises the iteration time:

* attention GPUs: ``(A^F_{0,0} .. A^F_{0,R-1}) .. (A^F_{L-1,0} .. A^F_{L-1,R-1})
  (A^F_{L,0} A^B_{L,0} .. A^F_{L,R-1} A^B_{L,R-1}) (A^B_{L-1,0} .. A^B_{L-1,R-1}) ..
  (A^B_{0,0} .. A^B_{0,R-1})``;
* expert GPUs: ``(E^F_{0,*}) .. (E^F_{L-1,*}) (E^B_{L-1,*}) .. (E^B_{0,*})``, microbatches in
  order within each bracket;
* all-to-all tasks enter their streams as soon as the task they depend on is done.

The paper assumes that an all-to-all takes less time than the computation it sits between.
:func:`theorem1_order` builds this order (with the asymmetric assignment's ``X`` tasks after
the ``A`` tasks of their layer, as the paper schedules them); :func:`simulate_zebra` simulates
any order; ``tests/compiler/schedule/test_zebra.py`` checks the theorem against every order of
the two compute streams on random small instances (docs/moe.md).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import re
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from harpjax.cluster import Link
from harpjax.compiler.schedule.zebra_kernel import zebra_sim_batch, zebra_sim_kernel
from harpjax.errors import ScheduleError

__all__ = ["ZebraTask", "ZebraCosts", "ZebraOrder", "ZebraResult", "STREAMS", "theorem1_order",
           "simulate_zebra", "compute_orders", "bipartite_all_to_all_time_s",
           "zebra_task_graph", "theorem1_iteration_time", "theorem1_iteration_times",
           "ZebraArrays", "zebra_arrays"]

STREAMS = ("attn", "expert", "dispatch", "combine")
"""The four streams of a zebra stage: attention-group compute, expert-group compute, dispatch
all-to-all, combine all-to-all."""

_KIND_STREAM = {"A": "attn", "X": "attn", "E": "expert", "D": "dispatch", "C": "combine"}
_TASK_RE = re.compile(r"^\s*([AXEDC])([FB])(\d+)\.(\d+)\s*$")


class ZebraTask(NamedTuple):
  """One task of a zebra stage; text form ``"AF0.3"`` (attention, forward, layer 0, mb 3).

  Attributes:
    kind: ``"A"`` attention side, ``"X"`` experts on the attention GPUs, ``"E"`` experts on
      the expert GPUs, ``"D"`` dispatch, ``"C"`` combine.
    direction: ``"F"`` or ``"B"``.
    layer: ``0 .. L`` for ``A`` (``L`` is the tail), ``0 .. L-1`` for the others.
    microbatch: ``0 .. R-1``.
  """
  kind: str
  direction: str
  layer: int
  microbatch: int

  def __str__(self) -> str:
    return f"{self.kind}{self.direction}{self.layer}.{self.microbatch}"

  @property
  def stream(self) -> str:
    return _KIND_STREAM[self.kind]

  @classmethod
  def parse(cls, text: str) -> "ZebraTask":
    """Parses the text form (``"EB1.0"``)."""
    m = _TASK_RE.match(text)
    if not m:
      raise ScheduleError(f"cannot parse zebra task {text!r}: expected e.g. 'AF0.3' "
                          "(kind A/X/E/D/C, direction F/B, layer.microbatch)")
    return cls(m.group(1), m.group(2), int(m.group(3)), int(m.group(4)))


def _vec(name: str, value, n: int) -> tuple[float, ...]:
  arr = np.broadcast_to(np.asarray(value, dtype=np.float64), (n,)) if np.ndim(value) == 0 \
      else np.asarray(value, dtype=np.float64)
  if arr.shape != (n,):
    raise ScheduleError(f"ZebraCosts.{name} has shape {arr.shape}, expected ({n},)")
  if not np.all(np.isfinite(arr)) or np.any(arr < 0):
    raise ScheduleError(f"ZebraCosts.{name}={arr.tolist()}: seconds must be finite and >= 0")
  return tuple(float(x) for x in arr)


@dataclasses.dataclass(frozen=True)
class ZebraCosts:
  """Per-microbatch task times of a zebra stage (seconds; ``L`` MoE layers).

  Scalars broadcast. ``offload_*`` is the time of the experts moved onto the attention GPUs
  (``X`` tasks); a layer whose ``offload_fwd_s`` and ``offload_bwd_s`` are both zero has no
  ``X`` tasks.

  Attributes:
    num_layers: ``L``.
    num_microbatches: ``R``.
    attn_fwd_s, attn_bwd_s: ``[L + 1]`` attention-side forward/backward on the attention GPUs
      (entry ``L``: the tail).
    expert_fwd_s, expert_bwd_s: ``[L]`` experts on the expert GPUs.
    offload_fwd_s, offload_bwd_s: ``[L]`` experts on the attention GPUs (default 0).
    dispatch_fwd_s, combine_fwd_s, dispatch_bwd_s, combine_bwd_s: ``[L]`` all-to-all times.
  """
  num_layers: int
  num_microbatches: int
  attn_fwd_s: Sequence[float]
  attn_bwd_s: Sequence[float]
  expert_fwd_s: Sequence[float]
  expert_bwd_s: Sequence[float]
  dispatch_fwd_s: Sequence[float] = 0.0
  combine_fwd_s: Sequence[float] = 0.0
  dispatch_bwd_s: Sequence[float] = 0.0
  combine_bwd_s: Sequence[float] = 0.0
  offload_fwd_s: Sequence[float] = 0.0
  offload_bwd_s: Sequence[float] = 0.0

  def __post_init__(self):
    L, R = self.num_layers, self.num_microbatches
    for name, v in (("num_layers", L), ("num_microbatches", R)):
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ScheduleError(f"ZebraCosts.{name}={v!r}: must be an integer >= 1")
    object.__setattr__(self, "num_layers", int(L))
    object.__setattr__(self, "num_microbatches", int(R))
    for f in dataclasses.fields(self):
      if f.name.endswith("_s"):
        n = L + 1 if f.name.startswith("attn") else L
        object.__setattr__(self, f.name, _vec(f.name, getattr(self, f.name), n))

  def offloaded(self, layer: int) -> bool:
    """Whether layer ``layer`` runs experts on the attention GPUs (has ``X`` tasks)."""
    return self.offload_fwd_s[layer] > 0 or self.offload_bwd_s[layer] > 0

  def duration_s(self, task: ZebraTask) -> float:
    """Seconds of one task."""
    k, d, i = task.kind, task.direction, task.layer
    table = {("A", "F"): self.attn_fwd_s, ("A", "B"): self.attn_bwd_s,
             ("E", "F"): self.expert_fwd_s, ("E", "B"): self.expert_bwd_s,
             ("X", "F"): self.offload_fwd_s, ("X", "B"): self.offload_bwd_s,
             ("D", "F"): self.dispatch_fwd_s, ("D", "B"): self.dispatch_bwd_s,
             ("C", "F"): self.combine_fwd_s, ("C", "B"): self.combine_bwd_s}[(k, d)]
    return table[i]

  def comm_below_compute(self) -> bool:
    """The paper's assumption: every all-to-all is shorter than every computation of a layer
    (attention side and experts, both directions)."""
    comm = max(self.dispatch_fwd_s + self.combine_fwd_s + self.dispatch_bwd_s
               + self.combine_bwd_s)
    comp = min(self.attn_fwd_s[:-1] + self.attn_bwd_s[:-1] + self.expert_fwd_s
               + self.expert_bwd_s)
    return comm <= comp


# --------------------------------------------------------------------------- the task graph


def zebra_task_graph(costs: ZebraCosts) -> dict[ZebraTask, tuple[ZebraTask, ...]]:
  """Every task of one iteration with its data dependencies (predecessors), in chain order.

  Returns:
    ``{task: predecessors}``; insertion order is each microbatch's chain, microbatch by
    microbatch.
  """
  return _task_graph(costs.num_layers, costs.num_microbatches,
                     tuple(costs.offloaded(i) for i in range(costs.num_layers)))


def _task_graph(L: int, R: int, offloaded: tuple[bool, ...]
                ) -> dict[ZebraTask, tuple[ZebraTask, ...]]:
  """:func:`zebra_task_graph` of ``L`` layers, ``R`` microbatches, ``X`` tasks in the layers
  ``offloaded`` marks."""
  graph: dict[ZebraTask, tuple[ZebraTask, ...]] = {}
  for j in range(R):
    prev: tuple[ZebraTask, ...] = ()
    for i in range(L):                                    # forward
      a = ZebraTask("A", "F", i, j)
      graph[a] = prev
      d = ZebraTask("D", "F", i, j)
      graph[d] = (a,)
      e = ZebraTask("E", "F", i, j)
      graph[e] = (d,)
      mid = (e,)
      if offloaded[i]:
        x = ZebraTask("X", "F", i, j)
        graph[x] = (d,)
        mid = (e, x)
      c = ZebraTask("C", "F", i, j)
      graph[c] = mid
      prev = (c,)
    tail_f = ZebraTask("A", "F", L, j)
    graph[tail_f] = prev
    tail_b = ZebraTask("A", "B", L, j)
    graph[tail_b] = (tail_f,)
    prev = (tail_b,)
    for i in reversed(range(L)):                          # backward
      c = ZebraTask("C", "B", i, j)
      graph[c] = prev
      e = ZebraTask("E", "B", i, j)
      graph[e] = (c,)
      mid = (e,)
      if offloaded[i]:
        x = ZebraTask("X", "B", i, j)
        graph[x] = (c,)
        mid = (e, x)
      d = ZebraTask("D", "B", i, j)
      graph[d] = mid
      a = ZebraTask("A", "B", i, j)
      graph[a] = (d,)
      prev = (a,)
  return graph


# --------------------------------------------------------------------------- orders


@dataclasses.dataclass(frozen=True)
class ZebraOrder:
  """The order of the two compute streams (the communication streams are first in, first out).

  Attributes:
    attn: every ``A`` and ``X`` task once, in the order the attention GPUs run them.
    expert: every ``E`` task once.
  """
  attn: tuple[ZebraTask, ...]
  expert: tuple[ZebraTask, ...]

  def __post_init__(self):
    for name in ("attn", "expert"):
      row = tuple(t if isinstance(t, ZebraTask) else ZebraTask.parse(t)
                  for t in getattr(self, name))
      object.__setattr__(self, name, row)

  def text(self) -> str:
    return ("attn:   " + " ".join(map(str, self.attn)) + "\nexpert: "
            + " ".join(map(str, self.expert)))


def theorem1_order(costs: ZebraCosts) -> ZebraOrder:
  """The per-stream order of Theorem 1 (module docstring); ``X`` tasks of a layer follow its
  ``A`` tasks (forward) and precede the ``A`` tasks of the layer below (backward)."""
  return _theorem1(costs.num_layers, costs.num_microbatches,
                   tuple(costs.offloaded(i) for i in range(costs.num_layers)))


def _theorem1(L: int, R: int, offloaded: tuple[bool, ...]) -> ZebraOrder:
  mbs = range(R)
  attn: list[ZebraTask] = []
  for i in range(L):
    attn += [ZebraTask("A", "F", i, j) for j in mbs]
    if offloaded[i]:
      attn += [ZebraTask("X", "F", i, j) for j in mbs]
  for j in mbs:
    attn += [ZebraTask("A", "F", L, j), ZebraTask("A", "B", L, j)]
  for i in reversed(range(L)):
    if offloaded[i]:
      attn += [ZebraTask("X", "B", i, j) for j in mbs]
    attn += [ZebraTask("A", "B", i, j) for j in mbs]
  expert = [ZebraTask("E", "F", i, j) for i in range(L) for j in mbs]
  expert += [ZebraTask("E", "B", i, j) for i in reversed(range(L)) for j in mbs]
  return ZebraOrder(tuple(attn), tuple(expert))


def _interleavings(chains: list[list[ZebraTask]]) -> Iterator[tuple[ZebraTask, ...]]:
  """Every merge of ``chains`` that keeps each chain's order."""
  total = sum(len(c) for c in chains)
  pos = [0] * len(chains)
  out: list[ZebraTask] = []

  def rec():
    if len(out) == total:
      yield tuple(out)
      return
    for k, chain in enumerate(chains):
      if pos[k] < len(chain):
        out.append(chain[pos[k]])
        pos[k] += 1
        yield from rec()
        pos[k] -= 1
        out.pop()
  yield from rec()


def compute_orders(costs: ZebraCosts, symmetric: bool = True) -> Iterator[ZebraOrder]:
  """Every pair of compute-stream orders consistent with the data dependencies.

  Each microbatch's tasks on one stream form a chain (its data dependencies order them), so an
  order of a stream is an interleaving of the microbatches' chains; some pairs deadlock, which
  :func:`simulate_zebra` reports as an infinite time. Brute force: ``(R (2L + 2))! / ((2L +
  2)!)^R`` attention orders times ``(2 R L)! / ((2L)!)^R`` expert orders.

  Args:
    costs: the stage (its ``L``, ``R`` and which layers have ``X`` tasks).
    symmetric: when every microbatch has the same times, orders that differ only by renaming
      microbatches take the same time; keep only those whose attention stream starts the
      microbatches' chains in increasing order (divides the count by ``R!``).
  """
  graph = zebra_task_graph(costs)
  R = costs.num_microbatches
  chains = {s: [[t for t in graph if t.microbatch == j and t.stream == s] for j in range(R)]
            for s in ("attn", "expert")}
  expert_orders = list(_interleavings(chains["expert"]))
  for attn in _interleavings(chains["attn"]):
    if symmetric:
      firsts = [t.microbatch for t in attn if t.kind == "A" and t.direction == "F"
                and t.layer == 0]
      if firsts != sorted(firsts):
        continue
    for expert in expert_orders:
      yield ZebraOrder(attn, expert)


# --------------------------------------------------------------------------- the simulator


@dataclasses.dataclass(frozen=True, eq=False)
class ZebraResult:
  """One simulated iteration of a zebra stage (seconds).

  Attributes:
    iteration_time: from the first task's start to the last task's end (``inf`` if the order
      deadlocks).
    busy_s: ``{stream: seconds it runs tasks}``.
    start_s: ``{task: start}``.
    end_s: ``{task: end}``.
    order: the compute-stream order simulated.
  """
  iteration_time: float
  busy_s: dict
  start_s: dict
  end_s: dict
  order: ZebraOrder

  @property
  def deadlocked(self) -> bool:
    return not math.isfinite(self.iteration_time)

  def utilization(self, stream: str) -> float:
    """Fraction of the iteration the stream is busy."""
    return self.busy_s[stream] / self.iteration_time if self.iteration_time > 0 else 0.0

  def stream_tasks(self, stream: str) -> list[ZebraTask]:
    """The tasks of a stream in the order they ran."""
    return sorted((t for t in self.start_s if t.stream == stream), key=self.start_s.get)


def _check_order(order: ZebraOrder, graph) -> None:
  for name, stream_names in (("attn", ("attn",)), ("expert", ("expert",))):
    row = getattr(order, name)
    want = {t for t in graph if t.stream in stream_names}
    got = set(row)
    if len(row) != len(got) or got != want:
      missing = sorted(map(str, want - got))[:6]
      extra = sorted(map(str, got - want))[:6]
      dup = len(row) - len(got)
      raise ScheduleError(
          f"ZebraOrder.{name} must list each of its stream's {len(want)} tasks once: "
          f"missing {missing}, not of this stage {extra}, {dup} repeated")


def simulate_zebra(costs: ZebraCosts, order: ZebraOrder | None = None, *,
                   check: bool = True) -> ZebraResult:
  """Event-driven simulation of one iteration of a zebra stage.

  Every task starts at ``max(end of its dependencies, its stream's free time)``; compute streams
  take their tasks in ``order``, communication streams in the order the tasks became ready
  (ties: forward before backward, lower layer, lower microbatch). Tasks are committed in order
  of start time, so the communication streams' first-in-first-out order is exact.

  Args:
    costs: task times.
    order: compute-stream order; default :func:`theorem1_order`.
    check: validate that ``order`` lists each compute task once.

  Returns:
    A :class:`ZebraResult`; its ``iteration_time`` is ``inf`` when the order deadlocks.

  Raises:
    ScheduleError: ``order`` is not an order of this stage's compute tasks.
  """
  graph = zebra_task_graph(costs)
  if order is None:
    order = theorem1_order(costs)
  elif check:
    _check_order(order, graph)
  succ: dict[ZebraTask, list[ZebraTask]] = {t: [] for t in graph}
  for t, preds in graph.items():
    for p in preds:
      succ[p].append(t)
  waiting = {t: len(p) for t, p in graph.items()}
  ready_at = {t: 0.0 for t, p in graph.items() if not p}
  rows = {"attn": order.attn, "expert": order.expert}
  pos = {"attn": 0, "expert": 0}
  heaps: dict[str, list] = {"dispatch": [], "combine": []}
  free = {s: 0.0 for s in STREAMS}
  busy = {s: 0.0 for s in STREAMS}
  start: dict[ZebraTask, float] = {}
  end: dict[ZebraTask, float] = {}
  dur = {t: costs.duration_s(t) for t in graph}
  remaining = len(graph)
  while remaining:
    best = None
    for s in ("attn", "expert"):
      row, p = rows[s], pos[s]
      if p < len(row):
        t = row[p]
        if waiting[t] == 0:
          t0 = max(free[s], ready_at[t])
          if best is None or t0 < best[0]:
            best = (t0, s, t)
    for s in ("dispatch", "combine"):
      if heaps[s]:
        t = heaps[s][0][-1]
        t0 = max(free[s], ready_at[t])
        if best is None or t0 < best[0]:
          best = (t0, s, t)
    if best is None:
      return ZebraResult(math.inf, busy, start, end, order)
    t0, s, t = best
    if s in heaps:
      heapq.heappop(heaps[s])
    else:
      pos[s] += 1
    t1 = t0 + dur[t]
    start[t], end[t] = t0, t1
    free[s] = t1
    busy[s] += dur[t]
    remaining -= 1
    for u in succ[t]:
      ready_at[u] = max(ready_at.get(u, 0.0), t1)
      waiting[u] -= 1
      if waiting[u] == 0 and u.stream in heaps:
        heapq.heappush(heaps[u.stream], (ready_at[u], u.direction != "F", u.layer,
                                         u.microbatch, u))
  t_end = max(end.values()) if end else 0.0
  return ZebraResult(t_end, busy, start, end, order)


# --------------------------------------------------------------------------- the fast path

_KINDS = "AXEDC"
_STREAM_ID = {s: k for k, s in enumerate(STREAMS)}


class ZebraArrays(NamedTuple):
  """A zebra stage's task graph and Theorem 1's order as integer arrays (the kernel's input,
  :mod:`~harpjax.compiler.schedule.zebra_kernel`); task ``k`` is the ``k``-th of
  :func:`zebra_task_graph`'s order.

  Attributes:
    tasks: ``[n]`` the :class:`ZebraTask` of each id.
    stream, backward, layer, microbatch, num_preds: ``[n]`` int64.
    succ: ``[n, 2]`` int64 dependants (``-1``: none).
    duration_row: ``[n]`` int64: the row of each task's seconds in the ``[10, L + 1]`` table
      :func:`theorem1_iteration_time` builds (``2 * kind + backward``, kinds ``A X E D C``).
    attn_order, expert_order: task ids of Theorem 1's order of the two compute streams.
  """
  tasks: tuple
  stream: np.ndarray
  backward: np.ndarray
  layer: np.ndarray
  microbatch: np.ndarray
  num_preds: np.ndarray
  succ: np.ndarray
  duration_row: np.ndarray
  attn_order: np.ndarray
  expert_order: np.ndarray


@functools.lru_cache(maxsize=4096)
def zebra_arrays(num_layers: int, num_microbatches: int, offloaded: tuple[bool, ...]
                 ) -> ZebraArrays:
  """The :class:`ZebraArrays` of ``L`` layers, ``R`` microbatches and ``X`` tasks in the
  layers ``offloaded`` marks (built once per such triple: the graph and order of
  :func:`zebra_task_graph` and :func:`theorem1_order` themselves)."""
  L, R = int(num_layers), int(num_microbatches)
  offloaded = tuple(bool(x) for x in offloaded)
  graph = _task_graph(L, R, offloaded)
  order = _theorem1(L, R, offloaded)
  tasks = tuple(graph)
  ids = {t: k for k, t in enumerate(tasks)}
  n = len(tasks)
  succ = np.full((n, 2), -1, np.int64)
  fill = np.zeros(n, np.int64)
  for t, preds in graph.items():
    for p in preds:
      succ[ids[p], fill[ids[p]]] = ids[t]
      fill[ids[p]] += 1
  arr = lambda xs: np.array(list(xs), np.int64)  # noqa: E731
  out = ZebraArrays(
      tasks=tasks, stream=arr(_STREAM_ID[t.stream] for t in tasks),
      backward=arr(t.direction == "B" for t in tasks), layer=arr(t.layer for t in tasks),
      microbatch=arr(t.microbatch for t in tasks), num_preds=arr(len(graph[t]) for t in tasks),
      succ=succ,
      duration_row=arr(2 * _KINDS.index(t.kind) + (t.direction == "B") for t in tasks),
      attn_order=arr(ids[t] for t in order.attn), expert_order=arr(ids[t] for t in order.expert))
  for a in out[1:]:
    a.setflags(write=False)
  return out


def theorem1_iteration_time(num_microbatches: int, attn_fwd_s, attn_bwd_s, expert_fwd_s,
                            expert_bwd_s, dispatch_fwd_s, combine_fwd_s, dispatch_bwd_s,
                            combine_bwd_s, offload_fwd_s, offload_bwd_s, *,
                            use_numba: bool = True) -> float:
  """:func:`simulate_zebra`'s iteration time in Theorem 1's order, on the array kernel
  (:mod:`~harpjax.compiler.schedule.zebra_kernel`): equal to
  ``simulate_zebra(ZebraCosts(L, R, ...)).iteration_time`` for the same seconds (the same
  operations in the same order), without building the task objects. The arguments are
  :class:`ZebraCosts`'s fields as float64 arrays (``[L + 1]`` attention sides, ``[L]`` the
  rest; seconds, finite, >= 0: not checked here, :class:`ZebraCosts` checks them).

  Returns:
    Seconds (``inf`` only if the order deadlocks, which Theorem 1's never does).
  """
  expert_fwd_s = np.asarray(expert_fwd_s, np.float64)
  L = expert_fwd_s.shape[0]
  table = np.zeros((10, L + 1))
  table[0] = attn_fwd_s
  table[1] = attn_bwd_s
  table[2, :L] = offload_fwd_s
  table[3, :L] = offload_bwd_s
  table[4, :L] = expert_fwd_s
  table[5, :L] = expert_bwd_s
  table[6, :L] = dispatch_fwd_s
  table[7, :L] = dispatch_bwd_s
  table[8, :L] = combine_fwd_s
  table[9, :L] = combine_bwd_s
  offloaded = tuple(((table[2, :L] > 0) | (table[3, :L] > 0)).tolist())
  g = zebra_arrays(L, int(num_microbatches), offloaded)
  dur = table[g.duration_row, g.layer]
  t, _, _ = zebra_sim_kernel(g.stream, g.backward, g.layer, g.microbatch, g.num_preds, g.succ,
                             dur, g.attn_order, g.expert_order, use_numba=use_numba)
  return t


def theorem1_iteration_times(num_microbatches: int, attn_fwd_s, attn_bwd_s, layer_s, choice,
                             *, use_numba: bool = True) -> np.ndarray:
  """:func:`theorem1_iteration_time` of many stages that differ only in their layers' choice
  among a few alternatives (an expert assignment: how many experts each layer moves), in one
  kernel call per set of layers with ``X`` tasks.

  Args:
    num_microbatches: ``R``.
    attn_fwd_s, attn_bwd_s: ``[L + 1]`` seconds, the same for every stage.
    layer_s: ``[8, L, V]`` seconds of layer ``l`` under alternative ``v``: ``X`` forward,
      ``X`` backward, ``E`` forward, ``E`` backward, dispatch forward, dispatch backward,
      combine forward, combine backward (a layer has ``X`` tasks where either ``X`` is > 0).
    choice: ``[K, L]`` int, each stage's alternative per layer.

  Returns:
    ``[K]`` seconds, each equal to :func:`theorem1_iteration_time` of that stage's seconds.
  """
  layer_s = np.asarray(layer_s, np.float64)
  choice = np.asarray(choice, np.int64)
  _, L, V = layer_s.shape
  K = choice.shape[0]
  table = np.zeros((10, L + 1, V))
  table[0] = np.asarray(attn_fwd_s, np.float64)[:, None]
  table[1] = np.asarray(attn_bwd_s, np.float64)[:, None]
  table[2:, :L] = layer_s
  has_x = (layer_s[0] > 0) | (layer_s[1] > 0)                        # [L, V]
  masks = has_x[np.arange(L)[None, :], choice]                        # [K, L]
  keys = masks.astype(np.int64) @ (np.int64(1) << np.arange(L, dtype=np.int64))
  full = np.concatenate([choice, np.zeros((K, 1), np.int64)], axis=1)  # the tail: any column
  out = np.empty(K)
  for key in np.unique(keys):
    rows = np.flatnonzero(keys == key)
    g = zebra_arrays(L, int(num_microbatches), tuple(masks[rows[0]].tolist()))
    dur = table[g.duration_row[None, :], g.layer[None, :], full[rows][:, g.layer]]
    out[rows] = zebra_sim_batch(g.stream, g.backward, g.layer, g.microbatch, g.num_preds,
                                g.succ, dur, g.attn_order, g.expert_order, use_numba=use_numba)
  return out


# --------------------------------------------------------------------------- all-to-all cost


def bipartite_all_to_all_time_s(nbytes: float, num_attn: int, num_expert: int,
                                expert_fraction: float, link: Link) -> float:
  """Seconds of one dispatch (or combine) all-to-all of a zebra stage.

  The ``num_attn`` attention GPUs hold ``nbytes`` of routed token copies together (``tokens *
  top_k * hidden * dtype bytes`` of a microbatch), ``nbytes / num_attn`` each; the fraction
  ``expert_fraction`` goes to the expert GPUs (evenly), the rest to the attention GPUs' own
  experts (evenly, ``1 / num_attn`` of it staying on the sender). Every GPU has one full-duplex
  ``link``; the all-to-all lasts as long as its busiest endpoint sends or receives, plus one
  latency per peer (the ring all-to-all of :mod:`harpjax.compiler.profile.collectives` charges
  ``(p - 1)`` latencies the same way)::

      max(nbytes / M * (f + (1 - f) (M - 1) / M),  nbytes * f / N) / bandwidth
        + (M + N - 1) * latency

  Combine is the same exchange reversed, and the backward's are the same volumes.
  """
  M, N, f = int(num_attn), int(num_expert), float(expert_fraction)
  if M < 1 or N < 1 or not 0.0 <= f <= 1.0:
    raise ScheduleError(f"bipartite all-to-all: num_attn={num_attn}, num_expert={num_expert} "
                        f"must be >= 1 and expert_fraction={expert_fraction} in [0, 1]")
  per_attn = nbytes / M * (f + (1.0 - f) * (M - 1) / M)
  per_expert = nbytes * f / N
  busiest = max(per_attn, per_expert)
  if busiest <= 0:
    return 0.0
  return busiest / link.bandwidth_bytes_per_s + (M + N - 1) * link.latency_s
