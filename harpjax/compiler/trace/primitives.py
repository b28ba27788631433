"""Per-primitive facts: FLOPs, compute-heavy flag, view-ness.

One table keyed by primitive name (:data:`PRIMITIVES`), as JAX keeps its rules in tables keyed
by primitive. Layer construction reads the compute-heavy flag (the paper's "compute-intensive
operators", §5.1) and FLOPs; the profiler and sharding read the view flag (ops that only
re-address their operand: a slice of a stacked parameter is still "the parameter").

Equations that hold sub-jaxprs (``pjit``, ``remat2``/``checkpoint``, ``custom_jvp_call``,
``custom_vjp_call``, ``cond``, ``while``, ``scan``) are costed from their bodies: a ``scan``
costs ``length`` bodies, a ``cond`` its most expensive branch, a ``while`` one trip (the trip
count is unknown statically). A primitive missing from the table is costed as elementwise (one
FLOP per output element) and named once in the log.

A ``random_bits`` draw is costed as XLA's cost analysis counts the hash that produces it
(:func:`random_bits_flops`): threefry is integer arithmetic on counters, tens of operations
per element, which XLA counts as FLOPs. So are the key operations ``random_fold_in`` and
``random_split`` (:func:`random_key_flops`): each new key is one threefry hash (about 42
FLOPs on XLA:CPU), not one operation.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from harpjax import _compat

log = logging.getLogger(__name__)

__all__ = ["PrimitiveInfo", "PRIMITIVES", "ELEMENTWISE", "REDUCTIONS", "FUSES_PRODUCERS",
           "EXPENSIVE",
           "dot_operand_copies", "info", "is_compute_heavy", "is_view", "eqn_flops",
           "eqn_heavy_count", "jaxpr_flops", "jaxpr_heavy_count", "subjaxprs",
           "aval_nbytes", "aval_size", "is_float", "random_bits_flops", "random_key_flops",
           "small_program_flops",
           "XlaFits", "fused_attention_shape", "FUSED_ATTENTION_BWD_FLOPS_FACTOR"]


@dataclasses.dataclass(frozen=True)
class PrimitiveInfo:
  """What harpjax knows about one primitive.

  Attributes:
    flops: ``flops(params, in_avals, out_avals) -> float`` forward FLOPs of one application;
      ``None`` means zero (pure data movement).
    heavy: compute-intensive (matmul, convolution): counts towards the ``z`` threshold of
      repeated-module detection and anchors tensor-parallel sharding.
    view: only re-addresses its first operand (slice, squeeze, reshape...); a view of a
      parameter is treated as that parameter by the profiler and by sharding.
  """
  flops: Callable[[dict, Sequence[Any], Sequence[Any]], float] | None = None
  heavy: bool = False
  view: bool = False


def aval_size(aval) -> int:
  """Number of elements of an abstract value (1 for scalars)."""
  shape = getattr(aval, "shape", ())
  return int(np.prod(shape, dtype=np.int64)) if shape else 1


def aval_nbytes(aval) -> int:
  """Bytes of an abstract value; extended dtypes (PRNG keys) count 8 bytes per element."""
  try:
    item = np.dtype(aval.dtype).itemsize
  except TypeError:
    item = 8
  return aval_size(aval) * item


def is_float(aval) -> bool:
  """Whether an abstract value is floating point (differentiable); ``False`` for PRNG keys."""
  try:
    return bool(jnp.issubdtype(aval.dtype, jnp.inexact))
  except TypeError:   # extended dtypes (PRNG keys)
    return False


def _out_elems(params, ins, outs) -> float:
  return float(sum(aval_size(a) for a in outs))


def _in_elems(params, ins, outs) -> float:
  """One FLOP per input element; none for a reduction over axes of size 1 only (a reshape,
  which XLA simplifies away)."""
  if not ins:
    return 0.0
  axes = params.get("axes")
  shape = tuple(getattr(ins[0], "shape", ()))
  if axes is not None and shape and all(shape[a] == 1 for a in axes):
    return 0.0
  return float(aval_size(ins[0]))


def _reduce_flops(params, ins, outs) -> float:
  """A reduction combines ``n`` elements into each result with ``n - 1`` operations: its input
  elements less its results, as XLA's cost analysis counts it."""
  return max(_in_elems(params, ins, outs) - _out_elems(params, ins, outs), 0.0) \
      if _in_elems(params, ins, outs) else 0.0


