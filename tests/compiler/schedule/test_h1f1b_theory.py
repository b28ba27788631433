"""The H-1F1B theory of HARP (§2.3, §4, Appendix B), checked on the simulator.

Definitions (see ``docs/schedules.md``): stage ``s``'s steady phase runs from the start of its
first backward to the end of its last forward; its *bubble* is the time in there during which
it does not compute; ``t_i = f_i + b_i``; ``t_max = max_i t_i``; a *bottleneck* stage has
``t_i = t_max``. ``c_f``/``c_b`` are a link's activation/gradient transfer times (the paper's
symmetric ``c`` is ``c_f = c_b = c``, so its ``2c`` reads ``c_f + c_b`` here).

Every equality below is exact up to floating-point rounding (``atol = 1e-9 * scale``).
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harpjax.compiler import schedule as sched
from harpjax.compiler.schedule import simulate

FRACTIONS = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0.0, 1.0))


def run(f, b, cf, cb, warmups, B, name="h1f1b"):
  """Simulates a 1F1B-family table with the given warm-up counts."""
  f, b = np.asarray(f, float), np.asarray(b, float)
  S = len(f)
  table = sched.table_from_warmups(S, B, warmups)
  return simulate(f, b, None, sched.Schedule(name, table, B, tuple(warmups)),
                  comm_fwd=np.asarray(cf, float), comm_bwd=np.asarray(cb, float))


def h1f1b_warmups(f, b, cf, cb, eps=0.0):
  t_max = float(np.max(np.add(f, b)))
  return sched.h1f1b_warmups((np.asarray(cf) + np.asarray(cb)) / 2, t_max, eps)


@st.composite
def pipelines(draw, max_stages=16, max_mb=64, balanced=False, max_comm=1.0, symmetric=None):
  """Random pipelines: per-stage (f, b), per-link (c_f, c_b) <= max_comm * t_max, B."""
  S = draw(st.integers(2, max_stages))
  if balanced:  # equal t_i, forward/backward split may differ per stage
    t = draw(st.floats(0.01, 1.0))
    split = np.array(draw(st.lists(st.floats(0.05, 0.95), min_size=S, max_size=S)))
    if draw(st.booleans()):
      split[:] = split[0]
    f = split * t
    b = t - f
  else:
    f = np.array(draw(st.lists(st.floats(0.001, 1.0), min_size=S, max_size=S)))
    b = np.array(draw(st.lists(st.floats(0.001, 2.0), min_size=S, max_size=S)))
  t_max = float(np.max(f + b))
  fr = np.array(draw(st.lists(FRACTIONS, min_size=S - 1, max_size=S - 1)))
  cf = fr * max_comm * t_max
  sym = draw(st.booleans()) if symmetric is None else symmetric
  if sym:
    cb = cf.copy()
  else:
    cb = np.array(draw(st.lists(FRACTIONS, min_size=S - 1, max_size=S - 1))) * max_comm * t_max
  B = draw(st.integers(1, max_mb))
  return f, b, cf, cb, B


def _atol(r):
  return 1e-9 * max(r.iteration_time, 1.0)


# --------------------------------------------------------------------------- Eq. 5, 7, 8


@given(f=st.floats(1e-3, 1.0), b=st.floats(1e-3, 1.0), frac_f=FRACTIONS, frac_b=FRACTIONS,
       symmetric=st.booleans(), K=st.integers(1, 8), extra=st.integers(1, 12))
def test_two_balanced_stages_k_block_is_eq8(f, b, frac_f, frac_b, symmetric, K, extra):
  """Eq. 7-8: on stage 0 of a balanced 2-stage pipeline with warm-up K, every steady K-block
  lasts s(F_{i+K}) - s(F_i) = max{K (f+b), 2 (f+b) + c_f + c_b} (= max{K(f+b), 2(f+b+c)}),
  and Lemma 1 (Eq. 5) holds with equality: s(B_i) - s(F_i) = max{K f + (K-1) b,
  2f + b + c_f + c_b}. Steady i: K <= i <= B-1-K (F_i runs after a backward and F_{i+K}
  exists); any K >= 1, any 0 <= c <= f + b."""
  t = f + b
  cf = frac_f * t
  cb = cf if symmetric else frac_b * t
  B = 2 * K + extra
  r = run([f, f], [b, b], [cf], [cb], (K, 1), B)
  x = r.f_start[0]
  steady = np.arange(K, B - K)
  np.testing.assert_allclose(x[steady + K] - x[steady], max(K * t, 2 * t + cf + cb),
                             rtol=0, atol=_atol(r))
  np.testing.assert_allclose(r.b_start[0, steady] - x[steady],
                             max(K * f + (K - 1) * b, 2 * f + b + cf + cb), rtol=0,
                             atol=_atol(r))


def test_eq5_does_not_hold_for_warmup_microbatches():
  """Lemma 1 is about the steady phase only: a warm-up microbatch's F and B are further apart,
  since its round trip queues behind the warm-up burst (K=3, f=0.1, b=0.9, c=0.9)."""
  r = run([0.1, 0.1], [0.9, 0.9], [0.9], [0.9], (3, 1), 12)
  x = r.f_start[0]
  assert x[3 + 3] - x[3] == pytest.approx(3.8)         # steady block: 2(t + c)
  assert x[1 + 3] - x[1] == pytest.approx(3.8 + 0.9)   # first F's block: + (t - f)


# --------------------------------------------------------------------------- bubble-free


@given(pipelines())
def test_h1f1b_bottleneck_stages_are_bubble_free(p):
  """H-1F1B with delta_i = ceil(1 + (c_f + c_b) / t_max) (eps = 0): whenever every
  c_f, c_b <= t_max, every bottleneck stage is bubble-free in its steady phase, for up to 16
  stages with imbalanced costs and asymmetric links."""
  f, b, cf, cb, B = p
  r = run(f, b, cf, cb, h1f1b_warmups(f, b, cf, cb), B)
  for s in r.bottleneck_stages:
    assert r.bubble[s] <= _atol(r), (s, r.bubble)


@given(pipelines(balanced=True))
def test_h1f1b_balanced_pipeline_is_bubble_free_everywhere(p):
  """Balanced stages (equal t_i, any forward/backward split): every stage is bubble-free."""
  f, b, cf, cb, B = p
  r = run(f, b, cf, cb, h1f1b_warmups(f, b, cf, cb), B)
  assert np.all(r.bubble <= _atol(r)), r.bubble


def test_h1f1b_bubble_free_seeded_sweep():
  rng = np.random.default_rng(2026)
  for _ in range(150):
    S, B = int(rng.integers(2, 17)), int(rng.integers(1, 65))
    f, b = rng.uniform(1e-3, 1, S), rng.uniform(1e-3, 2, S)
    t_max = (f + b).max()
    cf = rng.choice([0, 0.5, 1, rng.uniform()], S - 1) * t_max
    cb = cf if rng.random() < 0.5 else rng.uniform(0, 1, S - 1) * t_max
    r = run(f, b, cf, cb, h1f1b_warmups(f, b, cf, cb), B)
    assert max(r.bubble[s] for s in r.bottleneck_stages) <= _atol(r)


def test_faster_stages_idle_even_with_h1f1b():
  """The paper's "stretching" (§4.2.4) is conceptual: a faster stage does idle in its steady
  phase, by about (t_max - t_i) per microbatch; only the bottleneck is bubble-free."""
  r = run([1.0, 0.2], [2.0, 0.4], [0.3], [0.3], h1f1b_warmups([1, .2], [2, .4], [.3], [.3]),
          20)
  assert r.bottleneck_stages == (0,) and r.bubble[0] == pytest.approx(0, abs=1e-12)
  assert r.bubble[1] > 15 * (3.0 - 0.6)


@given(pipelines(max_stages=8, balanced=True, symmetric=True), st.data())
def test_h1f1b_delta_is_tight_for_balanced_pipelines(p, data):
  """One warm-up fewer at any link with delta_i >= 2 leaves a steady-phase bubble (given
  B >= 3 N_0 + 5) at least as long as the deficit t + c_f + c_b - (delta_i - 1) t of one
  K-block (Eq. 8), so Eq. 10's delta is the minimum for balanced pipelines."""
  f, b, cf, cb, _ = p
  w = np.array(h1f1b_warmups(f, b, cf, cb))
  links = [i for i in range(len(f) - 1) if w[i] - w[i + 1] >= 2]
  if not links:
    return
  i = data.draw(st.sampled_from(links))
  w[:i + 1] -= 1
  B = int(3 * w[0] + 5)
  r = run(f, b, cf, cb, tuple(int(x) for x in w), B)
  t = r.t_max
  deficit = t + cf[i] + cb[i] - (w[i] - w[i + 1]) * t
  assert deficit > 0
  assert r.bubble.max() >= deficit * (1 - 1e-9) - _atol(r)


