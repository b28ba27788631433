"""The analytic time model, its per-GPU-type factors, and the published data.

A layer's forward+backward on one device of a GPU type takes (:func:`predict_time_s`)::

    t = sum over matmuls  max(flops / (peak_flops * compute), bytes / (mem_bandwidth * memory))
        + light_bytes / (mem_bandwidth * memory)
        + kernel_s * kernels

summed op by op over the :class:`Work` of the layer's program (per device): every
compute-heavy op (matmul, convolution) on its own roofline; the bytes every other op reads
and writes at the memory rate; and a fixed ``kernel_s`` per op that launches a kernel of its
own (matmuls, reductions, gathers, concatenations...: every op but the elementwise ones XLA
fuses into their neighbours and those it computes inside their consumers). Every term is a sum
over ops, so a model's predicted time does not depend on how finely it is cut into layers (the
former model charged a fixed overhead per *layer*: a 16-block GPT on H100 took 113 ms cut
into 18 layers and 537 ms cut into 200).

``compute``, ``memory`` and ``kernel_s`` are fitted per GPU type to published per-layer
measurements: the Zorse repository's ``zorse_model_latencies.json`` (MIT licence; one
transformer layer, forward and backward milliseconds by microbatch size), using the fp16
entries of its DeepSpeed GPT and LLaMA models (shapes from ``zorse_model_stats.json``).
:data:`CALIBRATION` holds the fit; the developer tool ``tools/calibration.py`` recomputes it
(rebuilding the models' blocks and reading their :class:`Work` through the same layer
construction and jaxpr reading the default cost source uses). GPU types without published
measurements get :data:`DEFAULT_EFFICIENCY`, a documented roofline default, and the profiler
names them in one warning (:func:`uncalibrated`). The readers of the published data
(:func:`load_zorse`...) serve both that tool and the ``"imported"`` cost source.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Iterable

import numpy as np

from harpjax.errors import PublishedDataError

log = logging.getLogger(__name__)

__all__ = ["Efficiency", "Work", "CALIBRATION", "DEFAULT_EFFICIENCY", "COST_MODEL_VERSION",
           "efficiency_for", "efficiency_table", "uncalibrated", "predict_time_s", "ZORSE_GPU_KEYS",
           "default_zorse_dir", "load_zorse", "load_zorse_stats", "zorse_layer_ms",
           "zorse_fit_ms"]

COST_MODEL_VERSION = "4"
"""Bumped when the time model or its inputs change (invalidates cached analytic costs)."""


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Fitted factors of one GPU type.

  Attributes:
    compute: achieved fraction of peak FLOP/s in matmuls.
    memory: achieved fraction of memory bandwidth, against the bytes :class:`Work` counts
      (each op reading its operands and writing its results: ``memory > 1`` means XLA's
      fusion moves fewer bytes than that).
    kernel_s: fixed seconds per kernel (launch, framework); see :class:`Work`.
    mape: mean absolute percentage error on the calibration data (``None``: not fitted).
    cv_mape: leave-one-model-out error (``None``: fewer than two models).
    samples: number of measurements fitted.
    source: provenance.
    max_error: largest absolute relative error on the calibration data (``None``: not
      fitted).
  """
  compute: float
  memory: float
  kernel_s: float
  mape: float | None = None
  cv_mape: float | None = None
  samples: int = 0
  source: str = ""
  max_error: float | None = None