def _dot_flops(params, ins, outs) -> float:
  (lhs_c, _), _ = params["dimension_numbers"]
  k = 1
  for d in lhs_c:
    k *= int(ins[0].shape[d])
  return 2.0 * aval_size(outs[0]) * k


def _conv_flops(params, ins, outs) -> float:
  rhs = ins[1]
  dn = params.get("dimension_numbers")
  out_feat_dim = dn.rhs_spec[0] if dn is not None and hasattr(dn, "rhs_spec") else 0
  per_out = aval_size(rhs) / max(int(rhs.shape[out_feat_dim]), 1)
  return 2.0 * aval_size(outs[0]) * per_out


def _sort_flops(params, ins, outs) -> float:
  n = aval_size(ins[0])
  dim = params.get("dimension", -1)
  m = int(ins[0].shape[dim]) if ins[0].shape else 1
  return float(n * max(math.log2(max(m, 2)), 1.0))


def _gather_flops(params, ins, outs) -> float:
  """A gather moves data; in ``FILL_OR_DROP`` mode (jnp's default for indexing) XLA selects
  the fill value for out-of-bounds rows: one select per result element."""
  return _out_elems(params, ins, outs) if "FILL" in str(params.get("mode", "")) else 0.0


def _reduce_window_flops(params, ins, outs) -> float:
  win = params.get("window_dimensions", ())
  return float(aval_size(outs[0]) * int(np.prod(win or (1,))))


class XlaFits:
  """A memo of small numbers read off XLA's cost analysis (the draws' and the keys' FLOPs),
  kept in memory and on disk so a second process does not compile the small programs again.

  The file is ``xla_fits.json`` in ``$HARPJAX_CACHE_DIR`` (or ``~/.cache/harpjax/profiles``,
  the profile cache's directory), one entry per ``(kind, key)`` under the running jax and
  jaxlib versions; a file that cannot be read or written is ignored (the numbers are
  recomputed). Writes replace the file atomically, so concurrent processes lose at most an
  entry, never the file.
  """

  def __init__(self, kind: str):
    self.kind = kind
    self._mem: dict[tuple, tuple[float, float]] = {}

  @staticmethod
  def _path():
    import os
    from pathlib import Path
    root = os.environ.get("HARPJAX_CACHE_DIR")
    return (Path(root) if root else Path("~/.cache/harpjax/profiles").expanduser()) \
        / "xla_fits.json"

  def _disk_key(self, key: tuple) -> str:
    import jaxlib
    return "|".join([self.kind, jax.__version__, getattr(jaxlib, "__version__", "?")]
                    + [str(k) for k in key])

  def get(self, key: tuple, compute) -> tuple[float, float]:
    """The fit of ``key``: memoised, else read from disk, else ``compute()`` (and kept)."""
    fit = self._mem.get(key)
    if fit is not None:
      return fit
    import json
    path, dk = self._path(), self._disk_key(key)
    try:
      stored = json.loads(path.read_text())
    except (OSError, ValueError):
      stored = {}
    got = stored.get(dk) if isinstance(stored, dict) else None
    if (isinstance(got, list) and len(got) == 2
        and all(isinstance(x, (int, float)) and np.isfinite(x) for x in got)):
      fit = (float(got[0]), float(got[1]))
    else:
      fit = tuple(float(x) for x in compute())
      try:
        import os
        import tempfile
        path.parent.mkdir(parents=True, exist_ok=True)
        stored = stored if isinstance(stored, dict) else {}
        stored[dk] = list(fit)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".xla_fits.")
        with os.fdopen(fd, "w") as f:
          json.dump(stored, f)
        os.replace(tmp, path)
      except OSError:
        pass
    self._mem[key] = fit
    return fit


