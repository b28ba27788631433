"""Time to the end of the first step: ``auto_parallel`` with no plan vs ``jax.jit``.

The first call of an automatically planned step traces it, cuts it into layers, costs every
(layer, submesh, logical mesh), plans, lays out and compiles the stages and runs; ``jax.jit``
traces, compiles and runs. Both clocks start at the first call and stop when its outputs are
ready (``jax.block_until_ready``). Every measurement runs in a fresh process, so JAX's
in-process caches do not help: ``jit``; harpjax **cold** (an empty profile cache:
``ProfileOptions(cache_dir=<new directory>)``); harpjax **warm** (a second process on the same
cache). Runs are interleaved and the median of ``--repeats`` is reported.

Models (8 fake CPU devices as the demo cluster, 4 V100 + 2 x 2 A100; batch 16, 4
microbatches):

* ``demo-gpt``: the demo's GPT (``harpjax/examples/demo.py``: hidden 64, 4 blocks, layer
  cuts marked, dropout);
* ``gpt2-small``: the repository's GPT shaped like GPT-2 (pre-LayerNorm, GELU, tied
  embedding, dropout 0.1) at reduced width: vocabulary 8192, sequence 64, hidden 256, 4 heads,
  4 blocks, no cuts marked (harpjax finds the layers);
* ``bert-small``: a BERT-style encoder built here with Flax (post-LayerNorm, bidirectional
  attention, token-type and position embeddings, masked-LM head tied to the embedding, dropout
  0.1): vocabulary 8192, sequence 64, hidden 256, 4 heads, 5 layers.

(HuggingFace ``transformers`` is not a dependency; these stand in for its small GPT-2 and BERT.)

For the plans, a further process per model costs the same layers with the XLA-compiled
analytic source and reports the predicted step time of the plan found from the default
(jaxpr) tables and of the plan found from the compiled tables, both scored on the compiled
tables.

``--compare-with DIR`` runs the cold and warm first steps of this checkout and of another
(``git archive <commit> | tar -x -C DIR``, its own copy of this script and its own harpjax),
interleaved, and prints both with the ratio of their CPU seconds.

Cold is an empty profile cache and an empty executable cache. The FLOP fits of random draws
read off XLA (``xla_fits.json`` in ``$HARPJAX_CACHE_DIR`` or ``~/.cache/harpjax/profiles``:
per JAX version, key type, bit width and rank, not per model) stay where the environment puts
them, as after any earlier run on the machine; point ``HARPJAX_CACHE_DIR`` at an empty
directory to measure a first run ever.

  python benchmarks/first_step.py [--repeats 3] [--models demo-gpt,gpt2-small,bert-small]
      [--compare-with DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = ("demo-gpt", "gpt2-small", "bert-small")
BATCH, MICROBATCHES = 16, 4
PHASES = ("trace", "plan", "layout", "compile", "run")


def _bert_module():
  import flax.linen as nn
  import jax.numpy as jnp

  class BertLayer(nn.Module):
    """Post-LayerNorm encoder layer: self-attention and a GELU MLP."""
    hidden: int
    heads: int
    dropout: float

    @nn.compact
    def __call__(self, x, train):
      drop = lambda y: nn.Dropout(self.dropout, deterministic=not train)(y)
      h = nn.MultiHeadDotProductAttention(self.heads, dropout_rate=self.dropout,
                                          deterministic=not train, name="attention")(x, x)
      x = nn.LayerNorm(name="ln_attention")(x + drop(h))
      h = nn.Dense(self.hidden, name="output")(nn.gelu(nn.Dense(4 * self.hidden,
                                                                 name="intermediate")(x)))
      return nn.LayerNorm(name="ln_output")(x + drop(h))

  class Bert(nn.Module):
    """Token ids ``[batch, seq]`` -> masked-LM logits ``[batch, seq, vocab]``."""
    vocab: int = 8192
    seq: int = 64
    hidden: int = 256
    heads: int = 4
    layers: int = 5
    dropout: float = 0.1

    @nn.compact
    def __call__(self, tokens, train: bool = False):
      embed = nn.Embed(self.vocab, self.hidden, name="word_embeddings")
      pos = self.param("position_embeddings", nn.initializers.normal(0.02),
                       (self.seq, self.hidden))
      kind = self.param("token_type_embeddings", nn.initializers.normal(0.02),
                        (2, self.hidden))
      x = embed(tokens) + pos[None, : tokens.shape[1]] + kind[0]
      x = nn.Dropout(self.dropout, deterministic=not train)(nn.LayerNorm(name="ln_embed")(x))
      for i in range(self.layers):
        x = BertLayer(self.hidden, self.heads, self.dropout, name=f"layer_{i}")(x, train)
      h = nn.LayerNorm(name="ln_head")(nn.gelu(nn.Dense(self.hidden, name="transform")(x)))
      bias = self.param("decoder_bias", nn.initializers.zeros, (self.vocab,))
      return embed.attend(h) + bias

  return Bert, jnp


def build(name: str):
  """``(step, args, cluster)`` of a model: concrete train state, tokens and a dropout key."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax.training import train_state

  import harpjax
  from harpjax.examples.demo import DEFAULT_CLUSTER, counting_batch, make_step
  from harpjax.models import GPT, GPTConfig

  if name in ("demo-gpt", "gpt2-small"):
    cfg = (GPTConfig(vocab_size=256, seq_len=32, hidden=64, num_heads=4, num_blocks=4,
                     dropout=0.1, layer_marks=2) if name == "demo-gpt" else
           GPTConfig(vocab_size=8192, seq_len=64, hidden=256, num_heads=4, num_blocks=4,
                     dropout=0.1, layer_marks=0))
    model, step = GPT(cfg), make_step()
    seq, vocab = cfg.seq_len, cfg.vocab_size
    params = model.init(jax.random.key(0), jnp.zeros((BATCH, seq), jnp.int32))
    tokens = counting_batch(jax.random.key(1), BATCH, seq, vocab)
  elif name == "bert-small":
    bert, _ = _bert_module()
    model = bert()
    seq, vocab = model.seq, model.vocab
    params = model.init(jax.random.key(0), jnp.zeros((BATCH, seq), jnp.int32))
    tokens = jax.random.randint(jax.random.key(1), (BATCH, seq), 1, vocab)

    def step(state, tokens, rng):
      def loss_fn(params):
        masked = (jnp.arange(seq) % 7 == 3)[None, :]       # 1 position in 7, token id 0
        logits = state.apply_fn(params, jnp.where(masked, 0, tokens), train=True,
                                rngs={"dropout": rng})
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
        return (ce * masked).sum() / (masked.sum() * tokens.shape[0])
      loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), loss
  else:
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(1e-3))
  return step, (state, tokens, jax.random.key(2)), DEFAULT_CLUSTER


