"""The planner's independent reference: every plan of a small instance, scored by the rules.

:func:`brute_force` enumerates every plan of a small instance and scores it by its own rules
(warm-ups from the plan's own period via :func:`~harpjax.compiler.schedule.h1f1b_warmups`,
exact bin-packing of submeshes onto hosts with its own packer, :func:`packable`): by the
simulator's iteration time of its H-1F1B schedule (link-bound plans admitted), or by the
paper's Eq. 12 with its rule ``c <= t_max``. It is the reference the planner is proved against
on :func:`random_tables` instances and shares nothing with the planner but the cost tables, the
warm-up formula and the simulator (the judge). :func:`surrogate_minimum` is the same
enumeration for the DP's own per-period value.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from harpjax.cluster import paper_submeshes
from harpjax.compiler.profile import CostTables
from harpjax.compiler.schedule import (h1f1b_warmups, iteration_times, make_schedule,
                                       simulate)
from harpjax.errors import PlanError

Quad = tuple[int, int, int, int]  # (first layer, last layer, subcluster, submesh index)


@dataclasses.dataclass(frozen=True)
class BruteForceResult:
  """The optimum over every plan (``objective_s = inf`` and no stages when none is valid).

  ``objective_s`` is the ranked value: seconds (simulated, or Eq. 12 plus the first stage's
  end time), or for ``"min_cost"`` the hourly rate times those seconds."""
  objective_s: float
  t_max_s: float
  stages: tuple[Quad, ...]
  warmups: tuple[int, ...]
  num_plans: int
  num_valid: int


def packable(num_hosts: int, devices_per_host: int, shapes: Sequence[tuple[int, int]]) -> bool:
  """Exact test: can these submeshes be placed on the hosts (no chain assumption)?

  The brute force's own packer, written independently of :func:`harpjax.cluster.bin_pack`
  (which the planner and the device allocator share) so that the cross-check is independent.
  """
  whole = sum(n for n, m in shapes if n > 1 or m == devices_per_host)
  if whole > num_hosts:
    return False
  items = sorted((m for n, m in shapes if n == 1 and m < devices_per_host), reverse=True)
  bins = [devices_per_host] * (num_hosts - whole)

  def place(x):
    if x == len(items):
      return True
    seen = set()
    for b in range(len(bins)):
      if bins[b] >= items[x] and bins[b] not in seen:
        seen.add(bins[b])
        bins[b] -= items[x]
        if place(x + 1):
          return True
        bins[b] += items[x]
    return False
  return place(0)


def cut_s(tables: CostTables, a: int, b: int, j: int) -> float:
  """Seconds of a cut after layer ``j`` from a stage on subcluster ``a`` to one on ``b``, from
  the tables' link fields (``inf``: no link)."""
  if a == b:
    return float(tables.intra_latency_s[a] + tables.boundary_bytes[j]
                 / tables.intra_bandwidth_bytes_per_s[a])
  bw = tables.link_bandwidth_bytes_per_s[a][b]
  if bw <= 0:
    return math.inf
  return float(tables.link_latency_s[a][b] + tables.boundary_bytes[j] / bw)


def _host_cut_s(tables: CostTables, k: int, j: int) -> float:
  return float(tables.host_latency_s[k] + tables.boundary_bytes[j]
               / tables.host_bandwidth_bytes_per_s[k])


def _divides(devices_per_host: int, shapes) -> bool:
  ws = sorted({m for n, m in shapes if n == 1} | {devices_per_host})
  return all(b % a == 0 for a, b in zip(ws, ws[1:]))


def _host_priced(tables: CostTables, k: int) -> bool:
  return (tables.host_bandwidth_bytes_per_s is not None
          and _divides(tables.devices_per_host[k], tables.submeshes[k])
          and any(_host_cut_s(tables, k, j) != cut_s(tables, k, k, j)
                  for j in range(tables.num_layers)))


def _overflows(devices_per_host: int, shapes) -> bool:
  """Whether, placed one after the other in the lowest host with devices left, some
  single-host stage of the run does not fit the host in use (whole-host stages aside)."""
  room = 0
  for n, m in shapes:
    if n > 1 or m == devices_per_host:
      continue
    if room == 0:
      room = devices_per_host
    if m > room:
      return True
    room -= m
  return False


