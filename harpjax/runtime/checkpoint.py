"""Checkpoints of the training state that restore onto any plan, any cluster, or ``jax.jit``.

A checkpoint holds the state as the undecorated step sees it: a pytree of arrays (remote
handles of the Ray runtime are gathered first), nothing about stages or devices. It is written
with Orbax (``orbax-checkpoint``, Flax's checkpoint library): each save goes to a temporary
directory that is renamed when complete, so an interrupted save leaves the previous checkpoints
intact and is not listed; with ``asynchronous=True`` the write runs in the background while
training goes on.

Layout of one checkpoint (step ``N`` under the directory): ``arrays`` (the leaves, named
``leaf_00000``...) and ``meta`` (JSON: per leaf its pytree path, shape, dtype, and the PRNG
implementation of typed keys). Restoring compares ``meta`` with the tree the caller expects
(``like``: the initial state, or ``jax.ShapeDtypeStruct`` s) and names the first leaf whose
path, shape or dtype differs before reading any array.

Usage::

    ckpt = harpjax.Checkpointer("/ckpt/run1", keep=3)
    ckpt.save(step, state)                      # or auto_parallel(..., checkpoint=...)
    state = ckpt.restore(like=state)            # the newest complete checkpoint
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from harpjax.errors import HarpjaxError
from harpjax.runtime.handles import gather

log = logging.getLogger(__name__)

__all__ = ["CheckpointOptions", "Checkpointer", "CheckpointError", "save_checkpoint",
           "restore_checkpoint"]


class CheckpointError(HarpjaxError):
  """A checkpoint cannot be written or does not fit the state it is restored into."""


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
    if not isinstance(self.every, int) or self.every < 1:
      raise CheckpointError(f"CheckpointOptions.every must be a positive integer, got "
                            f"{self.every!r}")
    if self.keep is not None and (not isinstance(self.keep, int) or self.keep < 1):
      raise CheckpointError(f"CheckpointOptions.keep must be a positive integer or None, got "
                            f"{self.keep!r}")

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


def _finish_at_exit(ckpt: "Checkpointer") -> None:
  """Makes a script that ends right after an asynchronous save still complete it.

  The save's last step (renaming the finished directory) runs on Python's thread pools,
  which refuse work once the interpreter starts shutting down; hooks registered with the
  ``threading`` module run before that (``atexit`` hooks run after it and are the fallback).
  """
  ref = weakref.ref(ckpt)

  def finish():
    c = ref()
    if c is not None:
      try:
        c.wait()
      except Exception as e:  # noqa: BLE001 -- never fail the interpreter's exit
        log.warning("%s: the last asynchronous checkpoint did not complete: %s", c.directory, e)

  register = getattr(threading, "_register_atexit", None)
  try:
    if register is None:
      raise RuntimeError
    register(finish)
  except RuntimeError:   # not available, or the interpreter is shutting down already
    atexit.register(finish)


class Checkpointer:
  """Saves and restores the training state under one directory, one checkpoint per step.

  Args:
    directory: created if missing.
    keep: newest checkpoints kept (``None``: all).
    asynchronous: write in the background; :meth:`wait` (or :meth:`close`) blocks until the
      writes are on disk.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3,
               asynchronous: bool = False):
    import orbax.checkpoint as ocp   # imported on first use: it starts background threads

    self._ocp = ocp
    self.directory = os.path.abspath(os.fspath(directory))
    parent = os.path.dirname(self.directory)
    if not os.path.isdir(parent):
      raise CheckpointError(f"cannot write checkpoints to {self.directory}: {parent} does not "
                            "exist")
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=asynchronous)
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    if asynchronous:
      _finish_at_exit(self)

  # ------------------------------------------------------------------ save

  def save(self, step: int, state, *, force: bool = True) -> bool:
    """Writes ``state`` (gathered if it holds remote handles) as checkpoint ``step``.

    Returns whether a checkpoint was written (Orbax skips a step that already exists).
    """
    state = gather(state)
    arrays, meta = _flatten(state)
    args = self._ocp.args.Composite(arrays=self._ocp.args.StandardSave(arrays),
                                    meta=self._ocp.args.JsonSave({"leaves": meta}))
    try:
      return bool(self._manager.save(int(step), args=args, force=force))
    except ValueError as e:   # an existing step, say
      raise CheckpointError(f"{self.directory}: cannot save step {step}: {e}") from None

  def wait(self) -> None:
    """Blocks until every asynchronous save is complete."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ------------------------------------------------------------------ restore

  def steps(self) -> list[int]:
    """Steps of the complete checkpoints, oldest first."""
    self._manager.reload()
    return sorted(int(s) for s in self._manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def restore(self, like, step: int | None = None):
    """The state of checkpoint ``step`` (default: the newest) in the structure of ``like``.

    Args:
      like: a pytree of the state's structure (the initial state, arrays or
        ``jax.ShapeDtypeStruct``; typed PRNG keys are restored as keys).
      step: which checkpoint.

    Raises:
      CheckpointError: no checkpoint, or one whose leaves differ from ``like`` (the first
        differing path, shape or dtype is named).
    """
    if step is None:
      step = self.latest_step()
      if step is None:
        raise CheckpointError(f"{self.directory} holds no complete checkpoint")
    elif step not in self.steps():
      raise CheckpointError(f"{self.directory} holds no checkpoint of step {step} "
                            f"(complete ones: {self.steps()})")
    where = f"{self.directory} step {step}"
    meta = self._manager.restore(step, args=self._ocp.args.Composite(
        meta=self._ocp.args.JsonRestore()))["meta"]["leaves"]
    expected, treedef = _expected(like)
    if len(meta) != len(expected):
      raise CheckpointError(f"{where} holds {len(meta)} arrays but the state has "
                            f"{len(expected)} leaves; it was saved from another structure")
    abstract = {}
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
      abstract[f"leaf_{i:05d}"] = jax.ShapeDtypeStruct(shape, np.dtype(dtype))
    arrays = self._manager.restore(step, args=self._ocp.args.Composite(
        arrays=self._ocp.args.StandardRestore(abstract)))["arrays"]
    leaves = []
    for i, (_, _, _, impl) in enumerate(expected):
      x = arrays[f"leaf_{i:05d}"]
      leaves.append(jax.random.wrap_key_data(x, impl=impl) if impl else x)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def save_checkpoint(directory: str | os.PathLike, state, step: int = 0, *,
                    keep: int | None = None) -> None:
  """Writes one checkpoint synchronously (see :class:`Checkpointer`)."""
  with Checkpointer(directory, keep=keep) as ckpt:
    ckpt.save(step, state)


def restore_checkpoint(directory: str | os.PathLike, like, step: int | None = None):
  """Reads checkpoint ``step`` (default: the newest) into the structure of ``like``."""
  with Checkpointer(directory, keep=None) as ckpt:
    return ckpt.restore(like, step)
