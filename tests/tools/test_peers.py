"""``benchmarks/peers.py``: the tables it writes, between their markers, on a tiny case."""

import importlib.util
import os

import pytest

from harpjax.compiler.profile.calibration import default_zorse_dir

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _peers():
  spec = importlib.util.spec_from_file_location(
      "peers_bench", os.path.join(ROOT, "benchmarks", "peers.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_replace_between_markers():
  peers = _peers()
  text = "a\n<!-- peers:zorse -->\nold\n<!-- /peers:zorse -->\nb\n"
  once = peers.replace_between(text, "zorse", "| new |")
  assert once == "a\n<!-- peers:zorse -->\n| new |\n<!-- /peers:zorse -->\nb\n"
  assert peers.replace_between(once, "zorse", "| new |") == once   # a rerun replaces
  with pytest.raises(peers.MarkerError):
    peers.replace_between("no markers", "zorse", "x")
  with pytest.raises(peers.MarkerError):
    peers.replace_between(text + text, "zorse", "x")


def test_verdict_says_who_wins():
  v = _peers()._verdict
  assert v(8.0, 10.0, "Zorse") == "ours 25% faster"
  assert v(12.0, 10.0, "Zorse") == "**Zorse 20% faster**"
  assert v(10.0, 20.0, "Zorse") == "ours 2.00x as fast"
  assert v(3.0, 2.0, "Sailor", "cheaper") == "**Sailor cheaper: ours costs 1.50x as much**"
  assert v(2.0, 3.0, "Sailor", "cheaper") == "ours cheaper: Sailor costs 1.50x as much"
  assert v(10.02, 10.0, "Zorse") == "tie (within 0.5%)"
  assert v(float("inf"), 10.0, "Zorse").startswith("**Zorse**")


@pytest.mark.skipif(
    not all((default_zorse_dir() / f).exists()
            for f in ("zorse_model_latencies.json", "zorse_model_stats.json")),
    reason="Zorse's published measurements not found beside the repo")
def test_tiny_run_writes_one_table_per_peer(tmp_path, capsys):
  readme = tmp_path / "README.md"
  readme.write_text("# x\n<!-- peers:zorse -->\n<!-- /peers:zorse -->\n\n"
                    "<!-- peers:sailor -->\nstale\n<!-- /peers:sailor -->\nend\n")
  peers = _peers()
  assert peers.main(["--tiny", "--readme", str(readme)]) == 0
  text = readme.read_text()
  assert "stale" not in text and text.endswith("end\n")
  zorse_part = text.split("<!-- peers:zorse -->")[1].split("<!-- /peers:zorse -->")[0]
  sailor_part = text.split("<!-- peers:sailor -->")[1].split("<!-- /peers:sailor -->")[0]
  # The one Zorse row: Zorse's measured 17.17 s (4371 TFLOPs under its own FLOP count), ours
  # with the recomputation charged and without, and who wins.
  assert "| A Llama 7B | 20 | 17.17 (4371) |" in zorse_part
  assert "ours 5% faster" in zorse_part
  assert "| a100x32 (OPT-350) | min time |" in sailor_part and "faster" in sailor_part
  # A rerun leaves the file as it was (the tables are deterministic).
  assert peers.main(["--tiny", "--readme", str(readme)]) == 0
  assert readme.read_text() == text
