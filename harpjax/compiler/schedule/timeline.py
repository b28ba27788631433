"""Pictures of a simulated (or measured) pipeline iteration.

Two formats, both with one row per stage and one per link direction, in pipeline order
(stage 0, link 0 activations, link 0 gradients, stage 1, ...), like the paper's Figures 3
and 9:

* :func:`chrome_trace` / :func:`save_chrome_trace`: Chrome trace-event JSON; open it in
  https://ui.perfetto.dev or ``chrome://tracing``.
* :func:`save_gantt`: a PNG Gantt chart drawn with matplotlib (imported lazily, Agg backend).

Both take a :class:`~harpjax.compiler.schedule.SimResult` or anything with an ``events()``
method returning :class:`~harpjax.compiler.schedule.TimelineEvent` records.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

__all__ = ["chrome_trace", "save_chrome_trace", "save_gantt", "timeline_rows"]

log = logging.getLogger(__name__)

# Colours of the Gantt chart (and Perfetto's named colours for the trace).
_COLORS = {"F": "#4C72B0", "B": "#55A868", "U": "#8172B2", "A": "#DD8452", "G": "#C44E52"}
_TRACE_COLORS = {"F": "thread_state_running", "B": "good", "U": "rail_idle",
                 "A": "thread_state_iowait", "G": "terrible"}
_LABELS = {"F": "forward", "B": "backward", "U": "grad sync + update",
           "A": "activation transfer", "G": "gradient transfer"}


def _events(result) -> list:
  return list(result.events()) if hasattr(result, "events") else list(result)


def timeline_rows(num_stages: int) -> list[tuple[str, int, str]]:
  """Row keys ``(lane, index, direction)`` from top to bottom."""
  rows = []
  for s in range(num_stages):
    rows.append(("stage", s, ""))
    if s < num_stages - 1:
      rows += [("link", s, "fwd"), ("link", s, "bwd")]
  return rows


def _row_name(key: tuple[str, int, str]) -> str:
  lane, i, d = key
  if lane == "stage":
    return f"stage {i}"
  return f"link {i}\u2192{i + 1}" if d == "fwd" else f"link {i + 1}\u2192{i}"


def chrome_trace(result, name: str | None = None) -> dict[str, Any]:
  """The timeline as a Chrome trace-event dict (times in microseconds).

  Args:
    result: a :class:`~harpjax.compiler.schedule.SimResult` (or an iterable of
      :class:`~harpjax.compiler.schedule.TimelineEvent`).
    name: process name shown in the viewer; defaults to the schedule's name.

  Returns:
    ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``.
  """
  events = _events(result)
  num_stages = 1 + max((e.index + (e.lane == "link") for e in events), default=0)
  rows = timeline_rows(num_stages)
  tid = {key: i for i, key in enumerate(rows)}
  if name is None:
    name = getattr(getattr(result, "schedule", None), "name", "pipeline")
  out: list[dict[str, Any]] = [
      {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": name}}]
  for key, i in tid.items():
    out.append({"ph": "M", "pid": 0, "tid": i, "name": "thread_name",
                "args": {"name": _row_name(key)}})
    out.append({"ph": "M", "pid": 0, "tid": i, "name": "thread_sort_index",
                "args": {"sort_index": i}})
  for e in events:
    label = e.kind if e.microbatch < 0 else f"{e.kind}{e.microbatch}"
    out.append({
        "ph": "X", "pid": 0, "tid": tid[(e.lane, e.index, e.direction)], "name": label,
        "cat": _LABELS[e.kind], "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6,
        "cname": _TRACE_COLORS[e.kind],
        "args": {"microbatch": e.microbatch, "start_s": e.start_s, "end_s": e.end_s}})
  other = {}
  if hasattr(result, "iteration_time"):
    other = {"iteration_time_s": result.iteration_time,
             "num_microbatches": result.num_microbatches,
             "warmups": list(result.schedule.table_warmups())}
  return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def save_chrome_trace(result, path: str | os.PathLike, name: str | None = None) -> str:
  """Writes :func:`chrome_trace` to ``path`` and returns the path."""
  path = os.fspath(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(chrome_trace(result, name), f)
  log.info("wrote Chrome trace %s", path)
  return path


def save_gantt(result, path: str | os.PathLike, title: str | None = None,
               time_unit: str = "ms", label_limit: int = 600, width_in: float = 14.0,
               dpi: int = 120) -> str:
  """Draws the timeline as a PNG Gantt chart, one row per stage and per link direction.

  Args:
    result: a :class:`~harpjax.compiler.schedule.SimResult` (or iterable of events).
    path: output ``.png`` path.
    title: figure title; defaults to the schedule name and iteration time.
    time_unit: ``"s"``, ``"ms"`` or ``"us"`` for the x axis.
    label_limit: microbatch numbers are written inside bars only when the chart has at most
      this many bars (and the bar is wide enough).
    width_in: figure width, inches.
    dpi: resolution.

  Returns:
    The path written.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from matplotlib.patches import Patch  # pylint: disable=import-outside-toplevel

  scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[time_unit]
  events = _events(result)
  num_stages = 1 + max((e.index + (e.lane == "link") for e in events), default=0)
  rows = timeline_rows(num_stages)
  ypos = {key: len(rows) - 1 - i for i, key in enumerate(rows)}
  fig_h = max(2.0, 0.32 * len(rows) + 1.4)
  fig, ax = plt.subplots(figsize=(width_in, fig_h))
  by_row_kind: dict[tuple, list] = {}
  for e in events:
    by_row_kind.setdefault((e.lane, e.index, e.direction, e.kind), []).append(e)
  for (lane, i, d, kind), evs in by_row_kind.items():
    y = ypos[(lane, i, d)]
    height = 0.8 if lane == "stage" else 0.5
    bars = [(e.start_s * scale, (e.end_s - e.start_s) * scale) for e in evs]
    ax.broken_barh(bars, (y - height / 2, height), facecolors=_COLORS[kind],
                   edgecolors="white", linewidth=0.3)
  t_end = max((e.end_s for e in events), default=1.0) * scale
  if len(events) <= label_limit:
    min_w = t_end / 150
    for e in events:
      w = (e.end_s - e.start_s) * scale
      if e.microbatch >= 0 and w >= min_w:
        ax.text((e.start_s * scale) + w / 2, ypos[(e.lane, e.index, e.direction)],
                str(e.microbatch), ha="center", va="center", fontsize=6, color="white")
  ax.set_yticks([ypos[k] for k in rows])
  ax.set_yticklabels([_row_name(k) for k in rows], fontsize=8)
  ax.set_xlim(0, t_end * 1.01 if t_end > 0 else 1)
  ax.set_ylim(-0.7, len(rows) - 0.3)
  ax.set_xlabel(f"time ({time_unit})")
  ax.grid(axis="x", alpha=0.3)
  kinds_present = [k for k in _COLORS if any(e.kind == k for e in events)]
  ax.legend(handles=[Patch(color=_COLORS[k], label=_LABELS[k]) for k in kinds_present],
            loc="upper center", bbox_to_anchor=(0.5, -0.18 if len(rows) < 8 else -0.08),
            ncol=len(kinds_present), fontsize=8, frameon=False)
  if title is None and hasattr(result, "iteration_time"):
    title = (f"{result.schedule.name}: B={result.num_microbatches}, warm-ups "
             f"{list(result.schedule.table_warmups())}, iteration "
             f"{result.iteration_time * scale:.4g} {time_unit}")
  if title:
    ax.set_title(title, fontsize=10)
  fig.tight_layout()
  path = os.fspath(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
  log.info("wrote Gantt chart %s", path)
  return path