@dataclasses.dataclass(frozen=True)
class Work:
  """What a program does on one device, as the time model reads it (:func:`predict_time_s`).

  Attributes:
    heavy_flops: FLOPs of each compute-heavy op (matmul, convolution).
    heavy_bytes: bytes each of them reads and writes.
    light_flops: FLOPs of every other op (elementwise, reductions; not in the time: these ops
      are bound by memory).
    light_bytes: bytes every other op reads and writes (ops XLA computes inside their
      consumers excluded).
    kernels: ops that launch a kernel of their own: compute-heavy ops, reductions and data
      movement that is not a view (gather, scatter, concatenate, pad...); elementwise ops are
      fused into their neighbours.
    flash_flops: FLOPs of each fused attention call (``jax.nn.dot_product_attention(...,
      implementation="cudnn")``: cuDNN's FlashAttention-2 style kernel, forward or backward),
      as a GPU type with the kernel runs it (``GPUType.fused_attention``).
    flash_bytes: bytes each of them reads and writes: Q, K, V, O (and the softmax statistics,
      the output gradient, the input gradients), no ``S x S`` scores.
    flash_composition: the same attention calls as the plain XLA composition (the ``S x S``
      scores through memory, softmax in fp32), what a type without the kernel runs instead
      (``None`` when there are none).
  """
  heavy_flops: tuple[float, ...] = ()
  heavy_bytes: tuple[float, ...] = ()
  light_flops: float = 0.0
  light_bytes: float = 0.0
  kernels: float = 0.0
  flash_flops: tuple[float, ...] = ()
  flash_bytes: tuple[float, ...] = ()
  flash_composition: "Work | None" = None

  @property
  def flops(self) -> float:
    """FLOPs of the program as written (fused attention calls as the fused kernel)."""
    return float(sum(self.heavy_flops)) + self.light_flops + float(sum(self.flash_flops))

  @property
  def bytes(self) -> float:
    return float(sum(self.heavy_bytes)) + self.light_bytes + float(sum(self.flash_bytes))

  def unfused(self) -> "Work":
    """This work with its fused attention calls replaced by their XLA composition (what a GPU
    type without the fused kernel runs)."""
    if self.flash_composition is None:
      return self
    return Work(self.heavy_flops, self.heavy_bytes, self.light_flops, self.light_bytes,
                self.kernels) + self.flash_composition

  def scaled(self, scale: float) -> "Work":
    """The work of ``1 / scale`` of the batch (FLOPs and bytes divided, kernels kept)."""
    if scale == 1:
      return self
    comp = None if self.flash_composition is None else self.flash_composition.scaled(scale)
    return Work(tuple(f / scale for f in self.heavy_flops),
                tuple(b / scale for b in self.heavy_bytes), self.light_flops / scale,
                self.light_bytes / scale, self.kernels,
                tuple(f / scale for f in self.flash_flops),
                tuple(b / scale for b in self.flash_bytes), comp)

  def __add__(self, other: "Work") -> "Work":
    a, b = self.flash_composition, other.flash_composition
    comp = a if b is None else b if a is None else a + b
    return Work(self.heavy_flops + other.heavy_flops, self.heavy_bytes + other.heavy_bytes,
                self.light_flops + other.light_flops, self.light_bytes + other.light_bytes,
                self.kernels + other.kernels, self.flash_flops + other.flash_flops,
                self.flash_bytes + other.flash_bytes, comp)

  def interpolate(self, other: "Work", x: float) -> "Work":
    """``self + (other - self) * x`` term by term (the same program at another batch)."""
    lerp = lambda a, b: a + (b - a) * x
    comp = self.flash_composition
    if comp is not None and other.flash_composition is not None:
      comp = comp.interpolate(other.flash_composition, x)
    return Work(tuple(lerp(a, b) for a, b in zip(self.heavy_flops, other.heavy_flops)),
                tuple(lerp(a, b) for a, b in zip(self.heavy_bytes, other.heavy_bytes)),
                lerp(self.light_flops, other.light_flops),
                lerp(self.light_bytes, other.light_bytes), self.kernels,
                tuple(lerp(a, b) for a, b in zip(self.flash_flops, other.flash_flops)),
                tuple(lerp(a, b) for a, b in zip(self.flash_bytes, other.flash_bytes)), comp)

  def to_json(self) -> dict:
    d = {"heavy_flops": list(self.heavy_flops), "heavy_bytes": list(self.heavy_bytes),
         "light_flops": self.light_flops, "light_bytes": self.light_bytes,
         "kernels": self.kernels}
    if self.flash_flops:
      d["flash_flops"] = list(self.flash_flops)
      d["flash_bytes"] = list(self.flash_bytes)
      d["flash_composition"] = (None if self.flash_composition is None
                                else self.flash_composition.to_json())
    return d

  @classmethod
  def from_json(cls, d: dict) -> "Work":
    comp = d.get("flash_composition")
    return cls(tuple(float(x) for x in d["heavy_flops"]),
               tuple(float(x) for x in d["heavy_bytes"]), float(d["light_flops"]),
               float(d["light_bytes"]), float(d["kernels"]),
               tuple(float(x) for x in d.get("flash_flops", ())),
               tuple(float(x) for x in d.get("flash_bytes", ())),
               None if comp is None else cls.from_json(comp))


