"""Time from a model's abstract state to its layers, this tree beside an earlier revision.

What is timed is what ``python -m harpjax plan`` and ``auto_parallel`` do before costing:
:func:`harpjax.compiler.trace.trace_step` of the train step from ``jax.ShapeDtypeStruct`` s
(nothing is allocated) and :func:`harpjax.compiler.layers.layers_for_step` of the trace. The
model's abstract state (``jax.eval_shape`` of its initialisation) is built before the clock
starts. Models:

* ``gpt-39b``, ``gpt-15b``: the built-in GPTs (48 blocks; hidden 8192 and 5120), Adam,
  microbatches of 8 sequences of 1024 tokens;
* ``bert-large``: a user's own Flax model, written here as one would for Flax alone: a
  post-LayerNorm BERT-large encoder (24 layers, hidden 1024, 16 heads, sequence 512, vocabulary
  30522) on ``nn.MultiHeadDotProductAttention``, masked-LM head tied to the embedding, AdamW.

Each (revision, model) runs in a fresh process: one **cold** call (the first in the process:
JAX's caches of its own functions empty) and ``--repeats`` **warm** calls, of which the median
is reported, wall-clock and CPU seconds of the process (on a shared machine the CPU seconds
say more). Revisions run interleaved. The earlier revision (``--before``, default the commit
before the tracing shortcuts) is extracted with ``git archive`` into a temporary directory.
Both must give the same layers: the script compares each layer (signature, op range, FLOPs,
parameter and boundary bytes) and the region program's op sequence and fails if they differ.

With ``--local 2,4,8`` it also times the traces the profiler makes on a cold profile cache, one
per data-parallel degree ``dp``: the step traced again at ``dp`` times the microbatches
(``profile_step``'s ``local``).

  python benchmarks/trace_speed.py [--models gpt-39b,gpt-15b,bert-large] [--repeats 3]
                                   [--before REV|none] [--local 2,4,8] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = ("gpt-39b", "gpt-15b", "bert-large")
BEFORE = "1ee0dbd"
"""The commit before the tracing shortcuts (the microbatch trace ending at the region, Flax's
shape check memoised, the collector paused)."""
NUM_MICROBATCHES = 64


# --------------------------------------------------------------------------- the user's model


def _bert_spec(num_microbatches: int, microbatch_size: int = 8):
  """``(step, (state, batch))`` of a BERT-large masked-LM step, abstract."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import optax
  from flax.training import train_state

  import harpjax

  vocab, seq, hidden, heads, depth = 30522, 512, 1024, 16, 24

  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
      h = nn.MultiHeadDotProductAttention(heads, dtype=jnp.float16, name="attention")(
          x, x, mask=mask)
      x = nn.LayerNorm(dtype=jnp.float16, name="ln_attention")(x + h)
      h = nn.Dense(4 * hidden, dtype=jnp.float16, name="intermediate")(x)
      h = nn.Dense(hidden, dtype=jnp.float16, name="output")(nn.gelu(h))
      return nn.LayerNorm(dtype=jnp.float16, name="ln_output")(x + h)

  class Bert(nn.Module):
    @nn.compact
    def __call__(self, tokens, types):
      embed = nn.Embed(vocab, hidden, name="word_embeddings")
      pos = nn.Embed(seq, hidden, name="position_embeddings")(jnp.arange(tokens.shape[1]))
      x = embed(tokens) + pos[None] + nn.Embed(2, hidden, name="type_embeddings")(types)
      x = nn.LayerNorm(name="ln_embed")(x).astype(jnp.float16)
      mask = nn.make_attention_mask(tokens > 0, tokens > 0)
      for i in range(depth):
        x = Layer(name=f"layer_{i}")(x, mask)
      return embed.attend(x.astype(jnp.float32))

  model = Bert()
  tx = optax.adamw(1e-4)
  rows = microbatch_size * num_microbatches

  def create(key):
    toks = jnp.zeros((1, seq), jnp.int32)
    params = model.init(key, toks, toks)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def step(state, batch):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch["tokens"], batch["types"])
      logp = jax.nn.log_softmax(logits, axis=-1)
      nll = -jnp.take_along_axis(logp, batch["labels"][..., None], axis=-1)[..., 0]
      return jnp.sum(nll * batch["weights"]) / jnp.maximum(jnp.sum(batch["weights"]), 1.0)
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  state = jax.eval_shape(create, jax.random.key(0))
  ints = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
  batch = {"tokens": ints, "types": ints, "labels": ints,
           "weights": jax.ShapeDtypeStruct((rows, seq), jnp.float32)}
  return step, (state, batch)


def _spec(name: str, num_microbatches: int):
  if name == "bert-large":
    return _bert_spec(num_microbatches)
  from harpjax.models import BUILTIN_MODELS
  spec = BUILTIN_MODELS[name](num_microbatches=num_microbatches)
  return spec.step_fn, spec.args


# --------------------------------------------------------------------------- one process


