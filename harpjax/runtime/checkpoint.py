"""Checkpoints of the training state that restore onto any plan, any cluster, or ``jax.jit``.

A checkpoint holds the state as the undecorated step sees it: a pytree of arrays (remote
handles of the Ray runtime are gathered first), nothing about stages or devices. It is written
with Orbax (``orbax-checkpoint``, Flax's checkpoint library) to a temporary directory that is
renamed when complete, so an interrupted or killed save leaves the previous checkpoints intact
and is never listed; with ``asynchronous=True`` the write runs in the background while training
goes on.

Layout of one checkpoint (step ``N`` under the directory): ``arrays`` (the leaves, named
``leaf_00000``...) and ``meta`` (JSON: per leaf its pytree path, shape, dtype, CRC-32 of its
bytes, and the PRNG implementation of typed keys). Restoring compares ``meta`` with the tree
the caller expects (``like``: the initial state, or ``jax.ShapeDtypeStruct`` s) and names the
first leaf whose path, shape or dtype differs before reading any array, then checks every
array against its checksum.

Faults. Every read and write runs on a thread of the checkpointer's own, in order, and the
caller only waits for it: Ctrl-C stops the wait at once (``KeyboardInterrupt``), never a write
half-way, and a save that was started completes (the process waits for it at exit, even when
the :class:`Checkpointer` is gone; a second Ctrl-C there gives it up). Saving a step that is
already on disk keeps it if it holds the same state (a step retried after an interrupt) and
replaces it otherwise. Restoring without a step takes the newest *intact* checkpoint: one that
is incomplete (an empty step directory), unreadable or whose arrays do not match their
checksums is skipped with one warning naming it. Temporary directories left by a killed process
are removed when the next checkpointer opens the directory.

Usage::

    ckpt = harpjax.Checkpointer("/ckpt/run1", keep=3)
    ckpt.save(step, state)                      # or auto_parallel(..., checkpoint=...)
    state = ckpt.restore(like=state)            # the newest intact checkpoint
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import dataclasses
import logging
import os
import re
import shutil
import sys
import threading
import time
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from harpjax.errors import HarpjaxError, InvalidOptionError, check_count, check_flag
from harpjax.runtime.handles import gather

log = logging.getLogger(__name__)

__all__ = ["CheckpointOptions", "Checkpointer", "CheckpointError", "CheckpointOptionsError",
           "save_checkpoint", "restore_checkpoint"]


class CheckpointError(HarpjaxError):
  """A checkpoint cannot be written or does not fit the state it is restored into."""


class CheckpointOptionsError(InvalidOptionError, CheckpointError):
  """A field of :class:`CheckpointOptions` has a value it cannot take: an
  :class:`~harpjax.errors.InvalidOptionError`, and a :class:`CheckpointError` as well (which
  ``CheckpointOptions`` raised in earlier releases). The message names the field; change it."""


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
  """Periodic checkpoints of a step (``auto_parallel(..., checkpoint=CheckpointOptions(...))``).

  Attributes:
    directory: where checkpoints go (created if missing).
    every: save after every ``every``-th completed step.
    keep: newest checkpoints kept (``None``: all).
    asynchronous: write in the background (the next step does not wait for the disk).
    state_output: which element of the step's result tuple is the new training state
      (``None``: the whole result).
  """
  directory: str
  every: int = 1
  keep: int | None = 3
  asynchronous: bool = True
  state_output: int | None = 0

  def __post_init__(self):
    if not isinstance(self.directory, str) and not hasattr(self.directory, "__fspath__"):
      raise CheckpointOptionsError(f"CheckpointOptions.directory={self.directory!r} must be a "
                                   "directory (a str or path)")
    try:
      check_count("CheckpointOptions.every", self.every, 1)
      check_count("CheckpointOptions.keep", self.keep, 1, allow_none=True)
      check_count("CheckpointOptions.state_output", self.state_output, 0, allow_none=True)
      check_flag("CheckpointOptions.asynchronous", self.asynchronous)
    except InvalidOptionError as e:
      raise CheckpointOptionsError(str(e)) from None

  def state_of(self, result):
    """The training state inside a step's result."""
    if self.state_output is None:
      return result
    if not isinstance(result, (tuple, list)) or len(result) <= self.state_output:
      raise CheckpointError(
          f"CheckpointOptions.state_output={self.state_output} but the step returned "
          f"{type(result).__name__}; set state_output to the index of the new state in the "
          "step's result, or None to save the whole result")
    return result[self.state_output]


