"""Numeric kernel of the pipeline simulator, on plain arrays, with a pure-Python twin.

The model is the DAG of HARP §4.2.1: compute nodes ``F``/``B`` per (stage, microbatch), one
transfer node per (link, direction, microbatch), and three kinds of edges:

* ``E_comp``: a stage runs its tasks one at a time, in its table's order;
* ``E_comm``: a link direction sends one message at a time, in FIFO order of enqueueing (a
  forward message is enqueued when its ``F`` ends, so the order is the sender's table order);
* ``E_dep``: ``F(s, m)`` needs the activation of ``m`` delivered from stage ``s - 1``;
  ``B(s, m)`` needs the gradient of ``m`` delivered from stage ``s + 1`` (the last stage's
  ``B(m)`` needs only its own ``F(m)``, which its table runs earlier).

Every node starts as soon as all its predecessors are done (Eq. 3 with equality), so the start
times are the longest-path distances in the DAG. Two kernels compute them:

* :func:`simulate_kernel` (Numba when available): a topological sweep. Stages are visited
  forwards then backwards; each runs its table as far as the data already computed allows.
  Every node is computed once, after all its predecessors, so the cost is
  ``O(tasks + sweeps * stages)``.
* :func:`simulate_reference` (pure Python): an independent discrete-event simulation that pops
  events from a heap in time order. Tests cross-check the two on random tables.

Both take the task table as two ``[num_stages, 2 * num_microbatches]`` integer arrays (kind
``0 = F``, ``1 = B``; microbatch index) and return the same arrays. :func:`analyze` turns their
output into the per-phase breakdown (compute, exposed communication, idle, bubble, overlap).
"""

from __future__ import annotations

import heapq

import numpy as np

from harpjax.errors import interruptible_kernel

try:  # Numba is a hard dependency, but the twin keeps the simulator usable without it.
  import numba as _numba
except ImportError:  # pragma: no cover
  _numba = None

__all__ = ["simulate_kernel", "simulate_python", "simulate_reference", "analyze",
           "steady_positions", "iteration_times", "iteration_time_kernel", "KIND_F", "KIND_B",
           "HAVE_NUMBA", "simulate_groups", "simulate_groups_reference", "group_channels"]

KIND_F = 0
KIND_B = 1
HAVE_NUMBA = _numba is not None


