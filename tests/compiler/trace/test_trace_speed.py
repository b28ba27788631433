"""Tracing's shortcuts change nothing but time: the microbatch trace ending at the region,
Flax's shape check evaluated once per distinct initializer, the garbage collector paused.

Each test traces a step with the shortcuts and with all three turned off (the step traced to its
end at both sizes, every parameter's initializer evaluated, the collector running) and compares
the programs, the region's inputs, the random-number sites and the layers op for op."""

from __future__ import annotations

import contextlib
import dataclasses
import gc

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import harpjax
from harpjax import _compat
from harpjax.compiler.layers import layers_for_step
from harpjax.compiler.trace import signature, step as step_mod, trace_step
from harpjax.errors import MicrobatchError, TraceError
from harpjax.models import BUILTIN_MODELS, gpt
from tests import zoo

B = 4


@contextlib.contextmanager
def _without_shortcuts(monkeypatch):
  """Traces as before the shortcuts: whole step at both sizes, Flax's check per parameter,
  collector on."""
  whole = step_mod._trace
  with monkeypatch.context() as m:
    m.setattr(step_mod, "_trace", lambda fn, args, stop_at_region=False: whole(fn, args))
    m.setattr(_compat, "flax_param_shape_memo", contextlib.nullcontext)
    m.setattr(step_mod, "_gc_paused", contextlib.nullcontext)
    yield


def _program(p) -> tuple:
  """A program, op for op, with remat scopes numbered by first appearance."""
  scopes: dict = {}
  ops = []
  for op in p.ops:
    remat = tuple((scopes.setdefault(s.id, len(scopes)), s.prevent_cse, repr(s.policy))
                  for s in op.remat)
    ops.append((op.name, signature.canonical(op.params), tuple(op.invars), tuple(op.outvars),
                op.name_stack, remat))
  return (tuple(_aval(a) for a in p.avals), tuple(p.invars), tuple(p.outvars), p.num_consts,
          tuple(ops))


def _aval(a) -> tuple:
  return (tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False)))


def _static(v):
  if v is None:
    return None
  return (type(v).__name__, tuple(np.shape(v)), str(np.asarray(v).dtype),
          np.asarray(v).tobytes())


def _describe(ts, layers) -> dict:
  return dict(
      outer=_program(ts.outer), region=_program(ts.region), full=_program(ts.region_full),
      consts=tuple(_static(np.asarray(c)) for c in ts.outer_consts),
      inputs=tuple((i.kind, i.outer_ref, i.param_index, i.axis, _static(i.static_value))
                   for i in ts.inputs),
      trees=(ts.in_tree, ts.out_tree), region_op=ts.region_op, aux=ts.aux_concat_axes,
      regen={k: repr(v) for k, v in ts.regen_ops.items()}, rng_exact=ts.rng_exact,
      cuts=ts.boundary_cuts, flows=repr(ts.output_flows), couplings=repr(ts.couplings),
      layers=tuple(layers), summary=layers.summary)


def _both(monkeypatch, step, args, num_microbatches=B, **kw):
  got = trace_step(step, args, num_microbatches=num_microbatches, **kw)
  with _without_shortcuts(monkeypatch):
    ref = trace_step(step, args, num_microbatches=num_microbatches, **kw)
  return (_describe(got, layers_for_step(got)), _describe(ref, layers_for_step(ref)))


def _assert_same(got: dict, ref: dict):
  for key in ref:
    assert got[key] == ref[key], key


def _fast(values, fast) -> list:
  """``values`` as parameters, those not in ``fast`` marked slow (``make test-slow``)."""
  return [v if v in fast else pytest.param(v, marks=pytest.mark.slow) for v in values]


@pytest.mark.parametrize("kind", _fast(zoo.KINDS, ("scan_remat",)))
def test_zoo_traces_as_without_shortcuts(x64, monkeypatch, kind):
  case = zoo.linen(kind)
  _assert_same(*_both(monkeypatch, case.step, (case.state, case.batches[0])))


@pytest.mark.parametrize("name", _fast(["batch_stats", "nnx_model", "custom_vjp"], ()))
def test_stateful_models_trace_as_without_shortcuts(x64, monkeypatch, name):
  case = getattr(zoo, name)()
  _assert_same(*_both(monkeypatch, case.step, (case.state, case.batches[0])))


@pytest.mark.parametrize("name", _fast(["masked_lm", "contrastive", "batch_norm"],
                                       ("masked_lm",)))
