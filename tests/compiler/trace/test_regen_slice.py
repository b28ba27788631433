"""A redrawn slice is the full draw's slice, bit for bit, and hashes only its own elements.

:func:`harpjax.compiler.trace.regen.redraw_slice` computes a microbatch's (or a replica's) rows
of a draw made at the full batch's shape without drawing the rest: for threefry keys drawn by
position it hashes the slice's counters. Each test compares it with ``jax.random`` at the full
shape, sliced, at traced offsets; one reads XLA's cost analysis of both."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from harpjax.compiler.trace import regen

_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def _site(fn, key):
  """The last equation of ``fn(key)`` (the draw) and a :class:`Redraw` of it along ``axis``."""
  eqn = jax.make_jaxpr(fn)(key).jaxpr.eqns[-1]
  return eqn, dict(eqn.params)


def _sliced(fn, key, axis, parts, rows=None):
  """``fn(key)`` (the full draw) and, per slice, ``redraw_slice``'s result at a traced
  offset (``mb_index`` the slice's index, or with ``rows`` its first row)."""
  eqn, params = _site(fn, key)
  full = fn(key)
  aval = eqn.outvars[0].aval
  size = aval.shape[axis] // parts
  small = aval.update(shape=aval.shape[:axis] + (size,) + aval.shape[axis + 1:])
  site = regen.Redraw(axis, params)
  run = jax.jit(lambda k, m: regen.redraw_slice(eqn.primitive, site, [k], [small], m,
                                                rows)[0])
  outs = [run(key, np.int32(m * rows if rows else m)) for m in range(parts)]
  wants = [lax.slice_in_dim(full, m * size, (m + 1) * size, axis=axis) for m in range(parts)]
  return outs, wants


def _equal(outs, wants):
  for got, want in zip(outs, wants):
    if jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key):
      got, want = jax.random.key_data(got), jax.random.key_data(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("bits", [8, 16, 32, 64])
@pytest.mark.parametrize("shape,axis,parts", [((16, 1024), 0, 4), ((3, 8, 5), 1, 4),
                                              ((7, 6), 1, 3), ((12,), 0, 6)])
def test_bits_slice_is_the_full_draws_slice(bits, shape, axis, parts, x64):
  key = jax.random.key(11)
  fn = lambda k: jax.random.bits(k, shape, _UINT[bits])
  _equal(*_sliced(fn, key, axis, parts))


def test_key_array_slices_each_keys_draw(x64):
  keys = jax.random.split(jax.random.key(5), 3)
  for bits, axis in ((32, 1), (16, 2), (64, 1)):
    fn = jax.vmap(lambda k, b=bits: jax.random.bits(k, (4, 6), _UINT[b]))
    _equal(*_sliced(fn, keys, axis, 2))


@pytest.mark.parametrize("shape,axis,parts", [((8, 3), 0, 4), ((8,), 0, 2), ((2, 6), 1, 3)])
def test_split_slice_is_the_full_splits_slice(shape, axis, parts):
  fn = lambda k: jax.random.split(k, shape)
  _equal(*_sliced(fn, jax.random.key(2), axis, parts))


def test_rows_offset(x64):
  """A part of a microbatch (``rows``: the offset given is its first row, a replica's)."""
  key = jax.random.key(7)
  fn = lambda k: jax.random.bits(k, (8, 4, 10), jnp.uint32)
  outs, wants = _sliced(fn, key, 0, 4, rows=2)
  _equal(outs, wants)
  # 4 elements per row along axis 1: rows=2 over a slice of 2 along axis 1 is 1 element each
  fn = lambda k: jax.random.bits(k, (3, 8), jnp.uint8)
  _equal(*_sliced(fn, key, 1, 4, rows=2))


def test_iota_slice_is_the_full_iotas_slice():
  for dim in (0, 1):
    eqn = jax.make_jaxpr(lambda: lax.broadcasted_iota(jnp.int32, (8, 5), dim))().jaxpr.eqns[0]
    site = regen.Redraw(0, dict(eqn.params))
    small = eqn.outvars[0].aval.update(shape=(2, 5))
    run = jax.jit(lambda m: regen.redraw_slice(eqn.primitive, site, [], [small], m)[0])
    full = lax.broadcasted_iota(jnp.int32, (8, 5), dim)
    for m in range(4):
      np.testing.assert_array_equal(np.asarray(run(np.int32(m))),
                                    np.asarray(full[2 * m:2 * m + 2]))


def test_rbg_keys_keep_the_full_draw():
  """``rbg`` keys draw with XLA's ``RngBitGenerator``, not by position: the full shape is
  drawn and sliced (still its slice, bit for bit)."""
  key = jax.random.key(3, impl="rbg")
  fn = lambda k: jax.random.bits(k, (8, 16), jnp.uint32)
  _equal(*_sliced(fn, key, 0, 4))
  eqn, params = _site(fn, key)
  small = eqn.outvars[0].aval.update(shape=(2, 16))
  jaxpr = jax.make_jaxpr(lambda k, m: regen.redraw_slice(
      eqn.primitive, regen.Redraw(0, params), [k], [small], m))(key, np.int32(0))
  assert any(e.primitive.name == "random_bits" and tuple(e.params["shape"]) == (8, 16)
             for e in jaxpr.jaxpr.eqns)


@pytest.mark.parametrize("shape,axis,start,size", [((2 ** 21, 2 ** 12, 2), 0, 2 ** 21 - 2, 2),
                                                   ((2 ** 10, 2 ** 12, 2 ** 11), 1, 4000, 1)])
def test_counters_above_two_to_the_32(shape, axis, start, size):
  """Beyond 2**32 elements the counters carry into the high word, as JAX's 64-bit iota does
  (compared with NumPy's ``uint64`` positions; the full draw is never made)."""
  local = shape[:axis] + (size,) + shape[axis + 1:]
  hi, lo = jax.jit(lambda s: regen.position_counters(shape, axis, s, size))(np.int32(start))
  idx = np.indices(local, dtype=np.uint64)
  idx[axis] += np.uint64(start)
  strides = [int(np.prod(shape[d + 1:], dtype=object)) for d in range(len(shape))]
  pos = sum(i * np.uint64(s) for i, s in zip(idx, strides))
  np.testing.assert_array_equal(np.asarray(hi), (pos >> np.uint64(32)).astype(np.uint32))
  np.testing.assert_array_equal(np.asarray(lo), (pos & np.uint64(0xFFFFFFFF)).astype(np.uint32))
  assert np.asarray(hi).max() > 0


def _xla(fn, *args):
  compiled = jax.jit(fn).lower(*args).compile()
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  return float(ca.get("flops", 0.0)), compiled.memory_analysis().temp_size_in_bytes


def test_slice_hashes_its_own_rows_only():
  """XLA's account of a ``u32[16, 1024]`` draw's 4-row slice: the full draw then a dynamic
  slice hashes all 16 rows; the redrawn slice costs what a draw of 4 rows costs (the same
  temporaries, a few FLOPs per element fewer: its counters are 32-bit), a quarter of it."""
  key = jax.random.key(0)
  fn = lambda k: jax.random.bits(k, (16, 1024), jnp.uint32)
  eqn, params = _site(fn, key)
  small = eqn.outvars[0].aval.update(shape=(4, 1024))
  site = regen.Redraw(0, params)
  full_then_slice = _xla(lambda k, m: lax.dynamic_slice_in_dim(fn(k), m * 4, 4, 0), key,
                         np.int32(1))
  redrawn = _xla(lambda k, m: regen.redraw_slice(eqn.primitive, site, [k], [small], m)[0], key,
                 np.int32(1))
  four_rows = _xla(lambda k: jax.random.bits(k, (4, 1024), jnp.uint32), key)
  assert redrawn[1] == four_rows[1] < full_then_slice[1] / 4
  assert redrawn[0] <= four_rows[0] < full_then_slice[0] / 3.5


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_data_parallel_replicas_hash_their_own_rows(zero):
  """A stage on two data-parallel devices (the zoo's loop model, dropout in every block), as
  replicas (ZeRO 0: a ``shard_map`` given each replica's first row) or one program (ZeRO 3:
  XLA partitions the counters' iota): each device's forward hashes the counters of its own
  rows only. Read off the optimized HLO of the stage's forward: every 2-D ``u32`` array (the
  hash's counters and state) has the device's 2 rows, where the replicas drawing the whole
  batch (keys treated as not drawn by position, the earlier runtime) hash all 16."""
  import dataclasses
  import re

  import harpjax
  from harpjax import _compat
  from harpjax.compiler.stages import compile_stage
  from tests import zoo
  from tests.equivalence import DEMO_CLUSTER

  case = zoo.linen("loop")
  args = (case.state, case.batches[0])

  def hashed_rows():
    probe = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=4)
    L = len(probe.profile(*args).layers)
    plan = dataclasses.replace(harpjax.ManualPlan([
        dict(layers=(0, L // 2 - 1), subcluster="v100", submesh=(1, 2), logical_mesh=(2, 1),
             zero=zero),
        dict(layers=(L // 2, L - 1), subcluster="a100", submesh=(1, 2), logical_mesh=(2, 1),
             zero=zero)]), layer_source="auto")
    step = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=4, plan=plan)
    cs = step.compile(*args)
    assert cs.stages[0].layout.replicas == (zero == 0)
    text = compile_stage(cs.stages[0])["fwd"].as_text()
    return {int(m.group(1)) for m in re.finditer(r"u32\[(\d+),\d+\]", text)}

  assert hashed_rows() == {2}
  if zero == 0:
    saved = _compat.threefry_key_words
    _compat.threefry_key_words = lambda keys: None
    try:
      assert max(hashed_rows()) == zoo.BATCH
    finally:
      _compat.threefry_key_words = saved
