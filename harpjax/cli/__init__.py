"""Command line: ``python -m harpjax <command>``.

Each sub-command lives in its own module of this package as a ``click`` command named
``command``. Commands check every argument before any long work (tracing, profiling, planning)
and report bad input as one ``Error:`` line, never a traceback.

Ctrl-C (SIGINT) stops any command within a second or two, prints one line and exits with
status 130 (:data:`INTERRUPTED`): the ``KeyboardInterrupt`` unwinds the command (the planner's
worker pools are cancelled on the way), and when the main thread cannot take it in time (inside
compiled code) or swallows it, a watcher thread (:func:`run`) ends the process itself. Once the
command is done, Ctrl-C no longer changes its outcome: the process exits with its status.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading

import click

from harpjax.cli import plan, simulate
from harpjax.errors import INTERRUPT_MESSAGE, INTERRUPTED, interrupts_as_keyboard

__all__ = ["main", "run", "INTERRUPTED", "INTERRUPT_MESSAGE", "INTERRUPT_GRACE_S"]


INTERRUPT_GRACE_S = 1.0
"""Seconds the command has to unwind after Ctrl-C before the process is ended regardless."""


class _Watcher:
  """Sees SIGINT even while the main thread runs compiled code, and ends the process if the
  command has not unwound ``INTERRUPT_GRACE_S`` after it (or at once on a second Ctrl-C).

  The C-level signal handler writes the signal number to the wakeup socket
  (:func:`signal.set_wakeup_fd`) the moment the signal arrives; the watcher thread blocks on
  the other end. It holds no lock while it waits, so forking worker processes stays safe
  (the thread says so with ``fork_safe``).
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._announced = False
    self.seen = 0   # Ctrl-Cs so far
    self.done = threading.Event()
    self._rsock, self._wsock = socket.socketpair()
    self._wsock.setblocking(False)
    self._old_fd = signal.set_wakeup_fd(self._wsock.fileno(), warn_on_full_buffer=False)
    self._old_handler = signal.getsignal(signal.SIGINT)
    if self._old_handler is not signal.SIG_IGN:   # ignored (a background job): keep it so
      signal.signal(signal.SIGINT, signal.default_int_handler)
    # A KeyboardInterrupt raised in a garbage-collection callback (JAX has one) is printed and
    # dropped by CPython: not printed here, the watcher ends the command with its one line.
    self._old_hook = sys.unraisablehook
    sys.unraisablehook = self._unraisable
    thread = threading.Thread(target=self._watch, name="harpjax-interrupt", daemon=True)
    thread.fork_safe = True
    thread.start()

  def announce(self) -> None:
    """Prints :data:`INTERRUPT_MESSAGE` once."""
    with self._lock:
      if self._announced:
        return
      self._announced = True
    _echo_interrupt()

  def _watch(self) -> None:
    seen = 0
    while True:
      try:
        data = self._rsock.recv(64)
      except OSError:
        return
      if not data:
        return
      seen += data.count(signal.SIGINT)
      self.seen = seen
      if seen and (seen > 1 or not self.done.wait(INTERRUPT_GRACE_S)):
        self.announce()
        _stop(INTERRUPTED)

  def _unraisable(self, unraisable) -> None:
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
      self._old_hook(unraisable)

  def close(self, sigint=None) -> None:
    """Stops watching; SIGINT's handler becomes ``sigint`` (default: the one before)."""
    signal.set_wakeup_fd(self._old_fd)
    signal.signal(signal.SIGINT, self._old_handler if sigint is None else sigint)
    sys.unraisablehook = self._old_hook


_WATCHER: _Watcher | None = None


def _echo_interrupt() -> None:
  try:
    click.echo(INTERRUPT_MESSAGE, err=True)
  except Exception:  # noqa: BLE001 - a closed stderr must not stop the exit
    pass


def _stop(status: int) -> None:
  """Ends the process now with ``status``: terminates the worker processes it started, flushes
  the output and skips interpreter shutdown (which would wait for busy threads)."""
  for child in multiprocessing.active_children():
    try:
      child.terminate()
    except Exception:  # noqa: BLE001 - already gone
      pass
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # noqa: BLE001
      pass
  os._exit(status)


class _Group(click.Group):
  """A group whose commands exit with :data:`INTERRUPTED` and one line on Ctrl-C."""

  def invoke(self, ctx: click.Context):
    try:
      # Ctrl-C handled inside a C callback (NumPy's dtype hooks, a Numba dispatcher) comes
      # back as "returned a result with an exception set", chained to the interrupt
      with interrupts_as_keyboard():
        return super().invoke(ctx)
    except KeyboardInterrupt:
      if _WATCHER is not None:
        _WATCHER.announce()
      else:
        _echo_interrupt()
      raise click.exceptions.Exit(INTERRUPTED) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def main(verbose: int) -> None:
  """harpjax: plan, simulate and run pipelines on heterogeneous GPU clusters."""
  level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
  logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


main.add_command(simulate.command, "simulate")
main.add_command(plan.command, "plan")


def run(args: list[str] | None = None) -> None:
  """``python -m harpjax``: :func:`main` with the Ctrl-C watcher; exits with the command's
  status (:data:`INTERRUPTED` after Ctrl-C, without waiting for busy threads).

  Once the command is done its outcome stands: Ctrl-C while the process exits is ignored (it
  used to kill the interpreter as it finalized, silently, with -SIGINT, or raise in an exit
  hook and print a traceback).
  """
  global _WATCHER
  status = 0
  try:
    try:
      if threading.current_thread() is threading.main_thread():   # where signals arrive
        _WATCHER = _Watcher()
      main.main(args=args)
    except SystemExit as e:
      status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
      status = INTERRUPTED
    finally:
      _done()
  except KeyboardInterrupt:   # Ctrl-C in the instant before _done() took it over
    _done()
    status = INTERRUPTED
  if _WATCHER is not None:
    _WATCHER.done.set()
    if _WATCHER.seen and status != INTERRUPTED:   # Ctrl-C the command dropped somewhere
      status = INTERRUPTED
  if status == INTERRUPTED:
    if _WATCHER is not None:
      _WATCHER.announce()
    else:
      _echo_interrupt()
    _stop(INTERRUPTED)
  if _WATCHER is not None:
    _WATCHER.close(sigint=signal.SIG_IGN)
  sys.exit(status)


def _done() -> None:
  """The command is done: SIGINT is ignored from here to the end of the process (a signal
  that arrived just before is dropped with it)."""
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
