"""Zebra stages as a transformation of the cost tables: attention/expert disaggregation
(HeterMoE §4) as one more kind of pipeline stage the one search ranges over.

A *zebra stage* runs a range of layers ``i..j`` of a routed model (at least one layer whose
module holds a routed block, :attr:`~harpjax.compiler.layers.Module.routed`) on two groups of
GPUs of two subclusters: the *attention group* (submesh ``s_a`` of subcluster ``a``, ``M``
devices) runs everything but the experts, the *expert group* (submesh ``s_e`` of subcluster
``e``, ``N`` devices) the experts, and each pipeline microbatch is cut into ``R`` zebra
microbatches that zig-zag between the two (:mod:`harpjax.compiler.schedule.zebra`). Per routed
layer, ``o_l`` of each expert GPU's experts may run on the attention group instead
(:mod:`harpjax.compiler.plan.expert_assignment`). The stage's values arrive at and leave from
the attention group (its *home*), so a zebra stage is one stage of an H-1F1B plan like any other.

**Cost** (:func:`zebra_stage_cost`; every number from the tables and their
:attr:`~harpjax.compiler.profile.CostTables.routed_split`):

* *tasks*: a routed layer ``l``'s attention side is its single-layer entry on the attention
  group less its experts, ``t_a[l, l, s_a] - x_a[l, s_a]`` (``x`` the split's
  ``expert_time_s``); a layer without experts is all attention side. The attention-side task
  ``A_r`` of the ``r``-th routed layer holds the attention sides of the layers after the
  previous routed layer up to this one; the tail ``A_L`` those after the last routed layer.
  The experts of routed layer ``l`` on the expert group take ``x_e[l, s_e]`` (``T_E^Exp``: one
  expert GPU's ``n / N`` experts); one expert GPU's share on an attention GPU takes
  ``x_a[l, s_a] M / N`` (``T_E^Attn``: the entry spreads all experts over ``M`` devices).
  Forward is ``fwd_fraction`` of each, backward the rest; each of the ``R`` zebra
  microbatches takes ``alpha + (1 - alpha) / R`` of every compute task
  (:attr:`ZebraOptions.fixed_fraction`, default 0).
* *all-to-all*: dispatch and combine, each direction, on the link between ``a`` and ``e``
  (the tables' ``link_bandwidth_bytes_per_s[a][e]``), by
  :func:`~harpjax.compiler.schedule.bipartite_all_to_all_time_s` of the split's
  ``routed_bytes / R``, the fraction ``1 - N o_l / n`` going to the expert group.
* *time per microbatch*: :func:`~harpjax.compiler.schedule.simulate_zebra` of those tasks in
  Theorem 1's order: forward and backward of the ``R`` zebra microbatches of one pipeline
  microbatch, the stage's ``t`` in the pipeline (its forward ``fwd_fraction`` of it, as every
  stage's).
* *memory* per device (pipeline microbatches in flight ``n``): the attention group holds its
  layers' single-layer entries' state less the experts' (``expert_state_bytes / ep``, ``ep``
  the entry's expert-parallel degree, 1 for a data-parallel mesh) plus ``N o_l / M`` offloaded
  experts' state, and per microbatch its entries' activations less the experts' (``/ M``) plus
  those of its offloaded experts; the expert group ``n / N - o_l`` experts' state and its
  experts' activations. Each is checked against its own device's memory.
* *end of iteration*: the larger of the two groups' entries' end times (each as if it ran the
  whole range: an upper bound).

**Choice**: for every entry, every ``R`` dividing the microbatch's rows up to
:attr:`ZebraOptions.max_microbatches` and the assignment of
:func:`~harpjax.compiler.plan.expert_assignment.optimize_assignment` (exhaustive up to
:attr:`ZebraOptions.assignment_limit` assignments, local search beyond), within the memory
bounds of Algorithm 1 (``min_offload``, ``max_offload`` from the two groups' free memory with
one microbatch in flight, the costliest layer's expert bytes per unit); the fastest, fewer
``R`` and less offload on ties.

**Search**: :class:`ZebraShape` is a shape of zebra stage (the two groups' submeshes, up to
``stages`` such stages), planned as one virtual subcluster exactly as mixed-type stages are
(:func:`~harpjax.compiler.plan.mixed.fused_tables`, whose virtual entry for a zebra shape is
:func:`zebra_entry`); :func:`~harpjax.compiler.plan.mixed.solve_mixed` tries every
:func:`candidate_zebra_shapes` shape unless ``MixedOptions(zebra="off")`` (``"auto"``, the
default, considers them where the runtime runs them: :data:`ZEBRA_MODES`). The local runtime
runs zebra stages, their expert assignment included (:mod:`harpjax.compiler.stages.zebra`);
the Ray runtime, ZeRO and offloads on them raise :class:`~harpjax.errors.ZebraPlanOnlyError`
when laid out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from harpjax.cluster import Link
from harpjax.compiler.plan.expert_assignment import (AssignmentResult, ExpertAssignmentProblem,
                                                     exhaustive_assignment, gather_and_squeeze,
                                                     optimize_assignment, repair_assignment)
from harpjax.compiler.profile import CostTables
from harpjax.compiler.schedule import simulate_zebra
from harpjax.errors import PlanError

__all__ = ["ZebraOptions", "ZebraShape", "ZebraStageCost", "ZEBRA_MODES", "ZEBRA_ALIASES",
           "zebra_mode", "zebra_for_runtime", "zebra_group_bytes", "zebra_stage_cost",
           "zebra_entry", "candidate_zebra_shapes", "zebra_problem"]

ZEBRA_MODES = ("auto", "on", "off")
"""Whether the planner considers zebra stages (``MixedOptions.zebra``): ``"on"`` always,
``"off"`` never, ``"auto"`` (the default of ``auto_parallel``, ``solve`` and ``harpjax
plan`` alike) where the runtime the plan is for runs them: planning alone (``solve``,
``harpjax plan``: the plan file runs on the local runtime) and ``auto_parallel`` on the
local runtime; not for the Ray runtime, which does not run them (:func:`zebra_for_runtime`).
``"plan-only"``, the name ``"on"`` had while the runtime could not run zebra stages, is
accepted with a :class:`DeprecationWarning`."""

ZEBRA_ALIASES = {"plan-only": "on"}
"""Deprecated spellings of :data:`ZEBRA_MODES`."""


def zebra_mode(value, where: str = "MixedOptions.zebra") -> str:
  """``value`` as one of :data:`ZEBRA_MODES` (a deprecated alias, :data:`ZEBRA_ALIASES`,
  warns once and is replaced).

  Raises:
    InvalidOptionError: ``value`` is none of them.
  """
  import warnings
  from harpjax.errors import check_choice
  if isinstance(value, str) and value in ZEBRA_ALIASES:
    new = ZEBRA_ALIASES[value]
    warnings.warn(f"{where}={value!r} is deprecated: zebra stages run on the local runtime "
                  f"now; write {where}={new!r}", DeprecationWarning, stacklevel=4)
    return new
  check_choice(where, value, ZEBRA_MODES)
  return value


def zebra_for_runtime(options, local: bool):
  """``options`` (a :class:`~harpjax.compiler.plan.MixedOptions`) for planning a step that
  runs on the local runtime (``local``) or the Ray runtime: ``zebra="auto"`` becomes
  ``"off"`` for the Ray runtime, which does not run zebra stages (``"on"`` stays: such a
  plan is then refused by name when laid out, :class:`~harpjax.errors.ZebraPlanOnlyError`)."""
  if options is None or local or options.zebra != "auto":
    return options
  return dataclasses.replace(options, zebra="off")


@dataclasses.dataclass(frozen=True)
class ZebraOptions:
  """How zebra stages are costed and searched (``MixedOptions.zebra_options``).

  Attributes:
    max_microbatches: the most zebra microbatches ``R`` a pipeline microbatch is cut into
      (every divisor of its rows up to this is tried).
    assignment_limit: expert assignments of a stage searched exhaustively up to this many,
      by local search beyond (:func:`~harpjax.compiler.plan.expert_assignment.
      optimize_assignment`); ``0``: no experts move (plain zebra).
    local_search: beyond ``assignment_limit``, local search from Algorithm 1's assignment
      and from the least offload (default); ``False``: the better of Algorithm 1's
      assignment and the least offload, two simulations (for large sweeps).
    fwd_fraction: the forward's share of each task's time.
    fixed_fraction: ``alpha``, the share of a task's compute that does not shrink with the
      zebra microbatch's rows (reading the weights, kernel overheads): one of ``R`` zebra
      microbatches takes ``T (alpha + (1 - alpha) / R)``. Default 0: the tables cannot tell
      (as :attr:`~harpjax.compiler.plan.MixedOptions.fixed_fraction`).
    max_hosts_per_group: most whole hosts of one group.
    sub_host: a group may also be a submesh inside one host (``(1, m)``).
  """
  max_microbatches: int = 8
  assignment_limit: int = 256
  local_search: bool = True
  fwd_fraction: float = 1.0 / 3.0
  fixed_fraction: float = 0.0
  max_hosts_per_group: int = 2
  sub_host: bool = True

  def __post_init__(self):
    from harpjax.errors import check_count, check_flag, check_number
    check_count("ZebraOptions.max_microbatches", self.max_microbatches, 1)
    check_count("ZebraOptions.assignment_limit", self.assignment_limit, 0)
    check_number("ZebraOptions.fwd_fraction", self.fwd_fraction, 0, 1, low_open=True,
                  high_open=True)
    check_number("ZebraOptions.fixed_fraction", self.fixed_fraction, 0, 1, high_open=True)
    check_count("ZebraOptions.max_hosts_per_group", self.max_hosts_per_group, 1)
    check_flag("ZebraOptions.sub_host", self.sub_host)
    check_flag("ZebraOptions.local_search", self.local_search)


@dataclasses.dataclass(frozen=True)
class ZebraShape:
  """Zebra stages of one shape, planned as one virtual subcluster (as a
  :class:`~harpjax.compiler.plan.mixed.Fusion` is for mixed stages).

  Attributes:
    members: ``(a, e)``: the attention group's subcluster, then the expert group's.
    shapes: each group's submesh.
    stages: the most zebra stages of this shape.
  """
  members: tuple[int, int]
  shapes: tuple[tuple[int, int], tuple[int, int]]
  stages: int

  def name(self, tables: CostTables) -> str:
    a, e = (tables.subcluster_names[k] for k in self.members)
    return f"zebra:{a}+{e}"

  def group_shape(self, x: int) -> tuple[int, int]:
    return self.shapes[x]

  def reserved_hosts(self, tables: CostTables, x: int, stages: int | None = None) -> int:
    """Hosts of group ``x``'s subcluster that ``stages`` (default :attr:`stages`) zebra
    stages hold (a host holding a group runs no plain stage)."""
    c = self.stages if stages is None else stages
    n, m = self.shapes[x]
    M = tables.devices_per_host[self.members[x]]
    return n * c if m == M else -(-c // (M // m))

  def virtual_entry(self, tables: CostTables, B: int, options, zero: int = 0,
                    memo: dict | None = None):
    """``(time, activation bytes, end time)`` ``[L, L, 1]`` of the virtual subcluster
    (:func:`zebra_entry`; ``options`` a :class:`~harpjax.compiler.plan.MixedOptions`)."""
    return zebra_entry(tables, self, B, _rows_of(options, tables), _zebra_options(options),
                       memo)


@dataclasses.dataclass(frozen=True)
class ZebraStageCost:
  """One zebra stage, costed (:func:`zebra_stage_cost`).

  Attributes:
    layers: ``(i, j)``.
    attn, expert: ``(subcluster, submesh index)`` of each group.
    num_microbatches: ``R``.
    routed_layers: the routed layers of the range, in order (the zebra stage's MoE layers).
    offload: ``o_l`` per routed layer: experts moved off each expert GPU.
    time_s: simulated forward+backward seconds of one pipeline microbatch.
    attn_param_bytes, attn_act_bytes, expert_param_bytes, expert_act_bytes: per device of each
      group: state, and activations per pipeline microbatch in flight.
    attn_memory_bytes, expert_memory_bytes: each group's device memory.
    end_s: end-of-iteration seconds.
  """
  layers: tuple[int, int]
  attn: tuple[int, int]
  expert: tuple[int, int]
  num_microbatches: int
  routed_layers: tuple[int, ...]
  offload: tuple[int, ...]
  time_s: float
  attn_param_bytes: float
  attn_act_bytes: float
  expert_param_bytes: float
  expert_act_bytes: float
  attn_memory_bytes: float
  expert_memory_bytes: float
  end_s: float

  def max_inflight(self, cap: int) -> int:
    """The most pipeline microbatches in flight (``<= cap``) both groups hold (0: none)."""
    n = cap
    for p, a, mem in ((self.attn_param_bytes, self.attn_act_bytes, self.attn_memory_bytes),
                      (self.expert_param_bytes, self.expert_act_bytes,
                       self.expert_memory_bytes)):
      while n > 0 and not zebra_group_bytes(p, a, n) <= mem:
        n -= 1
    return n


def zebra_group_bytes(state_bytes: float, act_bytes: float, in_flight: int,
                      update_bytes: float = 0.0) -> float:
  """The memory model of one group of a zebra stage, per device: its state (parameters,
  gradients, optimizer state) with the residuals of ``in_flight`` pipeline microbatches
  (each ``act_bytes``: its ``R`` zebra microbatches' in every part the group runs), or,
  during the optimizer update, the state with the update's new values (``update_bytes``:
  the new parameters and optimizer state, not written over the old), whichever is larger.
  The planner checks it against the device's memory (:meth:`ZebraStageCost.max_inflight`;
  its tables do not part the state into parameters and optimizer state, so it passes no
  ``update_bytes``); :func:`harpjax.compiler.stages.memory_report` computes it from the
  programs the runtime compiles and sets XLA's account beside it."""
  return max(float(state_bytes) + int(in_flight) * float(act_bytes),
             float(state_bytes) + float(update_bytes))


