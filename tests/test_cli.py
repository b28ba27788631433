"""Bad input gets one clear message before any long work; Ctrl-C stops any command.

* the profile cache: invalid entries (NaN, inf, negative, wrong types, truncated files) are
  misses, recomputed and overwritten, reported by one summary warning; ``--no-cache``;
* every CLI argument is checked before tracing, profiling, planning or simulating (the long
  work is monkeypatched to fail: a test passes only if it never started);
* plan files and cluster files: typed fields, errors naming the file and the field, bounds;
* Ctrl-C (SIGINT) during ``python -m harpjax plan`` exits with status 130 and one line, wherever
  the planner is: Python, worker processes, worker threads, Numba code, XLA compilation, or
  code that swallows the ``KeyboardInterrupt``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import harpjax.compiler.plan as plan_pkg
import harpjax.compiler.profile as profile_pkg
import harpjax.compiler.schedule as schedule_pkg
from harpjax.cli import INTERRUPT_MESSAGE, INTERRUPTED, main as cli_main
from harpjax.cluster import MAX_DEVICES_PER_HOST, MAX_HOSTS, Cluster, SubCluster
from harpjax.compiler.plan import Plan, StageSpec, load_plan
from harpjax.compiler.profile import ProfileDB
from harpjax.compiler.profile import cache as cache_lib
from harpjax.errors import ClusterSpecError, HarpjaxError, PlanError
from tests.equivalence import cluster_yaml

ROOT = Path(__file__).resolve().parents[1]

CLUSTER_YAML = """\
subclusters:
  - {name: a100, gpu: A100-40G, hosts: 1, devices_per_host: 2}
