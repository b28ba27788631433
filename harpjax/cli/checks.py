"""Argument checks the commands share: finite numbers, output paths, options given together.

Every check runs before a command does any long work and fails with a ``click`` error naming
the option, the value and what to change.
"""

from __future__ import annotations

import math
import os

import click
from click.core import ParameterSource

__all__ = ["Finite", "check_output_file", "check_output_dir", "given", "MAX_MICROBATCHES"]

MAX_MICROBATCHES = 1_000_000
"""Most microbatches ``-B`` takes (the simulated schedules hold ``2 B`` tasks per stage)."""


class Finite(click.FloatRange):
  """A finite float in a range (``click.FloatRange`` lets ``nan`` and ``inf`` through)."""

  name = "number"

  def convert(self, value, param, ctx):
    out = super().convert(value, param, ctx)
    if not math.isfinite(out):
      self.fail(f"{value!r} is not a finite number", param, ctx)
    return out


def _writable_dir(path: str) -> bool:
  return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def check_output_file(path: str | None, hint: str) -> None:
  """``path`` can be written: not a directory, its directory exists and is writable (and the
  file, if it exists, too)."""
  if path is None:
    return
  parent = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    raise click.BadParameter(f"{path!r} is a directory; give a file name", param_hint=hint)
  if not os.path.isdir(parent):
    raise click.BadParameter(f"cannot write {path!r}: directory {parent!r} does not exist; "
                             "create it or choose another path", param_hint=hint)
  if not _writable_dir(parent) or (os.path.exists(path) and not os.access(path, os.W_OK)):
    raise click.BadParameter(f"cannot write {path!r}: permission denied; choose another path",
                             param_hint=hint)


def check_output_dir(path: str | None, hint: str) -> None:
  """``path`` is a writable directory, or can be created (its nearest existing ancestor is a
  writable directory)."""
  if path is None:
    return
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.exists(path):
    if not os.path.isdir(path):
      raise click.BadParameter(f"{path!r} is a file, not a directory; choose another path",
                               param_hint=hint)
    if not _writable_dir(path):
      raise click.BadParameter(f"cannot write into {path!r}: permission denied; choose "
                               "another directory", param_hint=hint)
    return
  ancestor = os.path.dirname(path)
  while not os.path.exists(ancestor):
    ancestor = os.path.dirname(ancestor)
  if not _writable_dir(ancestor):
    what = "is not a directory" if not os.path.isdir(ancestor) else "is not writable"
    raise click.BadParameter(f"cannot create {path!r}: {ancestor!r} {what}; choose another "
                             "directory", param_hint=hint)


def given(ctx: click.Context, name: str) -> bool:
  """Whether the option ``name`` (its parameter name) was given, not defaulted."""
  return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE,
                                            ParameterSource.ENVIRONMENT)
