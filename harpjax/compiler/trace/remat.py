"""Rematerialisation modes: what a stage's backward recomputes instead of keeping.

One list of modes and one way to apply each, shared by the profiler (which costs a layer in a
mode), the plan (:attr:`~harpjax.compiler.plan.StageSpec.remat`) and the runtime (which
compiles the stage in its mode), so the program costed is the program run.

* ``"none"``: the forward's residuals are kept for the backward;
* ``"full"``: only the inputs are kept; the backward recomputes the whole forward
  (``jax.checkpoint``);
* ``"dots"``: the matmuls' outputs are kept too and the rest recomputed
  (``jax.checkpoint_policies.dots_saveable``).
"""

from __future__ import annotations

from typing import Callable

import jax

from harpjax.errors import HarpjaxError

__all__ = ["REMAT_MODES", "remat_mode", "checkpointed"]

REMAT_MODES = ("none", "full", "dots")


def remat_mode(remat) -> str:
  """The mode named by ``remat``: one of :data:`REMAT_MODES`, ``True`` (``"full"``) or
  ``False``/``None`` (``"none"``).

  Raises:
    HarpjaxError: anything else.
  """
  if remat is True:
    return "full"
  if remat is False or remat is None:
    return "none"
  if isinstance(remat, str) and remat in REMAT_MODES:
    return remat
  raise HarpjaxError(f"remat={remat!r}: choose one of {', '.join(map(repr, REMAT_MODES))} "
                     "(True is 'full', False 'none')")


def checkpointed(remat) -> Callable[[Callable], Callable]:
  """``f -> f`` rematerialised as ``remat`` says (:func:`remat_mode`; ``"none"``: as is)."""
  mode = remat_mode(remat)
  if mode == "full":
    return jax.checkpoint
  if mode == "dots":
    return lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable)
  return lambda f: f
