"""The profile database: one JSON file per costed piece, keyed by what determines its cost.

Entries are keyed by a dict (layer signature, GPU type, submesh, logical mesh, microbatch
size, cost source, ...) and stamped with the library version; a file that does not parse, was
written for another key (hash collision) or another version is ignored and recomputed, never
an error. Writes are atomic (temporary file + rename), so concurrent profilers at worst
compute an entry twice.

The directory is ``$HARPJAX_CACHE_DIR`` if set, else ``~/.cache/harpjax/profiles``
(:data:`CACHE_DIR_ENV`, :func:`default_cache_dir`); profiling functions take it as an argument
too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import jax

from harpjax._version import __version__
from harpjax.compiler.profile.calibration import COST_MODEL_VERSION

log = logging.getLogger(__name__)

__all__ = ["CACHE_DIR_ENV", "default_cache_dir", "ProfileDB", "library_version",
           "SCHEMA_VERSION"]

CACHE_DIR_ENV = "HARPJAX_CACHE_DIR"
"""Environment variable naming the profile cache directory (the one place it is declared)."""

SCHEMA_VERSION = 1
"""Layout of an entry; bump to invalidate every cached entry."""


def default_cache_dir() -> Path:
  """``$HARPJAX_CACHE_DIR`` or ``~/.cache/harpjax/profiles``."""
  env = os.environ.get(CACHE_DIR_ENV)
  if env:
    return Path(env).expanduser()
  return Path("~/.cache/harpjax/profiles").expanduser()


def library_version() -> str:
  """harpjax, JAX and cost-model versions: a change invalidates cached costs."""
  return f"harpjax-{__version__}/jax-{jax.__version__}/cost-{COST_MODEL_VERSION}"


class ProfileDB:
  """A directory of cached profile entries.

  Args:
    root: the cache directory (created on first write); ``None`` disables caching.
    version: stamped on entries; entries of another version are stale.
  """

  def __init__(self, root: str | os.PathLike | None, version: str | None = None):
    self.root = Path(root).expanduser() if root is not None else None
    self.version = version if version is not None else library_version()
    self.hits = 0
    self.misses = 0

  @property
  def enabled(self) -> bool:
    return self.root is not None

  def _path(self, key: dict) -> Path:
    blob = json.dumps(key, sort_keys=True, default=str)
    name = hashlib.sha256(blob.encode()).hexdigest()[:32]
    return self.root / f"v{SCHEMA_VERSION}" / name[:2] / f"{name}.json"

  def get(self, key: dict) -> dict | None:
    """The cached value for ``key``, or ``None`` (absent, corrupt or stale)."""
    if self.root is None:
      return None
    path = self._path(key)
    try:
      with open(path) as f:
        entry = json.load(f)
    except FileNotFoundError:
      self.misses += 1
      return None
    except (OSError, ValueError) as e:
      log.warning("profile cache entry %s is unreadable (%s); recomputing it", path, e)
      self.misses += 1
      return None
    want = json.loads(json.dumps(key, sort_keys=True, default=str))
    if not isinstance(entry, dict) or entry.get("schema") != SCHEMA_VERSION or \
        entry.get("version") != self.version or entry.get("key") != want or \
        not isinstance(entry.get("value"), dict):
      log.info("profile cache entry %s is stale; recomputing it", path.name)
      self.misses += 1
      return None
    self.hits += 1
    return entry["value"]

  def put(self, key: dict, value: dict[str, Any]) -> None:
    """Stores ``value`` (JSON-serialisable) for ``key``; failures only log."""
    if self.root is None:
      return
    path = self._path(key)
    entry = {"schema": SCHEMA_VERSION, "version": self.version,
             "key": json.loads(json.dumps(key, sort_keys=True, default=str)), "value": value}
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
      with os.fdopen(fd, "w") as f:
        json.dump(entry, f)
      os.replace(tmp, path)
    except OSError as e:
      log.warning("could not write profile cache entry %s: %s", path, e)
