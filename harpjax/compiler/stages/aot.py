"""Compiling a step's executables before its first call, stages in parallel.

``jax.jit`` compiles on first call, one executable after another. A pipelined step has a
forward, a backward and a zeros executable per stage plus the placement groups around the
region; :func:`precompile` lowers and compiles them ahead of the first call, one stage per
thread (XLA compiles outside the GIL), with the argument shardings the runtimes will pass,
so that the calls hit JAX's compilation cache. The chain within a stage is sequential: the
backward takes the forward's residuals in the shardings XLA chose for them, and the gradient
accumulator in the shardings the backward returns.

A signature that differs from what the runtime passes is not an error, nor is a failure here
(logged): the call compiles lazily as before. ``tests/runtime/test_equivalence.py`` checks
that the first step of a precompiled step compiles nothing.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from harpjax.compiler.stages.layout import StepLayout
from harpjax.compiler.stages.stage import StageExecutables, acc_shardings

__all__ = ["precompile", "default_workers", "compile_stage", "compile_group"]

log = logging.getLogger(__name__)


def default_workers(num_stages: int) -> int:
  """One thread per stage, at most one per CPU."""
  return max(1, min(num_stages, os.cpu_count() or 1))


def precompile(layout: StepLayout, stages: Mapping[int, StageExecutables],
               group_fns: Mapping[int, Callable], workers: int | None = None,
               order: Sequence[int] | None = None,
               done: Callable[[int], None] | None = None) -> float:
  """Compiles stages' executables and placement groups ahead of their first call, one job per
  stage (its executables, then the placement groups it runs), in one pool of threads.

  Args:
    layout: the step's :class:`~harpjax.compiler.stages.layout.StepLayout`.
    stages: stage index -> its executables (a worker has one, the local runtime all).
    group_fns: placement group index -> its jitted function (the groups of those stages).
    workers: threads (default :func:`default_workers`).
    order: the stages in the order their jobs start (default: as ``stages`` lists them;
      the largest first finishes soonest).
    done: called with each stage as its job completes (a progress bar).

  Returns:
    Seconds taken.
  """
  t0 = time.perf_counter()
  groups: dict[int, list] = {s: [] for s in stages}
  for gi, fn in group_fns.items():
    groups[layout.groups[gi].home].append((gi, fn))

  def job(s: int) -> int:
    _attempt(f"stage {s}", lambda: _stage(stages[s]))
    for gi, fn in groups[s]:
      _attempt(f"a placement group of stage {s}",
               lambda gi=gi, fn=fn: _group(
                   layout, gi, fn, stages[s].group_mesh(layout.groups[gi].side)))
    return s

  order = list(stages) if order is None else [s for s in order if s in stages]
  workers = workers or default_workers(len(stages))
  if workers <= 1:
    for s in order:
      job(s)
      if done is not None:
        done(s)
    return time.perf_counter() - t0
  ex = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="harpjax-compile")
  try:
    for f in concurrent.futures.as_completed([ex.submit(job, s) for s in order]):
      s = f.result()
      if done is not None:
        done(s)
  except BaseException:
    # Ctrl-C (or a failure) hands control back now: queued compilations are cancelled,
    # running ones finish in their threads (XLA cannot be stopped mid-compile) and their
    # results are dropped.
    ex.shutdown(wait=False, cancel_futures=True)
    raise
  ex.shutdown(wait=True)
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
  them, and a weakly typed residual is part of the backward's signature)."""
  shardings = jax.tree_util.tree_leaves(lowered.compile().output_shardings)
  weak = [getattr(x, "weak_type", False)
          for x in jax.tree_util.tree_leaves(jax.eval_shape(fn, *args))]
  info, tree = jax.tree_util.tree_flatten(lowered.out_info)
  return jax.tree_util.tree_unflatten(tree, [
      jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=sh, weak_type=w)
      for i, sh, w in zip(info, shardings, weak, strict=True)])


def compile_stage(st: StageExecutables) -> dict:
  """Compiles a stage's forward, zeros and backward in the runtime's argument shardings.

  Returns:
    ``{"fwd": compiled, "bwd": compiled, "zeros": compiled}`` and ``"reduce"`` where the
    replicas accumulate their own gradients (``jax.stages.Compiled``: their
    ``memory_analysis()`` is XLA's account of each executable's memory per device).
  """
  lay = st.layout
  spec = lambda v: _spec(lay.avals[v], st.sharding(v))
  params = tuple(spec(v) for v in lay.param_ids)
  args = (params, tuple(spec(v) for v in lay.act_ids), tuple(spec(v) for v in lay.act_int_ids),
          tuple(spec(v) for v in lay.data_ids),
          jax.ShapeDtypeStruct((), jnp.int32))   # the runtime passes an uncommitted np.int32
  lowered = st.fwd.lower(*args)
  residuals = _outputs(st.fwd, args, lowered)[1]
  out = {"fwd": lowered.compile(), "zeros": st.zeros.lower().compile()}
  cts = tuple(spec(v) for v, has in zip(lay.output_ids, lay.ct_present) if has)
  acc = tuple(_spec(lay.held_acc_aval(v), sh)   # what the zeros executable returns
              for v, sh in zip(lay.param_ids, acc_shardings(lay, st.mesh)))
  for _ in range(3):   # the accumulator comes back in the backward's output shardings
    args = (params, residuals, cts, acc)
    lowered = st.bwd.lower(*args)
    got = _outputs(st.bwd, args, lowered)[0]
    out["bwd"] = lowered.compile()
    if all(a.sharding == o.sharding for a, o in zip(acc, got)):
      break
    acc = got
  if st.reduce is not None:
    out["reduce"] = st.reduce.lower(acc).compile()
  return out


def _stage(st: StageExecutables) -> None:
  for part in st.executables:
    compile_stage(part)


def compile_group(layout: StepLayout, gi: int, fn, mesh):
  """Compiles placement group ``gi``, its inputs in the shardings the runtimes put them in;
  returns the ``jax.stages.Compiled``."""
  g = layout.groups[gi]
  args = [_spec(layout.outer_avals[v],
                layout.preferred_sharding(g.home, v, mesh) or NamedSharding(mesh, P()))
          for v in g.in_ids]
  return fn.lower(*args).compile()


def _group(layout: StepLayout, gi: int, fn, mesh) -> None:
  compile_group(layout, gi, fn, mesh)
