"""Transfer fees: what a plan sends over each class of link per iteration, and what it pays.

Clouds charge per GB sent between zones and between regions (Sailor, Strati et al., SOSP'25,
§4.2.3: ``C_iter = C_comp + C_comm``). The cluster says where each subcluster sits (its
``zone`` and ``region``) and the fee of each link class
(:class:`~harpjax.cluster.TransferFees`, :data:`~harpjax.cluster.LINK_CLASSES`); the cost
tables carry both as a :class:`LinkFees` (:attr:`~harpjax.compiler.profile.CostTables.fees`,
set by :func:`with_fees`), keyed by subcluster name so that any subset or order of the
tables' subclusters reads it.

* :func:`plan_transfer`: a plan's bytes per iteration per link class and its fee per
  iteration. A cut after layer ``j`` from a stage on subcluster ``a`` to the next on ``b``
  sends ``boundary_bytes[j]`` forward and as many (the activations' cotangents) back for
  each of the ``B`` microbatches, ``2 B boundary_bytes[j]`` bytes over the link class of
  ``(a, b)``; the data-parallel replicas of a stage send it in parallel, pair by pair, which
  changes the seconds but not the bytes. A plain stage's replicas sit in one subcluster, so in
  one zone: its gradient sync pays no fee. The fee is
  ``sum over classes of bytes x fee per byte``.
* :func:`cut_fees`: the same fee as the planner's DP adds it, per cut: ``[K, K, L]`` the fee
  per microbatch of a cut after layer ``j`` from a stage on subcluster ``a`` to one on ``b``,
  ``2 boundary_bytes[j] x fee per byte of (a, b)`` (times ``B`` per iteration).
* :func:`group_sync_transfer`: the bytes a mixed-type stage's cross-group gradient sum sends
  between its home group and each other group (the gradient there, the parameters back,
  :func:`~harpjax.compiler.profile.routes.home_sync_s`'s traffic) per link class, for the
  evaluators of mixed plans.

The money of a plan per iteration is then ``rate x iteration_s / 3600 + fee``, and its hourly
rate with fees ``rate + 3600 fee / iteration_s``
(:class:`~harpjax.compiler.plan.PlanEvaluation`). See docs/cost_model.md, "Transfer fees".
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from harpjax.cluster import LINK_CLASSES, TransferFees
from harpjax.errors import CostTablesError

__all__ = ["LinkFees", "PlanTransfer", "with_fees", "plan_transfer", "cuts_transfer",
           "cut_fees", "group_sync_transfer"]


@dataclasses.dataclass(frozen=True)
class LinkFees:
  """Where each subcluster sits, and the fee per GB of each link class.

  Attributes:
    places: ``(subcluster name, zone, region)`` per subcluster (zone and region ``None``
      where the cluster gives none).
    fees: the fee per GB of each link class.

  Raises:
    CostTablesError: a name twice, or ``fees`` not a :class:`~harpjax.cluster.TransferFees`.
  """
  places: tuple[tuple[str, str | None, str | None], ...]
  fees: TransferFees = TransferFees()

  def __post_init__(self):
    places = tuple((str(n), z, r) for n, z, r in self.places)
    names = [p[0] for p in places]
    if len(set(names)) != len(names):
      raise CostTablesError(f"LinkFees.places: a subcluster name repeats in {names}")
    if not isinstance(self.fees, TransferFees):
      raise CostTablesError(f"LinkFees.fees: expected a TransferFees, got {self.fees!r}")
    object.__setattr__(self, "places", places)

  @classmethod
  def from_cluster(cls, cluster) -> "LinkFees":
    """The places and fees of a :class:`~harpjax.cluster.Cluster`."""
    return cls(tuple((s.name, s.zone, s.region) for s in cluster.subclusters),
               cluster.transfer_fees)

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(p[0] for p in self.places)

  def zone_of(self, name: str) -> str | None:
    """The zone of subcluster ``name`` (``None``: the cluster gives no zones)."""
    return self._place(name)[0]

  def _place(self, name: str) -> tuple[str | None, str | None]:
    for n, z, r in self.places:
      if n == name:
        return z, r
    raise CostTablesError(f"the transfer fees know no subcluster {name!r} (they know "
                          f"{', '.join(self.names)}); build them from the cluster the tables "
                          "were costed for (with_fees(tables, cluster))")

  def link_class(self, a: str, b: str) -> str:
    """The class of the link between subclusters ``a`` and ``b`` (by name), as
    :meth:`harpjax.cluster.Cluster.link_class` says it."""
    (za, ra), (zb, rb) = self._place(a), self._place(b)
    if za == zb:
      return "same_zone"
    if ra is not None and rb is not None and ra != rb:
      return "other_region"
    return "other_zone"

  def fee_per_byte(self, a: str, b: str) -> float:
    """Fee per byte sent between subclusters ``a`` and ``b``."""
    return self.fees.per_byte(self.link_class(a, b))

  @property
  def charges(self) -> bool:
    """Whether any link between two of the subclusters costs a fee."""
    return any(self.fee_per_byte(a, b) > 0 for a in self.names for b in self.names)


@dataclasses.dataclass(frozen=True)
class PlanTransfer:
  """The bytes a plan sends per iteration over each link class, and their fee.

  Attributes:
    bytes_by_class: ``[3]`` bytes per iteration over links of each class of
      :data:`~harpjax.cluster.LINK_CLASSES` (``same_zone``, ``other_zone``,
      ``other_region``).
    fee_per_iteration: the fee of those bytes, currency of the prices.
  """
  bytes_by_class: tuple[float, float, float]
  fee_per_iteration: float

  def bytes_of(self, link_class: str) -> float:
    return self.bytes_by_class[LINK_CLASSES.index(link_class)]

  def __add__(self, other: "PlanTransfer") -> "PlanTransfer":
    return PlanTransfer(tuple(a + b for a, b in zip(self.bytes_by_class, other.bytes_by_class)),
                        self.fee_per_iteration + other.fee_per_iteration)


NO_TRANSFER = PlanTransfer((0.0, 0.0, 0.0), 0.0)


def with_fees(tables, cluster) -> "CostTables":  # noqa: F821 - the tables' own type
  """``tables`` (a :class:`~harpjax.compiler.profile.CostTables`) with the zones, regions and
  fees of ``cluster``'s subclusters (:attr:`~harpjax.compiler.profile.CostTables.fees`)."""
  return tables.replace(fees=LinkFees.from_cluster(cluster))


