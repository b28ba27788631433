"""Zorse (Guo et al., "Zorse: Optimizing LLM Training Efficiency on Heterogeneous GPU Clusters",
``papers/zorse.txt`` beside the design) as a baseline: its clusters, its planner's choices and
the throughput it reports, and our planner on the same ten model/cluster rows.

A developer tool (``benchmarks/peers.py`` and ``benchmarks/mixed_stages.py`` use it), not part
of the library. Three parts:

* **What Zorse reports, quoted.** :data:`CLUSTERS` (its Table 4: VMs, GPUs per VM, regions,
  sequence lengths of §6.1), :data:`ZORSE_CHOICES` (its planner's GPU groups and ministages as
  §6.2 and §6.6 describe them; the paper gives no microbatch sizes or layer splits) and
  :data:`ROWS`, the ten rows of its Table 5: Zorse's TFLOPs and HFU and those it measured for
  TorchTitan-Het, HexiScale and Cephalo (``None`` where it reports OOM).
* **Zorse's throughput as an iteration time.** Zorse's TFLOPs are *its* FLOP count over its
  measured iteration: ``compute_model_flops`` in its public code (``utils/train_utils.py`` of
  benson-guo/zorse) counts ``4.5 x (2 N s + 4 L h s^2)`` FLOPs per sequence (forward 1,
  backward 2, recomputation 1, optimizer 0.5; ``N`` all parameters, ``L`` layers, ``h``
  hidden, ``s`` the sequence length) over a global batch of 1M tokens (§6.1; here ``2^20``).
  :func:`zorse_iteration_s` inverts it: the seconds per iteration Zorse measured. Its HFU
  divides by the GPUs' peaks of its code's ``GPU_TFLOPs`` table (H100-NVL 835, A100 312,
  A10G 125, V100-16G 112, T4 65 TFLOPs), which the ten rows reproduce to 0.1%; its Table 4
  totals for clusters B and C (8112, 8240) do not match that table (7848, 10032) and are not
  what its HFU divides by.
* **Our planner on the same rows.** :func:`zorse_tables` builds the cost tables of a LLaMA
  model (transformer blocks only, one layer per block) on a cluster from Zorse's own per-GPU
  measurements (``zorse_model_latencies.json``: the linear fit of one layer's forward and
  backward milliseconds against the microbatch size), and :func:`plan_row` runs
  :func:`harpjax.compiler.plan.solve` on them. **Recomputation is charged as Zorse charges
  it**: Zorse checkpoints every layer (§4.1.3) and its latency model counts a backward as
  backward plus forward (``calculate_pipeline_latency`` in its ``zorse_optimizer/
  optimizer.py``); our tables carry both modes per stage (:func:`~harpjax.compiler.profile.
  with_remat_choice`): ``"full"`` keeps each layer's input per microbatch and costs forward +
  (forward + backward), ``"none"`` costs forward + backward and keeps the layer's residuals,
  counted from the program (:func:`layer_residual_bytes`, the ``jax.vjp`` residuals of
  :class:`tools.llama.LlamaBlock` at the row's shape; checked against XLA's
  ``memory_analysis`` by the test). The planner chooses per stage; on these rows the
  residuals of the unfused attention (several bytes per score: 0.55 GB per 1024-token
  sequence of a 7B layer) fit only on a few stages of clusters B and C, so most stages
  recompute.

What our tables keep of Zorse's setting, and what they do not (each marked where it favours
one side): the per-layer times are Zorse's measurements (PyTorch kernels; ours would be XLA's);
16 bytes of state per parameter (fp16 weights and gradients, fp32 Adam: Zorse's own
multiplier), of which 12 optimizer state, so our planner may choose ZeRO levels and host
offload of the optimizer state per stage (``optimizer_share=0.75``) and host offload of the
residuals; tensor parallelism inside a host with its all-reduces (4 per layer and microbatch,
6 with recomputation); the embedding and head are left out on both sides' times (Zorse's FLOP
count includes them: this favours us by under 2% on 7B). Links: cluster A's 50 Gbps between
hosts is the paper's (§6.2); B's and C's 25 Gbps inside a region and 5 Gbps between C's two
regions are ours (the paper plots AWS bandwidths in Fig. 2 but states none); device to host
memory 25 GB/s on PCIe 4 hosts (H100, A100, A10G), 12 GB/s on PCIe 3 hosts (V100, T4), ours.
The fits are evaluated at the whole microbatch on one device and divided over a stage's
devices (the analytic tables' rule), which spreads the per-call intercept (0-20% of a layer at
4 rows) over the devices: this favours us. Zorse's interleaved ministages with parameter
offload and its interleaved optimizer updates have no counterpart in our plans: that favours
Zorse on the memory-bound rows, and is what its rows measure.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from harpjax.cluster import Link
from harpjax.compiler.plan import PlanResult, SolveOptions, solve
from harpjax.compiler.profile import (CostTables, LayerProfile, SubclusterSpec,
                                      with_remat_choice)
from harpjax.compiler.profile.calibration import load_zorse, load_zorse_stats
from harpjax.errors import InfeasiblePlanError, PlanError

__all__ = ["ZorseGPU", "GPUS", "Pool", "ZorseCluster", "CLUSTERS", "ZorseChoice",
           "ZORSE_CHOICES", "ZorseRow", "ROWS", "LLAMA_SHAPES", "GLOBAL_TOKENS",
           "zorse_model_flops", "zorse_iteration_s", "zorse_hfu_pct", "layer_fits_s",
           "layer_residual_bytes", "zorse_tables", "RowPlan", "plan_row", "row_by_name"]

GiB = 2.0 ** 30
GBPS = 1e9 / 8
GLOBAL_TOKENS = 2 ** 20     # "a global batch size of 1 million tokens" (§6.1)


# --------------------------------------------------------------------------- Zorse's setting


@dataclasses.dataclass(frozen=True)
class ZorseGPU:
  """One GPU type of Zorse's clusters.

  Attributes:
    name: our name.
    key: its key in Zorse's measurements (``zorse_model_latencies.json``).
    memory_bytes: device memory (Table 3).
    peak_flops: fp16 FLOP/s Zorse's HFU divides by (its code's ``GPU_TFLOPs``).
    table3_tflops: the TFLOPs its Table 3 prints (H100-NVL 989 and V100 125 there, which its
      HFU does not use).
    host_bytes_per_s: link inside a host (NVLink/NVSwitch or PCIe), ours.
    offload_bytes_per_s: device to host memory, one direction (PCIe generation), ours.
  """
  name: str
  key: str
  memory_bytes: float
  peak_flops: float
  table3_tflops: float
  host_bytes_per_s: float
  offload_bytes_per_s: float


GPUS = {
    "H100-NVL": ZorseGPU("H100-NVL", "h100-nvl", 94 * GiB, 835e12, 989, 450e9, 25e9),
    "A100-80G": ZorseGPU("A100-80G", "a100x80", 80 * GiB, 312e12, 312, 300e9, 25e9),
    "A100-40G": ZorseGPU("A100-40G", "a100x40", 40 * GiB, 312e12, 312, 300e9, 25e9),
    "A10G": ZorseGPU("A10G", "a10g", 24 * GiB, 125e12, 125, 32e9, 25e9),
    "V100-16G": ZorseGPU("V100-16G", "v100x16", 16 * GiB, 112e12, 125, 150e9, 12e9),
    "T4": ZorseGPU("T4", "t4", 16 * GiB, 65e12, 65, 16e9, 12e9),
}


@dataclasses.dataclass(frozen=True)
class Pool:
  """Hosts of one GPU type in one region: a subcluster of our tables."""
  name: str
  gpu: str
  num_hosts: int
  devices_per_host: int
  region: int = 1

  @property
  def num_devices(self) -> int:
    return self.num_hosts * self.devices_per_host


@dataclasses.dataclass(frozen=True)
class ZorseCluster:
  """One of Zorse's clusters (Table 4) with the sequence length it trains on there (§6.1).

  Attributes:
    name: ``"A"``, ``"B"`` or ``"C"``.
    label: a short description.
    pools: the hosts, one pool per GPU type and region.
    seq_len: tokens per sequence (4096, 1024, 512).
    inter_gbps: link between hosts of one region (A: the paper's 50 Gbps; B, C: ours).
    cross_gbps: link between regions (C only; ours).
    table4_tflops: the total Table 4 prints.
    link_source: where ``inter_gbps`` comes from.
  """
  name: str
  label: str
  pools: tuple[Pool, ...]
  seq_len: int
  inter_gbps: float
  cross_gbps: float | None
  table4_tflops: float
  link_source: str

  @property
  def num_devices(self) -> int:
    return sum(p.num_devices for p in self.pools)

  @property
  def peak_flops(self) -> float:
    """Sum of the GPUs' peaks as Zorse's HFU counts them."""
    return sum(p.num_devices * GPUS[p.gpu].peak_flops for p in self.pools)

  @property
  def global_batch(self) -> int:
    """Sequences per iteration: ``GLOBAL_TOKENS / seq_len``."""
    return GLOBAL_TOKENS // self.seq_len


CLUSTERS = {
    "A": ZorseCluster("A", "4 H100 + 16 A100-80G",
                      (Pool("h100", "H100-NVL", 2, 2), Pool("a100", "A100-80G", 2, 8)),
                      4096, 50.0, None, 8332, "paper §6.2: 50 Gbps between nodes"),
    "B": ZorseCluster("B", "8 A100 + 16 A10G + 16 V100 + 24 T4",
                      (Pool("a100", "A100-40G", 1, 8), Pool("a10g", "A10G", 2, 8),
                       Pool("v100", "V100-16G", 2, 8), Pool("t4", "T4", 3, 8)),
                      1024, 25.0, None, 8112, "ours: 25 Gbps (the paper states none)"),
    "C": ZorseCluster("C", "16 A10G + 48 T4 | 16 V100 + 48 T4",
                      (Pool("a10g", "A10G", 2, 8, 1), Pool("t4a", "T4", 6, 8, 1),
                       Pool("v100", "V100-16G", 2, 8, 2), Pool("t4b", "T4", 6, 8, 2)),
                      512, 25.0, 5.0, 8240,
                      "ours: 25 Gbps in a region, 5 Gbps between the two (the paper states "
                      "none)"),
}


@dataclasses.dataclass(frozen=True)
class ZorseChoice:
  """Zorse's planner's choice on a cluster, as its paper describes it.

  Attributes:
    cluster: cluster name.
    models: the models it is stated for (empty: all of the cluster's rows).
    groups: the GPU groups (data parallel inside, pipelined across), described.
    num_groups: how many.
    ministages_per_gpu: interleaving degree where stated, by model.
    source: section of the paper.
  """
  cluster: str
  models: tuple[str, ...]
  groups: tuple[str, ...]
  num_groups: int
  ministages_per_gpu: tuple[tuple[str, int], ...]
  source: str


ZORSE_CHOICES = (
    ZorseChoice("A", ("deepspeedllama_65b",),
                ("2 H100 (node 1)", "2 H100 (node 2)", "8 A100 (node 3)", "8 A100 (node 4)"),
                4, (), "§6.2 ('grouping GPUs within each node for DP and applying PP across "
                "nodes'); §6.6 ('we reduce pipeline stages to 4 by grouping GPUs within each "
                "node', Llama 65B)"),
    ZorseChoice("B", (), ("8 A100", "16 A10G", "16 V100", "24 T4"), 4,
                (("deepspeedllama_13b", 4), ("deepspeedllama_33b", 6)),
                "§6.2 ('partitions the cluster into four groups, each consisting of VMs with "
                "the same GPUs'; 'for the larger 13B and 33B models, Zorse employs 4 and 6 "
                "ministages per GPU')"),
    ZorseChoice("C", ("deepspeedllama_33b",),
                ("16 A10G", "8 V100", "8 V100", "24 T4 (region 1)", "24 T4 (region 1)",
                 "24 T4 (region 2)", "24 T4 (region 2)"), 7, (),
                "§6.2 ('all A10Gs form a single DP group, while V100s are divided into two "
                "groups of 8 GPUs each ... T4s ... are split into two groups of 24 within each "
                "region'; stated 'to prevent OOM errors on larger models')"),
)


@dataclasses.dataclass(frozen=True)
class ZorseRow:
  """One row of Zorse's Table 5.

  Attributes:
    cluster: ``"A"``, ``"B"`` or ``"C"``.
    model: the model's key in Zorse's measurements (``"deepspeedllama_7b"``).
    label: as the table prints it.
    tflops: Zorse's measured TFLOPs (its FLOP count, :func:`zorse_model_flops`).
    hfu_pct: its HFU, percent.
    others: TFLOPs it measured for TorchTitan-Het, HexiScale and Cephalo (``None``: OOM).
  """
  cluster: str
  model: str
  label: str
  tflops: float
  hfu_pct: float
  others: tuple[tuple[str, float | None], ...]

  @property
  def name(self) -> str:
    return f"{self.cluster}-{self.label.split()[-1]}"


def _row(cluster, size, tflops, hfu, tt, hexi, ceph) -> ZorseRow:
  return ZorseRow(cluster, f"deepspeedllama_{size.lower()}", f"Llama {size}", tflops, hfu,
                  (("TorchTitan-Het", tt), ("HexiScale", hexi), ("Cephalo", ceph)))


# Table 5 of the paper (TFLOPs; HFU in percent for Zorse).
ROWS = (
    _row("A", "7B", 4370.56, 52.46, 4223.80, 3193.46, 1714.52),
    _row("A", "13B", 4917.87, 59.02, 3837.49, 3270.32, 1656.29),
    _row("A", "33B", 5281.64, 63.39, 944.47, 3064.22, 1943.89),
    _row("A", "65B", 5239.13, 62.88, None, 2048.63, 1937.64),
    _row("B", "7B", 3412.88, 43.49, 2033.53, 1194.89, 2274.50),
    _row("B", "13B", 2965.64, 37.79, 1956.09, 1152.73, 1992.24),
    _row("B", "33B", 2658.29, 33.87, None, 657.16, 1373.31),
    _row("C", "7B", 3936.94, 39.24, 2441.70, 2624.63, 1213.39),
    _row("C", "13B", 3357.97, 33.47, 2061.55, 1952.31, 1222.96),
    _row("C", "33B", 1548.60, 15.44, None, None, 775.42),
)

# Heads and feed-forward width of the LLaMA models (hidden size and layers are in Zorse's
# zorse_model_stats.json); the block's parameters then equal its parameters_per_layer.
LLAMA_SHAPES = {
    "deepspeedllama_7b": (32, 11008),
    "deepspeedllama_13b": (40, 13824),
    "deepspeedllama_33b": (52, 17920),
    "deepspeedllama_65b": (64, 22016),
}


def row_by_name(name: str) -> ZorseRow:
  """The row ``"B-13B"`` (cluster, model size)."""
  for r in ROWS:
    if r.name == name:
      return r
  raise PlanError(f"no Zorse row {name!r}; the rows are {', '.join(r.name for r in ROWS)}")


def zorse_model_flops(model: str, seq_len: int, global_batch: int,
                      stats: dict | None = None) -> float:
  """FLOPs of one iteration as Zorse counts them (``compute_model_flops``):
  ``4.5 * (2 N s + 4 L h s^2) * G`` (forward, backward, recomputation, half for the
  optimizer)."""
  st = (stats or load_zorse_stats())[model]
  n, layers, h = st["total_parameters"], st["num_layers"], st["hidden_size"]
  return 4.5 * (2.0 * n * seq_len + 4.0 * layers * h * seq_len ** 2) * global_batch


def zorse_iteration_s(row: ZorseRow, stats: dict | None = None) -> float:
  """Seconds per iteration Zorse measured: its FLOP count over its TFLOPs."""
  c = CLUSTERS[row.cluster]
  return zorse_model_flops(row.model, c.seq_len, c.global_batch, stats) / (row.tflops * 1e12)


def zorse_hfu_pct(row: ZorseRow) -> float:
  """HFU recomputed from the row's TFLOPs and the peaks Zorse's HFU divides by (percent)."""
  return 100.0 * row.tflops * 1e12 / CLUSTERS[row.cluster].peak_flops


# --------------------------------------------------------------------------- our tables


def layer_fits_s(data: dict, model: str, gpu: str, seq_len: int, rows: float
                 ) -> tuple[float, float]:
  """``(forward s, backward s)`` of one layer on one ``gpu`` at ``rows`` sequences, from
  Zorse's linear fits (fp16)."""
  try:
    entry = data[model][GPUS[gpu].key][str(seq_len)]["float16"]
  except KeyError:
    raise PlanError(f"Zorse's measurements have no {model} on {gpu} at sequence length "
                    f"{seq_len} in float16") from None
  (fs, fi), (bs, bi) = entry[0], entry[1]
  return 1e-3 * (fs * rows + fi), 1e-3 * (bs * rows + bi)


def layer_residual_bytes(model: str, seq_len: int, rows: int,
                         stats: dict | None = None) -> tuple[float, float]:
  """``(bytes per sequence, bytes independent of the rows)`` of the residuals one LLaMA
  block's ``jax.vjp`` keeps for its backward (fp16, :class:`tools.llama.LlamaBlock`), found
  abstractly (``jax.eval_shape``) at ``rows`` and ``2 rows`` sequences: the part that grows
  with the rows is the activations a microbatch keeps without recomputation; the rest is the
  weights (and the causal mask)."""
  import jax
  import jax.numpy as jnp

  from tools.llama import LlamaBlock, LlamaConfig

  st = (stats or load_zorse_stats())[model]
  heads, ffn = LLAMA_SHAPES[model]
  block = LlamaBlock(LlamaConfig(hidden=st["hidden_size"], num_heads=heads, ffn=ffn))

  def total(r):
    x = jax.ShapeDtypeStruct((r, seq_len, st["hidden_size"]), jnp.float16)
    p = jax.eval_shape(block.init, jax.random.PRNGKey(0), x)
    leaves = jax.eval_shape(
        lambda p, x: jax.tree_util.tree_leaves(jax.vjp(block.apply, p, x)[1]), p, x)
    return float(sum(v.size * v.dtype.itemsize for v in leaves))

  a, b = total(rows), total(2 * rows)
  per_row = (b - a) / rows
  return per_row, a - per_row * rows


def _specs(cluster: ZorseCluster) -> list[SubclusterSpec]:
  out = []
  for p in cluster.pools:
    g = GPUS[p.gpu]
    out.append(SubclusterSpec(p.name, p.num_hosts, p.devices_per_host, g.memory_bytes,
                              cluster.inter_gbps * GBPS, peak_flops=g.peak_flops,
                              latency_s=1e-5, host_bandwidth_bytes_per_s=g.host_bytes_per_s,
                              host_latency_s=2e-6,
                              offload_bandwidth_bytes_per_s=g.offload_bytes_per_s))
  return out


def _links(cluster: ZorseCluster) -> dict:
  region = {p.name: p.region for p in cluster.pools}
  cross = cluster.cross_gbps if cluster.cross_gbps is not None else cluster.inter_gbps
  return {(a, b): Link(cluster.inter_gbps * GBPS, 1e-5) if region[a] == region[b]
          else Link(cross * GBPS, 1e-3) for a in region for b in region if a < b}


def zorse_tables(cluster: ZorseCluster, model: str, rows: int, *, remat: str = "choose",
                 data: dict | None = None, stats: dict | None = None,
                 residual_bytes: tuple[float, float] | None = None) -> CostTables:
  """Cost tables of ``model`` (its transformer blocks, one layer each) on ``cluster`` at
  microbatches of ``rows`` sequences.

  Args:
    cluster: one of :data:`CLUSTERS`.
    model: a key of :data:`LLAMA_SHAPES`.
    rows: sequences per microbatch (split over a stage's data-parallel devices).
    remat: ``"full"`` (each layer's input kept, the forward recomputed: Zorse's setting),
      ``"none"`` (the residuals kept, no recomputation), ``"choose"`` (both, per stage: the
      planner chooses), or ``"uncharged"`` (the input kept but no recomputation timed: what
      ``benchmarks/mixed_stages.py`` charged before, for comparison only).
    data, stats: Zorse's measurements and model statistics (read if not given).
    residual_bytes: :func:`layer_residual_bytes` if already known.

  Returns:
    The tables, with ZeRO and host-offload data (``optimizer_share=0.75``) and the gradient
    sync and update once per iteration (``end_cost=True``).
  """
  if remat not in ("full", "none", "choose", "uncharged"):
    raise PlanError(f"remat={remat!r}: choose 'full', 'none', 'choose' or 'uncharged'")
  data = data if data is not None else load_zorse()
  stats = stats if stats is not None else load_zorse_stats()
  if remat == "choose":
    none = zorse_tables(cluster, model, rows, remat="none", data=data, stats=stats,
                        residual_bytes=residual_bytes)
    full = zorse_tables(cluster, model, rows, remat="full", data=data, stats=stats)
    return with_remat_choice(none, full)
  st = stats[model]
  L, h, params = st["num_layers"], st["hidden_size"], st["parameters_per_layer"]
  x = rows * cluster.seq_len * h * 2.0            # one layer's fp16 input per microbatch
  if remat == "none":
    per_row, _ = residual_bytes or layer_residual_bytes(model, cluster.seq_len, 1, stats)
    act = per_row * rows
  else:
    act = x
  tp_allreduces = 6.0 if remat == "full" else 4.0
  prof = LayerProfile(flops=np.full(L, 8.0 * params * rows * cluster.seq_len),
                      param_bytes=np.full(L, 2.0 * params),
                      param_mem_bytes=np.full(L, 16.0 * params), act_bytes=np.full(L, act),
                      boundary_bytes=np.full(L, x), tp_comm_bytes=np.full(L, tp_allreduces * x))
  times = {}
  for p in cluster.pools:
    fwd, bwd = layer_fits_s(data, model, p.gpu, cluster.seq_len, rows)
    times[p.name] = np.full(L, (2 * fwd + bwd) if remat == "full" else (fwd + bwd))
  tables = CostTables.from_layer_costs(prof, _specs(cluster), _links(cluster),
                                       layer_time_s=times, end_cost=True, optimizer_share=0.75)
  return tables


# --------------------------------------------------------------------------- our plan


@dataclasses.dataclass(frozen=True)
class RowPlan:
  """Our planner's best plan on a Zorse row.

  Attributes:
    row: the row.
    rows: sequences per microbatch of the best plan.
    num_microbatches: ``B``.
    result: the plan (``None``: nothing fits at any microbatch tried).
    iteration_s: its simulated seconds per iteration (``inf`` if none).
    zorse_s: Zorse's measured seconds per iteration (:func:`zorse_iteration_s`).
    remat: the stages' rematerialisation modes, in order.
    search_s: seconds of all searches of this row.
    tried: ``(rows, iteration s or inf)`` per microbatch size tried.
  """
  row: ZorseRow
  rows: int | None
  num_microbatches: int | None
  result: PlanResult | None
  iteration_s: float
  zorse_s: float
  remat: tuple[str, ...]
  search_s: float
  tried: tuple[tuple[int, float], ...]

  @property
  def speedup(self) -> float:
    """Zorse's seconds over ours (> 1: we are faster)."""
    return self.zorse_s / self.iteration_s if self.iteration_s > 0 else 0.0

  @property
  def tflops_zorse_count(self) -> float:
    """Our plan's throughput counted as Zorse counts its own (its FLOPs over our time)."""
    c = CLUSTERS[self.row.cluster]
    f = zorse_model_flops(self.row.model, c.seq_len, c.global_batch)
    return f / self.iteration_s / 1e12 if math.isfinite(self.iteration_s) else 0.0


def plan_row(row: ZorseRow, rows_options: Sequence[int], *, remat: str = "choose",
             options: SolveOptions | None = None, data: dict | None = None,
             stats: dict | None = None) -> RowPlan:
  """Our best plan for ``row`` over the microbatch sizes ``rows_options`` (each must divide
  the cluster's global batch).

  Raises:
    PlanError: a microbatch size that does not divide the global batch.
  """
  import time

  cluster = CLUSTERS[row.cluster]
  data = data if data is not None else load_zorse()
  stats = stats if stats is not None else load_zorse_stats()
  G = cluster.global_batch
  residual = layer_residual_bytes(row.model, cluster.seq_len, 1, stats) \
      if remat in ("choose", "none") else None
  best, best_rows, tried = None, None, []
  t0 = time.perf_counter()
  for r in rows_options:
    if G % r:
      raise PlanError(f"{r} sequences per microbatch do not divide the global batch of {G}")
    tables = zorse_tables(cluster, row.model, r, remat=remat, data=data, stats=stats,
                          residual_bytes=residual)
    try:
      res = solve(tables, G // r, options=options)
    except InfeasiblePlanError:
      tried.append((r, math.inf))
      continue
    tried.append((r, res.iteration_s))
    if best is None or res.iteration_s < best.iteration_s:
      best, best_rows = res, r
  secs = time.perf_counter() - t0
  zs = zorse_iteration_s(row, stats)
  if best is None:
    return RowPlan(row, None, None, None, math.inf, zs, (), secs, tuple(tried))
  modes = tuple(s.remat or ("full" if remat == "full" else "none")
                for s in best.plan.stages)
  return RowPlan(row, best_rows, G // best_rows, best, best.iteration_s, zs, modes, secs,
                 tuple(tried))