def predict_time_s(work: Work, peak_flops: float, mem_bandwidth_bytes_per_s: float,
                   eff: Efficiency, compute=None, memory=None, kernel_s=None,
                   fused_attention: bool = False):
  """Seconds of ``work`` on one device (the module docstring's formula).

  ``compute``, ``memory`` and ``kernel_s`` override ``eff``'s and may be arrays (they
  broadcast: the calibration's grid search evaluates many factors at once).
  ``fused_attention`` (``GPUType.fused_attention``): whether the type runs cuDNN's fused
  attention kernel; if so each of the work's fused attention calls is one kernel on the
  matmul roofline (its FLOPs, its Q/K/V/O bytes), if not they cost as their XLA composition
  (:attr:`Work.flash_composition`).
  """
  if work.flash_flops and not fused_attention:
    work = work.unfused()
  c = eff.compute if compute is None else compute
  m = eff.memory if memory is None else memory
  k = eff.kernel_s if kernel_s is None else kernel_s
  peak, bw = peak_flops * np.asarray(c), mem_bandwidth_bytes_per_s * np.asarray(m)
  t = (np.asarray(work.light_bytes) / bw
       + np.asarray(k) * (work.kernels + len(work.flash_flops)))
  for f, b in zip(work.heavy_flops + work.flash_flops, work.heavy_bytes + work.flash_bytes):
    t = t + np.maximum(f / peak, b / bw)
  return t


# Fitted by ``tools/calibration.py`` (``python benchmarks/profile.py --calibrate`` prints this
# table and docs/cost_model.md holds its errors) on the fp16 entries of
# zorse_model_latencies.json (public Zorse repository, MIT licence), microbatch sizes 1-8, with
# the jaxpr work of the rebuilt blocks (harpjax 0.1.0, jax 0.10.2). V100-32G uses the v100x16
# measurements (same SXM2 V100 chip and 900 GB/s HBM2): the v100x32 fp16 entries are in the
# old [fwd, bwd] format, which does not say the microbatch size. ``kernel_s`` is large
# (~0.1 ms) because the measured DeepSpeed layers spend that much per launched op in the
# framework; these layers are compute-bound and the memory term rarely binds.
CALIBRATION: dict[str, Efficiency] = {
    "A100-40G": Efficiency(
        compute=0.6332, memory=20.0000, kernel_s=9.463e-05, mape=0.0797, cv_mape=0.1104,
        samples=128, max_error=0.8871, source=(
            "zorse a100x40 fp16, 128 measurements of deepspeedllama_13b, deepspeedllama_33b, "
            "deepspeedllama_3b, deepspeedllama_7b, deepspeedllama_tiny")),
    "A100-80G": Efficiency(
        compute=0.7374, memory=11.8786, kernel_s=1.947e-04, mape=0.0461, cv_mape=0.0509,
        samples=80, max_error=0.4306, source=(
            "zorse a100x80 fp16, 80 measurements of deepspeedllama_13b, deepspeedllama_33b, "
            "deepspeedllama_7b, deepspeedllama_tiny")),
    "V100-16G": Efficiency(
        compute=0.6662, memory=4.9849, kernel_s=1.947e-04, mape=0.0478, cv_mape=0.0705,
        samples=55, max_error=0.3166, source=(
            "zorse v100x16 fp16, 55 measurements of deepspeedgpt_2.7b, deepspeedgpt_6.7b, "
            "deepspeedllama_13b, deepspeedllama_33b, deepspeedllama_7b")),
    "A10G": Efficiency(
        compute=0.7758, memory=20.0000, kernel_s=1.947e-04, mape=0.0704, cv_mape=0.1193,
        samples=102, max_error=0.5751, source=(
            "zorse a10g fp16, 102 measurements of deepspeedllama_13b, deepspeedllama_33b, "
            "deepspeedllama_3b, deepspeedllama_7b, deepspeedllama_tiny")),
    "T4": Efficiency(
        compute=0.3811, memory=2.9607, kernel_s=2.331e-04, mape=0.1341, cv_mape=0.1765,
        samples=83, max_error=0.8001, source=(
            "zorse t4 fp16, 83 measurements of deepspeedgpt_2.7b, deepspeedgpt_6.7b, "
            "deepspeedllama_13b, deepspeedllama_33b, deepspeedllama_3b, deepspeedllama_7b, "
            "deepspeedllama_tiny")),
}