def _child(name: str, repeats: int, local: list[int]) -> dict:
  """Runs in the revision's process: times trace_step + layers_for_step."""
  import harpjax
  from harpjax.compiler.layers import layers_for_step
  from harpjax.compiler.trace import trace_step

  B = NUM_MICROBATCHES
  t0 = time.perf_counter()
  step, args = _spec(name, B)
  state_s = time.perf_counter() - t0

  def once(num_microbatches=B, **kw):
    w, c = time.perf_counter(), time.process_time()
    ts = trace_step(step, args, num_microbatches=num_microbatches, **kw)
    w1, c1 = time.perf_counter(), time.process_time()
    layers = layers_for_step(ts)
    w2, c2 = time.perf_counter(), time.process_time()
    return ts, layers, {"wall_s": w2 - w, "cpu_s": c2 - c, "trace_wall_s": w1 - w,
                        "trace_cpu_s": c1 - c, "layers_wall_s": w2 - w1,
                        "layers_cpu_s": c2 - c1}

  ts, layers, cold = once()
  warm = [once()[2] for _ in range(repeats)]
  local_s = {}
  for dp in local:
    # As profile_step's local traces: the step at dp times the microbatches.
    w, c = time.perf_counter(), time.process_time()
    trace_step(step, args, num_microbatches=B * dp, batch_coupling="per_microbatch")
    local_s[dp] = {"wall_s": time.perf_counter() - w, "cpu_s": time.process_time() - c}
  ops = hashlib.blake2b(repr([(op.name, tuple(op.invars), tuple(op.outvars), op.name_stack)
                              for op in ts.region.ops]).encode(), digest_size=8).hexdigest()
  layer_rows = [(l.signature, l.start, l.end, l.flops, l.param_bytes, l.boundary_bytes,
                 l.module, l.position) for l in layers]
  return {"model": name, "harpjax": os.path.dirname(harpjax.__file__), "state_s": state_s,
          "cold": cold, "warm": warm, "local": local_s, "summary": layers.summary,
          "region_ops": len(ts.region.ops), "region_digest": ops,
          "layers_digest": hashlib.blake2b(repr(layer_rows).encode(),
                                           digest_size=8).hexdigest()}


def _run_child(src: str, name: str, repeats: int, local: list[int]) -> dict:
  env = dict(os.environ, PYTHONPATH=src, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name,
                        "--repeats", str(repeats), "--local", ",".join(map(str, local))],
                       env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True,
                       check=False)
  if out.returncode != 0:
    raise SystemExit(f"{name} with {src} failed:\n{out.stderr[-4000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def _extract(rev: str, into: str) -> str:
  archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "harpjax"], check=True,
                           capture_output=True).stdout
  subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
  return into


def _median(rows: list[dict], key: str) -> float:
  return statistics.median(r[key] for r in rows)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--models", default=",".join(MODELS))
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--before", default=BEFORE, help="revision to compare with, or 'none'")
  ap.add_argument("--local", default="", help="data-parallel degrees of the profiler's traces")
  ap.add_argument("--json", default=None, help="write the measurements here")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  local = [int(x) for x in a.local.split(",") if x]
  if a.child:
    print(json.dumps(_child(a.child, a.repeats, local)))
    return 0

  tmp = tempfile.mkdtemp(prefix="harpjax-before-")
  try:
    versions = [("now", ROOT)]
    if a.before != "none":
      versions.append((f"before ({a.before})", _extract(a.before, tmp)))
    results: dict = {}
    for name in a.models.split(","):
      for label, src in versions:   # interleaved: the machine's load falls on both alike
        results[(name, label)] = _run_child(src, name, a.repeats, local)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)

  ok = True
  print(f"B={NUM_MICROBATCHES} microbatches; trace_step + layers_for_step, seconds "
        f"(median of {a.repeats} warm calls; cold = first call in the process)")
  print(f"{'model':<11} {'revision':<20} {'warm wall':>9} {'warm cpu':>9} {'trace cpu':>9} "
        f"{'layers cpu':>10} {'cold wall':>9} {'cold cpu':>9}  layers")
  for name in a.models.split(","):
    rows = []
    for label, _ in versions:
      r = results[(name, label)]
      rows.append(r)
      print(f"{name:<11} {label:<20} {_median(r['warm'], 'wall_s'):9.2f} "
            f"{_median(r['warm'], 'cpu_s'):9.2f} {_median(r['warm'], 'trace_cpu_s'):9.2f} "
            f"{_median(r['warm'], 'layers_cpu_s'):10.2f} {r['cold']['wall_s']:9.2f} "
            f"{r['cold']['cpu_s']:9.2f}  {r['summary']}")
      for dp, t in r["local"].items():
        print(f"{'':<11} {'':<20} profiler trace at dp={dp}: {t['wall_s']:.2f} s wall, "
              f"{t['cpu_s']:.2f} s cpu")
    if len(rows) == 2:
      now, before = rows
      same = (now["layers_digest"], now["region_digest"]) == \
          (before["layers_digest"], before["region_digest"])
      ok &= same
      print(f"{name:<11} {'before / now':<20} "
            f"{_median(before['warm'], 'wall_s') / _median(now['warm'], 'wall_s'):8.2f}x "
            f"{_median(before['warm'], 'cpu_s') / _median(now['warm'], 'cpu_s'):8.2f}x "
            f"{'':>20} {before['cold']['wall_s'] / now['cold']['wall_s']:8.2f}x "
            f"{before['cold']['cpu_s'] / now['cold']['cpu_s']:8.2f}x  "
            f"{'same layers and region' if same else 'DIFFERENT layers or region'}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({f"{m}|{v}": r for (m, v), r in results.items()}, f, indent=1)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
