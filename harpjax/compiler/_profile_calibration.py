"""The analytic time model and its per-GPU-type efficiency factors.

A layer's forward+backward on one device of a GPU type takes (roofline with launch overhead)::

    t = overhead_s + max(flops / (peak_flops * compute), bytes / (mem_bandwidth * memory))

with ``flops`` and ``bytes`` from XLA's cost analysis of the layer's compiled forward+backward
(per device). ``compute``, ``memory`` and ``overhead_s`` are fitted per GPU type to published
per-layer measurements: the Zorse repository's ``zorse_model_latencies.json`` (MIT licence;
one transformer layer, forward and backward milliseconds by microbatch size), using the fp16
entries of its DeepSpeed GPT and LLaMA models (shapes from ``zorse_model_stats.json``), whose
blocks are rebuilt here (:mod:`harpjax.models.gpt`, :mod:`harpjax.models.llama`) and costed
through the same layer construction and XLA analysis the profiler uses.
:func:`calibrate` recomputes the fit; :data:`CALIBRATION` holds its result.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["Efficiency", "CALIBRATION", "DEFAULT_EFFICIENCY", "COST_MODEL_VERSION",
           "efficiency_for", "predict_layer_time_s", "ZORSE_GPU_KEYS", "ZORSE_MODELS",
           "default_zorse_dir", "load_zorse", "calibration_samples", "fit", "calibrate",
           "CalibrationReport"]

COST_MODEL_VERSION = "1"
"""Bumped when the time model or its inputs change (invalidates cached analytic costs)."""


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Fitted factors of one GPU type.

  Attributes:
    compute: achieved fraction of peak FLOP/s.
    memory: achieved fraction of memory bandwidth, against XLA's ``bytes accessed``.
    overhead_s: fixed seconds per layer (kernel launches, framework).
    mape: mean absolute percentage error on the calibration data (``None``: not fitted).
    cv_mape: leave-one-model-out error (``None``: fewer than two models).
    samples: number of measurements fitted.
    source: provenance.
  """
  compute: float
  memory: float
  overhead_s: float
  mape: float | None = None
  cv_mape: float | None = None
  samples: int = 0
  source: str = ""


# Fitted by ``calibrate()`` (``python benchmarks/profile.py --calibrate`` prints this table)
# on the fp16 entries of zorse_model_latencies.json (public Zorse repository, MIT licence),
# microbatch sizes 1-8, with harpjax 0.1.0 / jax 0.10.2 XLA:CPU statistics of the rebuilt
# blocks. V100-32G uses the v100x16 measurements (same SXM2 V100 chip and 900 GB/s HBM2):
# the v100x32 fp16 entries are in the old [fwd, bwd] format, which does not say the
# microbatch size. ``memory > 1`` means XLA:CPU's "bytes accessed" (less fusion) overstates
# a GPU's traffic; these layers are compute-bound and the memory term rarely binds.
# ``overhead_s`` is per fine layer (the rebuilt blocks are cut into 3 layers, like GPT
# blocks): DeepSpeed's per-layer fixed cost (the measurements' intercepts) spread over them.
CALIBRATION: dict[str, Efficiency] = {
    'A100-40G': Efficiency(
        compute=0.5721, memory=3.2292, overhead_s=1.3e-03, mape=0.0738, cv_mape=0.1022,
        samples=128, source=(
            'zorse a100x40 fp16, 128 measurements of deepspeedllama_13b, '
            'deepspeedllama_33b, deepspeedllama_3b, deepspeedllama_7b, '
            'deepspeedllama_tiny')),
    'A100-80G': Efficiency(
        compute=0.6332, memory=2.4887, overhead_s=2.0e-03, mape=0.0431, cv_mape=0.0481,
        samples=80, source=(
            'zorse a100x80 fp16, 80 measurements of deepspeedllama_13b, '
            'deepspeedllama_33b, deepspeedllama_7b, deepspeedllama_tiny')),
    'V100-16G': Efficiency(
        compute=0.5721, memory=1.6122, overhead_s=2.5e-03, mape=0.0531, cv_mape=0.0544,
        samples=55, source=(
            'zorse v100x16 fp16, 55 measurements of deepspeedgpt_2.7b, '
            'deepspeedgpt_6.7b, deepspeedllama_13b, deepspeedllama_33b, '
            'deepspeedllama_7b')),
    'V100-32G': Efficiency(
        compute=0.5721, memory=1.6122, overhead_s=2.5e-03, mape=0.0531, cv_mape=0.0544,
        samples=55, source=(
            'zorse v100x16 fp16, 55 measurements of deepspeedgpt_2.7b, '
            'deepspeedgpt_6.7b, deepspeedllama_13b, deepspeedllama_33b, '
            'deepspeedllama_7b')),
    'A10G': Efficiency(
        compute=0.7009, memory=2.4887, overhead_s=2.5e-03, mape=0.0641, cv_mape=0.099,
        samples=102, source=(
            'zorse a10g fp16, 102 measurements of deepspeedllama_13b, '
            'deepspeedllama_33b, deepspeedllama_3b, deepspeedllama_7b, '
            'deepspeedllama_tiny')),
    'T4': Efficiency(
        compute=0.3443, memory=0.6766, overhead_s=6.3e-04, mape=0.1394, cv_mape=0.1924,
        samples=83, source=(
            'zorse t4 fp16, 83 measurements of deepspeedgpt_2.7b, deepspeedgpt_6.7b, '
            'deepspeedllama_13b, deepspeedllama_33b, deepspeedllama_3b, '
            'deepspeedllama_7b, deepspeedllama_tiny')),
}