def test_h1f1b_delta_is_not_minimal_for_imbalanced_pipelines():
  """Smallest counterexample to minimality beyond balanced pipelines: S=2, t=(1, 3),
  c=2 <= t_max. H-1F1B launches N=(4, 1); N=(3, 1) is as fast and just as bubble-free on the
  bottleneck, with one microbatch less in flight on stage 0."""
  f, b, c = [0.5, 1.0], [0.5, 2.0], [2.0]
  assert h1f1b_warmups(f, b, c, c) == (4, 1)
  r4 = run(f, b, c, c, (4, 1), 20)
  r3 = run(f, b, c, c, (3, 1), 20)
  assert r3.iteration_time == r4.iteration_time == 65.0
  assert r3.bubble[1] == r4.bubble[1] == 0.0
  assert r3.peak_inflight == (3, 1) and r4.peak_inflight == (4, 1)
  assert run(f, b, c, c, (2, 1), 20).bubble[1] > 0     # one fewer is too few


# --------------------------------------------------------------------------- Eager-1F1B


@given(pipelines(max_comm=0.5))
def test_eager_is_bubble_free_while_comm_is_at_most_half_of_t_max(p):
  """Eager-1F1B (delta = 2 everywhere) hides c_f + c_b <= t_max, i.e. c <= (f+b)/2."""
  f, b, cf, cb, B = p
  r = run(f, b, cf, cb, sched.eager_1f1b_warmups(len(f)), B, "eager_1f1b")
  for s in r.bottleneck_stages:
    assert r.bubble[s] <= _atol(r)


