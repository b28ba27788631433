"""Command line: ``python -m harpjax <command>``.

Each sub-command lives in its own module of this package as a ``click`` command named
``command``.
"""

from __future__ import annotations

import logging

import click

from harpjax.cli import plan, simulate

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def main(verbose: int) -> None:
  """harpjax: plan, simulate and run pipelines on heterogeneous GPU clusters."""
  level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
  logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


main.add_command(simulate.command, "simulate")
main.add_command(plan.command, "plan")
