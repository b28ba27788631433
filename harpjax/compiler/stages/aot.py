"""Compiling a step's executables before its first call, stages in parallel.

``jax.jit`` compiles on first call, one executable after another. A pipelined step has a
forward, a backward and a zeros executable per stage plus the placement groups around the
region; :func:`precompile` lowers and compiles them ahead of the first call, one stage per
thread (XLA compiles outside the GIL), with the argument shardings the local runtime will pass,
so that the calls hit JAX's compilation cache. The chain within a stage is sequential: the
backward takes the forward's residuals in the shardings XLA chose for them, and the gradient
accumulator in the shardings the backward returns.

A signature that differs from what the runtime passes is not an error, nor is a failure here
(logged): the call compiles lazily as before. ``tests/runtime/test_equivalence.py`` checks that the first step of a
precompiled step compiles nothing.
"""

from __future__ import annotations

import concurrent.futures
import os
import logging
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = ["precompile", "default_workers"]

log = logging.getLogger(__name__)


def default_workers(num_stages: int) -> int:
  """One thread per stage, at most one per CPU."""
  return max(1, min(num_stages, os.cpu_count() or 1))


def precompile(cs, workers: int | None = None) -> float:
  """Compiles the built stages' executables and placement groups of ``cs``; returns seconds.

  Args:
    cs: a :class:`~harpjax.compiler.compile.CompiledStep`.
    workers: threads (default :func:`default_workers`).
  """
  t0 = time.perf_counter()
  built = [s for s, st in enumerate(cs.stages) if st is not None]
  groups = [(g, fn) for g, fn in zip(cs.placement.before + cs.placement.after, cs.group_fns)
            if fn is not None]
  jobs = [(f"stage {s}", lambda s=s: _stage(cs, s)) for s in built]
  jobs += [(f"a placement group of stage {g.home}", lambda g=g, fn=fn: _group(cs, g, fn))
           for g, fn in groups]
  workers = workers or default_workers(len(built))
  if workers <= 1:
    for what, job in jobs:
      _attempt(what, job)
  else:
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
      for f in [ex.submit(_attempt, what, job) for what, job in jobs]:
        f.result()
  return time.perf_counter() - t0


def _attempt(what: str, job) -> None:
  """Runs ``job``; a failure is logged and left to the first call, which compiles lazily
  (and raises there if compiling itself fails)."""
  try:
    job()
  except Exception as e:   # noqa: BLE001 -- the lazy path is the authority
    log.warning("compiling %s ahead of the first call failed (%s: %s); it compiles on "
                "first call instead", what, type(e).__name__, e)


def _spec(aval, sharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype, sharding=sharding)


def _outputs(fn, args, lowered):
  """``fn``'s outputs as specs in the compiled shardings, weak types kept (``out_info`` drops
  them, and a weakly typed residual is part of the backward's signature), in the tree
  structure of ``lowered`` (whose ``jax.vjp`` closure is the one the calls return)."""
  shardings = jax.tree_util.tree_leaves(lowered.compile().output_shardings)
  weak = [getattr(x, "weak_type", False)
          for x in jax.tree_util.tree_leaves(jax.eval_shape(fn, *args))]
  info, tree = jax.tree_util.tree_flatten(lowered.out_info)
  return jax.tree_util.tree_unflatten(tree, [
      jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=sh, weak_type=w)
      for i, sh, w in zip(info, shardings, weak, strict=True)])


def _stage(cs, s: int) -> None:
  """Forward, zeros and backward of stage ``s``, in the runtime's argument shardings."""
  st = cs.stages[s]
  sp, avals = st.program, cs.layers.program.avals
  params = tuple(_spec(avals[v], st.param_sharding[v]) for v in sp.param_ids)
  acts = tuple(_spec(avals[v], st.input_sharding[v]) for v in sp.act_ids)
  acts_int = tuple(_spec(avals[v], st.input_sharding[v]) for v in sp.act_int_ids)
  data = tuple(_spec(avals[v], st.input_sharding[v]) for v in sp.data_ids)
  mb_index = jax.ShapeDtypeStruct((), jnp.int32)   # the runtime passes an uncommitted np.int32
  args = (params, acts, acts_int, data, mb_index)
  residuals = _outputs(st.fwd, args, st.fwd.lower(*args))[1]
  st.zeros.lower().compile()
  cts = tuple(_spec(avals[v], cs.output_sharding(s, v))
              for v, has in zip(sp.output_ids, sp.ct_present) if has)
  acc = params   # the zeros executable returns the parameters' shardings
  for _ in range(3):   # the accumulator comes back in the backward's output shardings
    args = (residuals, cts, acc)
    out = _outputs(st.bwd, args, st.bwd.lower(*args))[0]
    if all(a.sharding == o.sharding for a, o in zip(acc, out)):
      break
    acc = out


def _group(cs, group, fn) -> None:
  """A placement group, its inputs in the shardings ``run_groups`` puts them in."""
  mesh = cs.stages[group.home].mesh
  avals = cs.traced.outer.avals
  args = [_spec(avals[v], cs.preferred.get((group.home, v)) or NamedSharding(mesh, P()))
          for v in group.in_ids]
  fn.lower(*args).compile()
