"""Ablation sweeps: run train.py over a grid of config overrides × seeds, then write a Markdown
table and one plot of held-out EX per variant (mean and spread over seeds).

    python sweep.py configs/tiny.yaml --grid grpo.loss=grpo,gspo,cispo --seeds 1,2,3 --jobs 2
    python sweep.py configs/tiny.yaml --variants all --seeds 1,2 --set train.steps=20 --out runs/sweep
    python sweep.py configs/tiny.yaml --variants all --seeds 1,2 --report-only   # table + plot only

A variant is a named set of overrides (VARIANTS below: SkyRL's GRPO, DAPO, Dr. GRPO, GSPO, CISPO,
GRPO + token TIS); --grid adds a Cartesian product of key=v1,v2 values on top of each variant, and
--set fixes keys for every run. Each (point, seed) is one `python train.py` subprocess with its own
train.out_dir (<out>/<point>/seed<k>) and train.seed; --jobs runs several at a time, each with
train.threads = cores // jobs so the machine is not oversubscribed. Resumable: a run whose
metrics.jsonl ends with train.py's end-of-run line is not rerun; an unfinished one is relaunched and
train.py resumes it from its last checkpoint. Every point's config is validated (config.py) before
anything runs, so a bad key fails at once with config.py's message.
Outputs in <out>: results.md (the table), ex.png (held-out EX over steps), sweep.json (the points).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import config as C

Point = tuple[str, dict]  # (name, {"group.key": value} overrides): one column of the table

DONE = "run/done"  # train.py's last metrics line (plot.DONE); duplicated to keep sweep.py light
HERE = Path(__file__).resolve().parent

# -----------------------------------------------------------------------------
# variants: the 2025-26 loss family as config overrides (keys of config.GRPOConfig)

# SkyRL-SQL's recipe: PPO-clip GRPO, ε 0.2/0.2, token-mean, group-std advantages, no KL, every group
# kept. Every variant spells out all of these keys, the loss family's, so a variant means the same
# loss on any base config. Every other key (the credit, the reward, truncation, ...) comes from the
# base config, --grid or --set: a new key needs nothing here.
_SKYRL = {"grpo.loss": "grpo", "grpo.clip_low": 0.2, "grpo.clip_high": 0.2, "grpo.loss_agg": "token-mean",
          "grpo.advantage": "group", "grpo.kl_beta": 0.0, "grpo.dynamic_sampling": False,
          "grpo.rollout_is": "none"}
VARIANTS: dict[str, dict] = {
    "skyrl-grpo": _SKYRL,
    # DAPO: clip-higher (ε_high 0.28) + dynamic sampling (all-equal-reward groups dropped) + token-mean
    "dapo": {**_SKYRL, "grpo.clip_high": 0.28, "grpo.dynamic_sampling": True},
    # Dr. GRPO: no std normalisation, constant normaliser sum / (B * L)
    "drgrpo": {**_SKYRL, "grpo.advantage": "none", "grpo.loss_agg": "drgrpo"},
    # GSPO: sequence ratio exp(mean_t log ρ), its own small ε (3e-4/4e-4), one loss per sequence
    "gspo": {**_SKYRL, "grpo.loss": "gspo", "grpo.clip_low": -1.0, "grpo.clip_high": -1.0,
             "grpo.loss_agg": "seq-mean-token-mean"},
    # CISPO: stop-gradient clipped IS weight × A × log π (ε_high 0.28, no lower bound)
    "cispo": {**_SKYRL, "grpo.loss": "cispo", "grpo.clip_low": -1.0, "grpo.clip_high": -1.0},
    # TIS on: SkyRL's GRPO with token-level truncated IS, weight min(π_old / π_rollout, 2)
    "skyrl-grpo+tis": {**_SKYRL, "grpo.rollout_is": "token-tis", "grpo.rollout_is_cap": 2.0},
}


# -----------------------------------------------------------------------------
# the grid


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """["grpo.loss=grpo,gspo", "optim.lr=1e-3"] -> {"grpo.loss": ["grpo", "gspo"], "optim.lr": ["1e-3"]}"""
    grid = {}
    for it in items:
        if "=" not in it:
            raise C.ConfigError(f"--grid '{it}' must look like group.key=v1,v2")
        k, v = it.split("=", 1)
        grid[k.removeprefix("--")] = [x for x in v.split(",") if x != ""]
        if not grid[k.removeprefix("--")]:
            raise C.ConfigError(f"--grid '{it}' has no values")
    return grid


def expand(variants: list[str], grid: dict[str, list[str]]) -> list[Point]:
    """Points (name, overrides): each variant (or none) × the Cartesian product of the grid.
    The name joins the variant and the grid values: "dapo", "grpo.loss=gspo,optim.lr=1e-3", ..."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise C.ConfigError(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    points = []
    keys = list(grid)
    for var in variants or [None]:
        for values in itertools.product(*(grid[k] for k in keys)):
            over = dict(VARIANTS[var]) if var else {}
            over.update(zip(keys, values))
            parts = ([var] if var else []) + [f"{k}={v}" for k, v in zip(keys, values)]
            points.append((",".join(parts) or "base", over))
    return points


