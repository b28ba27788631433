"""Intra-op sharding: logical meshes, Megatron rules from the jaxpr, equal numbers sharded."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from harpjax.compiler.profile import pieces
from harpjax.compiler import layers as L
from harpjax.compiler.layers import sharding as S
from harpjax.compiler.trace import from_closed_jaxpr
from harpjax.compiler.trace import trace_step
from harpjax.models import BUILTIN_MODELS


def test_logical_meshes():
  assert S.logical_meshes(8) == [(8, 1), (4, 2), (2, 4), (1, 8)]
  assert S.submesh_logical_meshes((2, 4)) == [(8, 1), (4, 2), (2, 4)]   # tp stays in a host
  assert S.submesh_logical_meshes((1, 8), microbatch_size=4) == [(4, 2), (2, 4), (1, 8)]
  assert S.submesh_logical_meshes((1, 8), max_tp=2) == [(8, 1), (4, 2)]
  assert S.batch_spec((8, 3), 0, 4) == P("dp") and S.batch_spec((6, 3), 0, 4) == P()


@pytest.fixture(scope="module")
def gpt():
  spec = BUILTIN_MODELS["gpt-tiny"](num_blocks=2, num_microbatches=1,
                                    microbatch_size=4)
  ts = trace_step(spec.step_fn, spec.args, num_microbatches=1, batch_argnums=(1,))
  seq = L.layers_for_step(ts, L.LayerOptions(layers_per_module=1))
  names = {}
  leaves = jax.tree_util.tree_leaves_with_path(spec.args[0].params)
  for k, inp in enumerate(ts.inputs):
    if inp.kind == "param":
      names[ts.region.invars[k]] = jax.tree_util.keystr(leaves[inp.param_index][0])
  return spec, ts, seq, names


def test_megatron_rules_from_the_jaxpr(gpt):
  _, ts, _, names = gpt
  prog = ts.region
  pids = [prog.invars[k] for k, i in enumerate(ts.inputs) if i.kind == "param"]
  plan = S.tp_plan(prog, prog.ops, pids, 4)
  dims = {names[p]: plan.param_dims.get(p) for p in pids}
  b0 = "['block_0']"
  for col in ("['attn']['query']", "['attn']['key']", "['attn']['value']", "['fc_in']"):
    assert dims[f"{b0}{col}['kernel']"] == 1, col      # column: output features
  for row in ("['attn']['out']", "['fc_out']"):
    assert dims[f"{b0}{row}['kernel']"] == 0, row      # row: input features
  assert dims[f"{b0}['attn']['query']['bias']"] == 0   # bias of a column split follows it
  assert dims[f"{b0}['fc_out']['bias']"] is None       # bias after the reduction: replicated
  assert dims[f"{b0}['ln_attn']['scale']"] is None
  assert dims["['embed']['embedding']"] == 0           # tied LM head: vocabulary-parallel
  # one reduction per attention and per MLP: the row-parallel matmuls
  row_names = sorted(prog.ops[i].name_stack.split("/")[-1] for i in plan.row_ops)
  assert row_names == ["fc_out", "fc_out", "out", "out"]
  specs = S.param_specs(prog, prog.ops, pids, 4)
  assert specs[pids[0]] in (P(), P(None, "tp"), P("tp"))
  assert all(v == P() for v in S.param_specs(prog, prog.ops, pids, 1).values())


def _run(piece, mesh_shape, args):
  devices = jax.devices()[: mesh_shape[0] * mesh_shape[1]]
  mesh = S.make_mesh(devices, mesh_shape)
  in_sh, _ = pieces.shardings(piece, mesh)
  fwd_bwd, fwd_res = pieces.make_functions(piece)
  placed = jax.tree_util.tree_map(jax.device_put, args, in_sh)
  outs = jax.jit(lambda *a: fwd_res(*a)[0], in_shardings=in_sh[:3])(*placed[:3])
  grads = jax.jit(fwd_bwd, in_shardings=in_sh)(*placed)
  return outs, grads


@pytest.mark.parametrize("mesh_shape", [(1, 4), (2, 2), (4, 2), (2, 4)])
def test_sharded_block_equals_unsharded(gpt, mesh_shape):
  _, ts, seq, _ = gpt
  dep = pieces.batch_dependent(seq.program, seq.input_kinds)
  piece = pieces.build_piece(seq, 1, 1, dep)    # block_0: attention, MLP, residuals
  assert seq[1].module == "block"
  rng = np.random.default_rng(0)
  args = jax.tree_util.tree_map(
      lambda s: jnp.asarray(rng.standard_normal(s.shape) * 0.3, s.dtype),
      pieces.abstract_inputs(piece))
  ref_out, ref_grads = _run(piece, (1, 1), args)
  out, grads = _run(piece, mesh_shape, args)
  # Relative to each leaf's largest value: sharded reductions sum in another order, and how
  # far an element near zero moves depends on the CPU's vector width; a wrong split is O(1).
  # A leaf whose exact gradient is zero (the key bias before the softmax) holds only rounding
  # noise: its scale is floored at 1% of the largest value of all leaves.
  ref = [np.asarray(x) for x in jax.tree_util.tree_leaves((ref_out, ref_grads))]
  got = [np.asarray(x) for x in jax.tree_util.tree_leaves((out, grads))]
  floor = 0.01 * max(float(np.max(np.abs(a))) for a in ref)
  for a, b in zip(ref, got):
    assert a.shape == b.shape
    err = float(np.max(np.abs(b - a))) / max(float(np.max(np.abs(a))), floor)
    assert err <= 2e-5, (err, a.shape)


def test_one_reduction_per_column_row_pair():
  """An MLP on tp=4: the forward needs exactly one all-reduce (after the row matmul)."""
  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(32)(nn.gelu(nn.Dense(128)(x)))

  m = MLP()
  x = jax.ShapeDtypeStruct((8, 32), jnp.float32)
  params = jax.eval_shape(m.init, jax.random.key(0), x)
  leaves, tree = jax.tree_util.tree_flatten(params)
  closed = jax.make_jaxpr(lambda ps, x: m.apply(jax.tree_util.tree_unflatten(tree, ps), x))(
      leaves, x)
  prog = from_closed_jaxpr(closed)
  pids = list(prog.invars[:len(leaves)])
  specs = S.param_specs(prog, prog.ops, pids, 4)
  mesh = S.make_mesh(jax.devices()[:4])

  def f(ps, x):
    return m.apply(jax.tree_util.tree_unflatten(tree, ps), x)
  in_sh = ([NamedSharding(mesh, specs[p]) for p in pids], NamedSharding(mesh, P()))
  hlo = jax.jit(f, in_shardings=in_sh).lower(leaves, x).compile().as_text()
  colls = pieces.parse_collectives(hlo)
  assert set(colls) == {"all-reduce"} and colls["all-reduce"][1] == 1
  assert colls["all-reduce"][0] == 8 * 32 * 4


def test_conv_weights_split_on_features():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Conv(8, (3, 3))(nn.relu(nn.Conv(16, (3, 3))(x)))

  m = Net()
  x = jax.ShapeDtypeStruct((2, 8, 8, 4), jnp.float32)
  params = jax.eval_shape(m.init, jax.random.key(0), x)
  leaves, tree = jax.tree_util.tree_flatten(params)
  closed = jax.make_jaxpr(lambda ps, x: m.apply(jax.tree_util.tree_unflatten(tree, ps), x))(
      leaves, x)
  prog = from_closed_jaxpr(closed)
  pids = list(prog.invars[:len(leaves)])
  plan = S.tp_plan(prog, prog.ops, pids, 4)
  shapes = {prog.avals[p].shape: plan.param_dims.get(p) for p in pids}
  assert shapes[(3, 3, 4, 16)] == 3     # first conv: output features (column)
  assert shapes[(16,)] == 0             # its bias follows
  assert shapes[(3, 3, 16, 8)] == 2     # second conv: input features (row)
  assert len(plan.row_ops) == 1


def test_parse_collectives():
  text = """
  %all-reduce.1 = f16[8,1024]{1,0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  %ag = (f32[4]{0}, f32[16]{0}) all-gather-start(%y), dimensions={0}
  %agd = f32[16]{0} all-gather-done(%ag)
  %t = (f32[2]{0}, bf16[2,2]{1,0}) all-reduce(%a, %b), to_apply=%add
  """
  got = pieces.parse_collectives(text)
  assert got["all-reduce"] == [8 * 1024 * 2 + 2 * 4 + 4 * 2, 2]
  assert got["all-gather"] == [64.0, 1]