"""

LAYER_COST = {"time_s": 1e-3, "comm_s": 1e-5, "param_mem_bytes": 1024.0, "act_mem_bytes": 64.0,
              "temp_bytes": 0.0, "flops": 1e6, "grad_bytes": 256.0, "fwd_temp_bytes": 0.0,
              "bwd_temp_bytes": 0.0, "draw_bytes": 0.0, "draw_max_bytes": 0.0,
              "remat_held_bytes": 0.0, "inner_remat_flops": 0.0, "inner_remat_time_s": 0.0}
XLA_STATS = {"flops": 4e5, "bytes_accessed": 2e5, "transcendentals": 10.0,
             "collective_bytes": {"all-reduce": [4480.0, 3]}, "temp_bytes": 25104.0,
             "residual_bytes": 4224.0, "param_bytes": 8448.0, "num_params": 2112.0,
             "compile_s": 0.5, "fwd_temp_bytes": 25104.0, "bwd_temp_bytes": 25104.0,
             "draw_bytes": 0.0, "draw_max_bytes": 0.0, "remat_held_bytes": 0.0}
COST_KEY = {"source": "analytic", "signature": "abc", "gpu": "A100-40G", "mesh": [1, 1]}
STATS_KEY = {"what": "xla-stats", "signature": "abc", "tp": 1, "microbatch": 2, "remat": True}


@pytest.fixture
def cluster_file(tmp_path) -> str:
  path = tmp_path / "cluster.yaml"
  path.write_text(CLUSTER_YAML)
  return str(path)


@pytest.fixture
def no_long_work(monkeypatch):
  """Profiling, planning and simulating fail the test if they start."""
  def never(*args, **kwargs):
    raise AssertionError("the long work started before the arguments were checked")
  monkeypatch.setattr(profile_pkg, "profile_step", never)
  monkeypatch.setattr(plan_pkg, "solve", never)
  monkeypatch.setattr(schedule_pkg, "simulate", never)


def _refused(res, *needles, status=None):
  """One clear message: a click exit (no traceback) whose output names ``needles``."""
  assert isinstance(res.exception, SystemExit), (res.exception, res.output)
  assert res.exit_code != 0 and (status is None or res.exit_code == status), res.output
  assert "Traceback" not in res.output
  for needle in needles:
    assert needle in res.output, (needle, res.output)
  assert res.output.count("Error:") == 1, res.output


def _run(*args):
  return CliRunner().invoke(cli_main, [str(a) for a in args])


# --------------------------------------------------------------------------- cache: unit


def _with(value: dict, **changes) -> dict:
  return {**json.loads(json.dumps(value)), **changes}


@pytest.mark.parametrize("key, value, field", [
    (COST_KEY, _with(LAYER_COST, time_s=float("nan")), "time_s"),
    (COST_KEY, _with(LAYER_COST, time_s=float("inf")), "time_s"),
    (COST_KEY, _with(LAYER_COST, time_s=0.0), "time_s"),
    (COST_KEY, _with(LAYER_COST, time_s=-1e-3), "time_s"),
    (COST_KEY, _with(LAYER_COST, act_mem_bytes=-64.0), "act_mem_bytes"),
    (COST_KEY, _with(LAYER_COST, param_mem_bytes=float("-inf")), "param_mem_bytes"),
    (COST_KEY, _with(LAYER_COST, flops="1e6"), "flops"),
    (COST_KEY, _with(LAYER_COST, comm_s=True), "comm_s"),
    (COST_KEY, _with(LAYER_COST, temp_bytes=None), "temp_bytes"),
    (COST_KEY, {k: v for k, v in LAYER_COST.items() if k != "flops"}, "flops"),
    (COST_KEY, _with(LAYER_COST, extra=1.0), "extra"),
    (COST_KEY, [1e-3, 0.0], "list"),
    (STATS_KEY, _with(XLA_STATS, collective_bytes={"all-reduce": [4480.0, -3]}), "collective"),
    (STATS_KEY, _with(XLA_STATS, collective_bytes={"all-reduce": [4480.0, 1.5]}), "collective"),
    (STATS_KEY, _with(XLA_STATS, collective_bytes=[4480.0, 3]), "collective_bytes"),
    (STATS_KEY, _with(XLA_STATS, num_params=2112.5), "num_params"),
    (STATS_KEY, _with(XLA_STATS, temp_bytes=-1.0), "temp_bytes"),
    ({"what": "zorse-block"}, {"layers": []}, "layers"),
    ({"what": "zorse-block"}, {"layers": [[1.0, float("nan")]]}, "layers"),
    ({"what": "something-else"}, {"v": [1.0, {"w": float("nan")}]}, "w"),
])
def test_entry_problem_names_the_field(key, value, field):
  problem = cache_lib.entry_problem(key, value)
  assert problem and field in problem, problem


def test_entry_problem_accepts_valid_entries():
  assert cache_lib.entry_problem(COST_KEY, LAYER_COST) is None
  assert cache_lib.entry_problem(STATS_KEY, XLA_STATS) is None
  assert cache_lib.entry_problem(STATS_KEY, _with(XLA_STATS, collective_bytes={})) is None
  assert cache_lib.entry_problem({"what": "zorse-block"}, {"layers": [[1.0, 2.0]]}) is None
  assert cache_lib.entry_problem({"what": "x"}, {"v": 1.0, "w": ["a", 2]}) is None
  assert cache_lib.entry_kind(COST_KEY) == "layer-cost"
  assert cache_lib.entry_kind(STATS_KEY) == "xla-stats"
  assert cache_lib.entry_kind({"what": "x"}) is None


def test_entry_fields_are_the_cost_types_fields():
  # The cache checks exactly the fields the profiler's types write: keep them in step.
  from harpjax.compiler.profile.pieces import XlaStats
  from harpjax.compiler.profile.sources import LayerCost
  assert set(cache_lib.ENTRY_FIELDS["layer-cost"]) == {f.name for f in
                                                       dataclasses.fields(LayerCost)}
  assert set(cache_lib.ENTRY_FIELDS["xla-stats"]) == {f.name for f in
                                                      dataclasses.fields(XlaStats)}
  assert cache_lib.entry_problem(COST_KEY, LayerCost(**LAYER_COST).to_json()) is None


def _corrupt(db: ProfileDB, key: dict, how: str) -> Path:
  """Writes a valid entry for ``key`` and breaks it ``how``."""
  value = LAYER_COST if cache_lib.entry_kind(key) == "layer-cost" else XLA_STATS
  db.put(key, value)
  path = db._path(key)
  entry = json.loads(path.read_text())
  text = {
      "nan-time": lambda: json.dumps({**entry, "value": _with(value, time_s=float("nan"))}),
      "negative-memory": lambda: json.dumps({**entry, "value": _with(value, temp_bytes=-5.0)}),
      "wrong-type": lambda: json.dumps({**entry, "value": _with(value, flops="many")}),
      "value-not-a-mapping": lambda: json.dumps({**entry, "value": [1.0, 2.0]}),
      "entry-not-a-mapping": lambda: json.dumps([entry]),
      "truncated": lambda: path.read_text()[:len(path.read_text()) // 2],
      "not-utf8": lambda: None,
  }[how]()
  if text is None:
    path.write_bytes(b"\xff\xfe\x00garbage")
  else:
    path.write_text(text)
  return path


HOWS = ["nan-time", "negative-memory", "wrong-type", "value-not-a-mapping", "entry-not-a-mapping",
        "truncated", "not-utf8"]


@pytest.mark.parametrize("how", HOWS)
def test_invalid_entry_is_a_miss_and_is_overwritten(tmp_path, how):
  db = ProfileDB(tmp_path)
  key = dict(COST_KEY) if how != "negative-memory" else dict(STATS_KEY)
  _corrupt(db, key, how)
  assert db.get(key) is None and db.misses == 1 and db.invalid == 1 and db.hits == 0
  value = LAYER_COST if "source" in key else XLA_STATS
  db.put(key, value)                      # what the profiler does with the recomputed cost
  assert db.get(key) == value and db.hits == 1 and db.invalid == 1


def test_invalid_entries_give_one_summary_warning(tmp_path, caplog):
  db = ProfileDB(tmp_path)
  keys = [dict(COST_KEY, signature=f"s{i}") for i in range(len(HOWS))]
  for key, how in zip(keys, HOWS):
    _corrupt(db, key, how)
  stale = dict(COST_KEY, signature="stale")
  db.put(stale, LAYER_COST)
  ProfileDB(tmp_path, version="other").get(stale)        # another version: stale, not invalid
  with caplog.at_level(logging.WARNING, logger=cache_lib.__name__):
    assert all(db.get(k) is None for k in keys)
    assert not caplog.records                              # nothing per entry
    assert db.report_invalid() == len(HOWS)
    assert db.report_invalid() == 0
  warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1, warnings
  assert f"{len(HOWS)} cache entries in {tmp_path} were invalid and are recomputed" \
      in warnings[0]


def test_summary_warning_when_the_database_is_dropped(tmp_path, caplog):
  db = ProfileDB(tmp_path)
  for i, how in enumerate(["nan-time", "truncated", "wrong-type"]):
    _corrupt(db, dict(COST_KEY, signature=f"s{i}"), how)
  db = ProfileDB(tmp_path)
  with caplog.at_level(logging.WARNING, logger=cache_lib.__name__):
    for i in range(3):
      db.get(dict(COST_KEY, signature=f"s{i}"))
    del db
    gc.collect()
  warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1 and "3 cache entries" in warnings[0], warnings


def test_values_are_checked_as_they_read_back(tmp_path):
  db = ProfileDB(tmp_path)
  db.put(STATS_KEY, {**XLA_STATS, "collective_bytes": {"all-reduce": (4480.0, 3)}})
  assert db.get(STATS_KEY) == XLA_STATS and db.invalid == 0


def test_invalid_values_are_not_written(tmp_path, caplog):
  db = ProfileDB(tmp_path)
  with caplog.at_level(logging.WARNING, logger=cache_lib.__name__):
    db.put(COST_KEY, _with(LAYER_COST, time_s=float("nan")))
    db.put(STATS_KEY, _with(XLA_STATS, num_params=-1.0))
  assert not list(tmp_path.rglob("*.json")) and not list(tmp_path.rglob("*.tmp"))
  assert len(caplog.records) == 1 and "time_s" in caplog.records[0].getMessage()
  assert db.get(COST_KEY) is None and db.invalid == 0


# --------------------------------------------------------------------------- cache: CLI


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
  """A profile database holding gpt-tiny on one host of two A100 (profiled once)."""
  d = tmp_path_factory.mktemp("warm")
  cluster = d / "cluster.yaml"
  cluster.write_text(CLUSTER_YAML)
  res = _run("plan", "--cluster", cluster, "--model", "gpt-tiny", "-B", 4, "--no-simulate",
             "--no-progress", "--cache-dir", d / "db")
  assert res.exit_code == 0, res.output
  return d / "db", str(cluster)


def _cost_entries(db_dir: Path) -> list[Path]:
  return sorted(p for p in db_dir.rglob("*.json") if "source" in json.loads(p.read_text())["key"])


@pytest.mark.parametrize("edits", [
    {"time_s": float("nan"), "act_mem_bytes": -1.0, "flops": "abc", "truncate": None},
    {"time_s": float("inf"), "value": [1.0], "comm_s": None},
], ids=["nan-negative-type-truncated", "inf-list-null"])
def test_plan_recomputes_invalid_cache_entries(warm_cache, tmp_path, caplog, edits):
  db_dir = tmp_path / "db"
  shutil.copytree(warm_cache[0], db_dir)
  files = _cost_entries(db_dir)
  for path, (field, bad) in zip(files, edits.items()):
    entry = json.loads(path.read_text())
    if field == "truncate":
      path.write_text(path.read_text()[:30])
      continue
    if field == "value":
      entry["value"] = bad
    else:
      entry["value"][field] = bad
    path.write_text(json.dumps(entry))
  args = ("plan", "--cluster", warm_cache[1], "--model", "gpt-tiny", "-B", 4, "--no-simulate",
          "--no-progress", "--cache-dir", db_dir)
  with caplog.at_level(logging.WARNING, logger=cache_lib.__name__):
    res = _run(*args)
  assert res.exit_code == 0, res.output
  warnings = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.WARNING and r.name == cache_lib.__name__]
  n = len(edits)
  assert len(warnings) == 1 and \
      f"{n} cache entries in {db_dir} were invalid and are recomputed" in warnings[0], warnings
  assert f"{n} computed" in res.output
  for path in files[:n]:                                   # overwritten with valid values
    entry = json.loads(path.read_text())
    assert cache_lib.entry_problem(entry["key"], entry["value"]) is None
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger=cache_lib.__name__):
    again = _run(*args)
  assert again.exit_code == 0 and " 0 computed" in again.output, again.output
  assert not [r for r in caplog.records if r.name == cache_lib.__name__]


@pytest.mark.parametrize("args, use_cache, cache_dir", [
    (["--no-cache"], False, None),
    (["--cache-dir", "DIR"], True, "DIR"),
    ([], True, None),
])
def test_no_cache_is_use_cache_false(monkeypatch, cluster_file, tmp_path, args, use_cache,
                                     cache_dir):
  seen = {}

  def profile_step(*a, options=None, **kw):
    seen["options"] = options
    raise HarpjaxError("stopped after the options")
  monkeypatch.setattr(profile_pkg, "profile_step", profile_step)
  args = [str(tmp_path / "db") if a == "DIR" else a for a in args]
  res = _run("plan", "--cluster", cluster_file, "--model", "gpt-tiny", *args)
  _refused(res, "stopped after the options", status=1)
  opts = seen["options"]
  assert opts.use_cache is use_cache
  assert opts.cache_dir == (None if cache_dir is None else str(tmp_path / "db"))


# --------------------------------------------------------------------------- plan arguments


@pytest.mark.parametrize("args, needles", [
    (["--json", "/nonexistent_dir/p.json"], ["--json", "/nonexistent_dir", "does not exist"]),
    (["--json", "TMP"], ["--json", "is a directory"]),
    (["-B", "-3"], ["--microbatches", "-3"]),
    (["-B", "0"], ["--microbatches"]),
    (["--microbatch-size", "0"], ["--microbatch-size"]),
    (["--bandwidth", "nan"], ["--bandwidth", "finite"]),
    (["--bandwidth", "inf"], ["--bandwidth", "finite"]),
    (["--bandwidth", "0"], ["--bandwidth"]),
    (["--bandwidth", "5", "--latency-us", "-1"], ["--latency-us"]),
    (["--latency-us", "20"], ["--latency-us", "--bandwidth"]),
    (["--eps", "-0.1"], ["--eps"]),
    (["--eps", "2"], ["--eps"]),
    (["--z", "0"], ["--z"]),
    (["--target-layers", "-2"], ["--target-layers"]),
    (["--no-cache", "--cache-dir", "TMP"], ["--no-cache", "--cache-dir"]),
    (["--cache-dir", "FILE"], ["--cache-dir"]),
    (["--cache-dir", "FILE/sub"], ["--cache-dir", "not a directory"]),
    (["--model", "gpt-1t"], ["--model", "neither a built-in model"]),
    (["--objective", "cheapest"], ["--objective", "cheapest"]),
    (["--objective", "min_time_within_budget"], ["--budget"]),
    (["--objective", "min_cost_within_time"], ["--time-limit"]),
    (["--objective", "max_throughput_per_dollar", "--budget", "3"], ["--budget", "not use"]),
    (["--time-limit", "3"], ["--time-limit", "not use"]),
    (["--budget", "-3"], ["--budget"]),
    (["--objective", "max_throughput_per_dollar"], ["needs prices", "price_per_gpu_hour"]),
    (["--budget", "120"], ["--budget needs prices", "price_per_gpu_hour"]),
    (["--order", "given"], ["--order", "--use-all-devices"]),
    (["--mixed-stages", "sometimes"], ["--mixed-stages", "sometimes"]),
    (["--mixed-stages", "on", "--use-all-devices"], ["--mixed-stages", "--use-all-devices"]),
    (["--schedule", "zero-bubble"], ["--schedule", "zero-bubble", "rank"]),
])
def test_plan_arguments_are_checked_first(no_long_work, cluster_file, tmp_path, args, needles):
  (tmp_path / "file").write_text("x")
  args = [str(tmp_path) if a == "TMP" else a.replace("FILE", str(tmp_path / "file"))
          for a in args]
  base = ["plan", "--cluster", cluster_file, "--model", "gpt-tiny"]
  if "--model" in args:
    base = base[:3]
  _refused(_run(*base, *args), *needles)


@pytest.mark.parametrize("fields, needles", [
    ({"hidden": "abc"}, ["hidden='abc'", "number"]),
    ({"num_blocks": 2.5}, ["num_blocks=2.5", "integer"]),
    ({"num_blocks": 0}, ["num_blocks=0", "> 0"]),
    ({"dropout": 1.5}, ["dropout=1.5"]),
    ({"dtype": "float33"}, ["dtype='float33'"]),
    ({"fused_qkv": "yes"}, ["fused_qkv"]),
    ({"hidden": 30, "num_heads": 4}, ["hidden=30", "num_heads=4"]),
    ({"layer_marks": 3}, ["layer_marks=3"]),
    ({"hiddne": 32}, ["unknown fields", "hiddne"]),
    ({"microbatch_size": 0}, ["microbatch_size=0"]),
    ({"family": "rnn"}, ["family 'rnn'"]),
])
def test_model_config_fields_are_checked_first(no_long_work, cluster_file, tmp_path, fields,
                                               needles):
  path = tmp_path / "model.json"
  path.write_text(json.dumps({"family": "gpt", "hidden": 32, "num_heads": 4, "num_blocks": 2,
                              "seq_len": 8, "vocab_size": 64, **fields}))
  _refused(_run("plan", "--cluster", cluster_file, "--model", path), "--model", *needles)


def test_model_config_and_option_give_the_microbatch_size_once(no_long_work, cluster_file,
                                                               tmp_path):
  path = tmp_path / "model.yaml"
  path.write_text("hidden: 32\nnum_heads: 4\nmicrobatch_size: 4\n")
  _refused(_run("plan", "--cluster", cluster_file, "--model", path, "--microbatch-size", 8),
           "microbatch_size", "--microbatch-size", "once")


def test_plan_cannot_write_json_is_refused_before_work(no_long_work, cluster_file, tmp_path):
  ro = tmp_path / "ro"
  ro.mkdir()
  ro.chmod(0o500)
  try:
    if os.access(ro, os.W_OK):
      pytest.skip("running with permissions that ignore the mode (root)")
    _refused(_run("plan", "--cluster", cluster_file, "--model", "gpt-tiny", "--json",
                  ro / "p.json"), "--json", "permission denied")
  finally:
    ro.chmod(0o700)


# --------------------------------------------------------------------------- cluster files


@pytest.mark.parametrize("sub, needles", [
    ({"devices_per_host": 100_000_000_000}, ["subclusters[0].devices_per_host", "100000000000",
                                              str(MAX_DEVICES_PER_HOST)]),
    ({"devices_per_host": MAX_DEVICES_PER_HOST + 1}, ["subclusters[0].devices_per_host"]),
    ({"hosts": 100_000_000_000}, ["subclusters[0].hosts", str(MAX_HOSTS)]),
    ({"hosts": 100_000, "devices_per_host": 1024}, ["1048576", "devices in all"]),
])
def test_absurd_cluster_sizes_are_refused_up_front(no_long_work, tmp_path, sub, needles):
  text = json.dumps({"subclusters": [{"name": "a", "gpu": "A100-40G", "hosts": 1,
                                      "devices_per_host": 2, **sub}]})
  path = tmp_path / "cluster.yaml"
  path.write_text(text)
  with pytest.raises(ClusterSpecError) as e:
    Cluster.load(path)
  assert all(n in str(e.value) for n in needles), str(e.value)
  res = _run("plan", "--cluster", path, "--model", "gpt-tiny")
  _refused(res, str(path), *needles, status=1)


def test_absurd_subcluster_sizes_are_refused_in_python_too():
  with pytest.raises(ClusterSpecError, match=r"devices_per_host: 100000000000 .* 1024"):
    SubCluster("a", "A100-40G", 1, 100_000_000_000)
  with pytest.raises(ClusterSpecError, match=r"num_hosts: 200000 .* 100000"):
    SubCluster("a", "A100-40G", 200_000, 1)
  assert SubCluster("a", "A100-40G", MAX_HOSTS, 8).num_devices == 800_000


# --------------------------------------------------------------------------- plan files


def _plan_json() -> dict:
  plan = Plan(stages=(StageSpec((0, 3), "v100", (1, 2), warmup=2, time_s=0.1, comm_s=0.01),
                      StageSpec((4, 9), "a100", (1, 2), warmup=1, time_s=0.12)),
              num_microbatches=8, schedule="h1f1b")
  return plan.to_json()


def _edit(data: dict, path: str, value) -> dict:
  """``data`` with the field at ``path`` (``stages.1.warmup``) set to ``value``."""
  *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
  node = data
  for p in parents:
    node = node[p]
  node[last] = value
  return data


@pytest.mark.parametrize("path, value, field", [
    ("stages.1.warmup", "abc", "stages[1].warmup"),
    ("stages.0.warmup", 0, "stages[0].warmup"),
    ("stages.0.warmup", 1.5, "stages[0].warmup"),
    ("stages.0.layers", [0, "3"], "stages[0].layers[1]"),
    ("stages.0.layers", [0], "stages[0].layers"),
    ("stages.1.submesh", "1x2", "stages[1].submesh"),
    ("stages.0.logical_mesh", [2, "x"], "stages[0].logical_mesh[1]"),
    ("stages.0.devices", [0, -1], "stages[0].devices[1]"),
    ("stages.0.time_s", float("nan"), "stages[0].time_s"),
    ("stages.1.comm_s", -1.0, "stages[1].comm_s"),
    ("stages.0.subcluster", 7, "stages[0].subcluster"),
    ("stages.0.bogus", 1, "bogus"),
    ("num_microbatches", "eight", "num_microbatches"),
    ("num_layers", 0, "num_layers"),
    ("schedule", "zero-bubble", "schedule"),
    ("t_max_s", float("inf"), "t_max_s"),
    ("eta", 2, "eta"),
    ("meta", [1], "meta"),
    ("stages", {}, "stages"),
    ("stages.0", "stage", "stages[0]"),
])
def test_plan_file_fields_are_typed(tmp_path, path, value, field):
  f = tmp_path / "p.json"
  f.write_text(json.dumps(_edit(_plan_json(), path, value)))
  with pytest.raises(PlanError) as e:
    load_plan(f)
  assert str(f) in str(e.value) and field in str(e.value), str(e.value)


@pytest.mark.parametrize("text, needle", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a harpjax plan"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_unreadable_plan_files_name_the_file(tmp_path, text, needle):
  f = tmp_path / "p.json"
  f.write_bytes(text if isinstance(text, bytes) else text.encode())
  with pytest.raises(PlanError, match=needle) as e:
    load_plan(f)
  assert str(f) in str(e.value)


def test_plan_file_round_trip_still_loads(tmp_path):
  f = tmp_path / "p.json"
  f.write_text(json.dumps(_plan_json()))
  plan = load_plan(f)
  assert plan.warmups == (2, 1) and plan.stages[0].time_s == 0.1
  with pytest.raises(PlanError, match=r"warmup='abc' must be an integer"):
    StageSpec((0, 3), "v100", (1, 2), warmup="abc")


@pytest.mark.parametrize("path, value, field", [
    ("stages.1.warmup", "abc", "stages[1].warmup"),
    ("stages.0.time_s", -0.1, "stages[0].time_s"),
    ("num_microbatches", 2.5, "num_microbatches"),
])
def test_simulate_names_the_plan_file_and_field(no_long_work, tmp_path, path, value, field):
  f = tmp_path / "p.json"
  f.write_text(json.dumps(_edit(_plan_json(), path, value)))
  _refused(_run("simulate", f), str(f), field, status=1)


# --------------------------------------------------------------------------- simulate arguments


@pytest.mark.parametrize("args, needles", [
    (["--time", "1,1,1", "-B", "-3"], ["--microbatches", "-3"]),
    (["--time", "1,1,1", "-B", "0"], ["--microbatches"]),
    (["--time", "1,1,1", "-B", "1000000000000"], ["--microbatches"]),
    (["--time", "1,-1", "-B", "4"], ["--time", "'-1'"]),
    (["--time", "nan", "-B", "4"], ["--time"]),
    (["--fwd", "0,1", "--bwd", "1", "-B", "4"], ["--fwd", "> 0"]),
    (["--time", "1,1", "--comm", "-2ms", "-B", "4"], ["--comm"]),
    (["--time", "1,1", "--end-cost", "inf", "-B", "4"], ["--end-cost"]),
    (["--time", "1,1", "--act-bytes", "-5", "-B", "4"], ["--act-bytes"]),
    (["--time", "1,1", "-B", "4", "--bwd-ratio", "0"], ["--bwd-ratio"]),
    (["--time", "1,1", "-B", "4", "--bwd-ratio", "nan"], ["--bwd-ratio"]),
    (["--time", "1,1", "-B", "4", "--eps", "-1"], ["--eps"]),
    (["--time", "1,1", "-B", "4", "--warmups", "0,1"], ["--warmups"]),
    (["--time", "1,1", "-B", "4", "--warmups", "2.5,1"], ["--warmups"]),
    (["--time", "1,1", "-B", "4", "--warmups", "3,2,1"], ["--warmups", "expected 1 or 2"]),
    (["--time", "1", "--comm", "0.5", "-B", "4"], ["--comm", "1-stage pipeline has no links"]),
    (["--time", "1", "--comm-bwd", "0.5", "-B", "4"], ["--comm-bwd", "1-stage"]),
    (["--time", "1,1", "--fwd", "1,1", "-B", "4"], ["--time", "--fwd"]),
    (["--time", "1,1", "--bwd", "2", "-B", "4"], ["--time", "--bwd"]),
    (["--fwd", "1,1", "--bwd", "2,2", "--bwd-ratio", "3", "-B", "4"], ["--bwd-ratio"]),
    (["--time", "1,1", "-B", "4", "--schedule", "1f1b", "--warmups", "2,1"],
     ["--warmups", "h1f1b"]),
    (["--time", "1,1", "-B", "4", "--schedule", "gpipe", "--eps", "0.2"], ["--eps", "h1f1b"]),
    (["--time", "1,1", "-B", "4", "--warmups", "2,1", "--eps", "0.2"], ["--eps", "--warmups"]),
    (["--time", "1,1", "-B", "4", "--no-png"], ["--no-png", "--out"]),
    (["--time", "1,1", "-B", "4", "--out", "FILE"], ["--out"]),
    (["--time", "1,1", "-B", "4", "--out", "FILE/sub"], ["--out", "not a directory"]),
    (["--time", "1,1", "-B", "4", "--schedule", "zero-bubble"], ["zero-bubble"]),
    (["--time", "1,1", "--table", "TABLE", "-B", "3"], ["-B 3", "--table"]),
    (["--time", "1,1,1", "--table", "TABLE"], ["--table", "2 stages", "times give 3"]),
    (["--fwd", "1,1", "-B", "4"], ["--fwd and --bwd"]),
    (["--time", "1,1"], ["-B"]),
    (["missing.json"], ["missing.json"]),
])
def test_simulate_arguments_are_checked_first(no_long_work, tmp_path, args, needles):
  (tmp_path / "file").write_text("x")
  (tmp_path / "t.txt").write_text("stage 0: F0 F1 B0 B1\nstage 1: F0 B0 F1 B1\n")
  args = [a.replace("FILE", str(tmp_path / "file")).replace("TABLE", str(tmp_path / "t.txt"))
          for a in args]
  _refused(_run("simulate", *args), *needles)


def test_simulate_still_runs(tmp_path):
  res = _run("simulate", "--time", "1,1", "--comm", "0.1", "-B", "4", "--eps", "0",
             "--schedule", "h1f1b,1f1b", "--json")
  assert res.exit_code == 0, res.output
  assert [r["schedule"] for r in json.loads(res.stdout)] == ["h1f1b", "1f1b"]


def test_simulate_takes_the_tolerance_the_plan_records(tmp_path):
  # A plan's eps is the one its warm-up counts derive with: --eps may not say otherwise.
  plan = Plan(stages=(StageSpec((0, 0), "a", (1, 1), time_s=1.0, comm_s=0.2),
                      StageSpec((1, 1), "b", (1, 1), time_s=1.0)), eps=0.5)
  path = tmp_path / "plan.json"
  plan.save(path)
  common = ("simulate", str(path), "-B", "4", "--schedule", "h1f1b", "--json")
  _refused(_run(*common, "--eps", "0.1"), "--eps 0.1", "eps=0.5")
  ours, low = _run(*common), _run("simulate", "--time", "1,1", "--comm", "0.2", "-B", "4",
                                  "--eps", "0.1", "--schedule", "h1f1b", "--json")
  assert ours.exit_code == 0 and low.exit_code == 0, (ours.output, low.output)
  # 2c/t_max = 0.4: no extra warm-up under the plan's eps=0.5, one under 0.1
  warm = lambda res: json.loads(res.stdout)[0]["warmups"]
  assert warm(ours) != warm(low), (warm(ours), warm(low))


# --------------------------------------------------------------------------- Ctrl-C


def test_keyboard_interrupt_in_a_command_exits_130(monkeypatch, cluster_file):
  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(profile_pkg, "profile_step", interrupted)
  res = _run("plan", "--cluster", cluster_file, "--model", "gpt-tiny")
  assert res.exit_code == INTERRUPTED and isinstance(res.exception, SystemExit), res.output
  assert res.stderr.count(INTERRUPT_MESSAGE) == 1 and "Aborted" not in res.output
  monkeypatch.setattr(schedule_pkg, "simulate", interrupted)
  res = _run("simulate", "--time", "1,1", "-B", "4")
  assert res.exit_code == INTERRUPTED and res.stderr.count(INTERRUPT_MESSAGE) == 1


# The child runs ``python -m harpjax plan`` (harpjax.cli.run) with the planner replaced by one
# that never finishes on its own, in the place ``mode`` names; it prints a line when there.
CHILD = r"""
import os, signal, sys, time
# A user's terminal delivers Ctrl-C: undo an ignored SIGINT inherited from a background launch.
signal.signal(signal.SIGINT, signal.default_int_handler)
import numpy as np
import harpjax.compiler.plan as plan_pkg
import harpjax.compiler.profile as profile_pkg
from harpjax.cli import run

