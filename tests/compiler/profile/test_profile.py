"""The zero-redundant profiler: dedup by signature, pruning, sources, cache, calibration."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from harpjax.cluster import GPU_CATALOG, Cluster, GPUType
from harpjax.compiler.profile import cache as cache_lib
from harpjax.compiler.profile import calibration as calib
from harpjax.compiler.profile import tables as tables_lib
from harpjax.compiler.profile import profiler as P
from harpjax.compiler.profile import CostTables, stage_memory
from harpjax.errors import HarpjaxError
from harpjax.models import BUILTIN_MODELS

SMALL = Cluster.simple([("v100", "V100-32G", 1, 2), ("a100", "A100-40G", 1, 2)])
DATA = calib.default_zorse_dir()
needs_data = pytest.mark.skipif(not (DATA / "zorse_model_latencies.json").exists(),
                                reason="published measurements not found beside the repo")


def _gpt(num_blocks, **kw):
  kw.setdefault("num_microbatches", 2)
  return BUILTIN_MODELS["gpt-tiny"](num_blocks=num_blocks, microbatch_size=4, **kw)


def _profile(spec, cluster=SMALL, **opts):
  """Profiles with the XLA-compiled analytic source unless told otherwise (the jaxpr source,
  the default, has its own tests in test_jaxpr_source.py)."""
  opts.setdefault("source", "analytic")
  return P.profile_step(spec.step_fn, spec.args, cluster,
                        num_microbatches=spec.num_microbatches,
                        options=P.ProfileOptions(progress=False, **opts))


@pytest.fixture(scope="module")
def gpt48(tmp_path_factory):
  cache = tmp_path_factory.mktemp("profiles")
  res = _profile(_gpt(48), cache_dir=str(cache))
  return res, cache


def test_unique_tasks_are_per_block_layer_not_per_layer(gpt48):
  res, _ = gpt48
  st, seq = res.stats, res.layers
  assert seq.module_kinds() == {"block": 48} and st.layers_per_repeat == 3
  # configurations: per subcluster (1,1):(1,1); (1,2):(2,1),(1,2)
  assert st.configs == 6 and st.candidates == 6 * 146
  # embed + 3 block layers + head, once per configuration: 5 x 6, not 146 x 6
  assert st.distinct_layers == 5 and st.unique_tasks == 5 * 6
  # both GPU types share the compilations: (signature, tp, local batch)
  assert st.unique_compiles == 5 * 3
  assert st.naive_stage_submesh == 146 * 147 // 2 * 4 and st.reduction > 1000
  assert not st.dp_approximated


def test_gradient_sync_is_charged_once_per_step(gpt48):
  """A data-parallel entry's time per microbatch holds no gradient all-reduce; its end time
  (after the stage's last backward) holds one ring all-reduce of the stage's gradient bytes on
  the link between its replicas and the optimizer update, as the runtime runs them."""
  from harpjax.compiler.profile.collectives import allreduce_time_s
  res, _ = gpt48
  t = res.tables
  k, i, j = 1, 5, 9
  s = t.submesh_index(k, (1, 2))
  assert t.logical_mesh_of(k, i, j, s) == (2, 1)
  cost = res.costs[("a100", (1, 2), (2, 1))]
  assert t.stage_time_s[k][i, j, s] == pytest.approx(cost["time_s"][i:j + 1].sum())
  assert not cost["comm_s"][i:j + 1].any()   # dp alone: no collective per microbatch
  sub = [x for x in res.cluster.subclusters if x.name == "a100"][0]
  link = P.dp_link(res.cluster, sub, (1, 2))
  grads = cost["grad_bytes"][i:j + 1].sum()
  assert grads > 0
  sync = allreduce_time_s(grads, 2, link)
  assert t.sync_time_s[k][i, j, s] == pytest.approx(sync)
  update = 2 * cost["param_mem_bytes"][i:j + 1].sum() / sub.gpu.mem_bandwidth_bytes_per_s
  assert t.end_time_s[k][i, j, s] == pytest.approx(sync + update)
  one = t.submesh_index(k, (1, 1))   # one device: nothing to reduce
  assert t.sync_time_s[k][i, j, one] == 0.0 < t.end_time_s[k][i, j, one]


def test_tables_are_valid_and_consistent(gpt48):
  res, _ = gpt48
  t = res.tables
  assert isinstance(t, CostTables) and t.num_layers == 146
  assert t.subcluster_names == ("v100", "a100") and t.submeshes == (((1, 1), (1, 2)),) * 2
  for k in range(2):
    st = t.stage_time_s[k]
    # identical ranges cost bit-identically (block i..i+2 for every block)
    starts = [1 + 3 * b for b in range(48)]
    vals = {st[i, i + 2, 0] for i in starts}
    assert len(vals) == 1 and np.isfinite(vals.pop())
    # single layers are never pruned as imbalanced
    assert np.isfinite(np.diagonal(st[:, :, 1])).all()
  # A100 is faster than V100 on the same layers
  assert t.stage_time_s[1][1, 3, 0] < t.stage_time_s[0][1, 3, 0]
  # the time of a range is the sum of its layers (under the chosen logical mesh)
  cost = res.costs[("a100", (1, 1), (1, 1))]
  assert t.stage_time_s[1][5, 9, 0] == pytest.approx(cost["time_s"][5:10].sum())
  # the memory is the memory model's (profile.stage_memory): the state (16 bytes per
  # parameter, 12 of them the optimizer's), and the larger of a forward's outputs and
  # temporaries and a backward's new gradient and temporaries (each executable its own);
  # after the pipeline, the update (a backward adds each layer's gradient into the donated
  # accumulator: the largest layer's gradient is written beside it)
  state = cost["param_mem_bytes"][5:10].sum()
  opt = state / 16 * 12
  w = (state - opt) / 2
  gout = cost["grad_bytes"][5:10].max() * w / cost["grad_bytes"][5:10].sum()
  out = res.layers[9].boundary_bytes
  ws_f, ws_b = cost["fwd_temp_bytes"][5:10].max(), cost["bwd_temp_bytes"][5:10].max()
  assert max(ws_f, ws_b) == pytest.approx(cost["temp_bytes"][5:10].max())
  m = stage_memory(param_bytes=w, grad_bytes=w, opt_bytes=opt, act_bytes=0.0, dp=1, zero=0,
                   out_bytes=out, workspace_bytes=ws_f, bwd_workspace_bytes=ws_b,
                   replicas=True, grad_out_bytes=gout)
  assert t.param_mem_bytes[1][5, 9, 0] == pytest.approx(m.fixed_bytes())
  # the tables' one workspace gives the same pipeline peak beside the outputs or the gradient
  assert max(out, gout) + t.workspace_bytes[1][5, 9, 0] == pytest.approx(
      max(out + ws_f, gout + ws_b))
  assert t.grad_out_bytes[1][5, 9, 0] == pytest.approx(gout)
  assert t.step_mem_bytes[1][5, 9, 0] == pytest.approx(m.step_bytes())
  assert m.step_bytes() > state
  assert res.stats.pruned_imbalance > 0
  # tensor parallelism halves the block layers' parameter state
  tp2 = res.costs[("a100", (1, 2), (1, 2))]["param_mem_bytes"][1:4]
  assert np.all(tp2 < 0.6 * cost["param_mem_bytes"][1:4])


def test_warm_cache_recomputes_nothing(gpt48):
  res, cache = gpt48
  again = _profile(_gpt(48), cache_dir=str(cache))
  assert again.stats.computed == 0 and again.stats.cache_hits == again.stats.unique_tasks
  for a, b in zip(res.tables.stage_time_s, again.tables.stage_time_s):
    np.testing.assert_array_equal(a, b)


def test_corrupt_or_stale_cache_is_recomputed(gpt48, tmp_path):
  shutil.copytree(gpt48[1], tmp_path, dirs_exist_ok=True)
  spec = _gpt(2)
  first = _profile(spec, cache_dir=str(tmp_path))
  assert first.stats.computed == 0     # a 2-block GPT's layers are the 48-block one's
  files = [f for f in sorted(tmp_path.rglob("*.json"))
           if json.loads(f.read_text())["key"].get("source") == "analytic"]
  assert len(files) >= first.stats.unique_tasks
  files[0].write_text("{not json")
  entry = json.loads(files[1].read_text())
  entry["version"] = "harpjax-0.0.0"
  files[1].write_text(json.dumps(entry))
  again = _profile(spec, cache_dir=str(tmp_path))
  assert again.stats.computed in (1, 2)   # the corrupt and stale entries (if this model's)
  for a, b in zip(first.tables.stage_time_s, again.tables.stage_time_s):
    np.testing.assert_allclose(a, b)
  db = cache_lib.ProfileDB(tmp_path)
  assert db.get({"what": "nothing"}) is None
  db.put({"what": "x"}, {"v": 1.0})
  assert db.get({"what": "x"}) == {"v": 1.0}
  assert cache_lib.ProfileDB(tmp_path, version="other").get({"what": "x"}) is None


def test_cache_dir_from_environment(monkeypatch, tmp_path):
  monkeypatch.setenv(cache_lib.CACHE_DIR_ENV, str(tmp_path / "here"))
  assert cache_lib.default_cache_dir() == tmp_path / "here"
  monkeypatch.delenv(cache_lib.CACHE_DIR_ENV)
  assert cache_lib.default_cache_dir() == Path("~/.cache/harpjax/profiles").expanduser()
  assert cache_lib.CACHE_DIR_ENV == "HARPJAX_CACHE_DIR"


def test_measured_source(tmp_path):
  cluster = Cluster.simple([("a100", "A100-40G", 1, 2)])
  res = _profile(_gpt(2), cluster, source="measured", repeats=2, cache_dir=str(tmp_path),
                 max_tp=1)
  t = res.tables.stage_time_s[0]
  assert res.stats.unique_tasks == 5 * 2 and res.stats.computed == 10
  assert np.isfinite(t[0, -1, :]).all() and (t[0, -1, :] > 0).all()
  dp2 = res.costs[("a100", (1, 2), (2, 1))]
  assert (dp2["act_mem_bytes"][1:4] > 0).all()
  single = res.costs[("a100", (1, 1), (1, 1))]["act_mem_bytes"]
  assert (dp2["act_mem_bytes"][1:4] < single[1:4]).all()


def test_parameters_that_cannot_fit_are_pruned(gpt48):
  tiny = GPUType("tiny-gpu", 1e12, 100_000, 1e11, 1e10)
  cluster = Cluster.simple([("t", tiny, 1, 2)])
  # At ZeRO level 0 only (with levels, a layer fits when its dp share does).
  res = _profile(_gpt(2), cluster, cache_dir=str(gpt48[1]),   # shares XLA statistics
                 optimizer_bytes_per_param=None)
  assert res.stats.computed > 0
  # the embedding's state (16 B x 8704 parameters) and the MLPs' (16 B x 8352) do not fit
  # one device without tensor parallelism: embed, head, 2 MLP layers on 2 configurations
  assert res.stats.pruned_tasks == 8
  assert np.isinf(res.costs[("t", (1, 1), (1, 1))]["time_s"][0])
  assert not np.isfinite(res.tables.stage_time_s[0][0, :, 0]).any()
  assert np.isfinite(res.costs[("t", (1, 2), (1, 2))]["time_s"][0])   # tp=2 halves it
  assert res.stats.pruned_oom > 0


@needs_data
def test_imported_source_uses_published_block_time(tmp_path):
  spec = BUILTIN_MODELS["gpt-2.6b"](num_blocks=2, seq_len=512, microbatch_size=1,
                                    num_microbatches=1, vocab_size=512)
  cluster = Cluster.simple([("v100", "V100-32G", 1, 1)])
  kw = dict(cache_dir=str(tmp_path), max_tp=1)
  ana = _profile(spec, cluster, **kw)
  imp = _profile(spec, cluster, source="imported", imported_model="deepspeedgpt_2.7b", **kw)
  block = slice(1, 4)
  entry = calib.load_zorse(DATA)["deepspeedgpt_2.7b"]["v100x16"]["512"]["float16"]
  published = calib.zorse_fit_ms(entry, 1) * 1e-3
  got = imp.costs[("v100", (1, 1), (1, 1))]["time_s"][block].sum()
  assert got == pytest.approx(published, rel=1e-6)
  a = ana.costs[("v100", (1, 1), (1, 1))]["time_s"]
  i = imp.costs[("v100", (1, 1), (1, 1))]["time_s"]
  assert a[0] == i[0] and a[-1] == i[-1]    # embed and head stay analytic
  # without a name the published model is chosen by the block's shape: the same one
  auto = _profile(spec, cluster, source="imported", **kw)
  assert auto.costs[("v100", (1, 1), (1, 1))]["time_s"][block].sum() == pytest.approx(
      published, rel=1e-6)


def test_calibration_constants_and_time_model():
  # every calibrated type within 15% of the published measurements on average, T4 included
  assert {"A100-40G", "A100-80G", "V100-16G", "V100-32G", "A10G", "T4"} <= set(
      calib.CALIBRATION)
  for name, e in calib.CALIBRATION.items():
    assert e.samples >= 40 and e.mape <= 0.15 and 0.2 < e.compute <= 1.0, name
  g = GPU_CATALOG["A100-40G"]
  e = calib.CALIBRATION["A100-40G"]
  work = calib.Work(heavy_flops=(1e12, 1e6), heavy_bytes=(1e9, 1e9), light_bytes=2e9,
                    kernels=7)
  bw = g.mem_bandwidth_bytes_per_s * e.memory
  want = (1e12 / (g.peak_flops * e.compute)      # a compute-bound matmul
          + 1e9 / bw                             # a memory-bound one
          + 2e9 / bw + 7 * e.kernel_s)           # the other ops, and every kernel's fixed cost
  assert calib.predict_time_s(work, g.peak_flops, g.mem_bandwidth_bytes_per_s,
                              e) == pytest.approx(want)
  assert calib.efficiency_for("H100-80G") is calib.DEFAULT_EFFICIENCY
  assert calib.uncalibrated(["H100-80G", "T4", "L40S", "H100-80G"]) == ["H100-80G", "L40S"]
  mine = calib.Efficiency(0.5, 1.0, 1e-5)
  assert calib.efficiency_for("H100-80G", {"H100-80G": mine}) is mine
  assert calib.uncalibrated(["H100-80G", "T4"], {"H100-80G": mine}) == []
  assert calib.zorse_layer_ms([1.0, 2.0]) is None
  assert calib.zorse_layer_ms([[1, 0.5], [2, 1.0]]) == {1: 4.5, 2: 7.5, 4: 13.5}


def test_range_sums_are_left_to_right():
  x = np.array([0.1, 0.2, 0.3, np.inf, 0.4])
  s = tables_lib.range_sums(x)
  assert s[0, 2] == (0.1 + 0.2) + 0.3 and s[1, 2] == 0.2 + 0.3
  assert np.isinf(s[2, 3]) and np.isinf(s[0, 4]) and s[4, 4] == 0.4
  assert tables_lib.range_max(np.array([1.0, 3.0, 2.0]))[0, 2] == 3.0


def test_bad_options():
  with pytest.raises(HarpjaxError):
    P.ProfileOptions(source="guess")
  with pytest.raises(HarpjaxError):
    P.profile_layers(_fake_empty(), SMALL)


def _fake_empty():
  from harpjax.compiler.layers import LayerSequence
  from harpjax.compiler.trace import Program
  return LayerSequence(Program((), (), (), ()), ())


@pytest.mark.slow
@needs_data
def test_calibration_reproduces_its_constants(tmp_path):
  from tools.calibration import calibrate
  rep = calibrate(DATA, gpu_names=["A100-40G", "T4"])
  for name, e in rep.efficiencies.items():
    ref = calib.CALIBRATION[name]
    assert e.samples == ref.samples
    assert e.mape == pytest.approx(ref.mape, abs=0.01)
    assert (e.compute, e.memory, e.kernel_s) == pytest.approx(
        (ref.compute, ref.memory, ref.kernel_s), rel=0.01)
  assert "| T4 | t4 | 83 |" in rep.table()


@pytest.mark.slow
def test_gpt39b_like_analytic_tables(tmp_path):
  """GPT-39B shapes (hidden 8192, 64 heads, seq 1024, microbatch 8, fp16), 2 blocks."""
  spec = BUILTIN_MODELS["gpt-39b"](num_blocks=2, num_microbatches=1)
  cluster = Cluster.load(Path(__file__).parents[3] / "benchmarks" / "configs" /
                         "hetero_64.yaml")
  res = _profile(spec, cluster, cache_dir=str(tmp_path), remat=True)
  t = res.tables
  assert t.num_layers == 8 and res.stats.unique_compiles <= 5 * 16
  a100 = res.costs[("a100", (1, 1), (1, 1))]["time_s"][1:4].sum()
  v100 = res.costs[("v100", (1, 1), (1, 1))]["time_s"][1:4].sum()
  # 6 x 805M params x 8192 tokens (+ remat, attention) at ~57% of 312 TFLOP/s: ~0.3 s
  assert 0.15 < a100 < 0.6 and 2.0 < v100 / a100 < 3.0