def _simulate_impl(kinds, mbs, fwd, bwd, comm_fwd, comm_bwd, task_start, task_end,
                   msg_start, msg_end, stuck):
  """Longest-path start times of every node (see module docstring).

  Args:
    kinds: ``[S, n]`` int, ``0`` for F, ``1`` for B; ``n = 2 * B``.
    mbs: ``[S, n]`` int, the microbatch of each task.
    fwd: ``[S, B]`` float, forward seconds of each (stage, microbatch).
    bwd: ``[S, B]`` float, backward seconds.
    comm_fwd: ``[max(S - 1, 1), B]`` float, seconds to send the activation of a microbatch
      from stage ``i`` to ``i + 1``.
    comm_bwd: ``[max(S - 1, 1), B]`` float, seconds to send the gradient from ``i + 1`` to
      ``i``.
    task_start: ``[S, n]`` float output, start of each table entry, seconds.
    task_end: ``[S, n]`` float output.
    msg_start: ``[2, max(S - 1, 1), B]`` float output, transfer start per (direction, link,
      microbatch); direction ``0`` is activations (``i -> i + 1``), ``1`` gradients.
    msg_end: ``[2, max(S - 1, 1), B]`` float output, delivery time.
    stuck: ``[S]`` int output: on deadlock, the table position each stage is stuck at
      (``n`` for stages that finished); untouched otherwise.

  Returns:
    ``0`` on success, ``1`` if the table deadlocks.
  """
  num_stages = kinds.shape[0]
  n = kinds.shape[1]
  num_mb = fwd.shape[1]
  # -1 marks "not delivered yet"; every real time is >= 0.
  act_ready = np.full((num_stages, num_mb), -1.0)
  grad_ready = np.full((num_stages, num_mb), -1.0)
  for m in range(num_mb):
    act_ready[0, m] = 0.0
  pos = np.zeros(num_stages, np.int64)
  free = np.zeros(num_stages)
  link_free = np.zeros((2, max(num_stages - 1, 1)))
  remaining = num_stages * n
  while remaining > 0:
    progressed = False
    for sweep in range(2 * num_stages):
      s = sweep if sweep < num_stages else 2 * num_stages - 1 - sweep
      while pos[s] < n:
        p = pos[s]
        m = mbs[s, p]
        if kinds[s, p] == 0:
          ready = act_ready[s, m]
          dur = fwd[s, m]
        else:
          ready = grad_ready[s, m]
          dur = bwd[s, m]
        if ready < 0.0:
          break
        t0 = free[s] if free[s] > ready else ready
        t1 = t0 + dur
        task_start[s, p] = t0
        task_end[s, p] = t1
        free[s] = t1
        if kinds[s, p] == 0:
          if s + 1 < num_stages:
            a = link_free[0, s] if link_free[0, s] > t1 else t1
            e = a + comm_fwd[s, m]
            msg_start[0, s, m] = a
            msg_end[0, s, m] = e
            link_free[0, s] = e
            act_ready[s + 1, m] = e
          else:
            grad_ready[s, m] = t1
        elif s > 0:
          a = link_free[1, s - 1] if link_free[1, s - 1] > t1 else t1
          e = a + comm_bwd[s - 1, m]
          msg_start[1, s - 1, m] = a
          msg_end[1, s - 1, m] = e
          link_free[1, s - 1] = e
          grad_ready[s - 1, m] = e
        pos[s] = p + 1
        remaining -= 1
        progressed = True
    if not progressed:
      for s in range(num_stages):
        stuck[s] = pos[s]
      return 1
  return 0


if HAVE_NUMBA:
  _simulate_jit = _numba.njit(cache=True, nogil=True)(_simulate_impl)
else:  # pragma: no cover
  _simulate_jit = _simulate_impl


# --------------------------------------------------------------------------- device groups