def _is_key(x) -> bool:
  try:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  except (AttributeError, TypeError):
    return False


def _flatten(tree) -> tuple[dict, list]:
  """``({leaf_i: numpy array}, [meta per leaf])`` of a gathered state."""
  arrays, meta = {}, []
  for i, (path, x) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
    entry = {"path": jax.tree_util.keystr(path) or "<root>"}
    if _is_key(x):
      entry["key_impl"] = str(jax.random.key_impl(x))
      x = jax.random.key_data(x)
    a = np.asarray(x)
    entry.update(shape=list(a.shape), dtype=str(a.dtype))
    arrays[f"leaf_{i:05d}"] = a
    meta.append(entry)
  return arrays, meta


def _expected(like) -> tuple[list, Any]:
  """Per leaf of ``like``: ``(path, shape, dtype, key impl or None)``, and its treedef."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(like)
  out = []
  for path, x in flat:
    name = jax.tree_util.keystr(path) or "<root>"
    if _is_key(x):
      data = jax.eval_shape(jax.random.key_data, x)
      out.append((name, tuple(data.shape), str(data.dtype), str(jax.random.key_impl(x))))
    else:
      shape = tuple(getattr(x, "shape", np.shape(x)))
      dtype = getattr(x, "dtype", None) or jnp.result_type(x)
      out.append((name, shape, str(np.dtype(dtype)), None))
  return out, treedef


def _checksum(a: np.ndarray) -> int:
  """CRC-32 of an array's bytes (C order)."""
  return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


class _Damaged(Exception):
  """A checkpoint directory that cannot be read back as it was written (the message says
  why); the restore falls back to an older one."""


# --------------------------------------------------------------------------- disk work

# Checkpointers with disk work queued or running, held here (strongly) until it is done, so
# that a save completes at exit even when nothing else refers to its checkpointer.
_ACTIVE: dict["_DiskWork", str] = {}
_ACTIVE_LOCK = threading.Lock()
_EXIT_HOOK = False


class _DiskWork:
  """Runs one checkpointer's reads and writes in order on a daemon thread that exists only
  while there is work; the caller waits on the returned future (which Ctrl-C interrupts)."""

  def __init__(self, directory: str):
    self.directory = directory
    self._jobs: collections.deque = collections.deque()
    self._lock = threading.Lock()
    self._thread: threading.Thread | None = None

  def submit(self, fn, *args) -> cf.Future:
    fut: cf.Future = cf.Future()
    with self._lock:
      self._jobs.append((fut, fn, args))
      self._ensure_thread()
    return fut

  def _ensure_thread(self) -> None:
    """Under the lock: a thread runs the queued jobs. Ctrl-C anywhere in here, even inside
    ``Thread.start``, leaves what the next call completes: a thread that never started is
    replaced (one that started after all finds it was replaced and ends)."""
    if self._thread is not None and self._thread.is_alive():
      return
    if self._idle():
      return
    _finish_at_exit()
    with _ACTIVE_LOCK:
      _ACTIVE[self] = self.directory
    thread = threading.Thread(target=self._run, daemon=True, name="harpjax-checkpoint")
    self._thread = thread
    thread.start()

  def _idle(self) -> bool:
    """Under the lock: with no job queued, no thread and nothing to wait for at exit."""
    if self._jobs:
      return False
    self._thread = None
    with _ACTIVE_LOCK:
      _ACTIVE.pop(self, None)
    return True

  def _run(self) -> None:
    me = threading.current_thread()
    while True:
      with self._lock:
        if self._thread is not me:   # replaced: its start was interrupted
          return
        if self._idle():
          return
        fut, fn, args = self._jobs.popleft()
      if fut.set_running_or_notify_cancel():
        try:
          fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 -- handed to the waiting caller
          fut.set_exception(e)

  def join(self, timeout_s: float | None = None) -> bool:
    """Waits until the queued work is done; returns whether it is."""
    with self._lock:
      self._ensure_thread()   # jobs whose thread's start was interrupted
      thread = self._thread
    if thread is not None:
      thread.join(timeout_s)
    return not (thread is not None and thread.is_alive())


