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
* ``(d) Pipeline``: :func:`harpjax.compiler.plan.solve` on cost tables of the same per-block
  costs (each stage expert-parallel over its GPUs of one type), best ``B``;
* ``P+Z``: pipeline + zebra, two stages (a zebra stage, and a zebra or EP stage), estimated by
  Eq. 12 with each zebra stage's latency and period (not simulated).
* ``Planner (with zebra)``: :func:`harpjax.compiler.plan.solve` with zebra stages
  (``MixedOptions(zebra="on")``) on :func:`planner_tables` (the (d) tables with each
  block's expert part, ``routed_split``), best ``B``: the planner's own choice among pipeline
  stages, EP per stage, zebra groups and their GPU ratio (either type on attention), ``R`` and
  the expert assignment, simulated (:func:`best_planner`; a zebra microbatch's fixed share of
  the compute by :func:`fixed_share`).

Run ``python benchmarks/moe.py`` (about 8 minutes); ``--quick`` runs one setting (14 s). The
(d) and pipeline + zebra methods are described at :func:`pipeline_tables` and
:func:`best_pipeline_zebra`; the tables are
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
import numpy as np                                                    # noqa: E402

from harpjax import _compat                                           # noqa: E402
from harpjax.cluster import GPU_CATALOG, Link                         # noqa: E402
from harpjax.compiler.layers import construct_layers, LayerOptions    # noqa: E402
from harpjax.compiler.plan import (MixedOptions, SolveOptions,       # noqa: E402
                                   solve, zebra_stage_cost, ZebraOptions)
from harpjax.compiler.plan.expert_assignment import (                 # noqa: E402
    ExpertAssignmentProblem, gather_and_squeeze, optimize_assignment)
from harpjax.compiler.profile import CostTables, RoutedSplit          # noqa: E402
from harpjax.errors import InfeasiblePlanError                        # noqa: E402
from harpjax.compiler.profile import calibration as calib             # noqa: E402
from harpjax.compiler.profile import estimate                         # noqa: E402
from harpjax.compiler.profile import pieces as pieces_lib             # noqa: E402
from harpjax.compiler.profile.collectives import collective_time_s    # noqa: E402
from harpjax.compiler.schedule import simulate_zebra                  # noqa: E402
from harpjax.compiler.trace import from_closed_jaxpr                  # noqa: E402
from harpjax.models.gpt import Attention, GPTConfig                   # noqa: E402

TOP_K = 2
DTYPE_BYTES = 2
UNBOUNDED_BYTES = 1e30     # device memory of the pipeline's tables: memory is not modelled


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


ATTENTION = "cudnn"
"""How the attention side writes attention (``GPTConfig.attention``; ``--attention``):
``"cudnn"`` (``jax.nn.dot_product_attention(implementation="cudnn")``: costed as cuDNN's fused
kernel on GPU types that have it, A40 and L40S here, and as the XLA composition on V100 and
T4) or ``"einsum"`` (the composition on every type)."""


@functools.lru_cache(maxsize=None)
def attn_work(hidden: int, heads: int, experts: int, seq: int, seqs: int,
              attention: str = "einsum") -> calib.Work:
  cfg = GPTConfig(seq_len=seq, hidden=hidden, num_heads=heads, num_blocks=1, dtype="float16",
                  param_dtype="float16", softmax_dtype="float32", layer_marks=0,
                  attention=attention)
  with _compat.tracing_cudnn_attention():   # traced here, compiled on the GPUs
    return module_work(AttentionSide(cfg, experts), (seqs, seq, hidden))


@functools.lru_cache(maxsize=None)
def expert_work(hidden: int, ffn: int, experts: int, tokens_each: int) -> calib.Work:
  return module_work(ExpertShare(experts, hidden, ffn), (experts, tokens_each, hidden))


def seconds(work: calib.Work, gpu: str) -> float:
  g = GPU_CATALOG[gpu]
  return float(calib.predict_time_s(work, g.peak_flops, g.mem_bandwidth_bytes_per_s,
                                    calib.efficiency_for(gpu),
                                    fused_attention=g.fused_attention))


def attn_s(m: MoEModel, seq: int, seqs: float, gpu: str) -> float:
  """Attention side of ``seqs`` sequences (linear in whole sequences: traced at 1 and 2)."""
  w1 = attn_work(m.hidden, m.heads, m.experts, seq, 1, ATTENTION)
  w2 = attn_work(m.hidden, m.heads, m.experts, seq, 2, ATTENTION)
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


def zebra_problem(m: MoEModel, s: Setup, seq: int, batch_seqs: int, R: int, *,
                  num_attn: int | None = None, num_expert: int | None = None,
                  layers: int | None = None) -> ExpertAssignmentProblem:
  """A zebra stage of ``layers`` (default all) blocks, ``num_attn`` of the setup's newer GPUs
  for attention and ``num_expert`` of its older ones for experts (default all of each), on
  ``batch_seqs`` sequences cut into ``R`` microbatches."""
  M = s.num_new if num_attn is None else num_attn
  N = s.num_old if num_expert is None else num_expert
  L = m.layers if layers is None else layers
  seqs_attn = batch_seqs / (M * R)              # per attention GPU per microbatch
  tokens_mb = batch_seqs * seq / R * TOP_K      # routed copies of one microbatch
  ta = attn_s(m, seq, seqs_attn, s.new)
  te = experts_s(m, m.experts // N, tokens_mb / N, s.old)
  tx = experts_s(m, m.experts // N, tokens_mb / N, s.new)
  return ExpertAssignmentProblem(
      m.experts, M, N, R, [ta / 3] * L + [0.0], [2 * ta / 3] * L + [0.0], [te / 3] * L,
      [2 * te / 3] * L, [tx / 3] * L, [2 * tx / 3] * L,
      routed_bytes=[tokens_mb * m.hidden * DTYPE_BYTES] * L, link=link_of(s))


# --------------------------------------------------------------------------- (d) the pipeline


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def ep_block_s(m: MoEModel, s: Setup, seq: int, gpu: str, p: int, mb_seqs: int) -> float:
  """One block, forward+backward, of a microbatch of ``mb_seqs`` sequences on ``p`` GPUs of
  type ``gpu`` running expert parallelism over all ``p`` (logical mesh ``(1, 1, p)``): the EP
  column's model on those GPUs alone; ``inf`` where ``p`` divides neither the experts nor the
  microbatch's sequences (a sequence's attention is not split)."""
  if m.experts % p or mb_seqs % p:
    return math.inf
  return ep_iteration_s(m, seq, [(gpu, p)], mb_seqs / p, link_of(s)) / m.layers


def pipeline_tables(m: MoEModel, s: Setup, seq: int, mb_seqs: int,
                    gpu_hosts: bool = False) -> CostTables:
  """Cost tables of the model's blocks (one planner layer per block, so no stage splits a
  block's attention from its experts) on the setup's two GPU types, by the model the other
  columns use: a stage of blocks ``i..j`` on ``(1, p)`` takes ``(j - i + 1)`` times
  :func:`ep_block_s`; a cut sends a microbatch's hidden states (fp16) each way over the
  setup's link, which also joins the GPUs of one type (as in the EP column). Memory, gradient
  synchronisation and the optimizer step are left out, as in every column: device memory is
  unbounded and the tables have no end times. ``gpu_hosts``: each GPU a host of its own
  (submeshes ``(p, 1)``; the same link joins them, so the same costs), so that a zebra group
  of some GPUs of a type leaves the others to plain stages (a host holding a zebra group runs
  no plain stage)."""
  L = m.layers
  link = link_of(s)
  names, counts, times, meshes, subs = [], [], [], [], []
  for gpu, count in ((s.new, s.num_new), (s.old, s.num_old)):
    widths = list(range(1, count + 1))
    per_block = np.array([ep_block_s(m, s, seq, gpu, p, mb_seqs) for p in widths])
    t = np.full((L, L, len(widths)), np.inf)
    for i in range(L):
      for j in range(i, L):
        t[i, j] = (j - i + 1) * per_block
    mesh = np.zeros((L, L, len(widths), 3), dtype=np.int64)
    mesh[..., 0], mesh[..., 1], mesh[..., 2] = 1, 1, np.array(widths)
    names.append(gpu)
    counts.append(count)
    times.append(t)
    meshes.append(mesh)
    subs.append(tuple((p, 1) if gpu_hosts else (1, p) for p in widths))
  zeros = tuple(np.zeros((L, L, len(x))) for x in subs)
  return CostTables(
      num_layers=L, subcluster_names=tuple(names),
      num_hosts=tuple(counts) if gpu_hosts else (1, 1),
      devices_per_host=(1, 1) if gpu_hosts else tuple(counts),
      device_memory_bytes=(UNBOUNDED_BYTES,) * 2,
      submeshes=tuple(subs), stage_time_s=tuple(times), param_mem_bytes=zeros,
      act_mem_bytes=zeros,
      boundary_bytes=np.full(L, float(mb_seqs * seq * m.hidden * DTYPE_BYTES)),
      intra_bandwidth_bytes_per_s=(link.bandwidth_bytes_per_s,) * 2,
      intra_latency_s=(link.latency_s,) * 2,
      inter_bandwidth_bytes_per_s=(link.bandwidth_bytes_per_s,),
      inter_latency_s=(link.latency_s,), logical_mesh=tuple(meshes),
      layer_names=tuple(f"block_{i}" for i in range(L)))


def best_pipeline(m: MoEModel, s: Setup, seq: int, batch: int, cost_model: str = "simulator"):
  """(d): ``solve`` on :func:`pipeline_tables` for every microbatch count ``B`` dividing the
  batch; the fastest plan's (seconds, B, PlanResult). ``cost_model="eq12"`` ranks by HARP's
  Eq. 12 instead of the simulator (the seconds are then Eq. 12's)."""
  best = None
  for B in divisors(batch):
    tables = pipeline_tables(m, s, seq, batch // B)
    try:
      r = solve(tables, B, options=SolveOptions(mixed_stages="off", backend="sequential",
                                                cost_model=cost_model))
    except InfeasiblePlanError:
      continue
    t = r.iteration_s if cost_model == "simulator" else r.eq12_s
    if best is None or t < best[0]:
      best = (t, B, r)
  return best


def planner_tables(m: MoEModel, s: Setup, seq: int, mb_seqs: int) -> CostTables:
  """:func:`pipeline_tables` with each block's experts told apart (``routed_split``): on
  ``p`` GPUs of a type, a block's attention side is the EP column's attention of its
  ``mb_seqs / p`` sequences and its expert part the rest of the entry (the experts with
  whatever of EP's own all-to-all they do not hide: a zebra stage pays its bipartite
  all-to-all on top, so its expert side is pessimistic where EP's all-to-all shows); the
  routed bytes are the microbatch's token copies. Memory stays unmodelled (zero state and
  activations)."""
  tables = pipeline_tables(m, s, seq, mb_seqs, gpu_hosts=True)
  L = m.layers
  tokens = mb_seqs * seq * TOP_K
  expert = []
  for k, gpu in enumerate((s.new, s.old)):
    x = np.zeros((L, len(tables.submeshes[k])))
    for c, (p, _) in enumerate(tables.submeshes[k]):
      t = tables.stage_time_s[k][0, 0, c]
      if np.isfinite(t):
        x[:, c] = max(0.0, t - attn_s(m, seq, mb_seqs / p, gpu))
    expert.append(x)
  split = RoutedSplit(num_experts=[m.experts] * L, expert_time_s=expert,
                      expert_state_bytes=0.0, expert_act_bytes=0.0,
                      routed_bytes=float(tokens * m.hidden * DTYPE_BYTES))
  return tables.replace(routed_split=split, microbatch_rows=mb_seqs)


def fixed_share(m: MoEModel, s: Setup, seq: int, mb_seqs: int) -> float:
  """``alpha`` of the planner's zebra stages (``ZebraOptions.fixed_fraction``): the share of a
  block's attention (newer GPUs) plus experts (older GPUs) that does not halve with half the
  microbatch, ``2 t(b / 2) / t(b) - 1`` (our costs are affine in the rows above a few
  sequences: the weights are read whatever the rows)."""
  M, N = s.num_new, s.num_old
  t = lambda b: (attn_s(m, seq, b / M, s.new)
                 + experts_s(m, m.experts // N, b * seq * TOP_K / N, s.old))
  return min(max(2.0 * t(mb_seqs / 2) / t(mb_seqs) - 1.0, 0.0), 0.99)


def best_planner(m: MoEModel, s: Setup, seq: int, batch: int, zebra_options: ZebraOptions):
  """The planner with zebra stages (``MixedOptions(zebra="on")``, no data-parallel
  mixed-type stages) on :func:`planner_tables` for every ``B`` dividing the batch: the
  fastest simulated plan's (seconds, B, PlanResult)."""
  best = None
  for B in divisors(batch):
    zo = dataclasses.replace(zebra_options, fixed_fraction=fixed_share(m, s, seq, batch // B))
    mo = MixedOptions(zebra="on", min_link_ratio=math.inf, pair_candidates=0,
                      zebra_options=zo)
    tables = planner_tables(m, s, seq, batch // B)
    try:
      r = solve(tables, B, options=SolveOptions(mixed_stages="auto", backend="sequential",
                                                mixed_options=mo))
    except InfeasiblePlanError:
      continue
    if best is None or r.iteration_s < best[0]:
      best = (r.iteration_s, B, r)
  return best


def planner_model_s(m: MoEModel, s: Setup, seq: int, batch: int, R: int,
                    offload) -> float:
  """The Zebra+Asym-EA column's stage (every GPU, attention on the newer type, its ``R`` and
  offload, one pipeline microbatch) costed by the planner's own model:
  ``zebra_stage_cost`` on :func:`planner_tables` with :func:`fixed_share`, as
  :func:`best_planner` costs it at ``B = 1``. The planner's column is at least this fast (its
  search includes this stage); where this is slower than the column, the difference is the
  tables' (one ``alpha`` for every ``R``, entries from EP's model), not the search's."""
  tables = planner_tables(m, s, seq, batch)
  zo = dataclasses.replace(PLANNER_ZEBRA, fixed_fraction=fixed_share(m, s, seq, batch))
  attn = (0, tables.submeshes[0].index((s.num_new, 1)))
  expert = (1, tables.submeshes[1].index((s.num_old, 1)))
  c = zebra_stage_cost(tables, (0, m.layers - 1), attn, expert, batch, zo,
                       num_microbatches=R, offload=tuple(offload))
  return math.inf if c is None else c.time_s   # None: e.g. expert GPUs that do not divide
  #                                                the experts (the column spreads them unevenly)


def best_zebra_estimate(m: MoEModel, s: Setup, seq: int, batch: int) -> float:
  """Zebra alone (one stage, every GPU, no offload) by the pipeline estimate, best ``B``."""
  out = math.inf
  for B in divisors(batch):
    e = zebra_stage_estimate(m, s, seq, batch // B, s.num_new, s.num_old, m.layers)
    if e is not None:
      out = min(out, pipeline_estimate_s([e], 0.0, B))
  return out


def plan_text(r) -> str:
  """``A40 1+V100-16G 3 ...``: each stage's GPU type, blocks and devices, pipeline order."""
  out = []
  for st in r.plan.stages:
    i, j = st.layers
    if st.zebra is not None:
      z = st.zebra
      off = "" if not any(z.offload) else " o=" + ",".join(map(str, z.offload))
      out.append(f"Z({st.submesh[0] * st.submesh[1]}{st.subcluster[0]}+{z.num_devices}"
                 f"{z.subcluster[0]})"
                 f"[{i}-{j}] R={z.num_microbatches}{off}")
    else:
      out.append(f"{st.subcluster}[{i}-{j}]x{st.submesh[0] * st.submesh[1]}")
  return " ".join(out)


# --------------------------------------------------------------------------- pipeline + zebra


@dataclasses.dataclass(frozen=True)
class StageEstimate:
  """One stage of a pipeline, per microbatch: ``latency_s`` (its forward+backward chain, one
  microbatch alone) and ``period_s`` (its busiest stream: the steady-state time between
  microbatches)."""
  what: str
  latency_s: float
  period_s: float


@functools.lru_cache(maxsize=None)
def zebra_stage_estimate(m: MoEModel, s: Setup, seq: int, mb_seqs: int, M: int, N: int,
                         layers: int) -> StageEstimate | None:
  """A zebra stage of ``layers`` blocks on ``M`` newer (attention) + ``N`` older (experts)
  GPUs, every expert on the expert GPUs; ``None`` where ``N`` does not divide the experts or
  ``M`` the microbatch's sequences."""
  if M < 1 or N < 1 or m.experts % N or mb_seqs % M:
    return None
  c = zebra_problem(m, s, seq, mb_seqs, 1, num_attn=M, num_expert=N,
                    layers=1).costs([0])
  streams = {"attn": sum(c.attn_fwd_s) + sum(c.attn_bwd_s),
             "expert": sum(c.expert_fwd_s) + sum(c.expert_bwd_s),
             "dispatch": sum(c.dispatch_fwd_s) + sum(c.dispatch_bwd_s),
             "combine": sum(c.combine_fwd_s) + sum(c.combine_bwd_s)}
  return StageEstimate(f"Z({M}+{N})x{layers}", layers * sum(streams.values()),
                       layers * max(streams.values()))


@functools.lru_cache(maxsize=None)
def ep_stage_estimate(m: MoEModel, s: Setup, seq: int, mb_seqs: int, gpu: str, p: int,
                      layers: int) -> StageEstimate | None:
  """``layers`` blocks with expert parallelism on ``p`` GPUs of type ``gpu``."""
  t = layers * ep_block_s(m, s, seq, gpu, p, mb_seqs) if p >= 1 else math.inf
  if not math.isfinite(t):
    return None
  return StageEstimate(f"EP({p}{'N' if gpu == s.new else 'O'})x{layers}", t, t)


def pipeline_estimate_s(stages: list[StageEstimate], cut_s: float, B: int) -> float:
  """Eq. 12 with a zebra stage's latency and period told apart: ``sum_i (latency_i + 2 c) +
  (B - 1) max_i max(period_i, c)``; for stages of one stream (latency = period) it is HARP's
  Eq. 12."""
  cuts = len(stages) - 1
  period = max(max(x.period_s for x in stages), cut_s if cuts else 0.0)
  return sum(x.latency_s for x in stages) + 2 * cuts * cut_s + (B - 1) * period


def best_pipeline_zebra(m: MoEModel, s: Setup, seq: int, batch: int):
  """Pipeline + zebra, estimated: two stages over the setup's link, the first a zebra stage
  (``M_1`` newer + ``N_1`` older GPUs), the second a zebra stage on the rest or expert
  parallelism on up to the rest of one type (the order of the two does not change the
  estimate); every split of the blocks and GPUs, every ``B``
  dividing the batch; the best (estimated seconds, B, stages)."""
  L, best = m.layers, None
  for B in divisors(batch):
    b = batch // B
    link = link_of(s)
    cut = link.latency_s + b * seq * m.hidden * DTYPE_BYTES / link.bandwidth_bytes_per_s
    for l1 in range(1, L):
      for M1 in range(1, s.num_new + 1):
        for N1 in range(1, s.num_old + 1):
          first = zebra_stage_estimate(m, s, seq, b, M1, N1, l1)
          if first is None:
            continue
          M2, N2, l2 = s.num_new - M1, s.num_old - N1, L - l1
          rest = [zebra_stage_estimate(m, s, seq, b, M2, N2, l2)]
          rest += [ep_stage_estimate(m, s, seq, b, s.new, p, l2) for p in range(1, M2 + 1)]
          rest += [ep_stage_estimate(m, s, seq, b, s.old, p, l2) for p in range(1, N2 + 1)]
          for second in rest:
            if second is None:
              continue
            t = pipeline_estimate_s([first, second], cut, B)
            if best is None or t < best[0]:
              best = (t, B, (first, second))
  return best


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
  pipe = best_pipeline(m, s, seq, batch)
  planned = best_planner(m, s, seq, batch, PLANNER_ZEBRA)
  asym_by_planner = planner_model_s(m, s, seq, batch, best_asym[1], best_asym[2])
  pz = best_pipeline_zebra(m, s, seq, batch)
  zebra_est = pipeline_estimate_s(
      [zebra_stage_estimate(m, s, seq, batch // best_zebra[1], s.num_new, s.num_old,
                            m.layers)], 0.0, best_zebra[1])
  return {"ep": tokens / ep, "dist": tokens / dist, "ideal": ideal_tput,
          "zebra": tokens / best_zebra[0], "zebra_R": best_zebra[1],
          "asym": tokens / best_asym[0], "asym_R": best_asym[1], "offload": best_asym[2],
          "alg1": tokens / best_asym[3],
          "pipe": tokens / pipe[0], "pipe_B": pipe[1], "pipe_plan": plan_text(pipe[2]),
          "pipe_eq12_over_sim": pipe[2].eq12_s / pipe[2].iteration_s,
          "planner": tokens / planned[0], "planner_B": planned[1],
          "asym_by_planner": tokens / asym_by_planner,
          "planner_plan": plan_text(planned[2]),
          "planner_kind": plan_kind(planned[2]),
          "pz": tokens / pz[0], "pz_B": pz[1], "pz_stages": " then ".join(x.what for x in pz[2]),
          "zebra_est_over_sim": zebra_est / best_zebra[0],
          "est_zebra": tokens / best_zebra_estimate(m, s, seq, batch),
          "est_pipe": tokens / best_pipeline(m, s, seq, batch, cost_model="eq12")[0]}


PLANNER_ZEBRA = ZebraOptions(assignment_limit=4096, local_search=True, max_hosts_per_group=8)
"""The planner column's zebra search: every ``R`` up to 8, expert assignments exhaustively up
to 4096 of them, else local search from Algorithm 1's and from no offload (the search of the
Zebra+Asym-EA column, ``optimize_assignment``'s defaults), on every entry of every group
pair."""


def plan_kind(r) -> str:
  """``"zebra"`` (one zebra stage, nothing else), ``"pipeline+zebra"`` (a zebra stage among
  others) or ``"pipeline"``."""
  z = sum(1 for st in r.plan.stages if st.zebra is not None)
  if not z:
    return "pipeline"
  return "zebra" if r.plan.num_stages == 1 else "pipeline+zebra"


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
  ap.add_argument("--attention", choices=("cudnn", "einsum"), default="cudnn",
                  help="attention as cuDNN's fused kernel where the GPU has it (default), or "
                       "the einsum composition everywhere")
  args = ap.parse_args(argv)
  global ATTENTION
  ATTENTION = args.attention
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
            "(R, offload) | Alg. 1 only | (d) Pipeline | vs EP | vs DistEP | vs Ideal | vs (d) |")
  print(header)
  print("|---" * 14 + "|")
  ratios = {"ep": [], "dist": [], "ideal": [], "pipe": []}
  rows = []
  for sname, mname in runs:
    s, m = SETUPS[sname], MODELS[mname]
    for seq in seqs:
      r = run_one(m, s, seq, args.seqs_per_gpu)
      rows.append((s, mname, seq, r))
      k = lambda v: f"{v / 1e3:.1f}"
      vs = {x: r["asym"] / r[x] for x in ratios}
      for x in ratios:
        ratios[x].append(vs[x])
      off = ",".join(map(str, r["offload"]))
      print(f"| {s.num_new}x{s.new}+{s.num_old}x{s.old} | {mname} | {seq // 1024}K | "
            f"{k(r['ep'])} | {k(r['dist'])} | {k(r['ideal'])} | {k(r['zebra'])} "
            f"(R={r['zebra_R']}) | {k(r['asym'])} (R={r['asym_R']}; {off}) | {k(r['alg1'])} | "
            f"{k(r['pipe'])} | {vs['ep']:.2f}x | {vs['dist']:.2f}x | {vs['ideal']:.2f}x | "
            f"{vs['pipe']:.2f}x |")
  print()
  for x, name in (("ep", "EP"), ("dist", "DistEP"), ("ideal", "EP (Ideal)"),
                  ("pipe", "(d) Pipeline")):
    v = ratios[x]
    print(f"Zebra+Asym-EA over {name}: mean {sum(v) / len(v):.2f}x, min {min(v):.2f}x, "
          f"max {max(v):.2f}x")
  print()
  print("The planner with zebra stages (one search over pipeline stages, EP per stage, zebra "
        "groups and their GPU ratio, R and the expert assignment; simulated):")
  print("| setup | model | seq | Zebra+Asym-EA | its stage by the planner's model | (d) Pipeline "
        "| Planner (with zebra) (B; stages) | kind | over Zebra | over its stage by the "
        "planner's model | over (d) | over EP | over EP (Ideal) |")
  print("|---" * 13 + "|")
  kinds = {"pipeline": 0, "zebra": 0, "pipeline+zebra": 0}
  both = []
  over = {"ep": [], "ideal": [], "asym": [], "asym_by_planner": [], "pipe": []}
  for s, mname, seq, r in rows:
    k = lambda v: f"{v / 1e3:.1f}" if v > 0 else "-"
    kinds[r["planner_kind"]] += 1
    for x in over:
      if r[x] > 0:      # 0: the planner's model has no such stage (see planner_model_s)
        over[x].append(r["planner"] / r[x])
    by_model = (f"{r['planner'] / r['asym_by_planner']:.3f}x" if r["asym_by_planner"] > 0
                else "-")
    if r["planner_kind"] == "pipeline+zebra" and r["planner"] > max(r["asym"], r["pipe"]):
      both.append(f"{s.name} {mname} {seq // 1024}K")
    print(f"| {s.num_new}x{s.new}+{s.num_old}x{s.old} | {mname} | {seq // 1024}K | "
          f"{k(r['asym'])} | {k(r['asym_by_planner'])} | {k(r['pipe'])} | "
          f"{k(r['planner'])} (B={r['planner_B']}; {r['planner_plan']}) | "
          f"{r['planner_kind']} | {r['planner'] / r['asym']:.2f}x | "
          f"{by_model} | {r['planner'] / r['pipe']:.2f}x | {r['planner'] / r['ep']:.2f}x | "
          f"{r['planner'] / r['ideal']:.2f}x |")
  print()
  for x, name in (("ep", "EP"), ("ideal", "EP (Ideal)"), ("asym", "Zebra+Asym-EA"),
                  ("asym_by_planner", "Zebra+Asym-EA's stage by the planner's model"),
                  ("pipe", "(d) Pipeline")):
    v = over[x]
    print(f"Planner (with zebra) over {name}: mean {sum(v) / len(v):.2f}x, min {min(v):.2f}x, "
          f"max {max(v):.2f}x")
  print("planner's choice: " + ", ".join(f"{name} in {n} of {len(rows)}"
                                         for name, n in kinds.items()))
  print("pipeline + zebra beats both zebra alone and (d): "
        + (", ".join(both) if both else "nowhere"))
  print()
  print("(d) and pipeline + zebra (P+Z, estimated: two stages, Eq. 12 with each zebra stage's "
        "latency and period):")
  print("| setup | model | seq | Zebra+Asym-EA | (d) Pipeline (B; stages) | P+Z est. (B; stages) "
        "| P+Z over the better | best | est.: Zebra / (d) / P+Z | best by est. |")
  print("|---" * 10 + "|")
  wins = {"P+Z": 0, "Zebra": 0, "(d)": 0}
  est_wins = {"P+Z": 0, "Zebra": 0, "(d)": 0}
  for s, mname, seq, r in rows:
    k = lambda v: f"{v / 1e3:.1f}"
    better = max(r["asym"], r["pipe"])
    best = "P+Z" if r["pz"] > better else ("Zebra" if r["asym"] >= r["pipe"] else "(d)")
    wins[best] += 1
    est = {"Zebra": r["est_zebra"], "(d)": r["est_pipe"], "P+Z": r["pz"]}
    best_est = max(est, key=est.get)
    est_wins[best_est] += 1
    print(f"| {s.num_new}x{s.new}+{s.num_old}x{s.old} | {mname} | {seq // 1024}K | "
          f"{k(r['asym'])} | {k(r['pipe'])} (B={r['pipe_B']}; {r['pipe_plan']}) | "
          f"{k(r['pz'])} (B={r['pz_B']}; {r['pz_stages']}) | {r['pz'] / better:.2f}x | {best} | "
          f"{k(est['Zebra'])} / {k(est['(d)'])} / {k(est['P+Z'])} | {best_est} |")
  print()
  print("best (P+Z's estimate against the others' simulated times): "
        + ", ".join(f"{name} in {n} of {len(rows)}" for name, n in wins.items()))
  print("best, all three by the estimate: "
        + ", ".join(f"{name} in {n} of {len(rows)}" for name, n in est_wins.items()))
  ze = [r["zebra_est_over_sim"] for *_, r in rows]
  pe = [r["pipe_eq12_over_sim"] for *_, r in rows]
  print(f"the estimate over the simulated time: zebra alone (its R) {min(ze):.3f}-{max(ze):.3f}; "
        f"Eq. 12 of (d)'s plans {min(pe):.3f}-{max(pe):.3f}")
  print(f"(throughput in thousands of tokens/s; {time.time() - t_start:.0f} s)")


if __name__ == "__main__":
  main()
