"""The profile database: one JSON file per costed piece, keyed by what determines its cost.

Entries are keyed by a dict (layer signature, GPU type, submesh, logical mesh, microbatch
size, cost source, ...) and stamped with the library version; a file that does not parse, was
written for another key (hash collision) or another version is ignored and recomputed, never
an error. Every value read is checked too (:func:`entry_problem`: the fields its kind of entry
holds, each of the right type, finite, times > 0, sizes >= 0): an entry that fails is a miss,
recomputed and overwritten, and a database that met such entries logs one warning saying how
many (when it is dropped or :meth:`ProfileDB.report_invalid` is called), not one per entry.
Values that would not pass are not written. Writes are atomic (temporary file + rename), so
concurrent profilers at worst compute an entry twice.

The directory is ``$HARPJAX_CACHE_DIR`` if set, else ``~/.cache/harpjax/profiles``
(:data:`CACHE_DIR_ENV`, :func:`default_cache_dir`); profiling functions take it as an argument
too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

import jax

from harpjax._version import __version__
from harpjax.compiler.profile.calibration import COST_MODEL_VERSION

log = logging.getLogger(__name__)

__all__ = ["CACHE_DIR_ENV", "default_cache_dir", "ProfileDB", "library_version",
           "SCHEMA_VERSION", "ENTRY_FIELDS", "entry_kind", "entry_problem"]

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


# --------------------------------------------------------------------------- validation

Rule = Callable[[Any], "str | None"]


def _number(minimum: float = 0.0, *, strict: bool = False, integer: bool = False) -> Rule:
  """A rule: a finite JSON number ``>= minimum`` (``>`` when ``strict``), integral if asked."""
  def check(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
      return f"{v!r} is not a number"
    if not math.isfinite(v):
      return f"{v!r} is not finite"
    if v < minimum or (strict and v == minimum):
      return f"{v!r} is not {'>' if strict else '>='} {minimum:g}"
    if integer and v != int(v):
      return f"{v!r} is not an integer"
    return None
  return check


_TIME = _number(strict=True)
_AMOUNT = _number()
_COUNT = _number(integer=True)


def _collectives(v: Any) -> str | None:
  """``{kind: [bytes, count]}``."""
  if not isinstance(v, dict):
    return f"{v!r} is not a mapping of collective kind to [bytes, count]"
  for kind, pair in v.items():
    if not (isinstance(pair, list) and len(pair) == 2):
      return f"[{kind!r}] = {pair!r} is not [bytes, count]"
    problem = _AMOUNT(pair[0]) or _COUNT(pair[1])
    if problem:
      return f"[{kind!r}]: {problem}"
  return None


def _rows(v: Any) -> str | None:
  """A non-empty list of ``[flops, bytes]`` rows."""
  if not isinstance(v, list) or not v:
    return f"{v!r} is not a non-empty list of [flops, bytes] rows"
  for i, row in enumerate(v):
    if not (isinstance(row, list) and len(row) == 2):
      return f"[{i}] = {row!r} is not [flops, bytes]"
    problem = _AMOUNT(row[0]) or _AMOUNT(row[1])
    if problem:
      return f"[{i}]: {problem}"
  return None


ENTRY_FIELDS: dict[str, dict[str, Rule]] = {
    # A layer's cost (LayerCost): seconds per microbatch > 0, the rest >= 0.
    "layer-cost": {"time_s": _TIME, "comm_s": _AMOUNT, "param_mem_bytes": _AMOUNT,
                   "act_mem_bytes": _AMOUNT, "temp_bytes": _AMOUNT, "flops": _AMOUNT,
                   "grad_bytes": _AMOUNT, "fwd_temp_bytes": _AMOUNT, "bwd_temp_bytes": _AMOUNT,
                   "draw_bytes": _AMOUNT, "draw_max_bytes": _AMOUNT,
                   "remat_held_bytes": _AMOUNT, "inner_remat_flops": _AMOUNT,
                   "inner_remat_time_s": _AMOUNT},
    # XLA's statistics of a compiled piece (XlaStats).
    "xla-stats": {"flops": _AMOUNT, "bytes_accessed": _AMOUNT, "transcendentals": _AMOUNT,
                  "collective_bytes": _collectives, "temp_bytes": _AMOUNT,
                  "residual_bytes": _AMOUNT, "param_bytes": _AMOUNT, "num_params": _COUNT,
                  "compile_s": _AMOUNT, "fwd_temp_bytes": _AMOUNT, "bwd_temp_bytes": _AMOUNT,
                  "draw_bytes": _AMOUNT, "draw_max_bytes": _AMOUNT,
                  "remat_held_bytes": _AMOUNT},
    # Per-layer FLOPs and bytes of a published model's block (tools/calibration.py).
    "zorse-block": {"layers": _rows},
}
"""Kind of entry -> the fields its value holds, each with its rule (a function returning the
problem or ``None``). Entries of other kinds only need finite numbers."""


def entry_kind(key: dict) -> str | None:
  """The kind of entry a key asks for (a key of :data:`ENTRY_FIELDS`), or ``None``: ``what``
  names it (``"xla-stats"``), a cost ``source`` means a layer's cost."""
  what = key.get("what") if isinstance(key, dict) else None
  if what is not None:
    return what if what in ENTRY_FIELDS else None
  return "layer-cost" if isinstance(key, dict) and "source" in key else None


def _finite(v: Any, where: str) -> str | None:
  """The first non-finite number inside a JSON value."""
  if isinstance(v, float) and not math.isfinite(v):
    return f"{where or 'value'} = {v!r} is not finite"
  if isinstance(v, dict):
    items = v.items()
  elif isinstance(v, list):
    items = enumerate(v)
  else:
    return None
  for k, x in items:
    problem = _finite(x, f"{where}[{k!r}]" if where else f"[{k!r}]")
    if problem:
      return problem
  return None


