"""Submesh shapes, and packing a subcluster's submeshes onto its hosts: one exact packer.

A stage runs on a submesh ``(n, m)`` of one subcluster of ``N`` hosts with ``M`` devices each:
``(1, m)`` takes ``m`` devices of one host, ``(n, M)`` takes ``n`` whole hosts (HARP §5.1).
Whether a set of submeshes fits the hosts is bin packing of the single-host widths into the
hosts the whole-host submeshes leave. :func:`bin_pack` decides it exactly; the planner's device
states (:mod:`harpjax.compiler.plan`), its plan evaluation (:func:`pack_submeshes`) and the
device allocator of a :class:`~harpjax.cluster.Cluster` (:func:`allocate_submeshes`) all ask
it, so they cannot disagree on whether stages fit.

Where the stages sit decides which link a cut between two of them uses: the link inside a host
when both share it. :func:`place_stages` is the one placement of a subcluster's run of stages
(pipeline order) that the planner prices and the allocator hands out, when the single-host
widths divide each other and ``M`` (the usual case): single-host stages fill hosts one after
the other from the first host, whole-host stages take hosts from the last one, so a stage
shares its predecessor's host exactly when both are single-host and it fits in what that host
has left (:func:`host_joins`). A single-host stage that does not fit there ends this *clean*
part: it and every later stage of the run are packed exactly into what is left, and their cuts
are taken as between hosts (two of them may still share one: then they run faster than
priced). This placement fits every set of stages whose devices add up to at most ``N M``
(:func:`place_stages`), so the planner's device count stays exact.

Device indices here are local to the subcluster: host ``h``'s devices are
``h * M .. h * M + M - 1``.
"""

from __future__ import annotations

from typing import Sequence

from harpjax.errors import PlanError

__all__ = ["WIDTHS", "submesh_shapes", "paper_submeshes", "is_divisibility_chain", "bin_pack",
           "pack_submeshes", "place_stages", "host_joins", "allocate_submeshes"]

WIDTHS = ("chain", "powers", "all")
"""Single-host widths of :func:`submesh_shapes`."""


# --------------------------------------------------------------------------- shapes


def submesh_shapes(num_hosts: int, devices_per_host: int, widths: str = "chain"
                   ) -> tuple[tuple[int, int], ...]:
  """The submesh shapes a stage may use on ``N`` hosts of ``M`` devices.

  Args:
    num_hosts: ``N``.
    devices_per_host: ``M``.
    widths: the single-host widths ``m`` of ``(1, m)``: ``"chain"`` the powers of two below
      ``M`` as long as they divide ``M``, then ``M`` (a divisibility chain: any mix of such
      submeshes whose sizes add up to at most ``N * M`` packs, so a planner may just count
      devices; for ``M = 6`` this is ``1, 2, 6``); ``"powers"`` every power of two below
      ``M``, then ``M`` (the paper's shapes; ``1, 2, 4, 6`` for ``M = 6``); ``"all"`` every
      width ``1 .. M``.

  Returns:
    ``((1, m) for each width) + ((2, M), ..., (N, M))``, in increasing size.
  """
  M = devices_per_host
  if widths == "all":
    ms = list(range(1, M + 1))
  elif widths in ("chain", "powers"):
    ms, w = [], 1
    while w < M and (widths == "powers" or M % w == 0):
      ms.append(w)
      w *= 2
    ms.append(M)
  else:
    raise ValueError(f"widths={widths!r}; choose one of {WIDTHS}")
  return tuple((1, m) for m in ms) + tuple((n, M) for n in range(2, num_hosts + 1))


def paper_submeshes(num_hosts: int, devices_per_host: int) -> tuple[tuple[int, int], ...]:
  """The paper's submesh shapes: ``(1, 2^p)`` below ``M``, ``(1, M)``, then ``(n, M)``.

  ``submesh_shapes(num_hosts, devices_per_host, "powers")``.
  """
  return submesh_shapes(num_hosts, devices_per_host, "powers")


def is_divisibility_chain(devices_per_host: int, shapes: Sequence[tuple[int, int]]) -> bool:
  """Whether the single-host widths of ``shapes`` and ``M`` divide each other in turn.

  Then first-fit decreasing packs any mix of the shapes adding up to at most ``N * M``
  devices, and a stage's fit depends only on the devices used before it.
  """
  ws = sorted({m for n, m in shapes if n == 1} | {devices_per_host})
  return all(b % a == 0 for a, b in zip(ws, ws[1:]))


# --------------------------------------------------------------------------- the packer


