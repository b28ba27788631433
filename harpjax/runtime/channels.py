"""Channels between stage workers: mailboxes, in-process and TCP channels, sender threads.

:mod:`harpjax.runtime.transport` chooses which channel each pair of stages uses; the Ray
object-store channel lives in :mod:`harpjax.runtime.ray_runtime`.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from typing import Any, Callable

from harpjax.errors import RuntimeFailure
from harpjax.runtime import codec

log = logging.getLogger(__name__)

__all__ = ["Mailbox", "Channel", "LocalChannel", "TcpChannel", "FanoutChannel", "TcpListener",
           "Sender", "sleep_until"]


# --------------------------------------------------------------------------- mailbox


class Mailbox:
  """Messages a stage has received, by key; the compute thread waits on them with a timeout.

  Keys are ``(step, key)`` with a :class:`~harpjax.runtime.interpreter.MessageKey`.
  :meth:`fail` wakes every waiter with an error (the runner aborts a step); :meth:`peer_lost`
  fails the waits on one sender.
  """

  def __init__(self, stage: int):
    self.stage = stage
    self._cond = threading.Condition()
    self._items: dict[tuple, Any] = {}
    self._failed: str | None = None
    self._failed_step: int | None = None   # the step aborted (None: every step)
    self._lost: dict[int, str] = {}

  def put(self, key: tuple, value: Any) -> None:
    with self._cond:
      self._items[key] = value
      self._cond.notify_all()

  def get(self, key: tuple, src: int, timeout_s: float, what: str) -> Any:
    """Waits for ``key`` from stage ``src``.

    Raises:
      RuntimeFailure: the wait timed out, ``src``'s connection was lost, or the step was
        aborted; the message names this stage, ``src`` and what was awaited.
    """
    deadline = time.monotonic() + timeout_s
    with self._cond:
      while key not in self._items:
        if self._failed is not None and (self._failed_step is None
                                         or key[0] <= self._failed_step):
          raise RuntimeFailure(f"stage {self.stage}: aborted while waiting for {what} from "
                               f"stage {src}: {self._failed}")
        if src in self._lost:
          raise RuntimeFailure(f"stage {self.stage}: lost stage {src} while waiting for "
                               f"{what}: {self._lost[src]}")
        left = deadline - time.monotonic()
        if left <= 0:
          raise RuntimeFailure(
              f"stage {self.stage}: waited {timeout_s:g} s for {what} from stage {src}; stage "
              f"{src} failed, hangs or is slower than recv_timeout_s={timeout_s:g}")
        self._cond.wait(min(left, 1.0))
      return self._items.pop(key)

  def fail(self, reason: str, step: int | None = None) -> None:
    """Fails the waits of ``step`` and earlier steps (``None``: of every step)."""
    with self._cond:
      self._failed, self._failed_step = reason, step
      self._cond.notify_all()

  def reset(self) -> None:
    with self._cond:
      self._failed = self._failed_step = None

  def peer_lost(self, src: int, reason: str) -> None:
    with self._cond:
      self._lost[src] = reason
      self._cond.notify_all()

  def drop_before(self, step: int) -> None:
    """Forgets messages of earlier steps (left over from an aborted step)."""
    with self._cond:
      for k in [k for k in self._items if k[0] < step]:
        del self._items[k]


# --------------------------------------------------------------------------- channels


class Channel:
  """One direction of a link: :meth:`send` is called from that direction's sender thread.

  Attributes:
    remote: whether values cross a process boundary (then they are encoded to NumPy first).
  """
  remote = True

  def send(self, step: int, key: tuple, src: int, payload: dict) -> None:
    raise NotImplementedError

  def nbytes(self, payload: dict) -> int:
    """Bytes of a message's values."""
    return sum(codec.nbytes_of(x) for x in payload.values())

  def encode(self, payload: dict) -> dict:
    """A message's values as they cross a process boundary."""
    return {k: codec.encode(x) for k, x in payload.items()}

  def close(self) -> None:
    pass


class LocalChannel(Channel):
  """To a stage in the same process: the receiver's mailbox directly (values stay device
  arrays; the receiver ``device_put``s them onto its submesh)."""
  remote = False

  def __init__(self, mailbox: Mailbox):
    self.mailbox = mailbox

  def send(self, step, key, src, payload):
    self.mailbox.put((step, key), payload)