mode = sys.argv[1]
solve_mod = sys.modules["harpjax.compiler.plan.solve"]
real_solve = plan_pkg.solve

def say(line):
  # One write per line: the forked workers' lines must not interleave.
  os.write(2, (line + "\n").encode())

def forever():
  while True:
    time.sleep(0.05)

def blocked_batch(index, batch, *args):
  say(f"worker {os.getpid()} busy")
  forever()

def stuck_solve(tables, num_microbatches, options=None, **kw):
  if mode == "python":
    say("stuck in python")
    forever()
  if mode == "swallow":
    say("stuck swallowing")
    while True:
      try:
        forever()
      except KeyboardInterrupt:
        say("swallowed")
  if mode == "gc":   # Ctrl-C inside a garbage-collection callback (JAX has one): dropped
    import gc
    def callback(phase, info):
      if phase == "start":
        gc.callbacks.remove(callback)
        say("stuck in a gc callback")
        time.sleep(600)
    gc.callbacks.append(callback)
    gc.collect()
    forever()
  if mode == "swallow_once":   # dropped (as CPython drops it in a GC callback), then done
    say("stuck swallowing once")
    try:
      forever()
    except KeyboardInterrupt:
      say("swallowed")
    return real_solve(tables, num_microbatches, options=options, **kw)
  if mode == "numba":
    import numba
    @numba.njit(nogil=True)
    def spin(n):
      x = np.uint64(1)
      for _ in range(n):
        x = x * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)
      return x
    spin(10)
    say("stuck in numba")
    spin(2**62)
  if mode in ("process", "thread"):
    solve_mod.evaluate_candidates = blocked_batch
    index = plan_pkg.SparseIndex.build(tables)
    say(f"stuck in {mode} workers")
    solve_mod._run_parallel(index, [[0], [1]], (num_microbatches,), mode, 2, 3600.0, "fork")
  raise AssertionError("the planner returned")