def bin_pack(sizes: Sequence[int], num_bins: int, capacity: int) -> list[int] | None:
  """Packs items into bins of equal capacity, exactly: a bin per item, or ``None``.

  Depth-first search, items largest first, whose first branch is first-fit decreasing (which
  succeeds at once for sizes that divide each other); bins with equal free space are tried
  once, and a (next item, free spaces) state that failed once is never searched again, so the
  search ends on every input with the true answer.

  Args:
    sizes: item sizes (devices of single-host submeshes).
    num_bins: bins (hosts left for them).
    capacity: size of a bin (devices per host).

  Returns:
    Per item (in the given order) its bin, or ``None`` if no packing exists.
  """
  if sum(sizes) > num_bins * capacity or any(s > capacity for s in sizes):
    return None
  order = sorted(range(len(sizes)), key=lambda x: -sizes[x])
  free = [capacity] * num_bins
  out = [0] * len(sizes)
  failed: set[tuple] = set()

  def place(x: int) -> bool:
    if x == len(order):
      return True
    state = (x, tuple(sorted(free)))
    if state in failed:
      return False
    w, tried = sizes[order[x]], set()
    for b in range(num_bins):
      if free[b] >= w and free[b] not in tried:
        tried.add(free[b])
        free[b] -= w
        out[order[x]] = b
        if place(x + 1):
          return True
        free[b] += w
    failed.add(state)
    return False

  return out if place(0) else None


def pack_submeshes(num_hosts: int, devices_per_host: int, shapes: Sequence[tuple[int, int]]
                   ) -> list[tuple[tuple[int, int, int], ...]] | None:
  """Places submeshes on the hosts of one subcluster (exactly: ``None`` only if impossible).

  Whole-host shapes ``(n, M)`` take hosts in the given order, from host 0; the single-host
  ones are bin-packed (:func:`bin_pack`) onto the hosts left, each host filled in the given
  order.

  Returns:
    Per shape ``((host, first_device, num_devices), ...)``, or ``None`` if they do not fit.
  """
  M = devices_per_host
  out: list = [None] * len(shapes)
  host = 0
  for idx, (n, m) in enumerate(shapes):
    if n > 1 or m == M:
      if host + n > num_hosts:
        return None
      out[idx] = tuple((h, 0, m) for h in range(host, host + n))
      host += n
  small = [x for x in range(len(shapes)) if out[x] is None]
  bins = bin_pack([shapes[x][1] for x in small], num_hosts - host, M)
  if bins is None:
    return None
  fill = [0] * num_hosts
  for x, b in zip(small, bins):
    h = host + b
    out[x] = ((h, fill[h], shapes[x][1]),)
    fill[h] += shapes[x][1]
  return out


def host_joins(devices_per_host: int, shapes: Sequence[tuple[int, int]]) -> list[bool]:
  """Which cuts of a subcluster's run of stages stay inside a host, by :func:`place_stages`'s
  rule (the module docstring): entry ``x`` is the cut after stage ``x`` (``len(shapes) - 1``
  entries). Needs single-host widths that divide each other and ``M``."""
  M = devices_per_host
  out = []
  fill, clean, last_single = 0, True, False   # the open host's devices used; the run so far
  for x, (n, m) in enumerate(shapes):
    single = n == 1 and m < M
    join = False
    if clean and single:
      if fill + m > M:
        clean = False                        # a straddle: the packed part begins
      else:
        join = last_single and fill > 0      # its predecessor's host has room for it
        fill = (fill + m) % M
    if x:
      out.append(join)
    last_single = single and clean
  return out


def place_stages(num_hosts: int, devices_per_host: int, shapes: Sequence[tuple[int, int]]
                 ) -> list[tuple[tuple[int, int, int], ...]] | None:
  """The placement the planner prices (module docstring), or ``None`` if the stages do not fit.

  With single-host widths that divide each other and ``M``: single-host stages fill hosts
  ``0, 1, ...`` in pipeline order, whole-host stages take hosts ``N - 1, N - 2, ...``; from the
  first single-host stage that does not fit the open host on, the rest are packed exactly
  (:func:`pack_submeshes`) into what is left. Any set of stages of at most ``N M`` devices fits
  (first-fit decreasing on divisible widths). Other widths: :func:`pack_submeshes`.

  Returns:
    Per stage ``((host, first_device, num_devices), ...)``.
  """
  N, M = num_hosts, devices_per_host
  if not is_divisibility_chain(M, shapes):
    return pack_submeshes(N, M, shapes)
  out: list = [None] * len(shapes)
  fill, low, high = 0, 0, N       # the open host's devices used; next host from each end
  rest = len(shapes)
  for x, (n, m) in enumerate(shapes):
    if n > 1 or m == M:
      if high - n < low:
        return None
      high -= n
      out[x] = tuple((h, 0, m) for h in range(high, high + n))
    elif fill + m <= M:
      if fill == 0:
        if low >= high:
          return None
        low += 1
      out[x] = ((low - 1, fill, m),)
      fill = (fill + m) % M
    else:
      rest = x
      break
  if rest == len(shapes):
    return out
  # The packed part: into the open host's free devices and the hosts left between the ends.
  tail = list(shapes[rest:])
  whole = [x for x, (n, m) in enumerate(tail) if n > 1 or m == M]
  part = [x for x, (n, m) in enumerate(tail) if not (n > 1 or m == M)]
  free_hosts = list(range(low, high))
  for x in whole:
    n = tail[x][0]
    if len(free_hosts) < n:
      return None
    out[rest + x] = tuple((h, 0, M) for h in free_hosts[:n])
    free_hosts = free_hosts[n:]
  bins = ([(low - 1, fill)] if fill > 0 else []) + [(h, 0) for h in free_hosts]
  got = _pack_into([tail[x][1] for x in part], [M - f for _, f in bins])
  if got is None:
    return None
  used = {h: f for h, f in bins}
  for x, b in zip(part, got):
    h = bins[b][0]
    out[rest + x] = ((h, used[h], tail[x][1]),)
    used[h] += tail[x][1]
  return out