def _simulate_groups_impl(gstage, gkind, gmb, fwd, bwd, comm_fwd, comm_bwd, hold, chan_fwd,
                          chan_bwd, num_channels, task_start, task_end, msg_start, msg_end,
                          stuck):
  """The same DAG when device groups run several stages each (an interleaved schedule).

  A group computes one task at a time in its order, whichever of its stages it belongs to. A
  transfer between stages ``i`` and ``i + 1`` goes over a *channel* (``chan_fwd[i]`` for the
  activation, ``chan_bwd[i]`` for the gradient): one message at a time in FIFO order, every
  channel fed by one group (the channel of a pair of groups and a direction), so FIFO is the
  sending group's order. Channel ``-1`` is local: the two stages share a group and the value
  is there when its producer ends.

  Args:
    gstage: ``[G, n]`` int, the stage of each group task.
    gkind: ``[G, n]`` int, ``0`` F, ``1`` B.
    gmb: ``[G, n]`` int, the microbatch.
    fwd: ``[S, B]`` forward seconds; bwd: ``[S, B]`` backward seconds.
    comm_fwd: ``[max(S - 1, 1), B]`` activation seconds over cut ``i``; comm_bwd likewise
      for gradients.
    hold: ``[G, n]`` seconds the group stays busy after the task ends, its messages already
      sent (a stage's optimizer update right after its last backward: interleaved updates).
    chan_fwd: ``[max(S - 1, 1)]`` int channel of cut ``i``'s activations (``-1`` local);
      chan_bwd likewise for gradients.
    num_channels: channels (``>= 1``).
    task_start: ``[G, n]`` output; task_end: ``[G, n]`` output.
    msg_start: ``[2, max(S - 1, 1), B]`` output (a local transfer starts and ends when its
      producer ends); msg_end likewise.
    stuck: ``[G]`` output: on deadlock, where each group is stuck.

  Returns:
    ``0`` on success, ``1`` if the order deadlocks.
  """
  num_groups = gstage.shape[0]
  n = gstage.shape[1]
  num_stages = fwd.shape[0]
  num_mb = fwd.shape[1]
  act_ready = np.full((num_stages, num_mb), -1.0)
  grad_ready = np.full((num_stages, num_mb), -1.0)
  for m in range(num_mb):
    act_ready[0, m] = 0.0
  pos = np.zeros(num_groups, np.int64)
  free = np.zeros(num_groups)
  chan_free = np.zeros(num_channels)
  remaining = num_groups * n
  while remaining > 0:
    progressed = False
    for sweep in range(2 * num_groups):
      g = sweep if sweep < num_groups else 2 * num_groups - 1 - sweep
      while pos[g] < n:
        p = pos[g]
        s = gstage[g, p]
        m = gmb[g, p]
        if gkind[g, p] == 0:
          ready = act_ready[s, m]
          dur = fwd[s, m]
        else:
          ready = grad_ready[s, m]
          dur = bwd[s, m]
        if ready < 0.0:
          break
        t0 = free[g] if free[g] > ready else ready
        t1 = t0 + dur
        task_start[g, p] = t0
        task_end[g, p] = t1
        free[g] = t1 + hold[g, p]
        if gkind[g, p] == 0:
          if s + 1 < num_stages:
            c = chan_fwd[s]
            a = t1
            e = t1
            if c >= 0:
              if chan_free[c] > a:
                a = chan_free[c]
              e = a + comm_fwd[s, m]
              chan_free[c] = e
            msg_start[0, s, m] = a
            msg_end[0, s, m] = e
            act_ready[s + 1, m] = e
          else:
            grad_ready[s, m] = t1
        elif s > 0:
          c = chan_bwd[s - 1]
          a = t1
          e = t1
          if c >= 0:
            if chan_free[c] > a:
              a = chan_free[c]
            e = a + comm_bwd[s - 1, m]
            chan_free[c] = e
          msg_start[1, s - 1, m] = a
          msg_end[1, s - 1, m] = e
          grad_ready[s - 1, m] = e
        pos[g] = p + 1
        remaining -= 1
        progressed = True
    if not progressed:
      for g in range(num_groups):
        stuck[g] = pos[g]
      return 1
  return 0


if HAVE_NUMBA:
  _simulate_groups_jit = _numba.njit(cache=True, nogil=True)(_simulate_groups_impl)
else:  # pragma: no cover
  _simulate_groups_jit = _simulate_groups_impl


def group_channels(device_groups) -> tuple[np.ndarray, np.ndarray, int]:
  """The channels of each cut's two directions, from the stages' device groups: one per
  ordered pair of distinct groups (the link from one group's devices to another's, which
  every cut between them shares), ``-1`` within a group.

  Returns:
    ``(chan_fwd, chan_bwd, num_channels)``: two ``[max(S - 1, 1)]`` int64 arrays and the
    count (at least 1).
  """
  groups = [int(g) for g in device_groups]
  L = max(len(groups) - 1, 1)
  chan_fwd = np.full(L, -1, np.int64)
  chan_bwd = np.full(L, -1, np.int64)
  ids: dict[tuple[int, int], int] = {}
  for i in range(len(groups) - 1):
    a, b = groups[i], groups[i + 1]
    if a != b:
      chan_fwd[i] = ids.setdefault((a, b), len(ids))
      chan_bwd[i] = ids.setdefault((b, a), len(ids))
  return chan_fwd, chan_bwd, max(len(ids), 1)


def simulate_groups(gstage, gkind, gmb, fwd, bwd, comm_fwd, comm_bwd, device_groups,
                    use_numba=True, hold=None):
  """Runs :func:`_simulate_groups_impl` (Numba when ``use_numba`` and installed); ``hold``:
  ``[G, n]`` seconds each group stays busy after a task (default none).

  Returns:
    ``(status, task_start, task_end, msg_start, msg_end, stuck)``, the task arrays ``[G, n]``
    in group order.
  """
  G, n = gstage.shape
  L = comm_fwd.shape[0]
  B = fwd.shape[1]
  chan_fwd, chan_bwd, nch = group_channels(device_groups)
  out = (np.zeros((G, n)), np.zeros((G, n)), np.zeros((2, L, B)), np.zeros((2, L, B)),
         np.full(G, n, np.int64))
  hold = np.zeros((G, n)) if hold is None else np.ascontiguousarray(hold, np.float64)
  fn = _simulate_groups_jit if use_numba else _simulate_groups_impl
  status = fn(gstage, gkind, gmb, fwd, bwd, comm_fwd, comm_bwd, hold, chan_fwd, chan_bwd, nch,
              *out)
  return (int(status),) + out