def stuck_profile(*args, **kwargs):
  import jax, jax.numpy as jnp
  say("stuck compiling")
  n = 8
  while True:
    n += 1
    jax.jit(lambda x: jnp.tanh(x @ x.T).sum()).lower(
        jax.ShapeDtypeStruct((n, 64), jnp.float32)).compile()

plan_pkg.solve = stuck_solve
if mode == "compile":
  profile_pkg.profile_step = stuck_profile
run(sys.argv[2:])
"""


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/status") as f:
      return "\nState:\tZ" not in f.read()
  except FileNotFoundError:
    return False
  except OSError:
    return True


def _read_lines(stream, lines: queue.Queue) -> None:
  """Puts each line of ``stream`` (bytes) on ``lines``, then ``None``."""
  try:
    for raw in stream:
      lines.put(raw.decode("utf-8", "replace"))
  finally:
    lines.put(None)


def _worker_pids(seen: list[str]) -> list[int]:
  return [int(pid) for pid in re.findall(r"worker (\d+) busy", "".join(seen))]


@pytest.mark.parametrize("mode", ["python", "swallow", "gc", "numba", "compile"] + [
    pytest.param(m, marks=pytest.mark.slow) for m in ("swallow_once", "process", "thread")])
def test_ctrl_c_during_plan_exits_130(warm_cache, mode):
  db_dir, cluster = warm_cache
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path))
  proc = subprocess.Popen(
      [sys.executable, "-c", CHILD, mode, "plan", "--cluster", cluster, "--model", "gpt-tiny",
       "-B", "4", "--cache-dir", str(db_dir), "--no-progress"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=str(ROOT))
  lines: queue.Queue = queue.Queue()
  reader = threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True)
  reader.start()
  seen: list[str] = []
  workers = 2 if mode == "process" else 0
  try:
    # Wait for the child to be stuck where ``mode`` says (generous: a hung child only).
    deadline = time.monotonic() + 300
    while not (any(l.startswith("stuck") for l in seen) and
               len(_worker_pids(seen)) >= workers):
      try:
        line = lines.get(timeout=max(1.0, deadline - time.monotonic()))
      except queue.Empty:
        line = None
      assert line is not None, f"child exited or hung before the planner started:\n" \
          f"{''.join(seen)}"
      seen.append(line)
    proc.send_signal(signal.SIGINT)
    status = proc.wait(timeout=300)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
      for pid in _worker_pids(seen):      # a hung child's workers too
        if _alive(pid):
          os.kill(pid, signal.SIGKILL)
  reader.join(timeout=60)
  while not lines.empty():
    line = lines.get()
    if line is not None:
      seen.append(line)
  err = "".join(seen)
  assert status == INTERRUPTED, err
  assert [l.strip() for l in seen].count(INTERRUPT_MESSAGE) == 1, err
  assert "Traceback" not in err and "Aborted" not in err, err
  pids = _worker_pids(seen) if mode == "process" else []
  deadline = time.monotonic() + 120
  while any(_alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not [p for p in pids if _alive(p)], "planner workers outlived the interrupted command"


def test_plan_with_zero_reads_the_cache_and_passes_the_optimizer_state(warm_cache):
  # --zero: the same cached costs, the tables carry the optimizer state (12 of 16 bytes per
  # parameter) for the planner; the plan still prints.
  args = ("plan", "--cluster", warm_cache[1], "--model", "gpt-tiny", "-B", 4, "--no-simulate",
          "--no-progress", "--cache-dir", warm_cache[0])
  res = _run(*args, "--zero")
  assert res.exit_code == 0 and " 0 computed" in res.output, res.output
  assert "Layer Range" in res.output


def test_plan_offload_activations_needs_the_host_link(warm_cache, tmp_path, monkeypatch):
  # --offload-activations lets the planner keep residuals in host memory: refused on a
  # cluster without host_memory_gbps (before any work), passed to the planner where it has
  # one, off with --no-offload-activations, and by default the planner's choice (as
  # auto_parallel's) wherever the cluster gives the host link.
  args = ("plan", "--model", "gpt-tiny", "-B", 4, "--no-simulate", "--no-progress",
          "--cache-dir", warm_cache[0])
  res = _run(*args, "--cluster", warm_cache[1], "--offload-activations")
  assert res.exit_code == 2 and "host_memory_gbps" in res.output, res.output
  host = tmp_path / "host.yaml"
  host.write_text(CLUSTER_YAML.replace("devices_per_host: 2}",
                                       "devices_per_host: 2, host_memory_gbps: 100}"))
  seen = []
  real = plan_pkg.solve
  monkeypatch.setattr(plan_pkg, "solve", lambda t, b, options: seen.append(
      (options.offload_activations, t.offload_bandwidth_bytes_per_s)) or real(t, b,
                                                                     options=options))
  for flag in ("--offload-activations", "--no-offload-activations", None):
    res = _run(*args, "--cluster", host, *([flag] if flag else []))
    assert res.exit_code == 0 and "Layer Range" in res.output, res.output
  assert seen == [(True, (12.5e9,)), (False, (12.5e9,)), (True, (12.5e9,))], seen


ASYMMETRIC_YAML = cluster_yaml("asym", (("a100", "A100-40G", 3, 2), ("v100", "V100-16G", 5, 1),
                                        ("t4", "T4", 3, 1)))


@pytest.mark.slow
def test_plan_with_mixed_stages(tmp_path):
  """6 A100 + 5 V100 + 3 T4: the plan has stages on two GPU types, scored and saved."""
  path = tmp_path / "asym.yaml"
  path.write_text(ASYMMETRIC_YAML)
  out = tmp_path / "plan.json"
  res = _run("plan", "--cluster", path, "--model", "gpt-tiny", "-B", "8",
             "--microbatch-size", "16", "--mixed-stages", "on", "--no-cache", "--json", out)
  assert res.exit_code == 0, res.output
  plan = plan_pkg.load_plan(out)
  assert f"mixed-type stages: {plan.schedule}" in res.output
  mixed = [s for s in plan.stages if s.groups]
  assert mixed and all(sum(s.group_rows(16)) == 16 for s in mixed)
  assert all(len({g.subcluster for g in s.all_groups}) > 1 for s in mixed)
  assert dict(plan.meta)["mixed_stages"] == "on"


# A GPU with little memory and 3x the T4's FLOP/s beside a T4: a two-block Mixtral-tiny's
# experts (786 KiB of state per block) do not fit the small GPU beside the rest; its attention
# sides do.
ZEBRA_YAML = """\
gpus:
  - {name: fastsmall, tflops: 200, memory_gb: 0.0015, mem_bandwidth_gbs: 3000}