def argv_of(overrides: dict) -> list[str]:
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items()]


def validate(config_path: str, points: list[Point], fixed: dict) -> None:
    """Raise config.ConfigError (config.py's and trainer/config_checks.py's messages: a bad key, a value out
    of range, keys that disagree) for any point before anything runs (each point is one process)."""
    from trainer import config_checks
    for name, over in points:
        try:
            config_checks.validate(C.load_config([config_path, *argv_of({**fixed, **over})]), world=1)
        except C.ConfigError as e:
            raise C.ConfigError(f"point '{name}': {e}") from None


# -----------------------------------------------------------------------------
# running


def finished(run_dir: Path) -> bool:
    """The run's metrics.jsonl ends with train.py's end-of-run line."""
    f = run_dir / "metrics.jsonl"
    if not f.exists():
        return False
    lines = [ln for ln in f.read_text().splitlines() if ln.strip()]
    try:
        return bool(lines) and DONE in json.loads(lines[-1])
    except json.JSONDecodeError:
        return False


def run_one(config_path: str, run_dir: Path, argv: list[str]) -> float:
    """One train.py subprocess; its output goes to <run_dir>/train.log. Returns wall seconds
    (also stored in <run_dir>/wall.json for the table)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(run_dir / "train.log", "a") as logf:
        rc = subprocess.run([sys.executable, str(HERE / "train.py"), config_path, *argv],
                            stdout=logf, stderr=subprocess.STDOUT, cwd=os.getcwd()).returncode
    wall = time.time() - t0
    if rc != 0:
        raise RuntimeError(f"train.py failed (exit {rc}) in {run_dir}; see {run_dir / 'train.log'}")
    prev = json.loads((run_dir / "wall.json").read_text())["wall_s"] if (run_dir / "wall.json").exists() else 0.0
    (run_dir / "wall.json").write_text(json.dumps({"wall_s": prev + wall}))  # a resumed run adds up
    return wall


def run_sweep(config_path: str, points: list[Point], seeds: list[int], fixed: dict, out: Path, jobs: int,
              threads: int) -> None:
    """Build the shared assets once (toy data, tiny model), then every (point, seed) not finished."""
    import sft  # the asset builder and what it needs; imported here so the report path needs no model code
    from model import Transformer
    from toy import tiny
    base = C.load_config([config_path, *argv_of(fixed)])
    tiny.prepare_assets(base, Transformer, sft.gold_texts)  # once, before the jobs: concurrent runs would race to build them
    todo = []
    for name, over in points:
        for s in seeds:
            d = out / name / f"seed{s}"
            if finished(d):
                print(f"[sweep] {name} seed {s}: finished, skipped", flush=True)
                continue
            argv = argv_of({**fixed, **over, "train.seed": s, "train.out_dir": str(d), "train.threads": threads})
            todo.append((name, s, d, argv))
    print(f"[sweep] {len(todo)} run(s) to do, {jobs} at a time, {threads} thread(s) each", flush=True)

    def go(job: tuple[str, int, Path, list[str]]) -> None:
        name, s, d, argv = job
        print(f"[sweep] start {name} seed {s} -> {d}", flush=True)
        wall = run_one(config_path, d, argv)
        print(f"[sweep] done  {name} seed {s} in {wall / 60:.1f} min", flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for f in [pool.submit(go, j) for j in todo]:
            f.result()  # re-raises the first failure


# -----------------------------------------------------------------------------
# report: table + plot


def eval_curve(run_dir: Path, key: str = "eval/ex") -> dict[int, float]:
    """{step: held-out EX} from a run's metrics.jsonl (the last value when a resumed run repeats a step)."""
    curve = {}
    for ln in (run_dir / "metrics.jsonl").read_text().splitlines():
        if ln.strip():
            r = json.loads(ln)
            if key in r:
                curve[int(r["step"])] = float(r[key])
    return curve