def _pack_into(sizes: Sequence[int], capacities: Sequence[int]) -> list[int] | None:
  """First-fit decreasing of ``sizes`` into bins of the given free ``capacities`` (exact for
  sizes that divide each other when every bin but the first has capacity ``M``): a bin per
  item, or ``None``."""
  free = list(capacities)
  out = [0] * len(sizes)
  for x in sorted(range(len(sizes)), key=lambda x: -sizes[x]):
    b = next((b for b, f in enumerate(free) if f >= sizes[x]), None)
    if b is None:
      return None
    free[b] -= sizes[x]
    out[x] = b
  return out


def allocate_submeshes(name: str, num_hosts: int, devices_per_host: int,
                       requests: Sequence[tuple[int, tuple[int, int]]]) -> dict[int, list[int]]:
  """Concrete devices of one subcluster for pipeline stages, ascending with the stages.

  The submeshes are placed by :func:`place_stages` (the placement the planner prices: a stage
  shares its predecessor's host where :func:`host_joins` says so); the hosts are then
  renumbered so that each whole-host stage and each shared host come in the order of their
  first stage.

  Args:
    name: the subcluster's name (for messages).
    num_hosts, devices_per_host: ``N`` and ``M``.
    requests: ``(stage index, (n, m))`` in pipeline order.

  Returns:
    Stage index -> its ``n * m`` device indices local to the subcluster (host-major).

  Raises:
    PlanError: the submeshes do not fit; the message names the stage and what is left.
  """
  N, M = num_hosts, devices_per_host
  used = 0
  for i, (n, m) in requests:
    used += n * m
    if used > N * M:
      raise PlanError(f"stage {i}: submesh ({n}, {m}) does not fit on subcluster {name!r}: the "
                      f"stages before it already take {used - n * m} of its {N * M} devices "
                      f"({N} hosts x {M}), {N * M - used + n * m} left")
  placed = place_stages(N, M, [shape for _, shape in requests])
  if placed is None:
    whole = [(i, (n, m)) for i, (n, m) in requests if n > 1 or m == M]
    part = sorted(((i, (n, m)) for i, (n, m) in requests if n == 1 and m < M),
                  key=lambda r: (-r[1][1], r[0]))
    taken = sum(n for _, (n, _) in whole)
    free = [M] * (N - taken)
    for i, (_, m) in part:  # replay first-fit decreasing to name the stage that does not fit
      fit = next((b for b, f in enumerate(free) if f >= m), None)
      if fit is None:
        raise PlanError(
            f"stage {i}: submesh (1, {m}) does not fit on subcluster {name!r} "
            f"({N} hosts x {M}): {taken} hosts go to whole-host stages and, with the larger "
            f"stages placed first, the other hosts have {free} devices free; single-host "
            "submeshes cannot span hosts")
      free[fit] -= m
    raise AssertionError("first-fit decreasing packed what the exact search could not")
  reqs = list(requests)
  on_host: dict[int, list[tuple[int, int]]] = {}   # packed host -> its (stage, width)
  for (i, (n, m)), where in zip(reqs, placed):
    for h, _, count in where:
      on_host.setdefault(h, []).append((i, count))
  first_stage = {h: min(i for i, _ in items) for h, items in on_host.items()}
  renumber = {h: r for r, h in enumerate(sorted(first_stage, key=lambda h: (first_stage[h], h)))}
  out: dict[int, list[int]] = {i: [] for i, _ in requests}
  for h in sorted(on_host, key=renumber.get):
    slot = 0
    for i, count in sorted(on_host[h]):   # a shared host is filled in stage order
      base = renumber[h] * M + slot
      out[i] += range(base, base + count)
      slot += count
  return out
