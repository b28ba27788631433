"""Handles of values that stay on stage workers, and saving gathered state.

A step's outputs that the runtime keeps on the workers come back to the driver as
:class:`RemoteArray` handles: which stage holds which leaf, and its shape and dtype. Passing a
handle back into the next step moves nothing; :func:`gather` fetches the arrays;
:func:`save_tree` / :func:`load_tree` write and read them as ``.npz`` files.
"""

from __future__ import annotations

import itertools
import os
import weakref
import zipfile

import jax
import jax.numpy as jnp
import numpy as np

from harpjax.errors import HarpjaxError, RuntimeFailure
from harpjax.runtime import codec

__all__ = ["RemoteArray", "gather", "save_tree", "load_tree", "register_runner",
           "unregister_runner", "new_runner_id"]

_RUNNERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


class RemoteArray:
  """A step output that stays on the stage worker that computed it.

  Pass it back into the step (nothing moves), or fetch it with :func:`gather`
  (``np.asarray(handle)`` fetches too).

  Attributes:
    stage: the stage holding it.
    key: ``(step, output index)`` on that stage.
    shape, dtype: of the array.
  """
  __slots__ = ("runner_id", "stage", "key", "shape", "dtype", "__weakref__")

  def __init__(self, runner_id: int, stage: int, key: tuple, shape, dtype):
    self.runner_id, self.stage, self.key = runner_id, stage, tuple(key)
    self.shape, self.dtype = tuple(shape), dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  def __repr__(self) -> str:
    return (f"RemoteArray(stage={self.stage}, step={self.key[0]}, output={self.key[1]}, "
            f"shape={self.shape}, dtype={self.dtype})")

  def gather(self):
    """The array, fetched from its stage."""
    return gather(self)

  def __array__(self, dtype=None, copy=None):
    x = np.asarray(self.gather())
    return x if dtype is None else x.astype(dtype)


def _runner_of(handle: RemoteArray):
  runner = _RUNNERS.get(handle.runner_id)
  if runner is None:
    raise RuntimeFailure(f"{handle!r} belongs to a runner that was shut down; its value is lost")
  return runner


def gather(tree):
  """Replaces every :class:`RemoteArray` in ``tree`` by the array it stands for."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  by_runner: dict[int, list[int]] = {}
  for i, x in enumerate(leaves):
    if isinstance(x, RemoteArray):
      by_runner.setdefault(x.runner_id, []).append(i)
  for rid, idx in by_runner.items():
    runner = _runner_of(leaves[idx[0]])
    for i, v in zip(idx, runner.fetch_handles([leaves[i] for i in idx])):
      leaves[i] = v
  return jax.tree_util.tree_unflatten(treedef, leaves)


def save_tree(path: str | os.PathLike, tree) -> None:
  """Writes the arrays of ``tree`` (handles gathered) to an ``.npz`` file keyed by their
  pytree paths; PRNG keys are stored as their key data with the impl in the key name."""
  tree = gather(tree)
  arrays = {}
  for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = jax.tree_util.keystr(kp) or "<root>"
    e = codec.encode(jnp.asarray(x) if not isinstance(x, (np.ndarray, jax.Array)) else x)
    if e[0] == "k":
      arrays[f"{name}#key:{e[1]}"] = e[2]
    else:
      arrays[name] = np.asarray(e[1])
  # Written aside, then renamed: an interrupted save leaves the previous file intact.
  path = os.fspath(path)
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    with open(tmp, "wb") as f:
      np.savez(f, **arrays)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def load_tree(path: str | os.PathLike, like):
  """Reads :func:`save_tree`'s file into the structure of ``like`` (a pytree of the same
  structure: the initial state, say); shapes and dtypes are checked against ``like``'s."""
  try:
    with np.load(path) as data:
      stored = {}
      for name in data.files:
        base, _, impl = name.partition("#key:")
        stored[base] = (data[name], impl or None)
  except (EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
    raise HarpjaxError(f"{path} is not a complete saved state ({type(e).__name__}: {e}); it "
                       "may have been truncated by an interrupted save of an older version, "
                       "or it is another kind of file") from None
  out = []
  flat, treedef = jax.tree_util.tree_flatten_with_path(like)
  for kp, like_leaf in flat:
    name = jax.tree_util.keystr(kp) or "<root>"
    if name not in stored:
      raise HarpjaxError(f"{path}: no array for {name}; the file was saved from a different "
                         "structure")
    arr, impl = stored[name]
    want = _leaf_spec(like_leaf)
    if want is not None and not impl and (tuple(arr.shape), np.dtype(arr.dtype)) != want:
      raise HarpjaxError(f"{path}: {name} is {arr.dtype}{list(arr.shape)} in the file but "
                         f"{want[1]}{list(want[0])} in the state it is loaded into")
    out.append(jax.random.wrap_key_data(arr, impl=impl) if impl else jnp.asarray(arr))
  return jax.tree_util.tree_unflatten(treedef, out)




def _leaf_spec(x):
  """``(shape, dtype)`` of an array-like leaf, ``None`` for typed keys and unknowns."""
  dtype = getattr(x, "dtype", None)
  if dtype is None or not hasattr(x, "shape"):
    return None
  try:
    return tuple(x.shape), np.dtype(dtype)
  except TypeError:   # PRNG keys
    return None


def new_runner_id() -> int:
  return next(_IDS)


def register_runner(runner_id: int, runner) -> None:
  """Makes ``runner`` answer :func:`gather` for its handles (``runner.fetch_handles``)."""
  _RUNNERS[runner_id] = runner


def unregister_runner(runner_id: int) -> None:
  _RUNNERS.pop(runner_id, None)