def _busy(directory: str) -> bool:
  with _ACTIVE_LOCK:
    return directory in _ACTIVE.values()


def _finish_at_exit() -> None:
  """Makes the interpreter's exit wait for the checkpoints being written (once per process).

  Orbax's writes use Python's thread pools, which refuse work once the interpreter starts
  shutting down; hooks registered with the ``threading`` module run before that (``atexit``
  hooks run after it and are the fallback). Ctrl-C while waiting gives the writes up: their
  temporary directories are removed when the directory is next opened.
  """
  global _EXIT_HOOK
  if _EXIT_HOOK:
    return
  _EXIT_HOOK = True

  def finish():
    with _ACTIVE_LOCK:
      pending = list(_ACTIVE.items())
    for work, directory in pending:
      try:
        work.join()
      except KeyboardInterrupt:
        log.warning("%s: interrupted while the last checkpoint was written; it is incomplete "
                    "and will not be listed", directory)
        return
      except RuntimeError as e:   # its thread never started, and none can start at exit
        log.warning("%s: the last checkpoint could not be written at exit (%s); it will not "
                    "be listed", directory, e)

  register = getattr(threading, "_register_atexit", None)
  try:
    if register is None:
      raise RuntimeError
    register(finish)
  except RuntimeError:   # not available, or the interpreter is shutting down already
    atexit.register(finish)


# --------------------------------------------------------------------------- checkpointer


