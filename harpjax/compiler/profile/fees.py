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
* :func:`group_route_transfer`: the bytes a mixed-type stage's other groups receive and send
  per iteration, their rows of the stage's inputs and outputs to and from the home group,
  forward and backward (:func:`~harpjax.compiler.profile.routes.group_route_s`'s traffic);
  :func:`route_cut_bytes` the same bytes attributed to the cut before and the cut after the
  stage (what the planner's search charges, :attr:`LinkFees.cut_extra`).

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
           "cut_fees", "group_sync_transfer", "group_route_transfer", "route_cut_bytes",
           "NO_TRANSFER"]


@dataclasses.dataclass(frozen=True)
class LinkFees:
  """Where each subcluster sits, and the fee per GB of each link class.

  Attributes:
    places: ``(subcluster name, zone, region)`` per subcluster (zone and region ``None``
      where the cluster gives none).
    fees: the fee per GB of each link class.
    cut_extra: ``(name a, name b, [3, L] bytes)``: bytes per microbatch that a cut after layer
      ``j`` from a stage on ``a`` to one on ``b`` sends besides the cut itself, per link class
      (:data:`~harpjax.cluster.LINK_CLASSES`); tables of mixed-type stages
      (:func:`~harpjax.compiler.plan.fused_tables`) put the rows their groups exchange with
      the home group there (:func:`route_cut_bytes`). Empty for a cluster's tables.

  Raises:
    CostTablesError: a name twice, ``fees`` not a :class:`~harpjax.cluster.TransferFees`, or
      a ``cut_extra`` entry that is not ``[3, L]`` non-negative bytes.
  """
  places: tuple[tuple[str, str | None, str | None], ...]
  fees: TransferFees = TransferFees()
  cut_extra: tuple = ()

  def __post_init__(self):
    places = tuple((str(n), z, r) for n, z, r in self.places)
    names = [p[0] for p in places]
    if len(set(names)) != len(names):
      raise CostTablesError(f"LinkFees.places: a subcluster name repeats in {names}")
    if not isinstance(self.fees, TransferFees):
      raise CostTablesError(f"LinkFees.fees: expected a TransferFees, got {self.fees!r}")
    object.__setattr__(self, "places", places)
    extra = []
    for a, b, arr in self.cut_extra:
      arr = np.array(arr, np.float64)
      if arr.ndim != 2 or arr.shape[0] != len(LINK_CLASSES) or not (arr >= 0).all():
        raise CostTablesError(f"LinkFees.cut_extra[{a!r}, {b!r}]: expected [3, L] bytes >= 0 "
                              f"per link class, got shape {arr.shape}")
      arr.setflags(write=False)
      extra.append((str(a), str(b), arr))
    object.__setattr__(self, "cut_extra", tuple(extra))

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
    """Whether any link between two of the subclusters costs a fee (or any class does, where
    cuts carry extra bytes)."""
    if self.cut_extra and any(self.fees.per_byte(c) > 0 for c in LINK_CLASSES):
      return True
    return any(self.fee_per_byte(a, b) > 0 for a in self.names for b in self.names)

  @property
  def class_per_byte(self) -> np.ndarray:
    """``[3]`` the fee per byte of each link class."""
    return np.array([self.fees.per_byte(c) for c in LINK_CLASSES], np.float64)

  def extra_bytes(self, a: str, b: str, j: int) -> np.ndarray | None:
    """``[3]`` the extra bytes per microbatch of the cut after layer ``j`` from ``a`` to
    ``b`` (:attr:`cut_extra`), ``None`` where there are none."""
    for x, y, arr in self.cut_extra:
      if x == a and y == b:
        return arr[:, j]
    return None


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
    extra = None if fees is None else fees.extra_bytes(names[a], names[b], j)
    if extra is not None:
      for c, cls in enumerate(LINK_CLASSES):
        if extra[c]:
          by_class[c] += B * float(extra[c])
          fee += B * float(extra[c]) * fees.fees.per_byte(cls)
  return PlanTransfer(tuple(by_class), fee)


def cut_fees(tables) -> np.ndarray | None:
  """The transfer fee of each cut per microbatch, as the planner's search adds it.

  Args:
    tables: the :class:`~harpjax.compiler.profile.CostTables` (their ``fees``).

  Returns:
    ``[K, K, L]`` float64: the fee (currency of the prices) per microbatch of the cut after
    layer ``j`` from a stage on subcluster ``a`` to the next stage on ``b``: ``2
    boundary_bytes[j]`` bytes (forward and back) at the fee per byte of the class of ``(a,
    b)`` (``a == b``: inside one zone), plus the fee of the cut's extra bytes
    (:attr:`LinkFees.cut_extra`: a mixed-type stage's groups' rows). Times ``B`` it is
    :func:`plan_transfer`'s fee of that cut per iteration. ``None`` when no link between two
    of the subclusters charges a fee.
  """
  fees = tables.fees
  if fees is None or not fees.charges:
    return None
  names = tables.subcluster_names
  per_byte = np.array([[fees.fee_per_byte(a, b) for b in names] for a in names], np.float64)
  nbytes = 2.0 * np.asarray(tables.boundary_bytes, np.float64)
  out = per_byte[:, :, None] * nbytes[None, None, :]
  cls = fees.class_per_byte
  for a, b, arr in fees.cut_extra:
    if a in names and b in names:
      out[names.index(a), names.index(b)] += cls @ arr
  return np.ascontiguousarray(out)


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


def _route_bytes(boundary_bytes, i: int, j: int) -> tuple[float, float]:
  """``(in_i, out_j)``: the boundary bytes of the cut before layer ``i`` and after ``j``
  (none at the ends of the model)."""
  L = len(boundary_bytes)
  into = float(boundary_bytes[i - 1]) if i > 0 else 0.0
  out = float(boundary_bytes[j]) if j < L - 1 else 0.0
  return into, out


def group_route_transfer(fees: LinkFees | None, home: str, groups: Sequence[tuple[str, int]],
                         microbatch_rows: int, boundary_bytes, layers: tuple[int, int],
                         num_microbatches: int) -> PlanTransfer:
  """The bytes per iteration a mixed-type stage on ``layers`` ``(i, j)`` moves between its
  home group (on subcluster ``home``) and each other group ``(subcluster name, rows)``: the
  group's ``rows / b`` of the stage's inputs (``in_i``) and outputs (``out_j``), forward and
  their cotangents backward, ``2 (in_i + out_j) r / b`` per microbatch (``B`` of them), over
  the link class of (home, group); none at the ends of the model
  (:func:`~harpjax.compiler.profile.routes.group_route_s`'s traffic)."""
  by_class = [0.0, 0.0, 0.0]
  fee = 0.0
  into, out = _route_bytes(boundary_bytes, *layers)
  for name, rows in groups:
    nbytes = 2.0 * int(num_microbatches) * (into + out) * (rows / int(microbatch_rows))
    fee += _charge(fees, by_class, home, name, nbytes)
  return PlanTransfer(tuple(by_class), fee)


def route_cut_bytes(fees: LinkFees, home: str, groups: Sequence[tuple[str, int]],
                    microbatch_rows: int, boundary_bytes) -> np.ndarray:
  """``[3, L]`` per link class, the bytes per microbatch that a mixed stage's other groups
  ``(subcluster name, rows)`` exchange with the home at the cut after layer ``j`` (their rows
  of the boundary, forward and back: ``2 boundary_bytes[j] r / b``), once for a stage that
  ends at ``j`` and once for one that starts at ``j + 1``. Summed over the cuts into and out
  of a stage, times ``B``, they are :func:`group_route_transfer`'s bytes, which is how the
  planner's search charges them (:attr:`LinkFees.cut_extra`)."""
  bb = 2.0 * np.asarray(boundary_bytes, np.float64)
  out = np.zeros((len(LINK_CLASSES), bb.size))
  for name, rows in groups:
    out[LINK_CLASSES.index(fees.link_class(home, name))] += bb * (rows / int(microbatch_rows))
  return out
