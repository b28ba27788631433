"""Pipeline plans: which layers run on which submesh, with which logical mesh and warm-up.

A :class:`Plan` is what the planner returns and what the runtime executes; a
:class:`ManualPlan` is the same thing written by hand. Layer ranges are inclusive and 0-indexed,
as in the paper's Tables 3-10 (``[0, 39]`` is layers 0 to 39).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any, Iterable, Sequence

from harpjax.compiler.layers import LayerOptions
from harpjax.compiler.schedule import schedule_key, schedule_kind
from harpjax.compiler.trace import REMAT_MODES
from harpjax.errors import HarpjaxError, PlanError

__all__ = ["StageSpec", "StageGroup", "ZebraGroup", "Plan", "ManualPlan", "load_plan", "row_shares",
           "REMAT_MODES", "LAYER_SOURCES"]



def _int(v: Any, where: str, minimum: int) -> int:
  """``v`` as an int ``>= minimum`` (integral floats accepted), else a :class:`PlanError`
  naming ``where``."""
  if isinstance(v, bool) or not isinstance(v, (numbers.Integral, float)) or \
      (isinstance(v, float) and not v.is_integer()):
    raise PlanError(f"{where}={v!r} must be an integer >= {minimum}")
  if int(v) < minimum:
    raise PlanError(f"{where}={v!r} must be >= {minimum}")
  return int(v)


def _ints(v: Any, where: str, minimum: int, size: int | None = None) -> tuple[int, ...]:
  """A list or tuple of ints ``>= minimum`` (exactly ``size`` of them if given)."""
  if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or \
      (size is not None and len(v) != size):
    what = f"a list of {size} integers" if size is not None else "a list of integers"
    raise PlanError(f"{where}={v!r} must be {what} >= {minimum}")
  return tuple(_int(x, f"{where}[{i}]", minimum) for i, x in enumerate(v))


def _seconds(v: Any, where: str, *, positive: bool = False) -> float | None:
  """``None`` or a finite number of seconds ``>= 0`` (``> 0`` if ``positive``)."""
  if v is None:
    return None
  if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or \
      v < 0 or (positive and v == 0):
    raise PlanError(f"{where}={v!r} must be a finite number {'>' if positive else '>='} 0 "
                    "(seconds) or null")
  return float(v)


def _optional(data: dict, name: str, where: str, check, *args):
  """``data[name]`` checked by ``check`` (named ``where.name``), or ``None`` if absent."""
  v = data.get(name)
  return None if v is None else check(v, f"{where}.{name}" if where else name, *args)


def _check_fields(cls, data: Any, where: str, required: Sequence[str]) -> None:
  """A JSON object for ``cls``: a dict with only ``cls``'s fields and the ``required`` ones."""
  known = [f.name for f in dataclasses.fields(cls)]
  if not isinstance(data, dict):
    raise PlanError(f"{where}: expected an object with fields {known}, got {data!r}")
  unknown = set(data) - set(known)
  if unknown:
    raise PlanError(f"{where} has unknown fields {sorted(unknown)}; known: {sorted(known)}")
  missing = [k for k in required if data.get(k) is None]
  if missing:
    raise PlanError(f"{where} is missing {missing}")


def _check_mesh(obj, where: str) -> None:
  """Checks and normalises ``obj``'s ``submesh``, ``logical_mesh`` (default ``(n m, 1)``) and
  ``devices`` (a :class:`StageSpec` or a :class:`StageGroup`; errors start with ``where``)."""
  submesh = _ints(obj.submesh, f"{where}: submesh", 1, 2)
  object.__setattr__(obj, "submesh", submesh)
  size = submesh[0] * submesh[1]
  given = obj.logical_mesh
  if hasattr(given, "as_tuple"):   # a LogicalMesh
    given = given.as_tuple()
  logical = (size, 1) if given is None else _ints(given, f"{where}: logical_mesh", 1)
  if len(logical) not in (2, 3) or math.prod(logical) != size:
    raise PlanError(f"{where}: logical_mesh={obj.logical_mesh!r} must be (dp, tp) with "
                    f"dp * tp == {size} devices of submesh {submesh}, or (dp, tp, ep) with "
                    f"dp * tp * ep == {size}")
  if len(logical) == 3 and logical[2] == 1:   # ep = 1 is the (dp, tp) mesh
    logical = logical[:2]
  object.__setattr__(obj, "logical_mesh", logical)
  if obj.devices is not None:
    devices = _ints(obj.devices, f"{where}: devices", 0)
    if len(devices) != size or len(set(devices)) != size:
      raise PlanError(f"{where}: devices={obj.devices!r} must list {size} distinct device "
                      f"indices for submesh {submesh}")
    object.__setattr__(obj, "devices", devices)


