"""The one place harpjax touches JAX internals.

JAX renames and removes internals between releases; everything harpjax needs beyond the public
API is funnelled through this module and gated on ``jax.__version_info__``. Tested with the
version pinned in ``setup.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend as jex
import numpy as np

__all__ = [
    "JAX_VERSION", "Primitive", "Literal", "Var", "DropVar", "ClosedJaxpr", "Jaxpr",
    "is_literal", "is_dropvar", "literal_value", "bind_eqn", "eqn_name_stack", "CALL_PRIMITIVES",
    "REMAT_PRIMITIVES",
    "subjaxpr_of_call", "float0", "aval_of", "make_float0_zeros", "register_identity_primitive",
]

JAX_VERSION = jax.__version_info__

Primitive = jex.core.Primitive
Literal = jex.core.Literal
Var = jex.core.Var
DropVar = jex.core.DropVar
ClosedJaxpr = jex.core.ClosedJaxpr
Jaxpr = jex.core.Jaxpr

# Call-like primitives whose body can be inlined without changing semantics.
CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "remat2",
                             "checkpoint"})
# Of those, the rematerialising ones (``jax.checkpoint``): inlined, their ops keep the scope.
REMAT_PRIMITIVES = frozenset({"remat", "remat2", "checkpoint"})

float0 = jax.dtypes.float0


def is_literal(x: Any) -> bool:
  return isinstance(x, Literal)


def is_dropvar(x: Any) -> bool:
  return isinstance(x, DropVar)


def literal_value(x: Any) -> Any:
  return x.val


def bind_eqn(primitive, params: dict, invals: list) -> list:
  """Binds ``primitive`` as ``jax.core.eval_jaxpr`` does; always returns a list."""
  got = primitive.get_bind_params(params)
  if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], (list, tuple)):
    subfuns, bind_params = got          # JAX < 0.7 returned (subfuns, params)
  else:
    subfuns, bind_params = (), got
  out = primitive.bind(*subfuns, *invals, **bind_params)
  return list(out) if primitive.multiple_results else [out]


def eqn_name_stack(eqn) -> str:
  """The module path of an equation (Flax module scopes, named_scope), '' if unknown."""
  try:
    return str(eqn.source_info.name_stack)
  except AttributeError:  # pragma: no cover - older JAX
    return ""


def subjaxpr_of_call(eqn):
  """For an inlinable call equation, its ``ClosedJaxpr`` body; else ``None``.

  ``remat``/``checkpoint`` bodies are plain ``Jaxpr`` objects: wrap them without constants.
  """
  name = eqn.primitive.name
  if name not in CALL_PRIMITIVES:
    return None
  for key in ("jaxpr", "call_jaxpr"):
    body = eqn.params.get(key)
    if body is None:
      continue
    if isinstance(body, ClosedJaxpr):
      return body
    if isinstance(body, Jaxpr):
      return ClosedJaxpr(body, ())
  return None


def aval_of(x):
  """The abstract value (``ShapedArray``) of an array, tracer or scalar."""
  return jax.typeof(x)


def make_float0_zeros(shape) -> np.ndarray:
  return np.zeros(shape, dtype=float0)


def register_identity_primitive(name: str) -> Primitive:
  """A multiple-results identity primitive: impl, abstract eval, JVP (tangents pass through),
  batching and lowering all return their inputs. Used for markers such as layer boundaries."""
  from jax.interpreters import ad, batching, mlir

  prim = Primitive(name)
  prim.multiple_results = True
  prim.def_impl(lambda *xs: list(xs))
  prim.def_abstract_eval(lambda *avals: list(avals))
  ad.primitive_jvps[prim] = lambda primals, tangents: (prim.bind(*primals), list(tangents))
  batching.primitive_batchers[prim] = lambda args, dims: (prim.bind(*args), list(dims))
  mlir.register_lowering(prim, mlir.lower_fun(lambda *xs: list(xs), multiple_results=True))
  return prim