DEFAULT_EFFICIENCY = Efficiency(compute=0.45, memory=0.6, overhead_s=3e-5,
                                source="default for GPU types without published data")


def efficiency_for(gpu_name: str, table: dict | None = None) -> Efficiency:
  """The efficiency factors of a GPU type (the default when it was not calibrated)."""
  table = CALIBRATION if table is None else table
  eff = table.get(gpu_name)
  if eff is None:
    if table:
      vals = list(table.values())
      eff = Efficiency(float(np.median([e.compute for e in vals])),
                       float(np.median([e.memory for e in vals])),
                       float(np.median([e.overhead_s for e in vals])),
                       source=f"median of calibrated types (no data for {gpu_name})")
    else:
      eff = DEFAULT_EFFICIENCY
  return eff


def predict_layer_time_s(flops, bytes_accessed, peak_flops: float,
                         mem_bandwidth_bytes_per_s: float, eff: Efficiency):
  """Roofline time of a layer's forward+backward on one device (arrays broadcast)."""
  return eff.overhead_s + np.maximum(
      np.asarray(flops) / (peak_flops * eff.compute),
      np.asarray(bytes_accessed) / (mem_bandwidth_bytes_per_s * eff.memory))


# --------------------------------------------------------------------------- Zorse data

ZORSE_GPU_KEYS: dict[str, tuple[str, ...]] = {
    "A100-40G": ("a100x40",), "A100-80G": ("a100x80",), "V100-16G": ("v100x16",),
    "V100-32G": ("v100x16",), "A10G": ("a10g",), "T4": ("t4",),
}
"""Catalog GPU name -> Zorse GPU keys whose fp16 measurements calibrate it."""

ZORSE_MODELS: dict[str, tuple[str, int, int, int]] = {
    # name: (family, hidden, heads, ffn); per-layer parameters match zorse_model_stats.json
    "deepspeedgpt_1.3b": ("gpt", 2048, 16, 8192),
    "deepspeedgpt_2.7b": ("gpt", 2560, 20, 10240),
    "deepspeedgpt_6.7b": ("gpt", 4096, 32, 16384),
    "deepspeedllama_tiny": ("llama", 2048, 16, 5632),
    "deepspeedllama_3b": ("llama", 3200, 32, 8640),
    "deepspeedllama_7b": ("llama", 4096, 32, 11008),
    "deepspeedllama_13b": ("llama", 5120, 40, 13824),
    "deepspeedllama_33b": ("llama", 6656, 52, 17920),
}
"""Zorse model name -> the block harpjax rebuilds to cost it."""


def default_zorse_dir() -> Path:
  """``<repo>/../shared/data`` (where the public measurements are kept beside the repo)."""
  return Path(__file__).resolve().parents[3] / "shared" / "data"


def load_zorse(data_dir: str | os.PathLike | None = None) -> dict:
  """The parsed ``zorse_model_latencies.json``."""
  path = Path(data_dir or default_zorse_dir()) / "zorse_model_latencies.json"
  with open(path) as f:
    return json.load(f)


