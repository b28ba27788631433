"""A stage spanning several hosts: one SPMD program over one process per host.

HARP's submeshes ``(n, M)`` with ``n > 1`` put one stage on ``n`` hosts. The Ray runtime then
starts one worker per host for that stage (a *group*); the group's processes form their own
``jax.distributed`` world (the first member, the *leader*, hosts the coordinator), so that
``jax.devices()`` in each of them is the stage's whole submesh and the stage's executables are
one SPMD program with a :class:`~jax.sharding.NamedSharding` over all of its devices. Every
member loads the same lowered stage, compiles it and runs the same task list in the same order;
XLA's collectives inside the stage run over the group (NCCL on GPUs; Gloo on CPUs).

Messages to and from other stages stay one per stage pair, as the simulator and the network
model count them: before a send, the members gather the message's values to host memory
(:func:`gather`, a collective inside the stage) and only the leader hands it to its sender
thread; a received message reaches the leader, which broadcasts it to the members
(:class:`Broadcaster`, again inside the stage). Values the driver sends reach every member.
The collectives use ``jax.experimental.multihost_utils``, which assumes the same number of
devices on every host of the stage (submeshes ``(n, M)`` are that).

Each process takes part in every collective its stage issues, in the same order; that holds
because all members run the same deterministic code path, and only the compute thread issues
collectives. A member that dies leaves the others blocked in a collective: the driver reports
the dead member's stage (every wait has a timeout) and kills the group.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import socket

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from harpjax.errors import NotEnoughDevicesError, RuntimeFailure

log = logging.getLogger(__name__)

__all__ = ["Group", "join", "free_port", "group_devices", "is_global", "to_host", "gather",
           "allgather_object", "Broadcaster", "put"]


@dataclasses.dataclass(frozen=True)
class Group:
  """This process's place in its stage's group.

  Attributes:
    rank: 0 for the leader (it talks to other stages), ``1..size-1`` for the other members.
    size: number of processes (hosts) of the stage.
    coordinator: ``"ip:port"`` of the ``jax.distributed`` coordinator (on the leader).
  """
  rank: int
  size: int
  coordinator: str

  @property
  def leader(self) -> bool:
    return self.rank == 0


def free_port(address: str) -> int:
  """A TCP port free on ``address`` now (for the coordinator, which binds it shortly after)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((address, 0))
    return int(s.getsockname()[1])


def join(coordinator: str, size: int, rank: int, timeout_s: float) -> Group:
  """Joins the group's ``jax.distributed`` world; must run before this process uses a device.

  Raises:
    RuntimeFailure: JAX already initialised its devices here, or the group did not assemble
      within ``timeout_s``.
  """
  if jax.config.jax_platforms == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=size,
                               process_id=rank, initialization_timeout=max(1, int(timeout_s)))
  except RuntimeError as e:
    raise RuntimeFailure(f"process {rank} of {size} could not join the stage's group at "
                         f"{coordinator}: {str(e).strip().splitlines()[0]}") from None
  if jax.process_count() != size:
    raise RuntimeFailure(f"the stage's group has {jax.process_count()} processes, expected "
                         f"{size}")
  log.info("joined a group of %d processes as rank %d (%s)", size, rank, coordinator)
  return Group(rank, size, coordinator)


def group_devices(layout, stage: int) -> list:
  """The stage's devices in submesh order, from its ``layout``: per device ``(rank, local
  index)``, the member (JAX process index) holding it and its place among that member's
  devices.

  Raises:
    NotEnoughDevicesError: a member has fewer devices than the layout asks of it.
  """
  by_process: dict[int, list] = {}
  for d in jax.devices():
    by_process.setdefault(d.process_index, []).append(d)
  out = []
  for rank, local in layout:
    mine = sorted(by_process.get(rank, []), key=lambda d: d.id)
    if local >= len(mine):
      raise NotEnoughDevicesError(f"stage {stage}: process {rank} of its group has "
                                  f"{len(mine)} devices, the plan puts {local + 1} there")
    out.append(mine[local])
  return out


def is_global(x) -> bool:
  """Whether ``x`` is an array with shards in other processes."""
  return isinstance(x, jax.Array) and not x.is_fully_addressable


