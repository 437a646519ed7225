"""The toy recipes' runs as one Markdown table, checked against their goals.

    .venv/bin/python bench/toy_table.py runs/seed0 runs/seed1 ...    [--names a,b,...]

Reads each run's metrics.jsonl (train.out_dir), its protocol from a checkpoint's config.yaml and,
for the wall time, the log beside it (RUN.log, as bench/toy_seeds.sh writes it, or RUN/train.log, as
sweep.py does). One row per run: where the warm start stopped (SFT step, and the training EX and
recovery of that check), held-out EX at every eval (greedy), its gain from the warm start to the
end, the held-out recovery (episodes whose first query came back empty or failed that still ended
right: recovered / such episodes) from the warm start to the end, format errors and tool calls per
episode at the end, the whole command's wall time; then whether the run meets each goal of its
protocol (GOALS): the main command (tags) gain >= +10 points, recovery >= 50% at the end and >= +10
points over the warm start, >= 0.7 tool calls per episode; the actions recipe (configs/tiny_actions.yaml)
gain >= +15, the same recovery goals, format errors (no ANSWER in the step budget) <= 5%. The last
lines name the worst run (smallest gain) and the range of every figure over the runs.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

GOALS = {"tags": {"gain": 10.0, "recovery": 50.0, "recovery_gain": 10.0, "tool_calls": 0.7},
         "actions": {"gain": 15.0, "recovery": 50.0, "recovery_gain": 10.0, "format_err": 5.0}}


def protocol(run_dir: Path) -> str:
    """env.protocol of the run, from its first checkpoint's config.yaml (tags when none is there)."""
    for cfg in sorted(run_dir.glob("ckpt_*/config.yaml")):
        found = re.search(r"^\s+protocol:\s*(\w+)", cfg.read_text(), re.M)
        if found:
            return found.group(1)
    return "tags"


def read_run(run_dir: Path) -> dict:
    """Figures of one finished run (EX and recovery in percent)."""
    by_step: dict[int, dict] = {}
    for line in open(run_dir / "metrics.jsonl"):
        if line.strip():
            rec = json.loads(line)
            by_step.setdefault(int(rec.pop("step")), {}).update(rec)
    evals = {s: m for s, m in by_step.items() if "eval/ex" in m}
    stop = next((int(m["sft/stopped_at"]) for m in by_step.values() if "sft/stopped_at" in m), None)
    check = by_step.get(stop, {}) if stop else {}
    first, last = evals[min(evals)], evals[max(evals)]

    def recovery(m):
        bad = m.get("eval/first_query_bad", 0)
        return m.get("eval/recovered", 0), bad, 100 * m.get("eval/recovered", 0) / max(bad, 1)
    wall = grpo = None
    for log in (run_dir.with_suffix(".log"), run_dir / "train.log"):
        if log.exists():
            found = re.findall(r"steps in ([\d.]+) min \(whole command ([\d.]+) min", log.read_text())
            grpo, wall = map(float, found[-1]) if found else (grpo, wall)
    return {"run": str(run_dir), "stop": stop, "stop_ex": 100 * check.get("sft/train/ex", float("nan")),
            "stop_recovery": 100 * check.get("sft/train/recovery_rate", float("nan")),
            "ex": [100 * evals[s]["eval/ex"] for s in sorted(evals)], "steps": sorted(evals),
            "gain": 100 * (last["eval/ex"] - first["eval/ex"]),
            "recovery0": recovery(first), "recovery1": recovery(last),
            "recovery_gain": recovery(last)[2] - recovery(first)[2],
            "tool_calls": last.get("eval/tool_calls", 0.0), "format_err": 100 * last.get("eval/format_err", 0.0),
            "wall_min": wall, "grpo_min": grpo, "protocol": protocol(run_dir)}


def passes(r: dict) -> dict[str, bool]:
    goals = GOALS[r["protocol"]]
    got = {"gain": r["gain"], "recovery": r["recovery1"][2], "recovery_gain": r["recovery_gain"],
           "tool_calls": r["tool_calls"], "format_err": -r["format_err"]}  # format errors: at most
    return {k: got[k] >= (-v if k == "format_err" else v) for k, v in goals.items()}


def table(rows: list[dict], names: list[str]) -> str:
    steps = rows[0]["steps"]
    head = (["run", "warm start stops at (train EX, recovery)"] + [f"EX {s}" for s in steps] +
            ["gain", "recovered / first query empty (start -> end)", "format errors", "tool calls",
             "whole command (GRPO)", "goals"])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in zip(names, rows):
        (a0, b0, p0), (a1, b1, p1) = r["recovery0"], r["recovery1"]
        ok = passes(r)
        out.append("| " + " | ".join(
            [name, f"{r['stop'] or 'cap'} ({r['stop_ex']:.1f}%, {r['stop_recovery']:.1f}%)"]
            + [f"{x:.1f}" for x in r["ex"]]
            + [f"**{r['gain']:+.1f}**", f"{a0:.0f}/{b0:.0f} ({p0:.1f}%) -> {a1:.0f}/{b1:.0f} ({p1:.1f}%, {r['recovery_gain']:+.1f})",
               f"{r['format_err']:.1f}%", f"{r['tool_calls']:.2f}",
               f"{r['wall_min']:.1f} min ({r['grpo_min']:.1f})" if r["wall_min"] else "-",
               "all" if all(ok.values()) else "missed: " + ", ".join(k for k, v in ok.items() if not v)]) + " |")
    return "\n".join(out)


def summary(rows: list[dict], names: list[str]) -> str:
    worst = min(range(len(rows)), key=lambda i: rows[i]["gain"])
    rng = lambda xs: f"{min(xs):.1f} to {max(xs):.1f}"  # noqa: E731
    n_ok = sum(all(passes(r).values()) for r in rows)
    return (f"{n_ok} of {len(rows)} runs meet every goal. Worst run (smallest gain): {names[worst]} "
            f"({rows[worst]['ex'][0]:.1f} -> {rows[worst]['ex'][-1]:.1f}, {rows[worst]['gain']:+.1f}; recovery "
            f"{rows[worst]['recovery1'][2]:.1f}%). Over all runs: warm start EX {rng([r['ex'][0] for r in rows])}, "
            f"final EX {rng([r['ex'][-1] for r in rows])}, gain {rng([r['gain'] for r in rows])}, final recovery "
            f"{rng([r['recovery1'][2] for r in rows])}% (gain {rng([r['recovery_gain'] for r in rows])}), format errors "
            f"{rng([r['format_err'] for r in rows])}%, tool calls "
            f"{rng([r['tool_calls'] for r in rows])}, warm start stops {min(r['stop'] or 0 for r in rows)}-"
            f"{max(r['stop'] or 0 for r in rows)}.")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="train.out_dir folders of finished runs")
    ap.add_argument("--names", default="", help="comma-separated row names (default: the folders)")
    a = ap.parse_args()
    rows = [read_run(Path(r)) for r in a.runs]
    names = a.names.split(",") if a.names else [r["run"] for r in rows]
    print(table(rows, names))
    print()
    print(summary(rows, names))


if __name__ == "__main__":
    main()