def mean_spread(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; 0 for a single seed)."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarise(points: list[Point], seeds: list[int], out: Path) -> list[dict]:
    """One row per point with finished runs: EX at the first and last evaluation, per seed."""
    rows = []
    for name, _ in points:
        dirs = [out / name / f"seed{s}" for s in seeds if finished(out / name / f"seed{s}")]
        curves = [eval_curve(d) for d in dirs]
        curves = [c for c in curves if c]
        if not curves:
            continue
        start = [c[min(c)] for c in curves]
        end = [c[max(c)] for c in curves]
        walls = [json.loads((d / "wall.json").read_text())["wall_s"] for d in dirs if (d / "wall.json").exists()]
        rows.append({"name": name, "seeds": len(curves), "start": start, "end": end,
                     "delta": [e - s for s, e in zip(start, end)], "curves": curves,
                     "wall_min": statistics.fmean(walls) / 60 if walls else None,
                     "steps": max(max(c) for c in curves)})
    return rows


def table(rows: list[dict]) -> str:
    """Markdown; EX in percent, mean ± sample std over seeds."""
    def pm(xs: list[float]) -> str:
        m, s = mean_spread(xs)
        return f"{100 * m:.1f} ± {100 * s:.1f}"
    lines = ["| variant | seeds | held-out EX start (%) | EX end (%) | Δ EX (points) | steps | wall / run (min) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        wall = f"{r['wall_min']:.1f}" if r["wall_min"] is not None else "-"
        lines.append(f"| {r['name']} | {r['seeds']} | {pm(r['start'])} | {pm(r['end'])} | {pm(r['delta'])} "
                     f"| {r['steps']} | {wall} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Held-out EX over GRPO steps: one line per variant (mean over seeds), band = min..max over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        steps = sorted(set.intersection(*(set(c) for c in r["curves"])))
        vals = [[100 * c[s] for c in r["curves"]] for s in steps]
        ax.plot(steps, [statistics.fmean(v) for v in vals], marker="o", ms=3, label=r["name"])
        ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], alpha=0.15)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("held-out EX (%)")
    ax.set_title("held-out EX per variant (mean over seeds; band: min..max)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(points: list[Point], seeds: list[int], out: Path, command: str = "") -> str:
    rows = summarise(points, seeds, out)
    md = table(rows)
    (out / "results.md").write_text((f"`{command}`\n\n" if command else "") + md)
    if rows:
        plot(rows, out / "ex.png")
    return md


# -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--grid", action="append", default=[], help="group.key=v1,v2 (repeatable: Cartesian product)")
    ap.add_argument("--variants", default="", help=f"comma-separated presets or 'all': {', '.join(VARIANTS)}")
    ap.add_argument("--seeds", default="1", help="comma-separated train.seed values")
    ap.add_argument("--set", action="append", default=[], help="group.key=value for every run (repeatable)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time")
    ap.add_argument("--threads", type=int, default=0, help="train.threads per run (0: cores // jobs)")
    ap.add_argument("--out", default="runs/sweep")
    ap.add_argument("--report-only", action="store_true", help="write the table and plot from finished runs")
    args = ap.parse_args(argv)
    variants = list(VARIANTS) if args.variants == "all" else [v for v in args.variants.split(",") if v]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    fixed = {}
    for it in args.set:
        if "=" not in it:
            raise C.ConfigError(f"--set '{it}' must look like group.key=value")
        k, v = it.split("=", 1)
        fixed[k.removeprefix("--")] = v
    points = expand(variants, parse_grid(args.grid))
    validate(args.config, points, fixed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"config": args.config, "points": points, "seeds": seeds,
                                                "fixed": fixed}, indent=1, default=str))
    if not args.report_only:
        threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
        run_sweep(args.config, points, seeds, fixed, out, args.jobs, threads)
    print(report(points, seeds, out, "python " + " ".join(["sweep.py", *(argv if argv is not None else sys.argv[1:])])))
    print(f"[sweep] table: {out / 'results.md'}  plot: {out / 'ex.png'}")


if __name__ == "__main__":
    try:
        main()
    except C.ConfigError as e:
        sys.exit(f"config error: {e}")