def small_program_flops(fn: Callable, *avals) -> float:
  """FLOPs of ``fn`` at ``avals`` as XLA's cost analysis counts them on the default backend.

  Compiled without the backend's own code optimisation (``xla_backend_optimization_level``
  0: LLVM's passes on XLA:CPU): XLA's HLO passes still run, and the cost analysis reads the
  optimised HLO, so the count is the default compilation's (a test compares them), at a small
  part of its compile time (rolled threefry loops: 0.14 s against 1.1 s for a draw of rank
  4 on XLA:CPU)."""
  lowered = jax.jit(fn).lower(*avals)
  try:
    compiled = lowered.compile(compiler_options={"xla_backend_optimization_level": 0})
  except Exception:  # noqa: BLE001 -- a backend without the option: its default compilation
    compiled = lowered.compile()
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  return float(ca.get("flops", 0.0))


_DRAW_FITS = XlaFits("random_bits")


def random_bits_flops(key_aval, params: dict, parts: float = 1.0) -> float:
  """FLOPs of one ``random_bits`` draw as XLA's cost analysis counts them.

  The draw is lowered to its PRNG's hash (threefry: 20 rounds of add, rotate and xor on a
  pair of 32-bit counters per element, plus the counters' iota over the shape), whose integer
  operations XLA counts as FLOPs. How many depends on the lowering and the backend: XLA:CPU
  rolls threefry's five four-round groups into a ``while`` loop whose body its cost analysis
  counts once (about 45 per element of a 1-D draw), where GPUs unroll them (every round
  counted). The count is affine in the elements for a given key type, bit width and rank (the
  counters' iota adds a multiply-add per dimension), so it is read once off XLA on the default
  backend: ``random_bits`` compiled at two small shapes of that rank gives the per-element
  slope and the fixed part (:func:`small_program_flops`; memoised in memory and on disk,
  :class:`XlaFits`). Falls back to one FLOP per element if the draw cannot be compiled alone.

  Args:
    key_aval: the abstract key operand (a typed PRNG key array).
    params: the equation's parameters (``shape``, ``bit_width``).
    parts: the draw is partitioned into this many equal parts, one per device (a draw split
      with the value it masks): the FLOPs of one part, whose device still sets up the key
      (the fixed part).
  """
  shape = tuple(int(d) for d in params.get("shape", ()))
  bits = int(params.get("bit_width", 32))
  n = int(np.prod(shape, dtype=np.int64)) if shape else 1
  n_keys = aval_size(key_aval)   # a batch of keys draws ``shape`` per key
  rank = len(shape)
  key = (jax.default_backend(), str(getattr(key_aval, "dtype", "")), bits, rank,
         bool(jax.config.jax_threefry_partitionable))
  fit = _DRAW_FITS.get(key, lambda: _fit_draw(key_aval, bits, rank))
  per, fixed = fit
  return float(n_keys * (per * n / parts + fixed))


def _fit_draw(key_aval, bits: int, rank: int) -> tuple[float, float]:
  """``(FLOPs per element, fixed FLOPs)`` of a ``random_bits`` draw of ``rank`` dimensions,
  from XLA's cost analysis of two small draws (see :func:`random_bits_flops`)."""
  dtype = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}.get(bits)
  small, large = ((2,) * (rank - 1) + (64,), (2,) * (rank - 1) + (128,)) if rank else ((), ())
  try:
    key = jax.ShapeDtypeStruct((), key_aval.dtype)

    def flops(shape):
      return small_program_flops(lambda k: jax.random.bits(k, shape, dtype), key)
    if not rank:
      return 0.0, flops(())
    a, b = flops(small), flops(large)
  except Exception as e:  # noqa: BLE001 -- an unusual PRNG: count it as elementwise
    log.info("random_bits of %s (%d bits) cannot be costed by XLA alone (%s); one FLOP per "
             "element", getattr(key_aval, "dtype", "?"), bits, e)
    return 1.0, 0.0
  n_small, n_large = int(np.prod(small)), int(np.prod(large))
  per = (b - a) / (n_large - n_small)
  return per, a - per * n_small


