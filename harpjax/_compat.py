"""The one place harpjax touches JAX internals.

JAX renames and removes internals between releases; everything harpjax needs beyond the public
API is funnelled through this module and gated on ``jax.__version_info__``. Tested with the
version pinned in ``setup.py``.
"""

from __future__ import annotations

import contextlib
import enum
import os
import sys
import threading
from typing import Any, Iterable

import jax
import jax.extend as jex
import numpy as np

__all__ = [
    "JAX_VERSION", "Primitive", "Literal", "Var", "DropVar", "ClosedJaxpr", "Jaxpr",
    "is_literal", "is_dropvar", "literal_value", "bind_eqn", "eqn_name_stack", "eqn_source_info",
    "describe_source", "mul_eqn", "CALL_PRIMITIVES",
    "REMAT_PRIMITIVES",
    "subjaxpr_of_call", "float0", "aval_of", "make_float0_zeros", "register_identity_primitive",
    "JAX_SETTINGS", "jax_settings", "differing_jax_settings", "apply_jax_settings",
    "setting_env_var", "use_persistent_compilation_cache", "trace_state",
    "flax_param_shape_memo", "threefry_key_words", "threefry2x32", "key_impl_name",
    "draws_by_position", "FUSED_ATTENTION_PRIMITIVES", "fused_attention_layout",
    "fused_attention_causal", "tracing_cudnn_attention",
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


def eqn_source_info(eqn):
  """The equation's source information (kept as is: summarised only for messages)."""
  return getattr(eqn, "source_info", None)


_LIBRARY_DIRS: tuple[str, ...] | None = None


def _library_dirs() -> tuple[str, ...]:
  global _LIBRARY_DIRS
  if _LIBRARY_DIRS is None:
    import importlib
    dirs = []
    for name in ("flax", "optax", "harpjax", "numpy", "jax"):
      try:
        mod = importlib.import_module(name)
      except ImportError:  # pragma: no cover - an optional library
        continue
      dirs.append(os.path.dirname(os.path.abspath(mod.__file__)) + os.sep)
    _LIBRARY_DIRS = tuple(dirs)
  return _LIBRARY_DIRS


def describe_source(source_info) -> str:
  """Where an equation comes from, for messages: the innermost frame outside JAX, Flax, optax
  and harpjax (``model.py:42 (loss_fn)``), with the library frame it went through, if any
  (``model.py:42 (loss_fn), via flax/linen/linear.py:287 (Dense.__call__)``); ``""`` if
  unknown. ``source_info`` may be a sequence of them, innermost first (an equation inlined
  from calls): the first that names a frame wins."""
  from jax._src import source_info_util
  if isinstance(source_info, (tuple, list)):
    for info in source_info:
      got = describe_source(info)
      if got:
        return got
    return ""
  try:
    frames = list(source_info_util.user_frames(source_info.traceback))
  except (AttributeError, TypeError):
    return ""
  libs = _library_dirs()
  fmt = lambda f: f"{_short_path(f.file_name)}:{f.start_line} ({f.function_name})"
  for i, f in enumerate(frames):
    if not os.path.abspath(f.file_name).startswith(libs):
      inner = frames[0] if i > 0 else None
      return fmt(f) + (f", via {fmt(inner)}" if inner is not None else "")
  return fmt(frames[0]) if frames else ""


def _short_path(path: str) -> str:
  parts = os.path.abspath(path).split(os.sep)
  for lib in ("flax", "optax", "harpjax", "numpy", "jax"):
    if lib in parts[:-1]:
      return "/".join(parts[len(parts) - 1 - parts[::-1].index(lib):])
  try:
    rel = os.path.relpath(path)
  except ValueError:  # pragma: no cover - another drive
    return path
  return rel if not rel.startswith("..") else os.path.basename(path)


_MUL = None


def mul_eqn() -> tuple:
  """``(primitive, params)`` of an elementwise multiplication by a scalar, as this JAX version
  writes it in a jaxpr (its parameters change between releases)."""
  global _MUL
  if _MUL is None:
    eqn = jax.make_jaxpr(lambda x: x * np.float32(2))(np.ones((2,), np.float32)).jaxpr.eqns[0]
    _MUL = (eqn.primitive, dict(eqn.params))
  return _MUL


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


# --------------------------------------------------------------------------- threefry by position

_THREEFRY = "threefry2x32"


def key_impl_name(keys) -> str:
  """The name of the PRNG of a typed key array (``"threefry2x32"``, ``"rbg"``,
  ``"unsafe_rbg"``...), traced or not."""
  return str(jax.random.key_impl(keys))


def threefry_key_words(keys):
  """``(k1, k2)``: the two ``uint32`` words of each key of the typed key array ``keys``
  (each of ``keys``' shape), when its PRNG is threefry2x32 and JAX draws its bits by position
  (``jax_threefry_partitionable``, JAX's default since 0.5): the bits of every element of a
  ``random_bits`` draw or a ``random_split`` are then ``threefry2x32`` of the key and the
  element's flat index in the drawn shape (as a 64-bit count, high word first), and nothing
  else. ``None`` for any other PRNG (``rbg``, ``unsafe_rbg``: XLA's ``RngBitGenerator``
  whose output is not a function of position) or with the flag off."""
  if not jax.config.jax_threefry_partitionable:
    return None
  try:
    if key_impl_name(keys) != _THREEFRY:
      return None
  except (TypeError, ValueError):
    return None
  data = jax.random.key_data(keys)
  return data[..., 0], data[..., 1]


def draws_by_position(key_aval) -> bool:
  """Whether keys of the abstract value ``key_aval`` (a typed key array's aval) draw by
  position (:func:`threefry_key_words` would give their words)."""
  impl = getattr(getattr(key_aval, "dtype", None), "_impl", None)
  return bool(jax.config.jax_threefry_partitionable) and getattr(impl, "name", None) == _THREEFRY


def threefry2x32(k1, k2, x1, x2) -> tuple:
  """The threefry2x32 hash of the counter pairs ``(x1, x2)`` (``uint32``, broadcast together
  with the key words ``k1``, ``k2``), as JAX's partitionable ``random_bits`` and
  ``random_split`` apply it (the same primitive, so the same lowering on every backend)."""
  return tuple(jex.random.threefry2x32_p.bind(k1, k2, x1, x2))


JAX_SETTINGS = (
    "jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
    "jax_threefry_partitionable", "jax_numpy_rank_promotion", "jax_numpy_dtype_promotion",
    "jax_softmax_custom_jvp", "jax_dynamic_shapes", "jax_legacy_prng_key",
    "jax_use_shardy_partitioner",
    # Not numerics: where compiled executables are kept (use_persistent_compilation_cache).
    "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
)
"""The JAX settings that change how a step traces, lowers or computes (dtypes, precision,
random bits, promotion rules, partitioner), and the persistent compilation cache's. Another
process running part of a step (a Ray worker) runs under the driver's values. Names this JAX
version does not know are skipped."""

_JAX_MIN_COMPILE_TIME_DEFAULT_S = 1.0


def use_persistent_compilation_cache(path: str | os.PathLike) -> tuple[str, bool]:
  """Turns on JAX's persistent compilation cache in ``path``, unless a cache directory is
  configured already (that one is kept).

  A pipelined step compiles many small executables (a forward and a backward per stage), most
  of them in under JAX's default one-second threshold, so the threshold drops to zero unless
  the user changed it. The settings are process-wide: ``jax.jit`` programs compiled later are
  kept too.

  Returns:
    The directory in effect, and whether this call set it.
  """
  current = jax.config.values.get("jax_compilation_cache_dir")
  if current:
    return str(current), False
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  if jax.config.values.get("jax_persistent_cache_min_compile_time_secs") == \
      _JAX_MIN_COMPILE_TIME_DEFAULT_S:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return path, True


def jax_settings() -> dict[str, Any]:
  """The values of :data:`JAX_SETTINGS` in effect here (in this thread, context managers such
  as ``jax.enable_x64`` included), as plain picklable values (enums by their value)."""
  values = jax.config.values
  return {name: _plain(values[name]) for name in JAX_SETTINGS if name in values}


def differing_jax_settings(settings: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
  """The settings of ``settings`` (from :func:`jax_settings`, maybe in another process) whose
  value here differs: ``{name: (value in settings, value here or None if unknown here)}``."""
  here = jax.config.values
  return {name: (value, _plain(here.get(name))) for name, value in settings.items()
          if name not in here or _plain(here[name]) != value}


def apply_jax_settings(settings: dict[str, Any], keep: Iterable[str] = ()) -> dict[str, str]:
  """Sets ``settings`` (from :func:`jax_settings` in another process) globally in this one,
  except the names in ``keep`` (left as this process has them).

  Returns:
    ``{name: error}`` of the settings ``jax.config.update`` refused (a name this JAX does not
    know, a value it does not accept); see :func:`differing_jax_settings` for what remains.
  """
  keep = frozenset(keep)
  failed = {}
  for name, value in settings.items():
    current = jax.config.values
    if name in keep or (name in current and _plain(current[name]) == value):
      continue
    try:
      jax.config.update(name, value)
    except Exception as e:  # pylint: disable=broad-except  (unknown name, bad value)
      failed[name] = f"{type(e).__name__}: {e}"
  return failed


def setting_env_var(name: str) -> str:
  """The environment variable JAX reads a setting from at import (``JAX_ENABLE_X64``)."""
  return name.upper()


def _plain(value: Any) -> Any:
  return value.value if isinstance(value, enum.Enum) else value


def trace_state():
  """An opaque token of the trace JAX binds operations to here, comparable with ``==``: two
  tokens are equal where operations land in the same jaxpr (a ``jax.jit``, ``lax.scan`` or
  ``jax.checkpoint`` body traced in between has a token of its own)."""
  return jex.core.get_opaque_trace_state()


# --------------------------------------------------------------------------- Flax's shape check
#
# ``flax.core.scope.Scope.param``, given a parameter that exists, evaluates its initializer's
# shape with ``jax.eval_shape(lambda: init_fn(random.key(0), *init_args, **init_kwargs))`` and
# raises ``ScopeParamShapeError`` if the parameter's shape differs. The lambda is new each
# time, so JAX traces the initializer once per parameter and per trace: 772 parameters of
# GPT-15B make 772 traces of a handful of distinct initializers. Within
# :func:`flax_param_shape_memo`, the shape is evaluated once per (initializer, arguments) and
# compared as before.

_FLAX_LOCK = threading.Lock()
_FLAX_ACTIVE = [0, None]          # nesting depth, the module object replaced
_FLAX_MEMO: dict = {}
_FLAX_FREEVARS = ("init_args", "init_fn", "init_kwargs")


def _memo_key(x) -> Any:
  """A key equal only for equal values of equal types (``1``, ``1.0`` and ``True`` differ),
  recursing into tuples, lists (Flax writes some shapes as lists) and dicts; raises
  ``TypeError`` for an unhashable value."""
  if type(x) in (tuple, list):  # pylint: disable=unidiomatic-typecheck  (NamedTuples by type)
    return (type(x), tuple(_memo_key(e) for e in x))
  if type(x) is dict:  # pylint: disable=unidiomatic-typecheck
    return (dict, tuple(sorted(((k, _memo_key(v)) for k, v in x.items()), key=repr)))
  hash(x)
  return (type(x), x)


class _MemoJax:
  """``jax`` as Flax's scope module sees it inside :func:`flax_param_shape_memo`: the same
  module, with ``eval_shape`` of the shape-check lambda answered from the memo."""

  def __init__(self, module, code):
    self._module = module
    self._code = code

  def __getattr__(self, name):
    return getattr(self._module, name)

  def eval_shape(self, fun, *args, **kwargs):
    code = getattr(fun, "__code__", None)
    if code is not self._code or args or kwargs or fun.__closure__ is None:
      return self._module.eval_shape(fun, *args, **kwargs)
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in fun.__closure__)))
    try:
      key = (cells["init_fn"], _memo_key(cells["init_args"]), _memo_key(cells["init_kwargs"]))
      hit = _FLAX_MEMO.get(key)
    except TypeError:   # an unhashable argument: evaluated as Flax does
      return self._module.eval_shape(fun)
    if hit is None:
      hit = self._module.eval_shape(fun)
      _FLAX_MEMO[key] = hit
    return hit