def _charge(fees: LinkFees | None, by_class: list, a: str, b: str, nbytes: float) -> float:
  cls = "same_zone" if fees is None else fees.link_class(a, b)
  by_class[LINK_CLASSES.index(cls)] += nbytes
  return 0.0 if fees is None else nbytes * fees.fees.per_byte(cls)


def plan_transfer(tables, stages: Sequence[tuple[int, int, int, int]],
                  num_microbatches: int) -> PlanTransfer:
  """A plan's bytes per iteration per link class across its cuts, and their fee.

  Args:
    tables: the :class:`~harpjax.compiler.profile.CostTables` (their ``fees``; ``None``: every
      link is same-zone and free).
    stages: ``(first layer, last layer, subcluster index, submesh index)`` in pipeline order.
    num_microbatches: ``B``.

  Returns:
    The :class:`PlanTransfer`: each cut after layer ``j`` from subcluster ``a`` to ``b`` adds
    ``2 B boundary_bytes[j]`` bytes to the class of ``(a, b)``, at its fee per byte.
  """
  return cuts_transfer(tables.fees, tables.subcluster_names, tables.boundary_bytes,
                       [(st[1], st[2]) for st in stages], num_microbatches)


def cuts_transfer(fees: LinkFees | None, names: Sequence[str], boundary_bytes,
                  stages: Sequence[tuple[int, int]], num_microbatches: int) -> PlanTransfer:
  """:func:`plan_transfer` from its parts: ``fees``, the subclusters' ``names``, the
  ``[L]`` ``boundary_bytes`` and ``(last layer, subcluster index)`` per stage."""
  by_class = [0.0, 0.0, 0.0]
  fee = 0.0
  B = int(num_microbatches)
  for (j, a), (_, b) in zip(stages, stages[1:]):
    nbytes = 2.0 * B * float(boundary_bytes[j])
    fee += _charge(fees, by_class, names[a], names[b], nbytes)
  return PlanTransfer(tuple(by_class), fee)


def cut_fees(tables) -> np.ndarray | None:
  """The transfer fee of each cut per microbatch, as the planner's search adds it.

  Args:
    tables: the :class:`~harpjax.compiler.profile.CostTables` (their ``fees``).

  Returns:
    ``[K, K, L]`` float64: the fee (currency of the prices) per microbatch of the cut after
    layer ``j`` from a stage on subcluster ``a`` to the next stage on ``b``: ``2
    boundary_bytes[j]`` bytes (forward and back) at the fee per byte of the class of ``(a,
    b)`` (``a == b``: inside one zone). Times ``B`` it is :func:`plan_transfer`'s fee of that
    cut per iteration. ``None`` when no link between two of the subclusters charges a fee.
  """
  fees = tables.fees
  if fees is None or not fees.charges:
    return None
  names = tables.subcluster_names
  per_byte = np.array([[fees.fee_per_byte(a, b) for b in names] for a in names], np.float64)
  nbytes = 2.0 * np.asarray(tables.boundary_bytes, np.float64)
  return np.ascontiguousarray(per_byte[:, :, None] * nbytes[None, None, :])


def group_sync_transfer(fees: LinkFees | None, home: str, others: Sequence[str],
                        grad_bytes: Mapping[str, float] | float) -> PlanTransfer:
  """The bytes per iteration of a mixed-type stage's cross-group gradient sum, per link class,
  and their fee: each other group sends its gradient (``grad_bytes``, one number or per group
  name) to the home group and receives the parameters back, ``2 x grad_bytes`` over the link
  class of (home, group)."""
  by_class = [0.0, 0.0, 0.0]
  fee = 0.0
  for g in others:
    nbytes = 2.0 * float(grad_bytes[g] if isinstance(grad_bytes, Mapping) else grad_bytes)
    fee += _charge(fees, by_class, home, g, nbytes)
  return PlanTransfer(tuple(by_class), fee)
