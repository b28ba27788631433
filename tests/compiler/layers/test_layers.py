"""Automatic layer construction: canonical signatures, repeated modules, clustering, scans."""

import dataclasses
import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import harpjax
from harpjax.compiler import layers as L
from harpjax.compiler.layers import repeats
from harpjax.compiler.trace import signature
from harpjax.compiler.trace import eval_ops, from_closed_jaxpr
from harpjax.compiler.trace import trace_step
from harpjax.models import BUILTIN_MODELS

# --------------------------------------------------------------------------- a small model zoo
# Third-party-style Flax models written the ordinary way: no harpjax markers.


class MlpBlock(nn.Module):   # google-research/vision_transformer models_vit.py, shrunk
  mlp_dim: int

  @nn.compact
  def __call__(self, inputs):
    x = nn.gelu(nn.Dense(self.mlp_dim)(inputs))
    return nn.Dense(inputs.shape[-1])(x)


class Encoder1DBlock(nn.Module):
  mlp_dim: int
  num_heads: int

  @nn.compact
  def __call__(self, inputs):
    x = nn.LayerNorm()(inputs)
    x = nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(x, x)
    x = x + inputs
    y = MlpBlock(mlp_dim=self.mlp_dim)(nn.LayerNorm()(x))
    return x + y


class ViT(nn.Module):
  num_layers: int = 6

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(32, (4, 4), strides=(4, 4), padding="VALID", name="embedding")(x)
    n, h, w, c = x.shape
    x = x.reshape(n, h * w, c)
    cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
    x = jnp.concatenate([jnp.tile(cls, [n, 1, 1]), x], axis=1)
    x = x + self.param("pos_embedding", nn.initializers.normal(0.02), (1,) + x.shape[1:])
    for lyr in range(self.num_layers):
      x = Encoder1DBlock(mlp_dim=64, num_heads=4, name=f"encoderblock_{lyr}")(x)
    x = nn.LayerNorm(name="encoder_norm")(x)
    return nn.Dense(10, name="head")(x[:, 0])


class ResNetBlock(nn.Module):   # flax/examples/imagenet/models.py, shrunk
  filters: int
  conv: Any
  norm: Any
  act: Callable
  strides: tuple = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
    y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters, (3, 3))(y))
    if residual.shape != y.shape:
      residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return self.act(residual + y)


class ResNet(nn.Module):
  stage_sizes: Sequence[int] = (2, 3, 3)

  @nn.compact
  def __call__(self, x, train: bool = False):
    conv = functools.partial(nn.Conv, use_bias=False)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    x = nn.relu(norm(name="bn_init")(conv(8, (3, 3), name="conv_init")(x)))
    for i, size in enumerate(self.stage_sizes):
      for j in range(size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = ResNetBlock(8 * 2 ** i, strides=strides, conv=conv, norm=norm, act=nn.relu)(x)
    return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


class ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    # no key bias: its gradient is zero in exact arithmetic, pure rounding noise in practice
    x = x + nn.SelfAttention(num_heads=2, use_bias=False)(nn.LayerNorm()(x))
    h = nn.gelu(nn.Dense(64)(nn.LayerNorm()(x)))
    return x + nn.Dense(x.shape[-1])(h), None


class ScanTransformer(nn.Module):   # layers as one nn.scan over stacked parameters
  num_layers: int = 6

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16)(x)
    stack = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=self.num_layers)
    x, _ = stack(name="layers")(x, None)
    return nn.Dense(3)(x.mean(1))


class RematBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(x.shape[-1])(nn.relu(nn.Dense(64)(nn.LayerNorm()(x))))


class RematNet(nn.Module):
  num_layers: int = 5

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16)(x)
    for _ in range(self.num_layers):
      x = nn.remat(RematBlock)()(x)
    return nn.Dense(3)(x)


def pure_init(key, depth=7, d=16):   # plain JAX: no name stack at all
  ks = jax.random.split(key, 2 * depth + 2)
  return {"w_in": jax.random.normal(ks[0], (8, d)) * 0.3,
          "blocks": [{"a": jax.random.normal(ks[2 * i + 1], (d, 2 * d)) * 0.2,
                      "b": jax.random.normal(ks[2 * i + 2], (2 * d, d)) * 0.2}
                     for i in range(depth)],
          "w_out": jax.random.normal(ks[-1], (d, 3)) * 0.3}