class Checkpointer:
  """Saves and restores the training state under one directory, one checkpoint per step.

  Args:
    directory: created if missing (its parent must exist).
    keep: newest checkpoints kept (``None``: all).
    asynchronous: write in the background; :meth:`wait` (or :meth:`close`) blocks until the
      writes are on disk.

  Raises:
    CheckpointError: the directory cannot be created or written.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3,
               asynchronous: bool = False):
    import orbax.checkpoint as ocp   # imported on first use: it starts background threads

    self._ocp = ocp
    self.directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    self.keep = keep
    self.asynchronous = bool(asynchronous)
    parent = os.path.dirname(self.directory)
    if not os.path.isdir(parent):
      raise CheckpointError(f"cannot write checkpoints to {self.directory}: {parent} does not "
                            "exist; create it or choose another directory")
    try:
      os.makedirs(self.directory, exist_ok=True)
    except OSError as e:
      raise CheckpointError(f"cannot create the checkpoint directory {self.directory}: "
                            f"{e.strerror or e}; choose another directory") from None
    if not os.path.isdir(self.directory) or not os.access(self.directory, os.W_OK | os.X_OK):
      why = "permission denied" if os.path.isdir(self.directory) else "not a directory"
      raise CheckpointError(f"cannot write checkpoints to {self.directory}: {why}; choose "
                            "another directory")
    self._work = _DiskWork(self.directory)
    self._pending: list[tuple[int, cf.Future]] = []   # asynchronous saves not yet waited for
    if not _busy(self.directory):
      self._remove_leftovers()

  def _orbax(self, method: str, step: int, **items):
    """On the disk thread: Orbax's ``save`` or ``restore`` of checkpoint ``step``'s
    ``items`` (a checkpointer each time: it binds each item to the handler of its first
    use)."""
    ocp = self._ocp
    ckpt = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
      return getattr(ckpt, method)(self._path(step), args=ocp.args.Composite(**items))
    finally:
      ckpt.close()

  def _path(self, step: int) -> str:
    return os.path.join(self.directory, str(int(step)))

  def _remove_leftovers(self) -> None:
    """Removes temporary directories of saves and deletions a killed process left behind."""
    for name in os.listdir(self.directory):
      if _TMP.fullmatch(name):
        log.info("%s: removing %s, left by an interrupted save", self.directory, name)
        _remove(os.path.join(self.directory, name))

  # ------------------------------------------------------------------ save

  def save(self, step: int, state, *, force: bool = True) -> bool:
    """Writes ``state`` (gathered if it holds remote handles) as checkpoint ``step``.

    The arrays are fetched to host memory here; the write runs on the checkpointer's thread,
    and, unless the checkpointer is asynchronous, this waits for it. Ctrl-C stops the wait,
    not the write.

    Args:
      step: the checkpoint's step.
      state: the pytree to save.
      force: kept for compatibility; a step is always saved.

    Returns:
      ``False`` when checkpoint ``step`` already held this state (a step retried after an
      interrupt), else ``True`` (asynchronous: once the write is queued).

    Raises:
      CheckpointError: this write failed, or (asynchronous) an earlier one did.
    """
    del force
    self._raise_failed()
    state = gather(state)
    arrays, meta = _flatten(state)
    fut = self._work.submit(self._write, int(step), arrays, meta)
    if self.asynchronous:
      self._pending.append((int(step), fut))
      return True
    return self._result(int(step), fut)

  def _result(self, step: int, fut: cf.Future):
    try:
      return fut.result()
    except CheckpointError:
      raise
    except Exception as e:  # noqa: BLE001 -- Orbax's and the file system's errors
      raise CheckpointError(f"{self.directory}: cannot save step {step}: "
                            f"{type(e).__name__}: {_first_line(e)}") from None

  def _raise_failed(self) -> None:
    """Raises the error of the first asynchronous save that failed (and forgets those done)."""
    pending, self._pending = self._pending, []
    for k, (step, fut) in enumerate(pending):
      if fut.done():
        self._result(step, fut)   # raises if it failed
      else:
        self._pending = pending[k:]
        return

  def _write(self, step: int, arrays: dict, meta: list) -> bool:
    """On the disk thread: checkpoint ``step`` (kept if it holds the same state), then the
    oldest beyond ``keep`` removed."""
    for entry, a in zip(meta, arrays.values()):
      entry["crc32"] = _checksum(a)
    path = self._path(step)
    if os.path.lexists(path):
      problem = self._differs(step, meta)
      if problem is None:
        log.info("%s: checkpoint %d already holds this state", self.directory, step)
        return False
      log.warning("%s: replacing checkpoint %d (%s)", self.directory, step, problem)
      self._delete(step)
    ocp = self._ocp
    self._orbax("save", step, arrays=ocp.args.StandardSave(arrays),
                meta=ocp.args.JsonSave({"leaves": meta}))
    if self.keep is not None:
      for old in self._complete_steps()[:-self.keep]:
        self._delete(old)
    return True

  def _differs(self, step: int, meta: list) -> str | None:
    """Why checkpoint ``step`` on disk is not ``meta``'s state intact; ``None`` if it is."""
    try:
      stored = self._read_meta(step)
      if [_identity(m) for m in stored] != [_identity(m) for m in meta]:
        return "it holds another state"
      self._read_arrays(step, stored)
    except _Damaged as e:
      return f"damaged: {e}"
    return None

  def _delete(self, step: int) -> None:
    """Removes checkpoint ``step``: first renamed (so it is no longer listed), then deleted."""
    aside = f"{self._path(step)}.harpjax-deleting-tmp"
    _remove(aside)
    os.replace(self._path(step), aside)
    _remove(aside)

  def wait(self) -> None:
    """Blocks until every save is complete (Ctrl-C stops the wait, not the saves).

    Raises:
      CheckpointError: an asynchronous save failed.
    """
    self._work.join()
    self._raise_failed()

  def close(self) -> None:
    self.wait()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ------------------------------------------------------------------ restore

  def _complete_steps(self) -> list[int]:
    out = []
    for name in os.listdir(self.directory):
      path = os.path.join(self.directory, name)
      if name.isdigit() and all(os.path.isdir(os.path.join(path, d)) for d in _ITEMS):
        out.append(int(name))
    return sorted(out)

  def steps(self) -> list[int]:
    """Steps of the complete checkpoints, oldest first (complete: written to the end; whether
    its files are intact is checked when it is restored)."""
    return self._complete_steps()

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def restore(self, like, step: int | None = None):
    """The state of checkpoint ``step`` (default: the newest intact one) in the structure of
    ``like``.

    Args:
      like: a pytree of the state's structure (the initial state, arrays or
        ``jax.ShapeDtypeStruct``; typed PRNG keys are restored as keys).
      step: which checkpoint.

    Raises:
      CheckpointError: no intact checkpoint (or not ``step``, or ``step`` is damaged), or one
        whose leaves differ from ``like`` (the first differing path, shape or dtype is named).
    """
    if step is None:
      found = self.restore_newest(like)
      if found is None:
        raise CheckpointError(f"{self.directory} holds no complete checkpoint")
      return found[1]
    self._work.join()   # what is being written first (a failed save is the next save's error)
    if not os.path.lexists(self._path(step)):
      raise CheckpointError(f"{self.directory} holds no checkpoint of step {step} "
                            f"(complete ones: {self._complete_steps()})")
    try:
      return self._restore(like, int(step))
    except _Damaged as e:
      raise CheckpointError(f"{self.directory} step {step} is damaged ({e}); restore another "
                            f"step (complete ones: {self._complete_steps()}) or none to take the "
                            "newest intact one") from None

  def restore_newest(self, like) -> tuple[int, Any] | None:
    """``(step, state)`` of the newest intact checkpoint, or ``None`` when there is none.

    Checkpoints that are incomplete, unreadable or whose arrays fail their checksums are
    skipped with one warning naming them.

    Raises:
      CheckpointError: the newest readable checkpoint's leaves differ from ``like``'s, or
        every checkpoint is damaged.
    """
    self._work.join()   # what is being written first (a failed save is the next save's error)
    damaged = []
    try:
      for step in sorted((int(n) for n in os.listdir(self.directory) if n.isdigit()),
                         reverse=True):
        try:
          state = self._restore(like, step)
        except _Damaged as e:
          damaged.append(f"step {step} ({e})")
          continue
        return step, state
    finally:
      if damaged:
        log.warning("%s: skipped damaged checkpoint%s %s", self.directory,
                    "s" * (len(damaged) > 1), "; ".join(damaged))
    if damaged:
      raise CheckpointError(f"{self.directory}: every checkpoint is damaged: "
                            + "; ".join(damaged))
    return None

  def _restore(self, like, step: int):
    expected, treedef = _expected(like)
    where = f"{self.directory} step {step}"
    meta = self._work.submit(self._read_meta, step).result()
    if len(meta) != len(expected):
      raise CheckpointError(f"{where} holds {len(meta)} arrays but the state has "
                            f"{len(expected)} leaves; it was saved from another structure")
    for i, (m, (path, shape, dtype, impl)) in enumerate(zip(meta, expected)):
      if m["path"] != path:
        raise CheckpointError(f"{where}: leaf {i} is {m['path']} in the checkpoint but {path} "
                              "in the state; it was saved from another structure")
      if tuple(m["shape"]) != shape or m["dtype"] != dtype:
        raise CheckpointError(f"{where}: {path} is {m['dtype']}{list(m['shape'])} in the "
                              f"checkpoint but {dtype}{list(shape)} in the state")
      if (m.get("key_impl") is None) != (impl is None):
        raise CheckpointError(f"{where}: {path} is {'a' if impl else 'not a'} PRNG key in the "
                              "state but not so in the checkpoint")
    arrays = self._work.submit(self._read_arrays, step, meta).result()
    leaves = [jax.random.wrap_key_data(x, impl=impl) if impl else jnp.asarray(x)
              for x, (_, _, _, impl) in zip(arrays, expected)]
    return jax.tree_util.tree_unflatten(treedef, leaves)

  def _read_meta(self, step: int) -> list:
    """On the disk thread: the leaves' entries of checkpoint ``step``'s ``meta``."""
    path = self._path(step)
    if not os.path.isdir(path):
      raise _Damaged("not a directory")
    missing = [d for d in _ITEMS if not os.path.isdir(os.path.join(path, d))]
    if missing:
      raise _Damaged(f"incomplete: no {' or '.join(missing)}" if os.listdir(path) else
                     "an empty directory")
    try:
      meta = self._orbax("restore", step, meta=self._ocp.args.JsonRestore())["meta"]["leaves"]
      for m in meta:
        (m["path"], tuple(m["shape"]), np.dtype(m["dtype"]))
    except Exception as e:  # noqa: BLE001 -- whatever a damaged file raises
      raise _Damaged(f"its meta cannot be read: {type(e).__name__}: {_first_line(e)}") \
          from None
    return meta

  def _read_arrays(self, step: int, meta: list) -> list[np.ndarray]:
    """On the disk thread: checkpoint ``step``'s arrays, checked against ``meta``."""
    ocp = self._ocp
    names = [f"leaf_{i:05d}" for i in range(len(meta))]
    try:
      got = self._orbax("restore", step, arrays=ocp.args.PyTreeRestore(restore_args={
          n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names}))["arrays"]
      arrays = [np.asarray(got[n]) for n in names]
    except Exception as e:  # noqa: BLE001 -- whatever a damaged file raises
      _quiet_abandoned_reads(self._path(step))
      raise _Damaged(f"its arrays cannot be read: {type(e).__name__}: {_first_line(e)}") \
          from None
    for m, a in zip(meta, arrays):
      if tuple(a.shape) != tuple(m["shape"]) or str(a.dtype) != m["dtype"]:
        raise _Damaged(f"{m['path']} reads as {a.dtype}{list(a.shape)}, not "
                       f"{m['dtype']}{list(m['shape'])}")
      if "crc32" in m and _checksum(a) != m["crc32"]:
        raise _Damaged(f"{m['path']} does not match its checksum")
    return arrays