def sharing_cuts(tables: CostTables, stages: Sequence[Quad]) -> list[bool]:
  """Which cuts stay inside a host, by the oracle's own placement of each subcluster's run:
  a device map of the hosts, single-host stages written into the lowest host from the
  lowest free device up while they fit the host in use, whole-host stages into the highest
  free hosts; a single-host stage that does not fit the host in use (the run's last, see
  :func:`enumerate_plans`) goes to another host. Only where the tables give a host link that
  differs from the subcluster's own and the single-host widths divide each other and ``M``."""
  out = []
  for x in range(len(stages) - 1):
    out.append(False)
  x = 0
  while x < len(stages):
    k = stages[x][2]
    y = x
    while y + 1 < len(stages) and stages[y + 1][2] == k:
      y += 1
    N, M = tables.num_hosts[k], tables.devices_per_host[k]
    if _host_priced(tables, k):
      owner = [[None] * M for _ in range(N)]   # host -> device -> stage
      low, high, clean = 0, N - 1, True
      where = {}
      for z in range(x, y + 1):
        n, m = tables.submeshes[k][stages[z][3]]
        if n > 1 or m == M:
          if clean:
            where[z] = set(range(high - n + 1, high + 1))
            high -= n
          continue
        if not clean:
          continue
        free = [d for d in range(M) if owner[low][d] is None] if low < N else []
        if owner[low][0] is not None and len(free) < m:   # the host in use lacks room
          clean = False
          continue
        if not free:
          low += 1
          free = list(range(M))
        for d in free[:m]:
          owner[low][d] = z
        where[z] = {low}
        if len(free) == m:
          low += 1
      for z in range(x, y):
        out[z] = bool(z in where and z + 1 in where and where[z] & where[z + 1])
    x = y + 1
  return out


def plan_cuts(tables: CostTables, stages: Sequence[Quad]) -> list[float]:
  """The cut after each stage but the last: inside a host where :func:`sharing_cuts` says so,
  else on the link between the two stages' subclusters (or the subcluster's own)."""
  share = sharing_cuts(tables, stages)
  return [_host_cut_s(tables, a[2], a[1]) if share[x] else cut_s(tables, a[2], b[2], a[1])
          for x, (a, b) in enumerate(zip(stages, stages[1:]))]


def plan_rate(tables: CostTables, stages: Sequence[Quad]) -> float:
  """Hourly rate of a plan: its devices times their subcluster's price."""
  return sum(tables.price_per_gpu_hour[k] * tables.submeshes[k][s][0] * tables.submeshes[k][s][1]
             for _, _, k, s in stages)


def plan_fee(tables: CostTables, stages: Sequence[Quad], B: int) -> float:
  """Transfer fee per iteration of a plan, by its own count: each cut after layer ``j`` from
  subcluster ``a`` to ``b`` sends ``boundary_bytes[j]`` each way per microbatch, at the fee per
  GB of the class of ``(a, b)`` (same zone, another zone of the region, another region)."""
  fees = tables.fees
  if fees is None:
    return 0.0
  place = {n: (z, r) for n, z, r in fees.places}
  total = 0.0
  for a, b in zip(stages, stages[1:]):
    (za, ra), (zb, rb) = place[tables.subcluster_names[a[2]]], place[tables.subcluster_names[b[2]]]
    per_gb = (fees.fees.same_zone if za == zb else fees.fees.other_region
              if (ra is not None and rb is not None and ra != rb) else fees.fees.other_zone)
    total += 2.0 * B * float(tables.boundary_bytes[a[1]]) * per_gb / 1e9
  return total