def simulate_groups_reference(gstage, gkind, gmb, fwd, bwd, comm_fwd, comm_bwd,
                              device_groups, hold=None):
  """An independent twin of :func:`simulate_groups`: discrete events from a heap in time
  order (tasks start when their group is free and their input delivered; a channel sends
  its queue in order of enqueueing). Same arguments and results."""
  G, n = gstage.shape
  S, B = fwd.shape
  L = comm_fwd.shape[0]
  hold = np.zeros((G, n)) if hold is None else np.asarray(hold, np.float64)
  chan_fwd, chan_bwd, nch = group_channels(device_groups)
  start, end = np.zeros((G, n)), np.zeros((G, n))
  msg_start, msg_end = np.zeros((2, L, B)), np.zeros((2, L, B))
  ready = {}                      # (kind, stage, mb) -> time the input is there
  for m in range(B):
    ready[(0, 0, m)] = 0.0
  pos = [0] * G
  busy_until = [0.0] * G
  queues: list[list] = [[] for _ in range(nch)]   # (enqueue time, seq, d, link, m)
  chan_busy = [0.0] * nch
  heap: list = []
  seq = 0
  now = 0.0

  def deliver(d, link, m, t):
    ready[(0, link + 1, m) if d == 0 else (1, link, m)] = t

  def enqueue(d, link, m, t):
    nonlocal seq
    c = int((chan_fwd if d == 0 else chan_bwd)[link])
    if c < 0:
      msg_start[d, link, m] = msg_end[d, link, m] = t
      deliver(d, link, m, t)
      return
    queues[c].append((t, seq, d, link, m))
    seq += 1

  done = 0
  while done < G * n:
    progressed = False
    for g in range(G):         # start the next task of each free group whose input is there
      if pos[g] < n and busy_until[g] <= now:
        p = pos[g]
        s, k, m = int(gstage[g, p]), int(gkind[g, p]), int(gmb[g, p])
        r = ready.get((k, s, m))
        if r is not None and r <= now:
          t0 = max(now, busy_until[g])
          t1 = t0 + (fwd if k == 0 else bwd)[s, m]
          start[g, p], end[g, p] = t0, t1
          busy_until[g] = t1 + hold[g, p]
          pos[g] += 1
          done += 1
          heapq.heappush(heap, (t1, 0, g, s, k, m))
          if hold[g, p] > 0.0:   # the group frees later: wake then
            heapq.heappush(heap, (t1 + hold[g, p], 2, g))
          progressed = True
    for c in range(nch):       # start the head of each idle channel
      if queues[c] and chan_busy[c] <= now and queues[c][0][0] <= now:
        _, _, d, link, m = queues[c].pop(0)
        t1 = now + (comm_fwd if d == 0 else comm_bwd)[link, m]
        msg_start[d, link, m], msg_end[d, link, m] = now, t1
        chan_busy[c] = t1
        heapq.heappush(heap, (t1, 1, c, d, link, m))
        progressed = True
    if progressed:
      continue
    if not heap:
      return (1, start, end, msg_start, msg_end, np.asarray(pos, np.int64))
    now = heap[0][0]
    while heap and heap[0][0] <= now:
      ev = heapq.heappop(heap)
      if ev[1] == 0:
        _, _, g, s, k, m = ev
        if k == 0:
          if s + 1 < S:
            enqueue(0, s, m, ev[0])
          else:
            ready[(1, s, m)] = ev[0]
        elif s > 0:
          enqueue(1, s - 1, m, ev[0])
      elif ev[1] == 1:
        _, _, c, d, link, m = ev
        deliver(d, link, m, ev[0])
  return (0, start, end, msg_start, msg_end, np.full(G, n, np.int64))