_ITEMS = ("arrays", "meta")
_TMP = re.compile(r".*\.(orbax-checkpoint-tmp.*|harpjax-.*-tmp)")


_ABANDONED: set[str] = set()   # checkpoints whose reads failed half-way


def _quiet_abandoned_reads(path: str) -> None:
  """After a read of checkpoint ``path`` that failed half-way, the reads of other arrays
  still in flight complete into the event loop Orbax has closed: each prints ``RuntimeError:
  Event loop is closed`` when the process's unraisable-exception hook reports it, and a
  failed one ``Future exception was never retrieved`` (or ``Task exception ...``: asyncio's
  log, often at exit) when its future is collected. Those (and only those) pass silently: the damage was reported once.
  Called on the disk thread, which then gives them a moment to arrive."""
  _ABANDONED.add(os.path.abspath(path))
  prev = sys.unraisablehook
  if not getattr(prev, "harpjax_quiet", False):
    def hook(u):
      if not (u.object is None and isinstance(u.exc_value, RuntimeError)
              and str(u.exc_value) == "Event loop is closed"):
        prev(u)
    hook.harpjax_quiet = True
    sys.unraisablehook = hook
  asyncio_log = logging.getLogger("asyncio")
  if not any(isinstance(f, _AbandonedReads) for f in asyncio_log.filters):
    asyncio_log.addFilter(_AbandonedReads())
  time.sleep(0.2)