def _rows_of(options, tables: CostTables) -> int:
  rows = getattr(options, "microbatch_rows", None)
  if rows is None:
    rows = tables.microbatch_rows
  if rows is None:
    raise PlanError("zebra stages need the rows of one microbatch: give "
                    "MixedOptions(microbatch_rows=...), or tables that carry them")
  return int(rows)


def _zebra_options(options) -> ZebraOptions:
  z = getattr(options, "zebra_options", None)
  return z if z is not None else ZebraOptions()


@dataclasses.dataclass(frozen=True)
class _Parts:
  """The per-layer numbers of a zebra stage before ``R`` and the assignment are chosen."""
  routed: tuple[int, ...]
  num_experts: int
  attn_f: np.ndarray        # [Lz + 1] attention-side seconds per pipeline microbatch, fwd
  attn_b: np.ndarray
  exp_f: np.ndarray         # [Lz] T_E^Exp
  exp_b: np.ndarray
  on_attn_f: np.ndarray     # [Lz] T_E^Attn
  on_attn_b: np.ndarray
  routed_bytes: np.ndarray  # [Lz]
  link: Link
  M: int
  N: int
  attn_p0: float            # attention group's state and activations per device, no offload
  attn_a0: float
  exp_p0: float
  exp_a0: float
  attn_unit: np.ndarray     # [Lz] (state, act) bytes per expert offloaded per expert GPU
  attn_unit_a: np.ndarray
  exp_unit: np.ndarray
  exp_unit_a: np.ndarray
  attn_mem: float
  exp_mem: float
  end_s: float
  quantum: int              # a zebra microbatch's rows: a multiple of the attention batch ways

  def key(self) -> tuple:
    """What the choice of ``R`` and assignment depends on (entries of equal blocks share
    it)."""
    arrs = (self.attn_f, self.attn_b, self.exp_f, self.exp_b, self.on_attn_f, self.on_attn_b,
            self.routed_bytes, self.attn_unit, self.attn_unit_a, self.exp_unit, self.exp_unit_a)
    return (tuple(tuple(a.tolist()) for a in arrs), self.num_experts, self.M, self.N,
            self.link, self.attn_p0, self.attn_a0, self.exp_p0, self.exp_a0, self.attn_mem,
            self.exp_mem, self.quantum)