# --------------------------------------------------------------------------- 1F1B-style plans


def _warmup_tables_impl(warmups, num_mb, kinds, mbs):
  """Fills ``kinds``/``mbs`` (``[S, 2B]``) with the table of 1F1B-style warm-up counts: the
  order of :func:`harpjax.compiler.schedule.table_from_warmups`."""
  for s in range(warmups.shape[0]):
    w = warmups[s]
    if w > num_mb:
      w = num_mb
    p = 0
    for m in range(w):
      kinds[s, p] = 0
      mbs[s, p] = m
      p += 1
    next_f = w
    for m in range(num_mb):
      kinds[s, p] = 1
      mbs[s, p] = m
      p += 1
      if next_f < num_mb:
        kinds[s, p] = 0
        mbs[s, p] = next_f
        p += 1
        next_f += 1


def _iteration_time_impl(time_s, comm_s, end_s, warmups, num_mb, fwd_fraction):
  """Iteration time of one pipeline under the 1F1B-style table of ``warmups`` (``[S]`` each;
  ``comm_s[s]`` is the cut after stage ``s``); ``inf`` if it deadlocked (it cannot)."""
  S = time_s.shape[0]
  n = 2 * num_mb
  kinds = np.empty((S, n), np.int64)
  mbs = np.empty((S, n), np.int64)
  _warmup_tables(warmups, num_mb, kinds, mbs)
  fwd = np.empty((S, num_mb))
  bwd = np.empty((S, num_mb))
  for s in range(S):
    f = time_s[s] * fwd_fraction
    b = time_s[s] - f
    for m in range(num_mb):
      fwd[s, m] = f
      bwd[s, m] = b
  links = S - 1 if S > 1 else 1
  cf = np.zeros((links, num_mb))
  for s in range(S - 1):
    for m in range(num_mb):
      cf[s, m] = comm_s[s]
  task_start = np.zeros((S, n))
  task_end = np.zeros((S, n))
  msg_start = np.zeros((2, links, num_mb))
  msg_end = np.zeros((2, links, num_mb))
  stuck = np.full(S, n, np.int64)
  if _simulate_core(kinds, mbs, fwd, bwd, cf, cf, task_start, task_end, msg_start, msg_end,
                    stuck):
    return np.inf
  best = 0.0
  for s in range(S):
    v = task_end[s, n - 1] + end_s[s]
    if v > best:
      best = v
  return best


def _iteration_times_impl(time_s, comm_s, end_s, warmups, num_stages, num_mb, fwd_fraction,
                          out):
  """:func:`_iteration_time_impl` of many pipelines (rows padded to ``S_max``) into ``out``."""
  for q in range(time_s.shape[0]):
    S = num_stages[q]
    out[q] = iteration_time_kernel(time_s[q, :S], comm_s[q, :S], end_s[q, :S], warmups[q, :S],
                                   num_mb, fwd_fraction)


_simulate_core = _simulate_jit
if HAVE_NUMBA:
  _warmup_tables = _numba.njit(cache=True, nogil=True)(_warmup_tables_impl)
  iteration_time_kernel = _numba.njit(cache=True, nogil=True)(_iteration_time_impl)
  _iteration_times_jit = _numba.njit(cache=True, nogil=True)(_iteration_times_impl)
else:  # pragma: no cover
  _warmup_tables = _warmup_tables_impl
  iteration_time_kernel = _iteration_time_impl
  _iteration_times_jit = _iteration_times_impl
iteration_time_kernel.__doc__ = """The simulated iteration time of one pipeline (Numba; callable
from other kernels): ``iteration_time_kernel(time_s, comm_s, end_s, warmups, B, fwd_fraction)``
with ``[S]`` float arrays (``comm_s[s]``: the cut after stage ``s``) and ``[S]`` int warm-ups;
see :func:`iteration_times`."""