subclusters:
  - {name: new, gpu: fastsmall, hosts: 1, devices_per_host: 1}
  - {name: old, gpu: T4, hosts: 1, devices_per_host: 1}
links:
  - {between: [new, old], gbps: 100}
"""
MIXTRAL_2_BLOCKS = dict(family="mixtral", vocab_size=256, seq_len=16, hidden=32, num_heads=4,
                        num_kv_heads=2, num_blocks=2, ffn_hidden=64, dtype="float32",
                        param_dtype="float32", microbatch_size=2)


@pytest.mark.slow
def test_plan_chooses_a_zebra_stage_from_profiled_tables(tmp_path):
  """The profiler's routed split lets ``harpjax plan`` put a Mixtral's attention on the
  small fast GPU and its experts on the T4: a zebra stage, faster than the best plan without
  one (everything but the first block's attention on the T4)."""
  cluster, model = tmp_path / "zebra.yaml", tmp_path / "mixtral2.yaml"
  cluster.write_text(ZEBRA_YAML)
  model.write_text(json.dumps(MIXTRAL_2_BLOCKS))
  out = tmp_path / "plan.json"
  res = _run("plan", "--cluster", cluster, "--model", model, "-B", 4, "--no-cache",
             "--no-simulate", "--json", out)
  assert res.exit_code == 0, res.output
  assert "zebra stages (attention|experts on two groups): [1]" in res.output, res.output
  plan = load_plan(out)
  (stage,) = plan.stages
  assert stage.subcluster == "new" and stage.zebra.subcluster == "old"
  # the same profile planned without zebra stages
  from harpjax.cli.model import model_spec, profile_options, solve_options
  spec = model_spec(str(model), 4, None)
  c = Cluster.load(str(cluster))
  tables = profile_pkg.with_fees(profile_pkg.profile_step(
      spec.step_fn, spec.args, c, num_microbatches=4,
      options=profile_options(no_cache=True)).tables, c)
  plain = plan_pkg.solve(tables, 4, options=solve_options(microbatch_rows=2, zebra="off"))
  assert not any(s.zebra for s in plain.plan.stages)
  assert plan.predicted_iteration_s < 0.75 * plain.plan.predicted_iteration_s


# Imported at start-up (sitecustomize): Ctrl-C the moment `python -m harpjax` starts to import
# JAX, i.e. while the package itself is being imported, before the command runs.
_CTRL_C_WHILE_IMPORTING = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)

