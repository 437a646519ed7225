"""The main command on other CPUs' float paths, on this machine: its warm start (or the whole run) per
seed under each path, one run at a time, and the figures the README promises.

    .venv/bin/python bench/float_paths.py                               # warm starts: seeds 0 1 2 x native avx2 default
    .venv/bin/python bench/float_paths.py --full                        # the whole main command (40 GRPO steps)
    .venv/bin/python bench/float_paths.py --paths avx2 --seeds 0 --tag _try --extra "--sft.stop_checks_in_a_row=3"

Why: torch's CPU kernels take the widest vector unit the CPU has, and each path adds in its own
order, so the floats differ in the last bits from one kind of CPU to another. Over the warm start's
hundreds of steps the bits grow into another trajectory: on the same seed the stop lands tens of
steps apart and held-out EX after it moves by ten points. A recipe tuned on one kind of CPU can hold
there and miss on another. The environment variables below make this machine take another CPU's
path (they are read when torch and MKL load, so each run is a subprocess):
- `ATEN_CPU_CAPABILITY` (avx2, default, ...): torch's own vectorised kernels (softmax, norms,
  elementwise, reductions, the CPU flash attention's arithmetic; also torch.randn's transform, so the
  tiny model's initial weights differ under `default`);
- `MKL_ENABLE_INSTRUCTIONS` (AVX2, SSE4_2, ...): MKL's code path (the BLAS of the CPU wheel: every
  matmul); a CPU without AVX-512 runs MKL's AVX2 kernels;
- `ONEDNN_MAX_CPU_ISA`: caps oneDNN (not on the float32 path of the main command; set for completeness).
PATHS names three: `native` (nothing set: this CPU's widest), `avx2` (an AVX2-only CPU: torch's and
MKL's AVX2 kernels) and `default` (torch's unvectorised kernels, MKL's own path). A path wider
than the CPU has is ignored by torch (it falls back to the CPU's own): `capability(path)` says what
a subprocess under that path reports.

Each run is `torchrun --standalone --nproc_per_node=2 train.py configs/tiny.yaml --train.seed=S` in
runs/fp_<path>_s<S><TAG> (log beside it, `.log`), its tiny model built in <run>/model under the same
path (as bench/toy_seeds.sh builds one per seed; seed 0's is the main command's), GPUs hidden; the
warm start alone by default (`--train.steps=0`: the warm start, ckpt_000000 and the held-out eval
after it). Printed per run: the float path's capability, where the warm start stopped (step, the
stop check's EX and recovery), held-out EX and recovery after it and, with --full, at the end; the
load average at its start and end (the machine may be shared: wall times are then inflated); then
bench/toy_table.py's table with --full. Headlines last: the smallest held-out recovery after the warm
start, and with --full the smallest at the end (the README's goal: >= 50% on every run).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# the environment of each float path (module docstring)
PATHS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default"},
}


def path_env(path: str) -> dict:
    """The environment of a subprocess on `path`: this one's, with the path's variables set and every
    path variable it does not set removed (an inherited one would otherwise pick the kernels), GPUs
    hidden, wandb off."""
    env = {k: v for k, v in os.environ.items() if k not in {key for p in PATHS.values() for key in p}}
    return {**env, **PATHS[path], "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "disabled"}


def capability(path: str) -> str:
    """What torch reports in a subprocess on `path` (AVX512, AVX2, DEFAULT, ...)."""
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                          env=path_env(path), capture_output=True, text=True, check=True).stdout.strip()


def top_processes(n: int = 8) -> str:
    """The n busiest processes (ps), or "" where ps is missing."""
    try:
        out = subprocess.run(["ps", "-eo", "pid,pcpu,etime,args", "--sort=-pcpu"], capture_output=True, text=True).stdout
    except OSError:
        return ""
    return "".join(line[:200] + "\n" for line in out.splitlines()[:n + 1])


def run_main_command(path: str, seed: int, out_dir: Path, args: list[str], nproc: int = 2,
                     timeout: float | None = None) -> dict:
    """train.py configs/tiny.yaml on `path` for `seed` in out_dir (its model in out_dir/model unless
    args name another), args after the seed's (later ones win); its log in out_dir.log. Returns the
    run's figures (figures()) with the wall time, the exit code and the load average at start and end
    (the busiest processes then: out_dir.beside)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    launch = [sys.executable, "train.py"] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    cmd = launch + ["configs/tiny.yaml", f"--train.seed={seed}", f"--model.path={out_dir}/model",
                    f"--train.out_dir={out_dir}", *args]
    load0, t0 = os.getloadavg()[0], time.time()
    beside = out_dir.with_suffix(".beside")  # what else ran at the start and the end (a shared machine)
    beside.write_text(f"start, load {load0:.2f}\n{top_processes()}")
    with open(out_dir.with_suffix(".log"), "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env={**path_env(path), "OMP_NUM_THREADS": "1"}, stdout=log,
                            stderr=subprocess.STDOUT, timeout=timeout).returncode
    with open(beside, "a") as fh:
        fh.write(f"end, load {os.getloadavg()[0]:.2f}, {(time.time() - t0) / 60:.1f} min\n{top_processes()}")
    out = {"path": path, "seed": seed, "run": str(out_dir), "rc": rc, "wall_min": (time.time() - t0) / 60,
           "load": (load0, os.getloadavg()[0])}
    if rc == 0:
        out.update(figures(out_dir))
    return out