class TcpChannel(Channel):
  """A TCP connection bound to the sender's NIC address.

  Args:
    src_address: local IPv4 address to bind (the chosen NIC's); ``None`` lets the OS choose.
    dst: ``(address, port)`` of the receiver's :class:`TcpListener`.
    token: the runner's secret.
    src_stage: the sending stage (sent in the hello).
    device: optional interface name for ``SO_BINDTODEVICE`` (needs ``CAP_NET_RAW``).
    timeout_s: connect timeout, and the longest a send may block.
  """

  def __init__(self, src_address: str | None, dst: tuple[str, int], token: str,
               src_stage: int, device: str | None = None, timeout_s: float = 30.0):
    self.src_address, self.dst = src_address, tuple(dst)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if device:
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, device.encode())
    if src_address:
      sock.bind((src_address, 0))
    sock.settimeout(timeout_s)
    try:
      sock.connect(self.dst)
    except OSError as e:
      sock.close()
      raise RuntimeFailure(f"stage {src_stage}: cannot connect from {src_address} to "
                           f"{self.dst[0]}:{self.dst[1]}: {e}") from None
    # Sends keep the timeout: a receiver that stops reading fails the send instead of
    # blocking the sender thread forever.
    codec.send_frames(sock, codec.dumps(("hello", token, src_stage)))
    self.sock = sock
    self.local = sock.getsockname()
    self._lock = threading.Lock()

  def send(self, step, key, src, payload):
    frames = codec.dumps((step, key, src, payload))
    with self._lock:
      codec.send_frames(self.sock, frames)

  def close(self):
    try:
      self.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
    self.sock.close()


class FanoutChannel(Channel):
  """One sending process's connections to the members of another stage (a cut sent per host
  pair): a message is ``{member: payload}``, each payload sent on that member's channel. One
  sender thread, so the emulated link holds the sending host for the whole of its part of the
  cut (``cut_time_s``'s busiest host).

  Args:
    channels: member rank -> its :class:`Channel`.
  """

  def __init__(self, channels: dict):
    self.channels = dict(channels)

  def nbytes(self, payload: dict) -> int:
    return sum(self.channels[d].nbytes(p) for d, p in payload.items())

  def encode(self, payload: dict) -> dict:
    return {d: self.channels[d].encode(p) for d, p in payload.items()}

  def send(self, step, key, src, payload):
    for d, p in sorted(payload.items()):
      self.channels[d].send(step, key, src, p)

  def close(self):
    for ch in self.channels.values():
      ch.close()


class TcpListener:
  """Accepts a runner's connections on one address and files their messages in a mailbox.

  Args:
    address: IPv4 address to listen on (the receiving NIC's).
    mailbox: where decoded messages go.
    token: connections not presenting it are closed.
    decode: applied to each received payload value.
  """

  def __init__(self, address: str, mailbox: Mailbox, token: str,
               decode: Callable[[Any], Any] = codec.decode):
    self.mailbox, self.token, self.decode = mailbox, token, decode
    self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self.sock.bind((address, 0))
    self.sock.listen(64)
    self.endpoint = self.sock.getsockname()
    self.peers: dict[tuple, Any] = {}   # (stage, address) -> (address, connection)
    self.bytes_received = 0
    self._closing = False
    self._threads = []
    t = threading.Thread(target=self._accept, name=f"harpjax-accept-{self.endpoint[1]}",
                         daemon=True)
    t.start()
    self._threads.append(t)

  def _accept(self):
    while not self._closing:
      try:
        conn, addr = self.sock.accept()
      except OSError:
        return
      t = threading.Thread(target=self._read, args=(conn, addr), daemon=True,
                           name=f"harpjax-recv-{addr[0]}:{addr[1]}")
      t.start()
      self._threads.append(t)

  def _read(self, conn, addr):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    src = None
    try:
      hello = codec.recv_message(conn)
      if not (isinstance(hello, tuple) and len(hello) == 3 and hello[0] == "hello"
              and hello[1] == self.token):
        log.warning("refused a connection from %s:%s without the runner's token", *addr)
        conn.close()
        return
      src = int(hello[2])
      self.peers[(src, addr)] = (addr, conn)   # a group's members connect from one stage
      while True:
        msg = codec.recv_message(conn)
        if msg is None:
          break
        step, key, sender, payload = msg
        self.bytes_received += sum(codec.encoded_nbytes(e) for e in payload.values())
        self.mailbox.put((step, key), {k: self.decode(e) for k, e in payload.items()})
    except OSError as e:
      if not self._closing:
        log.debug("connection from %s:%s failed: %s", *addr, e)
    finally:
      conn.close()
      if src is not None and not self._closing:
        self.mailbox.peer_lost(src, f"the connection from stage {src} ({addr[0]}) closed")

  def close(self):
    self._closing = True
    try:
      self.sock.close()
    except OSError:
      pass
    for _, conn in list(self.peers.values()):
      try:
        conn.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass


# --------------------------------------------------------------------------- sender thread


class Sender:
  """A FIFO sender thread for one link direction (this stage to ``dst``).

  Messages are sent one at a time in submission order. With ``delay_s`` (emulation), message
  ``k`` occupies the direction from its start ``s_k = max(submitted_k, end_{k-1})`` to
  ``s_k + delay_s(bytes_k)``: the sender encodes and sleeps within that window and hands the
  message to the channel at its end (the simulator's link semantics).

  Args:
    channel: the :class:`Channel`.
    src, dst: stage indices.
    delay_s: ``bytes -> seconds`` of the emulated link, or ``None``.
  """

  def __init__(self, channel: Channel, src: int, dst: int,
               delay_s: Callable[[int], float] | None = None):
    self.channel, self.src, self.dst, self.delay_s = channel, src, dst, delay_s
    self.events: list[tuple] = []     # (step, key, start, end, nbytes)
    self.error: BaseException | None = None
    self._q: queue.Queue = queue.Queue()
    self._pending = 0
    self._cond = threading.Condition()
    self._thread = threading.Thread(target=self._run, daemon=True,
                                    name=f"harpjax-send-{src}-to-{dst}")
    self._thread.start()

  def submit(self, step: int, key: tuple, payload: dict, cost_bytes: int | None = None
             ) -> None:
    """Queues a message; ``cost_bytes``: the bytes the emulated link charges for it
    (default its own)."""
    if self.error is not None:
      raise RuntimeFailure(f"stage {self.src}: sending to stage {self.dst} failed earlier: "
                           f"{self.error}")
    with self._cond:
      self._pending += 1
    self._q.put((step, key, payload, time.time(), cost_bytes))

  def _run(self):
    free_at = 0.0
    while True:
      item = self._q.get()
      if item is None:
        return
      step, key, payload, submitted, cost_bytes = item
      try:
        if self.error is None:
          start = max(submitted, free_at) if self.delay_s is not None else time.time()
          nbytes = self.channel.nbytes(payload)
          wire = self.channel.encode(payload) if self.channel.remote else payload
          if self.delay_s is not None:
            free_at = start + self.delay_s(nbytes if cost_bytes is None else cost_bytes)
            sleep_until(free_at)
          self.channel.send(step, key, self.src, wire)
          self.events.append((step, key, start, time.time(), nbytes))
      except BaseException as e:  # reported to the compute thread at the next submit/flush
        self.error = e
        log.debug("stage %d -> %d: send failed: %s", self.src, self.dst, e)
      finally:
        with self._cond:
          self._pending -= 1
          self._cond.notify_all()

  def flush(self, timeout_s: float) -> None:
    """Waits until every submitted message was handed to the channel.

    Raises:
      RuntimeFailure: a send failed, or the queue did not drain in ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    with self._cond:
      while self._pending and self.error is None:
        left = deadline - time.monotonic()
        if left <= 0:
          raise RuntimeFailure(f"stage {self.src}: sends to stage {self.dst} did not finish in "
                               f"{timeout_s:g} s")
        self._cond.wait(min(left, 1.0))
    if self.error is not None:
      raise RuntimeFailure(f"stage {self.src}: sending to stage {self.dst} failed: "
                           f"{self.error}")

  def close(self):
    self._q.put(None)
    self.channel.close()


def sleep_until(deadline: float) -> None:
  """Sleeps until ``time.time()`` reaches ``deadline`` (returns at once if it has)."""
  left = deadline - time.time()
  if left > 0:
    time.sleep(left)
