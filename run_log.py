"""A run's record: rank-0 prints, <out_dir>/metrics.jsonl and wandb (Log); seconds and, on CUDA,
peak memory per phase of a step (Phases). train.py makes one of each; the evals and the warm start
write through the Log they are handed.

    log = Log(cfg, rank); log.print("..."); log.metrics(step, {"train/reward": 0.3})
    phase = Phases(PeakMemory(device)); with phase("rollout"): ...; seconds = phase.pop()
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import config as C
import samples
from distributed import PeakMemory

class Log:
    """Rank-0 prints, <out_dir>/metrics.jsonl and wandb (online/offline/disabled)."""

    def __init__(self, cfg: C.Config, rank: int):
        self.rank, self.run = rank, None
        if rank != 0:
            return
        Path(cfg.train.out_dir).mkdir(parents=True, exist_ok=True)
        self.f = open(Path(cfg.train.out_dir) / "metrics.jsonl", "a")
        if cfg.wandb.mode != "disabled":
            import wandb
            self.run = wandb.init(project=cfg.wandb.project, name=cfg.wandb.name or None, mode=cfg.wandb.mode,
                                  config=C.to_dict(cfg), dir=cfg.train.out_dir)
        self.sample_log = samples.SampleLog(cfg.train.out_dir, self.run)  # samples.jsonl (+ wandb table)

    def print(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    def metrics(self, step: int, m: dict):
        if self.rank != 0:
            return
        self.f.write(json.dumps({"step": step, **{k: float(v) for k, v in m.items()}}) + "\n")
        self.f.flush()
        if self.run is not None:
            self.run.log(m, step=step)


class Phases:
    """Seconds per phase of a step (the time/* metrics) and, on CUDA, each phase's peak memory.

        with phase("rollout"): ...       # may run several times in a step: the seconds add up
        seconds = phase.pop()            # {name: seconds} since the last pop"""

    def __init__(self, mem: PeakMemory):
        self.mem, self.seconds = mem, {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = time.time()
        with self.mem.phase(name):
            yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.time() - t

    def pop(self) -> dict:
        out, self.seconds = self.seconds, {}
        return out