@given(S=st.integers(2, 10), split=st.floats(0.05, 0.95), frac=st.floats(0.55, 1.0),
       one_link=st.booleans(), data=st.data())
def test_eager_shows_steady_bubbles_beyond_half(S, split, frac, one_link, data):
  """Balanced stages, c in (t/2, t] on one link or all: Eager-1F1B leaves steady-phase
  bubbles as soon as there is a steady phase (B > N_0), while H-1F1B has none."""
  f, b = np.full(S, split), np.full(S, 1 - split)
  c = np.full(S - 1, frac)
  if one_link:
    c[:] = 0
    c[data.draw(st.integers(0, S - 2))] = frac
  B = data.draw(st.integers(2 * S, 4 * S + 4))
  eager = run(f, b, c, c, sched.eager_1f1b_warmups(S), B, "eager_1f1b")
  assert eager.bubble.max() > 1e-3 * (2 * frac - 1)
  h = run(f, b, c, c, h1f1b_warmups(f, b, c, c), B)
  assert h.bubble.max() <= _atol(h)
  assert h.iteration_time <= eager.iteration_time + _atol(h)


def test_eager_two_stage_bubble_is_2c_minus_t_per_block():
  """S=2, K=3: each steady 3-block lasts 2(t+c) instead of 3t (Eq. 8), so stage 0 waits
  2c - t per block."""
  t, c = 1.0, 0.8
  r = run([0.4, 0.4], [0.6, 0.6], [c], [c], (3, 1), 30)
  x = r.f_start[0]
  np.testing.assert_allclose(np.diff(x[3::3]), 2 * (t + c))