def _parts(tables: CostTables, i: int, j: int, attn: tuple[int, int], expert: tuple[int, int],
           fwd: float) -> _Parts | None:
  """The stage's numbers, or ``None`` when no zebra stage can run there (no routed layer,
  different expert counts, an expert group that does not divide them, no link, an entry
  without a finite time)."""
  split = tables.routed_split
  if split is None:
    return None
  (a, sa), (e, se) = attn, expert
  if a == e:
    return None
  routed = tuple(l for l in range(i, j + 1) if split.routed(l))
  if not routed:
    return None
  n = {split.num_experts[l] for l in routed}
  M = tables.submeshes[a][sa][0] * tables.submeshes[a][sa][1]
  N = tables.submeshes[e][se][0] * tables.submeshes[e][se][1]
  if len(n) != 1:
    return None
  n = n.pop()
  if n % N:
    return None
  bw = tables.link_bandwidth_bytes_per_s[a][e]
  if not bw > 0:
    return None
  link = Link(float(bw), float(tables.link_latency_s[a][e]))
  ta = np.array([tables.stage_time_s[a][l, l, sa] for l in range(i, j + 1)])
  if not np.isfinite(ta).all():
    return None
  if not all(math.isfinite(tables.stage_time_s[e][l, l, se]) for l in routed):
    return None
  xa = np.array([split.expert_time_s[a][l, sa] for l in range(i, j + 1)])
  side = ta - xa
  attn_t = np.zeros(len(routed) + 1)
  r = 0
  for off, l in enumerate(range(i, j + 1)):
    attn_t[r] += side[off]
    if r < len(routed) and l == routed[r]:
      r += 1
  exp_t = np.array([split.expert_time_s[e][l, se] for l in routed])
  on_attn = np.array([split.expert_time_s[a][l, sa] for l in routed]) * M / N
  es = np.array([split.expert_state_bytes[l] for l in routed])
  ea = np.array([split.expert_act_bytes[l] for l in routed])
  attn_p0 = attn_a0 = 0.0
  for l in range(i, j + 1):
    p = float(tables.param_mem_bytes[a][l, l, sa])
    act = float(tables.act_mem_bytes[a][l, l, sa])
    if split.routed(l):
      lm = tables.logical_mesh_of(a, l, l, sa)
      ep = lm[2] if len(lm) > 2 else 1
      p = max(0.0, p - float(split.expert_state_bytes[l]) / ep)
      act = max(0.0, act - float(split.expert_act_bytes[l]) / M)
    attn_p0 += p
    attn_a0 += act
  quantum = 1
  for l in range(i, j + 1):   # every device of the attention group gets whole rows
    lm = tables.logical_mesh_of(a, l, l, sa)
    quantum = math.lcm(quantum, int(lm[0]) * (int(lm[2]) if len(lm) > 2 else 1))
  end = 0.0
  if tables.end_time_s is not None:
    end = max(float(tables.end_time_s[a][i, j, sa]), float(tables.end_time_s[e][i, j, se]))
  return _Parts(
      routed=routed, num_experts=n, attn_f=attn_t * fwd, attn_b=attn_t * (1 - fwd),
      exp_f=exp_t * fwd, exp_b=exp_t * (1 - fwd), on_attn_f=on_attn * fwd,
      on_attn_b=on_attn * (1 - fwd),
      routed_bytes=np.array([split.routed_bytes[l] for l in routed]), link=link, M=M, N=N,
      attn_p0=attn_p0, attn_a0=attn_a0, exp_p0=float((es / N).sum()),
      exp_a0=float((ea / N).sum()), attn_unit=N / M * es / n, attn_unit_a=N / M * ea / n / M,
      exp_unit=es / n, exp_unit_a=ea / n / N,
      attn_mem=float(tables.device_memory_bytes[a]), exp_mem=float(tables.device_memory_bytes[e]),
      end_s=end, quantum=quantum)


