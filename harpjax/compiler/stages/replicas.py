"""Data-parallel replicas that accumulate their own gradients, reduced once per step.

A stage on a ``(dp, tp)`` logical mesh splits each microbatch's rows over its ``dp`` replicas.
Run as one SPMD program, every microbatch's backward all-reduces the parameters' gradients
across the replicas; HARP and Alpa reduce once per step instead, after the last backward.
That is what these functions do: the stage's forward and backward run as a ``shard_map`` over
``dp`` (``tp`` left to XLA's partitioner), each replica running the step traced at its own
``b / dp`` rows (a :class:`~harpjax.compiler.stages.split.Part`, rewritten like the
microbatch's program so that sums over the examples come out in mean-exact form for its rows).
A replica keeps its residuals and its own gradient accumulator: one slice of a ``[dp, ...]``
array per parameter, so nothing crosses the replicas in the backward. ``reduce`` sums the
slices once per step (one all-reduce of the gradients), into the parameters' sharding.

The values a stage sends or returns combine over the replicas as a split stage's groups do
(:func:`~harpjax.compiler.stages.split.rows_of`): values with rows are the replicas' slices
along their row axis, mean-exact values their average, counts their sum, values that do not
depend on the rows the first replica's; cotangents follow (a value taken from the first
replica sends its cotangent there only).

Used for stages at ZeRO level 0 or 1 whose step does not tie examples together (batch
statistics need the replicas' rows together); from level 2 on the accumulator is split over
``dp`` and reduce-scattered every microbatch, which is what the level is for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, PartitionSpec as P

from harpjax.compiler.layers import sharding as sharding_lib
from harpjax.compiler.stages.layout import StageLayout
from harpjax.compiler.stages.split import FIRST, SUMMED, WEIGHTED, Part
from harpjax.compiler.stages.stage import StageFunctions

__all__ = ["replica_functions"]

DP = sharding_lib.DP


def _row_spec(axis: int | None) -> P:
  return P() if axis is None else P(*([None] * axis + [DP]))


def replica_functions(home: StageLayout, part: Part, axes: dict, combine: dict,
                      rows: int) -> StageFunctions:
  """The stage's functions with its ``dp`` replicas each running ``part`` on its rows.

  Args:
    home: the stage's layout (values at the microbatch's ``rows``, on its ``(dp, tp)`` mesh).
    part: the stage traced at ``rows / dp`` rows (its functions take the index in the full
      batch of their first row).
    axes, combine: from :func:`~harpjax.compiler.stages.split.rows_of`.
    rows: the microbatch's rows (``b``).

  Returns:
    :class:`~harpjax.compiler.stages.stage.StageFunctions` with the home's signatures, the
    gradient accumulator held as ``[dp, ...]`` per parameter
    (:meth:`~harpjax.compiler.stages.layout.StageLayout.held_acc_spec`), and ``reduce``.
  """
  dp, tp = home.logical_mesh
  r = part.rows
  mesh = AbstractMesh((dp, tp), (DP, sharding_lib.TP))
  local = part.functions
  weight = r / rows
  spec = lambda v: _row_spec(axes[v])
  out_specs = tuple(spec(v) if axes[v] is not None else P(DP) for v in home.output_ids)
  act_specs = tuple(spec(v) if axes[v] is not None else P(DP) for v in home.act_ids)
  present = [v for v, has in zip(home.output_ids, home.ct_present) if has]

  def local_fwd(params, acts, acts_int, data, mb_index):
    k = lax.axis_index(DP)
    outs, residuals = local.fwd(params, acts, acts_int, data, mb_index * rows + k * r)
    outs = tuple(o if axes[v] is not None else o[None] for v, o in zip(home.output_ids, outs))
    return outs, tuple(x[None] for x in residuals)

  fwd_specs = (tuple(P() for _ in home.param_ids), tuple(spec(v) for v in home.act_ids),
               tuple(spec(v) for v in home.act_int_ids), tuple(spec(v) for v in home.data_ids),
               P())

  def fwd(params, acts, acts_int, data, mb_index):
    outs, residuals = jax.shard_map(local_fwd, mesh=mesh, in_specs=fwd_specs,
                                    out_specs=(out_specs, P(DP)), axis_names=frozenset({DP}),
                                    check_vma=False)(
        params, acts, acts_int, data, mb_index)
    return tuple(_combine(o, axes[v], combine.get(v), weight)
                 for v, o in zip(home.output_ids, outs)), residuals

  def local_bwd(params, residuals, cts, acc):
    k = lax.axis_index(DP)
    cts = tuple(jnp.where(k == 0, ct, jnp.zeros_like(ct))
                if axes[v] is None and combine.get(v) == FIRST else ct
                for v, ct in zip(present, cts))
    acc, g_acts = local.bwd(params, tuple(x[0] for x in residuals), cts,
                            tuple(a[0] for a in acc))
    g_acts = tuple(g if axes[v] is not None else g[None] for v, g in zip(home.act_ids, g_acts))
    return tuple(a[None] for a in acc), g_acts

  def bwd(params, residuals, cts, acc):
    cts = tuple(ct * jnp.asarray(weight, ct.dtype)
                if axes[v] is None and combine.get(v) == WEIGHTED else ct
                for v, ct in zip(present, cts))
    acc, g_acts = jax.shard_map(
        local_bwd, mesh=mesh,
        in_specs=(tuple(P() for _ in home.param_ids), P(DP), tuple(spec(v) for v in present),
                  P(DP)),
        out_specs=(P(DP), act_specs), axis_names=frozenset({DP}), check_vma=False)(
            params, residuals, cts, acc)
    # An activation without rows was read by every replica: its cotangent is their sum.
    return acc, tuple(g if axes[v] is not None else jnp.sum(g, axis=0)
                      for v, g in zip(home.act_ids, g_acts))

  def zeros():
    return tuple(jnp.zeros((dp,) + tuple(home.avals[v].shape), home.avals[v].dtype)
                 for v in home.param_ids)

  def reduce(acc):
    return tuple(jnp.sum(a, axis=0) for a in acc)

  return StageFunctions(fwd, bwd, zeros, reduce)


def _combine(x, axis, how, weight):
  """A replica-stacked output (leading axis) as the stage returns it."""
  if axis is not None:
    return x
  if how == FIRST:
    return x[0]
  if how == SUMMED:
    return jnp.sum(x, axis=0)
  assert how == WEIGHTED, how
  return jnp.sum(x * jnp.asarray(weight, x.dtype), axis=0).astype(x.dtype)