_KEY_FITS = XlaFits("random_key")
_KEY_OPS = frozenset({"random_fold_in", "random_split"})


def random_key_flops(name: str, key_aval, out_avals) -> float:
  """FLOPs of a ``random_fold_in`` or ``random_split`` as XLA's cost analysis counts them.

  Each key the operation makes is one hash of the PRNG (threefry: twenty rounds of add,
  rotate and xor on two 32-bit words), which XLA counts as integer FLOPs (42 per key on
  XLA:CPU, 11 more to set up a ``fold_in``; ``split`` 44 per key and 13), not one per
  element. The count is affine in the keys made, for a given key type and backend, so it is
  read once off XLA like :func:`random_bits_flops` (two small compilations, memoised); one
  FLOP per key if the operation cannot be compiled alone.

  Args:
    name: ``"random_fold_in"`` or ``"random_split"``.
    key_aval: the abstract key operand (a typed PRNG key array).
    out_avals: the abstract results (the new keys).
  """
  n_out = float(sum(aval_size(a) for a in out_avals))
  key = (jax.default_backend(), name, str(getattr(key_aval, "dtype", "")),
         bool(jax.config.jax_threefry_partitionable))
  fit = _KEY_FITS.get(key, lambda: _fit_key_op(name, key_aval))
  per, fixed = fit
  return per * n_out + fixed


def _fit_key_op(name: str, key_aval) -> tuple[float, float]:
  """``(FLOPs per key made, fixed FLOPs)`` of a key operation, from XLA's cost analysis of the
  operation making one and two keys (``fold_in``) or two and four (``split``)."""
  try:
    dtype = key_aval.dtype

    def flops(fn, shape):
      return small_program_flops(fn, jax.ShapeDtypeStruct(shape, dtype))
    if name == "random_fold_in":
      fold = jax.vmap(lambda k: jax.random.fold_in(k, 7))
      (n_a, a), (n_b, b) = (1, flops(fold, (1,))), (2, flops(fold, (2,)))
    else:
      (n_a, a), (n_b, b) = ((n, flops(lambda k, n=n: jax.random.split(k, n), ()))
                            for n in (2, 4))
  except Exception as e:  # noqa: BLE001 -- an unusual PRNG: one FLOP per key
    log.info("%s of %s cannot be costed by XLA alone (%s); one FLOP per key", name,
             getattr(key_aval, "dtype", "?"), e)
    return 1.0, 0.0
  per = (b - a) / (n_b - n_a)
  return per, a - per * n_a


PRIMITIVES: dict[str, PrimitiveInfo] = {}
"""Primitive name -> :class:`PrimitiveInfo`."""


def _register(names: Iterable[str], **kw) -> None:
  for n in names:
    PRIMITIVES[n] = PrimitiveInfo(**kw)


_register(["dot_general", "ragged_dot", "ragged_dot_general"], flops=_dot_flops, heavy=True)
_register(["conv_general_dilated"], flops=_conv_flops, heavy=True)


def fused_attention_shape(name: str, params: dict, in_avals: Sequence[Any]) -> tuple:
  """``(batch, heads, q_len, kv_len, head_dim, kept_pairs_per_head)`` of a fused attention
  call (:data:`_compat.FUSED_ATTENTION_PRIMITIVES`): query ``[B, T, N, H]`` (``[B, N, T, H]``
  in the BNTH layout), key/value ``[B, S, K, H]``; ``kept_pairs`` is ``T * S``, or
  ``T (T + 1) / 2`` under a causal mask with ``T == S`` (the kernel skips the masked blocks;
  ``T * S - T (T - 1) / 2`` for ``T != S``)."""
  q, k = in_avals[0].shape, in_avals[1].shape
  if _compat.fused_attention_layout(params) == "BNTH":
    b, n, t, h = q
    s = k[2]
  else:
    b, t, n, h = q
    s = k[1]
  pairs = float(t) * s
  if _compat.fused_attention_causal(params):
    pairs -= t * (t - 1) / 2.0
  return int(b), int(n), int(t), int(s), int(h), max(pairs, 0.0)