def zebra_problem(parts: _Parts, R: int, min_offload: int = 0,
                  max_offload: int | None = None, fixed_fraction: float = 0.0
                  ) -> ExpertAssignmentProblem:
  """The expert-assignment problem of a zebra stage cut into ``R`` zebra microbatches (each
  compute task ``alpha + (1 - alpha) / R`` of the microbatch's, the bytes ``1 / R``)."""
  x = fixed_fraction + (1.0 - fixed_fraction) / R
  return ExpertAssignmentProblem(
      num_experts=parts.num_experts, num_attn=parts.M, num_expert=parts.N, num_microbatches=R,
      attn_fwd_s=parts.attn_f * x, attn_bwd_s=parts.attn_b * x, expert_fwd_s=parts.exp_f * x,
      expert_bwd_s=parts.exp_b * x, expert_on_attn_fwd_s=parts.on_attn_f * x,
      expert_on_attn_bwd_s=parts.on_attn_b * x, routed_bytes=parts.routed_bytes / R,
      link=parts.link, min_offload=min_offload, max_offload=max_offload)


def _bounds(parts: _Parts) -> tuple[int, int | None] | None:
  """``(min_offload, max_offload)`` from the groups' free memory with one microbatch in
  flight (``None``: no assignment can fit)."""
  free_a = parts.attn_mem - parts.attn_p0 - parts.attn_a0
  if free_a < 0:
    return None
  unit_a = float(np.max(parts.attn_unit + parts.attn_unit_a))
  hi = None if unit_a <= 0 else int(math.floor(free_a / unit_a))
  over = parts.exp_p0 + parts.exp_a0 - parts.exp_mem
  lo = 0
  if over > 0:
    unit_e = float(np.min(parts.exp_unit + parts.exp_unit_a))
    if unit_e <= 0:
      return None
    lo = int(math.ceil(over / unit_e))
  per_gpu = parts.num_experts // parts.N
  top = len(parts.routed) * per_gpu if hi is None else min(hi, len(parts.routed) * per_gpu)
  if lo > top:
    return None
  return lo, hi