@dataclasses.dataclass(frozen=True)
class StageGroup:
  """One more group of devices running a stage beside its own (a mixed-type stage).

  A stage normally runs on one submesh of one subcluster. With :attr:`StageSpec.groups` it
  also runs on these groups, data-parallel: each microbatch's rows are split among the
  stage's own devices and its groups in proportion to their ``share`` (:func:`row_shares`),
  every group runs its own executable on its rows, and the parameter gradients are summed
  across the groups (over the link between them) before the update.

  Attributes:
    subcluster: name of the subcluster whose devices run this group.
    submesh: ``(n, m)``: ``n`` hosts times ``m`` devices per host.
    logical_mesh: ``(dp, tp)`` inside the group; default ``(n * m, 1)``.
    devices: optional explicit global device indices, ``n * m`` of them.
    share: relative rows per microbatch (an A100 group ``5`` beside a V100 group ``2``).
    time_s: the group's forward+backward seconds per microbatch at its rows, if known.
  """
  subcluster: str
  submesh: tuple[int, int]
  logical_mesh: tuple[int, int] | None = None
  devices: tuple[int, ...] | None = None
  share: int = 1
  time_s: float | None = None

  def __post_init__(self):
    where = f"stage group on {self.subcluster!r}"
    if not isinstance(self.subcluster, str) or not self.subcluster:
      raise PlanError(f"stage group: subcluster={self.subcluster!r} must be a subcluster name")
    _check_mesh(self, where)
    object.__setattr__(self, "share", _int(self.share, f"{where}: share", 1))
    object.__setattr__(self, "time_s", _seconds(self.time_s, f"{where}: time_s"))

  @property
  def num_devices(self) -> int:
    return self.submesh[0] * self.submesh[1]

  def to_json(self) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(self).items() if v is not None}

  @classmethod
  def from_json(cls, data: dict, where: str = "group") -> "StageGroup":
    _check_fields(cls, data, where, ("subcluster", "submesh"))
    try:
      return cls(subcluster=data["subcluster"],
                 submesh=_ints(data["submesh"], f"{where}.submesh", 1, 2),
                 logical_mesh=_optional(data, "logical_mesh", where, _ints, 1),
                 devices=_optional(data, "devices", where, _ints, 0),
                 share=_optional(data, "share", where, _int, 1) or 1,
                 time_s=_seconds(data.get("time_s"), f"{where}.time_s"))
    except PlanError as e:
      raise PlanError(f"{where}: {e}") from None


@dataclasses.dataclass(frozen=True)
class ZebraGroup:
  """The expert group of a zebra stage (attention/expert disaggregation, HeterMoE §4; the
  planner's :mod:`~harpjax.compiler.plan.zebra_stages`).

  A stage with :attr:`StageSpec.zebra` runs its routed layers' experts on this group and
  everything else on the stage's own devices (the *attention group*), every microbatch cut
  into ``num_microbatches`` zebra microbatches that alternate between the two groups in the
  order of the paper's Theorem 1. The local runtime runs it
  (:mod:`harpjax.compiler.stages.zebra`); what it does not run raises
  :class:`~harpjax.errors.ZebraPlanOnlyError`.

  Attributes:
    subcluster: name of the subcluster whose devices hold the experts.
    submesh: ``(n, m)`` of the expert group.
    num_microbatches: ``R``, zebra microbatches per pipeline microbatch.
    routed_layers: the stage's routed layers (global indices), in order.
    offload: per routed layer, experts moved off each expert GPU onto the attention group
      (asymmetric expert assignment, HeterMoE §4.2); zeros: every expert on the expert group.
    devices: optional explicit global device indices of the expert group (cluster order),
      ``n * m`` of them; filled in when the plan is resolved on a cluster. Written to a plan
      file only when set.
  """
  subcluster: str
  submesh: tuple[int, int]
  num_microbatches: int
  routed_layers: tuple[int, ...]
  offload: tuple[int, ...]
  devices: tuple[int, ...] | None = None

  def __post_init__(self):
    where = f"zebra group on {self.subcluster!r}"
    if not isinstance(self.subcluster, str) or not self.subcluster:
      raise PlanError(f"zebra group: subcluster={self.subcluster!r} must be a subcluster name")
    object.__setattr__(self, "submesh", _ints(self.submesh, f"{where}: submesh", 1, 2))
    object.__setattr__(self, "num_microbatches",
                       _int(self.num_microbatches, f"{where}: num_microbatches", 1))
    routed = tuple(_int(x, f"{where}: routed_layers", 0) for x in self.routed_layers)
    offload = tuple(_int(x, f"{where}: offload", 0) for x in self.offload)
    if not routed or len(offload) != len(routed):
      raise PlanError(f"{where}: offload={list(offload)} must give one count per routed layer "
                      f"{list(routed)} (at least one)")
    object.__setattr__(self, "routed_layers", routed)
    object.__setattr__(self, "offload", offload)
    if self.devices is not None:
      devices = _ints(self.devices, f"{where}: devices", 0)
      if len(devices) != self.num_devices or len(set(devices)) != len(devices):
        raise PlanError(f"{where}: devices={list(devices)} must be {self.num_devices} distinct "
                        f"device indices (submesh {self.submesh})")
      object.__setattr__(self, "devices", devices)

  @property
  def num_devices(self) -> int:
    return self.submesh[0] * self.submesh[1]

  def to_json(self) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(self).items() if k != "devices" or v is not None}

  @classmethod
  def from_json(cls, data: dict, where: str = "zebra") -> "ZebraGroup":
    _check_fields(cls, data, where, ("subcluster", "submesh", "num_microbatches",
                                     "routed_layers", "offload"))
    try:
      return cls(subcluster=data["subcluster"],
                 submesh=_ints(data["submesh"], f"{where}.submesh", 1, 2),
                 num_microbatches=data["num_microbatches"],
                 routed_layers=_ints(data["routed_layers"], f"{where}.routed_layers", 0),
                 offload=_ints(data["offload"], f"{where}.offload", 0),
                 devices=(_ints(data["devices"], f"{where}.devices", 0)
                          if data.get("devices") is not None else None))
    except PlanError as e:
      raise PlanError(f"{where}: {e}") from None