def child(mode: str, name: str, cache_dir: str) -> dict:
  """One measurement in this (fresh) process."""
  import jax

  import harpjax
  from harpjax.compiler.profile import ProfileOptions

  step, args, cluster = build(name)
  jax.block_until_ready(args)
  if mode == "jit":
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(jax.jit(step)(*args))
    return {"total_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
  pstep = harpjax.auto_parallel(
      step, cluster=cluster, num_microbatches=MICROBATCHES,
      plan=harpjax.AutoPlan(profile=ProfileOptions(cache_dir=cache_dir)),
      runtime=harpjax.LocalRuntime(compilation_cache=os.path.join(cache_dir, "executables")))
  out, t0, c0 = {}, time.perf_counter(), time.process_time()
  t = t0
  for phase, run in zip(PHASES, (pstep.trace, pstep.plan, pstep.layout, pstep.compile,
                                 lambda *a: jax.block_until_ready(pstep(*a)))):
    run(*args)   # each phase is cached: together they are exactly the first call
    out[phase + "_s"], t = time.perf_counter() - t, time.perf_counter()
  out["total_s"], out["cpu_s"] = t - t0, time.process_time() - c0
  plan, profile = pstep.plan(*args), pstep.profile(*args)
  out.update(stages=plan.num_stages, predicted_s=plan.predicted_iteration_s,
             computed=profile.stats.computed, layers=len(profile.layers),
             profile_s=profile.stats.seconds)
  return out


def quality(name: str, cache_dir: str) -> dict:
  """The plans from the jaxpr and the compiled tables, both scored on the compiled tables."""
  import jax

  from harpjax.cluster import Cluster
  from harpjax.compiler.plan import evaluate_plan, solve
  from harpjax.compiler.profile import ProfileOptions, profile_step

  step, args, cluster = build(name)
  args = jax.eval_shape(lambda *a: a, *args)
  cluster = Cluster.load(cluster)
  out = {}
  res = {src: profile_step(step, args, cluster, num_microbatches=MICROBATCHES,
                           options=ProfileOptions(source=src, cache_dir=cache_dir))
         for src in ("jaxpr", "analytic")}
  compiled = res["analytic"].tables
  for src, r in res.items():
    plan = solve(r.tables, MICROBATCHES).plan
    ev = evaluate_plan(compiled, plan, MICROBATCHES)
    own = evaluate_plan(r.tables, plan, MICROBATCHES)
    out[src] = {"on_compiled_s": ev.iteration_s, "own_s": own.iteration_s,
                "feasible": ev.feasible, "stages": plan.num_stages,
                "profile_s": r.stats.seconds,
                "plan": [[list(s.layers), s.subcluster, list(s.submesh), list(s.logical_mesh)]
                         for s in plan.stages]}
  return out


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*argv, root: str = _REPO) -> dict:
  """One child process of ``root``'s copy of this script, importing ``root``'s harpjax."""
  env = dict(os.environ, PYTHONPATH=root)
  env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  env.setdefault("JAX_PLATFORMS", "cpu")
  res = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "first_step.py"),
                        *argv], capture_output=True, text=True, env=env)
  if res.returncode:
    raise SystemExit(f"{' '.join(argv)} failed:\n{res.stderr[-3000:]}")
  return json.loads(res.stdout.strip().splitlines()[-1])


