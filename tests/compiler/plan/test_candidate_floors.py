"""The search's per-candidate floors read from one array: the same numbers as one lookup each."""

import numpy as np
import pytest

from harpjax.compiler.plan.index import SparseIndex
from tests.compiler.plan import oracle


def _with_end_times(tables, rng):
  """Random end-of-iteration seconds, some entries with none and some repeated times."""
  ends = []
  for t in tables.stage_time_s:
    e = np.round(rng.uniform(0.0, 0.5, t.shape) * np.where(np.isfinite(t), t, 0.0), 3)
    ends.append(np.where(rng.random(t.shape) < 0.2, 0.0, e))
  times = tuple(np.round(t, 2) for t in tables.stage_time_s)   # ties between entries
  return tables.replace(end_time_s=tuple(ends), stage_time_s=times)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("link_bound", [False, True])
def test_candidate_hit_ends_equal_hit_end_at_every_candidate(seed, link_bound):
  rng = np.random.default_rng(seed)
  tables = _with_end_times(oracle.random_tables(rng), rng)
  index = SparseIndex.build(tables, link_bound=link_bound)
  expected = np.array([index.hit_end(float(tau)) for tau in index.candidates])
  assert index.candidate_hit_ends.shape == index.candidates.shape
  np.testing.assert_array_equal(index.candidate_hit_ends, expected)
  if index.num_entries:
    assert (expected > 0).any() or not np.any(index.arrays.ent_e > 0)
