"""The time model: per-op fixed costs (so a model's time does not depend on its cut), the
roofline default for GPU types without measurements, and the published data it is fitted to."""

import logging

import pytest

from harpjax.cluster import GPU_CATALOG, Cluster
from harpjax.compiler.layers import LayerOptions
from harpjax.compiler.profile import calibration as calib
from harpjax.compiler.layers import layers_for_step
from harpjax.compiler.profile import profiler as P
from harpjax.compiler.trace import trace_step
from harpjax.errors import HarpjaxError, PublishedDataError
from harpjax.models import BUILTIN_MODELS

THREE = Cluster.simple([("h100", "H100-80G", 1, 1), ("a100", "A100-40G", 1, 1),
                        ("t4", "T4", 1, 1)])


def _gpt16():
  return BUILTIN_MODELS["gpt-tiny"](num_blocks=16, hidden=256, num_heads=4, seq_len=128,
                                    microbatch_size=4, num_microbatches=2)


def _profile(spec, cluster, layer_options=None, **opts):
  opts.setdefault("use_cache", False)
  return P.profile_step(spec.step_fn, spec.args, cluster, num_microbatches=2,
                        layer_options=layer_options,
                        options=P.ProfileOptions(progress=False, **opts))


def test_predicted_time_does_not_depend_on_the_cut():
  spec = _gpt16()
  ts = trace_step(spec.step_fn, spec.args, num_microbatches=2)
  runs = {L: P.profile_layers(layers_for_step(ts, LayerOptions(target_layers=L)), THREE,
                              options=P.ProfileOptions(use_cache=False, progress=False))
          for L in (18, 200)}
  assert {L: len(r.layers) for L, r in runs.items()} == {18: 18, 200: 200}
  for name in ("h100", "a100", "t4"):
    coarse, fine = (runs[L].costs[(name, (1, 1), (1, 1))] for L in (18, 200))
    # the whole model on one device: the same within 2% (the bound), and the work
    assert fine["time_s"].sum() == pytest.approx(coarse["time_s"].sum(), rel=0.02)
    assert fine["flops"].sum() == pytest.approx(coarse["flops"].sum(), rel=0.02)
  # the faster GPU is faster at either cut: compute, not a fixed cost per layer, decides
  for r in runs.values():
    t = {n: r.costs[(n, (1, 1), (1, 1))]["time_s"].sum() for n in ("a100", "t4")}
    assert t["a100"] < t["t4"]


def test_gpu_types_without_measurements_get_the_default_and_one_warning(caplog):
  spec = BUILTIN_MODELS["gpt-tiny"](num_blocks=2, microbatch_size=2, num_microbatches=2)
  cluster = Cluster.simple([("h100", "H100-80G", 1, 1), ("l40s", "L40S", 1, 1),
                            ("h200", "H200", 1, 1), ("a100", "A100-40G", 1, 1)])
  with caplog.at_level(logging.WARNING, logger="harpjax"):
    res = _profile(spec, cluster)
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and "published measurements" in r.getMessage()]
  assert len(warned) == 1
  assert "H100-80G, H200, L40S" in warned[0] and "A100-40G" not in warned[0]
  # H200 is H100 with faster memory: under the default it is never slower
  h100, h200 = (res.costs[(n, (1, 1), (1, 1))]["time_s"] for n in ("h100", "h200"))
  assert (h200 <= h100).all()
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="harpjax"):
    _profile(spec, Cluster.simple([("a100", "A100-40G", 1, 1), ("t4", "T4", 1, 1)]))
    mine = {"H100-80G": calib.Efficiency(0.5, 5.0, 1e-5)}
    _profile(spec, Cluster.simple([("h100", "H100-80G", 1, 1)]), efficiencies=mine)
  assert not [r for r in caplog.records if "published measurements" in r.getMessage()]


def test_default_is_the_documented_roofline():
  d = calib.DEFAULT_EFFICIENCY
  g = GPU_CATALOG["H100-80G"]
  w = calib.Work(heavy_flops=(4e12,), heavy_bytes=(1e8,), light_bytes=3e9, kernels=10)
  want = 4e12 / (g.peak_flops * 0.65) + 3e9 / (g.mem_bandwidth_bytes_per_s * 10.0) + 10 * 1e-4
  assert (d.compute, d.memory, d.kernel_s) == (0.65, 10.0, 1e-4)
  assert calib.predict_time_s(w, g.peak_flops, g.mem_bandwidth_bytes_per_s,
                              calib.efficiency_for("H100-80G")) == pytest.approx(want)


def test_imported_source_without_data_or_match_is_one_named_error(tmp_path):
  spec = BUILTIN_MODELS["gpt-tiny"](num_blocks=2, microbatch_size=2, num_microbatches=2)
  layers = layers_for_step(trace_step(spec.step_fn, spec.args, num_microbatches=2))
  cluster = Cluster.simple([("v100", "V100-32G", 1, 1)])
  imported = lambda **kw: P.profile_layers(layers, cluster, options=P.ProfileOptions(
      source="imported", use_cache=False, progress=False, **kw))
  with pytest.raises(PublishedDataError, match="no published measurements at"):
    imported(imported_data_dir=str(tmp_path))
  if not (calib.default_zorse_dir() / "zorse_model_stats.json").exists():
    pytest.skip("published measurements not found beside the repo")
  # the tiny GPT's block (hidden 32) is no published model's: refused, naming the nearest
  with pytest.raises(PublishedDataError, match="no published measurements of a block of "
                                               "hidden 32") as e:
    imported()
  assert "\n" not in str(e.value)
  # a published model of another shape is refused too, not silently used
  with pytest.raises(PublishedDataError, match="does not have this model's block shape"):
    imported(imported_model="deepspeedgpt_2.7b")
  with pytest.raises(HarpjaxError, match="known:"):
    imported(imported_model="no-such-model")