def to_host(x):
  """The whole value of ``x`` in this process (a NumPy array, or a key array over one). For a
  global array this is a collective: every member must call it, in the same order."""
  return gather({0: x})[0]


def gather(payload: dict) -> dict:
  """``payload`` with its global arrays replaced by their whole values in host memory (one
  collective for all of them; every member calls it with the same structure)."""
  glob = {k: x for k, x in payload.items() if is_global(x)}
  if not glob:
    return payload
  impls = {k: jax.random.key_impl(x) for k, x in glob.items()
           if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)}
  data = {k: jax.random.key_data(x) if k in impls else x for k, x in glob.items()}
  host = multihost_utils.process_allgather(data, tiled=True)
  out = dict(payload)
  for k in glob:
    x = np.asarray(host[k])
    out[k] = jax.random.wrap_key_data(x, impl=impls[k]) if k in impls else x
  return out


class Broadcaster:
  """Sends a message the leader received to every member of its group.

  A message kind (its key without the microbatch) always has the same structure: the first
  message of a kind broadcasts its structure (names, shapes, dtypes; two small collectives),
  every message then goes as one buffer of its arrays' bytes (one collective; bit exact for
  any dtype).
  """

  def __init__(self, group: Group):
    self.group = group
    self.specs: dict = {}

  def __call__(self, payload: dict | None, kind) -> dict:
    leader = self.group.leader
    spec = self.specs.get(kind)
    if spec is None:
      spec = self.specs[kind] = _broadcast_object(_spec_of(payload) if leader else None,
                                                  leader)
    size = sum(nbytes for _, _, _, nbytes, _ in spec)
    if leader:
      if _spec_of(payload) != spec:
        raise RuntimeFailure(f"message {kind!r} changed its structure between microbatches")
      parts = [_raw(payload[k]).reshape(-1).view(np.uint8) for k, *_ in spec]
      buf = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    else:
      buf = np.zeros(size, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=leader))
    if leader:
      return payload
    buf = buf.astype(np.uint8)
    out, at = {}, 0
    for k, shape, dtype, nbytes, impl in spec:
      x = buf[at:at + nbytes].view(np.dtype(dtype)).reshape(shape)
      at += nbytes
      out[k] = jax.random.wrap_key_data(x, impl=impl) if impl else x
    return out


def _raw(x) -> np.ndarray:
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x, order="C")   # (ascontiguousarray would make a scalar 1-d)


def _spec_of(payload: dict) -> tuple:
  out = []
  for k in sorted(payload, key=repr):
    x = payload[k]
    impl = (str(jax.random.key_impl(x)) if isinstance(x, jax.Array) and
            jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else None)
    r = _raw(x)
    out.append((k, tuple(r.shape), r.dtype.str, int(r.nbytes), impl))
  return tuple(out)


def allgather_object(obj) -> list:
  """Every member's picklable ``obj``, by rank (a collective: two ``process_allgather``s,
  of the lengths and of the padded bytes)."""
  blob = np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray([blob.size], np.int64)))
  sizes = sizes.reshape(-1)
  buf = np.zeros(int(sizes.max()), np.uint8)
  buf[:blob.size] = blob
  data = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
  return [pickle.loads(data[r, :int(n)].astype(np.uint8).tobytes())
          for r, n in enumerate(sizes)]


def _broadcast_object(obj, leader: bool):
  """A picklable object of the leader's on every member (two collectives: length, bytes)."""
  if leader:
    blob = np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)
    size = np.asarray([blob.size], np.int64)
  else:
    blob, size = None, np.zeros(1, np.int64)
  size = int(np.asarray(multihost_utils.broadcast_one_to_all(size, is_source=leader))[0])
  if not leader:
    blob = np.zeros(size, np.uint8)
  data = np.asarray(multihost_utils.broadcast_one_to_all(blob, is_source=leader))
  return obj if leader else pickle.loads(data.astype(np.uint8).tobytes())


def put(x, sharding: NamedSharding):
  """``x`` on ``sharding``, also when the sharding spans other processes and ``x`` lives in
  this one only (it then goes through host memory; every member holds the same value)."""
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  if sharding.is_fully_addressable or is_global(x):
    return jax.device_put(x, sharding)
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  return jax.device_put(np.asarray(x), sharding)