# --------------------------------------------------------------------------- memory


@given(pipelines(max_stages=12, max_comm=0.0), st.floats(0.01, 0.5), st.floats(0, 1))
def test_fast_links_cost_no_memory(p, eps, frac):
  """All links fast (c_f + c_b <= eps * t_max, so H-1F1B adds no warm-up): H-1F1B holds no
  more microbatches than 1F1B + 1 per stage and fewer than Eager-1F1B. The "+1" is the input
  activation that has arrived while the stage still works on its previous task
  (``peak_held``); counted from F start to B end (``peak_inflight``) H-1F1B equals 1F1B."""
  f, b, _, _, B = p
  S = len(f)
  t_max = float(np.max(f + b))
  c = np.full(S - 1, frac * eps * t_max / 2)
  h = simulate(f, b, c, "h1f1b", num_microbatches=B, eps=eps)
  one = simulate(f, b, c, "1f1b", num_microbatches=B)
  eager = simulate(f, b, c, "eager_1f1b", num_microbatches=B)
  assert h.schedule.tables == one.schedule.tables
  assert h.peak_inflight == one.peak_inflight
  assert all(x <= y + 1 for x, y in zip(h.peak_held, one.peak_inflight))
  assert all(x <= y for x, y in zip(h.peak_inflight, eager.peak_inflight))
  assert all(x <= y for x, y in zip(h.peak_held[:-1], eager.peak_held[:-1]))
  if B > S:
    assert sum(h.peak_inflight) < sum(eager.peak_inflight)
    assert h.peak_inflight[0] < eager.peak_inflight[0]


@given(pipelines(max_comm=0.5, symmetric=True))
def test_h1f1b_never_holds_more_than_eager_when_links_need_at_most_eager(p):
  """With every c <= t_max / 2, H-1F1B's delta is 1 or 2, Eager's always 2."""
  f, b, cf, cb, B = p
  w = h1f1b_warmups(f, b, cf, cb)
  e = sched.eager_1f1b_warmups(len(f))
  assert all(x <= y for x, y in zip(w, e))
  h = run(f, b, cf, cb, w, B)
  assert all(x <= min(y, B) for x, y in zip(h.peak_inflight, e))


def test_case_study_warmups_save_memory_over_eager():
  """§2.3.2 / Fig. 3(c,d): {5, 2, 1} instead of Eager's {5, 3, 1}."""
  f = np.array([45.2, 44.0, 44.0]) * 1e-3
  b = 2 * f
  c = [0.107, 0.0027]
  assert sched.h1f1b_warmups(c, (f + b).max(), eps=0.1) == (5, 2, 1)
  h = simulate(f, b, c, "h1f1b", num_microbatches=32)
  e = simulate(f, b, c, "eager_1f1b", num_microbatches=32)
  assert h.peak_inflight == (5, 2, 1) and e.peak_inflight == (5, 3, 1)
  assert h.iteration_time < e.iteration_time


# --------------------------------------------------------------------------- Eq. 12


def eq12(f, b, cf, cb, B):
  """HARP Eq. 12: sum_i (t_i + 2 c_i) + (B - 1) t_max, with 2 c_i = c_f + c_b."""
  t = np.add(f, b)
  return float(t.sum() + np.sum(cf) + np.sum(cb) + (B - 1) * t.max())


