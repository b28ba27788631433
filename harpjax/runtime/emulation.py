"""Emulated heterogeneous hardware: fake CPU devices that take as long as the plan's GPUs.

This machine has no GPU. To compare a measured run with the simulator
(:mod:`harpjax.compiler.schedule.simulator`), the stage workers make their fake devices and
links behave like the plan's:

* **compute**: each forward or backward task runs for real, waits for its results
  (``block_until_ready``), then sleeps until ``start + fwd_s[stage]`` (or ``bwd_s``) has passed;
  the times are those the cost model gives the stage's GPU type (``StageSpec.time_s``, split
  ``fwd_fraction : 1 - fwd_fraction``), or given explicitly;
* **links**: each message from stage ``i`` to stage ``j`` holds its direction for
  ``latency + bytes / bandwidth`` of the link between their hosts (from the cluster model, or
  given), full duplex, FIFO per direction (:class:`harpjax.runtime.channels.Sender`); a cut
  to or from a stage over several hosts, sent per host pair, holds each sending host's lane
  for the cut's ``cut_time_s`` (:meth:`Emulation.cut_transfer_s`), the hosts at once.

These are the simulator's semantics, and :meth:`Emulation.simulate` feeds the simulator exactly
these numbers. ``time_scale`` multiplies every emulated duration (compute and transfers alike,
so their ratios stay those of the hardware) to keep runs short; ``bytes_scale`` multiplies the
bytes of each message before the bandwidth applies, to emulate a model whose activations are
that much larger than those of the model actually run. The paper emulated V100s by throttling
A100 clocks and slow links with ``tc`` (§6); this is the same idea in software.

Real work must stay below the emulated durations for the emulation to be faithful: every task
whose real duration exceeded its emulated one is counted (``overruns`` in the runner's
timeline).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Mapping, Sequence

from harpjax.cluster import Cluster, Link
from harpjax.compiler.profile import cut_time_s
from harpjax.compiler.schedule import simulate as simulate_schedule
from harpjax.errors import (ClusterSpecError, InvalidOptionError, OptionConflictError, PlanError,
                            check_number)

log = logging.getLogger(__name__)

__all__ = ["Emulation", "annotate_plan"]


def _times(name: str, x) -> tuple[float, ...] | None:
  if x is None:
    return None
  try:
    out = tuple(float(v) for v in x)
  except (TypeError, ValueError):
    raise InvalidOptionError(f"Emulation.{name}={x!r}: per stage, seconds (finite numbers "
                             ">= 0), or None") from None
  for i, v in enumerate(out):
    if not (math.isfinite(v) and v >= 0):
      raise InvalidOptionError(f"Emulation.{name}[{i}]={v}: times are finite seconds >= 0")
  return out


@dataclasses.dataclass(frozen=True)
class Emulation:
  """Options of the emulated hardware
  (``runtime=harpjax.RayRuntime(emulation=harpjax.Emulation(...))``).

  Attributes:
    fwd_s: per stage, seconds of one microbatch's forward on the emulated GPUs; ``None``:
      ``fwd_fraction`` of the plan's ``StageSpec.time_s``.
    bwd_s: per stage, backward seconds; ``None``: the rest of ``time_s``.
    links: ``{(src_stage, dst_stage): Link}`` overriding the cluster's links (pairs not
      listed use the link between the two stages' hosts).
    time_scale: multiplies every emulated duration.
    bytes_scale: multiplies the bytes of every message before the bandwidth applies.
    fwd_fraction: the forward's share of ``time_s`` (the backward costs about twice the
      forward: ``1/3``).
    end_s: per stage, seconds of the part after the pipeline (gradient sync + optimizer
      update) to pad to, or ``None`` to leave it unpadded (the simulator's ``end_cost``).
  """
  fwd_s: tuple[float, ...] | None = None
  bwd_s: tuple[float, ...] | None = None
  links: Any = None
  time_scale: float = 1.0
  bytes_scale: float = 1.0
  fwd_fraction: float = 1.0 / 3.0
  end_s: tuple[float, ...] | None = None

  def __post_init__(self):
    object.__setattr__(self, "fwd_s", _times("fwd_s", self.fwd_s))
    object.__setattr__(self, "bwd_s", _times("bwd_s", self.bwd_s))
    object.__setattr__(self, "end_s", _times("end_s", self.end_s))
    links = self.links
    if links is not None:
      items = links.items() if isinstance(links, Mapping) else links
      fixed = []
      for key, model in items:
        try:
          a, b = (int(x) for x in key)
        except (TypeError, ValueError):
          raise InvalidOptionError(f"Emulation.links: key {key!r} must be a pair of stage "
                                   "indices (src_stage, dst_stage)") from None
        if not isinstance(model, Link):
          raise InvalidOptionError(f"Emulation.links[{key}] must be a harpjax Link, got "
                                   f"{model!r}")
        fixed.append(((a, b), model))
      object.__setattr__(self, "links", tuple(sorted(fixed)))
    for name in ("time_scale", "bytes_scale"):
      check_number(f"Emulation.{name}", getattr(self, name), 0, low_open=True)
    check_number("Emulation.fwd_fraction", self.fwd_fraction, 0, 1, low_open=True,
                 high_open=True)
    if (self.fwd_s is None) != (self.bwd_s is None):
      raise OptionConflictError("Emulation: give both fwd_s and bwd_s, or neither (then the "
                                "plan's StageSpec.time_s is split by fwd_fraction)")
    if self.fwd_s is not None and len(self.fwd_s) != len(self.bwd_s):
      raise OptionConflictError(f"Emulation: fwd_s has {len(self.fwd_s)} stages, bwd_s "
                                f"{len(self.bwd_s)}: give both per stage of the plan")

  # ------------------------------------------------------------------ resolution

  @property
  def link_map(self) -> dict[tuple[int, int], Link]:
    return dict(self.links or ())

  def replace(self, **changes) -> "Emulation":
    return dataclasses.replace(self, **changes)

  def resolve(self, plan, cluster: Cluster | None = None,
              hosts: Sequence[str] | None = None) -> "Emulation":
    """A fully specified copy: per-stage times and a link for every pair of stages.

    Args:
      plan: the resolved plan (its ``StageSpec.time_s`` is used when ``fwd_s`` is ``None``).
      cluster: the cluster model, for links not given in ``links``.
      hosts: per stage, its host name (``harpjax.runtime.transport.stage_hosts``).

    Raises:
      PlanError: the plan has no times (``StageSpec.time_s``) and the emulation none either.
      OptionConflictError: the emulation's times are for another number of stages.
    """
    S = plan.num_stages
    fwd, bwd = self.fwd_s, self.bwd_s
    if fwd is None:
      missing = [i for i, s in enumerate(plan.stages) if s.time_s is None]
      if missing:
        raise PlanError(f"emulation needs each stage's time: stages {missing} have no "
                        "StageSpec.time_s; give Emulation(fwd_s=..., bwd_s=...) or plan "
                        "stages with time_s (the planner fills them in)")
      fwd = tuple(s.time_s * self.fwd_fraction for s in plan.stages)
      bwd = tuple(s.time_s * (1 - self.fwd_fraction) for s in plan.stages)
    if len(fwd) != S:
      raise OptionConflictError(f"Emulation has times for {len(fwd)} stages, the plan has "
                                f"{S}")
    links = self.link_map
    if cluster is not None and hosts is not None:
      for a in range(S):
        for b in range(S):
          if a == b or (a, b) in links:
            continue
          try:
            link = cluster.link_between_hosts(hosts[a], hosts[b])
          except ClusterSpecError:
            continue   # the stages cannot talk; a message between them will fail anyway
          links[(a, b)] = link
    return dataclasses.replace(self, fwd_s=tuple(fwd), bwd_s=tuple(bwd), links=links)

  # ------------------------------------------------------------------ durations

  def compute_s(self, stage: int, kind: str) -> float:
    """Emulated seconds of one forward (``"F"``) or backward (``"B"``) task, scaled."""
    t = self.fwd_s if kind == "F" else self.bwd_s
    return t[stage] * self.time_scale

  def end_time_s(self, stage: int) -> float | None:
    return None if self.end_s is None else self.end_s[stage] * self.time_scale

  def transfer_s(self, src: int, dst: int, nbytes: float) -> float:
    """Emulated seconds of one message of ``nbytes`` from ``src`` to ``dst``, scaled (0 when
    the pair has no link)."""
    link = self.link_map.get((src, dst))
    if link is None:
      return 0.0
    return link.transfer_time_s(nbytes * self.bytes_scale) * self.time_scale

  def cut_transfer_s(self, src: int, dst: int, nbytes: float, senders: int = 1,
                     receivers: int = 1) -> float:
    """Emulated seconds of a cut of ``nbytes`` from ``src`` to ``dst`` sent per host pair,
    ``senders`` hosts holding distinct rows on one side and ``receivers`` on the other: what
    ``harpjax.compiler.profile.cut_time_s`` prices, ``latency + bytes / (h x bw(bytes / n))``,
    scaled (0 when the pair has no link). One host each side: :meth:`transfer_s`."""
    link = self.link_map.get((src, dst))
    if link is None:
      return 0.0
    return cut_time_s(nbytes * self.bytes_scale, link.bandwidth_bytes_per_s, link.latency_s,
                      link.curve, senders, receivers) * self.time_scale

  def cut_delay_fn(self, src: int, dst: int, senders: int, receivers: int):
    """``bytes -> seconds`` of a host's lane in a cut sent per host pair: each sending host
    holds its lane for the whole cut's :meth:`cut_transfer_s` (the busiest host's time), all
    sending hosts at once."""
    if self.link_map.get((src, dst)) is None:
      return None
    return lambda nbytes: self.cut_transfer_s(src, dst, nbytes, senders, receivers)

  def delay_fn(self, src: int, dst: int):
    link = self.link_map.get((src, dst))
    if link is None:
      return None
    scale, bscale = self.time_scale, self.bytes_scale
    return lambda nbytes: link.transfer_time_s(nbytes * bscale) * scale

  # ------------------------------------------------------------------ simulator

  def simulate(self, schedule, act_bytes: Sequence[float], ct_bytes: Sequence[float] | None = None,
               row_hosts: Mapping | None = None, **kwargs):
    """The simulator's prediction for these emulated numbers.

    Args:
      schedule: the :class:`~harpjax.compiler.schedule.Schedule` the runtime runs.
      act_bytes: ``[S - 1]`` bytes of the activation message from stage ``i`` to ``i + 1``
        per microbatch.
      ct_bytes: ``[S - 1]`` bytes of the cotangent message from ``i + 1`` to ``i``; default
        ``act_bytes``.
      row_hosts: ``{(src, dst): (hp, hc)}`` of the cuts sent per host pair
        (:meth:`cut_transfer_s`); the others are one message on one link.
      kwargs: passed to :func:`harpjax.compiler.schedule.simulate`.

    Returns:
      The :class:`~harpjax.compiler.schedule.SimResult` (times scaled like the runtime's).
    """
    if self.fwd_s is None:
      raise PlanError("resolve() the emulation against the plan before simulating")
    S = schedule.num_stages
    ct_bytes = act_bytes if ct_bytes is None else ct_bytes
    fwd = [self.compute_s(s, "F") for s in range(S)]
    bwd = [self.compute_s(s, "B") for s in range(S)]
    hosts = dict(row_hosts or {})

    def cut(a, b, nbytes):
      if (a, b) in hosts:
        return self.cut_transfer_s(a, b, nbytes, *hosts[(a, b)])
      return self.transfer_s(a, b, nbytes)
    cf = [cut(i, i + 1, act_bytes[i]) for i in range(S - 1)]
    cb = [cut(i + 1, i, ct_bytes[i]) for i in range(S - 1)]
    end = [self.end_time_s(s) or 0.0 for s in range(S)]
    return simulate_schedule(fwd, bwd, schedule=schedule, comm_fwd=cf if S > 1 else 0.0,
                             comm_bwd=cb if S > 1 else 0.0, end_cost=end, **kwargs)


def annotate_plan(plan, layers, cluster: Cluster, emulation: Emulation | None = None):
  """The plan with each stage's ``time_s`` and ``comm_s`` set to the emulated hardware's.

  H-1F1B derives its warm-up counts from these (``auto_parallel`` reads them), so a plan
  annotated this way runs the schedule the emulated cluster calls for. Times are unscaled
  (``time_scale`` does not change their ratios); ``comm_s`` of stage ``i`` is the emulated
  transfer of the activations crossing the cut after its last layer
  (``layers[j].boundary_bytes``, times ``bytes_scale``) over the link from its host to the next
  stage's.

  Args:
    plan: a plan whose stages list their devices explicitly.
    layers: the model's :class:`~harpjax.compiler.layers.LayerSequence`
      (``ParallelStep.trace(...).layers``).
    cluster: the cluster model.
    emulation: the emulated times and link overrides; ``None`` keeps the plan's times and
      uses the cluster's links.

  Raises:
    PlanError: a stage without explicit devices, or no times at all.
  """
  for i, s in enumerate(plan.stages):
    if s.devices is None:
      raise PlanError(f"annotate_plan needs explicit devices (stage {i} has none)")
  hosts = [cluster.host_of_device(s.devices[0]).name for s in plan.stages]
  emu = (emulation or Emulation()).resolve(plan, cluster, hosts)
  stages = []
  for i, s in enumerate(plan.stages):
    comm = None
    if i + 1 < plan.num_stages:
      nbytes = layers[s.layers[1]].boundary_bytes
      comm = emu.transfer_s(i, i + 1, nbytes) / emu.time_scale
    stages.append(dataclasses.replace(s, time_s=emu.fwd_s[i] + emu.bwd_s[i], comm_s=comm))
  return plan.with_stages(stages)
