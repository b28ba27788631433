"""The analytic time model, its per-GPU-type efficiency factors, and the published data.

A layer's forward+backward on one device of a GPU type takes (roofline with launch overhead)::

    t = overhead_s + max(flops / (peak_flops * compute), bytes / (mem_bandwidth * memory))

with ``flops`` and ``bytes`` from XLA's cost analysis of the layer's compiled forward+backward
(per device). ``compute``, ``memory`` and ``overhead_s`` are fitted per GPU type to published
per-layer measurements: the Zorse repository's ``zorse_model_latencies.json`` (MIT licence;
one transformer layer, forward and backward milliseconds by microbatch size), using the fp16
entries of its DeepSpeed GPT and LLaMA models (shapes from ``zorse_model_stats.json``).
:data:`CALIBRATION` holds the fit; the developer tool ``tools/calibration.py`` recomputes it
(rebuilding the models' blocks and costing them through the same layer construction and XLA
analysis the profiler uses). The readers of the published data (:func:`load_zorse`...) serve
both that tool and the ``"imported"`` cost source.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["Efficiency", "CALIBRATION", "DEFAULT_EFFICIENCY", "COST_MODEL_VERSION",
           "efficiency_for", "predict_layer_time_s", "ZORSE_GPU_KEYS", "default_zorse_dir",
           "load_zorse", "zorse_layer_ms", "zorse_fit_ms"]

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


# Fitted by ``tools/calibration.py`` (``python benchmarks/profile.py --calibrate`` prints this
# table)
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

CALIBRATION["V100-32G"] = CALIBRATION["V100-16G"]   # the same chip and HBM2 (see above)

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

def default_zorse_dir() -> Path:
  """``<repo>/../shared/data`` (where the public measurements are kept beside the repo)."""
  repo = Path(__file__).resolve().parents[3]   # profile -> compiler -> harpjax -> repo
  return repo.parent / "shared" / "data"


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