FUSED_ATTENTION_BWD_FLOPS_FACTOR = 2.5
"""A fused attention's backward does 2.5x its forward's FLOPs: it recomputes the scores
``Q K^T`` and computes ``dV = P^T dO``, ``dP = dO V^T``, ``dQ = dS K``, ``dK = dS^T Q``
(FlashAttention-2, §3.1.2): five matmuls of the forward's two."""


def _fused_attention_flops(name: str):
  def flops(params, in_avals, out_avals):
    b, n, _, _, h, pairs = fused_attention_shape(name, params, in_avals)
    fwd = 4.0 * b * n * pairs * h      # Q K^T and P V, 2 FLOPs per multiply-add
    return fwd * (FUSED_ATTENTION_BWD_FLOPS_FACTOR if "bwd" in name else 1.0)
  return flops


for _name in _compat.FUSED_ATTENTION_PRIMITIVES:
  _register([_name], flops=_fused_attention_flops(_name), heavy=True)
ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "rem", "pow", "max", "min", "neg", "sign", "floor", "ceil",
    "round", "is_finite", "abs", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
    "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh",
    "atanh", "sqrt", "rsqrt", "cbrt", "square", "integer_pow", "erf", "erfc", "erf_inv",
    "lgamma", "digamma", "igamma", "igammac", "bessel_i0e", "bessel_i1e", "nextafter",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "select_n", "clamp",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count", "clz",
    "add_any", "add_jaxvals", "conj", "real", "imag", "complex", "reduce_precision",
    "random_fold_in", "threefry2x32", "polygamma", "zeta", "regularized_incomplete_beta",
    "random_gamma",
})
"""Arithmetic applied element by element (operands of one shape, or scalars)."""

REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin", "reduce",
})
"""Reductions over axes (XLA fuses elementwise producers into them)."""

FUSES_PRODUCERS = ELEMENTWISE | REDUCTIONS

EXPENSIVE = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh", "tan", "sin", "cos", "asin",
    "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt",
    "cbrt", "pow", "erf", "erfc", "erf_inv", "lgamma", "digamma", "igamma", "igammac",
    "bessel_i0e", "bessel_i1e", "polygamma", "zeta", "regularized_incomplete_beta",
    "random_gamma", "threefry2x32", "random_fold_in",
})
"""Elementwise ops XLA's fusion does not duplicate into several consumers (transcendentals:
XLA's ``InstructionFusion::IsExpensive``); the other elementwise ops it recomputes inside every
fusion that reads them."""
"""Ops XLA computes their elementwise operands inside of (loop and input fusion): an
elementwise result read by these alone is never written to memory."""

_register(sorted((ELEMENTWISE - _KEY_OPS) | {"rng_uniform", "rng_bit_generator"}),
          flops=_out_elems)   # one FLOP per output element
_register([  # reductions: one FLOP per element combined into a result
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "reduce",
], flops=_reduce_flops)
_register([  # arg-reductions and scans over an axis: one FLOP per input element
    "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "top_k",
    "approx_top_k",
], flops=_in_elems)
_register(["random_bits"], flops=lambda p, i, o: random_bits_flops(i[0], p))
for _name in sorted(_KEY_OPS):
  _register([_name], flops=lambda p, i, o, _name=_name: random_key_flops(_name, i[0], o))
_register(["sort"], flops=_sort_flops)
_register(["reduce_window", "reduce_window_sum", "reduce_window_max", "reduce_window_min",
           "select_and_scatter_add", "select_and_gather_add", "select_and_scatter"],
          flops=_reduce_window_flops)
