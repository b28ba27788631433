"""Running a compiled step in one process.

Stages live on disjoint submeshes of the local devices; activations and gradients move between
them with ``jax.device_put``. The schedule's task tables are interpreted in a dependency-valid
order (:func:`harpjax.compiler.schedules.dry_run`); JAX dispatches asynchronously, so stages on
different devices overlap as their data dependencies allow.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from harpjax.compiler.stages import CompiledStep
from harpjax.compiler.trace import Lit
from harpjax.compiler.schedule import dry_run

log = logging.getLogger(__name__)

__all__ = ["run_step", "put", "run_groups", "microbatch_slice"]


def put(x, sharding: NamedSharding):
  """Moves ``x`` onto ``sharding`` unless it is already there."""
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  return jax.device_put(x, sharding)


def microbatch_slice(x, axis: int, m: int, num_microbatches: int):
  """Microbatch ``m`` of ``x``: its ``m``-th of ``num_microbatches`` equal parts along ``axis``."""
  size = x.shape[axis] // num_microbatches
  idx = [slice(None)] * np.ndim(x)
  idx[axis] = slice(m * size, (m + 1) * size)
  return x[tuple(idx)]


def _put_on_mesh(x, mesh, preferred: NamedSharding | None = None):
  """Puts ``x`` on ``mesh``: kept as is when already on exactly its devices."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    if x.sharding.device_set == set(mesh.devices.flat):
      return x
  return jax.device_put(x, preferred if preferred is not None else NamedSharding(mesh, P()))


def run_groups(cs: CompiledStep, groups, fns, env: dict, preferred: dict) -> None:
  """Runs placement groups, each on its stage's mesh, reading and writing ``env``."""
  for group, fn in zip(groups, fns):
    mesh = cs.stages[group.home].mesh
    args = []
    for v in group.in_ids:
      args.append(_put_on_mesh(env[v], mesh, preferred.get((group.home, v))))
    outs = fn(*args)
    env.update(zip(group.out_ids, outs))


def run_step(cs: CompiledStep, args: tuple) -> Any:
  """Runs one training step; returns the step's outputs with the user's pytree structure."""
  ts = cs.traced
  outer = ts.outer
  leaves = jax.tree_util.tree_leaves(args)
  arg_vids = outer.invars[len(ts.outer_consts):]
  leaves = [_strongly_typed(x, outer.avals[v]) for x, v in zip(leaves, arg_vids)]
  env: dict[int, Any] = dict(zip(outer.invars, list(ts.outer_consts) + leaves))
  preferred = _preferred_shardings(cs)
  n_before = len(cs.placement.before)
  run_groups(cs, cs.placement.before, cs.group_fns[:n_before], env, preferred)
  _run_region(cs, env)
  run_groups(cs, cs.placement.after, cs.group_fns[n_before:], env, preferred)
  outs = [ref.value if isinstance(ref, Lit) else env[ref] for ref in outer.outvars]
  return jax.tree_util.tree_unflatten(ts.out_tree, outs)


def _strongly_typed(x, aval):
  """A Python scalar or weakly typed argument as the traced program types it (strongly):
  ``TrainState.step`` starts as the int ``0``, and a weak first step would compile the
  placement groups once more on the second step."""
  if isinstance(x, (bool, int, float, complex)) or (
      getattr(x, "weak_type", False) and not getattr(aval, "weak_type", False)):
    return jnp.asarray(x, dtype=aval.dtype)
  return x


def _preferred_shardings(cs: CompiledStep) -> dict:
  """(stage, outer value id) -> sharding the placement groups expect (see ``CompiledStep``)."""
  return cs.preferred