def _flax_shape_check_code():
  """The code object of the shape-check lambda in ``Scope.param``, or ``None`` where this Flax
  version checks otherwise (the memo then stays off)."""
  scope = sys.modules.get("flax.core.scope")
  param = getattr(getattr(scope, "Scope", None), "param", None)
  for const in getattr(getattr(param, "__code__", None), "co_consts", ()):
    if getattr(const, "co_name", None) == "<lambda>" and \
        tuple(sorted(const.co_freevars)) == _FLAX_FREEVARS:
      return scope, const
  return None, None


@contextlib.contextmanager
def flax_param_shape_memo():
  """Within this context, Flax's check that an existing parameter has its initializer's shape
  evaluates each distinct initializer call's shape once.

  The check itself is unchanged: every parameter's shape is still compared with its
  initializer's, and a mismatch still raises ``flax.errors.ScopeParamShapeError``. Only the
  initializer's abstract result is remembered, keyed by the initializer object and its
  arguments (compared by value and type; calls with an unhashable argument are evaluated
  each time). This assumes, as Flax's lazy initialization does, that an initializer's result
  shape depends on its arguments alone. The memo is emptied when the outermost context exits;
  it does nothing if ``flax`` is not imported or checks shapes another way.
  """
  with _FLAX_LOCK:
    if _FLAX_ACTIVE[0] == 0:
      scope, code = _flax_shape_check_code()
      if scope is not None and isinstance(getattr(scope, "jax", None), type(sys)):
        _FLAX_ACTIVE[1] = scope
        scope.jax = _MemoJax(scope.jax, code)
    _FLAX_ACTIVE[0] += 1
  try:
    yield
  finally:
    with _FLAX_LOCK:
      _FLAX_ACTIVE[0] -= 1
      if _FLAX_ACTIVE[0] == 0:
        scope = _FLAX_ACTIVE[1]
        if scope is not None:
          scope.jax = scope.jax._module  # pylint: disable=protected-access
        _FLAX_ACTIVE[1] = None
        _FLAX_MEMO.clear()


# ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (jax 0.10): a ``custom_vjp``
# whose forward and backward each bind one primitive, lowered on CUDA to cuDNN's fused
# (FlashAttention-2 style) kernels. ``implementation=None`` or ``"xla"`` traces to the plain
# composition instead (two ``dot_general`` s and a softmax: no primitive of its own) on every
# backend in this jax version.
FUSED_ATTENTION_PRIMITIVES = frozenset({
    "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper",
    "dot_product_attention_fwd", "dot_product_attention_bwd"})


def fused_attention_layout(params: dict) -> str:
  """``"BTNH"`` or ``"BNTH"``: the operand layout of a fused attention equation."""
  layout = params.get("layout", 0)
  return "BNTH" if int(getattr(layout, "value", layout)) == 1 else "BTNH"


def fused_attention_causal(params: dict) -> bool:
  """Whether a fused attention equation applies a causal mask."""
  mask = params.get("mask_type")
  return "CAUSAL" in str(getattr(mask, "name", mask)).upper()


@contextlib.contextmanager
def tracing_cudnn_attention(cudnn_version: int = 90800):
  """Lets ``jax.nn.dot_product_attention(..., implementation="cudnn")`` be *traced* (jaxpr
  only, e.g. to plan for a GPU cluster from a machine without cuDNN) by answering jax's cuDNN
  version check with ``cudnn_version``. Nothing can be compiled or run this way on a machine
  without cuDNN; shape checks that ask the device (Hopper-only head dims) answer as a pre-Hopper
  GPU would."""
  from jax._src.cudnn import fused_attention_stablehlo as fa   # pylint: disable=g-import-not-at-top
  class _Versions:
    @staticmethod
    def cudnn_get_version():
      return cudnn_version
  before = fa.cuda_versions
  if before is None:
    fa.cuda_versions = _Versions()
  try:
    yield
  finally:
    fa.cuda_versions = before