_register(["scatter-add", "scatter-mul", "scatter-min", "scatter-max",   # JAX's names
           "scatter_add", "scatter_mul", "scatter_min", "scatter_max"],
          flops=lambda p, i, o: float(aval_size(i[2])) if len(i) > 2 else 0.0)
_register(["gather"], flops=_gather_flops)
_register(["slice", "dynamic_slice", "squeeze", "reshape"], view=True)


def _convert_flops(params, ins, outs) -> float:
  """XLA counts a conversion between two types as one FLOP per element (a bit cast too);
  one that keeps the type (a weak type made strong) is no op at all."""
  if ins and outs and np.dtype(ins[0].dtype) == np.dtype(outs[0].dtype):
    return 0.0
  return _out_elems(params, ins, outs)


_register(["convert_element_type", "bitcast_convert_type"], flops=_convert_flops)
_register(["stop_gradient", "optimization_barrier", "name",
           "sharding_constraint", "device_put", "copy", "copy_p", "random_wrap", "random_unwrap",
           "harpjax_layer_boundary"])
_register([  # data movement: no FLOPs, bytes moved
    "broadcast_in_dim", "transpose", "concatenate", "pad", "scatter",
    "dynamic_update_slice", "iota", "rev", "select_and_scatter_add",
    "split", "stack", "random_seed", "empty", "tie_in", "axis_index", "create_token",
    "after_all",
])
# Collectives inside the forward (rare outside shard_map); costed as data movement.
_register(["psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "reduce_scatter",
           "psum_scatter", "ragged_all_to_all"])

_warned: set[str] = set()


def info(name: str) -> PrimitiveInfo:
  """The table entry of primitive ``name``; elementwise (with one log line) when unknown."""
  got = PRIMITIVES.get(name)
  if got is None:
    if name not in _warned:
      _warned.add(name)
      log.info("primitive %r is not in harpjax's primitive table; costing it as elementwise",
               name)
    return _UNKNOWN
  return got


_UNKNOWN = PrimitiveInfo(flops=_out_elems)


def is_compute_heavy(name: str) -> bool:
  """Whether primitive ``name`` is compute-intensive (matmul, convolution)."""
  e = PRIMITIVES.get(name)
  return bool(e and e.heavy)


def is_view(name: str) -> bool:
  """Whether primitive ``name`` only re-addresses its first operand."""
  e = PRIMITIVES.get(name)
  return bool(e and e.view)


# --------------------------------------------------------------------------- sub-jaxprs


_COMBINERS = frozenset({"update_jaxpr", "select_jaxpr", "scatter_jaxpr"})
"""Parameters holding a scalar combiner (a scatter's update, a windowed select), not a body
the equation runs."""


def subjaxprs(params: dict) -> list[tuple[str, Any]]:
  """``(param name, Jaxpr)`` pairs of the bodies an equation holds (closed ones unwrapped);
  a scatter's scalar combiner is not one."""
  out = []
  for k, v in params.items():
    if k in _COMBINERS:
      continue
    for item in (v if isinstance(v, (tuple, list)) else (v,)):
      if isinstance(item, _compat.ClosedJaxpr):
        out.append((k, item.jaxpr))
      elif isinstance(item, _compat.Jaxpr):
        out.append((k, item))
  return out


