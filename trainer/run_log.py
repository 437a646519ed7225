"""A run's record: rank-0 prints, <out_dir>/metrics.jsonl and wandb (Log); seconds and, on CUDA,
peak memory per phase of a step (Phases). train.py makes one of each; the evals and the warm start
write through the Log they are handed.

    log = Log(cfg, rank); log.print("..."); log.metrics(step, {"train/reward": 0.3})
    log.sizes() / log.rewind(sizes) / log.set_aside()   # a checkpoint's log sizes; resume; a fresh start
    phase = Phases(PeakMemory(device)); with phase("rollout"): ...; seconds = phase.pop()
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from trainer.config_loader import to_dict
from trainer import sample_log
from trainer.distributed import PeakMemory

class Log:
    """Rank-0 prints, <out_dir>/metrics.jsonl and wandb (online/offline/disabled)."""

    def __init__(self, cfg, rank: int):
        self.rank, self.run = rank, None
        if rank != 0:
            return
        Path(cfg.train.out_dir).mkdir(parents=True, exist_ok=True)
        self.f = open(Path(cfg.train.out_dir) / "metrics.jsonl", "a")
        if cfg.wandb.mode != "disabled":
            import wandb
            self.run = wandb.init(project=cfg.wandb.project, name=cfg.wandb.name or None, mode=cfg.wandb.mode,
                                  config=to_dict(cfg), dir=cfg.train.out_dir)
        self.sample_log = sample_log.SampleLog(cfg.train.out_dir, self.run)  # samples.jsonl (+ wandb table)

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

    def samples(self, step: int, episodes: list, tokenizer, group_size: int, rows: int, show: int = 2):
        """Rank 0's sampled episodes (rollout.Episode list): the first `show` printed in full with their
        reward and the gold; up to `rows` (one per prompt) to samples.jsonl and the wandb table `samples`."""
        if self.rank != 0:
            return
        for e in episodes[:show]:
            t, r = e.trajectory, e.reward
            self.print(f"--- sample (reward {r.value:+.2f}, exec {r.exec_match}, end {t.end_reason}, "
                       f"turns {t.num_turns}, tool calls {t.num_tool_calls}) "
                       f"Q: {e.example['question']}\n{t.text}\n--- gold: {e.example['gold_sql']}")
        self.sample_log.write(step, episodes, tokenizer, group_size, rows)

    def sizes(self) -> dict:
        """Bytes written so far to metrics.jsonl and samples.jsonl (rank 0; {} elsewhere): a
        checkpoint keeps them, so a resume can drop what was logged after it."""
        if self.rank != 0:
            return {}
        return {p.name: p.stat().st_size for p in (Path(self.f.name), self.sample_log.path) if p.exists()}

    def set_aside(self):
        """A fresh start (nothing to resume) in an out_dir whose metrics.jsonl / samples.jsonl hold lines of
        an earlier attempt (one stopped in its warm start, or --train.resume=false): they move to
        <name>.<time>, so no step of this run is logged twice in one file."""
        if self.rank != 0:
            return
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for p in (Path(self.f.name), self.sample_log.path):
            if p.exists() and p.stat().st_size:
                p.rename(p.with_name(f"{p.name}.{stamp}"))
                self.print(f"note: {p} held an earlier attempt's lines: moved to {p.name}.{stamp}")
        self.f.close()
        self.f = open(self.f.name, "a")

    def rewind(self, sizes: dict | None):
        """Cut metrics.jsonl and samples.jsonl back to a checkpoint's sizes: the steps after it are
        run again and logged again, never twice (an older checkpoint without sizes: left as is)."""
        if self.rank != 0 or not sizes:
            return
        for p in (Path(self.f.name), self.sample_log.path):
            if p.name in sizes and p.exists() and p.stat().st_size > sizes[p.name]:
                os.truncate(p, sizes[p.name])  # metrics.jsonl is open for appending: writes go to the new end


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