def eq12_bounds(f, b, cf, cb, warmups, B):
  """Bounds on the iteration time T of a 1F1B-family table (derived in docs/schedules.md).

  Lower (a path of the DAG, any warm-ups): for every stage s with w_s = min(N_s, B),
    T >= sum_{i<s} (t_i + c_f,i + c_b,i) + R_s + (B - w_s + 1) f_s + B b_s,
    R_s = c_f,s + c_b,s + sum_{i>s} (t_i + c_f,i + c_b,i)       (round trip below s);
  for a bottleneck stage this is Eq. 12 - (w_s - 1) f_s: the warm-up forwards of the
  bottleneck that hide part of the first round trip.

  Upper (a feasible periodic timetable with every stage stretched to t_max; needs
  c_f,i, c_b,i <= t_max and delta_i >= 1 + (c_f,i + c_b,i) / t_max):
    T <= Eq. 12 + sum_i [(delta_i - 1) t_max - c_f,i - c_b,i] + sum_{i>0} (t_max - t_i),
  the rounding slack of each delta (< t_max per link) plus the stretch of the stages after
  the first. Both terms are independent of B: warm-up and cool-down.
  """
  f, b, cf, cb = (np.asarray(x, float) for x in (f, b, cf, cb))
  S = len(f)
  t = f + b
  c = np.append(cf + cb, 0.0)
  lows = []
  for s in range(S):
    w = min(warmups[s], B)
    R = c[s] + np.sum(t[s + 1:] + c[s + 1:])
    lows.append(np.sum(t[:s] + c[:s]) + R + (B - w + 1) * f[s] + B * b[s])
  delta = np.array(warmups[:-1]) - np.array(warmups[1:])
  slack = np.sum((delta - 1) * t.max() - cf - cb)
  upper = eq12(f, b, cf, cb, B) + slack + np.sum(t.max() - t[1:])
  return max(lows), upper


@given(pipelines())
def test_eq12_within_derived_warmup_cooldown_terms(p):
  f, b, cf, cb, B = p
  w = h1f1b_warmups(f, b, cf, cb)
  r = run(f, b, cf, cb, w, B)
  lo, hi = eq12_bounds(f, b, cf, cb, w, B)
  assert lo - _atol(r) <= r.iteration_time <= hi + _atol(r)
  # In Eq. 12's own terms: -min_{bottleneck s} (w_s - 1) f_s <= T - Eq. 12 <= slack + stretch.
  gap = r.iteration_time - eq12(f, b, cf, cb, B)
  assert gap >= -min((min(w[s], B) - 1) * f[s] for s in r.bottleneck_stages) - _atol(r)


@given(pipelines(balanced=True, symmetric=True), st.data())
def test_eq12_is_exact_for_balanced_stages_with_integer_2c_over_t(p, data):
  """Balanced stages and 2c_i / t_max integer (c_i in {0, t/2, t}): both bounds meet Eq. 12
  (the last stage is a bottleneck, and there is no rounding slack nor stretch)."""
  f, b, _, _, B = p
  t = float(np.max(f + b))
  c = np.array(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=len(f) - 1,
                                  max_size=len(f) - 1))) * t
  r = run(f, b, c, c, h1f1b_warmups(f, b, c, c), B)
  assert r.iteration_time == pytest.approx(eq12(f, b, c, c, B), rel=1e-12)


def test_eq12_is_not_an_upper_bound():
  """Smallest balanced counterexample: S=3, f=b=1, c=(1.75, 0.25), B=7, N=(6, 3, 1).
  The 6 warm-up activations queue on link 0 (c > f), and in the cool-down the 3 gradients
  stage 1 produces back to back queue again (c > b): T = 22.5 > Eq. 12 = 22."""
  f, b, c = [1, 1, 1], [1, 1, 1], [1.75, 0.25]
  w = h1f1b_warmups(f, b, c, c)
  assert w == (6, 3, 1)
  r = run(f, b, c, c, w, 7)
  assert r.iteration_time == 22.5 and eq12(f, b, c, c, 7) == 22.0
  assert r.bubble.max() == 0.0                  # not a bubble: warm-up / cool-down queueing


def test_eq12_is_not_a_lower_bound():
  """Smallest counterexample: S=2, c=0, t=(4, 1): the fast last stage's work hides under the
  bottleneck's warm-up, T = 4B while Eq. 12 = 4B + 1."""
  for B in (2, 3, 8):
    r = run([2, 0.5], [2, 0.5], [0], [0], (2, 1), B)
    assert r.iteration_time == 4 * B and eq12([2, .5], [2, .5], [0], [0], B) == 4 * B + 1
