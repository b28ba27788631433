"""Zebra stages (HeterMoE §4.1): the task graph, the event-driven simulator against an
independent longest-path evaluation, and Theorem 1 against every order of the compute streams."""

import math

import numpy as np
import pytest

from harpjax.cluster import Link
from harpjax.compiler.schedule import simulate_zebra, theorem1_order, ZebraCosts, ZebraOrder
from harpjax.compiler.schedule import zebra
from harpjax.errors import ScheduleError


def random_costs(rng, L, R, comm=(0.05, 0.5), offload=False):
  """Random task times; with the default ``comm`` every all-to-all is shorter than every
  computation (times in [1, 3]), the paper's assumption."""
  u = lambda n: rng.uniform(1.0, 3.0, n)
  c = lambda n: rng.uniform(*comm, n)
  kw = {}
  if offload:
    kw = dict(offload_fwd_s=rng.uniform(0.0, 1.0, L) * (rng.random(L) < 0.6),
              offload_bwd_s=rng.uniform(0.5, 2.0, L))
  return ZebraCosts(L, R, u(L + 1), u(L + 1), u(L), u(L), c(L), c(L), c(L), c(L), **kw)


def longest_path(costs, result):
  """Start times from the realised order of every stream (compute and communication) by
  relaxing the DAG: data edges plus consecutive tasks of a stream; independent of the
  simulator's event loop."""
  graph = zebra.zebra_task_graph(costs)
  preds = {t: list(p) for t, p in graph.items()}
  for s in zebra.STREAMS:
    row = result.stream_tasks(s)
    for a, b in zip(row, row[1:]):
      preds[b].append(a)
  end = {}
  todo = list(graph)
  while todo:
    rest = []
    for t in todo:
      if all(p in end for p in preds[t]):
        end[t] = max((end[p] for p in preds[t]), default=0.0) + costs.duration_s(t)
      else:
        rest.append(t)
    assert len(rest) < len(todo)
    todo = rest
  return end


def test_task_text_parses_back():
  t = zebra.ZebraTask("X", "B", 2, 5)
  assert str(t) == "XB2.5" and zebra.ZebraTask.parse("XB2.5") == t and t.stream == "attn"
  with pytest.raises(ScheduleError, match="cannot parse"):
    zebra.ZebraTask.parse("Q1")


