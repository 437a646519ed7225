"""Rollout time on CPU with decode windows of 8 steps (the GPU setting) vs 1 (what
sampling.decode_steps_per_sync: 0 picks off CUDA), interleaved pairs in one process, and a check
that every pair sampled the same episodes (a token's noise depends on its key and position only).

A window runs its steps for every running row; a row whose turn ends inside it idles to the end,
and its next turn (after the tool call) waits for the window. On CUDA a host read is a device sync,
so windows pay; on CPU each idle row still costs its share of every forward.

    .venv/bin/python bench/decode_window.py --model runs/tiny/ckpt_000000/hf [--toy runs] [--pairs 3]

--model: a trained checkpoint's hf/ folder (a warm start: turns of realistic length; a random
model runs every turn to max_new_tokens, where windows cost nothing). Prints each rollout, then
the medians (the first pair is a warm-up), headline last.
"""
import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import config as C  # noqa: E402
from sqltask import dataset  # noqa: E402
from rollout import sample_episodes  # noqa: E402
from trainer.run_log import Phases  # noqa: E402
from trainer.distributed import PeakMemory  # noqa: E402
from model import Transformer  # noqa: E402
from trainer.policy_sampler import PolicySampler  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a checkpoint's hf/ folder")
    ap.add_argument("--toy", default=os.path.join(ROOT, "runs"), help="a folder holding toy/ (as bench/rl_step.py)")
    ap.add_argument("--pairs", type=int, default=3, help="timed pairs (after one warm-up pair)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.model)
    toy = os.path.join(a.toy, "toy")
    cfgs = {w: C.load_config([os.path.join(ROOT, "configs", "tiny.yaml"), f"--data.db_root={toy}",
                              f"--data.train_path={toy}/train.jsonl", f"--model.path={a.model}",
                              f"--sampling.decode_steps_per_sync={w}"]) for w in (8, 1)}
    P, G = cfgs[8].grpo.prompts_per_step, cfgs[8].grpo.group_size
    exs = dataset.load_examples(cfgs[8].data.train_path, toy)[:P]
    # one PolicySampler (so one engine) per setting, as a run keeps one
    model = Transformer.from_pretrained(a.model, dtype=torch.float32)
    samplers = {w: PolicySampler(model, cfgs[w].sampling) for w in cfgs}
    for sampler in samplers.values():
        sampler.refresh(model)
    times = {w: [] for w in cfgs}
    for rep in range(a.pairs + 1):
        ids = {}
        for w in cfgs:
            t0, phase = time.time(), Phases(PeakMemory(torch.device("cpu")))
            trajs = [e.trajectory for e in sample_episodes(samplers[w], tok, exs, cfgs[w], n=G, seed=rep, phase=phase)]
            t_roll = phase.pop()["rollout"]
            ids[w] = [list(t.ids) for t in trajs]
            if rep:
                times[w].append(t_roll)
            print(f"pair {rep}{' (warm-up)' if rep == 0 else ''}, window {w}: rollout {t_roll:.2f}s "
                  f"({len(trajs)} episodes, {time.time() - t0:.2f}s with rewards)", flush=True)
        if ids[8] != ids[1]:
            raise SystemExit("the two windows sampled different episodes")
    med = {w: statistics.median(v) for w, v in times.items()}
    print(f"{P} prompts x {G}, {a.threads} threads; every pair sampled the same episodes")
    print(f"rollout_s_window8: {med[8]:.2f}")
    print(f"rollout_s_window1: {med[1]:.2f}")
    print(f"rollout_speedup_window1_vs_8: {med[8] / med[1]:.2f}")


if __name__ == "__main__":
    main()