def _run_region(cs: CompiledStep, env: dict) -> None:
  ts = cs.traced
  prog = cs.layers.program
  region_eqn = ts.outer.ops[ts.region_op]
  B = ts.num_microbatches
  S = cs.num_stages

  # Region input values, by region value id.
  value = {}
  for k, (ref, inp) in enumerate(zip(region_eqn.invars, ts.inputs)):
    value[prog.invars[k]] = ref.value if isinstance(ref, Lit) else env[ref]
  inputs_by_id = {prog.invars[k]: inp for k, inp in enumerate(ts.inputs)}

  params = []
  for s, st in enumerate(cs.stages):
    params.append(tuple(put(value[v], st.param_sharding[v]) for v in st.program.param_ids))

  whole_cache: dict[tuple[int, int], Any] = {}

  def data_for(s: int, m: int):
    st = cs.stages[s]
    out = []
    for v in st.program.data_ids:
      inp = inputs_by_id[v]
      sh = st.input_sharding[v]
      if inp.kind == "split":
        out.append(jax.device_put(microbatch_slice(value[v], inp.axis, m, B), sh))
      else:
        key = (s, v)
        if key not in whole_cache:
          whole_cache[key] = put(value[v], sh)
        out.append(whole_cache[key])
    return tuple(out)

  acts: list[dict[int, Any]] = [dict() for _ in range(B)]     # per microbatch: id -> value
  cts: list[dict[int, Any]] = [dict() for _ in range(B)]      # per microbatch: id -> cotangent
  residuals: list[dict[int, Any]] = [dict() for _ in range(S)]
  acc = [st.zeros() for st in cs.stages]
  fwd_outputs: list[dict[int, Any]] = [dict() for _ in range(B)]
  loss_vid = prog.outvars[0]
  region_outs = {v for v in prog.outvars if not isinstance(v, Lit)}
  scale = 1.0 / B if cs.loss_reduction == "mean" else 1.0
  mb_index = [np.int32(m) for m in range(B)]

  for s, task in dry_run(cs.schedule.tables):
    st = cs.stages[s]
    sp = st.program
    m = task.microbatch
    if task.kind == "F":
      a = tuple(put(acts[m][v], st.input_sharding[v]) for v in sp.act_ids)
      ai = tuple(put(acts[m][v], st.input_sharding[v]) for v in sp.act_int_ids)
      outs, vjp = st.fwd(params[s], a, ai, data_for(s, m), mb_index[m])
      for v, x in zip(sp.output_ids, outs):
        acts[m][v] = x
        if v in region_outs:
          fwd_outputs[m][v] = x
      residuals[s][m] = vjp
    else:
      present = []
      for v, has in zip(sp.output_ids, sp.ct_present):
        if not has:
          continue
        ct = cts[m].pop(v, None)
        if v == loss_vid:
          seed = jax.device_put(jnp.asarray(scale, prog.avals[v].dtype), st.replicated)
          ct = seed if ct is None else ct + seed
        if ct is None:
          aval = prog.avals[v]
          ct = jax.device_put(jnp.zeros(aval.shape, aval.dtype), cs.output_sharding(s, v))
        present.append(ct)
      acc[s], act_cts = st.bwd(residuals[s].pop(m), tuple(present), acc[s])
      for v, g in zip(sp.act_ids, act_cts):
        src = _producer_stage(cs, v)
        g = put(g, cs.output_sharding(src, v))
        cts[m][v] = g if v not in cts[m] else cts[m][v] + g
      if s == 0:
        acts[m] = {}   # every stage is done with microbatch m's activations

  # Region outputs: loss, aux, gradients.
  outs = []
  for k, ref in enumerate(prog.outvars):
    per_mb = [_region_output(cs, ref, value, fwd_outputs[m], m) for m in range(B)]
    axis = None if k == 0 else ts.aux_concat_axes[k - 1]
    outs.append(_combine(per_mb, axis, cs.loss_reduction))
  for j in range(ts.num_params):
    owner = cs.param_owner[j]
    vid = _param_vid(cs, j)
    total = None
    for s in cs.param_users[j] or [owner]:
      st = cs.stages[s]
      if vid not in st.program.param_ids:
        continue
      g = acc[s][st.program.param_ids.index(vid)]
      g = put(g, cs.stages[owner].param_sharding[vid])
      total = g if total is None else total + g
    if total is None:   # a parameter no stage reads: zero gradient
      aval = prog.avals[vid]
      total = jax.device_put(jnp.zeros(aval.shape, aval.dtype), cs.stages[owner].replicated)
    outs.append(total)
  for vid, x in zip(region_eqn.outvars, outs):
    if vid >= 0:
      env[vid] = x


def _param_vid(cs: CompiledStep, j: int) -> int:
  prog = cs.layers.program
  for k, inp in enumerate(cs.traced.inputs):
    if inp.kind == "param" and inp.param_index == j:
      return prog.invars[k]
  raise KeyError(j)


def _producer_stage(cs: CompiledStep, vid: int) -> int:
  for s, st in enumerate(cs.stages):
    if vid in st.program.output_ids:
      return s
  raise KeyError(vid)


def _region_output(cs: CompiledStep, ref, value: dict, acts_m: dict, m: int):
  if isinstance(ref, Lit):
    return jnp.asarray(ref.value)
  if ref in acts_m:
    return acts_m[ref]
  inp = {cs.layers.program.invars[k]: i for k, i in enumerate(cs.traced.inputs)}.get(ref)
  if inp is None:
    raise KeyError(ref)
  x = value[ref]
  if inp.kind == "split":
    return microbatch_slice(x, inp.axis, m, cs.traced.num_microbatches)
  return x


@jax.jit
def _mean(xs):
  return jnp.mean(jnp.stack(xs), axis=0).astype(xs[0].dtype)


@jax.jit
def _sum(xs):
  return jnp.sum(jnp.stack(xs), axis=0).astype(xs[0].dtype)


def _combine(per_mb: list, axis, reduction: str):
  if axis is not None:
    return jnp.concatenate(per_mb, axis=axis)
  dev = per_mb[0]
  if isinstance(dev, jax.Array):
    per_mb = [put(x, dev.sharding) if isinstance(x, jax.Array) else x for x in per_mb]
  xs = tuple(per_mb)
  if not jnp.issubdtype(jnp.result_type(xs[0]), jnp.inexact):
    return xs[0] if all(x is xs[0] for x in xs) else _sum(xs)
  return _mean(xs) if reduction == "mean" else _sum(xs)