def random_fees(rng: np.random.Generator, tables: CostTables, num_microbatches: int
                ) -> CostTables:
  """``tables`` with its subclusters in random zones of one or two regions and fees per GB
  large enough beside the GPUs' money (the instances' cut bytes are small) to change the
  best plan: a plan's fees per iteration are of the order of its GPUs' money."""
  from harpjax.cluster import TransferFees
  from harpjax.compiler.profile import LinkFees
  K = tables.num_subclusters
  zones = [int(rng.integers(0, 3)) for _ in range(K)]
  places = tuple((n, f"z{z}", "r0" if z < 2 else "r1")
                 for n, z in zip(tables.subcluster_names, zones))
  scale = float(rng.choice([1e6, 1e7, 3e7])) / num_microbatches
  fees = TransferFees(same_zone=float(rng.choice([0.0, 0.0, 0.2])) * scale,
                      other_zone=scale, other_region=2.0 * scale)
  return tables.replace(fees=LinkFees(places, fees))


def plan_numbers(tables: CostTables, stages: Sequence[Quad], B: int, eps: float):
  """``(t, c, ends, period, warmups)`` of a plan (``c`` has a trailing 0), or ``None`` when a
  stage has no finite time."""
  t = [float(tables.stage_time_s[k][i, j, s]) for i, j, k, s in stages]
  if not all(math.isfinite(x) for x in t):
    return None
  c = plan_cuts(tables, stages)
  ends = [0.0 if tables.end_time_s is None else float(tables.end_time_s[k][i, j, s])
          for i, j, k, s in stages]
  return t, c + [0.0], ends, max([max(t)] + c), h1f1b_warmups(c, max(t), eps)


def fits(tables: CostTables, stages: Sequence[Quad], warm: Sequence[int], B: int) -> bool:
  """Every stage fits ``mem_p + min(N, B) mem_a <= mem``."""
  for (i, j, k, s), w in zip(stages, warm):
    p = float(tables.param_mem_bytes[k][i, j, s])
    a = float(tables.act_mem_bytes[k][i, j, s])
    if not p + min(w, B) * a <= tables.device_memory_bytes[k]:
      return False
  return True


def enumerate_plans(tables: CostTables, *, use_all_devices: bool = False,
                    keep_order: bool = False, max_plans: int = 2_000_000):
  """Yields every plan (a tuple of :data:`Quad`) whose submeshes pack: each subcluster runs one
  contiguous group of stages, entered in any order over the links the tables have
  (``keep_order``: the tables' order, skipping allowed); with ``use_all_devices`` every device
  of every subcluster runs a stage (HARP's Eq. 19). On a subcluster whose cuts inside a host
  are priced at the host link, the stages sit in pipeline order (single-host ones filling
  hosts one after the other): a single-host stage that does not fit the host in use can only
  be the last of the subcluster's run.

  Raises:
    PlanError: more than ``max_plans`` plans (the instance is too large for brute force).
  """
  L, K = tables.num_layers, tables.num_subclusters
  stack: list[Quad] = []
  count = [0]

  def rec(i, k, entered, shapes):
    N, M = tables.num_hosts[k], tables.devices_per_host[k]
    if shapes and _host_priced(tables, k) and _overflows(M, shapes):
      return   # placed in order, a single-host stage that does not fit its host ends the run
    for j in range(i, L):
      for s, shape in enumerate(tables.submeshes[k]):
        mine = shapes + [shape]
        used = sum(n * m for n, m in mine)
        if used > N * M or not packable(N, M, mine):
          continue
        full = used == N * M
        stack.append((i, j, k, s))
        if j == L - 1:
          if not use_all_devices or (full and len(entered) == K):
            count[0] += 1
            if count[0] > max_plans:
              raise PlanError(f"brute force: more than {max_plans} plans")
            yield tuple(stack)
        else:
          if used < N * M:
            yield from rec(j + 1, k, entered, mine)
          if full or not use_all_devices:
            for k2 in range(K):
              if k2 in entered or (keep_order and k2 < k) or \
                  (keep_order and use_all_devices and k2 != k + 1):
                continue
              if math.isfinite(cut_s(tables, k, k2, 0)):
                yield from rec(j + 1, k2, entered | {k2}, [])
        stack.pop()

  firsts = [0] if (keep_order and use_all_devices) else range(K)
  for k in firsts:
    yield from rec(0, k, frozenset([k]), [])


