"""Draw a training run from its metrics.jsonl into one PNG beside it.

    python plot.py runs/tiny                    # -> runs/tiny/metrics.png
    python plot.py runs/tiny --out fig.png
    python plot.py runs/tiny --follow           # redraw while the run goes; stops at its end or Ctrl-C

Panels (x = GRPO step): reward and format-error rate; train vs held-out EX (eval/ex: the
overfitting view) with the held-out recovery rate beside it (eval/recovery_rate: the share of the
episodes whose first query came back empty or failed that still ended right); turns and tool calls per episode (train, and eval dashed); time per step split
into rollout / reward / update; the SFT warm-start loss and held-out EX (its own step axis); grad
norm and clip fraction. The random floor (eval/random_ex, eval.random_floor) is a dotted floor in
the EX panel. Each panel is one function in PANELS. Thin lines are per step, thick ones a running
mean over ~5% of the steps.
A resumed run appends to metrics.jsonl: the last value logged for a (step, metric) wins.

matplotlib is optional (training never needs it): without it this prints how to install it and
exits with status 1. Tests: .venv/bin/pytest tests/test_plot.py
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

MISSING = ("plot.py needs matplotlib, an optional dependency of grpo-sql (training does not use it): "
           "pip install matplotlib")
DONE = "run/done"  # train.py's last metrics line at the end of a run (plot.py --follow stops on it)


def read_metrics(path: str) -> dict[str, dict[int, float]]:
    """metrics.jsonl -> {metric: {step: value}}; later lines win (resumed runs append)."""
    series: dict[str, dict[int, float]] = {}
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
                print(f"{path}:{n}: skipping an unreadable line", file=sys.stderr)
                continue
            step = int(rec.pop("step", 0))
            for k, v in rec.items():
                if isinstance(v, (int, float)):
                    series.setdefault(k, {})[step] = float(v)
    return series


def xy(series: dict, key: str) -> tuple[list[int], list[float]]:
    d = series.get(key, {})
    steps = sorted(d)
    return steps, [d[s] for s in steps]


def running_mean(ys: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= w:
            acc -= ys[i - w]
        out.append(acc / min(i + 1, w))
    return out


# -----------------------------------------------------------------------------
# drawing


def _line(ax, series, key, label, color, style="-", smooth=True, marker=None):
    x, y = xy(series, key)
    if not x:
        return False
    w = max(1, len(x) // 20)
    if smooth and w > 1:
        ax.plot(x, y, style, color=color, alpha=0.3, lw=0.8)
        ax.plot(x, running_mean(y, w), style, color=color, lw=2, label=f"{label} (mean of {w})")
    else:
        ax.plot(x, y, style, color=color, lw=1.5, marker=marker or ("o" if len(x) < 30 else None),
                ms=4, label=label)
    return True


def _finish(ax, title, drew, ylabel=""):
    from matplotlib.ticker import MaxNLocator
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are integers
    ax.grid(alpha=0.3)
    lo, hi = ax.get_xlim()
    if hi - lo < 2:  # a single step (e.g. only the step-0 eval so far): show whole steps around it
        ax.set_xlim((lo + hi) / 2 - 1, (lo + hi) / 2 + 1)
    if drew:
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def panel_reward(ax, s, C):
    d = _line(ax, s, "train/reward", "reward", C[0])
    d |= _line(ax, s, "train/format_err", "format-error rate", C[3])
    d |= _line(ax, s, "eval/format_err", "eval format-error rate", C[3], "--", smooth=False)
    _finish(ax, "reward and format-error rate", d)


def panel_success(ax, s, C):
    """Train vs held-out EX as training goes, over the random baseline's floor (eval/random_ex),
    and beside held-out EX the held-out recovery rate (eval/recovery_rate: of the episodes whose
    first query came back empty or failed, the share that still ended right): what the multi-turn
    tool use is for, and on the toy set what GRPO learns."""
    d = _line(ax, s, "train/ex", "train EX (sampled)", C[0])
    d |= _line(ax, s, "eval/ex", "held-out EX (eval)", C[1], smooth=False, marker="o")
    _, rec = xy(s, "eval/recovery_rate")
    if rec:
        d |= _line(ax, s, "eval/recovery_rate", f"held-out recovery: right after an empty or failed first query "
                   f"({100 * rec[0]:.0f}% -> {100 * rec[-1]:.0f}%)", C[2], "--", smooth=False, marker="s")
    floor = s.get("eval/random_ex")
    if floor:
        v = floor[max(floor)]
        ax.axhline(v, color="gray", ls=":", lw=1.5, label=f"random baseline, held-out ({100 * v:.1f}%)")
        d = True
    ax.set_ylim(-0.02, 1.02)
    _finish(ax, "execution accuracy (train vs held-out) and error recovery", d)


def panel_episode(ax, s, C):
    """Per-episode shape: turns and tool calls (train solid, eval dashed)."""
    d = _line(ax, s, "train/turns", "turns", C[2])
    d |= _line(ax, s, "train/tool_calls", "tool calls", C[4])
    d |= _line(ax, s, "eval/turns", "eval turns", C[2], "--", smooth=False)
    d |= _line(ax, s, "eval/tool_calls", "eval tool calls", C[4], "--", smooth=False)
    _finish(ax, "per episode", d)


def panel_time(ax, s, C):
    parts = [("time/rollout", "rollout", C[0]), ("time/reward", "reward", C[1]), ("time/update", "update", C[2])]
    steps = sorted(set().union(*(s.get(k, {}) for k, _, _ in parts)))
    bottom = [0.0] * len(steps)
    for k, label, c in parts:
        ys = [s.get(k, {}).get(st, 0.0) for st in steps]
        if steps and any(ys):
            ax.bar(steps, ys, bottom=bottom, color=c, width=0.9, label=label)
            bottom = [b + y for b, y in zip(bottom, ys)]
    tot = {k: sum(s.get(k, {}).values()) for k, _, _ in parts}
    share = ", ".join(f"{lab} {100 * tot[k] / max(sum(tot.values()), 1e-9):.0f}%" for k, lab, _ in parts)
    _finish(ax, "time per step" + (f" (run total: {share})" if steps else ""), bool(steps), "seconds")


def panel_sft(ax, s, C):
    d = _line(ax, s, "sft/loss", "SFT loss (left)", C[5])
    _finish(ax, "SFT warm start", d)
    ax.set_xlabel("SFT step", fontsize=8)
    if "sft/eval/ex" in s:  # held-out EX during SFT, when the trainer logs it
        ax4 = ax.twinx()
        _line(ax4, s, "sft/eval/ex", "held-out EX (right)", C[1], smooth=False)
        ax4.set_ylim(-0.02, 1.02)
        ax4.tick_params(labelsize=8)
        hs = [h for a in (ax, ax4) for h in a.get_legend_handles_labels()[0]]
        ax.legend(hs, [h.get_label() for h in hs], fontsize=7, loc="best")


def panel_update(ax, s, C):
    d = _line(ax, s, "train/grad_norm", "grad norm (left)", C[6])
    ax2 = ax.twinx()
    if _line(ax2, s, "train/clip_frac", "clip fraction (right)", C[7]):
        ax2.tick_params(labelsize=8)
        d = True
    else:
        ax2.set_axis_off()
    _finish(ax, "update", d)
    if d:  # one legend for both axes
        hs = [h for a in (ax, ax2) for h in a.get_legend_handles_labels()[0]]
        ax.legend(hs, [h.get_label() for h in hs], fontsize=7, loc="best")


# the figure, row-major: a new panel is one function (ax, series, colors) added here
PANELS = [panel_reward, panel_success, panel_episode, panel_time, panel_sft, panel_update]
COLUMNS = 3


def plot(run_dir: str, out: str | None = None) -> str:
    """Draw run_dir/metrics.jsonl into out (default run_dir/metrics.png). Returns the path."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(MISSING) from None
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"no metrics.jsonl in {run_dir}")
    s = read_metrics(path)
    out = out or os.path.join(run_dir, "metrics.png")
    rows = -(-len(PANELS) // COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(16, 4.25 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for draw, ax in zip(PANELS, axes.ravel()):
        draw(ax, s, colors)
    for ax in axes.ravel()[len(PANELS):]:
        ax.set_axis_off()
    fig.suptitle(f"{os.path.abspath(run_dir)}", fontsize=10)
    fig.tight_layout()
    tmp = out + ".tmp"  # write then rename: a viewer polling the PNG never reads half a file
    fig.savefig(tmp, dpi=90, format=os.path.splitext(out)[1][1:] or "png")
    plt.close(fig)
    os.replace(tmp, out)
    return out


# -----------------------------------------------------------------------------
# live: redraw while a run is going


_warned = False


def refresh(run_dir: str) -> str | None:
    """train.py's train.plot_every hook: redraw metrics.png; never fails a run. Without
    matplotlib it warns once and returns None."""
    global _warned
    try:
        return plot(run_dir)
    except SystemExit as e:
        if not _warned:
            print(f"WARNING: train.plot_every is set but {e}", file=sys.stderr, flush=True)
            _warned = True
        return None


def finished(path: str) -> bool:
    """True when the last complete line of metrics.jsonl is train.py's end-of-run marker (DONE).
    A resumed run appends after it, so an old marker does not count."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 4096))
            lines = [ln for ln in fh.read().decode("utf-8", "replace").split("\n")[:-1] if ln.strip()]
    except FileNotFoundError:
        return False
    try:
        return bool(lines) and DONE in json.loads(lines[-1])
    except json.JSONDecodeError:
        return False


def follow(run_dir: str, out: str | None = None, every: float = 5.0, until=None, on_draw=None) -> int:
    """Redraw whenever metrics.jsonl changes (polled every `every` s) until the run's final line
    appears, until() is true (e.g. the training process exited), or Ctrl-C. on_draw(png_path) is
    called after each redraw (a notebook displays it). Returns the number of redraws."""
    path = os.path.join(run_dir, "metrics.jsonl")
    seen, draws = None, 0
    try:
        while True:
            done = finished(path) or bool(until and until())  # checked before reading: no last line lost
            stat = os.stat(path) if os.path.exists(path) else None
            key = stat and (stat.st_size, stat.st_mtime_ns)
            if key and key != seen:
                seen = key
                png = plot(run_dir, out)
                draws += 1
                if on_draw:
                    on_draw(png)
            if done:
                return draws
            time.sleep(every)
    except KeyboardInterrupt:
        return draws


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="folder with metrics.jsonl (train.out_dir)")
    ap.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    ap.add_argument("--follow", action="store_true", help="redraw while the run goes, until it ends or Ctrl-C")
    ap.add_argument("--every", type=float, default=5.0, help="--follow: seconds between checks")
    args = ap.parse_args(argv)
    if args.follow:
        n = follow(args.run_dir, args.out, args.every, on_draw=lambda p: print(f"redrew {p}", flush=True))
        print(f"stopped following after {n} redraws")
    else:
        print(plot(args.run_dir, args.out))


if __name__ == "__main__":
    main()