@interruptible_kernel
def iteration_times(time_s, comm_s, end_s, warmups, num_stages, num_microbatches,
                    fwd_fraction=1.0 / 3.0):
  """Simulated iteration time of many pipelines, each under the 1F1B-style table of its
  warm-up counts (H-1F1B, 1F1B, Eager-1F1B and GPipe are all of that form).

  The same kernel and the same arithmetic as :func:`harpjax.compiler.schedule.simulate` with
  per-stage forward ``t * fwd_fraction``, backward ``t - forward``, the same transfer time in
  both directions and ``end_cost``, so each time equals its ``iteration_time`` bit for bit
  (tested); without the per-phase analysis it costs ``O(S B)`` per pipeline.

  Args:
    time_s: ``[Q, S_max]`` forward+backward seconds per microbatch of each stage.
    comm_s: ``[Q, S_max]`` seconds of the cut after each stage (the last is ignored).
    end_s: ``[Q, S_max]`` end-of-iteration seconds of each stage.
    warmups: ``[Q, S_max]`` int warm-up counts.
    num_stages: ``[Q]`` int stages of each pipeline (entries beyond are ignored).
    num_microbatches: ``B``.
    fwd_fraction: the forward's share of a stage's time.

  Returns:
    ``[Q]`` float64 seconds.
  """
  t = np.ascontiguousarray(time_s, np.float64)
  Q = t.shape[0]
  out = np.empty(Q)
  if Q:
    _iteration_times_jit(t, np.ascontiguousarray(comm_s, np.float64),
                         np.ascontiguousarray(end_s, np.float64),
                         np.ascontiguousarray(warmups, np.int64),
                         np.ascontiguousarray(num_stages, np.int64), int(num_microbatches),
                         float(fwd_fraction), out)
  return out


def _alloc(kinds, fwd, comm_fwd):
  num_stages, n = kinds.shape
  num_mb = fwd.shape[1]
  links = comm_fwd.shape[0]
  return (np.zeros((num_stages, n)), np.zeros((num_stages, n)),
          np.zeros((2, links, num_mb)), np.zeros((2, links, num_mb)),
          np.full(num_stages, n, np.int64))


@interruptible_kernel
def simulate_kernel(kinds, mbs, fwd, bwd, comm_fwd, comm_bwd, use_numba=True):
  """Runs the sweep kernel; arguments as :func:`_simulate_impl`.

  Args:
    use_numba: ``False`` runs the very same code as plain Python (for debugging).

  Returns:
    ``(status, task_start, task_end, msg_start, msg_end, stuck)``; ``status`` is ``0`` on
    success and ``1`` on deadlock, in which case ``stuck[s]`` is stage ``s``'s stuck position.
  """
  args = [np.ascontiguousarray(kinds, np.int64), np.ascontiguousarray(mbs, np.int64),
          np.ascontiguousarray(fwd, np.float64), np.ascontiguousarray(bwd, np.float64),
          np.ascontiguousarray(comm_fwd, np.float64), np.ascontiguousarray(comm_bwd, np.float64)]
  out = _alloc(args[0], args[2], args[4])
  fn = _simulate_jit if use_numba else _simulate_impl
  status = fn(*args, *out)
  return (int(status),) + out


def simulate_python(kinds, mbs, fwd, bwd, comm_fwd, comm_bwd):
  """:func:`simulate_kernel` without Numba."""
  return simulate_kernel(kinds, mbs, fwd, bwd, comm_fwd, comm_bwd, use_numba=False)