def brute_force(tables: CostTables, num_microbatches: int, eps: float = 0.1,
                max_plans: int = 2_000_000, *, use_all_devices: bool = False,
                keep_order: bool = False, objective: str = "min_time",
                budget_per_hour: float = math.inf, time_limit_s: float = math.inf,
                cost_model: str = "simulator", fwd_fraction: float = 1.0 / 3.0,
                exact_simulator: bool = False) -> BruteForceResult:
  """Scores every plan of :func:`enumerate_plans`.

  A plan is valid when its stage times are finite, every stage fits ``mem_p + min(N_i, B)
  mem_a <= mem`` with ``N_i`` from :func:`~harpjax.compiler.schedule.h1f1b_warmups` (relative
  to the plan's own period ``max(t_max, max c)``), and, with ``cost_model="eq12"``, every cut
  ``c_i <= t_max``. Its time: the simulator's iteration time of that H-1F1B schedule with the
  stages' end times (``"simulator"``; forward ``fwd_fraction`` of each stage's time), or Eq.
  12 plus the first stage's end time (``"eq12"``). ``objective`` ``"min_time"`` minimises the
  time (within ``budget_per_hour``, the plan's rate, :func:`plan_rate`), ``"min_cost"``
  minimises rate times time (within ``time_limit_s``); where the tables charge transfer fees
  (:func:`plan_fee`) the money is rate times time plus 3600 times the fee per iteration and
  the budget bounds rate plus 3600 fee / time. The simulated times come from
  :func:`~harpjax.compiler.schedule.iteration_times`, or with ``exact_simulator`` from
  :func:`~harpjax.compiler.schedule.simulate` itself (the same numbers, tested; slower).
  """
  B = int(num_microbatches)
  best = [math.inf, math.inf, (), ()]
  counts = [0, 0]
  valid = []
  for stages in enumerate_plans(tables, use_all_devices=use_all_devices,
                                keep_order=keep_order, max_plans=max_plans):
    counts[0] += 1
    nums = plan_numbers(tables, stages, B, eps)
    if nums is None:
      continue
    t, c, ends, period, warm = nums
    if cost_model == "eq12" and period > max(t):
      continue
    if not fits(tables, stages, warm, B):
      continue
    rate = plan_rate(tables, stages) if tables.price_per_gpu_hour is not None else 0.0
    if rate > budget_per_hour:
      continue
    valid.append((stages, t, c, ends, warm, rate))
  if cost_model == "eq12":
    times = [sum(x + 2.0 * y for x, y in zip(t, c)) + e[0] + (B - 1) * max(t)
             for _, t, c, e, _, _ in valid]
  elif exact_simulator:
    times = []
    for _, t, c, e, w, _ in valid:
      f = [x * fwd_fraction for x in t]
      b = [x - y for x, y in zip(t, f)]
      sched = make_schedule("h1f1b", len(t), B, w)
      times.append(simulate(f, b, c[:-1], sched, end_cost=e).iteration_time)
  else:   # the simulator's batch kernel: the same times bit for bit, a hundred times faster
    S = max((len(v[1]) for v in valid), default=1)
    pad = lambda x, fill=0.0: list(x) + [fill] * (S - len(x))
    times = iteration_times([pad(v[1]) for v in valid], [pad(v[2]) for v in valid],
                            [pad(v[3]) for v in valid], [pad(v[4], 1) for v in valid],
                            [len(v[1]) for v in valid], B, fwd_fraction).tolist()
  for (stages, t, _, _, warm, rate), x in zip(valid, times):
    if x > time_limit_s:
      continue
    fee = plan_fee(tables, stages, B)
    if fee and rate + 3600.0 * fee / x > budget_per_hour * (1 + 1e-12):
      continue
    counts[1] += 1
    obj = x * rate + 3600.0 * fee if objective == "min_cost" else x
    if obj < best[0]:
      best[:] = [obj, max(t), stages, warm]
  return BruteForceResult(objective_s=best[0], t_max_s=best[1], stages=best[2],
                          warmups=tuple(best[3]), num_plans=counts[0], num_valid=counts[1])


def last_hit(t, c, period, link_hits=True):
  """``("stage", x)`` or ``("cut", x)``: the plan's last stage of time ``period``, or the cut
  of ``period`` after it (``link_hits``); ``None`` without one."""
  last = None
  for x in range(len(t)):
    if t[x] == period:
      last = ("stage", x)
    if link_hits and x < len(t) - 1 and c[x] == period:
      last = ("cut", x)
  return last