class CtrlC:
  def find_spec(self, name, path=None, target=None):
    if name == "jax":
      sys.meta_path.remove(self)
      os.kill(os.getpid(), signal.SIGINT)
    return None

sys.meta_path.insert(0, CtrlC())
"""


def test_ctrl_c_while_the_command_imports_its_packages_exits_130(tmp_path):
  (tmp_path / "sitecustomize.py").write_text(_CTRL_C_WHILE_IMPORTING)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)] + sys.path))
  res = subprocess.run([sys.executable, "-m", "harpjax", "plan", "--help"], env=env,
                       cwd=str(ROOT), capture_output=True, text=True, timeout=300)
  assert res.returncode == INTERRUPTED, res.stderr[-2000:]
  assert res.stderr.strip() == INTERRUPT_MESSAGE and not res.stdout, res.stderr[-2000:]


# Ctrl-C after the command is done, while the process exits: from an exit hook, and from a
# finalizer that runs as the interpreter clears its modules (after Python's own signal
# handling has ended, where SIGINT used to kill the process: status -2, nothing printed).
_CTRL_C_WHILE_EXITING = r"""
import atexit, os, signal, sys, time
from harpjax.cli import run

def ctrl_c():
  os.kill(os.getpid(), signal.SIGINT)
  time.sleep(0.2)

