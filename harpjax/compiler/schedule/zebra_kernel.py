"""Numeric kernel of the zebra simulator, on plain arrays, with its pure-Python twin.

The same event-driven model as :func:`~harpjax.compiler.schedule.zebra.simulate_zebra`, step for
step, on integer task ids instead of :class:`~harpjax.compiler.schedule.zebra.ZebraTask`
objects and dicts: every task starts at ``max(end of its dependencies, its stream's free
time)``; the two compute streams take their tasks in a given order, the two communication
streams the ready task with the smallest ``(ready time, backward, layer, microbatch)`` (the
event simulator's heap key); at each step the task with the earliest start is committed, ties
to the stream listed first (attention, expert, dispatch, combine). Both therefore perform the
same floating-point operations in the same order, and their times are equal, not merely close
(``tests/compiler/schedule/test_zebra_kernel.py`` checks every task's start and end on random
stages, with and without ``X`` tasks, slow and fast all-to-all, and the planner's own
stages).

:func:`zebra_sim_kernel` runs it (Numba when installed; ``use_numba=False`` the very same
code as plain Python). :func:`~harpjax.compiler.schedule.zebra.theorem1_iteration_time`
builds the arrays of Theorem 1's order and calls it: the expert-assignment search and the
planner's zebra stages use that path.
"""

from __future__ import annotations

import numpy as np

from harpjax.errors import interruptible_kernel

try:  # Numba is a hard dependency, but the twin keeps the simulator usable without it.
  import numba as _numba
except ImportError:  # pragma: no cover
  _numba = None

__all__ = ["zebra_sim_kernel", "zebra_sim_batch", "HAVE_NUMBA", "STREAM_ATTN", "STREAM_EXPERT",
           "STREAM_DISPATCH", "STREAM_COMBINE"]

HAVE_NUMBA = _numba is not None
STREAM_ATTN, STREAM_EXPERT, STREAM_DISPATCH, STREAM_COMBINE = 0, 1, 2, 3


def _zebra_sim_impl(stream, backward, layer, microbatch, num_preds, succ, dur, attn_order,
                    expert_order, start, end):
  """One iteration of a zebra stage (the module docstring's model).

  Args:
    stream: ``[n]`` int, each task's stream (``STREAM_*``).
    backward: ``[n]`` int, 1 for a backward task.
    layer, microbatch: ``[n]`` int.
    num_preds: ``[n]`` int, each task's number of data dependencies.
    succ: ``[n, 2]`` int, each task's dependants (``-1``: none).
    dur: ``[n]`` float, seconds.
    attn_order, expert_order: task ids of the two compute streams, in their order.
    start, end: ``[n]`` float, filled with each task's start and end.

  Returns:
    The iteration time (the last end; ``inf`` when the order deadlocks).
  """
  n = stream.shape[0]
  waiting = num_preds.copy()
  ready = np.zeros(n)
  pend = np.empty((2, n), np.int64)       # ready tasks of the dispatch / combine streams
  npend = np.zeros(2, np.int64)
  free = np.zeros(4)
  pos = np.zeros(2, np.int64)
  n_attn = attn_order.shape[0]
  n_expert = expert_order.shape[0]
  remaining = n
  while remaining > 0:
    found = False
    best_t0 = 0.0
    best_s = -1
    best_task = -1
    best_k = -1
    for s in range(2):
      if s == 0:
        if pos[0] >= n_attn:
          continue
        t = attn_order[pos[0]]
      else:
        if pos[1] >= n_expert:
          continue
        t = expert_order[pos[1]]
      if waiting[t] == 0:
        t0 = max(free[s], ready[t])
        if not found or t0 < best_t0:
          found, best_t0, best_s, best_task = True, t0, s, t
    for c in range(2):
      if npend[c] == 0:
        continue
      k = 0
      t = pend[c, 0]
      for q in range(1, npend[c]):      # the heap's minimum: (ready, backward, layer, mb)
        u = pend[c, q]
        if (ready[u] < ready[t] or (ready[u] == ready[t] and (
            backward[u] < backward[t] or (backward[u] == backward[t] and (
                layer[u] < layer[t] or (layer[u] == layer[t]
                                        and microbatch[u] < microbatch[t])))))):
          k, t = q, u
      s = 2 + c
      t0 = max(free[s], ready[t])
      if not found or t0 < best_t0:
        found, best_t0, best_s, best_task, best_k = True, t0, s, t, k
    if not found:
      return np.inf
    t = best_task
    if best_s >= 2:
      c = best_s - 2
      npend[c] -= 1
      pend[c, best_k] = pend[c, npend[c]]
    else:
      pos[best_s] += 1
    t1 = best_t0 + dur[t]
    start[t] = best_t0
    end[t] = t1
    free[best_s] = t1
    remaining -= 1
    for q in range(2):
      u = succ[t, q]
      if u < 0:
        continue
      ready[u] = max(ready[u], t1)
      waiting[u] -= 1
      if waiting[u] == 0 and stream[u] >= 2:
        c = stream[u] - 2
        pend[c, npend[c]] = u
        npend[c] += 1
  t_end = 0.0
  for t in range(n):
    if end[t] > t_end:
      t_end = end[t]
  return t_end


