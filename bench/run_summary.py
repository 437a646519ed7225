"""Headline figures of a train.py run, from its metrics.jsonl and its printed log.

    python bench/run_summary.py RUN_DIR LOG [--prefix grpo]

Prints `name: value` lines: mean rollout / reward / update seconds per GRPO step (the first step
apart: it captures CUDA graphs and compiles FlexAttention; a step that trained no group counts 0 s
of update), sampled tokens per rollout second,
peak GB per phase (CUDA) against the memory estimate train.py printed for that phase (`memory
estimate per device (GB): ..., rollout X, update Y, total Z`), and the steps logged (a resumed run
must continue the step count without repeating one). --from-step N (a resumed run): the first
rollout of the resumed process (step N + 1) against the last one before the stop (step N, steady).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def read_metrics(run_dir: str) -> list[dict]:
    rows = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill: the rest still counts
    return rows


def estimates(log_text: str) -> dict[str, float]:
    """The last `memory estimate per device (GB): name value, ...` line train.py printed, as a dict."""
    lines = [ln for ln in log_text.splitlines() if ln.startswith("memory estimate per device (GB):")]
    if not lines:
        return {}
    return {k: float(v) for k, v in re.findall(r"(\w+) ([0-9.]+)", lines[-1].split(":", 1)[1])}


def summary(rows: list[dict], log_text: str, prefix: str, from_step: int = 0) -> list[str]:
    steps = [r for r in rows if "time/step" in r]
    out = [f"{prefix}_steps_logged: {len(steps)}",
           f"{prefix}_last_step: {steps[-1]['step'] if steps else 0}"]
    numbers = [r["step"] for r in steps]
    out.append(f"{prefix}_repeated_steps: {len(numbers) - len(set(numbers))}")
    later = steps[1:] or steps
    for key in ("rollout", "reward", "update", "step"):
        if later:  # a step whose groups dynamic sampling all dropped ran no update: 0 s there
            out.append(f"{prefix}_{key}_s: {statistics.mean(r.get(f'time/{key}', 0.0) for r in later):.2f}")
    if steps:
        out.append(f"{prefix}_first_step_s: {steps[0]['time/step']:.2f}")
        out.append(f"{prefix}_rollout_tok_s: {statistics.mean(r['train/tokens_per_s'] for r in later):.0f}")
    peaks = {k: max(r[k] for r in rows if k in r) for k in {k for r in rows for k in r if k.startswith("mem/")}}
    for key, gb in sorted(peaks.items()):
        out.append(f"{prefix}_{key[4:]}: {gb:.2f}")
    est = estimates(log_text)
    if "total" in est:
        out.append(f"{prefix}_memory_estimate_gb: {est['total']:.2f}")
    for phase in ("rollout", "update"):  # each phase's measured peak against its own estimate
        if phase in est and f"mem/{phase}_peak_gb" in peaks:
            out.append(f"{prefix}_{phase}_peak_over_estimate: {peaks[f'mem/{phase}_peak_gb'] / est[phase]:.2f}")
    if "resident" in est and "mem/reward_start_gb" in peaks:  # what stays allocated between the phases
        out.append(f"{prefix}_resident_over_estimate: {peaks['mem/reward_start_gb'] / est['resident']:.2f}")
    by_step = {r["step"]: r for r in steps}
    if from_step and from_step in by_step and from_step + 1 in by_step:
        first, steady = by_step[from_step + 1]["time/rollout"], by_step[from_step]["time/rollout"]
        out += [f"{prefix}_first_rollout_s: {first:.2f}", f"{prefix}_steady_rollout_s: {steady:.2f}",
                f"{prefix}_first_rollout_over_steady: {first / steady:.2f}"]
    evals = [r for r in rows if "eval/ex" in r]
    if evals:
        out.append(f"{prefix}_eval_ex_last: {100 * evals[-1]['eval/ex']:.1f}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("log")
    ap.add_argument("--prefix", default="run")
    ap.add_argument("--from-step", type=int, default=0, help="a resumed run: the step it resumed from")
    a = ap.parse_args()
    log_text = Path(a.log).read_text(errors="replace") if Path(a.log).exists() else ""
    print("\n".join(summary(read_metrics(a.run_dir), log_text, a.prefix, a.from_step)))


if __name__ == "__main__":
    main()