class Late:
  def __del__(self, kill=os.kill, pid=os.getpid(), sig=signal.SIGINT, sleep=time.sleep):
    kill(pid, sig)   # (the module's globals are gone by then)
    sleep(0.2)

late = Late()
atexit.register(ctrl_c)
run(sys.argv[1:])
"""


def test_ctrl_c_while_the_process_exits_keeps_the_commands_status():
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path))
  res = subprocess.run([sys.executable, "-c", _CTRL_C_WHILE_EXITING, "plan", "--help"], env=env,
                       cwd=str(ROOT), capture_output=True, text=True, timeout=300)
  assert res.returncode == 0 and "--cluster" in res.stdout, (res.returncode, res.stderr)
  assert not res.stderr.strip(), res.stderr[-2000:]


# --------------------------------------------------------------------------- one set of defaults


def test_plan_and_auto_parallel_plan_with_one_set_of_defaults(monkeypatch, cluster_file):
  """``harpjax plan`` without options plans as ``auto_parallel`` does without options: the
  same remat, ZeRO, offload and mixed-stage choices (docs/planner.md, "One set of
  defaults")."""
  from harpjax import AutoPlan
  seen = {}
  real_profile = profile_pkg.profile_step

  def profile_step(*a, options=None, **kw):
    seen["profile"] = options
    return real_profile(*a, options=dataclasses.replace(options, use_cache=False), **kw)

  def solve(tables, b, options):
    seen["solve"] = options
    raise HarpjaxError("stopped after the options")
  monkeypatch.setattr(profile_pkg, "profile_step", profile_step)
  monkeypatch.setattr(plan_pkg, "solve", solve)
  _refused(_run("plan", "--cluster", cluster_file, "--model", "gpt-tiny", "-B", 4),
           "stopped after the options", status=1)
  auto = AutoPlan()   # what auto_parallel plans with when given nothing
  api_profile, api_solve = auto.profile, auto.solve
  for field in ("source", "remat", "state_bytes_per_param", "optimizer_bytes_per_param"):
    assert getattr(seen["profile"], field) == getattr(api_profile, field), field
  for field in ("eps", "cost_model", "objective", "use_all_devices", "keep_order",
                "zero_levels", "offload", "offload_activations", "mixed_stages", "schedule"):
    assert getattr(seen["solve"], field) == getattr(api_solve, field), field
  assert not api_profile.remat and api_profile.optimizer_bytes_per_param == 12.0
  assert api_solve.mixed_stages == "auto" and api_solve.offload_activations


def test_plan_shows_the_chosen_schedule_and_pins_one(warm_cache, tmp_path):
  """The plan's schedule is named, with the reason; the table scores every registered schedule
  on the plan's stages and marks the plan's, which is the fastest ranked one that fits;
  --schedule pins one (and the saved plan runs it)."""
  out = tmp_path / "plan.json"
  common = ("plan", "--cluster", warm_cache[1], "--model", "gpt-tiny", "-B", 8, "--no-progress",
            "--cache-dir", warm_cache[0], "--json", out)
  res = _run(*common)
  assert res.exit_code == 0, res.output
  plan = plan_pkg.load_plan(out)
  assert f"schedule: {plan.schedule} (" in res.output and "the fastest that fits" in res.output
  rows = {m.group(2): (m.group(1) == "*", float(m.group(3)), m.group(4) == "yes", m.group(5))
          for m in re.finditer(r"^([* ]) (\S+)\s+\S+\s+([0-9.]+)\s+(yes|NO)\s+(yes|-)$",
                               res.output, re.M)}
  assert set(rows) == {"gpipe", "1f1b", "eager_1f1b", "h1f1b"}, res.output
  assert [n for n, r in rows.items() if r[0]] == [plan.schedule]
  ranked = {n: r[1] for n, r in rows.items() if r[2] and r[3] == "yes"}
  assert rows[plan.schedule][1] == min(ranked.values())
  res = _run(*common, "--schedule", "PipeDream-Flush")
  assert res.exit_code == 0, res.output
  assert plan_pkg.load_plan(out).schedule == "1f1b"
  assert "schedule: 1f1b (1F1B; --schedule)" in res.output


def test_plan_times_tracing_and_costing_apart(warm_cache):
  res = _run("plan", "--cluster", warm_cache[1], "--model", "gpt-tiny", "-B", 4,
             "--no-simulate", "--no-progress", "--cache-dir", warm_cache[0])
  assert res.exit_code == 0, res.output
  got = re.search(r"tracing ([0-9.]+) s, costing ([0-9.]+) s, search ([0-9.]+) s", res.output)
  assert got, res.output


def test_imported_source_errors_are_one_line(tmp_path, cluster_file):
  empty = tmp_path / "nodata"
  empty.mkdir()
  res = _run("plan", "--cluster", cluster_file, "--model", "gpt-tiny", "-B", 4, "--no-cache",
             "--source", "imported", "--data-dir", empty)
  _refused(res, "no published measurements at", status=1)
  from harpjax.compiler.profile import calibration
  if not (calibration.default_zorse_dir() / "zorse_model_stats.json").exists():
    pytest.skip("published measurements not found beside the repo")
  res = _run("plan", "--cluster", cluster_file, "--model", "gpt-tiny", "-B", 4, "--no-cache",
             "--source", "imported")
  _refused(res, "no published measurements of a block of hidden 32", status=1)


# --------------------------------------------------------------------------- costing a plan file


def test_simulate_costs_a_hand_written_plan(warm_cache, tmp_path):
  """``simulate plan.json --cluster --model``: each stage on its own submesh and logical mesh
  (not the tables' fastest), what evaluate_plan says of the profile's tables for that plan."""
  db, cluster = warm_cache
  mine = Plan(stages=(StageSpec((0, 6), "a100", (1, 1)),
                      StageSpec((7, 13), "a100", (1, 1))), num_microbatches=4)
  path = tmp_path / "hand.json"
  mine.save(path)
  base = ("simulate", path, "--cluster", cluster, "--model", "gpt-tiny", "--cache-dir", db)
  res = _run(*base, "--json")
  assert res.exit_code == 0, res.output
  got = json.loads(res.stdout)[0]
  prof = profile_pkg.profile_step(
      *_tiny_step(), Cluster.load(cluster), num_microbatches=4,
      options=profile_pkg.ProfileOptions(cache_dir=str(db), progress=False))
  ev = plan_pkg.evaluate_plan(profile_pkg.tables_for_plan(prof, mine), mine, 4)
  assert got["iteration_time_s"] == pytest.approx(ev.iteration_s, rel=1e-9)
  assert got["warmups"] == list(ev.warmups)
  # one stage on both devices, as (2, 1) and as (1, 2): each costed on its own mesh
  times = {}
  for mesh in ((2, 1), (1, 2)):
    one = Plan(stages=(StageSpec((0, 13), "a100", (1, 2), mesh),), num_microbatches=4)
    one.save(path)
    res = _run(*base, "--json")
    assert res.exit_code == 0, res.output
    times[mesh] = json.loads(res.stdout)[0]["iteration_time_s"]
    ev = plan_pkg.evaluate_plan(profile_pkg.tables_for_plan(prof, one), one, 4)
    assert times[mesh] == pytest.approx(ev.iteration_s, rel=1e-9)
  assert times[(2, 1)] != times[(1, 2)]
  # the profile's own tables hold one mesh per entry: the other one is refused, not rescored
  wrong = [m for m in times if m != prof.tables.logical_mesh_of(0, 0, 13, 1)][0]
  with pytest.raises(PlanError, match="logical mesh"):
    plan_pkg.evaluate_plan(prof.tables, Plan(stages=(StageSpec((0, 13), "a100", (1, 2),
                                                               wrong),)), 4)


def test_simulate_costing_arguments_are_checked(tmp_path, warm_cache):
  db, cluster = warm_cache
  path = tmp_path / "hand.json"
  Plan(stages=(StageSpec((0, 13), "a100", (1, 2)),), num_microbatches=4).save(path)
  res = _run("simulate", path, "--cluster", cluster)
  _refused(res, "--cluster and --model together")
  res = _run("simulate", path, "--cluster", cluster, "--model", "gpt-tiny", "--time", "1,1")
  _refused(res, "--time would replace")
  res = _run("simulate", path, "--source", "analytic")
  _refused(res, "only apply with --cluster and --model")
  Plan(stages=(StageSpec((0, 5), "a100", (1, 2)),), num_microbatches=4).save(path)
  res = _run("simulate", path, "--cluster", cluster, "--model", "gpt-tiny", "--cache-dir", db)
  _refused(res, "has 14 layers")


def _tiny_step():
  from harpjax.models import BUILTIN_MODELS
  spec = BUILTIN_MODELS["gpt-tiny"](num_microbatches=4)
  return spec.step_fn, spec.args


def test_builtin_gpt_15b_is_alpa_and_harps_size():
  from harpjax.models import BUILTIN_MODELS
  spec = BUILTIN_MODELS["gpt-15b"](num_microbatches=2)
  cfg = spec.config
  assert (cfg.num_blocks, cfg.hidden) == (48, 5120)
  import jax
  n = sum(x.size for x in jax.tree_util.tree_leaves(spec.args[0].params))
  assert 15.0e9 < n < 15.8e9


def test_ctrl_c_inside_a_c_callback_is_an_interrupt():
  """Ctrl-C handled inside a C callback (NumPy's dtype hooks, a Numba dispatcher) surfaces as a
  ``SystemError`` chained to the ``KeyboardInterrupt``: the command still exits with 130."""
  import click
  from click.testing import CliRunner
  from harpjax import cli as cli_lib

  @click.group(cls=cli_lib._Group)
  def group():
    pass

  @group.command()
  def work():
    try:
      raise KeyboardInterrupt
    except KeyboardInterrupt as e:
      raise SystemError("<function f> returned a result with an exception set") from e

  @group.command()
  def broken():
    raise SystemError("something else")

  runner = CliRunner()
  assert runner.invoke(group, ["work"]).exit_code == cli_lib.INTERRUPTED
  out = runner.invoke(group, ["broken"])
  assert out.exit_code == 1 and isinstance(out.exception, SystemError)


def test_objective_choices_are_the_planners_objectives():
  # The command line's --objective lists exactly the planner's registered objectives.
  from harpjax.cli.plan import command as plan_command
  from harpjax.compiler.plan import OBJECTIVES
  (opt,) = [p for p in plan_command.params if p.name == "objective"]
  assert tuple(opt.type.choices) == OBJECTIVES


def test_plan_reports_transfer_fees_between_zones(warm_cache, tmp_path):
  """Two one-GPU subclusters in two regions, every device used: the plan's cut crosses
  regions and the report gives its bytes, its fee, and the rate and cost with it."""
  cluster = tmp_path / "zones.yaml"
  cluster.write_text("""\
subclusters:
  - {name: a, gpu: A100-40G, hosts: 1, devices_per_host: 1, zone: za, region: ra,
     price_per_gpu_hour: 2.0, nics: [{name: eth0, kind: ethernet, gbps: 10, network: wan}]}
  - {name: b, gpu: A100-40G, hosts: 1, devices_per_host: 1, zone: zb, region: rb,
     price_per_gpu_hour: 2.0, nics: [{name: eth0, kind: ethernet, gbps: 10, network: wan}]}
transfer_fee_per_gb: {other_region: 1000.0}
""")
  res = _run("plan", "--cluster", cluster, "--model", "gpt-tiny", "-B", 4, "--no-simulate",
             "--no-progress", "--cache-dir", warm_cache[0], "--use-all-devices")
  assert res.exit_code == 0, res.output
  got = re.search(r"transfer fees: ([0-9.e+-]+) GB between zones, ([0-9.e+-]+) GB between "
                  r"regions per iteration: ([0-9.]+) per iteration; with fees ([0-9.]+) per "
                  r"hour, ([0-9.]+) per iteration", res.output)
  assert got, res.output
  region_gb, fee = float(got.group(2)), float(got.group(3))
  assert float(got.group(1)) == 0.0 and region_gb > 0
  assert fee == pytest.approx(region_gb * 1000.0, rel=1e-3, abs=1e-4)
  assert float(got.group(4)) > 4.0