def _combine(name: str, params: dict, per_body: Callable[[Any], float]) -> float | None:
  """Cost of a sub-jaxpr equation from its bodies, or ``None`` if it has none."""
  bodies = subjaxprs(params)
  if not bodies:
    return None
  if name == "scan":
    return float(params.get("length", 1)) * sum(per_body(j) for k, j in bodies if k == "jaxpr")
  if name == "cond":
    return max((per_body(j) for k, j in bodies if k == "branches"), default=0.0)
  if name == "while":
    return sum(per_body(j) for k, j in bodies if k in ("body_jaxpr", "cond_jaxpr"))
  # Call-like (pjit, remat2, checkpoint, custom_jvp_call, custom_vjp_call, closed_call...):
  # the primal body only (``jvp_jaxpr_fun``/``fwd_jaxpr_thunk``/``bwd`` are not jaxprs here).
  keys = [k for k, _ in bodies]
  main = "call_jaxpr" if "call_jaxpr" in keys else ("jaxpr" if "jaxpr" in keys else keys[0])
  return sum(per_body(j) for k, j in bodies if k == main)


_flops_memo: dict[int, tuple[Any, float]] = {}
_heavy_memo: dict[int, tuple[Any, int]] = {}


def jaxpr_flops(jaxpr) -> float:
  """Forward FLOPs of a ``Jaxpr`` (memoised by identity)."""
  hit = _flops_memo.get(id(jaxpr))
  if hit is not None and hit[0] is jaxpr:
    return hit[1]
  total = 0.0
  for e in jaxpr.eqns:
    total += eqn_flops(e.primitive.name, e.params, [v.aval for v in e.invars],
                       [v.aval for v in e.outvars])
  _flops_memo[id(jaxpr)] = (jaxpr, total)
  return total


def jaxpr_heavy_count(jaxpr) -> int:
  """Number of compute-heavy equations in a ``Jaxpr``, bodies included (scan: times length)."""
  hit = _heavy_memo.get(id(jaxpr))
  if hit is not None and hit[0] is jaxpr:
    return hit[1]
  total = sum(eqn_heavy_count(e.primitive.name, e.params) for e in jaxpr.eqns)
  _heavy_memo[id(jaxpr)] = (jaxpr, total)
  return total


def eqn_flops(name: str, params: dict, in_avals: Sequence[Any], out_avals: Sequence[Any]
              ) -> float:
  """Forward FLOPs of one equation.

  Args:
    name: primitive name.
    params: the equation's parameters.
    in_avals: operand abstract values (literals included).
    out_avals: result abstract values.
  """
  nested = _combine(name, params, jaxpr_flops)
  if nested is not None:
    return nested
  e = info(name)
  if e.flops is None:
    return 0.0
  try:
    return float(e.flops(params, in_avals, out_avals))
  except (KeyError, IndexError, AttributeError, TypeError, ValueError):
    return _out_elems(params, in_avals, out_avals)


def dot_operand_copies(params: dict, in_avals: Sequence[Any]) -> tuple[bool, bool]:
  """Which operands of a ``dot_general`` XLA copies into the order its matmul reads:
  ``(lhs, rhs)``.

  XLA multiplies ``[batch, rows, k] x [batch, k, cols]`` matrices: it copies an operand whose
  batch dimensions do not lead, in order (``bshd,bthd->bhst`` copies both), or whose
  contracting dimensions do not sit where the matmul reads them (last for the left operand,
  right after the batch for the right one) unless it is a single matrix per batch element (one
  free and one contracting dimension: read transposed, no copy). A weight gradient contracting
  over batch and sequence (``bsk,bsn->kn``) copies its left operand.
  """
  (contracting, batch) = params["dimension_numbers"]
  out = []
  for side, aval in enumerate(in_avals[:2]):
    rank = len(getattr(aval, "shape", ()))
    b, c = tuple(batch[side]), tuple(contracting[side])
    if b != tuple(range(len(b))):
      out.append(True)
      continue
    rest = rank - len(b)
    want = (tuple(range(rank - len(c), rank)) if side == 0
            else tuple(range(len(b), len(b) + len(c))))
    out.append(c != want and rest > 2)
  return out[0], out[1]


def eqn_heavy_count(name: str, params: dict) -> int:
  """Compute-heavy equations in one equation (1 or 0, or its bodies' count)."""
  nested = _combine(name, params, jaxpr_heavy_count)
  if nested is not None:
    return int(nested)
  return 1 if is_compute_heavy(name) else 0
