"""Random draws per microbatch that are exactly the slice of the full batch's draws.

A microbatch traced on its own draws random bits of the microbatch's shape, which are not the
rows ``jax.jit`` of the whole step gives it (threefry numbers depend on the shape drawn). Every
equation that creates a batch-sized value from batch-independent inputs (random bits, an iota
over the batch) is therefore found by comparing the full-batch trace with the microbatch trace
equation by equation, and replaced when a stage runs by the microbatch's slice of the full
batch's value (:class:`Redraw`, :func:`redraw_slice`). Only that slice is computed wherever the
value is a function of position: with threefry keys (JAX's default PRNG, drawn by position
under ``jax_threefry_partitionable``, on by default) every element's bits are the hash of the
key and the element's flat index in the full shape, so a microbatch hashes its own elements'
counters (offset by its first row, a traced value) and a data-parallel replica, whose program
is given the index of its first row, its own rows: ``1 / B`` of the full draw's work and
memory per microbatch, ``1 / (B dp)`` per replica, bit for bit the full draw's slice. An
``iota`` gives the slice's positions. Keys of the ``rbg`` and ``unsafe_rbg`` PRNGs draw with
XLA's ``RngBitGenerator``, whose bits depend on the whole shape: their full draw is made and
sliced, as is ``rng_bit_generator``'s and ``rng_uniform``'s.

An ``iota`` over the batch is redrawn only where its numbers are used as data (per-example
positions feeding arithmetic or random keys: ``jax.jit``'s values are the full batch's
positions). Where they only index (``x[jnp.arange(n), labels]``, the labels of an in-batch
similarity matrix, a one-hot over the batch) they are the microbatch's own positions, which
index the microbatch's own rows (:func:`index_iotas`).

Draws inside sub-jaxprs are found the same way, recursively (:class:`Inside`): a ``scan``,
``while`` or ``cond`` body, a ``jit`` or ``jax.checkpoint`` body that was not inlined. Such an
equation is re-issued through the public API (``lax.scan``, ``lax.while_loop``,
``lax.switch``, ``jax.checkpoint``, an inlined ``jit``) with bodies that redraw, so its
semantics, rematerialisation included, stay those of the traced program.

The bodies of ``custom_jvp``/``custom_vjp`` functions cannot be re-issued without their rules:
a batch-sized draw inside one is reported with a warning naming the op and module, and the
typed PRNG keys entering it are folded with the microbatch index, so microbatches draw
independent (not ``jax.jit``'s) numbers.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from harpjax import _compat
from harpjax.compiler.trace import primitives
from harpjax.compiler.trace.program import Lit, Program
from harpjax.errors import TraceError

log = logging.getLogger(__name__)

__all__ = ["Redraw", "Inside", "regen_sites", "apply_site", "split_axis", "REGEN_PRIMITIVES",
           "RANDOM_PRIMITIVES", "index_iotas", "eqn_items", "redraw_slice", "position_counters"]

REGEN_PRIMITIVES = frozenset({"random_bits", "random_split", "iota", "rng_bit_generator",
                              "rng_uniform"})
"""Primitives that can create a batch-sized value from batch-independent inputs."""

RANDOM_PRIMITIVES = frozenset({"random_bits", "random_split", "rng_bit_generator",
                               "rng_uniform"})

_REISSUED = frozenset({"scan", "while", "cond", "jit", "pjit", "closed_call", "core_call"}) \
    | _compat.REMAT_PRIMITIVES


@dataclasses.dataclass(frozen=True)
class Redraw:
  """The microbatch's slice along ``axis`` of the equation drawn at the full batch's shape
  (``full_params``): :func:`redraw_slice`."""
  axis: int
  full_params: dict


@dataclasses.dataclass(frozen=True)
class Inside:
  """A higher-order equation whose bodies hold draws to redraw.

  Attributes:
    bodies: ``{(param name, position): {equation index: site}}`` per sub-jaxpr.
    where: the equation's primitive and module path, for messages.
  """
  bodies: dict
  where: str = ""


def regen_sites(full: Program, mb: Program, num_microbatches: int) -> tuple[dict, bool]:
  """The equations of ``mb`` to redraw, from its comparison with ``full``.

  Args:
    full: the region traced at full batch.
    mb: the same region traced at microbatch size (op for op the same, unless the step's
      structure depends on the batch size).
    num_microbatches: B (or, for a program of a part of a microbatch, the full batch's rows
      over the program's, a :class:`fractions.Fraction`).

  Returns:
    ``({op index: Redraw | Inside}, exact)``; ``exact`` is false when the two programs do not
    correspond op for op and the program draws random numbers (the draws then cannot be
    aligned; see :func:`harpjax.compiler.stages.stage_functions` for the fallback).
  """
  if len(full.ops) != len(mb.ops) or any(a.name != b.name for a, b in zip(full.ops, mb.ops)):
    return {}, not any(_draws(op.name, op.params) for op in mb.ops)
  sites = {}
  local = index_iotas([(op.name, op.params, tuple(op.invars), op.outvars) for op in mb.ops],
                      mb.outvars, _batch_iotas(full, mb))
  for fo, mo in zip(full.ops, mb.ops):
    if mo.index in local:
      continue
    site = _site(mo.name, fo.params, mo.params,
                 [_aval(full, a) for a in fo.invars], [_aval(mb, b) for b in mo.invars],
                 [full.avals[o] if o >= 0 else None for o in fo.outvars],
                 [mb.avals[o] if o >= 0 else None for o in mo.outvars],
                 num_microbatches, f"{mo.name} in {mo.name_stack or 'the top level'}")
    if site is not None:
      sites[mo.index] = site
  return sites, True


def _batch_iotas(full: Program, mb: Program) -> set:
  """Positions of the iotas whose shape follows the batch."""
  return {fo.index for fo, mo in zip(full.ops, mb.ops) if fo.name == "iota"
          and full.avals[fo.outvars[0]].shape != mb.avals[mo.outvars[0]].shape}


def _aval(program: Program, ref):
  if isinstance(ref, Lit):
    return _compat.aval_of(ref.value)
  return program.avals[ref]


def _draws(name: str, params: dict) -> bool:
  """Whether an equation draws random numbers, in its bodies included."""
  if name in RANDOM_PRIMITIVES:
    return True
  return any(_draws(e.primitive.name, e.params)
             for _, body in primitives.subjaxprs(params) for e in body.eqns)


def _site(name, fparams, mparams, fin, min_, fout, mout, B, where):
  if name in REGEN_PRIMITIVES:
    same_in = all(a.shape == b.shape for a, b in zip(fin, min_))
    fa, ma = fout[0], mout[0]
    if fa is None or ma is None or not same_in or fa.shape == ma.shape:
      return None
    axis = split_axis(fa.shape, ma.shape, B)
    if axis is None:
      raise TraceError(f"{where} produces {fa.shape} for the batch but {ma.shape} for a "
                       "microbatch; harpjax cannot slice it")
    return Redraw(axis, dict(fparams))
  fbodies = _bodies(fparams)
  if not fbodies:
    return None
  mbodies = _bodies(mparams)
  if list(fbodies) != list(mbodies):
    if _draws(name, mparams):
      log.warning("%s has different bodies for the batch and for a microbatch; its random "
                  "numbers are not aligned with jax.jit's", where)
    return None
  inside = {}
  for key, fb in fbodies.items():
    sub = _body_sites(fb, mbodies[key], B, where)
    if sub:
      inside[key] = sub
  return Inside(inside, where) if inside else None


def _bodies(params: dict) -> dict:
  out, count = {}, {}
  for k, body in primitives.subjaxprs(params):
    i = count.get(k, 0)
    count[k] = i + 1
    out[(k, i)] = body
  return out


def _body_sites(full_jaxpr, mb_jaxpr, B, where) -> dict:
  fe, me = full_jaxpr.eqns, mb_jaxpr.eqns
  if len(fe) != len(me) or any(a.primitive is not b.primitive for a, b in zip(fe, me)):
    if any(_draws(e.primitive.name, e.params) for e in me):
      log.warning("the body of %s differs between the batch and a microbatch; its random "
                  "numbers are not aligned with jax.jit's", where)
    return {}
  out = {}
  local = index_iotas(eqn_items(me), tuple(mb_jaxpr.outvars))
  for i, (f, m) in enumerate(zip(fe, me)):
    if i in local:
      continue
    stack = _compat.eqn_name_stack(m)
    site = _site(m.primitive.name, f.params, m.params, [v.aval for v in f.invars],
                 [v.aval for v in m.invars],
                 [None if _compat.is_dropvar(v) else v.aval for v in f.outvars],
                 [None if _compat.is_dropvar(v) else v.aval for v in m.outvars], B,
                 f"{m.primitive.name} in {stack or where}")
    if site is not None:
      out[i] = site
  return out


# --------------------------------------------------------------------------- iota: index or data

_PASS = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type",
                   "transpose", "copy", "copy_p", "concatenate", "select_n"})
"""Ops an index passes through unchanged in meaning."""
_PASS_WITH_LITERALS = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "add", "sub", "mul", "rem",
                                 "div", "clamp", "max", "min", "neg", "sign", "abs", "and",
                                 "or", "not"})
"""Ops an index passes through when its other operands are literals (the normalisation of
negative indices ``where(i < 0, i + n, i)``, shifted positions ``(i + n) % (2 * n)``)."""
_INDEX_OPERANDS = {"gather": (1,), "dynamic_slice": None, "dynamic_update_slice": None,
                   "scatter": (1,), "scatter-add": (1,), "scatter-mul": (1,),
                   "scatter-min": (1,), "scatter-max": (1,), "scatter_add": (1,),
                   "scatter_mul": (1,), "scatter_min": (1,), "scatter_max": (1,)}
"""Primitive -> operand positions that are indices (``None``: every operand after the first, or
after the first two for ``dynamic_update_slice``)."""
_CALLS = _compat.CALL_PRIMITIVES | {"custom_jvp_call", "custom_vjp_call"}


def _is_index_operand(name: str, pos: int) -> bool:
  if name not in _INDEX_OPERANDS:
    return False
  where = _INDEX_OPERANDS[name]
  if where is None:
    return pos >= (2 if name == "dynamic_update_slice" else 1)
  return pos in where


def eqn_items(eqns) -> list:
  """A jaxpr's equations as ``(name, params, operands, results)`` (literals as ``Lit``)."""
  lit = lambda v: Lit(_compat.literal_value(v)) if _compat.is_literal(v) else v
  return [(e.primitive.name, e.params, tuple(lit(v) for v in e.invars),
           tuple(None if _compat.is_dropvar(v) else v for v in e.outvars)) for e in eqns]


def index_iotas(items, outvars, candidates=None) -> frozenset:
  """Positions of the ``iota`` equations among ``items`` whose values are only ever used as
  indices: operands of the index of a gather, scatter or dynamic slice, or compared for
  equality with another array (a one-hot), possibly through reshapes, broadcasts,
  concatenations, conversions and integer arithmetic with constants (the normalisation of
  negative indices, shifted positions), and through the bodies of nested calls. Such an iota
  over the batch stays the microbatch's own (its positions index the microbatch's rows); any
  other use makes it data (redrawn at full size and sliced).

  Args:
    items: ``(primitive name, params, operands, results)`` per equation (operands may be
      :class:`Lit`; results ``None`` or negative where dropped).
    outvars: the level's outputs (a use as data).
    candidates: the positions to consider (``None``: every iota).
  """
  if candidates is not None and not candidates:
    return frozenset()
  uses = _uses(items)
  static = _static_values(items)
  outs = {v for v in outvars if not isinstance(v, Lit)}
  out = set()
  for i, (name, _, _, res) in enumerate(items):
    if name == "iota" and (candidates is None or i in candidates):
      reach = _reach(items[i + 1:], res[0])
      if _only_indexes(items, uses, outs, static, reach, res[0], set()):
        out.add(i)
  return frozenset(out)


def _uses(items) -> dict:
  uses: dict = {}
  for i, (_, _, ins, _) in enumerate(items):
    for p, v in enumerate(ins):
      if not isinstance(v, Lit):
        uses.setdefault(v, []).append((i, p))
  return uses


def _static_values(items) -> set:
  """Values computed from literals alone."""
  static: set = set()
  for name, _, ins, res in items:
    if name != "iota" and all(isinstance(v, Lit) or v in static for v in ins):
      static.update(r for r in res if r is not None)
  return static


def _reach(items, start) -> set:
  """Values of ``items`` that depend on ``start`` (``start`` included)."""
  reached = {start}
  for _, _, ins, res in items:
    if any(not isinstance(v, Lit) and v in reached for v in ins):
      reached.update(r for r in res if r is not None)
  return reached


def _only_indexes(items, uses, outs, static, reach, value, seen) -> bool:
  if value is None or (isinstance(value, int) and value < 0):
    return True
  if value in outs:
    return False
  for i, p in uses.get(value, ()):
    if (i, p) in seen:
      continue
    seen.add((i, p))
    name, params, ins, res = items[i]
    if _is_index_operand(name, p):
      continue
    others = [v for k, v in enumerate(ins) if k != p]
    constant = all(isinstance(v, Lit) or v in static or v in reach for v in others)
    if name in ("eq", "ne") and not constant:
      continue
    if name in _PASS or (name in _PASS_WITH_LITERALS and constant):
      if all(_only_indexes(items, uses, outs, static, reach, r, seen) for r in res):
        continue
      return False
    if name in _CALLS:
      body = _call_body(params)
      if body is None or p >= len(body.invars):
        return False
      inner = eqn_items(body.eqns)
      start = body.invars[p]
      reached = _reach(inner, start)
      if not _only_indexes(inner, _uses(inner), set(), _static_values(inner), reached, start,
                           set()):
        return False
      # What the body returns of the index is an index again, outside.
      for k, bo in enumerate(body.outvars):
        if bo in reached and k < len(res) and not _only_indexes(items, uses, outs, static,
                                                               reach, res[k], seen):
          return False
      continue
    return False
  return True


def _call_body(params):
  for key in ("jaxpr", "call_jaxpr"):
    body = params.get(key)
    if isinstance(body, _compat.ClosedJaxpr):
      return body.jaxpr
    if isinstance(body, _compat.Jaxpr):
      return body
  return None


def split_axis(full, mb, B):
  """The one axis along which shape ``full`` is ``B`` times shape ``mb``, or ``None`` (``B``
  an integer or a :class:`fractions.Fraction`)."""
  if len(full) != len(mb):
    return None
  diff = [i for i, (a, b) in enumerate(zip(full, mb)) if a != b]
  if len(diff) == 1 and full[diff[0]] == B * mb[diff[0]]:
    return diff[0]
  return None


# --------------------------------------------------------------------------- a slice drawn alone

_UINTS = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}


