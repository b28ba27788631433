"""The zebra simulator's array kernel (its Numba build and its Python twin) against the
event-driven simulator: every task's start and end equal, not close, in Theorem 1's order and
in arbitrary orders of the compute streams (including ones that deadlock)."""

import itertools

import numpy as np
import pytest

from harpjax.cluster import Link
from harpjax.compiler.plan.expert_assignment import ExpertAssignmentProblem
from harpjax.compiler.schedule import (simulate_zebra, theorem1_iteration_time, zebra_arrays,
                                       ZebraCosts, ZebraOrder)
from harpjax.compiler.schedule import zebra
from harpjax.compiler.schedule.zebra_kernel import zebra_sim_kernel

FIELDS = ("attn_fwd_s", "attn_bwd_s", "expert_fwd_s", "expert_bwd_s", "dispatch_fwd_s",
          "combine_fwd_s", "dispatch_bwd_s", "combine_bwd_s", "offload_fwd_s", "offload_bwd_s")


def random_costs(rng, L, R, kind):
  """``kind``: ``"fast"`` all-to-all below compute (the paper's assumption), ``"slow"`` above
  it, ``"ties"`` small whole numbers (equal ready times everywhere: the tie rules decide)."""
  if kind == "ties":
    f = lambda n, lo, hi: rng.integers(0, 3, n).astype(float)  # noqa: E731
  else:
    f = lambda n, lo, hi: rng.uniform(lo, hi, n)                # noqa: E731
  comm = (0.05, 0.5) if kind != "slow" else (0.5, 4.0)
  x = f(L, 0.2, 2.0) * (rng.random(L) < 0.5)
  return ZebraCosts(L, R, f(L + 1, 1, 3), f(L + 1, 1, 3), f(L, 1, 3), f(L, 1, 3), f(L, *comm),
                    f(L, *comm), f(L, *comm), f(L, *comm), offload_fwd_s=x,
                    offload_bwd_s=2 * x)


def kernel_run(costs, order, use_numba):
  """The kernel on ``order`` (a :class:`ZebraOrder`), mapped back to tasks."""
  L, R = costs.num_layers, costs.num_microbatches
  g = zebra_arrays(L, R, tuple(costs.offloaded(i) for i in range(L)))
  ids = {t: k for k, t in enumerate(g.tasks)}
  dur = np.array([costs.duration_s(t) for t in g.tasks])
  t, start, end = zebra_sim_kernel(
      g.stream, g.backward, g.layer, g.microbatch, g.num_preds, g.succ, dur,
      np.array([ids[t] for t in order.attn], np.int64),
      np.array([ids[t] for t in order.expert], np.int64), use_numba=use_numba)
  return t, {task: start[k] for k, task in enumerate(g.tasks)}, \
      {task: end[k] for k, task in enumerate(g.tasks)}


@pytest.mark.parametrize("kind", ["fast", "slow", "ties"])
@pytest.mark.parametrize("use_numba", [True, False])
def test_kernel_equals_event_simulator_in_theorem1_order(kind, use_numba):
  rng = np.random.default_rng({"fast": 1, "slow": 2, "ties": 3}[kind])
  for _ in range(40 if use_numba else 12):
    L, R = int(rng.integers(1, 5)), int(rng.integers(1, 6))
    costs = random_costs(rng, L, R, kind)
    ref = simulate_zebra(costs)
    t, start, end = kernel_run(costs, ref.order, use_numba)
    assert t == ref.iteration_time
    assert start == ref.start_s and end == ref.end_s
    fast = theorem1_iteration_time(R, *(np.asarray(getattr(costs, f)) for f in FIELDS),
                                   use_numba=use_numba)
    assert fast == ref.iteration_time


def test_kernel_equals_event_simulator_in_every_order():
  """Every pair of compute-stream orders of small stages, deadlocks included (``inf``)."""
  rng = np.random.default_rng(4)
  deadlocks = 0
  for L, R in ((1, 2), (2, 1)):
    for kind in ("fast", "slow"):
      costs = random_costs(rng, L, R, kind)
      for order in itertools.islice(zebra.compute_orders(costs, symmetric=False), 300):
        ref = simulate_zebra(costs, order)
        t, start, end = kernel_run(costs, order, True)
        assert t == ref.iteration_time
        if not ref.deadlocked:
          assert start == ref.start_s and end == ref.end_s
        deadlocks += ref.deadlocked
  assert deadlocks > 0          # the deadlock path is exercised


def test_assignment_problem_time_equals_event_simulator():
  """``ExpertAssignmentProblem.iteration_time`` (the kernel) against ``simulate_zebra`` of
  its ``costs`` on random stages and assignments, with and without all-to-all bytes."""
  rng = np.random.default_rng(5)
  for k in range(60):
    L, R = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    M, N = [(1, 2), (2, 2), (2, 4), (4, 2), (3, 2)][rng.integers(5)]
    n = N * int(rng.integers(1, 4)) * M
    ta = rng.uniform(1.0, 2.0, L + 1)
    te = rng.uniform(0.5, 3.0, L)
    kw = {}
    if k % 2:
      kw = dict(routed_bytes=rng.uniform(1e6, 4e7, L), link=Link.from_gbps(100, latency_us=5))
    p = ExpertAssignmentProblem(n, M, N, R, ta, 2 * ta, te, 2 * te, 0.5 * te, te, **kw)
    n2 = p.chunk[1]
    o = [int(rng.integers(0, p.max_chunks + 1)) * n2 for _ in range(L)]
    assert p.iteration_time(o) == simulate_zebra(p.costs(o)).iteration_time


def test_arrays_are_the_graph_and_theorem1_order():
  costs = ZebraCosts(2, 2, 1.0, 1.0, 1.0, 1.0, offload_fwd_s=[0.0, 1.0], offload_bwd_s=0.0)
  g = zebra_arrays(2, 2, (False, True))
  graph = zebra.zebra_task_graph(costs)
  assert g.tasks == tuple(graph)
  order = zebra.theorem1_order(costs)
  assert ZebraOrder(tuple(g.tasks[k] for k in g.attn_order),
                    tuple(g.tasks[k] for k in g.expert_order)) == order
  for k, t in enumerate(g.tasks):
    assert int(g.num_preds[k]) == len(graph[t])
    assert {g.tasks[u] for u in g.succ[k] if u >= 0} == {u for u, p in graph.items() if t in p}