if HAVE_NUMBA:
  _zebra_sim_jit = _numba.njit(cache=True, nogil=True)(_zebra_sim_impl)
else:  # pragma: no cover
  _zebra_sim_jit = _zebra_sim_impl


def _zebra_sim_batch_impl(stream, backward, layer, microbatch, num_preds, succ, dur,
                          attn_order, expert_order, out):
  """:func:`_zebra_sim_impl` of each row of ``dur`` (``[K, n]``: K stages of one graph and
  order), into ``out[K]``."""
  n = stream.shape[0]
  start = np.zeros(n)
  end = np.zeros(n)
  for k in range(dur.shape[0]):
    out[k] = _zebra_sim_jit(stream, backward, layer, microbatch, num_preds, succ, dur[k],
                            attn_order, expert_order, start, end)


if HAVE_NUMBA:
  _zebra_sim_batch_jit = _numba.njit(cache=True, nogil=True)(_zebra_sim_batch_impl)
else:  # pragma: no cover
  _zebra_sim_batch_jit = _zebra_sim_batch_impl


@interruptible_kernel
def zebra_sim_kernel(stream, backward, layer, microbatch, num_preds, succ, dur, attn_order,
                     expert_order, use_numba: bool = True):
  """Runs :func:`_zebra_sim_impl` (arguments as there, int64 and float64 arrays).

  Args:
    use_numba: ``False`` runs the very same code as plain Python (the twin).

  Returns:
    ``(iteration_time, start, end)``: seconds, and ``[n]`` start and end of every task
    (those of tasks never started are 0 when the order deadlocks).
  """
  n = stream.shape[0]
  start = np.zeros(n)
  end = np.zeros(n)
  fn = _zebra_sim_jit if use_numba else _zebra_sim_impl
  t = fn(stream, backward, layer, microbatch, num_preds, succ, dur, attn_order, expert_order,
         start, end)
  return float(t), start, end


@interruptible_kernel
def zebra_sim_batch(stream, backward, layer, microbatch, num_preds, succ, dur, attn_order,
                    expert_order, use_numba: bool = True) -> np.ndarray:
  """The iteration time of each row of ``dur`` (``[K, n]`` float64: K stages that share the
  graph and the order), one kernel call; ``use_numba=False``: the Python twin, row by row.

  Returns:
    ``[K]`` seconds.
  """
  out = np.empty(dur.shape[0])
  if use_numba:
    _zebra_sim_batch_jit(stream, backward, layer, microbatch, num_preds, succ, dur,
                         attn_order, expert_order, out)
  else:
    n = stream.shape[0]
    for k in range(dur.shape[0]):
      out[k] = _zebra_sim_impl(stream, backward, layer, microbatch, num_preds, succ, dur[k],
                               attn_order, expert_order, np.zeros(n), np.zeros(n))
  return out