def figures(out_dir: Path) -> dict:
    """From a run's metrics.jsonl: the SFT losses, the stop (step, the check's EX and recovery, in %),
    held-out EX and recovery (recovered / first query empty or failed, in %) after the warm start and
    at the last eval."""
    by_step: dict[int, dict] = {}
    for line in open(out_dir / "metrics.jsonl"):
        if line.strip():
            rec = json.loads(line)
            by_step.setdefault(int(rec.pop("step")), {}).update(rec)
    stop = next((int(m["sft/stopped_at"]) for m in by_step.values() if "sft/stopped_at" in m), None)
    check = by_step.get(stop, {}) if stop else {}
    evals = [by_step[s] for s in sorted(by_step) if "eval/ex" in by_step[s]]
    recovery = lambda m: 100 * m.get("eval/recovered", 0) / max(m.get("eval/first_query_bad", 0), 1)  # noqa: E731
    return {"sft_losses": [by_step[s]["sft/loss"] for s in sorted(by_step) if "sft/loss" in by_step[s]],
            "stop": stop, "stop_ex": 100 * check.get("sft/train/ex", float("nan")),
            "stop_recovery": 100 * check.get("sft/train/recovery_rate", float("nan")),
            "ex0": 100 * evals[0]["eval/ex"], "recovery0": recovery(evals[0]),
            "ex_end": 100 * evals[-1]["eval/ex"], "recovery_end": recovery(evals[-1]), "evals": len(evals)}


def row(r: dict, cap: str, full: bool) -> str:
    if r["rc"] != 0:
        return f"| {r['path']} ({cap}) | {r['seed']} | failed (exit {r['rc']}): {r['run']}.log |"
    cells = [f"{r['path']} ({cap})", str(r["seed"]),
             f"{r['stop'] or 'cap'} ({r['stop_ex']:.1f}%, {r['stop_recovery']:.1f}%)",
             f"{r['ex0']:.1f}", f"{r['recovery0']:.1f}%"]
    if full:
        cells += [f"{r['ex_end']:.1f} ({r['ex_end'] - r['ex0']:+.1f})", f"{r['recovery_end']:.1f}%"]
    cells += [f"{r['wall_min']:.1f} min", f"{r['load'][0]:.1f} / {r['load'][1]:.1f}"]
    return "| " + " | ".join(cells) + " |"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--full", action="store_true", help="the whole main command (default: the warm start alone)")
    ap.add_argument("--tag", default="", help="suffix of the run folders (runs/fp_<path>_s<S><TAG>)")
    ap.add_argument("--extra", default="", help="more train.py overrides, one string")
    a = ap.parse_args()
    args = ([] if a.full else ["--train.steps=0"]) + shlex.split(a.extra)
    head = ["float path (torch reports)", "seed", "warm start stops at (check EX, recovery)",
            "held-out EX after it", "recovery after it"] + (["EX at the end (gain)", "recovery at the end"]
                                                            if a.full else []) + ["wall", "load at start / end"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    runs = []
    for path in a.paths:
        cap = capability(path)
        for seed in a.seeds:
            r = run_main_command(path, seed, ROOT / "runs" / f"fp_{path}_s{seed}{a.tag}", args)
            runs.append(r)
            lines.append(row(r, cap, a.full))
            print(lines[-1], flush=True)
    print("\n" + "\n".join(lines))
    done = [r for r in runs if r["rc"] == 0]
    if a.full and done:
        subprocess.run([sys.executable, str(ROOT / "bench" / "toy_table.py"), *[r["run"] for r in done],
                        "--names", ",".join(f"{r['path']} s{r['seed']}" for r in done)], cwd=ROOT)
    print(f"failed_runs: {len(runs) - len(done)}")
    if done:
        print(f"warm_start_heldout_recovery_min: {min(r['recovery0'] for r in done):.1f}")
        if a.full:
            print(f"final_recovery_min: {min(r['recovery_end'] for r in done):.1f}")


if __name__ == "__main__":
    main()
