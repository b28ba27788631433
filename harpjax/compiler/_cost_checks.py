"""Submesh shapes and argument checks shared by the cost tables and their builder.

:func:`paper_submeshes` gives a subcluster's default submesh shapes (HARP §5.1) and
:func:`check_submeshes` validates given ones; the ``_int``/``_seq``/``_positive``/``_nonneg``
helpers check constructor arguments. All raise :class:`~harpjax.errors.CostTablesError`.
Both public functions are re-exported by :mod:`harpjax.compiler.cost_tables`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from harpjax.errors import CostTablesError

__all__ = ["paper_submeshes", "check_submeshes"]


def paper_submeshes(num_hosts: int, devices_per_host: int) -> tuple[tuple[int, int], ...]:
  """Submesh shapes of one subcluster: ``(1, 2^p)`` below ``M``, ``(1, M)``, ``(n, M)``.

  Args:
    num_hosts: ``N``, hosts in the subcluster.
    devices_per_host: ``M``.

  Returns:
    Shapes ``(hosts, devices_per_host)`` in increasing size.
  """
  shapes, w = [], 1
  while w < devices_per_host:
    shapes.append((1, w))
    w *= 2
  shapes.append((1, devices_per_host))
  shapes += [(n, devices_per_host) for n in range(2, num_hosts + 1)]
  return tuple(shapes)


def check_submeshes(name: str, num_hosts: int, devices_per_host: int,
                    shapes: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
  """Validates one subcluster's submesh shapes.

  Raises:
    CostTablesError: a shape is not ``(1, m)`` with ``1 <= m <= M`` or ``(n, M)`` with
      ``2 <= n <= N``, or shapes repeat.
  """
  out = []
  for shape in shapes:
    try:
      n, m = (int(x) for x in shape)
    except (TypeError, ValueError):
      raise CostTablesError(f"subcluster {name!r}: submesh {shape!r} is not (hosts, devices)")
    if not ((n == 1 and 1 <= m <= devices_per_host)
            or (2 <= n <= num_hosts and m == devices_per_host)):
      raise CostTablesError(
          f"subcluster {name!r} ({num_hosts} hosts x {devices_per_host} devices): submesh "
          f"{(n, m)} must be (1, m) with 1 <= m <= {devices_per_host} (inside one host) or "
          f"(n, {devices_per_host}) with 2 <= n <= {num_hosts} (whole hosts)")
    out.append((n, m))
  if not out:
    raise CostTablesError(f"subcluster {name!r} has no submesh shapes")
  if len(set(out)) != len(out):
    raise CostTablesError(f"subcluster {name!r}: submesh shapes {out} repeat")
  return tuple(out)


# --------------------------------------------------------------------------- helpers


def _int(v, where: str) -> int:
  try:
    iv = int(v)
  except (TypeError, ValueError):
    raise CostTablesError(f"{where}={v!r} is not an integer") from None
  if iv != v:
    raise CostTablesError(f"{where}={v!r} is not an integer")
  return iv


def _seq(v, where: str, n: int) -> tuple:
  try:
    t = tuple(v)
  except TypeError:
    raise CostTablesError(f"{where} must be a sequence of {n} entries, got {v!r}") from None
  if len(t) != n:
    raise CostTablesError(f"{where} has {len(t)} entries, expected {n} (one per "
                          f"{'subcluster' if n else 'link'})")
  return t


def _positive(v, where: str, n: int) -> tuple[float, ...]:
  t = tuple(float(x) for x in _seq(v, where, n))
  if any(not (x > 0 and np.isfinite(x)) for x in t):
    raise CostTablesError(f"{where}={t}: every entry must be finite and > 0")
  return t


def _nonneg(v, where: str, n: int) -> tuple[float, ...]:
  t = tuple(float(x) for x in _seq(v, where, n))
  if any(not (x >= 0 and np.isfinite(x)) for x in t):
    raise CostTablesError(f"{where}={t}: every entry must be finite and >= 0")
  return t