def pure_apply(p, x):
  x = jnp.tanh(x @ p["w_in"])
  for blk in p["blocks"]:
    x = x + jnp.tanh(jnp.tanh(x @ blk["a"]) @ blk["b"])
  return x @ p["w_out"]


def _layers(apply, params, x, options=None, num_microbatches=2, extra=None):
  """Traces ``mean(apply(params, x) ** 2)`` (``apply(params, extra, x)`` with ``extra``)."""
  def step(args, batch):
    p, e = args
    f = (lambda p: apply(p, e, batch)) if extra is not None else (lambda p: apply(p, batch))
    return harpjax.value_and_grad(lambda p: jnp.mean(f(p) ** 2))(p)
  ts = trace_step(step, ((params, extra), x), num_microbatches=num_microbatches,
                  batch_argnums=(1,))
  return ts, L.layers_for_step(ts, options)


def _abstract_init(model, x):
  """Variables as ``jax.ShapeDtypeStruct`` s: layer construction needs no values."""
  return jax.eval_shape(model.init, jax.random.key(0), x)


def _check_cover(seq: L.LayerSequence):
  assert seq.layers[0].start == 0 and seq.layers[-1].end == len(seq.program.ops)
  assert all(a.end == b.start for a, b in zip(seq.layers, seq.layers[1:]))
  flops = sum(l.flops for l in seq.layers)
  assert flops > 0
  for m in seq.modules:
    assert seq.layers[m.first_layer].start == m.start and seq.layers[m.last_layer].end == m.end


def _repeats_share_signatures(seq, name):
  inst = seq.instances(name)
  ref = [seq[i].signature for i in range(inst[0].first_layer, inst[0].last_layer + 1)]
  for m in inst[1:]:
    assert [seq[i].signature for i in range(m.first_layer, m.last_layer + 1)] == ref


# --------------------------------------------------------------------------- GPT


@pytest.fixture(scope="module")
def gpt48():
  spec = BUILTIN_MODELS["gpt-tiny"](num_blocks=48, num_microbatches=2)
  ts = trace_step(spec.step_fn, spec.args, num_microbatches=2, batch_argnums=(1,))
  return ts, L.layers_for_step(ts)


def test_gpt_48_blocks_found_and_share_signatures(gpt48):
  ts, seq = gpt48
  _check_cover(seq)
  assert seq.program is ts.region and seq.origin is None
  assert seq.module_kinds() == {"block": 48}
  assert str(seq) == "146 layers: embed 1 · 48 × block[3] · ln_f 1"
  _repeats_share_signatures(seq, "block")
  blocks = seq.instances("block")
  assert [m.path for m in blocks[:2]] == ["GPT/block_0", "GPT/block_1"]
  # embed, the three block layers, the head: 5 distinct computations among 146 layers
  assert len(set(seq.signatures)) == 5
  # every block layer has a matmul; cuts inside blocks cross small tensors
  for l in seq.layers[1:-1]:
    assert l.heavy_ops >= 1 and l.module == "block"
    assert l.boundary_bytes <= 2 * seq.layers[0].boundary_bytes


def test_gpt_layer_stats(gpt48):
  ts, seq = gpt48
  attn, proj, mlp = seq[1], seq[2], seq[3]
  h, t, b = 32, 16, 2
  # MLP layer: two [h, 4h] matmuls, forward FLOPs 2 * 2 * tokens * h * 4h (+ elementwise)
  assert 16 * b * t * h * h <= mlp.flops < 17.5 * b * t * h * h
  # parameter bytes: fc_in + fc_out weights and biases (ln_mlp sits in the layer before)
  assert mlp.param_bytes == 4 * (8 * h * h + 4 * h + h)
  assert attn.flops > proj.flops > 0
  assert seq[0].boundary_bytes == b * t * h * 4


def test_layer_knobs():
  spec = BUILTIN_MODELS["gpt-tiny"](num_blocks=6, num_microbatches=1)
  ts = trace_step(spec.step_fn, spec.args, num_microbatches=1, batch_argnums=(1,))
  one = L.layers_for_step(ts, L.LayerOptions(layers_per_module=1))
  assert str(one) == "8 layers: embed 1 · 6 × block[1] · ln_f 1"
  target = L.layers_for_step(ts, L.LayerOptions(target_layers=20))
  assert 14 <= len(target) <= 20 and target.module_kinds() == {"block": 6}
  _repeats_share_signatures(target, "block")
  nothing = L.layers_for_step(ts, L.LayerOptions(z=1000))
  assert "×" not in str(nothing) and not nothing.module_kinds()
  _check_cover(nothing)
  freq = L.layers_for_step(ts, L.LayerOptions(criterion="frequency", z=8))
  assert freq.module_kinds() == {"block": 6}
  with pytest.raises(harpjax.HarpjaxError):
    L.LayerOptions(z=0)


