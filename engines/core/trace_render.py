"""A PNG of a Chrome-trace timeline (engines/core/trace.py): one row per lane, a bar per span.

The driver's stages get a lane each; a rollout worker gets a lane for weight updates and one per slot,
where each request is a bar from start to finish (its queue wait a thin line before it, its first token
a tick). Perfetto shows the same file interactively; this is for a glance, a report or an MLflow page.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

SLOT_ROWS = 24  # the slot lanes of all rollout workers share about this many full lane heights
SLOT_LABELS = 8  # slot lanes labelled per worker
STOPPED, LENGTH, QUEUED, WEIGHTS = "#3b75af", "#9ec5e8", "0.55", "#c0392b"


def load_trace(path: str | Path) -> dict[str, Any]:
    """A trace file; a clear error if it is not Chrome trace JSON."""
    try:
        trace = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON trace ({e})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path}: expected a Chrome trace object with a 'traceEvents' list")
    return trace


def _lanes(events: list[dict]) -> list[tuple[int, Any, str, str]]:
    """(pid, tid, process, lane) for every lane that has events, processes in pid order, lanes in sort order."""
    proc, thread, order = {}, {}, {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "process_name":
            proc[e["pid"]] = e["args"]["name"].split(" (pid")[0]
        elif e["ph"] == "M" and e["name"] == "thread_name":
            thread[(e["pid"], e["tid"])] = e["args"]["name"]
        elif e["ph"] == "M" and e["name"] == "thread_sort_index":
            order[(e["pid"], e["tid"])] = e["args"]["sort_index"]
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] != "M"}
    keys = sorted(used, key=lambda k: (k[0], order.get(k, 1 << 30), str(k[1])))
    return [(pid, tid, str(proc.get(pid, pid)), str(thread.get((pid, tid), tid))) for pid, tid in keys]


def _layout(lanes: list[tuple[int, Any, str, str]]) -> tuple[list[float], list[float]]:
    """Each lane's centre and height: stage and weight lanes full height, slot lanes thinner the more there
    are (a 512-request batch still fits one page)."""
    n_slots = sum(1 for *_, name in lanes if name.startswith("slot"))
    slot_h = max(0.12, min(1.0, SLOT_ROWS / max(n_slots, 1)))
    centres, heights, y = [], [], 0.0
    for i, (pid, *_, name) in enumerate(lanes):
        h = slot_h if name.startswith("slot") else 1.0
        if i and pid != lanes[i - 1][0]:
            y += 0.6  # a gap between processes
        centres.append(y + h / 2)
        heights.append(h)
        y += h
    return centres, heights


def render(trace: dict[str, Any], out: str | Path, title: str = "") -> Path:
    """Draw `trace` to a PNG at `out`; returns its path."""
    import matplotlib  # deferred: ~1 s to import, only drawing needs it (the CLI imports this module); via mlflow

    matplotlib.use("Agg")
    # after use("Agg"): pyplot picks its backend when first imported
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = [e for e in trace["traceEvents"] if isinstance(e, dict) and "ph" in e]
    timed = [e for e in events if e["ph"] != "M"]
    if not timed:
        raise ValueError("the trace has no events to draw")
    lanes = _lanes(events)
    centres, heights = _layout(lanes)
    index = {(pid, tid): i for i, (pid, tid, *_) in enumerate(lanes)}
    t0 = min(e["ts"] for e in timed)
    span_us = max(max(e["ts"] + e.get("dur", 0.0) for e in timed) - t0, 1.0)
    sec = lambda us: (us - t0) / 1e6  # noqa: E731

    total = centres[-1] + heights[-1] / 2
    fig, ax = plt.subplots(figsize=(14, min(1.6 + 0.3 * total, 16.0)))
    stage_colors: dict[str, Any] = {}
    palette = plt.get_cmap("Dark2").colors

    def color(e: dict):
        if e["name"] == "request":
            return STOPPED if e["args"].get("finish") == "stop" else LENGTH
        if e["name"] == "weight_update":
            return WEIGHTS
        return stage_colors.setdefault(e["name"], palette[len(stage_colors) % len(palette)])

    queued = {(e["pid"], e["args"].get("rid")): e["ts"] for e in timed if e["name"] == "queued"}
    for e in timed:
        i = index[(e["pid"], e["tid"])]
        y, h = centres[i], heights[i] * 0.8
        if e["ph"] == "X":
            ax.broken_barh([(sec(e["ts"]), max(e["dur"], 1.0) / 1e6)], (y - h / 2, h), facecolors=color(e),
                           edgecolor="none")
            if e["dur"] < 0.004 * span_us and e["name"] != "request":  # too short to see: mark where it was
                ax.plot([sec(e["ts"])], [y], marker="v", color=color(e), markersize=7, linestyle="none")
            wait_from = queued.get((e["pid"], e["args"].get("rid"))) if e["name"] == "request" else None
            if wait_from is not None and wait_from < e["ts"]:
                ax.plot([sec(wait_from), sec(e["ts"])], [y, y], color=QUEUED, linewidth=0.6)
            if e["name"] != "request" and "step" in e["args"]:
                ax.text(sec(e["ts"]), y - h / 2, f" {e['args']['step']}", fontsize=6, va="top", color="white")
        elif e["name"] == "first_token":
            ax.plot([sec(e["ts"])], [y], marker="|", color="black", markersize=max(2.0, 6 * heights[i]),
                    linestyle="none")
        elif e["name"] != "queued":
            ax.plot([sec(e["ts"])], [y], marker="v", color=WEIGHTS, markersize=6, linestyle="none")

    ticks, labels = [], []
    slots_of: dict[int, list[int]] = defaultdict(list)
    for i, (pid, _, proc, name) in enumerate(lanes):
        if name.startswith("slot"):
            slots_of[pid].append(i)
        else:
            ticks.append(centres[i])
            labels.append(f"{proc} · {name}")
    for rows in slots_of.values():
        for i in rows[:: max(1, -(-len(rows) // SLOT_LABELS))]:
            ticks.append(centres[i])
            labels.append(f"{lanes[i][2]} · {lanes[i][3]}")
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_ylim(total + 0.2, -0.2)
    ax.set_xlabel("seconds since the step's first event")
    ax.grid(axis="x", alpha=0.3)
    legend = [Patch(color=c, label=n) for n, c in stage_colors.items()] + [
        Patch(color=STOPPED, label="request (stopped)"), Patch(color=LENGTH, label="request (max_new_tokens)"),
        Patch(color=WEIGHTS, label="weight update"), Patch(color=QUEUED, label="queued (line before a request)"),
        Patch(color="black", label="first token (tick)"),
    ]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    n_req = sum(1 for e in timed if e["name"] == "request")
    ax.set_title(f"{title}  ({n_req} requests)" if title else f"{n_req} requests", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