def simulate_reference(kinds, mbs, fwd, bwd, comm_fwd, comm_bwd):
  """Discrete-event twin of :func:`simulate_kernel`: same inputs, same outputs.

  Events are popped in time order from a heap. A stage whose next task's input has been
  delivered starts it when the stage is free; a link direction starts its next queued message
  when the link is free. Written independently of the sweep so that the two check each other.
  """
  kinds = np.asarray(kinds)
  mbs = np.asarray(mbs)
  num_stages, n = kinds.shape
  num_mb = np.asarray(fwd).shape[1]
  task_start, task_end, msg_start, msg_end, stuck = _alloc(kinds, np.asarray(fwd),
                                                           np.asarray(comm_fwd))
  delivered = set()     # ("A"|"G", stage, microbatch): input available at that stage
  for m in range(num_mb):
    delivered.add(("A", 0, m))
  pos = [0] * num_stages
  busy = [False] * num_stages
  queues = {(d, l): [] for d in range(2) for l in range(max(num_stages - 1, 1))}
  link_busy = {key: False for key in queues}
  events = []           # (time, seq, kind, payload)
  seq = 0
  now = 0.0

  def push(t, kind, payload):
    nonlocal seq
    heapq.heappush(events, (t, seq, kind, payload))
    seq += 1

  def try_start_stage(s):
    if busy[s] or pos[s] >= n:
      return
    p = pos[s]
    k, m = int(kinds[s, p]), int(mbs[s, p])
    need = ("A", s, m) if k == KIND_F else ("G", s, m)
    if need not in delivered:
      return
    dur = float(fwd[s][m] if k == KIND_F else bwd[s][m])
    busy[s] = True
    task_start[s, p] = now
    task_end[s, p] = now + dur
    push(now + dur, "task_done", (s, p))

  def try_start_link(key):
    if link_busy[key] or not queues[key]:
      return
    d, l = key
    m = queues[key].pop(0)
    dur = float(comm_fwd[l][m] if d == 0 else comm_bwd[l][m])
    link_busy[key] = True
    msg_start[d, l, m] = now
    msg_end[d, l, m] = now + dur
    push(now + dur, "msg_done", (d, l, m))

  for s in range(num_stages):
    try_start_stage(s)
  while events:
    now, _, kind, payload = heapq.heappop(events)
    if kind == "task_done":
      s, p = payload
      busy[s] = False
      pos[s] += 1
      k, m = int(kinds[s, p]), int(mbs[s, p])
      if k == KIND_F and s + 1 < num_stages:
        queues[(0, s)].append(m)
        try_start_link((0, s))
      elif k == KIND_F:
        delivered.add(("G", s, m))
      elif s > 0:
        queues[(1, s - 1)].append(m)
        try_start_link((1, s - 1))
      try_start_stage(s)
    else:
      d, l, m = payload
      link_busy[(d, l)] = False
      if d == 0:
        delivered.add(("A", l + 1, m))
        try_start_stage(l + 1)
      else:
        delivered.add(("G", l, m))
        try_start_stage(l)
      try_start_link((d, l))
    # Zero-length work can make new events due right now; the heap handles them in order.
  status = 0
  if any(p < n for p in pos):
    status = 1
    stuck[:] = pos
  return status, task_start, task_end, msg_start, msg_end, stuck


# --------------------------------------------------------------------------- analysis


def steady_positions(kinds_row: np.ndarray) -> tuple[int, int]:
  """Table positions of the first backward and the last forward of a stage."""
  first_b = int(np.argmax(kinds_row == 1))
  last_f = len(kinds_row) - 1 - int(np.argmax(kinds_row[::-1] == 0))
  return first_b, last_f