def test_manual_boundaries_win():
  from harpjax.models import GPT, GPTConfig
  cfg = GPTConfig(num_blocks=3)
  model = GPT(cfg)
  tokens = jax.ShapeDtypeStruct((4, cfg.seq_len), jnp.int32)
  params = _abstract_init(model, tokens)
  ts, seq = _layers(lambda p, x: model.apply(p, x), params, tokens)
  assert len(ts.boundary_cuts) == 4
  assert len(seq) == 5 and seq.cuts() == tuple(ts.boundary_cuts)
  assert "marked by hand" in str(seq)
  assert seq[1].signature == seq[2].signature == seq[3].signature != seq[0].signature
  assert sum(m.repeated for m in seq.modules) == 3


def test_dense_moe_interleaved_gets_two_kinds():
  spec = BUILTIN_MODELS["moe-tiny"](num_microbatches=1)
  ts = trace_step(spec.step_fn, spec.args, num_microbatches=1, batch_argnums=(1,))
  seq = L.layers_for_step(ts)
  _check_cover(seq)
  assert seq.module_kinds() == {"DenseBlock": 4, "MoEBlock": 4}
  assert "4 × (DenseBlock[3] · MoEBlock[" in str(seq)
  kinds = [m.name for m in seq.modules if m.repeated]
  assert kinds == ["DenseBlock", "MoEBlock"] * 4
  for m in seq.modules:   # no layer spans two blocks
    paths = {op.name_stack.split("/")[1] for op in seq.program.ops[m.start:m.end]
             if op.name_stack.count("/") >= 1}
    assert len(paths) <= 1 or not m.repeated
  _repeats_share_signatures(seq, "DenseBlock")
  _repeats_share_signatures(seq, "MoEBlock")


# --------------------------------------------------------------------------- third-party models


def test_vit_encoder_blocks():
  m = ViT()
  x = jax.ShapeDtypeStruct((4, 16, 16, 3), jnp.float32)
  _, seq = _layers(m.apply, _abstract_init(m, x), x)
  _check_cover(seq)
  assert seq.module_kinds() == {"encoderblock": 6}
  _repeats_share_signatures(seq, "encoderblock")


def test_resnet_blocks_with_batchnorm():
  m = ResNet()
  x = jax.ShapeDtypeStruct((4, 16, 16, 3), jnp.float32)
  v = _abstract_init(m, x)
  apply = lambda p, stats, x: m.apply({"params": p, "batch_stats": stats}, x)
  _, seq = _layers(apply, v["params"], x, extra=v["batch_stats"])
  _check_cover(seq)
  kinds = seq.module_kinds()
  # identical blocks repeat within each stage; the strided projection blocks are unique
  assert sorted(kinds.values()) == [2, 2, 2] and len(kinds) == 3
  for name in kinds:
    _repeats_share_signatures(seq, name)


def test_scan_over_layers_is_unrolled():
  m = ScanTransformer()
  x = jax.random.normal(jax.random.key(1), (4, 8, 5))
  params = jax.jit(m.init)(jax.random.key(0), x)
  ts, seq = _layers(m.apply, params, x, num_microbatches=1)
  assert [op.name for op in ts.region.ops].count("scan") == 1
  assert seq.origin is not None and len(seq.program.ops) > 6 * 20
  assert seq.module_kinds() == {"layers": 6}
  _repeats_share_signatures(seq, "layers")
  # the unrolled program computes what the scan computes
  leaves = jax.tree_util.tree_leaves(params)

  @functools.partial(jax.jit, static_argnums=0)
  def run(prog, leaves, x):
    vals = [leaves[i.param_index] if i.kind == "param" else
            (i.static_value if i.kind == "static" else x) for i in ts.inputs]
    env = dict(zip(prog.invars, vals))
    eval_ops(prog.ops, env)
    return [env[v] for v in prog.outvars]
  assert [i.kind for i in ts.inputs].count("whole") == 1
  np.testing.assert_allclose(run(seq.program, leaves, x)[0], run(ts.region, leaves, x)[0],
                             rtol=1e-6)
  ts2 = L.traced_step_for(ts, seq)
  assert ts2.region is seq.program and L.traced_step_for(ts, L.layers_for_step(
      ts, L.LayerOptions(unroll_scan=False))) is ts


