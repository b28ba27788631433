"""The rematerialisation mode as a per-stage choice: tables costed in several modes made one set
whose submesh choices are each submesh once per mode (:func:`with_remat_choice`), and tables of
one mode saying which (:func:`in_remat_mode`)."""

from __future__ import annotations

import numpy as np

from harpjax.compiler.profile.tables import CostTables, ENTRY_ARRAYS
from harpjax.compiler.trace import REMAT_MODES
from harpjax.errors import CostTablesError

__all__ = ["with_remat_choice", "in_remat_mode"]


def with_remat_choice(*tables: CostTables, **by_mode: CostTables) -> CostTables:
  """One set of tables whose submesh choices are each submesh once per rematerialisation
  mode (:attr:`CostTables.remat_modes`), from the tables of the same layers and cluster
  costed in each mode: the planner then chooses the mode per stage.

  ``with_remat_choice(none, full)`` (positional: the modes ``"none"`` and ``"full"``, in that
  order) or by name, ``with_remat_choice(none=a, full=b, dots=c)``
  (:data:`~harpjax.compiler.trace.REMAT_MODES`); at least two modes. A table may already say
  its one mode (``remat_modes`` all equal to its name).

  Raises:
    CostTablesError: fewer than two modes, an unknown or repeated mode, tables that do not
      describe the same layers and submeshes, or one already expanded into variants or
      carrying another choice.
  """
  if len(tables) > 2:
    raise CostTablesError("with_remat_choice takes at most two tables by position (none, "
                          "full); name the modes for more: with_remat_choice(none=..., "
                          "full=..., dots=...)")
  given = dict(zip(("none", "full"), tables))
  for mode, t in by_mode.items():
    if mode not in REMAT_MODES or mode in given:
      raise CostTablesError(f"with_remat_choice: mode {mode!r} is unknown or given twice; "
                            f"the modes are {REMAT_MODES}")
    given[mode] = t
  if len(given) < 2:
    raise CostTablesError("with_remat_choice needs the tables of at least two modes")
  modes = [m for m in REMAT_MODES if m in given]
  first = given[modes[0]]
  for mode in modes:
    t = given[mode]
    own = t.remat_modes is None or all(x == mode for row in t.remat_modes for x in row)
    if t.variants is not None or not own:
      raise CostTablesError("with_remat_choice takes tables of one remat mode each, before "
                            "their expansion into variants")
    if t.num_layers != first.num_layers or t.submeshes != first.submeshes or \
        t.subcluster_names != first.subcluster_names:
      raise CostTablesError("with_remat_choice: the tables must cost the same layers on the "
                            "same subclusters and submeshes")
  both = {}
  for f in ENTRY_ARRAYS:
    arrays = [getattr(given[m], f) for m in modes]
    if any(a is None for a in arrays) != all(a is None for a in arrays):
      raise CostTablesError(f"with_remat_choice: {f} is given in some of the tables only")
    if arrays[0] is not None:
      both[f] = tuple(np.concatenate(xs, axis=2) for xs in zip(*arrays))
  return first.replace(submeshes=tuple(s * len(modes) for s in first.submeshes),
                       remat_modes=tuple(tuple(m for m in modes for _ in s)
                                         for s in first.submeshes), **both)


def in_remat_mode(tables: CostTables, mode: str) -> CostTables:
  """``tables`` costed in one rematerialisation ``mode`` and saying so: ``"none"``/``"full"``
  as they are (the plan's :attr:`~harpjax.compiler.plan.Plan.remat` names them), any other
  mode in :attr:`CostTables.remat_modes`, so the planned stages carry it."""
  if mode in ("none", "full"):
    return tables
  return tables.replace(remat_modes=tuple((mode,) * len(s) for s in tables.submeshes))