def redraw_slice(primitive, site: Redraw, invals: list, out_avals, mb_index,
                 rows: int | None = None) -> list:
  """The results of one equation at the full batch's shape (``site.full_params``), of which
  only the microbatch's (or the replica's) elements along ``site.axis`` are computed, where
  the equation's values are a function of position:

  * ``random_bits`` and ``random_split`` of threefry2x32 keys drawn by position
    (``jax_threefry_partitionable``, :func:`~harpjax._compat.threefry_key_words`): the hash
    of the slice's own counters (its elements' flat indices in the full shape), combined as
    JAX's partitionable draw combines the hash's two words (``bits1 ^ bits2``, truncated to 8
    or 16 bits; ``bits1 << 32 | bits2`` for 64), so bit for bit the full draw's slice while
    hashing ``1 / B`` of it;
  * ``iota``: the slice's positions.

  Elsewhere (keys of the ``rbg`` and ``unsafe_rbg`` PRNGs, whose bits come from XLA's
  ``RngBitGenerator`` and depend on the whole shape drawn; ``rng_bit_generator``,
  ``rng_uniform``; threefry with ``jax_threefry_partitionable`` off; a key array split along
  the draw's axis) the full shape is drawn and the slice taken with a ``dynamic_slice``.

  Args:
    primitive: the equation's primitive.
    site: its :class:`Redraw`.
    invals: its operands.
    out_avals: its results' avals at the program's (microbatch's) size.
    mb_index / rows: as in :func:`apply_site`: the slice starts at ``mb_index * size`` along
      the axis, or at ``mb_index * (size // rows)`` (``mb_index`` the first row) with ``rows``.
  """
  name, params, axis = primitive.name, site.full_params, site.axis
  start_of = lambda size: mb_index * size if rows is None else mb_index * (size // rows)
  size = out_avals[0].shape[axis]
  if name == "iota":
    return [_iota_slice(params, axis, start_of(size), size)]
  if name in ("random_bits", "random_split"):
    keys = invals[0]
    words = _compat.threefry_key_words(keys)
    nk = len(keys.shape)
    if words is not None and axis >= nk:
      return [_threefry_slice(name, params, keys, words, axis - nk, start_of(size), size)]
  full = _compat.bind_eqn(primitive, params, invals)
  return [lax.dynamic_slice_in_dim(x, start_of(a.shape[axis]), a.shape[axis], axis)
          for x, a in zip(full, out_avals)]


def _iota_slice(params: dict, axis: int, start, size: int):
  shape = tuple(int(d) for d in params["shape"])
  dim, dtype = int(params["dimension"]), params["dtype"]
  local = shape[:axis] + (size,) + shape[axis + 1:]
  out = lax.broadcasted_iota(dtype, local, dim)
  return out + lax.convert_element_type(start, dtype) if dim == axis else out


def _threefry_slice(name: str, params: dict, keys, words, axis: int, start, size: int):
  """``random_bits`` / ``random_split`` of threefry keys at ``params['shape']``, the elements
  ``start .. start + size`` along ``axis`` of that shape only (each key of a key array
  draws that slice of its own)."""
  full = tuple(int(d) for d in params["shape"])
  local = full[:axis] + (size,) + full[axis + 1:]
  hi, lo = position_counters(full, axis, start, size)
  k1, k2 = words
  kshape = tuple(keys.shape)
  if kshape:   # a key array: each key draws ``shape``; its dimensions lead
    out = kshape + local
    lead, trail = tuple(range(len(kshape))), tuple(range(len(kshape), len(out)))
    k1, k2 = (lax.broadcast_in_dim(k, out, lead) for k in (k1, k2))
    hi, lo = (lax.broadcast_in_dim(c, out, trail) for c in (hi, lo))
  b1, b2 = _compat.threefry2x32(k1, k2, hi, lo)
  if name == "random_split":
    return jax.random.wrap_key_data(jnp.stack([b1, b2], axis=b1.ndim),
                                    impl=_compat.key_impl_name(keys))
  bits = int(params["bit_width"])
  dtype = _UINTS[bits]
  if bits == 64:
    b1, b2 = lax.convert_element_type(b1, dtype), lax.convert_element_type(b2, dtype)
    return lax.shift_left(b1, jnp.asarray(32, dtype)) | b2
  if bits == 32:
    return b1 ^ b2
  return lax.convert_element_type(b1 ^ b2, dtype)


def position_counters(shape: tuple, axis: int, start, size: int) -> tuple:
  """``(hi, lo)``: the ``uint32`` high and low words of the flat (row-major) index in
  ``shape`` of every element of its slice ``start .. start + size`` along ``axis`` (arrays of
  the slice's shape; ``start`` may be traced), as JAX's ``iota_2x32_shape`` gives them for the
  whole shape. Below 2**32 elements the high word is zero and the low word one multiply-add
  per dimension; above, 64-bit arithmetic on pairs of 32-bit words."""
  local = tuple(shape[:axis]) + (size,) + tuple(shape[axis + 1:])
  strides = [int(np.prod(shape[d + 1:], dtype=object)) for d in range(len(shape))]
  u32 = np.uint32
  first = lax.convert_element_type(start, u32)
  if int(np.prod(shape, dtype=object)) <= 2 ** 32:
    lo = jnp.zeros(local, u32) + first * u32(strides[axis]) if local else first
    for d, n in enumerate(local):
      if n > 1:
        lo = lo + lax.broadcasted_iota(u32, local, d) * u32(strides[d])
    return jnp.zeros(local, u32), lo
  hi, lo = _mul_wide(first, strides[axis])
  hi, lo = jnp.broadcast_to(hi, local), jnp.broadcast_to(lo, local)
  for d, n in enumerate(local):
    if n > 1:
      hi, lo = _add_wide((hi, lo), _mul_wide(lax.broadcasted_iota(u32, local, d), strides[d]))
  return hi, lo


def _mul_wide(x, c: int) -> tuple:
  """``(hi, lo)`` of ``x * c`` modulo 2**64, ``x`` ``uint32``, ``c`` a Python integer below
  2**64 (32-bit words in 16-bit halves: every partial product fits in 32 bits)."""
  u32 = np.uint32
  c_hi, c_lo = (c >> 32) & 0xFFFFFFFF, c & 0xFFFFFFFF
  xl, xh = x & u32(0xFFFF), lax.shift_right_logical(x, u32(16))
  cl, ch = u32(c_lo & 0xFFFF), u32(c_lo >> 16)
  p0, p1, p2, p3 = xl * cl, xl * ch, xh * cl, xh * ch
  mid = p1 + p2
  carry_mid = lax.convert_element_type(mid < p1, u32)
  lo = p0 + lax.shift_left(mid, u32(16))
  carry_lo = lax.convert_element_type(lo < p0, u32)
  hi = (p3 + lax.shift_right_logical(mid, u32(16)) + lax.shift_left(carry_mid, u32(16))
        + carry_lo + x * u32(c_hi))
  return hi, lo


def _add_wide(a: tuple, b: tuple) -> tuple:
  """``a + b`` modulo 2**64 of ``(hi, lo)`` pairs of ``uint32`` words."""
  lo = a[1] + b[1]
  return a[0] + b[0] + lax.convert_element_type(lo < a[1], np.uint32), lo


# --------------------------------------------------------------------------- running


_warned: set[str] = set()


def apply_site(primitive, params: dict, invals: list, site, mb_index, out_avals,
               rows: int | None = None) -> list:
  """Runs one equation with its draws redrawn for microbatch ``mb_index``.

  Args:
    primitive / params / invals: the equation (microbatch parameters) and its operands.
    site: its :class:`Redraw` or :class:`Inside`.
    mb_index: the microbatch's index (a traced integer); with ``rows``, the index in the full
      batch of the first row the program computes.
    out_avals: the equation's result avals at microbatch size (for :class:`Redraw`).
    rows: the rows the program computes (a part of a microbatch: a group of a stage that
      splits its microbatches' rows); ``None``: one whole microbatch.
  """
  if isinstance(site, Redraw):
    return redraw_slice(primitive, site, invals, out_avals, mb_index, rows)
  name = primitive.name
  if name not in _REISSUED:
    if site.where not in _warned:
      _warned.add(site.where)
      log.warning("random numbers drawn inside %s (a custom differentiation rule) cannot be "
                  "aligned with jax.jit's: each microbatch draws its own, from the PRNG keys "
                  "entering it folded with the microbatch index", site.where)
    return _compat.bind_eqn(primitive, params, [_fold_key(x, mb_index) for x in invals])
  bodies = site.bodies
  run = lambda key, jaxpr, consts, args: eval_jaxpr(jaxpr, consts, args,
                                                      bodies.get(key, {}), mb_index, rows)
  if name == "scan":
    closed = params["jaxpr"]
    nc, ncar = int(params["num_consts"]), int(params["num_carry"])
    consts, init, xs = invals[:nc], invals[nc:nc + ncar], invals[nc + ncar:]

    def step(carry, x):
      outs = run(("jaxpr", 0), closed.jaxpr, closed.consts, consts + list(carry) + list(x))
      return outs[:ncar], outs[ncar:]
    carry, ys = lax.scan(step, list(init), list(xs), length=int(params["length"]),
                         reverse=bool(params["reverse"]), unroll=params.get("unroll", 1))
    return list(carry) + list(ys)
  if name == "while":
    cj, bj = params["cond_jaxpr"], params["body_jaxpr"]
    cn, bn = int(params["cond_nconsts"]), int(params["body_nconsts"])
    cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    cond = lambda c: run(("cond_jaxpr", 0), cj.jaxpr, cj.consts, cconsts + list(c))[0]
    body = lambda c: run(("body_jaxpr", 0), bj.jaxpr, bj.consts, bconsts + list(c))
    return list(lax.while_loop(cond, body, list(init)))
  if name == "cond":
    branches = [
        (lambda *ops, i=i, b=b: run(("branches", i), b.jaxpr, b.consts, list(ops)))
        for i, b in enumerate(params["branches"])]
    return list(lax.switch(invals[0], branches, *invals[1:]))
  # jax.checkpoint, jit / pjit / closed_call / core_call: one body.
  (key, inner), = _bodies(params).items()
  value = params[key[0]]
  consts = value.consts if isinstance(value, _compat.ClosedJaxpr) else ()
  fn = lambda *a: run(key, inner, consts, list(a))
  if name in _compat.REMAT_PRIMITIVES:
    return list(jax.checkpoint(fn, prevent_cse=bool(params.get("prevent_cse", True)),
                               policy=params.get("policy"))(*invals))
  return fn(*invals)


def eval_jaxpr(jaxpr, consts, args, sites: dict, mb_index, rows: int | None = None) -> list:
  """Evaluates a ``Jaxpr`` with the equations in ``sites`` redrawn (as ``jax.core.eval_jaxpr``
  otherwise; ``mb_index`` and ``rows`` as in :func:`apply_site`)."""
  env: dict = {}

  def read(v):
    return _compat.literal_value(v) if _compat.is_literal(v) else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for i, eqn in enumerate(jaxpr.eqns):
    invals = [read(v) for v in eqn.invars]
    site = sites.get(i)
    if site is None:
      outs = _compat.bind_eqn(eqn.primitive, eqn.params, invals)
    else:
      outs = apply_site(eqn.primitive, eqn.params, invals, site, mb_index,
                        [v.aval for v in eqn.outvars], rows)
    for v, x in zip(eqn.outvars, outs):
      if not _compat.is_dropvar(v):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _fold_key(x, mb_index):
  try:
    typed = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  except (AttributeError, TypeError):
    typed = False
  return jax.random.fold_in(x, mb_index) if typed else x
