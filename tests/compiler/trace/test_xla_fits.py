"""The numbers read off XLA's cost analysis (a draw's and a key's FLOPs) are kept on disk: a
second process reads them instead of compiling the small programs again."""

import numpy as np
import pytest

import jax

from harpjax.compiler.trace.primitives import XlaFits, small_program_flops


def test_fits_are_computed_once_then_read_from_disk(tmp_path, monkeypatch):
  monkeypatch.setenv("HARPJAX_CACHE_DIR", str(tmp_path))
  calls = []
  first = XlaFits("test_kind")
  assert first.get(("cpu", "key<fry>", 32, 2), lambda: calls.append(1) or (42.5, 7.0)) \
      == (42.5, 7.0)
  assert calls == [1] and (tmp_path / "xla_fits.json").exists()
  # a fresh memo (another process): from disk, nothing computed
  again = XlaFits("test_kind")
  assert again.get(("cpu", "key<fry>", 32, 2), lambda: pytest.fail("recomputed")) == (42.5, 7.0)
  # another key or kind is computed, and the file keeps both
  other = XlaFits("other_kind")
  assert other.get(("cpu", "key<fry>", 32, 2), lambda: (1.0, 2.0)) == (1.0, 2.0)
  assert XlaFits("test_kind").get(("cpu", "key<fry>", 32, 2), lambda: pytest.fail("lost")) \
      == (42.5, 7.0)


def test_an_unreadable_file_is_recomputed(tmp_path, monkeypatch):
  monkeypatch.setenv("HARPJAX_CACHE_DIR", str(tmp_path))
  (tmp_path / "xla_fits.json").write_text("not json")
  assert XlaFits("k").get((1,), lambda: (3.0, np.float64(4.0))) == (3.0, 4.0)
  assert XlaFits("k").get((1,), lambda: pytest.fail("recomputed")) == (3.0, 4.0)


@pytest.mark.parametrize("what", ["bits", "split"])
def test_small_programs_count_the_flops_of_the_default_compilation(what):
  """The fits compile without backend code optimisation: XLA's count is the same."""
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  fn = ((lambda k: jax.random.bits(k, (2, 2, 2, 64), np.uint32)) if what == "bits" else
        (lambda k: jax.random.split(k, 4)))
  ca = jax.jit(fn).lower(key).compile().cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  assert ca["flops"] > 100
  assert small_program_flops(fn, key) == ca["flops"]
