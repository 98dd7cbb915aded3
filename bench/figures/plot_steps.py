"""Step-time breakdown per stage as a PNG, from the JSON the benchmarks write:

    python -m bench.figures.plot_steps --overhead overhead.json --gpu-async gpu_rl.json --out docs/step_breakdown.png

--overhead: bench/cpu/overhead.py --json (CPU: bare loop vs full stack, median seconds per stage).
--gpu-async: bench/e2e/rl.py --sections async (2 GPUs: synchronous vs one-step-off, seconds per stage).
Either may be left out. Each bar is one step: its stages stacked in the order they run, and whatever the
step took beyond its stages (orchestration, logging) as "other". In one-step-off mode the rollout of the
next step runs beside training, so it is drawn as its own bar under the step it hides in.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"rollout": "#4C72B0", "reward": "#DD8452", "advantages": "#8172B3", "train": "#55A868",
          "sync": "#C44E52", "other": "#BBBBBB"}


def _stacked(ax, label: str, y: float, parts: dict[str, float], hatch: str | None = None) -> None:
    left = 0.0
    for stage, seconds in parts.items():
        ax.barh(y, seconds, left=left, color=COLORS[stage], edgecolor="white", hatch=hatch,
                label=stage if stage not in ax.get_legend_handles_labels()[1] else None)
        left += seconds
    ax.text(left, y, f"  {left:.3f} s", va="center", fontsize=9)
    ticks = getattr(ax, "_step_ticks", {})
    ticks[y] = label
    ax._step_ticks = ticks
    ax.set_yticks(list(ticks), list(ticks.values()))


def overhead_panel(ax, result: dict) -> None:
    stages = ("rollout", "reward", "advantages", "train", "sync")
    for y, kind in ((1, "bare"), (0, "full")):
        parts = {s: result[f"{kind}_stages_s"][s] for s in stages}
        parts["other"] = max(result[f"{kind}_step_s"] - sum(parts.values()), 0.0)
        _stacked(ax, "bare loop" if kind == "bare" else "Prefect + Ray + MLflow", y, parts)
    ax.set_title(f"CPU, {Path(result['recipe']).name}: full / bare = {result['ratio']:.2f}")


def async_panel(ax, result: dict) -> None:
    sync, off = result["sync"], result["one_step_off"]
    rest = {"train": sync["train_s"], "sync": sync["sync_s"]}
    _stacked(ax, "synchronous", 2, {"rollout": sync["rollout_s"], **rest,
                                    "other": max(sync["step_s"] - sync["rollout_s"] - sum(rest.values()), 0.0)})
    rest = {"train": off["train_s"], "sync": off["sync_s"]}
    _stacked(ax, "one-step-off", 1, {**rest, "other": max(off["step_s"] - sum(rest.values()), 0.0)})
    _stacked(ax, "  (next rollout, overlapped)", 0, {"rollout": off["rollout_s"]}, hatch="//")
    ax.set_title(f"2 GPUs, one-step-off async: speedup {result['speedup']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--overhead", help="bench/cpu/overhead.py --json output")
    ap.add_argument("--gpu-async", help="bench/e2e/rl.py output with an 'async' section")
    ap.add_argument("--out", default="docs/step_breakdown.png")
    args = ap.parse_args()
    panels = []
    if args.overhead:
        panels.append((overhead_panel, json.loads(Path(args.overhead).read_text())))
    if args.gpu_async:
        result = json.loads(Path(args.gpu_async).read_text())
        panels.append((async_panel, result.get("async", result)))
    if not panels:
        ap.error("give --overhead and/or --gpu-async")
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.6 * len(panels) + 0.4), squeeze=False)
    for ax, (draw, result) in zip(axes[:, 0], panels, strict=True):
        draw(ax, result)
        ax.set_xlabel("seconds per step")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), fontsize=8, ncols=6, frameon=False)
        ax.margins(x=0.12)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
