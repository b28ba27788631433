"""Calibrating the analytic time model against published per-layer measurements.

A developer tool (not part of the library): fits the per-GPU-type efficiency factors of
:mod:`harpjax.compiler.profile.calibration` to the Zorse repository's
``zorse_model_latencies.json`` (MIT licence; one transformer layer, forward and backward
milliseconds by microbatch size). Each Zorse model's block is rebuilt in Flax
(:data:`ZORSE_MODELS`, :mod:`harpjax.models`), traced at the measured sequence length, cut into
layers by the same layer construction and costed per layer by the same XLA analysis the
profiler uses, on one device. Statistics are linear in the microbatch size (weights are read
once, activations scale), so microbatch sizes 1 and 2 are compiled and the rest extrapolated.

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
from harpjax.compiler.profile import cache as cache_lib
from harpjax.compiler.profile import pieces as pieces_lib
from harpjax.compiler.trace import from_closed_jaxpr
from harpjax.models import gpt
from tools import llama

log = logging.getLogger(__name__)

__all__ = ["ZORSE_MODELS", "block_program", "block_layer_stats", "Sample",
           "calibration_samples", "fit", "CalibrationReport", "calibrate"]

Efficiency = calib.Efficiency
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


def block_layer_stats(cache_dir=None, progress: bool | None = None):
  """``stats(model, seq, mbs) -> [(flops, bytes_accessed)]`` per layer of the block."""
  db = cache_lib.ProfileDB(cache_dir if cache_dir is not None
                                else cache_lib.default_cache_dir())
  memo: dict = {}

  def at(model: str, seq: int, mbs: int):
    key = {"what": "zorse-block", "model": model, "seq": seq, "mbs": mbs, "dtype": "float16"}
    k = tuple(sorted(key.items()))
    if k in memo:
      return memo[k]
    got = db.get(key)
    if got is None:
      program, kinds = block_program(model, seq, mbs)
      layers = construct_layers(program, kinds, options=LayerOptions())
      dep = pieces_lib.batch_dependent(program, kinds)
      dev = jax.devices()[:1]
      rows = []
      for i in range(len(layers)):
        st = pieces_lib.xla_stats(pieces_lib.build_piece(layers, i, i, dep), dev)
        rows.append([st.flops, st.bytes_accessed])
      got = {"layers": rows}
      db.put(key, got)
      log.info("block stats %s seq=%d mbs=%d: %d layers", model, seq, mbs, len(rows))
    memo[k] = [tuple(r) for r in got["layers"]]
    return memo[k]

  def stats(model: str, seq: int, mbs: int):
    one, two = at(model, seq, 1), at(model, seq, 2)
    return [tuple(a + (b - a) * (mbs - 1) for a, b in zip(r1, r2)) for r1, r2 in zip(one, two)]

  return stats


# --------------------------------------------------------------------------- the fit


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
        times = calib.zorse_layer_ms(by_dtype.get("float16"))
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
    t = float(np.sum(calib.predict_layer_time_s(np.asarray(s.flops), np.asarray(s.bytes), peak,
                                                bw, e)))
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
      :func:`~harpjax.compiler.profile.calibration.default_zorse_dir`).
    cache_dir: profile cache for the blocks' XLA statistics (``None``: the default directory).
    gpu_names: catalog GPU names to fit (default: every key of :data:`ZORSE_GPU_KEYS`).
    max_mbs: largest microbatch size used.
    progress: show a progress bar (default: when stderr is a TTY).

  Returns:
    A :class:`CalibrationReport`.
  """
  data = calib.load_zorse(data_dir)
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