def surrogate_minimum(tables: CostTables, num_microbatches: int, eps: float, period: float,
                      discount: float, *, link_hits: bool = True, **modes) -> float:
  """The DP's value at one candidate period, by enumeration: over the plans whose period is
  exactly ``period`` (with ``link_hits=False``: whose slowest *stage* takes ``period`` and no
  cut is slower) and that fit memory with warm-ups relative to it, the least ``sum (t + 2c) +
  e_0 - discount * period * (min(N_h, B) - 1)``, ``h`` the last stage of time ``period``
  unless a cut of ``period`` follows it (:func:`harpjax.compiler.plan.dp_kernel.solve_tau`).
  """
  B = int(num_microbatches)
  best = math.inf
  for stages in enumerate_plans(tables, **modes):
    nums = plan_numbers(tables, stages, B, eps)
    if nums is None:
      continue
    t, c, ends, p, warm = nums
    if (p != period) if link_hits else (max(t) != period or p > period):
      continue
    if not fits(tables, stages, warm, B):
      continue
    value = sum(x + 2.0 * y for x, y in zip(t, c)) + ends[0]
    last = last_hit(t, c, period, link_hits)
    if last[0] == "stage":
      value -= discount * period * (min(warm[last[1]], B) - 1)
    best = min(best, value)
  return best


def random_tables(rng: np.random.Generator, num_layers: int | None = None,
                  num_subclusters: int | None = None, max_devices: int = 4,
                  odd_hosts: bool = False, priced: bool = False) -> CostTables:
  """A small random heterogeneous instance for cross-checks against :func:`brute_force`.

  2-3 subclusters of 1-2 hosts x 1, 2 or 4 devices (at most ``max_devices`` each), different
  speeds and memories, sub-linear scaling with the submesh size, parameters sometimes sharded
  (tensor parallel) and sometimes replicated, ~8% of entries missing (``inf``), fast and slow
  links; half of them with links between any two subclusters (some missing, some asymmetric).
  About a fifth of the instances are infeasible and a third have binding memory. With
  ``odd_hosts`` some subclusters are 2 hosts x 3 devices, whose ``(1, 2)`` stages do not always
  pack (three of them add up to 6 devices but do not fit). With ``priced`` each subcluster has
  a price per device-hour.
  """
  K = num_subclusters or int(rng.integers(2, 4))
  L = num_layers or int(rng.integers(K, 9))
  hosts, dph, shapes = [], [], []
  for _ in range(K):
    n, m = int(rng.integers(1, 3)), int(rng.choice([1, 2, 2, 4]))
    if odd_hosts and rng.random() < 0.5:
      n, m = 2, 3
    elif n * m > max_devices:
      n = 1
    hosts.append(n)
    dph.append(m)
    shapes.append(paper_submeshes(n, m))
  work = rng.uniform(0.5, 2.0, L)
  speed = rng.uniform(0.5, 3.0, K)
  pw, aw = rng.uniform(0.5, 2.0, L), rng.uniform(0.1, 1.0, L)
  st, pm, am = [], [], []
  for k in range(K):
    S = len(shapes[k])
    t, p, a = np.full((L, L, S), np.inf), np.zeros((L, L, S)), np.zeros((L, L, S))
    for i in range(L):
      for j in range(i, L):
        for s, (n, m) in enumerate(shapes[k]):
          g = n * m
          if rng.random() < 0.08:
            continue
          scale = g ** rng.uniform(0.6, 1.0) / rng.uniform(0.9, 1.1)
          t[i, j, s] = round(work[i:j + 1].sum() / speed[k] / scale, 3) + 0.001
          p[i, j, s] = pw[i:j + 1].sum() / (int(rng.choice([1, g])) if g > 1 else 1)
          a[i, j, s] = aw[i:j + 1].sum() / g
    st.append(t)
    pm.append(p)
    am.append(a)
  inter = tuple(float(rng.choice([0.5, 2.0, 10.0])) for _ in range(K - 1))
  pair = None
  if rng.random() < 0.5:   # links between any two subclusters, some missing
    bw = rng.choice([0.0, 0.5, 2.0, 10.0], size=(K, K))
    bw = np.where(rng.random((K, K)) < 0.5, bw, bw.T)   # mostly symmetric
    for k in range(K - 1):
      bw[k, k + 1] = inter[k]
    pair = tuple(tuple(float(x) for x in row) for row in bw)
  return CostTables(
      num_layers=L, subcluster_names=tuple(f"c{k}" for k in range(K)), num_hosts=tuple(hosts),
      devices_per_host=tuple(dph),
      device_memory_bytes=tuple(float(rng.uniform(1.5, 9.0)) for _ in range(K)),
      submeshes=tuple(shapes), stage_time_s=tuple(st), param_mem_bytes=tuple(pm),
      act_mem_bytes=tuple(am), boundary_bytes=rng.uniform(0, 1.0, L),
      intra_bandwidth_bytes_per_s=tuple(float(rng.choice([2.0, 20.0])) for _ in range(K)),
      intra_latency_s=(0.01,) * K,
      price_per_gpu_hour=tuple(float(rng.choice([0.5, 1.0, 1.5, 3.0])) for _ in range(K))
      if priced else None,
      inter_bandwidth_bytes_per_s=inter, inter_latency_s=(0.05,) * (K - 1),
      link_bandwidth_bytes_per_s=pair,
      link_latency_s=None if pair is None else ((0.05,) * K,) * K)