def zorse_layer_ms(entry) -> dict[int, float] | None:
  """``{microbatch size: forward+backward ms}`` of one Zorse entry.

  Entries with measured times per microbatch size give those; entries with only the linear
  fits (``[[fwd_slope, fwd_intercept], [bwd_slope, bwd_intercept]]``) are evaluated at
  microbatch sizes 1, 2 and 4; the old ``[fwd_ms, bwd_ms]`` format (microbatch size not
  stated) gives ``None``.
  """
  if not isinstance(entry, list):
    return None
  if len(entry) == 4 and isinstance(entry[2], list):
    fwd, bwd = entry[2], entry[3]
    return {i + 1: float(f) + float(b) for i, (f, b) in enumerate(zip(fwd, bwd))}
  if len(entry) == 2 and all(isinstance(x, list) and len(x) == 2 for x in entry):
    (fs, fi), (bs, bi) = entry
    return {m: float(fs * m + fi + bs * m + bi) for m in (1, 2, 4)}
  return None


def zorse_fit_ms(entry, mbs: float) -> float | None:
  """Forward+backward ms at ``mbs`` from an entry's linear fits (``None``: old format)."""
  if not (isinstance(entry, list) and len(entry) in (2, 4)
          and all(isinstance(x, list) and len(x) == 2 for x in entry[:2])):
    return None
  (fs, fi), (bs, bi) = entry[0], entry[1]
  return float(fs * mbs + fi + bs * mbs + bi)


@dataclasses.dataclass(frozen=True)
class Sample:
  gpu_key: str
  model: str
  seq: int
  mbs: int
  measured_s: float
  flops: tuple      # per layer of the block
  bytes: tuple


def calibration_samples(data: dict, layer_stats, gpu_keys: Sequence[str] | None = None,
                        max_mbs: int = 8) -> list[Sample]:
  """Measurements paired with the analytic stats of the rebuilt block.

  Args:
    data: parsed Zorse latencies.
    layer_stats: ``layer_stats(model, seq, mbs) -> [(flops, bytes)]`` per layer of the block.
    gpu_keys: Zorse GPU keys to use (default: every key of :data:`ZORSE_GPU_KEYS`).
    max_mbs: largest microbatch size used.
  """
  keys = set(gpu_keys or {k for ks in ZORSE_GPU_KEYS.values() for k in ks})
  out = []
  for model in ZORSE_MODELS:
    for gk, by_seq in data.get(model, {}).items():
      if gk not in keys:
        continue
      for seq, by_dtype in by_seq.items():
        times = zorse_layer_ms(by_dtype.get("float16"))
        if not times:
          continue
        for mbs, ms in sorted(times.items()):
          if mbs > max_mbs:
            continue
          stats = layer_stats(model, int(seq), mbs)
          out.append(Sample(gk, model, int(seq), mbs, ms * 1e-3,
                            tuple(s[0] for s in stats), tuple(s[1] for s in stats)))
  return out


def fit(samples: Sequence[Sample], peak_flops: float, mem_bandwidth: float,
        source: str = "") -> Efficiency:
  """Grid-search ``compute``, ``memory``, ``overhead_s`` minimising mean |log error|."""
  ec = np.geomspace(0.05, 1.0, 60)
  em = np.geomspace(0.05, 20.0, 70)
  ov = np.concatenate([[0.0], np.geomspace(5e-6, 5e-3, 31)])

  def err_grid(subset):
    tot = np.zeros((len(ec), len(em), len(ov)))
    for s in subset:
      f = np.asarray(s.flops)[:, None, None]
      b = np.asarray(s.bytes)[:, None, None]
      tc = f / (peak_flops * ec[None, :, None])           # [layers, ec, 1]
      tm = b / (mem_bandwidth * em[None, None, :])        # [layers, 1, em]
      t = np.maximum(tc, tm).sum(0)[:, :, None] + len(s.flops) * ov[None, None, :]
      tot += np.abs(np.log(t / s.measured_s))
    return tot / max(len(subset), 1)

  def best(subset):
    g = err_grid(subset)
    i, j, k = np.unravel_index(np.argmin(g), g.shape)
    return Efficiency(float(ec[i]), float(em[j]), float(ov[k]))

  e = best(samples)
  mape = _mape(samples, e, peak_flops, mem_bandwidth)
  models = sorted({s.model for s in samples})
  cv = None
  if len(models) > 1:
    errs = []
    for m in models:
      held = [s for s in samples if s.model == m]
      e_m = best([s for s in samples if s.model != m])
      errs += _errors(held, e_m, peak_flops, mem_bandwidth)
    cv = float(np.mean(errs))
  return dataclasses.replace(e, mape=mape, cv_mape=cv, samples=len(samples), source=source)