def test_coupled_steps_trace_as_without_shortcuts(x64, monkeypatch, name):
  # Hoisted token counts, couplings, aux outputs per example and per batch.
  case = zoo.COUPLED[name]()
  _assert_same(*_both(monkeypatch, case.step, (case.state, case.batches[0]),
                      batch_coupling="per_microbatch"))


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_gpt_from_shapes_traces_as_without_shortcuts(monkeypatch, num_microbatches):
  # One microbatch: the batch flow comes from a probe at twice the batch, also cut short.
  spec = BUILTIN_MODELS["gpt-tiny"](num_microbatches=num_microbatches)
  got, ref = _both(monkeypatch, spec.step_fn, spec.args, num_microbatches=num_microbatches)
  _assert_same(got, ref)
  assert "4 × block" in got["summary"]


def test_dropout_gpt_with_static_arguments_traces_as_without_shortcuts(monkeypatch):
  # Literal and constant region inputs come from the microbatch trace, now cut short.
  spec = BUILTIN_MODELS["gpt-tiny"](num_microbatches=2, dropout=0.1)
  model, tx = spec.model, optax.sgd(0.1)
  table = np.arange(16, dtype=np.float32)

  def step(state, batch, key):
    def loss_fn(params, scale, table, rows):
      logits = model.apply({"params": params}, batch["tokens"], train=True,
                           rngs={"dropout": key})
      return scale * gpt.lm_loss(logits, batch["labels"]) + \
          0.0 * table.sum() / rows
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params, 2.0, table,
                                                  batch["tokens"].shape[0])
    return state.apply_gradients(grads=grads), loss

  state, batch = spec.args
  state = state.replace(tx=tx, opt_state=jax.eval_shape(tx.init, state.params))
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  got, ref = _both(monkeypatch, step, (state, batch, key), num_microbatches=2)
  _assert_same(got, ref)
  assert any(kind == "static" for kind, *_ in got["inputs"]), got["inputs"]
  assert got["regen"], "dropout draws are redrawn per microbatch"


def test_microbatch_trace_ends_at_the_region():
  # What the step does after the region runs on the whole batch only: a step whose update
  # reads the batch's row count as a number traces, where tracing it to its end at microbatch
  # size (as before) failed.
  model = nn.Dense(3)
  x = jnp.ones((8, 5))
  params = model.init(jax.random.key(0), x)["params"]

  def step(params, batch):
    def loss_fn(p):
      return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)
    loss, grads = harpjax.value_and_grad(loss_fn)(params)
    assert batch["x"].shape[0] == 8, "written for batches of 8"
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss

  ts = trace_step(step, (params, {"x": x, "y": jnp.ones((8, 3))}), num_microbatches=4)
  split = {tuple(ts.region.avals[v].shape) for v, i in zip(ts.region.invars, ts.inputs)
           if i.kind == "split"}
  assert split == {(2, 5), (2, 3)}


def test_region_inside_a_jit_traces_the_whole_step(monkeypatch):
  # Called inside a jax.jit of the step, the region cannot end the trace (the jit's own trace
  # would be abandoned): the step is traced to its end, as before.
  # (JAX keeps the jit's trace by function: each trace_step gets a function of its own.)
  case = BUILTIN_MODELS["gpt-tiny"](num_microbatches=2)
  jitted = lambda: jax.jit(lambda s, b: case.step_fn(s, b))
  got = trace_step(jitted(), case.args, num_microbatches=2)
  with _without_shortcuts(monkeypatch):
    ref = trace_step(jitted(), case.args, num_microbatches=2)
  _assert_same(_describe(got, layers_for_step(got)), _describe(ref, layers_for_step(ref)))


def test_step_catching_exceptions_still_traces():
  # A step that catches everything around the region sees no error of harpjax's.
  case = BUILTIN_MODELS["gpt-tiny"](num_microbatches=2)

  def step(state, batch):
    try:
      return case.step_fn(state, batch)
    except Exception as e:  # pylint: disable=broad-except
      raise AssertionError(f"the step saw {type(e).__name__}") from e

  ts = trace_step(step, case.args, num_microbatches=2)
  assert ts.region.ops


def test_two_regions_are_still_refused():
  case = BUILTIN_MODELS["gpt-tiny"](num_microbatches=2)

  def step(state, batch):
    state, loss = case.step_fn(state, batch)
    return case.step_fn(state, batch)[0], loss

  with pytest.raises(TraceError, match="more than once"):
    trace_step(step, case.args, num_microbatches=2)


# --------------------------------------------------------------------------- Flax's check


class _TwoDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="second")(nn.Dense(4, name="first")(x))