# --------------------------------------------------------------------------- ZeRO and offload

ZERO_PAIRS = tuple((z, o, False) for o in (False, True) for z in (0, 1, 2, 3))


def residual_pairs(levels=(0, 1, 2, 3)) -> tuple[tuple[int, bool, bool], ...]:
  """Every (level of ``levels``, offload, residual offload)."""
  return tuple((z, o, r) for r in (False, True) for o in (False, True) for z in levels)


def variant_numbers(tables: CostTables, k: int, i: int, j: int, s: int, zero: int,
                    offload: bool, offload_activations: bool = False
                    ) -> tuple[float, float, float, float] | None:
  """``(time, state bytes, activation bytes per in-flight microbatch, end time)`` of one entry
  under a ZeRO level and offload, from the tables' fields by the rules written out once more
  (``None``: not allowed): the state is weights ``W``, gradients ``G`` (half each of what is
  not optimizer state) and optimizer state ``O``; level 1 splits ``O`` over the ``dp``
  devices, level 2 ``G`` too, level 3 ``W`` too; level 3 gathers the weights twice per
  microbatch, levels 1 and 2 once per iteration; offload moves ``O`` (as split) to the device
  and back once per iteration, and the device must still hold the whole state for the update.
  Residual offload (``offload_activations``): a microbatch's residuals ``A`` go to the host
  after its forward and come back before its backward (two trips per microbatch over the host
  link), and the device holds two microbatches' residuals at most, counted as state: ``2 A``
  more state, none per microbatch in flight."""
  t = float(tables.stage_time_s[k][i, j, s])
  if not math.isfinite(t):
    return None
  P = float(tables.param_mem_bytes[k][i, j, s])
  A = float(tables.act_mem_bytes[k][i, j, s])
  e = 0.0 if tables.end_time_s is None else float(tables.end_time_s[k][i, j, s])
  state = P
  if zero or offload:
    O = float(tables.opt_mem_bytes[k][i, j, s])
    g = 0.0 if tables.gather_time_s is None else float(tables.gather_time_s[k][i, j, s])
    dp = tables.logical_mesh_of(k, i, j, s)[0]
    parts = [(P - O) / 2.0, (P - O) / 2.0, O]            # weights, gradients, optimizer state
    split = {1: (2,), 2: (1, 2), 3: (0, 1, 2)}.get(zero, ())
    held = [x / dp if n in split else x for n, x in enumerate(parts)]
    if zero == 3:
      t += 2.0 * g
    elif zero:
      e += g
    state = sum(held)
    if offload:
      if state > tables.device_memory_bytes[k]:
        return None
      e += 2.0 * held[2] / tables.offload_bandwidth_bytes_per_s[k]
      state -= held[2]
  if offload_activations:
    t += 2.0 * A / tables.offload_bandwidth_bytes_per_s[k]
    state += 2.0 * A
    A = 0.0
  return t, state, A, e


