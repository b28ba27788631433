"""Command line: ``python -m harpjax <command>``.

Each sub-command lives in its own module of this package and exposes a ``click`` command named
``command``; the group below registers the ones that exist.
"""

from __future__ import annotations

import importlib
import logging

import click

__all__ = ["main"]

_SUBCOMMANDS = ("simulate", "plan")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def main(verbose: int) -> None:
  """harpjax: plan, simulate and run pipelines on heterogeneous GPU clusters."""
  level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
  logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


for _name in _SUBCOMMANDS:
  try:
    _module = importlib.import_module(f"harpjax.cli.{_name}")
  except ModuleNotFoundError as _e:  # sub-command not built in this version
    if _e.name != f"harpjax.cli.{_name}":
      raise
    continue
  main.add_command(_module.command, _name)