@pytest.mark.parametrize("wrong", ["first", "second"])
def test_shape_mismatch_still_raises(wrong):
  # The second Dense's initializer call equals the first's (same initializer, shape, dtype):
  # its shape comes from the memo and is still compared.
  model = _TwoDense()
  x = jnp.ones((6, 4))
  params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  params = flax.core.unfreeze(params)
  params[wrong]["kernel"] = jax.ShapeDtypeStruct((4, 5), jnp.float32)

  def step(params, batch):
    loss, grads = harpjax.value_and_grad(
        lambda p: jnp.sum(model.apply({"params": p}, batch)))(params)
    return grads, loss

  with pytest.raises(flax.errors.ScopeParamShapeError):
    trace_step(step, (params, x), num_microbatches=2)
  with _compat.flax_param_shape_memo():
    with pytest.raises(flax.errors.ScopeParamShapeError):
      jax.eval_shape(lambda p: model.apply({"params": p}, x), params)


def test_memo_evaluates_each_distinct_initializer_once(monkeypatch):
  import flax.core.scope as scope_mod
  calls = []
  real = jax.eval_shape

  def counting(fun, *a, **k):
    calls.append(fun)
    return real(fun, *a, **k)

  monkeypatch.setattr(jax, "eval_shape", counting)
  model = nn.Sequential([nn.Dense(4), nn.LayerNorm(), nn.Dense(4), nn.LayerNorm(),
                         nn.Dense(4)])
  x = jnp.ones((2, 4))
  params = model.init(jax.random.key(0), x)
  calls.clear()
  model.apply(params, x)
  per_param = len(calls)
  assert per_param == 10           # kernel and bias of 3 Denses, scale and bias of 2 norms
  calls.clear()
  with _compat.flax_param_shape_memo():
    assert scope_mod.jax is not jax
    model.apply(params, x)
    model.apply(params, x)
  assert len(calls) == 4           # Dense kernel, Dense bias, norm scale, norm bias
  assert scope_mod.jax is jax
  calls.clear()
  model.apply(params, x)
  assert len(calls) == per_param


def test_memo_keys_by_value_and_type():
  key = _compat._memo_key
  assert key((4, 5)) == key((4, 5)) and key([4, 5]) == key([4, 5])
  assert len({key((1,)), key((1.0,)), key((True,)), key([1])}) == 4
  assert key({"a": (1, 2)}) == key({"a": (1, 2)}) != key({"a": (1, 3)})
  with pytest.raises(TypeError):
    key(({1: [2]}, np.ones(2)))


def test_memo_nests_and_restores():
  import flax.core.scope as scope_mod
  with _compat.flax_param_shape_memo():
    inner = scope_mod.jax
    with _compat.flax_param_shape_memo():
      assert scope_mod.jax is inner
    assert scope_mod.jax is inner
  assert scope_mod.jax is jax


# --------------------------------------------------------------------------- the collector


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_state_is_restored(enabled):
  case = BUILTIN_MODELS["gpt-tiny"](num_microbatches=2)
  seen = []

  def step(state, batch):
    seen.append(gc.isenabled())
    return case.step_fn(state, batch)

  was = gc.isenabled()
  (gc.enable if enabled else gc.disable)()
  try:
    trace_step(step, case.args, num_microbatches=2)
    assert gc.isenabled() == enabled
  finally:
    (gc.enable if was else gc.disable)()
  assert seen and not any(seen)


def test_collector_restored_after_an_error():
  case = BUILTIN_MODELS["gpt-tiny"](num_microbatches=3)
  assert gc.isenabled()
  with pytest.raises(MicrobatchError):
    trace_step(case.step_fn, case.args, num_microbatches=2 * 3 + 1)
  assert gc.isenabled()


@pytest.mark.parametrize("name", ["gpt_dropout", "masked_lm"])
def test_retrace_at_other_rows_traces_only_the_region(x64, name):
  # A step traced again at b / 2 rows per microbatch like its trace at b (what data-parallel
  # replicas and the profiler's local microbatch run) calls the step once, up to the region,
  # and its region is the one a trace of its own at 2 B microbatches rewrites.
  if name == "gpt_dropout":
    spec = BUILTIN_MODELS["gpt-tiny"](num_microbatches=2, dropout=0.1)
    fn, args, kw = spec.step_fn, spec.args, {}
  else:
    case = zoo.COUPLED[name]()
    fn, args, kw = case.step, (case.state, case.batches[0]), {"batch_coupling": "per_microbatch"}
  ts = trace_step(fn, args, num_microbatches=2, **kw)
  calls = []

  def counted(*a):
    calls.append(1)
    return fn(*a)
  got = trace_step(counted, args, num_microbatches=4, like=ts, factor=4, **kw)
  assert len(calls) == 1
  own = trace_step(fn, args, num_microbatches=4, batch_coupling="per_microbatch")
  assert _program(got.region) == _program(own.region)
  assert got.boundary_cuts == own.boundary_cuts
  assert got.inputs == ts.inputs and got.outer is ts.outer