def _cost(parts: _Parts, layers, attn, expert, R: int, offload: Sequence[int],
          time_s: float) -> ZebraStageCost:
  o = np.asarray(offload, dtype=np.float64)
  return ZebraStageCost(
      layers=layers, attn=attn, expert=expert, num_microbatches=R, routed_layers=parts.routed,
      offload=tuple(int(x) for x in offload), time_s=float(time_s),
      attn_param_bytes=parts.attn_p0 + float((parts.attn_unit * o).sum()),
      attn_act_bytes=parts.attn_a0 + float((parts.attn_unit_a * o).sum()),
      expert_param_bytes=max(0.0, parts.exp_p0 - float((parts.exp_unit * o).sum())),
      expert_act_bytes=max(0.0, parts.exp_a0 - float((parts.exp_unit_a * o).sum())),
      attn_memory_bytes=parts.attn_mem, expert_memory_bytes=parts.exp_mem, end_s=parts.end_s)


def _divisors(b: int, top: int, quantum: int = 1) -> list[int]:
  """The zebra microbatch counts: ``R <= top`` dividing ``b`` into multiples of ``quantum``."""
  return [r for r in range(1, min(b, top) + 1) if b % r == 0 and (b // r) % quantum == 0]


def zebra_stage_cost(tables: CostTables, layers: tuple[int, int], attn: tuple[int, int],
                     expert: tuple[int, int], microbatch_rows: int,
                     options: ZebraOptions | None = None, *, num_microbatches: int | None = None,
                     offload: Sequence[int] | None = None) -> ZebraStageCost | None:
  """Costs a zebra stage on layers ``layers`` (the module docstring's model).

  Args:
    tables: cost tables with a :attr:`~harpjax.compiler.profile.CostTables.routed_split`.
    layers: ``(i, j)``.
    attn, expert: ``(subcluster, submesh index)`` of the attention and the expert group.
    microbatch_rows: rows of a pipeline microbatch (``R`` must divide them).
    options: the choice's bounds (:class:`ZebraOptions`).
    num_microbatches, offload: ``R`` and ``o_l`` per routed layer as given (a plan's);
      ``None``: chosen (the fastest ``R``, the assignment
      :func:`~harpjax.compiler.plan.expert_assignment.optimize_assignment` finds).

  Returns:
    The :class:`ZebraStageCost`, or ``None`` where no zebra stage can run (no routed layer,
    no link, an expert group that does not divide the experts, nothing fits memory).

  Raises:
    PlanError: a given ``R`` that does not divide the rows, or an ``offload`` that is not
      whole chunks of the stage's routed layers.
  """
  options = options or ZebraOptions()
  i, j = (int(x) for x in layers)
  attn, expert = tuple(int(x) for x in attn), tuple(int(x) for x in expert)
  parts = _parts(tables, i, j, attn, expert, options.fwd_fraction)
  if parts is None:
    return None
  b = int(microbatch_rows)
  if num_microbatches is not None:
    R = int(num_microbatches)
    if R < 1 or b % R or (b // R) % parts.quantum:
      raise PlanError(f"zebra stage on layers {i}..{j}: {R} zebra microbatches must divide "
                      f"the microbatch's {b} rows into multiples of the attention group's "
                      f"{parts.quantum} data-parallel ways")
    problem = zebra_problem(parts, R, fixed_fraction=options.fixed_fraction)
    o = tuple(int(x) for x in (offload if offload is not None else (0,) * len(parts.routed)))
    if len(o) != len(parts.routed) or not all(
        0 <= x <= problem.per_gpu and x % problem.chunk[1] == 0 for x in o):
      raise PlanError(f"zebra stage on layers {i}..{j}: offload {list(o)} must give, for each "
                      f"of its {len(parts.routed)} routed layers, a multiple of "
                      f"{problem.chunk[1]} experts up to {problem.per_gpu}")
    return _cost(parts, (i, j), attn, expert, R, o, problem.iteration_time(o))
  got = _choose(parts, b, options)
  return None if got is None else _cost(parts, (i, j), attn, expert, *got)


def _choose(parts: _Parts, b: int, options: ZebraOptions, memo: dict | None = None
            ) -> tuple[int, tuple[int, ...], float] | None:
  """``(R, offload, seconds)`` of the fastest choice (``memo``: by :meth:`_Parts.key`)."""
  if memo is not None:
    key = (parts.key(), b, options)
    if key not in memo:
      memo[key] = _choose(parts, b, options)
    return memo[key]
  bounds = _bounds(parts)
  if bounds is None:
    return None
  lo, hi = bounds
  best = None
  for R in _divisors(b, options.max_microbatches, parts.quantum):
    try:
      problem = zebra_problem(parts, R, lo, hi, options.fixed_fraction)
    except PlanError:
      return None   # the memory bounds admit no whole chunks
    if options.assignment_limit == 0:
      if lo > 0:
        return None
      o = (0,) * problem.num_layers
      t = problem.iteration_time(o)
    else:
      count = (problem.max_chunks + 1) ** problem.num_layers
      try:
        if count <= options.assignment_limit:
          res = exhaustive_assignment(problem, options.assignment_limit)
        elif options.local_search:
          res = optimize_assignment(problem, 0)
        else:
          least = repair_assignment(problem, [0] * problem.num_layers)
          res = min((gather_and_squeeze(problem),
                     AssignmentResult(tuple(least), problem.iteration_time(least), 1, "least")),
                    key=lambda x: (x.iteration_time, sum(x.offload)))
      except PlanError:
        continue
      o, t = res.offload, res.iteration_time
    key = (t, R, sum(o))
    if best is None or key < best[0]:
      best = (key, R, tuple(o))
  if best is None:
    return None
  (t, _, _), R, o = best
  return R, o, t


def zebra_entry(tables: CostTables, shape: ZebraShape, B: int, microbatch_rows: int,
                options: ZebraOptions, memo: dict | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(time, activation bytes, end time)`` ``[L, L, 1]`` of ``shape``'s virtual subcluster,
  in the encoding of :func:`~harpjax.compiler.plan.mixed.fused_tables` (device memory 1,
  parameter bytes 0, activation bytes ``1 / (n_max + 0.5)`` with ``n_max`` the most pipeline
  microbatches in flight both groups hold: the DP's check ``p + n a <= mem`` is then
  ``n <= n_max``): each entry the choice :func:`zebra_stage_cost` makes. ``memo``: a dict
  the caller keeps across shapes of one search on ``tables`` (shapes that differ only in
  their number of stages share every entry)."""
  memo = {} if memo is None else memo
  L = tables.num_layers
  t_v = np.full((L, L, 1), np.inf)
  a_v = np.zeros((L, L, 1))
  e_v = np.zeros((L, L, 1))
  (a, e), (sh_a, sh_e) = shape.members, shape.shapes
  if sh_a not in tables.submeshes[a] or sh_e not in tables.submeshes[e]:
    return t_v, a_v, e_v
  attn = (a, tables.submeshes[a].index(sh_a))
  expert = (e, tables.submeshes[e].index(sh_e))
  for i in range(L):
    for j in range(i, L):
      parts = _parts(tables, i, j, attn, expert, options.fwd_fraction)
      got = None if parts is None else _choose(parts, int(microbatch_rows), options, memo)
      if got is None:
        continue
      c = _cost(parts, (i, j), attn, expert, *got)
      if c is None:
        continue
      n = c.max_inflight(int(B))
      if n < 1:
        continue
      t_v[i, j, 0] = c.time_s
      a_v[i, j, 0] = 1.0 / (n + 0.5)
      e_v[i, j, 0] = c.end_s
  return t_v, a_v, e_v


def candidate_zebra_shapes(tables: CostTables, options: ZebraOptions) -> list[ZebraShape]:
  """Every zebra shape: an ordered pair of subclusters linked to each other with a routed
  split, a submesh of each (``1..max_hosts_per_group`` whole hosts, and with ``sub_host``
  the single-host submeshes smaller than a host), every number of such stages the hosts
  allow."""
  if tables.routed_split is None or not any(tables.routed_split.routed(l)
                                            for l in range(tables.num_layers)):
    return []
  K = tables.num_subclusters
  out = []
  for a in range(K):
    for e in range(K):
      if a == e or not tables.link_bandwidth_bytes_per_s[a][e] > 0:
        continue
      for sh_a in _group_shapes(tables, a, options):
        for sh_e in _group_shapes(tables, e, options):
          probe = ZebraShape((a, e), (sh_a, sh_e), 1)
          top = 1
          while all(probe.reserved_hosts(tables, x, top + 1) <= tables.num_hosts[k]
                    for x, k in enumerate((a, e))):
            top += 1
          for n in range(1, top + 1):
            out.append(ZebraShape((a, e), (sh_a, sh_e), n))
  return out


def _group_shapes(tables: CostTables, k: int, options: ZebraOptions) -> list[tuple[int, int]]:
  N, M = tables.num_hosts[k], tables.devices_per_host[k]
  out = [(h, M) for h in range(1, min(N, options.max_hosts_per_group) + 1)]
  if options.sub_host:
    out = [(1, m) for n, m in tables.submeshes[k] if n == 1 and m < M] + out
  seen = []
  for s in out:
    if s in tables.submeshes[k] and s not in seen:
      seen.append(s)
  return seen
