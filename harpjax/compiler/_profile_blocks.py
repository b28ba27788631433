"""XLA statistics of the published models' transformer blocks (for calibration).

Each Zorse model's block is rebuilt in Flax (:data:`~._profile_calibration.ZORSE_MODELS`),
traced at the measured sequence length, cut into layers by :func:`construct_layers` and
costed per layer by :func:`~._profile_pieces.xla_stats` on one device: exactly what the
analytic profiler computes for a layer. Statistics are linear in the microbatch size (weights
are read once, activations scale), so microbatch sizes 1 and 2 are compiled and the rest
extrapolated.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from harpjax.compiler import _profile_cache, _profile_pieces
from harpjax.compiler._profile_calibration import ZORSE_MODELS
from harpjax.compiler.layers import LayerOptions, construct_layers
from harpjax.compiler.program import from_closed_jaxpr

log = logging.getLogger(__name__)

__all__ = ["block_program", "block_layer_stats"]


def block_program(model: str, seq: int, mbs: int, dtype=jnp.float16):
  """``(program, input_kinds)`` of one block of a Zorse model: ``x -> block(x)``."""
  from harpjax.models import gpt, llama
  family, hidden, heads, ffn = ZORSE_MODELS[model]
  if family == "gpt":
    cfg = gpt.GPTConfig(seq_len=seq, hidden=hidden, num_heads=heads, mlp_ratio=ffn // hidden,
                        num_blocks=1, dtype=dtype, param_dtype=dtype, fused_qkv=True)
    mod = gpt.Block(cfg)
  else:
    mod = llama.LlamaBlock(llama.LlamaConfig(hidden, heads, ffn, dtype, dtype))
  x = jax.ShapeDtypeStruct((mbs, seq, hidden), dtype)
  params = jax.eval_shape(mod.init, jax.random.key(0), x)
  leaves, tree = jax.tree_util.tree_flatten(params)
  closed = jax.make_jaxpr(
      lambda ps, x: mod.apply(jax.tree_util.tree_unflatten(tree, ps), x))(leaves, x)
  program = from_closed_jaxpr(closed)
  kinds = ["static"] * len(closed.consts) + ["param"] * len(leaves) + ["split"]
  return program, kinds


def block_layer_stats(cache_dir=None, progress: bool | None = None):
  """``stats(model, seq, mbs) -> [(flops, bytes_accessed)]`` per layer of the block."""
  db = _profile_cache.ProfileDB(cache_dir if cache_dir is not None
                                else _profile_cache.default_cache_dir())
  memo: dict = {}

  def at(model: str, seq: int, mbs: int):
    key = {"what": "zorse-block", "model": model, "seq": seq, "mbs": mbs, "dtype": "float16"}
    k = tuple(sorted(key.items()))
    if k in memo:
      return memo[k]
    got = db.get(key)
    if got is None:
      program, kinds = block_program(model, seq, mbs)
      layers = construct_layers(program, kinds, options=LayerOptions())
      dep = _profile_pieces.batch_dependent(program, kinds)
      dev = jax.devices()[:1]
      rows = []
      for i in range(len(layers)):
        st = _profile_pieces.xla_stats(_profile_pieces.build_piece(layers, i, i, dep), dev)
        rows.append([st.flops, st.bytes_accessed])
      got = {"layers": rows}
      db.put(key, got)
      log.info("block stats %s seq=%d mbs=%d: %d layers", model, seq, mbs, len(rows))
    memo[k] = [tuple(r) for r in got["layers"]]
    return memo[k]

  def stats(model: str, seq: int, mbs: int):
    one, two = at(model, seq, 1), at(model, seq, 2)
    return [tuple(a + (b - a) * (mbs - 1) for a, b in zip(r1, r2)) for r1, r2 in zip(one, two)]

  return stats