def _errors(samples, e: Efficiency, peak, bw) -> list[float]:
  out = []
  for s in samples:
    t = float(np.sum(predict_layer_time_s(np.asarray(s.flops), np.asarray(s.bytes), peak, bw, e)))
    out.append(abs(t - s.measured_s) / s.measured_s)
  return out


def _mape(samples, e, peak, bw) -> float:
  return float(np.mean(_errors(samples, e, peak, bw))) if samples else float("nan")


@dataclasses.dataclass(frozen=True)
class CalibrationReport:
  """Result of :func:`calibrate`: fitted factors and per-sample errors per GPU type."""
  efficiencies: dict
  samples: dict

  def table(self) -> str:
    rows = ["| GPU type | Zorse data | samples | compute eff | memory eff | overhead/layer "
            "| MAPE | leave-one-model-out MAPE |", "|---|---|---|---|---|---|---|---|"]
    for name, e in self.efficiencies.items():
      keys = ",".join(ZORSE_GPU_KEYS.get(name, ()))
      cv = f"{100 * e.cv_mape:.1f}%" if e.cv_mape is not None else "-"
      rows.append(f"| {name} | {keys} | {e.samples} | {e.compute:.3f} | {e.memory:.3f} | "
                  f"{e.overhead_s * 1e6:.0f} us | {100 * e.mape:.1f}% | {cv} |")
    return "\n".join(rows)

  def as_python(self) -> str:
    """The :data:`CALIBRATION` literal for these results."""
    lines = ["CALIBRATION: dict[str, Efficiency] = {"]
    for name, e in self.efficiencies.items():
      cv = None if e.cv_mape is None else round(e.cv_mape, 4)
      lines.append(f"    {name!r}: Efficiency(\n        compute={e.compute:.4f}, "
                   f"memory={e.memory:.4f}, overhead_s={e.overhead_s:.1e}, "
                   f"mape={e.mape:.4f}, cv_mape={cv},\n        samples={e.samples}, "
                   f"source={e.source!r}),")
    lines.append("}")
    return "\n".join(lines)


def calibrate(data_dir: str | os.PathLike | None = None, *, cache_dir=None,
              gpu_names: Sequence[str] | None = None, max_mbs: int = 8,
              progress: bool | None = None) -> CalibrationReport:
  """Fits :class:`Efficiency` per GPU type against the Zorse measurements.

  Args:
    data_dir: directory of ``zorse_model_latencies.json`` (default
      :func:`default_zorse_dir`).
    cache_dir: profile cache for the blocks' XLA statistics (``None``: the default directory).
    gpu_names: catalog GPU names to fit (default: every key of :data:`ZORSE_GPU_KEYS`).
    max_mbs: largest microbatch size used.
    progress: show a progress bar (default: when stderr is a TTY).

  Returns:
    A :class:`CalibrationReport`.
  """
  from harpjax.cluster import GPU_CATALOG
  from harpjax.compiler._profile_blocks import block_layer_stats

  data = load_zorse(data_dir)
  names = list(gpu_names or ZORSE_GPU_KEYS)
  stats_fn = block_layer_stats(cache_dir=cache_dir, progress=progress)
  effs, samples = {}, {}
  for name in names:
    gpu = GPU_CATALOG[name]
    ss = calibration_samples(data, stats_fn, ZORSE_GPU_KEYS[name], max_mbs=max_mbs)
    if not ss:
      continue
    models = sorted({s.model for s in ss})
    src = (f"zorse {'/'.join(ZORSE_GPU_KEYS[name])} fp16, {len(ss)} measurements of "
           f"{', '.join(models)}")
    effs[name] = fit(ss, gpu.peak_flops, gpu.mem_bandwidth_bytes_per_s, src)
    samples[name] = ss
    log.info("calibrated %s: %s", name, effs[name])
  return CalibrationReport(effs, samples)