@pytest.mark.slow
def test_unrolled_scan_runs_pipelined():
  """The runtime executes the unrolled program (via traced_step_for) like jax.jit."""
  from tests.equivalence import compare_steps

  m = ScanTransformer(num_layers=2)
  x = jax.random.normal(jax.random.key(1), (8, 8, 5))
  state = train_state.TrainState.create(apply_fn=m.apply,
                                        params=jax.jit(m.init)(jax.random.key(0), x),
                                        tx=optax.sgd(0.1))

  def step(state, batch):
    loss, g = harpjax.value_and_grad(
        lambda p: jnp.mean((state.apply_fn(p, batch) - 1.0) ** 2))(state.params)
    return state.apply_gradients(grads=g), loss
  # A plan over the automatic layers (the scan unrolled), as a solved plan records it.
  plan = dataclasses.replace(
      harpjax.ManualPlan([((0, 3), "v100", (1, 2), (1, 2)), ((4, 7), "a100", (1, 2), (2, 1))]),
      layer_source="auto")
  compare_steps(step, state, [x], plan=plan, num_microbatches=2)


def test_remat_blocks():
  m = RematNet()
  x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  _, seq = _layers(m.apply, _abstract_init(m, x), x)
  _check_cover(seq)
  assert seq.module_kinds() == {"CheckpointRematBlock": 5}
  # The remat bodies are inlined; each block's ops keep their own checkpoint scope.
  scopes = []
  for l in seq.layers[1:-1]:
    ops = seq.program.ops[l.start:l.end]
    assert all(op.remat for op in ops if op.name == "dot_general")
    scopes.append({op.remat[0].id for op in ops if op.remat})
  assert all(len(s) == 1 for s in scopes) and len(set.union(*scopes)) == 5
  assert seq[1].flops > 0 and seq[1].heavy_ops == 2


def test_plain_jax_without_names():
  p = pure_init(jax.random.key(0))
  x = jnp.ones((4, 8))
  _, seq = _layers(pure_apply, p, x)
  _check_cover(seq)
  assert list(seq.module_kinds().values()) == [7]
  name = next(iter(seq.module_kinds()))
  _repeats_share_signatures(seq, name)


# The branch is chosen from the batch's values (a coupling the trace reports); layers only here.
@pytest.mark.filterwarnings("ignore::harpjax.errors.BatchCouplingWarning")
def test_jit_cond_and_custom_vjp_inside_blocks():
  @jax.custom_vjp
  def clip_grad(x):
    return x

  clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))

  @jax.jit
  def block(w1, w2, x):
    h = jax.lax.cond(jnp.sum(x) > 0, lambda h: jnp.tanh(h @ w1), lambda h: h @ w1 * 0.5, x)
    return x + clip_grad(h @ w2)

  def apply(p, x):
    for w1, w2 in p:
      x = block(w1, w2, x)
    return x

  w = jax.ShapeDtypeStruct((16, 16), jnp.float32)
  _, seq = _layers(apply, [(w, w)] * 5, jax.ShapeDtypeStruct((4, 16), jnp.float32))
  names = [op.name for op in seq.program.ops]
  assert "pjit" not in names and "jit" not in names   # inlined
  assert "cond" in names and "custom_vjp_call" in names
  _check_cover(seq)
  assert sorted(seq.module_kinds().values()) == [4]   # the first block reads data, not an act
  cond_op = next(op for op in seq.program.ops if op.name == "cond")
  layer = next(l for l in seq.layers if l.start <= cond_op.index < l.end)
  # a cond costs its heaviest branch: one [2, 16] x [16, 16] matmul per microbatch
  assert layer.heavy_ops == 1 and 2 * 2 * 16 * 16 <= layer.flops < 2 * 2 * 16 * 16 + 128


# --------------------------------------------------------------------------- canonicalisation