def row_shares(rows: int, shares: Sequence[int], quanta: Sequence[int] | None = None
               ) -> tuple[int, ...]:
  """Splits a microbatch of ``rows`` rows among groups in proportion to ``shares``.

  Group ``g`` gets a multiple of ``quanta[g]`` rows (its data-parallel degree: every device
  of the group gets the same rows), at least one quantum, and the rows sum to ``rows``.
  Among the splits that satisfy this, the one closest to proportional is taken: each group
  first gets its proportional rows rounded down to its quantum, and what is left goes, a
  quantum at a time, to the group furthest below its proportional rows (ties to the first).

  Raises:
    PlanError: no such split exists (too few rows for the groups, or quanta that cannot sum
      to ``rows``).
  """
  shares = tuple(int(s) for s in shares)
  quanta = tuple(int(q) for q in (quanta or (1,) * len(shares)))
  if len(quanta) != len(shares) or not shares or min(shares) < 1 or min(quanta) < 1:
    raise PlanError(f"row_shares: shares={shares} and quanta={quanta} must be positive and "
                    "of equal length")
  total = sum(shares)
  target = [rows * s / total for s in shares]
  split = [max(q, int(t // q) * q) for t, q in zip(target, quanta)]
  left = rows - sum(split)
  while left > 0:
    room = [g for g, q in enumerate(quanta) if q <= left]
    if not room:
      break
    g = max(room, key=lambda g: (target[g] - split[g], -g))
    split[g] += quanta[g]
    left -= quanta[g]
  if left != 0 or sum(split) != rows:
    raise PlanError(
        f"a microbatch of {rows} rows cannot be split among the stage's groups with shares "
        f"{list(shares)} in whole multiples of their data-parallel degrees {list(quanta)}: "
        "use a larger microbatch (fewer microbatches), or change the groups' shares or "
        "logical meshes")
  return tuple(split)


@dataclasses.dataclass(frozen=True)
class StageSpec:
  """One pipeline stage.

  Attributes:
    layers: inclusive ``(first, last)`` layer indices.
    subcluster: name of the subcluster whose devices run the stage.
    submesh: ``(n, m)``: ``n`` hosts times ``m`` devices per host.
    logical_mesh: ``(dp, tp)`` with ``dp * tp == n * m``; default ``(n * m, 1)``; or
      ``(dp, tp, ep)`` with ``dp * tp * ep == n * m``: the stage's routed blocks split their
      experts over ``ep`` devices, which are data-parallel for the rest
      (:class:`~harpjax.compiler.layers.sharding.LogicalMesh`; ``ep = 1`` is read as
      ``(dp, tp)``).
    devices: optional explicit global device indices (cluster order), ``n * m`` of them.
    warmup: H-1F1B warm-up count ``N_i`` (filled in by the planner or the runtime).
    time_s: forward+backward seconds per microbatch predicted for this stage, if known.
    comm_s: seconds to send one microbatch's boundary activation to the next stage, if known.
    zero: how the stage shards its training state over its ``dp`` axis (ZeRO): ``0`` every
      device holds everything (default); ``1`` the optimizer state is sharded; ``2`` the
      gradient accumulator too (a reduce-scatter instead of an all-reduce); ``3`` the
      parameters too, gathered where they are used. Written to a plan file only when not 0.
    offload: the stage keeps its optimizer state in host memory between updates (the planner
      sets it where it pays; :meth:`harpjax.OffloadOptions.apply` sets it on a given plan's
      stages). The one place the runtime reads it from. Written to a plan file only when true.
    groups: more groups of devices running the stage, data-parallel, each on its share of
      every microbatch's rows (a mixed-type stage, :class:`StageGroup`); the fields above
      describe the stage's first group. With ``zero``, every group shards its parameters
      (level 3) and gradient accumulator (level 2) over its own ``dp`` axis; the optimizer
      state lives on the first group (sharded over its ``dp`` from level 1, in host memory
      with ``offload``). Written to a plan file only when not empty.
    share: the first group's relative rows per microbatch (used with ``groups``).
    offload_activations: the stage keeps each microbatch's residuals (the activations its
      backward needs) in host memory between its forward and its backward (likewise:
      ``harpjax.OffloadOptions(activations=True).apply(plan)``). Written to a plan file only
      when true.
    remat: what the stage's backward recomputes (:data:`REMAT_MODES`): ``"none"`` (the
      forward keeps every residual), ``"full"`` (it keeps only the stage's inputs and the
      backward recomputes the rest), ``"dots"`` (it keeps the matmuls' outputs and recomputes
      the rest); ``None``: the plan's (:attr:`Plan.remat`). Written to a plan file only when
      set.
    offload_params: the stage keeps its parameters in host memory while its device group
      runs its other stages (an interleaved schedule): the parameters are fetched to the
      devices before the stage's tasks, prefetched while the group's previous stage still
      runs, and dropped from the devices once the group moves on (Zorse's parameter offload;
      :func:`~harpjax.compiler.schedule.chunk_residency`). Needs a schedule with device
      groups. Written to a plan file only when true.
    zebra: a zebra stage's expert group (:class:`ZebraGroup`): the stage's routed layers'
      experts run there, the rest on the devices above. Written to a plan file only when set.
  """
  layers: tuple[int, int]
  subcluster: str
  submesh: tuple[int, int]
  logical_mesh: tuple[int, int] | None = None
  devices: tuple[int, ...] | None = None
  warmup: int | None = None
  time_s: float | None = None
  comm_s: float | None = None
  zero: int = 0
  groups: tuple[StageGroup, ...] = ()
  share: int = 1
  offload: bool = False
  offload_activations: bool = False
  remat: str | None = None
  zebra: ZebraGroup | None = None
  offload_params: bool = False

  def __post_init__(self):
    layers = _ints(self.layers, "stage layers", 0, 2)
    if layers[1] < layers[0]:
      raise PlanError(f"stage layers={self.layers!r}: expected (first, last) with "
                      "0 <= first <= last")
    where = f"stage on layers {layers}"
    _check_mesh(self, where)
    if not isinstance(self.subcluster, str) or not self.subcluster:
      raise PlanError(f"{where}: subcluster={self.subcluster!r} must be a subcluster name")
    object.__setattr__(self, "layers", layers)
    if self.warmup is not None:
      object.__setattr__(self, "warmup", _int(self.warmup, f"{where}: warmup", 1))
    for name in ("time_s", "comm_s"):
      object.__setattr__(self, name, _seconds(getattr(self, name), f"{where}: {name}"))
    zero = _int(self.zero, f"{where}: zero", 0)
    if zero > 3:
      raise PlanError(f"{where}: zero={self.zero!r} must be 0, 1, 2 or 3")
    object.__setattr__(self, "zero", zero)
    for name in ("offload", "offload_activations", "offload_params"):
      v = getattr(self, name)
      if not isinstance(v, bool) and type(v).__name__ != "bool_":
        raise PlanError(f"{where}: {name}={v!r} must be true or false")
      object.__setattr__(self, name, bool(v))
    if isinstance(self.groups, (str, bytes, dict)) or not isinstance(self.groups, Sequence):
      raise PlanError(f"{where}: groups={self.groups!r} must be a list of StageGroup")
    groups = tuple(g if isinstance(g, StageGroup) else StageGroup.from_json(g, f"{where}: group")
                   for g in self.groups)
    object.__setattr__(self, "groups", groups)
    object.__setattr__(self, "share", _int(self.share, f"{where}: share", 1))
    if self.zebra is not None:
      if isinstance(self.zebra, dict):
        object.__setattr__(self, "zebra", ZebraGroup.from_json(self.zebra, f"{where}: zebra"))
      elif not isinstance(self.zebra, ZebraGroup):
        raise PlanError(f"{where}: zebra={self.zebra!r} must be a ZebraGroup")
      if groups:
        raise PlanError(f"{where}: a zebra stage has no mixed-type groups; give zebra or "
                        "groups, not both")
      if not all(layers[0] <= l <= layers[1] for l in self.zebra.routed_layers):
        raise PlanError(f"{where}: zebra routed layers {list(self.zebra.routed_layers)} must "
                        "lie in the stage's layers")
    if self.remat is not None and self.remat not in REMAT_MODES:
      raise PlanError(f"{where}: remat={self.remat!r} must be one of {REMAT_MODES} (or None: "
                      "the plan's)")

  @property
  def mixed(self) -> bool:
    """Whether the stage runs on more than one group of devices."""
    return bool(self.groups)

  @property
  def all_groups(self) -> tuple[StageGroup, ...]:
    """The stage's first group (its own fields) followed by :attr:`groups`."""
    own = StageGroup(self.subcluster, self.submesh, self.logical_mesh, self.devices,
                     self.share, None if self.groups else self.time_s)
    return (own,) + self.groups

  @property
  def all_devices(self) -> tuple[int, ...] | None:
    """Global devices of every group, in order, then a zebra stage's expert group's
    (``None`` until every group has them)."""
    groups = self.all_groups
    if any(g.devices is None for g in groups) or (
        self.zebra is not None and self.zebra.devices is None):
      return None
    return sum((g.devices for g in groups), ()) + (
        self.zebra.devices if self.zebra is not None else ())

  def group_rows(self, rows: int) -> tuple[int, ...]:
    """Rows of a ``rows``-row microbatch each group runs (:func:`row_shares`)."""
    groups = self.all_groups
    return row_shares(rows, [g.share for g in groups], [g.logical_mesh[0] for g in groups])

  @property
  def num_devices(self) -> int:
    """Devices of the stage, every group's."""
    return (self.submesh[0] * self.submesh[1] + sum(g.num_devices for g in self.groups)
            + (self.zebra.num_devices if self.zebra is not None else 0))

  @property
  def num_layers(self) -> int:
    return self.layers[1] - self.layers[0] + 1

  def to_json(self) -> dict:
    out = {}
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name == "groups":
        if v:
          out["groups"] = [g.to_json() for g in v]
      elif f.name == "share":
        if self.groups:
          out["share"] = v
      elif f.name == "remat":
        if v is not None:
          out["remat"] = v
      elif f.name == "zebra":
        if v is not None:
          out["zebra"] = v.to_json()
      elif f.name not in ("zero", "offload", "offload_activations", "offload_params") or v:
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out

  @classmethod
  def from_json(cls, data: dict, where: str = "stage") -> "StageSpec":
    """A stage from its JSON object; errors name the field (``where.warmup``)."""
    _check_fields(cls, data, where, ("layers", "subcluster", "submesh"))
    if not isinstance(data["subcluster"], str) or not data["subcluster"]:
      raise PlanError(f"{where}.subcluster={data['subcluster']!r} must be a subcluster name")
    kw = {"layers": _ints(data["layers"], f"{where}.layers", 0, 2),
          "subcluster": data["subcluster"],
          "submesh": _ints(data["submesh"], f"{where}.submesh", 1, 2),
          "logical_mesh": _optional(data, "logical_mesh", where, _ints, 1),
          "devices": _optional(data, "devices", where, _ints, 0),
          "warmup": _optional(data, "warmup", where, _int, 1),
          "time_s": _seconds(data.get("time_s"), f"{where}.time_s"),
          "comm_s": _seconds(data.get("comm_s"), f"{where}.comm_s"),
          "zero": _optional(data, "zero", where, _int, 0) or 0,
          "share": _optional(data, "share", where, _int, 1) or 1,
          "remat": data.get("remat")}
    for name in ("offload", "offload_activations", "offload_params"):
      if name in data:
        if not isinstance(data[name], bool):
          raise PlanError(f"{where}.{name}={data[name]!r} must be true or false")
        kw[name] = data[name]
    groups = data.get("groups") or []
    if not isinstance(groups, list):
      raise PlanError(f"{where}.groups={groups!r} must be a list of group objects")
    kw["groups"] = tuple(StageGroup.from_json(g, f"{where}.groups[{i}]")
                         for i, g in enumerate(groups))
    if data.get("zebra") is not None:
      if not isinstance(data["zebra"], dict):
        raise PlanError(f"{where}.zebra={data['zebra']!r} must be an object")
      kw["zebra"] = ZebraGroup.from_json(data["zebra"], f"{where}.zebra")
    try:
      return cls(**kw)
    except PlanError as e:
      raise PlanError(f"{where}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Plan:
  """A pipeline plan.

  Attributes:
    stages: the stages in pipeline order.
    num_microbatches: ``B``; ``None`` lets the decorator's argument decide.
    schedule: a registered schedule (:func:`harpjax.compiler.schedule.schedule_names`):
      ``"h1f1b"`` (default), ``"1f1b"``, ``"eager_1f1b"``, ``"gpipe"`` or one registered with
      :func:`~harpjax.compiler.schedule.register_schedule`; any accepted spelling, kept as
      the canonical name. A solved plan's is the planner's choice
      (:func:`harpjax.compiler.plan.choose_schedule`).
    num_layers: total layers of the model the plan was made for (checked at compile time).
    t_max_s: bottleneck stage time, seconds.
    predicted_iteration_s: predicted seconds per iteration under ``schedule`` (the simulator's,
      or HARP Eq. 12).
    eta: load-balance score of Eq. 20, in ``(0, 1]``.
    meta: provenance only (model, cluster, the planner's options and statistics); nothing
      reads it to decide how the plan runs.
    eps: the H-1F1B tolerance ``epsilon`` of the warm-up rule
      (:func:`~harpjax.compiler.schedule.warmup_delta`) the warm-up counts are derived with:
      the planner's, or for a hand-written plan the one its counts are to be derived with at
      run time; ``None``: 0.1.
    remat: what the backward of a stage without its own :attr:`StageSpec.remat` recomputes
      (:data:`REMAT_MODES`; default ``"none"``).
    layer_source: how the layers the stages index were cut: ``"marked"`` (the step's
      ``harpjax.mark_layer_boundary`` calls, or none: the default, and what a hand-written
      plan means) or ``"auto"`` (constructed automatically from the forward program, as
      automatic planning and ``harpjax plan`` do: a plan saved from them is followed on the
      same automatic layers).
    layer_options: with ``layer_source="auto"``, the :class:`~harpjax.LayerOptions` the
      layers were constructed with (``None``: the defaults).
    microbatch_size: rows per microbatch the stages' times were costed at, if known.

  A plan file written before these fields existed kept them in ``meta`` (``"eps"``,
  ``"remat"`` as a bool, ``"layers": "auto"``, ``"microbatch_size"``); they are read into the
  fields, and so are such keys of a ``meta`` given to the constructor.
  """
  stages: tuple[StageSpec, ...]
  num_microbatches: int | None = None
  schedule: str = "h1f1b"
  num_layers: int | None = None
  t_max_s: float | None = None
  predicted_iteration_s: float | None = None
  eta: float | None = None
  meta: tuple[tuple[str, Any], ...] = ()
  eps: float | None = None
  remat: str = "none"
  layer_source: str = "marked"
  layer_options: LayerOptions | None = None
  microbatch_size: int | None = None

  def __post_init__(self):
    stages = tuple(s if isinstance(s, StageSpec) else _stage_from_any(s) for s in self.stages)
    if not stages:
      raise PlanError("a plan needs at least one stage")
    object.__setattr__(self, "stages", stages)
    meta = dict(self.meta)
    if not all(isinstance(k, str) for k in meta):
      raise PlanError(f"meta={self.meta!r}: its keys must be strings")
    self._fields_from_meta(meta)
    object.__setattr__(self, "meta", tuple(sorted(meta.items())))
    if self.eps is not None:
      eps = self.eps
      if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps <= 1:
        raise PlanError(f"eps={eps!r} must be a number in [0, 1] (the H-1F1B tolerance) or "
                        "None")
      object.__setattr__(self, "eps", float(eps))
    if self.remat not in REMAT_MODES:
      raise PlanError(f"remat={self.remat!r} must be one of {REMAT_MODES}")
    if self.layer_source not in LAYER_SOURCES:
      raise PlanError(f"layer_source={self.layer_source!r} must be one of {LAYER_SOURCES}")
    if isinstance(self.layer_options, dict):
      object.__setattr__(self, "layer_options", _layer_options(self.layer_options))
    if self.layer_options is not None:
      if not isinstance(self.layer_options, LayerOptions):
        raise PlanError(f"layer_options={self.layer_options!r} must be a LayerOptions or None")
      if self.layer_source != "auto":
        raise PlanError("layer_options describe automatically constructed layers: give them "
                        "with layer_source='auto'")
    if self.microbatch_size is not None:
      object.__setattr__(self, "microbatch_size",
                         _int(self.microbatch_size, "microbatch_size", 1))
    try:
      key = schedule_key(self.schedule if isinstance(self.schedule, str) else repr(self.schedule))
    except HarpjaxError as e:
      raise PlanError(f"schedule: {e}") from None
    object.__setattr__(self, "schedule", key)
    check_device_groups(stages, key)
    for a, b in zip(stages, stages[1:]):
      if b.layers[0] != a.layers[1] + 1:
        raise PlanError(
            f"stage layer ranges must be contiguous: {list(a.layers)} is followed by "
            f"{list(b.layers)}; the next stage should start at layer {a.layers[1] + 1}")
    if stages[0].layers[0] != 0:
      raise PlanError(f"the first stage must start at layer 0, not {stages[0].layers[0]}")
    if self.num_layers is not None and stages[-1].layers[1] != self.num_layers - 1:
      raise PlanError(f"the stages cover layers 0..{stages[-1].layers[1]} but the model has "
                      f"{self.num_layers} layers (0..{self.num_layers - 1})")
    if self.num_microbatches is not None:
      _int(self.num_microbatches, "num_microbatches", 1)

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  @property
  def warmups(self) -> tuple[int, ...] | None:
    if any(s.warmup is None for s in self.stages):
      return None
    return tuple(int(s.warmup) for s in self.stages)

  def _fields_from_meta(self, meta: dict) -> None:
    """Moves the keys of ``meta`` that earlier versions kept there into their fields (a field
    given explicitly wins)."""
    defaults = {f.name: f.default for f in dataclasses.fields(self)}
    for key, field in _META_FIELDS.items():
      if key not in meta:
        continue
      value = meta.pop(key)
      if getattr(self, field) != defaults[field] or value is None:
        continue
      if field == "remat" and isinstance(value, bool):
        value = "full" if value else "none"
      elif field == "layer_source":
        value = "auto" if value == "auto" else "marked"
      object.__setattr__(self, field, value)

  def remat_of(self, stage: "StageSpec") -> str:
    """The remat mode of ``stage`` (:attr:`StageSpec.remat`, else the plan's
    :attr:`remat`)."""
    if stage.remat is not None:
      return stage.remat
    return self.remat

  def replace(self, **changes) -> "Plan":
    return dataclasses.replace(self, **changes)

  def with_stages(self, stages: Sequence[StageSpec]) -> "Plan":
    return dataclasses.replace(self, stages=tuple(stages))

  # ------------------------------------------------------------------ display

  def table(self) -> str:
    """The plan as a table in the layout of the paper's Tables 3-10."""
    head = ["Stage", "Layer Range", "Cluster", "Physical Mesh", "Logical Mesh", "Warm-up",
            "t (ms)", "c (ms)"]
    rows = []
    for i, s in enumerate(self.stages):
      gs = s.all_groups
      share = "" if not s.groups else " " + ":".join(str(g.share) for g in gs)
      z = s.zebra
      rows.append([str(i + 1), f"[{s.layers[0]}, {s.layers[1]}]",
                   "+".join(g.subcluster for g in gs) + share
                   + ("" if z is None else f"|{z.subcluster}"),
                   "+".join(f"({g.submesh[0]}, {g.submesh[1]})" for g in gs)
                   + ("" if z is None else f"|({z.submesh[0]}, {z.submesh[1]})"),
                   "+".join(f"({g.logical_mesh[0]}, {g.logical_mesh[1]})" for g in gs),
                   "-" if s.warmup is None else str(s.warmup),
                   "-" if s.time_s is None else f"{s.time_s * 1e3:.3f}",
                   "-" if s.comm_s is None else f"{s.comm_s * 1e3:.3f}"])
    if any(st.remat is not None for st in self.stages):
      head.append("Remat")   # what each stage's backward recomputes
      for r, st in zip(rows, self.stages):
        r.append(self.remat_of(st))
    if any(st.zero or st.offload or st.offload_activations or st.offload_params
           for st in self.stages):
      head.append("State")   # the training state's place, and the residuals'
      for r, st in zip(rows, self.stages):
        r.append("+".join([f"ZeRO-{st.zero}"] + (["offload"] if st.offload else [])
                          + (["host-residuals"] if st.offload_activations else [])
                          + (["host-params"] if st.offload_params else [])))
    if any(st.zebra is not None for st in self.stages):
      head.append("Zebra")   # attention|experts, GPU ratio, zebra microbatches, offload
      for r, st in zip(rows, self.stages):
        z = st.zebra
        r.append("-" if z is None else (
            f"{st.submesh[0] * st.submesh[1]}:{z.num_devices} R={z.num_microbatches} "
            f"offload={','.join(map(str, z.offload))}"))
    widths = [max(len(r[c]) for r in [head] + rows) for c in range(len(head))]
    fmt = lambda r: "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()
    lines = [fmt(head), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]
    foot = [f"schedule={self.schedule}"]
    if self.remat != "none":
      foot.append(f"remat={self.remat}")
    if self.num_microbatches is not None:
      foot.append(f"B={self.num_microbatches}")
    if self.t_max_s is not None:
      foot.append(f"t_max={self.t_max_s * 1e3:.3f} ms")
    if self.predicted_iteration_s is not None:
      foot.append(f"predicted iteration={self.predicted_iteration_s:.4f} s")
    if self.eta is not None:
      foot.append(f"eta={self.eta * 100:.1f}%")
    return "\n".join(lines + ["  ".join(foot)])

  def __str__(self) -> str:
    return self.table()

  # ------------------------------------------------------------------ persistence

  def to_json(self) -> dict:
    return {
        "format": "harpjax.plan/1",
        "stages": [s.to_json() for s in self.stages],
        "num_microbatches": self.num_microbatches,
        "schedule": self.schedule,
        "num_layers": self.num_layers,
        "t_max_s": self.t_max_s,
        "predicted_iteration_s": self.predicted_iteration_s,
        "eta": self.eta,
        "eps": self.eps,
        "remat": self.remat,
        "layer_source": self.layer_source,
        "layer_options": (None if self.layer_options is None
                          else dataclasses.asdict(self.layer_options)),
        "microbatch_size": self.microbatch_size,
        "meta": dict(self.meta),
    }

  @classmethod
  def from_json(cls, data: dict) -> "Plan":
    """A plan from its JSON object (:meth:`to_json`); every field is checked, and errors name
    it (``stages[1].warmup``)."""
    if not isinstance(data, dict) or "stages" not in data:
      raise PlanError("not a harpjax plan: expected a JSON object with a 'stages' list")
    fmt = data.get("format", "harpjax.plan/1")
    if fmt != "harpjax.plan/1":
      raise PlanError(f"unsupported plan format {fmt!r}; this version reads 'harpjax.plan/1'")
    unknown = sorted(set(data) - set(_PLAN_FIELDS))
    if unknown:
      raise PlanError(f"unknown fields {unknown}; a plan has {list(_PLAN_FIELDS)}")
    stages = data["stages"]
    if not isinstance(stages, list) or not stages:
      raise PlanError(f"stages={stages!r} must be a non-empty list of stage objects")
    schedule = data.get("schedule", "h1f1b")
    try:
      schedule_key(schedule if isinstance(schedule, str) else repr(schedule))
    except HarpjaxError as e:
      raise PlanError(f"schedule: {e}") from None
    eta = data.get("eta")
    if eta is not None and (isinstance(eta, bool) or not isinstance(eta, numbers.Real)
                            or not 0 < eta <= 1):
      raise PlanError(f"eta={eta!r} must be a number in (0, 1] or null")
    meta = data.get("meta") or {}
    if not isinstance(meta, dict):
      raise PlanError(f"meta={meta!r} must be an object")
    eps = data.get("eps")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, numbers.Real)):
      raise PlanError(f"eps={eps!r} must be a number in [0, 1] or null")
    return Plan(stages=tuple(StageSpec.from_json(s, f"stages[{i}]")
                             for i, s in enumerate(stages)),
                num_microbatches=_optional(data, "num_microbatches", "", _int, 1),
                schedule=schedule,
                num_layers=_optional(data, "num_layers", "", _int, 1),
                t_max_s=_seconds(data.get("t_max_s"), "t_max_s"),
                predicted_iteration_s=_seconds(data.get("predicted_iteration_s"),
                                               "predicted_iteration_s"),
                eta=None if eta is None else float(eta),
                meta=tuple(sorted(meta.items())),
                eps=eps,
                remat=data.get("remat") or "none",
                layer_source=data.get("layer_source") or "marked",
                layer_options=_layer_options(data.get("layer_options")),
                microbatch_size=_optional(data, "microbatch_size", "", _int, 1))

  def save(self, path: str | os.PathLike) -> None:
    """Writes the plan as JSON: aside, then renamed, so an interrupted save leaves the file
    as it was."""
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    try:
      with open(tmp, "w") as f:
        json.dump(self.to_json(), f, indent=2)
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)

  @classmethod
  def load(cls, path: str | os.PathLike) -> "Plan":
    return load_plan(path)


def load_plan(path: str | os.PathLike) -> Plan:
  """Reads a plan saved by :meth:`Plan.save`.

  Raises:
    PlanError: the file is missing, unreadable, not JSON or not a valid plan; the message
      names the file and the field (``plan file 'p.json': stages[0].warmup='abc' must be an
      integer >= 1``).
  """
  name = os.fspath(path)
  try:
    with open(path) as f:
      data = json.load(f)
  except FileNotFoundError:
    raise PlanError(f"plan file {name!r} does not exist") from None
  except IsADirectoryError:
    raise PlanError(f"plan file {name!r} is a directory; give the plan's JSON file") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise PlanError(f"plan file {name!r} is not valid JSON: {e}") from None
  except OSError as e:
    raise PlanError(f"plan file {name!r} cannot be read: {e.strerror or e}") from None
  try:
    return Plan.from_json(data)
  except PlanError as e:
    raise PlanError(f"plan file {name!r}: {e}") from None


def ManualPlan(stages: Iterable[StageSpec | dict | Sequence], *,  # noqa: N802 - reads as a type
               num_microbatches: int | None = None, schedule: str | None = None,
               eps: float | None = None, remat: str = "none") -> Plan:
  """A plan written by hand, on the layers the step marks (``layer_source="marked"``).

  Each stage is a :class:`StageSpec`, a dict of its fields, or a tuple
  ``(layers, subcluster, submesh[, logical_mesh])``::

    ManualPlan([((0, 3), "v100", (1, 2), (2, 1)),
                ((4, 9), "a100", (1, 2), (1, 2)),
                ((10, 15), "a100", (1, 4))])

  ``schedule`` (default ``"h1f1b"``), ``eps`` (the H-1F1B tolerance its warm-up counts are
  derived with, default 0.1) and ``remat`` (what the stages' backward recomputes, unless a
  stage says) are the plan's fields (:class:`Plan`).
  """
  kw = {}
  if schedule is not None:
    kw["schedule"] = schedule
  return Plan(stages=tuple(_stage_from_any(s) for s in stages),
              num_microbatches=num_microbatches, eps=eps, remat=remat, **kw)


LAYER_SOURCES = ("marked", "auto")
"""The values of :attr:`Plan.layer_source`."""

_META_FIELDS = {"eps": "eps", "remat": "remat", "layers": "layer_source",
                "microbatch_size": "microbatch_size"}
"""Keys of ``meta`` that plans written before these fields existed used, and their fields."""

_PLAN_FIELDS = ("format", "stages", "num_microbatches", "schedule", "num_layers", "t_max_s",
                "predicted_iteration_s", "eta", "eps", "remat", "layer_source",
                "layer_options", "microbatch_size", "meta")
"""The fields of a plan file (:meth:`Plan.to_json`)."""


def _layer_options(data: Any) -> LayerOptions | None:
  """A plan file's ``layer_options`` object as :class:`LayerOptions` (``None`` stays)."""
  if data is None:
    return None
  known = [f.name for f in dataclasses.fields(LayerOptions)]
  if not isinstance(data, dict) or set(data) - set(known):
    raise PlanError(f"layer_options={data!r} must be an object with fields among {known}")
  try:
    return LayerOptions(**data)
  except HarpjaxError as e:
    raise PlanError(f"layer_options: {e}") from None


def _stage_from_any(s: Any) -> StageSpec:
  if isinstance(s, StageSpec):
    return s
  if isinstance(s, dict):
    return StageSpec.from_json(s)
  if isinstance(s, (tuple, list)) and 3 <= len(s) <= 4:
    return StageSpec(*s)
  raise PlanError(f"cannot read stage {s!r}: give a StageSpec, a dict, or "
                  "(layers, subcluster, submesh[, logical_mesh])")


def check_device_groups(stages: Sequence[StageSpec], schedule: str) -> None:
  """Stages that share a device group (an interleaved schedule, ``v`` chunks per group: stage
  ``i`` on group ``i mod (S / v)``) must describe the same devices: equal subcluster, submesh
  and logical mesh, equal explicit devices if any, and no groups of a mixed-type stage. Only
  a schedule with ``chunks > 1`` puts stages on one device group; with any other, every stage
  has devices of its own (:func:`~harpjax.compiler.stages.resolve_devices` checks that).

  Raises:
    PlanError: the stages do not divide into the schedule's groups, or two stages of one group
      differ (which, and how to fix it).
  """
  kind = schedule_kind(schedule)
  if kind.chunks == 1:
    return
  S, v = len(stages), kind.chunks
  if S % v:
    raise PlanError(f"schedule {kind.name!r} runs v={v} stages per device group, but the plan "
                    f"has {S} stages: use a multiple of {v} stages, or another schedule")
  d = S // v
  for i in range(d, S):
    a, b = stages[i % d], stages[i]
    for name in ("subcluster", "submesh", "logical_mesh", "devices"):
      if b.devices is None and name == "devices":
        continue
      if getattr(a, name) != getattr(b, name):
        raise PlanError(
            f"stages {i % d} and {i} share device group {i % d} under schedule {kind.name!r} "
            f"(stage i runs on group i mod {d}), but their {name} differ "
            f"({getattr(a, name)!r} vs {getattr(b, name)!r}): give the stages of one group the "
            "same subcluster, submesh, logical mesh and devices")
    if a.groups or b.groups:
      raise PlanError(f"stage {i} shares device group {i % d} under schedule {kind.name!r}; "
                      "a stage on several groups (a mixed-type stage) cannot share one")