def _coverage(mid: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
  """Whether each point of ``mid`` lies inside one of the sorted disjoint ``[starts, ends)``."""
  if len(starts) == 0:
    return np.zeros(len(mid), bool)
  idx = np.searchsorted(starts, mid, side="right") - 1
  ok = idx >= 0
  out = np.zeros(len(mid), bool)
  out[ok] = ends[idx[ok]] > mid[ok]
  return out


def analyze(kinds, start, end, msg_start, msg_end, ends) -> dict:
  """Per-stage, per-phase breakdown of a simulated iteration (plain arrays in and out).

  Args:
    kinds: ``[S, n]`` task kinds (``0`` F, ``1`` B) in table order.
    start: ``[S, n]`` task starts, seconds.
    end: ``[S, n]`` task ends.
    msg_start: ``[2, S - 1, B]`` transfer starts per (direction, link, microbatch).
    msg_end: ``[2, S - 1, B]`` transfer ends.
    ends: ``[S]`` end-of-iteration seconds, run after each stage's last task.

  Returns:
    A dict of the :class:`~harpjax.compiler.schedule.SimResult` fields ``iteration_time``,
    ``phase_time``, ``compute_time``, ``comm_time``, ``idle_time`` (``[S, 3]``: warm-up,
    steady, cool-down), ``update_time``, ``bubble``, ``link_busy``, ``link_hidden``,
    ``stage_comm``, ``stage_comm_hidden`` and ``peak_held``.
  """
  S = kinds.shape[0]
  L = S - 1
  upd_start = end[:, -1]
  upd_end = upd_start + ends
  T = float(upd_end.max()) if S else 0.0
  phase_time = np.zeros((S, 3))
  compute = np.zeros((S, 3))
  comm = np.zeros((S, 3))
  idle = np.zeros((S, 3))
  bubble = np.zeros(S)
  stage_comm = np.zeros(S)
  stage_hidden = np.zeros(S)
  link_busy = np.zeros((max(L, 0), 2))
  link_hidden = np.zeros((max(L, 0), 2))
  # Messages of one link direction never overlap (FIFO), so sorting by start sorts them.
  msgs = {}
  for d in range(2):
    for link in range(L):
      order = np.argsort(msg_start[d, link], kind="stable")
      msgs[d, link] = (msg_start[d, link, order], msg_end[d, link, order])
      link_busy[link, d] = float(np.sum(msg_end[d, link] - msg_start[d, link]))
  for s in range(S):
    first_b, last_f = steady_positions(kinds[s])
    w_end = start[s, first_b]
    s_end = max(w_end, end[s, last_f])
    if last_f > first_b:
      gaps = start[s, first_b + 1:last_f + 1] - end[s, first_b:last_f]
      bubble[s] = float(np.sum(gaps))
    cuts = np.array([0.0, w_end, s_end, T])
    phase_time[s] = np.diff(cuts)
    # Links touching stage s: (direction, link, stage s receives?).
    touching = []
    if s > 0:
      touching += [(0, s - 1, True), (1, s - 1, False)]
    if s < L:
      touching += [(0, s, False), (1, s, True)]
    pts = [cuts, start[s], end[s], upd_start[s:s + 1], upd_end[s:s + 1]]
    pts += [x for d, link, _ in touching for x in msgs[d, link]]
    grid = np.unique(np.concatenate(pts))
    grid = grid[(grid >= 0) & (grid <= T)]
    if len(grid) < 2:
      continue
    mid = 0.5 * (grid[1:] + grid[:-1])
    length = np.diff(grid)
    phase = np.clip(np.searchsorted(cuts[1:3], mid, side="right"), 0, 2)
    busy = _coverage(mid, start[s], end[s])
    upd = (mid >= upd_start[s]) & (mid < upd_end[s])
    any_comm = np.zeros(len(mid), bool)
    for d, link, receives in touching:
      cov = _coverage(mid, *msgs[d, link])
      any_comm |= cov
      if receives:
        link_hidden[link, d] = float(np.sum(length[cov & busy]))
    sums = lambda mask: np.bincount(phase[mask], weights=length[mask], minlength=3)
    compute[s] = sums(busy)
    comm[s] = sums(~busy & ~upd & any_comm)
    idle[s] = sums(~busy & ~upd & ~any_comm)
    stage_comm[s] = float(np.sum(length[any_comm]))
    stage_hidden[s] = float(np.sum(length[any_comm & busy]))
  held = []
  for s in range(S):
    arrive = start[s][kinds[s] == 0] if s == 0 else msg_end[0, s - 1]
    release = end[s][kinds[s] == 1]
    times = np.concatenate([release, arrive])
    delta = np.concatenate([-np.ones(len(release)), np.ones(len(arrive))])
    order = np.lexsort((delta, times))  # at equal times, releases first
    held.append(int(np.cumsum(delta[order]).max()) if len(order) else 0)
  return dict(iteration_time=T, phase_time=phase_time, compute_time=compute, comm_time=comm,
              peak_held=tuple(held),
              idle_time=idle, update_time=ends.copy(), bubble=bubble, link_busy=link_busy,
              link_hidden=link_hidden, stage_comm=stage_comm, stage_comm_hidden=stage_hidden)