def test_one_microbatch_is_the_serial_chain():
  rng = np.random.default_rng(0)
  c = random_costs(rng, 3, 1)
  r = simulate_zebra(c)
  total = sum(c.duration_s(t) for t in zebra.zebra_task_graph(c))
  assert r.iteration_time == pytest.approx(total, rel=1e-12)
  assert sum(r.busy_s.values()) == pytest.approx(total, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_simulator_matches_longest_path(seed):
  rng = np.random.default_rng(seed)
  c = random_costs(rng, int(rng.integers(1, 5)), int(rng.integers(1, 5)), comm=(0.1, 4.0),
                   offload=seed % 2 == 1)
  r = simulate_zebra(c)
  end = longest_path(c, r)
  for t, e in end.items():
    assert r.end_s[t] == pytest.approx(e, abs=1e-9), t
  assert r.iteration_time == pytest.approx(max(end.values()))
  for s in zebra.STREAMS:                 # streams never run two tasks at once
    row = r.stream_tasks(s)
    assert all(r.end_s[a] <= r.start_s[b] + 1e-12 for a, b in zip(row, row[1:]))


def test_order_validation_and_deadlock():
  c = ZebraCosts(1, 2, 1.0, 2.0, 1.5, 3.0)
  order = theorem1_order(c)
  with pytest.raises(ScheduleError, match="missing"):
    simulate_zebra(c, ZebraOrder(order.attn[1:], order.expert))
  # Microbatch 1's second attention task first on the attention stream, microbatch 0's
  # expert task first on the expert stream: each waits on the other.
  attn = ("AF0.1", "AF1.1", "AB1.1", "AB0.1", "AF0.0", "AF1.0", "AB1.0", "AB0.0")
  expert = ("EF0.0", "EB0.0", "EF0.1", "EB0.1")
  assert simulate_zebra(c, ZebraOrder(attn, expert)).deadlocked


def test_theorem1_order_shape():
  c = ZebraCosts(2, 2, 1.0, 1.0, 1.0, 1.0)
  o = theorem1_order(c)
  assert " ".join(map(str, o.attn)) == ("AF0.0 AF0.1 AF1.0 AF1.1 AF2.0 AB2.0 AF2.1 AB2.1 "
                                         "AB1.0 AB1.1 AB0.0 AB0.1")
  assert " ".join(map(str, o.expert)) == "EF0.0 EF0.1 EF1.0 EF1.1 EB1.0 EB1.1 EB0.0 EB0.1"


def test_overlap_beats_no_overlap():
  """Balanced groups: R microbatches keep both groups busy, the iteration approaches
  max(attention, experts) work plus one pass of the chain."""
  c1 = ZebraCosts(4, 1, 1.0, 2.0, 1.0, 2.0, 0.1, 0.1, 0.1, 0.1)
  c8 = dataclass_replace(c1, num_microbatches=8, scale=1 / 8)
  t1, t8 = simulate_zebra(c1).iteration_time, simulate_zebra(c8).iteration_time
  assert t8 < 0.65 * t1
  r8 = simulate_zebra(c8)
  assert r8.utilization("expert") > 0.6


def dataclass_replace(c, num_microbatches, scale):
  f = lambda v: np.asarray(v) * scale
  return ZebraCosts(c.num_layers, num_microbatches, f(c.attn_fwd_s), f(c.attn_bwd_s),
                    f(c.expert_fwd_s), f(c.expert_bwd_s), f(c.dispatch_fwd_s),
                    f(c.combine_fwd_s), f(c.dispatch_bwd_s), f(c.combine_bwd_s))


def best_order_time(c, symmetric=True):
  best = math.inf
  for o in zebra.compute_orders(c, symmetric=symmetric):
    best = min(best, simulate_zebra(c, o, check=False).iteration_time)
  return best


@pytest.mark.parametrize("L,R", [(1, 2), (2, 1), (3, 1)])
def test_theorem1_is_optimal_small(L, R):
  """Theorem 1's order is at least as fast as every order of the compute streams (all experts
  on the expert GPUs, every all-to-all shorter than every computation)."""
  rng = np.random.default_rng(100 * L + R)
  for _ in range(4):
    c = random_costs(rng, L, R)
    assert c.comm_below_compute()
    assert simulate_zebra(c).iteration_time <= best_order_time(c, symmetric=False) + 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("L,R,instances", [(1, 2, 40), (2, 2, 4), (1, 3, 1)])
def test_theorem1_is_optimal_exhaustive(L, R, instances):
  rng = np.random.default_rng(7 * L + R)
  for _ in range(instances):
    c = random_costs(rng, L, R)
    assert simulate_zebra(c).iteration_time <= best_order_time(c) + 1e-9


def test_bipartite_all_to_all():
  link = Link.from_gbps(100, latency_us=5)
  # 2 attention GPUs, 4 expert GPUs, all tokens to the experts: each attention GPU sends half.
  t = zebra.bipartite_all_to_all_time_s(8e6, 2, 4, 1.0, link)
  assert t == pytest.approx(4e6 / link.bandwidth_bytes_per_s + 5 * 5e-6)
  # 4 attention GPUs, 2 expert GPUs: each expert GPU receives half.
  t = zebra.bipartite_all_to_all_time_s(8e6, 4, 2, 1.0, link)
  assert t == pytest.approx(4e6 / link.bandwidth_bytes_per_s + 5 * 5e-6)
  # Experts moved to the attention GPUs relieve the expert GPUs' links.
  assert zebra.bipartite_all_to_all_time_s(8e6, 4, 2, 0.5, link) < t
  with pytest.raises(ScheduleError):
    zebra.bipartite_all_to_all_time_s(1.0, 0, 2, 1.0, link)