def test_signatures_are_canonical():
  def f(w1, w2, x):
    return jnp.tanh(x @ w1) @ w2

  a = jax.ShapeDtypeStruct((4, 4), jnp.float32)
  x = jax.ShapeDtypeStruct((2, 4), jnp.float32)
  p1 = from_closed_jaxpr(jax.make_jaxpr(f)(a, a, x))
  p2 = from_closed_jaxpr(jax.make_jaxpr(lambda u, v, y: f(u, v, y))(a, a, x))
  kinds = ["param", "param", "split"]
  t1, t2 = signature.op_tokens(p1, kinds), signature.op_tokens(p2, kinds)
  assert list(t1.tokens) == list(t2.tokens)
  live = lambda v: True
  assert signature.slice_signature(p1, 0, len(p1.ops), t1, live) == \
      signature.slice_signature(p2, 0, len(p2.ops), t2, live)
  # shapes, dtypes, operand kinds and dataflow all matter
  p3 = from_closed_jaxpr(jax.make_jaxpr(f)(a, a, jax.ShapeDtypeStruct((3, 4), jnp.float32)))
  assert signature.op_tokens(p3, kinds).tokens[0] != t1.tokens[0]
  t4 = signature.op_tokens(p1, ["split", "param", "split"])
  assert t4.tokens[0] != t1.tokens[0]
  g = lambda w1, w2, x: jnp.tanh(x @ w1) @ w1   # same ops, other wiring
  p5 = from_closed_jaxpr(jax.make_jaxpr(g)(a, a, x))
  h = lambda w1, w2, x: jnp.tanh(x @ w2) @ w1   # inputs permuted: the same computation
  p6 = from_closed_jaxpr(jax.make_jaxpr(h)(a, a, x))
  t6 = signature.op_tokens(p6, kinds)
  assert signature.slice_signature(p6, 0, len(p6.ops), t6, live) == \
      signature.slice_signature(p1, 0, len(p1.ops), t1, live)
  t5 = signature.op_tokens(p5, kinds)
  assert signature.slice_signature(p5, 0, len(p5.ops), t5, live) != \
      signature.slice_signature(p1, 0, len(p1.ops), t1, live)
  # sub-jaxprs are hashed by structure, not identity
  j1 = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0)
  j2 = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0)
  assert signature.jaxpr_digest(j1) == signature.jaxpr_digest(j2)


def test_most_repeated_finds_periodic_runs():
  tokens = np.array([9, 8] + [1, 2, 3, 4] * 5 + [7])
  heavy = np.isin(tokens, [2, 4]).astype(int)
  rep = repeats.most_repeated(tokens, heavy, [(0, len(tokens))], z=2)
  assert rep.length == 4 and rep.count == 5
  # two phases occur 5 times: the one whose starts cross the fewest bytes wins
  tokens = np.array([4] + [1, 2, 3, 4] * 5)
  heavy = np.isin(tokens, [2, 4]).astype(int)
  cost = np.zeros(len(tokens))
  assert repeats.most_repeated(tokens, heavy, [(0, 21)], z=2, start_cost=cost).starts[0] == 0
  cost[[4 * i for i in range(5)]] = 10.0
  rep2 = repeats.most_repeated(tokens, heavy, [(0, 21)], z=2, start_cost=cost)
  assert rep2.count == 5 and rep2.starts == (1, 5, 9, 13, 17)
  assert repeats.most_repeated(tokens, heavy, [(0, 21)], z=3).count == 2
  assert repeats.most_repeated(tokens, heavy, [(0, 21)], z=20) is None
  sa = repeats.suffix_array(np.array([3, 1, 2, 1, 2]))
  assert list(sa) == [3, 1, 4, 2, 0]


def test_ten_thousand_ops():
  depth = 1450

  def f(ws, x):
    for w in ws:
      h = jnp.tanh(x @ w)
      x = x + jnp.sin(h @ w.T) * 0.5
    return jnp.sum(x)
  ws = [jax.ShapeDtypeStruct((16, 16), jnp.float32)] * depth
  closed = jax.make_jaxpr(f)(ws, jax.ShapeDtypeStruct((4, 16), jnp.float32))
  prog = from_closed_jaxpr(closed)
  assert len(prog.ops) >= 10_000
  seq = L.construct_layers(prog, ["param"] * depth + ["split"])   # how fast: benchmarks/profile.py
  assert list(seq.module_kinds().values()) == [depth - 1]   # the first reads data, not an act