# asyncio's words for a failed future (or a task wrapping one) that nobody awaited
_NEVER_RETRIEVED = ("Future exception was never retrieved", "Task exception was never retrieved")


class _AbandonedReads(logging.Filter):
  """Drops asyncio's report of a never-retrieved failed read of an abandoned checkpoint."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if isinstance(record.exc_info, tuple) else None
    if exc is None or not str(record.msg).startswith(_NEVER_RETRIEVED):
      return True
    text = str(exc)
    return not any(path in text for path in list(_ABANDONED))


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  elif os.path.lexists(path):
    os.remove(path)


def _identity(entry: dict) -> tuple:
  return (entry["path"], tuple(entry["shape"]), entry["dtype"], entry.get("key_impl"),
          entry.get("crc32"))


def _first_line(e: BaseException, limit: int = 300) -> str:
  text = str(e).strip()
  line = text.splitlines()[0] if text else ""
  return line if len(line) <= limit else line[:limit] + " ..."


def save_checkpoint(directory: str | os.PathLike, state, step: int = 0, *,
                    keep: int | None = None) -> None:
  """Writes one checkpoint synchronously (see :class:`Checkpointer`)."""
  with Checkpointer(directory, keep=keep) as ckpt:
    ckpt.save(step, state)


def restore_checkpoint(directory: str | os.PathLike, like, step: int | None = None):
  """Reads checkpoint ``step`` (default: the newest) into the structure of ``like``."""
  with Checkpointer(directory, keep=None) as ckpt:
    return ckpt.restore(like, step)
