"""Intra-op parallelism inside one submesh: logical meshes and sharding rules.

A submesh of ``n * m`` devices is viewed as a logical mesh ``(dp, tp)`` with axes named
``"dp"`` and ``"tp"``. Batch-carrying values are split on ``dp``; the weights of matrix
multiplies found in the jaxpr are split on ``tp`` Megatron-style: the first matmul of a pair
splits its output (column) dimension, the next its contracting (row) dimension, so that the
pair needs one reduction. XLA's sharding propagation fills in everything else; any choice is
numerically the unsharded computation (up to summation order).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from jax.sharding import PartitionSpec as P

from harpjax.compiler.program import Lit, Op, Program

__all__ = ["DP", "TP", "logical_meshes", "param_specs", "batch_spec"]

DP, TP = "dp", "tp"

_PASSTHROUGH = frozenset({"convert_element_type", "copy", "copy_p"})


def logical_meshes(num_devices: int) -> list[tuple[int, int]]:
  """All ``(dp, tp)`` with ``dp * tp == num_devices``, data-parallel first."""
  out = [(num_devices // t, t) for t in range(1, num_devices + 1) if num_devices % t == 0]
  return out


def batch_spec(shape: Sequence[int], axis: int, dp: int) -> P:
  """Shards ``axis`` on ``dp`` when it divides evenly, else replicates."""
  if dp > 1 and len(shape) > axis >= 0 and shape[axis] % dp == 0:
    return P(*([None] * axis + [DP]))
  return P()


def param_specs(program: Program, ops: Iterable[Op], param_ids: Sequence[int],
                tp: int) -> dict[int, P]:
  """Tensor-parallel specs for the parameters read by ``ops``.

  Args:
    program: the program the ops belong to (for shapes).
    ops: the stage's ops, in order.
    param_ids: value ids of the parameters.
    tp: tensor-parallel degree; ``1`` replicates everything.

  Returns:
    value id -> ``PartitionSpec`` for every id of ``param_ids`` (``P()`` when not split).
  """
  specs = {pid: P() for pid in param_ids}
  if tp <= 1:
    return specs
  pset = set(param_ids)
  source: dict[int, int] = {}   # value id -> parameter id it is a cast/copy of
  role = 0                       # alternate column / row
  for op in ops:
    if op.name in _PASSTHROUGH and op.invars and not isinstance(op.invars[0], Lit):
      src = op.invars[0]
      root = src if src in pset else source.get(src)
      if root is not None:
        source[op.outvars[0]] = root
      continue
    if op.name != "dot_general":
      continue
    (lhs_c, rhs_c), _ = op.params["dimension_numbers"]
    for operand, contract in ((op.invars[1], rhs_c), (op.invars[0], lhs_c)):
      if isinstance(operand, Lit):
        continue
      pid = operand if operand in pset else source.get(operand)
      if pid is None:
        continue
      if specs[pid] != P():
        break
      shape = program.avals[pid].shape
      if len(shape) < 2:
        break
      # The operand's own shape may differ from the parameter's (a cast keeps it); use dims.
      free = [d for d in range(len(shape)) if d not in contract]
      want = free if role % 2 == 0 else list(contract)
      for d in want + [d for d in range(len(shape)) if d not in want]:
        if shape[d] % tp == 0 and shape[d] >= tp:
          specs[pid] = P(*([None] * d + [TP]))
          break
      role += 1
      break
  return specs
