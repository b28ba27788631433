"""Collective communication times on one link (ring algorithms), the round trip of a
point-to-point transfer, and the seconds of a pipeline cut (:func:`cut_time_s`).

A link whose bandwidth depends on the message size (:class:`~harpjax.cluster.BandwidthCurve`)
is read at the size of each message the algorithm sends: a ring step's ``bytes / p``, a cut's
share per host pair.

The one cost model of collectives in harpjax: the profiler's per-layer tensor-parallel
collectives and gradient all-reduce, :meth:`CostTables.from_layer_costs
<harpjax.compiler.profile.CostTables.from_layer_costs>`'s per-range ones, and ZeRO's
(:mod:`~harpjax.compiler.profile.zero`). :func:`round_trip_time_s` is every transfer there and
back: the optimizer state or the residuals to host memory and back
(:func:`~harpjax.compiler.profile.offload_time_s`), a mixed-type stage's rows and gradients to
its home group and back (:mod:`~harpjax.compiler.profile.routes`). :func:`update_time_s` is
the optimizer update's traffic in device memory, which every stage's end time holds beside
its gradient all-reduce.
"""

from __future__ import annotations

import numpy as np

from harpjax.cluster import Link

__all__ = ["allreduce_time_s", "allgather_time_s", "all_to_all_time_s", "collective_time_s",
           "round_trip_time_s", "update_time_s", "cut_time_s"]


def cut_time_s(nbytes, bandwidth_bytes_per_s, latency_s=0.0, curve=None, senders=1,
               receivers=1):
  """Seconds of a cut: ``nbytes`` sent from ``senders`` hosts to ``receivers`` hosts, each
  host's rows to the hosts whose rows overlap them, every host pair on its own connection at
  once.

  With ``h = min(senders, receivers)`` and ``n = max(senders, receivers)``, the cut moves
  ``n + h - gcd`` messages; the busiest host sends or receives ``n / h`` of them, each of
  ``bytes / n`` (rows split evenly), so the cut takes ``latency + bytes / (h x bw(bytes /
  n))``: ``bw`` is the link's bandwidth at that message size (``curve``, a
  :class:`~harpjax.cluster.BandwidthCurve`, where given, else ``bandwidth_bytes_per_s``).
  One host on each side: ``latency + bytes / bw(bytes)``, one message.

  Args:
    nbytes: bytes of the whole cut (a scalar or an array: then so is the result).
    bandwidth_bytes_per_s: the link's bandwidth (no size known); ``0``: no link (``inf``).
    latency_s: seconds per message.
    curve: optional bandwidth by message size.
    senders, receivers: hosts holding distinct rows of the cut on either side (``>= 1``;
      numbers or arrays broadcasting with ``nbytes``).
  """
  h = np.minimum(senders, receivers).astype(np.float64)
  n = np.maximum(senders, receivers).astype(np.float64)
  x = np.asarray(nbytes, np.float64)
  msg = x / n
  if curve is not None:
    bw = np.asarray(curve.bandwidth_at(msg), np.float64)
  else:
    bw = np.asarray(bandwidth_bytes_per_s, np.float64)
  with np.errstate(divide="ignore"):
    t = np.where(bw > 0, latency_s + x / (h * np.where(bw > 0, bw, 1.0)), np.inf)
  return float(t) if t.ndim == 0 else t


def allreduce_time_s(nbytes, p: int, link: Link):
  """Ring all-reduce of ``nbytes`` over ``p`` devices:
  ``2 (p - 1) / p * bytes / bandwidth + 2 (p - 1) * latency``; ``0`` when ``p <= 1`` or there
  is nothing to reduce.

  Args:
    nbytes: bytes each device holds (a scalar, or an array: then so is the result).
    p: devices.
    link: the link between them.
  """
  nbytes = np.asarray(nbytes, dtype=np.float64)
  if p <= 1:
    t = np.zeros_like(nbytes)
  else:   # 2 (p - 1) steps, each a message of bytes / p
    bw = link.bandwidth_at(nbytes / p)
    t = 2.0 * (p - 1) / p * nbytes / bw + 2.0 * (p - 1) * link.latency_s
    t = np.where(nbytes > 0, t, 0.0)
  return float(t) if t.ndim == 0 else t


def allgather_time_s(nbytes, p: int, link: Link):
  """Ring all-gather whose result is ``nbytes`` per device:
  ``(p - 1) / p * bytes / bandwidth + (p - 1) * latency`` (:func:`collective_time_s`'s
  ``"all-gather"``); ``0`` when ``p <= 1`` or there is nothing to gather; scalars or arrays,
  as :func:`allreduce_time_s`."""
  x = np.asarray(nbytes, dtype=np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):   # p - 1 steps of bytes / p each
    t = (p - 1) / p * x / link.bandwidth_at(x / max(p, 1)) + (p - 1) * link.latency_s
  t = np.where((x > 0) & (p > 1), t, 0.0)
  return float(t) if t.ndim == 0 else t


def all_to_all_time_s(nbytes, p: int, link: Link):
  """All-to-all among ``p`` devices, each holding ``nbytes`` of which it keeps ``1 / p`` and
  sends ``1 / p`` to each of the others (expert parallelism's dispatch and combine):
  ``(p - 1) / p * bytes / bandwidth + (p - 1) * latency`` on the link the devices share (the
  ring model's bytes; :func:`collective_time_s`'s ``"all-to-all"``); ``0`` when ``p <= 1`` or
  there is nothing to send; scalars or arrays, as :func:`allreduce_time_s`."""
  return allgather_time_s(nbytes, p, link)


def collective_time_s(colls: dict, p: int, link: Link) -> float:
  """Seconds of the collectives ``{kind: [bytes, count]}`` over ``p`` devices (ring model)."""
  if p <= 1:
    return 0.0
  lat = link.latency_s
  total = 0.0
  for kind, (nbytes, count) in colls.items():
    # each step's message: bytes / p of each collective (the whole result of a
    # reduce-scatter's step, the permuted value of a permute), count of them
    per = nbytes / max(count, 1)
    bw = link.bandwidth_at(per if kind in ("reduce-scatter", "collective-permute") else per / p)
    if kind == "all-reduce":
      total += 2.0 * (p - 1) / p * nbytes / bw + 2.0 * (p - 1) * lat * count
    elif kind == "reduce-scatter":     # result is 1/p of what each device sends
      total += (p - 1) * nbytes / bw + (p - 1) * lat * count
    elif kind == "collective-permute":
      total += nbytes / bw + lat * count
    else:                              # all-gather, all-to-all
      total += (p - 1) / p * nbytes / bw + (p - 1) * lat * count
  return total


def round_trip_time_s(nbytes, bandwidth_bytes_per_s: float, latency_s: float = 0.0):
  """Seconds to send ``nbytes`` over a link and as many back: ``2 (latency + bytes /
  bandwidth)`` (``latency_s`` per direction: the latency of every message sent that way).

  Args:
    nbytes: bytes each way (a scalar, or an array: then so is the result).
    bandwidth_bytes_per_s: the link's bandwidth, one direction.
    latency_s: seconds per direction.
  """
  return 2.0 * (latency_s + nbytes / bandwidth_bytes_per_s)


def update_time_s(state_bytes, mem_bandwidth_bytes_per_s: float):
  """Seconds of an optimizer update on one device: its state (weights, gradients, optimizer
  state: ``state_bytes``, a number or an array) read and written once at the device's memory
  bandwidth, ``2 * state_bytes / bandwidth``."""
  return 2.0 * state_bytes / mem_bandwidth_bytes_per_s
