"""Calibrating the analytic time model against published per-layer measurements.

A developer tool (not part of the library): fits the per-GPU-type factors of
:mod:`harpjax.compiler.profile.calibration` (``compute``, ``memory``, ``kernel_s``) to the
Zorse repository's ``zorse_model_latencies.json`` (MIT licence; one transformer layer, forward
and backward milliseconds by microbatch size). Each Zorse model's block is rebuilt in Flax
(:data:`ZORSE_MODELS`, :mod:`harpjax.models`), traced at the measured sequence length, cut into
layers by the same layer construction, and each layer's
:class:`~harpjax.compiler.profile.calibration.Work` read off its jaxpr as the default cost
source reads it, on one device. FLOPs and bytes are linear in the microbatch size (weights are
read once, activations scale), so microbatch sizes 1 and 2 are traced and the rest
interpolated.

``python benchmarks/profile.py --calibrate`` runs :func:`calibrate` and prints the
``CALIBRATION`` literal to paste into :mod:`harpjax.compiler.profile.calibration`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from harpjax.cluster import GPU_CATALOG
from harpjax.compiler.layers import LayerOptions, construct_layers
from harpjax.compiler.profile import calibration as calib
from harpjax.compiler.profile import estimate
from harpjax.compiler.profile import pieces as pieces_lib
from harpjax.compiler.trace import from_closed_jaxpr
from harpjax.models import gpt
from tools import llama

log = logging.getLogger(__name__)

__all__ = ["ZORSE_MODELS", "block_program", "block_work", "Sample", "calibration_samples",
           "fit", "errors", "CalibrationReport", "calibrate"]

Efficiency = calib.Efficiency
Work = calib.Work
ZORSE_GPU_KEYS = calib.ZORSE_GPU_KEYS

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


# --------------------------------------------------------------------------- the blocks


def block_program(model: str, seq: int, mbs: int, dtype=jnp.float16):
  """``(program, input_kinds)`` of one block of a Zorse model: ``x -> block(x)``."""
  family, hidden, heads, ffn = ZORSE_MODELS[model]
  if family == "gpt":
    cfg = gpt.GPTConfig(seq_len=seq, hidden=hidden, num_heads=heads, mlp_ratio=ffn // hidden,
                        num_blocks=1, dtype=dtype, param_dtype=dtype, fused_qkv=True,
                        softmax_dtype="float32", layer_marks=0)
    mod = gpt.Block(cfg)
  else:
    mod = llama.LlamaBlock(llama.LlamaConfig(hidden, heads, ffn, dtype, dtype))
  x = jax.ShapeDtypeStruct((mbs, seq, hidden), dtype)
  params = jax.eval_shape(mod.init, jax.random.key(0), x)
  leaves, tree = jax.tree_util.tree_flatten(params)
  closed = jax.make_jaxpr(
      lambda ps, x: mod.apply(jax.tree_util.tree_unflatten(tree, ps), x))(leaves, x)
  program = from_closed_jaxpr(closed)
  kinds = ["static"] * len(closed.consts) + ["param"] * len(leaves) + ["split"]
  return program, kinds


def block_work():
  """``work(model, seq, mbs) -> Work`` of one block (its layers' jaxpr work, summed)."""
  memo: dict = {}

  def at(model: str, seq: int, mbs: int) -> Work:
    k = (model, seq, mbs)
    if k not in memo:
      program, kinds = block_program(model, seq, mbs)
      layers = construct_layers(program, kinds, options=LayerOptions())
      dep = pieces_lib.batch_dependent(program, kinds)
      total = Work()
      for i in range(len(layers)):
        traced = estimate.trace_piece(pieces_lib.build_piece(layers, i, i, dep))
        total = total + estimate.jaxpr_work(traced, (1, 1))
      memo[k] = total
      log.info("block work %s seq=%d mbs=%d: %d layers, %d kernels", model, seq, mbs,
               len(layers), total.kernels)
    return memo[k]

  def work(model: str, seq: int, mbs: int) -> Work:
    return at(model, seq, 1).interpolate(at(model, seq, 2), mbs - 1)

  return work


# --------------------------------------------------------------------------- the fit


@dataclasses.dataclass(frozen=True)
class Sample:
  gpu_key: str
  model: str
  seq: int
  mbs: int
  measured_s: float
  work: Work        # of the block's forward+backward, one device


def calibration_samples(data: dict, block_work_fn, gpu_keys: Sequence[str] | None = None,
                        max_mbs: int = 8) -> list[Sample]:
  """Measurements paired with the work of the rebuilt block.

  Args:
    data: parsed Zorse latencies.
    block_work_fn: ``(model, seq, mbs) -> Work`` of the block (:func:`block_work`).
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
        times = calib.zorse_layer_ms(by_dtype.get("float16"))
        if not times:
          continue
        for mbs, ms in sorted(times.items()):
          if mbs <= max_mbs:
            out.append(Sample(gk, model, int(seq), mbs, ms * 1e-3,
                              block_work_fn(model, int(seq), mbs)))
  return out


_COMPUTE = np.geomspace(0.05, 1.0, 60)
_MEMORY = np.geomspace(0.05, 20.0, 70)
_KERNEL = np.concatenate([[0.0], np.geomspace(1e-7, 5e-3, 61)])


def fit(samples: Sequence[Sample], peak_flops: float, mem_bandwidth: float,
        source: str = "") -> Efficiency:
  """Grid-searches ``compute``, ``memory``, ``kernel_s`` minimising the mean |log error|;
  errors on the samples and leave-one-model-out (:func:`errors`) recorded."""

  # Per sample, the time without kernels on the (compute, memory) grid: computed once.
  comp, mem = _COMPUTE[:, None], _MEMORY[None, :]
  base = {id(s): calib.predict_time_s(s.work, peak_flops, mem_bandwidth,
                                      calib.DEFAULT_EFFICIENCY, comp, mem, 0.0)
          for s in samples}

  def best(subset) -> Efficiency:
    tot = np.zeros((len(_COMPUTE), len(_MEMORY), len(_KERNEL)))
    for s in subset:
      t = base[id(s)][:, :, None] + _KERNEL[None, None, :] * s.work.kernels
      tot += np.abs(np.log(t / s.measured_s))
    i, j, k = np.unravel_index(np.argmin(tot), tot.shape)
    return Efficiency(float(_COMPUTE[i]), float(_MEMORY[j]), float(_KERNEL[k]))

  e = best(samples)
  errs = errors(samples, e, peak_flops, mem_bandwidth)
  models = sorted({s.model for s in samples})
  cv = None
  if len(models) > 1:
    held = []
    for m in models:
      e_m = best([s for s in samples if s.model != m])
      held += errors([s for s in samples if s.model == m], e_m, peak_flops, mem_bandwidth)
    cv = float(np.mean(np.abs(held)))
  return dataclasses.replace(e, mape=float(np.mean(np.abs(errs))), cv_mape=cv,
                             samples=len(samples), source=source,
                             max_error=float(np.max(np.abs(errs))))


def errors(samples: Sequence[Sample], e: Efficiency, peak: float, bw: float) -> list[float]:
  """Signed relative errors ``predicted / measured - 1`` of ``e`` on ``samples``."""
  return [float(calib.predict_time_s(s.work, peak, bw, e)) / s.measured_s - 1
          for s in samples]


@dataclasses.dataclass(frozen=True)
class CalibrationReport:
  """Result of :func:`calibrate`: fitted factors and the samples per GPU type."""
  efficiencies: dict
  samples: dict

  def table(self) -> str:
    """The per-GPU error table (markdown) of docs/cost_model.md."""
    rows = ["| GPU type | Zorse data | samples | models | compute | memory | per kernel | "
            "mean error | median | 90th pct. | leave-one-model-out |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in self.efficiencies.items():
      g = GPU_CATALOG[name]
      errs = np.abs(errors(self.samples[name], e, g.peak_flops, g.mem_bandwidth_bytes_per_s))
      keys = ",".join(ZORSE_GPU_KEYS.get(name, ()))
      cv = f"{100 * e.cv_mape:.1f}%" if e.cv_mape is not None else "-"
      models = len({s.model for s in self.samples[name]})
      rows.append(f"| {name} | {keys} | {e.samples} | {models} | {e.compute:.3f} | "
                  f"{e.memory:.2f} | {e.kernel_s * 1e6:.0f} us | {100 * e.mape:.1f}% | "
                  f"{100 * np.median(errs):.1f}% | {100 * np.percentile(errs, 90):.1f}% | "
                  f"{cv} |")
    return "\n".join(rows)

  def as_python(self) -> str:
    """The :data:`CALIBRATION` literal for these results."""
    lines = ["CALIBRATION: dict[str, Efficiency] = {"]
    for name, e in self.efficiencies.items():
      cv = None if e.cv_mape is None else round(e.cv_mape, 4)
      lines.append(f"    {name!r}: Efficiency(\n        compute={e.compute:.4f}, "
                   f"memory={e.memory:.4f}, kernel_s={e.kernel_s:.3e}, "
                   f"mape={e.mape:.4f}, cv_mape={cv},\n        samples={e.samples}, "
                   f"max_error={e.max_error:.4f}, source={e.source!r}),")
    lines.append("}")
    return "\n".join(lines)


def calibrate(data_dir: str | os.PathLike | None = None, *,
              gpu_names: Sequence[str] | None = None, max_mbs: int = 8) -> CalibrationReport:
  """Fits :class:`Efficiency` per GPU type against the Zorse measurements.

  Args:
    data_dir: directory of ``zorse_model_latencies.json`` (default
      :func:`~harpjax.compiler.profile.calibration.default_zorse_dir`).
    gpu_names: catalog GPU names to fit (default: every key of :data:`ZORSE_GPU_KEYS`).
    max_mbs: largest microbatch size used.

  Returns:
    A :class:`CalibrationReport`.
  """
  data = calib.load_zorse(data_dir)
  names = list(gpu_names or ZORSE_GPU_KEYS)
  work_fn = block_work()
  effs, samples = {}, {}
  for name in names:
    gpu = GPU_CATALOG[name]
    ss = calibration_samples(data, work_fn, ZORSE_GPU_KEYS[name], max_mbs=max_mbs)
    if not ss:
      continue
    models = sorted({s.model for s in ss})
    src = (f"zorse {'/'.join(ZORSE_GPU_KEYS[name])} fp16, {len(ss)} measurements of "
           f"{', '.join(models)}")
    effs[name] = fit(ss, gpu.peak_flops, gpu.mem_bandwidth_bytes_per_s, src)
    samples[name] = ss
    log.info("calibrated %s: %s", name, effs[name])
  return CalibrationReport(effs, samples)
