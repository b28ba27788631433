"""Shared helpers: run a step pipelined and under ``jax.jit`` and compare every output."""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import numpy as np

import harpjax

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "configs")
DEMO_CLUSTER = os.path.join(CONFIGS, "demo_local.yaml")
RTOL = 1e-5


def cluster_yaml(name: str, subclusters, gbps: float = 100) -> str:
  """A cluster file of ``(name, gpu, hosts, devices per host)`` subclusters whose hosts share
  one Ethernet network of ``gbps``."""
  return f"name: {name}\nsubclusters:\n" + "".join(f"""  - name: {sub}
    gpu: {gpu}
    hosts: {hosts}
    devices_per_host: {dph}
    nics:
      - {{name: eth0, kind: ethernet, gbps: {gbps}, network: dc}}
""" for sub, gpu, hosts, dph in subclusters)


def max_rel_err(a, b, floor: float = 0.0) -> float:
  """Largest |a-b| / max(max|a|, floor) over matching leaves (non-floats must match exactly).

  ``floor`` only matters for leaves whose values are all tiny: a parameter whose exact gradient
  is zero (a key bias before a softmax) holds nothing but rounding noise."""
  worst = 0.0
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb), (len(la), len(lb))
  for x, y in zip(la, lb):
    if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)   # typed keys: their bits
    x, y = np.asarray(x), np.asarray(y)
    assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
    if not np.issubdtype(x.dtype, np.inexact):
      np.testing.assert_array_equal(x, y)
      continue
    scale = max(float(np.max(np.abs(x))), floor, 1e-30) if x.size else 1.0
    worst = max(worst, float(np.max(np.abs(x - y))) / scale if x.size else 0.0)
  return worst


def compare_steps(step, state, batches, *, plan, num_microbatches, schedule=None,
                  cluster=DEMO_CLUSTER, extra_args=(), rtol=RTOL, floor=0.0, **kwargs):
  """Runs ``len(batches)`` steps both ways from ``state``; asserts equal results each step.
  ``schedule`` is the given plan's (``plan.replace(schedule=...)``)."""
  if schedule is not None:
    plan = plan.replace(schedule=schedule)
  pstep = harpjax.auto_parallel(step, cluster=cluster, num_microbatches=num_microbatches,
                                plan=plan, **kwargs)
  ref = jax.jit(step)
  s_ref = s_par = state
  for i, batch in enumerate(batches):
    extra = extra_args[i] if extra_args else ()
    out_ref = ref(s_ref, batch, *extra)
    out_par = pstep(s_par, batch, *extra)
    assert jax.tree_util.tree_structure(out_ref) == jax.tree_util.tree_structure(out_par)
    err = max_rel_err(out_ref, out_par, floor)
    assert err <= rtol, f"step {i}: max relative error {err:.3g} > {rtol}"
    s_ref, s_par = out_ref[0], out_par[0]
  return pstep


class ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return x + nn.Dense(x.shape[-1])(nn.tanh(nn.Dense(32)(x))), None


class ScanNet(nn.Module):
  """Blocks as one ``nn.scan`` over stacked parameters (named ``blocks``), between two Denses."""
  length: int = 2

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16)(x)
    stack = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=self.length)
    x, _ = stack(name="blocks")(x, None)
    return nn.Dense(3)(x)