CALIBRATION["V100-32G"] = CALIBRATION["V100-16G"]   # the same chip and HBM2 (see above)

DEFAULT_EFFICIENCY = Efficiency(compute=0.65, memory=10.0, kernel_s=1e-4,
                                source="roofline default for GPU types without published "
                                       "measurements")
"""Factors of GPU types without published measurements (H100, H200, L40S, RTX 4090 ...):
65% of peak FLOP/s in matmuls and memory at 10x the bytes counted (XLA's fusion), about the
median of the calibrated types, and 0.1 ms per kernel, the least fixed cost among them (a
newer GPU is not slower per launch); docs/cost_model.md."""


def efficiency_table(overrides: dict | None = None) -> dict[str, Efficiency]:
  """:data:`CALIBRATION` with ``overrides`` (GPU name -> :class:`Efficiency`) on top."""
  return dict(CALIBRATION) if not overrides else {**CALIBRATION, **overrides}


def efficiency_for(gpu_name: str, overrides: dict | None = None) -> Efficiency:
  """The factors of a GPU type: ``overrides``, else :data:`CALIBRATION`, else
  :data:`DEFAULT_EFFICIENCY`."""
  if overrides and gpu_name in overrides:
    return overrides[gpu_name]
  return CALIBRATION.get(gpu_name, DEFAULT_EFFICIENCY)


def uncalibrated(gpu_names: Iterable[str], overrides: dict | None = None) -> list[str]:
  """The GPU types among ``gpu_names`` with neither published measurements nor ``overrides``
  (sorted, unique): they are timed with :data:`DEFAULT_EFFICIENCY`."""
  table = efficiency_table(overrides)
  return sorted({n for n in gpu_names if n not in table})


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


def _read_json(data_dir, name: str) -> dict:
  path = Path(data_dir or default_zorse_dir()) / name
  try:
    with open(path) as f:
      got = json.load(f)
  except FileNotFoundError:
    raise PublishedDataError(
        f"no published measurements at {path}: give the directory of {name} "
        "(ProfileOptions(imported_data_dir=...), harpjax plan --data-dir), or profile with "
        "source='jaxpr'") from None
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise PublishedDataError(f"cannot read the published measurements {path}: {e}") from None
  if not isinstance(got, dict):
    raise PublishedDataError(f"{path} holds {type(got).__name__}, not the expected mapping")
  return got


def load_zorse(data_dir: str | os.PathLike | None = None) -> dict:
  """The parsed ``zorse_model_latencies.json``.

  Raises:
    PublishedDataError: the file is missing or unreadable.
  """
  return _read_json(data_dir, "zorse_model_latencies.json")


def load_zorse_stats(data_dir: str | os.PathLike | None = None) -> dict:
  """The parsed ``zorse_model_stats.json``: per model ``hidden_size``, ``num_layers``,
  ``parameters_per_layer``.

  Raises:
    PublishedDataError: the file is missing or unreadable.
  """
  return _read_json(data_dir, "zorse_model_stats.json")


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
