"""The Mixtral model's routing against a plain NumPy reference, token by token: top-k choice,
top-2 renormalisation, capacity drops (first choices of every token before second choices,
tokens in order), the Switch load-balancing loss, and the routed layer's output."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harpjax.models import mixtral
from harpjax.models.mixtral import MixtralConfig, MoEFeedForward, expert_capacity
from harpjax.models.mixtral import route as _route

route = jax.jit(_route, static_argnums=(1, 2))   # one compilation rather than one per op


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def reference_route(logits: np.ndarray, k: int, capacity: int):
  """Loops over choice ranks, then tokens in order: a choice takes the expert's next free
  slot, or is dropped when the expert is full."""
  G, S, E = logits.shape
  probs = _softmax(logits)
  combine = np.zeros((G, S, E, capacity))
  dispatch = np.zeros((G, S, E, capacity))
  experts = np.zeros((G, S, k), int)
  aux = 0.0
  for g in range(G):
    order = [np.argsort(-probs[g, t], kind="stable")[:k] for t in range(S)]
    used = np.zeros(E, int)
    for j in range(k):
      for t in range(S):
        e = order[t][j]
        experts[g, t, j] = e
        w = probs[g, t, e] / probs[g, t, order[t]].sum() if k > 1 else probs[g, t, e]
        if used[e] < capacity:
          dispatch[g, t, e, used[e]] = 1.0
          combine[g, t, e, used[e]] = w
        used[e] += 1
    f = np.bincount(experts[g].ravel(), minlength=E) / (S * k)
    aux += E * float(np.sum(f * probs[g].mean(0))) / G
  return dispatch, combine, experts, aux


@pytest.mark.parametrize("k,capacity", [(2, 3), (2, 16), (1, 2), (1, 16)])
def test_route_equals_the_numpy_reference(x64, k, capacity):
  logits = np.random.default_rng(k * 7 + capacity).normal(size=(3, 16, 4)) * 2
  got = route(jnp.asarray(logits), k, capacity)
  dispatch, combine, experts, aux = reference_route(logits, k, capacity)
  np.testing.assert_array_equal(np.asarray(got.experts), experts)
  np.testing.assert_array_equal(np.asarray(got.dispatch), dispatch)
  np.testing.assert_allclose(np.asarray(got.combine), combine, rtol=1e-13, atol=0)
  assert float(got.aux_loss) == pytest.approx(aux, rel=1e-13)
  if capacity == 16:   # nothing dropped: top-2 weights sum to one, top-1 keeps its probability
    total = np.asarray(got.combine).sum((2, 3))
    want = np.ones_like(total) if k == 2 else _softmax(logits).max(-1)
    np.testing.assert_allclose(total, want, rtol=1e-13)
  else:                # capacity binds: some choices are dropped, each expert holds <= capacity
    assert dispatch.sum() < 3 * 16 * k
    assert np.asarray(got.dispatch).sum(1).max() == 1.0   # one token per slot


def test_second_choices_yield_to_every_first_choice(x64):
  # Token 0 picks expert 1 second, tokens 1 and 2 pick it first; with 2 slots the later first
  # choices win over the earlier token's second choice, which is dropped while its first
  # choice (expert 0) keeps its renormalised weight.
  logits = np.log(np.array([[[0.6, 0.3, 0.1], [0.1, 0.8, 0.1], [0.2, 0.7, 0.1]]]))
  r = route(jnp.asarray(logits), 2, 2)
  d = np.asarray(r.dispatch)
  assert d[0, 0, 1].sum() == 0 and d[0, 1, 1, 0] == 1 and d[0, 2, 1, 1] == 1
  assert float(np.asarray(r.combine)[0, 0, 0].sum()) == pytest.approx(0.6 / 0.9, rel=1e-14)


def test_balanced_router_has_aux_loss_one_and_uneven_more(x64):
  even = route(jnp.zeros((1, 8, 4), jnp.float64), 1, 8)
  assert float(even.aux_loss) == pytest.approx(1.0, rel=1e-14)
  skewed = route(jnp.asarray(np.tile([[4.0, 0, 0, 0]], (1, 8, 1))), 2, 8)
  assert float(skewed.aux_loss) > 1.5


def test_capacity():
  assert expert_capacity(64, 8, 2, 1.25) == 20
  assert expert_capacity(64, 8, 2, 100.0) == 64 and expert_capacity(64, 8, 2, None) == 64
  assert expert_capacity(3, 8, 1, 0.01) == 1


def _np_swiglu_experts(x, params, k, capacity, groups):
  """The routed layer computed token by token from the reference routing."""
  b, s, h = x.shape
  xs = x.reshape(1, b * s, h) if groups == "batch" else x
  logits = xs @ params["router"]["kernel"]
  _, combine, _, aux = reference_route(logits, k, capacity)
  silu = lambda z: z / (1 + np.exp(-z))
  out = np.zeros_like(xs)
  for g, t, e in zip(*np.nonzero(combine.sum(-1))):
    v = xs[g, t]
    hid = silu(v @ params["w_gate"][e]) * (v @ params["w_up"][e])
    out[g, t] += combine[g, t, e].sum() * (hid @ params["w_down"][e])
  return out.reshape(b, s, h), aux


@pytest.mark.parametrize("groups,factor", [("batch", 1.0), ("sequence", 0.5), ("sequence", None)])
def test_routed_layer_equals_the_numpy_reference(x64, groups, factor):
  cfg = MixtralConfig(hidden=8, num_heads=2, num_experts=4, ffn_hidden=12, top_k=2,
                      capacity_factor=factor, routing_group=groups, dtype="float64",
                      param_dtype="float64")
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(3, 8, 8)))
  layer = MoEFeedForward(cfg)
  shapes = jax.eval_shape(layer.init, jax.random.key(4), x)["params"]
  params = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(size=a.shape) / 2), shapes)
  y, aux = jax.jit(layer.apply)({"params": params}, x)
  S = 24 if groups == "batch" else 8
  cap = expert_capacity(S, 4, 2, factor)
  want, want_aux = _np_swiglu_experts(np.asarray(x), jax.tree_util.tree_map(np.asarray, params),
                                      2, cap, groups)
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-12, atol=1e-12)
  assert float(aux) == pytest.approx(want_aux, rel=1e-12)


def test_config_errors_say_what_to_change():
  with pytest.raises(ValueError, match="top_k"):
    MixtralConfig(top_k=3)
  with pytest.raises(ValueError, match="num_kv_heads"):
    MixtralConfig(num_heads=4, num_kv_heads=3)
  with pytest.raises(ValueError, match="routing_group"):
    MixtralConfig(routing_group="device")
  with pytest.raises(ValueError, match="capacity_factor"):
    MixtralConfig(capacity_factor=0)


def test_mixtral_8x7b_has_its_parameter_count():
  cfg = mixtral.MIXTRAL_8X7B
  shapes = jax.eval_shape(lambda: mixtral.Mixtral(cfg).init(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
  n = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes))
  assert n == cfg.num_params and 46.6e9 < n < 46.8e9
