"""A group of a mixed-type stage in a process of its own: the group's half of the stage's work.

A mixed-type stage (:attr:`~harpjax.compiler.plan.StageSpec.groups`) splits every
microbatch's rows among groups of devices of several GPU types
(:mod:`harpjax.compiler.stages.split`). On one machine all of them run in the stage worker's
process; across hosts (each GPU type on its own machines) the Ray runtime starts one
:class:`GroupWorker` per group on another host than the stage's first group, the *home*. The
home's worker drives it with plain calls, in order (the Ray actor runs one at a time):

* :meth:`~GroupWorker.set_params` once per step: the stage's parameters, which the home holds
  and updates, put on the group's devices in its own shardings (split over its ``dp`` at
  ZeRO-3);
* :meth:`~GroupWorker.fwd` per microbatch: the group's rows of the stage's inputs in, its
  outputs out; its residuals stay here, under the microbatch's first row;
* :meth:`~GroupWorker.bwd` per microbatch: the group's cotangents in, the cotangents of its
  inputs out; its parameter gradients add up in its own accumulator;
* :meth:`~GroupWorker.zeros` at the start of a step and :meth:`~GroupWorker.accumulator` at
  its end: the accumulator the home sums into the stage's, in group order (the cross-group
  reduction).

Values cross as host arrays (:func:`harpjax.runtime.codec.encode`: NumPy, PRNG keys as their
key data), bit for bit what a device holds, so the stage's numbers equal ``jax.jit``'s as when
every group shares one process. Like the stage worker, the class
is plain; :mod:`harpjax.runtime.ray_runtime` makes it an actor.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import jax
import numpy as np

from harpjax.compiler.stages import precompile
from harpjax.errors import NotEnoughDevicesError, RuntimeFailure
from harpjax.runtime import codec
from harpjax.runtime.interpreter import put
from harpjax.runtime.worker import WorkerSpec, apply_settings

log = logging.getLogger(__name__)

__all__ = ["GroupWorker"]


class GroupWorker:
  """Runs group ``g`` of a mixed-type stage (see the module docstring).

  Args:
    spec: the stage's :class:`~harpjax.runtime.worker.WorkerSpec` (its lowered form holds
      every group's executables).
    group: the group's index in the stage (``>= 1``: the home runs group 0).
    devices: the group's JAX devices; default the first ones of this process.
  """

  def __init__(self, spec: WorkerSpec | None = None, group: int = 0, devices=None):
    self.stage = self.group = -1
    self.exe = None
    self.params: tuple | None = None
    self.acc = None
    self.residuals: dict[int, tuple] = {}
    if spec is not None:
      self.build(spec, group, devices)

  def build(self, spec: WorkerSpec, group: int, devices=None) -> float:
    """Loads and compiles the group's executables; returns the seconds it took."""
    t0 = time.time()
    apply_settings(spec)
    s, lowered = spec.stage, spec.lowered
    split = lowered.layout.splits.get(s)
    if split is None or not 0 < group < len(split.groups):
      raise RuntimeFailure(f"stage {s} has no group {group} to run in a process of its own")
    n = split.groups[group].num_devices
    if devices is None:
      avail = jax.devices()
      if len(avail) < n:
        raise NotEnoughDevicesError(f"group {group} of stage {s} needs {n} devices but its "
                                    f"process has {len(avail)} ({avail[0].platform})")
      devices = avail[:n]
    self.stage, self.group = s, group
    self.exe = lowered.load_group(s, group, list(devices))
    self.residuals = {}
    self.params = self.acc = None
    precompile(lowered.layout, {s: self.exe}, {}, workers=1)
    log.info("stage %d, group %d ready on %s in %.2f s", s, group, list(devices),
             time.time() - t0)
    return time.time() - t0

  def info(self) -> dict:
    return {"hostname": socket.gethostname(), "pid": os.getpid(),
            "devices": [str(d) for d in self.exe.mesh.devices.flat] if self.exe else []}

  def ping(self) -> int:
    return self.stage

  def set_params(self, params) -> None:
    lay = self.exe.layout
    self.params = self._put(lay.param_ids, params)

  def zeros(self) -> None:
    self.acc = self.exe.zeros()
    self.residuals = {}   # a step that failed leaves none behind

  def fwd(self, key: int, acts, acts_int, data) -> tuple:
    """Runs the forward of the microbatch whose rows here start at row ``key`` of the batch
    (the random numbers' position too); keeps its residuals; returns its outputs."""
    if self.params is None:
      raise RuntimeFailure(f"stage {self.stage}, group {self.group}: a forward before the "
                           "stage's parameters arrived")
    lay, ex = self.exe.layout, self.exe
    outs, res = ex.fwd(self.params, self._put(lay.act_ids, acts),
                       self._put(lay.act_int_ids, acts_int), self._put(lay.data_ids, data),
                       np.int32(key))
    self.residuals[key] = res
    return tuple(codec.encode(x) for x in outs)

  def bwd(self, key: int, cts) -> tuple:
    """Runs the backward of microbatch ``key`` (its cotangents: those of the outputs that have
    one); adds its parameter gradients to the accumulator; returns its inputs' cotangents."""
    lay = self.exe.layout
    present = [v for v, has in zip(lay.output_ids, lay.ct_present) if has]
    res = self.residuals.pop(key)
    self.acc, act_cts = self.exe.bwd(self.params, res, self._put(present, cts), self.acc)
    return tuple(codec.encode(x) for x in act_cts)

  def accumulator(self) -> tuple:
    """The group's parameter gradients of this step (encoded host arrays)."""
    return tuple(codec.encode(x) for x in self.acc)

  def reset(self) -> None:
    self.params = self.acc = None
    self.residuals = {}

  def _put(self, ids, encoded) -> tuple:
    return tuple(put(codec.decode(e), self.exe.sharding(v)) for v, e in zip(ids, encoded))