def compare(names: list[str], other: str, repeats: int) -> None:
  """Cold and warm first steps of this checkout beside ``other``'s, interleaved."""
  trees = {"this": _REPO, "other": other}
  runs = {(t, n, m): [] for t in trees for n in names for m in ("cold", "warm")}
  with tempfile.TemporaryDirectory() as root:
    for r in range(repeats):
      for n in names:
        for t, tree in trees.items():
          cache = os.path.join(root, f"{t}-{n}-{r}")
          for m in ("cold", "warm"):
            runs[(t, n, m)].append(_run("--child", m, n, cache, root=tree))
          print(f"repeat {r + 1}/{repeats} {n} {t}: cold "
                f"{runs[(t, n, 'cold')][-1]['cpu_s']:.1f} CPU s, warm "
                f"{runs[(t, n, 'warm')][-1]['cpu_s']:.1f} CPU s", file=sys.stderr, flush=True)
  med = lambda t, n, m, k: statistics.median(x[k] for x in runs[(t, n, m)])
  ratio = lambda n, m: statistics.median(a["cpu_s"] / b["cpu_s"] for a, b in
                                         zip(runs[("this", n, m)], runs[("other", n, m)]))
  print(f"{os.cpu_count()} CPUs, 8 fake CPU devices; median of {repeats} fresh processes per "
        f"cell, interleaved; seconds to the end of the first step, wall / CPU; other: {other}\n")
  print("| model | cache | this tree s | other s | CPU ratio (this / other) |")
  print("|---|---|---|---|---|")
  for n in names:
    for m in ("cold", "warm"):
      cell = lambda t: f"{med(t, n, m, 'total_s'):.1f} / {med(t, n, m, 'cpu_s'):.1f}"
      print(f"| {n} | {m} | {cell('this')} | {cell('other')} | {ratio(n, m):.2f} |")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--models", default=",".join(MODELS))
  ap.add_argument("--no-quality", action="store_true",
                  help="skip costing with the compiled source (about a minute per model)")
  ap.add_argument("--json", help="also write every measurement to this file")
  ap.add_argument("--compare-with", metavar="DIR",
                  help="cold and warm first steps beside another checkout's (git archive)")
  ap.add_argument("--child", nargs=3, metavar=("MODE", "MODEL", "CACHE"),
                  help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    mode, name, cache = args.child
    print(json.dumps(quality(name, cache) if mode == "quality" else child(mode, name, cache)))
    return
  names = [m for m in args.models.split(",") if m]
  if args.compare_with:
    compare(names, os.path.abspath(args.compare_with), args.repeats)
    return
  runs = {(n, m): [] for n in names for m in ("jit", "cold", "warm")}
  qual = {}
  with tempfile.TemporaryDirectory() as root:
    for r in range(args.repeats):
      for n in names:
        cache = os.path.join(root, f"{n}-{r}")
        runs[(n, "jit")].append(_run("--child", "jit", n, cache))
        runs[(n, "cold")].append(_run("--child", "cold", n, cache))
        runs[(n, "warm")].append(_run("--child", "warm", n, cache))
        print(f"repeat {r + 1}/{args.repeats} {n}: jit {runs[(n, 'jit')][-1]['total_s']:.1f} s, "
              f"cold {runs[(n, 'cold')][-1]['total_s']:.1f} s, "
              f"warm {runs[(n, 'warm')][-1]['total_s']:.1f} s", file=sys.stderr)
    if not args.no_quality:
      for n in names:
        qual[n] = _run("--child", "quality", n, os.path.join(root, f"{n}-0"))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"runs": {f"{n}/{m}": v for (n, m), v in runs.items()}, "plans": qual}, f,
                indent=1)
  med = lambda n, m, k: statistics.median(x[k] for x in runs[(n, m)])
  # A ratio is the median over repeats of the ratio within a repeat (the three runs of a
  # repeat are consecutive: slow drifts in the machine's load cancel).
  ratio = lambda n, m, k: statistics.median(
      a[k] / b[k] for a, b in zip(runs[(n, m)], runs[(n, "jit")]))
  print(f"{os.cpu_count()} CPUs, 8 fake CPU devices; median of {args.repeats} fresh processes "
        "per cell; seconds to the end of the first step (wall clock; CPU seconds of the "
        "process, all threads, after /)\n")
  head = (f"{'model':<12}{'jit s':>11}{'cold s':>12}{'ratio':>11}{'warm s':>12}{'ratio':>11}"
          f"{'plan (jaxpr) ms':>17}{'plan (compiled) ms':>20}")
  print(head)
  for n in names:
    cell = lambda m: f"{med(n, m, 'total_s'):.1f} / {med(n, m, 'cpu_s'):.1f}"
    rat = lambda m: f"{ratio(n, m, 'total_s'):.1f} / {ratio(n, m, 'cpu_s'):.1f}"
    q = qual.get(n)
    cheap = f"{q['jaxpr']['on_compiled_s'] * 1e3:.2f}" if q else "-"
    best = f"{q['analytic']['on_compiled_s'] * 1e3:.2f}" if q else "-"
    print(f"{n:<12}{cell('jit'):>11}{cell('cold'):>12}{rat('cold'):>11}{cell('warm'):>12}"
          f"{rat('warm'):>11}{cheap:>17}{best:>20}")
  print(f"\nharpjax phases (median s; plan includes profile)\n{'':<18}"
        + "".join(f"{p:>9}" for p in PHASES[:2] + ("profile",) + PHASES[2:]))
  for n in names:
    for m in ("cold", "warm"):
      r0 = runs[(n, m)][0]
      print(f"{n:<12}{m:<6}" + "".join(f"{med(n, m, p + '_s'):>9.2f}"
                                      for p in PHASES[:2] + ("profile",) + PHASES[2:])
            + f"   {r0['layers']} layers, {r0['stages']} stages, {r0['computed']} tasks costed")
  if qual:
    print("\nplans (predicted step on the compiled tables; own: on the tables they came from; "
          "costing time with an empty cache)")
    for n, q in qual.items():
      for src in ("jaxpr", "analytic"):
        p = q[src]
        costed = med(n, "cold", "profile_s") if src == "jaxpr" else p["profile_s"]
        print(f"{n:<12}{src:<9} {p['on_compiled_s'] * 1e3:8.2f} ms (own {p['own_s'] * 1e3:.2f})"
              f"  costed in {costed:.1f} s  {p['stages']} stages {p['plan']}")


if __name__ == "__main__":
  main()
