"""Mixture-of-experts training on two GPU generations: zebra parallelism with asymmetric expert
assignment against expert parallelism, disaggregation without overlap and the ideal sum of
per-type expert-parallel clusters (HeterMoE's §6.2 settings), all costed by harpjax's model.

Costs: one Mixtral-shaped layer is two Flax functions, its *attention side* (pre-norm
attention with the residual, the post-attention norm and the router's top-2 softmax) and its
*experts* (SwiGLU FFNs, ``ffn = 3.5 hidden``, on the tokens routed to them). Each is traced,
cut into layers by harpjax's layer construction and its forward+backward
:class:`~harpjax.compiler.profile.calibration.Work` read off its jaxpr, as the default cost
source reads a layer; seconds on a GPU type are
:func:`~harpjax.compiler.profile.calibration.predict_time_s` at that type's calibrated
factors. Forward is a third of it and backward two thirds. All-to-all over ``p`` GPUs is
:func:`~harpjax.compiler.profile.collectives.collective_time_s` (``"all-to-all"``); a zebra
stage's bipartite one is :func:`~harpjax.compiler.schedule.zebra.bipartite_all_to_all_time_s`.

Methods, for the same global batch (``--seqs-per-gpu`` sequences per GPU of the cluster):

* ``EP``: every GPU holds attention and ``n / G`` experts and an equal share of the batch; per
  layer all GPUs wait for the slowest type's attention, then its experts (the all-to-all
  overlapped with the experts, as Tutel/Lina overlap it: ``max(experts, dispatch +
  combine)``);
* ``DistEP``: attention on the newer GPUs, experts on the older ones, one microbatch: the zebra
  simulator with ``R = 1``;
* ``EP (Ideal)``: EP run separately on each GPU type with the same per-GPU batch, throughputs
  summed (no cross-type communication);
* ``Zebra``: zebra parallelism (best ``R``), without and with asymmetric expert assignment
  (exhaustive when small, else Algorithm 1 + local search).

Run ``python benchmarks/moe.py`` (about a minute); ``--quick`` runs one setting. The table is
in docs/moe.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn                                               # noqa: E402
import jax                                                            # noqa: E402
import jax.numpy as jnp                                               # noqa: E402

from harpjax.cluster import GPU_CATALOG, Link                         # noqa: E402
from harpjax.compiler.layers import construct_layers, LayerOptions    # noqa: E402
from harpjax.compiler.plan.expert_assignment import (                 # noqa: E402
    ExpertAssignmentProblem, gather_and_squeeze, optimize_assignment)
from harpjax.compiler.profile import calibration as calib             # noqa: E402
from harpjax.compiler.profile import estimate                         # noqa: E402
from harpjax.compiler.profile import pieces as pieces_lib             # noqa: E402
from harpjax.compiler.profile.collectives import collective_time_s    # noqa: E402
from harpjax.compiler.schedule import simulate_zebra                  # noqa: E402
from harpjax.compiler.trace import from_closed_jaxpr                  # noqa: E402
from harpjax.models.gpt import Attention, GPTConfig                   # noqa: E402

TOP_K = 2
DTYPE_BYTES = 2


@dataclasses.dataclass(frozen=True)
class MoEModel:
  name: str
  layers: int
  hidden: int
  experts: int

  @property
  def ffn(self) -> int:
    return self.hidden * 7 // 2

  @property
  def heads(self) -> int:
    return self.hidden // 128


MODELS = {m.name: m for m in (            # HeterMoE Table 2
    MoEModel("Mixtral-W1", 4, 2048, 12), MoEModel("Mixtral-W2", 4, 2048, 24),
    MoEModel("Mixtral-D1", 8, 1024, 24), MoEModel("Mixtral-D2", 6, 1024, 18),
    MoEModel("Mixtral-D3", 8, 1024, 40))}


@dataclasses.dataclass(frozen=True)
class Setup:
  name: str
  new: str          # attention GPUs
  num_new: int
  old: str          # expert GPUs
  num_old: int
  gbps: float


SETUPS = {s.name: s for s in (             # HeterMoE Table 1
    Setup("O1", "A40", 6, "V100-16G", 6, 100), Setup("O2", "A40", 4, "V100-16G", 8, 100),
    Setup("C1", "L40S", 2, "T4", 6, 200), Setup("C2", "L40S", 2, "T4", 8, 200))}

RUNS = [("O1", "Mixtral-W1"), ("O1", "Mixtral-D1"), ("O2", "Mixtral-W2"), ("O2", "Mixtral-D1"),
        ("C1", "Mixtral-D1"), ("C2", "Mixtral-D3")]
SEQS = (4096, 8192, 16384, 32768)


# --------------------------------------------------------------------------- the two parts


class AttentionSide(nn.Module):
  """Everything of a Mixtral layer but its experts: ``x -> (x + attn(norm(x)), router)``."""
  cfg: GPTConfig
  experts: int

  @nn.compact
  def __call__(self, x):
    c = self.cfg
    x = x + Attention(c, name="attn")(nn.LayerNorm(dtype=c.dtype, name="ln_attn")(x))
    h = nn.LayerNorm(dtype=c.dtype, name="ln_moe")(x)
    logits = nn.Dense(self.experts, use_bias=False, dtype=jnp.float32, name="router")(h)
    gates, _ = jax.lax.top_k(jax.nn.softmax(logits, -1), TOP_K)
    return h, gates


class ExpertShare(nn.Module):
  """``e`` SwiGLU experts, each on its ``t`` routed tokens: ``[e, t, h] -> [e, t, h]``."""
  experts: int
  hidden: int
  ffn: int

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    e, h, f = self.experts, self.hidden, self.ffn
    w1 = self.param("w1", init, (e, h, f), jnp.float16)
    w3 = self.param("w3", init, (e, h, f), jnp.float16)
    w2 = self.param("w2", init, (e, f, h), jnp.float16)
    g = jnp.einsum("eth,ehf->etf", x, w1)
    u = jnp.einsum("eth,ehf->etf", x, w3)
    return jnp.einsum("etf,efh->eth", nn.silu(g) * u, w2)


def module_work(mod: nn.Module, x_shape) -> calib.Work:
  """Forward+backward Work of ``mod`` on an fp16 input of ``x_shape`` (layer construction and
  jaxpr reading, as the default cost source)."""
  x = jax.ShapeDtypeStruct(x_shape, jnp.float16)
  params = jax.eval_shape(mod.init, jax.random.key(0), x)
  leaves, tree = jax.tree_util.tree_flatten(params)
  closed = jax.make_jaxpr(lambda ps, x: mod.apply(jax.tree_util.tree_unflatten(tree, ps), x))(
      leaves, x)
  program = from_closed_jaxpr(closed)
  kinds = ["static"] * len(closed.consts) + ["param"] * len(leaves) + ["split"]
  layers = construct_layers(program, kinds, options=LayerOptions())
  dep = pieces_lib.batch_dependent(program, kinds)
  total = calib.Work()
  for i in range(len(layers)):
    traced = estimate.trace_piece(pieces_lib.build_piece(layers, i, i, dep))
    total = total + estimate.jaxpr_work(traced, (1, 1))
  return total


@functools.lru_cache(maxsize=None)
def attn_work(hidden: int, heads: int, experts: int, seq: int, seqs: int) -> calib.Work:
  cfg = GPTConfig(seq_len=seq, hidden=hidden, num_heads=heads, num_blocks=1, dtype="float16",
                  param_dtype="float16", softmax_dtype="float32", layer_marks=0)
  return module_work(AttentionSide(cfg, experts), (seqs, seq, hidden))


@functools.lru_cache(maxsize=None)
def expert_work(hidden: int, ffn: int, experts: int, tokens_each: int) -> calib.Work:
  return module_work(ExpertShare(experts, hidden, ffn), (experts, tokens_each, hidden))


def seconds(work: calib.Work, gpu: str) -> float:
  g = GPU_CATALOG[gpu]
  return float(calib.predict_time_s(work, g.peak_flops, g.mem_bandwidth_bytes_per_s,
                                    calib.efficiency_for(gpu)))


def attn_s(m: MoEModel, seq: int, seqs: float, gpu: str) -> float:
  """Attention side of ``seqs`` sequences (linear in whole sequences: traced at 1 and 2)."""
  w1 = attn_work(m.hidden, m.heads, m.experts, seq, 1)
  w2 = attn_work(m.hidden, m.heads, m.experts, seq, 2)
  return seconds(w1.interpolate(w2, seqs - 1), gpu)


def experts_s(m: MoEModel, experts: int, tokens: float, gpu: str) -> float:
  """``experts`` experts sharing ``tokens`` routed token copies evenly."""
  each = tokens / experts
  base = 1024
  w1 = expert_work(m.hidden, m.ffn, experts, base)
  w2 = expert_work(m.hidden, m.ffn, experts, 2 * base)
  return seconds(w1.interpolate(w2, each / base - 1), gpu)


# --------------------------------------------------------------------------- the methods


def link_of(setup: Setup) -> Link:
  return Link.from_gbps(setup.gbps, latency_us=5.0)


def ep_iteration_s(m: MoEModel, seq: int, gpus: list[tuple[str, int]], seqs_per_gpu: float,
                   link: Link) -> float:
  """Expert parallelism over every GPU listed (``[(type, count)]``), equal shares."""
  G = sum(c for _, c in gpus)
  tokens = seqs_per_gpu * seq * TOP_K          # routed copies each GPU computes (balanced)
  a = max(attn_s(m, seq, seqs_per_gpu, t) for t, _ in gpus)
  e = max(experts_s(m, m.experts // G, tokens, t) for t, _ in gpus)
  a2a = collective_time_s({"all-to-all": [tokens * m.hidden * DTYPE_BYTES, 1]}, G, link)
  # Forward (a third of the work): dispatch + combine under the experts; backward the same.
  per_layer = a + max(e / 3, 2 * a2a) + max(2 * e / 3, 2 * a2a)
  return m.layers * per_layer


def zebra_problem(m: MoEModel, s: Setup, seq: int, batch_seqs: int, R: int
                  ) -> ExpertAssignmentProblem:
  M, N = s.num_new, s.num_old
  seqs_attn = batch_seqs / (M * R)              # per attention GPU per microbatch
  tokens_mb = batch_seqs * seq / R * TOP_K      # routed copies of one microbatch
  ta = attn_s(m, seq, seqs_attn, s.new)
  te = experts_s(m, m.experts // N, tokens_mb / N, s.old)
  tx = experts_s(m, m.experts // N, tokens_mb / N, s.new)
  L = m.layers
  return ExpertAssignmentProblem(
      m.experts, M, N, R, [ta / 3] * L + [0.0], [2 * ta / 3] * L + [0.0], [te / 3] * L,
      [2 * te / 3] * L, [tx / 3] * L, [2 * tx / 3] * L,
      routed_bytes=[tokens_mb * m.hidden * DTYPE_BYTES] * L, link=link_of(s))


def run_one(m: MoEModel, s: Setup, seq: int, seqs_per_gpu: int) -> dict:
  G = s.num_new + s.num_old
  batch = seqs_per_gpu * G
  link = link_of(s)
  tokens = batch * seq
  ep = ep_iteration_s(m, seq, [(s.new, s.num_new), (s.old, s.num_old)], seqs_per_gpu, link)
  ideal_tput = sum(n * seqs_per_gpu * seq / ep_iteration_s(m, seq, [(t, n)], seqs_per_gpu, link)
                   for t, n in ((s.new, s.num_new), (s.old, s.num_old)))
  per_attn = batch // s.num_new
  best_zebra = best_asym = None
  dist = None
  for R in range(1, per_attn + 1):
    if per_attn % R:
      continue
    p = zebra_problem(m, s, seq, batch, R)
    t0 = p.iteration_time([0] * m.layers)
    if R == 1:
      dist = t0
    if best_zebra is None or t0 < best_zebra[0]:
      best_zebra = (t0, R)
    opt = optimize_assignment(p)
    if best_asym is None or opt.iteration_time < best_asym[0]:
      best_asym = (opt.iteration_time, R, opt.offload, gather_and_squeeze(p).iteration_time)
  return {"ep": tokens / ep, "dist": tokens / dist, "ideal": ideal_tput,
          "zebra": tokens / best_zebra[0], "zebra_R": best_zebra[1],
          "asym": tokens / best_asym[0], "asym_R": best_asym[1], "offload": best_asym[2],
          "alg1": tokens / best_asym[3]}


def part_ratios(m: MoEModel, s: Setup, seq: int) -> tuple[float, float]:
  """(attention, experts) speed-up of the newer GPU over the older one, one sequence."""
  a = attn_s(m, seq, 1, s.old) / attn_s(m, seq, 1, s.new)
  e = (experts_s(m, m.experts, seq * TOP_K, s.old)
       / experts_s(m, m.experts, seq * TOP_K, s.new))
  return a, e


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--quick", action="store_true", help="one setting only")
  ap.add_argument("--seqs-per-gpu", type=int, default=4)
  args = ap.parse_args(argv)
  runs = RUNS[:1] if args.quick else RUNS
  seqs = SEQS[:2] if args.quick else SEQS
  t_start = time.time()
  print("newer/older GPU speed-up per part (our cost model, one sequence):")
  for pair in dict.fromkeys((SETUPS[s].new, SETUPS[s].old) for s, _ in runs):
    s = next(SETUPS[x] for x, _ in runs if (SETUPS[x].new, SETUPS[x].old) == pair)
    cells = []
    for seq in seqs:
      a, e = part_ratios(MODELS["Mixtral-D1"], s, seq)
      cells.append(f"{seq // 1024}K attn {a:.2f}x experts {e:.2f}x")
    print(f"  {s.new} vs {s.old}: " + "; ".join(cells))
  print()
  header = ("| setup | model | seq | EP | DistEP | EP (Ideal) | Zebra | Zebra+Asym-EA "
            "(R, offload) | Alg. 1 only | vs EP | vs DistEP | vs Ideal |")
  print(header)
  print("|---" * 12 + "|")
  ratios = {"ep": [], "dist": [], "ideal": []}
  for sname, mname in runs:
    s, m = SETUPS[sname], MODELS[mname]
    for seq in seqs:
      r = run_one(m, s, seq, args.seqs_per_gpu)
      k = lambda v: f"{v / 1e3:.1f}"
      vs = {x: r["asym"] / r[x] for x in ratios}
      for x in ratios:
        ratios[x].append(vs[x])
      off = ",".join(map(str, r["offload"]))
      print(f"| {s.num_new}x{s.new}+{s.num_old}x{s.old} | {mname} | {seq // 1024}K | "
            f"{k(r['ep'])} | {k(r['dist'])} | {k(r['ideal'])} | {k(r['zebra'])} "
            f"(R={r['zebra_R']}) | {k(r['asym'])} (R={r['asym_R']}; {off}) | {k(r['alg1'])} | "
            f"{vs['ep']:.2f}x | {vs['dist']:.2f}x | {vs['ideal']:.2f}x |")
  print()
  for x, name in (("ep", "EP"), ("dist", "DistEP"), ("ideal", "EP (Ideal)")):
    v = ratios[x]
    print(f"Zebra+Asym-EA over {name}: mean {sum(v) / len(v):.2f}x, min {min(v):.2f}x, "
          f"max {max(v):.2f}x")
  print(f"(throughput in thousands of tokens/s; {time.time() - t_start:.0f} s)")


if __name__ == "__main__":
  main()