def all_variants(tables: CostTables, pairs=ZERO_PAIRS) -> CostTables:
  """Tables whose submesh choices are every (submesh, level, offload, residual offload) of
  ``pairs``, none dropped (what :func:`brute_force` enumerates with the new freedom)."""
  if tables.offload_bandwidth_bytes_per_s is None:
    pairs = [(z, o, r) for z, o, r in pairs if not o and not r]
  if tables.opt_mem_bytes is None:
    pairs = [(z, o, r) for z, o, r in pairs if not z and not o]
  L = tables.num_layers
  fields = {f: [] for f in ("submeshes", "stage_time_s", "param_mem_bytes", "act_mem_bytes",
                            "end_time_s", "logical_mesh", "variants")}
  for k in range(tables.num_subclusters):
    cols = {f: [] for f in fields}
    for var in pairs:
      for s, shape in enumerate(tables.submeshes[k]):
        t, p, a, e = (np.full((L, L), np.inf), np.zeros((L, L)), np.zeros((L, L)),
                      np.zeros((L, L)))
        for i in range(L):
          for j in range(i, L):
            nums = variant_numbers(tables, k, i, j, s, *var)
            if nums is not None:
              t[i, j], p[i, j], a[i, j], e[i, j] = nums
        cols["submeshes"].append(shape)
        cols["variants"].append(var)
        cols["stage_time_s"].append(t)
        cols["param_mem_bytes"].append(p)
        cols["end_time_s"].append(e)
        cols["act_mem_bytes"].append(a)
        lm = np.zeros((L, L, 2), np.int64)
        for i in range(L):
          for j in range(L):
            lm[i, j] = tables.logical_mesh_of(k, i, j, s)
        cols["logical_mesh"].append(lm)
    fields["submeshes"].append(tuple(cols["submeshes"]))
    fields["variants"].append(tuple(cols["variants"]))
    for f in ("stage_time_s", "param_mem_bytes", "act_mem_bytes", "end_time_s",
              "logical_mesh"):
      fields[f].append(np.stack(cols[f], axis=2))
  return tables.replace(opt_mem_bytes=None, gather_time_s=None,
                        **{f: tuple(v) for f, v in fields.items()})


def random_zero_tables(rng: np.random.Generator, host_share: float = 0.6,
                       **kw) -> CostTables:
  """:func:`random_tables` with the optimizer state's share of each entry's state (0.3-0.8),
  the weights' all-gather seconds (up to a third of the stage time), end times, sometimes a
  host link for offload (in a ``host_share`` of the instances), and device memory drawn
  tighter (often nothing fits at level 0)."""
  base = random_tables(rng, **kw)
  K, L = base.num_subclusters, base.num_layers
  share = rng.uniform(0.3, 0.8, L)
  opt, gat, end = [], [], []
  for k in range(K):
    p, t = base.param_mem_bytes[k], base.stage_time_s[k]
    frac = np.zeros_like(p)
    for i in range(L):
      for j in range(i, L):
        frac[i, j] = share[i:j + 1].mean()
    opt.append(p * frac)
    finite = np.isfinite(t)
    gat.append(np.where(finite, np.round(rng.uniform(0, 0.33, t.shape) * np.where(
        finite, t, 0.0), 3), 0.0))
    end.append(np.where(finite, np.round(rng.uniform(0, 0.5, t.shape), 2), 0.0))
  offload = None
  if rng.random() < host_share:
    offload = tuple(float(rng.choice([1.0, 4.0, 20.0])) for _ in range(K))
  mem = tuple(float(m) * float(rng.choice([0.4, 0.6, 1.0])) for m in base.device_memory_bytes)
  return base.replace(opt_mem_bytes=tuple(opt), gather_time_s=tuple(gat),
                      end_time_s=tuple(end), offload_bandwidth_bytes_per_s=offload,
                      device_memory_bytes=mem)