def entry_problem(key: dict, value: Any) -> str | None:
  """What is wrong with a cached ``value`` for ``key`` (``None``: nothing).

  The value must be a mapping; for a kind of :data:`ENTRY_FIELDS` it holds exactly that kind's
  fields, each passing its rule; every number in it is finite.
  """
  if not isinstance(value, dict):
    return f"the value is a {type(value).__name__}, not a mapping"
  fields = ENTRY_FIELDS.get(entry_kind(key))
  if fields is not None:
    missing = sorted(set(fields) - set(value))
    unknown = sorted(set(value) - set(fields))
    if missing or unknown:
      return (f"fields {missing} are missing" if missing else
              f"fields {unknown} are not those of a {entry_kind(key)} entry")
    for name, rule in fields.items():
      problem = rule(value[name])
      if problem:
        return f"{name}: {problem}"
  return _finite(value, "")


class _Invalid:
  """Invalid entries a database met: counted, reported once (also when the database is
  dropped or at exit, through a finalizer that holds this and not the database)."""

  def __init__(self, root: Path | None):
    self.root = root
    self.count = 0
    self.reported = 0
    self.first = ""
    self.lock = threading.Lock()

  def add(self, path: Path, problem: str) -> None:
    with self.lock:
      self.count += 1
      if not self.first:
        self.first = f"{path.name}: {problem}"
    log.debug("profile cache entry %s is invalid (%s); recomputing it", path, problem)

  def report(self) -> int:
    with self.lock:
      new, self.reported = self.count - self.reported, self.count
      first, self.first = self.first, ""
    if new:
      log.warning("%d cache entries in %s were invalid and are recomputed (first: %s)", new,
                  self.root, first)
    return new


class ProfileDB:
  """A directory of cached profile entries.

  Args:
    root: the cache directory (created on first write); ``None`` disables caching.
    version: stamped on entries; entries of another version are stale.

  Attributes:
    hits, misses: lookups answered and not (absent, stale or invalid entries).
    invalid: entries that did not parse or failed :func:`entry_problem` (recomputed).
  """

  def __init__(self, root: str | os.PathLike | None, version: str | None = None):
    self.root = Path(root).expanduser() if root is not None else None
    self.version = version if version is not None else library_version()
    self.hits = 0
    self.misses = 0
    self._invalid = _Invalid(self.root)
    self._refused = 0
    self._unwritable = 0
    weakref.finalize(self, self._invalid.report)

  @property
  def enabled(self) -> bool:
    return self.root is not None

  @property
  def invalid(self) -> int:
    return self._invalid.count

  def report_invalid(self) -> int:
    """Logs one warning for the invalid entries met since the last report; returns their
    number. Called when the database is dropped too."""
    return self._invalid.report()

  def _path(self, key: dict) -> Path:
    blob = json.dumps(key, sort_keys=True, default=str)
    name = hashlib.sha256(blob.encode()).hexdigest()[:32]
    return self.root / f"v{SCHEMA_VERSION}" / name[:2] / f"{name}.json"

  def get(self, key: dict) -> dict | None:
    """The cached value for ``key``, or ``None`` (absent, stale or invalid: recompute it)."""
    if self.root is None:
      return None
    path = self._path(key)
    try:
      with open(path) as f:
        entry = json.load(f)
    except FileNotFoundError:
      self.misses += 1
      return None
    except (OSError, ValueError) as e:   # unreadable, truncated, not JSON, not UTF-8
      self._invalid.add(path, f"unreadable ({e})")
      self.misses += 1
      return None
    if not isinstance(entry, dict):
      self._invalid.add(path, f"a {type(entry).__name__}, not an entry")
      self.misses += 1
      return None
    want = json.loads(json.dumps(key, sort_keys=True, default=str))
    if entry.get("schema") != SCHEMA_VERSION or entry.get("version") != self.version or \
        entry.get("key") != want:
      log.info("profile cache entry %s is stale; recomputing it", path.name)
      self.misses += 1
      return None
    problem = entry_problem(want, entry.get("value"))
    if problem:
      self._invalid.add(path, problem)
      self.misses += 1
      return None
    self.hits += 1
    return entry["value"]

  def put(self, key: dict, value: dict[str, Any]) -> None:
    """Stores ``value`` (JSON-serialisable) for ``key``; failures only log, and a value
    :func:`entry_problem` rejects is not stored."""
    if self.root is None:
      return
    path = self._path(key)
    want = json.loads(json.dumps(key, sort_keys=True, default=str))
    try:
      value = json.loads(json.dumps(value))   # as it will read back (tuples become lists)
    except (TypeError, ValueError) as e:
      log.warning("could not write profile cache entry %s: %s", path, e)
      return
    problem = entry_problem(want, value)
    if problem:
      self._refused += 1
      (log.warning if self._refused == 1 else log.debug)(
          "not caching profile entry %s: %s", path.name, problem)
      return
    entry = {"schema": SCHEMA_VERSION, "version": self.version, "key": want, "value": value}
    tmp = None
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
      with os.fdopen(fd, "w") as f:
        json.dump(entry, f, allow_nan=False)
      os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as e:
      if tmp is not None and os.path.exists(tmp):
        os.unlink(tmp)
      self._unwritable += 1   # one warning: an unwritable directory fails every entry
      (log.warning if self._unwritable == 1 else log.debug)(
          "could not write profile cache entry %s: %s", path, e)
