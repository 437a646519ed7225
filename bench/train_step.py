"""Training throughput: tokens/s of the GRPO update step (train.update: forward, backward, AdamW)
on CPU, 1 process vs 2 processes (torchrun, FSDP2 over gloo), same global batch.

The model has configs/tiny.yaml's shape (random weights); the batch is fake trajectories shaped
like tiny.yaml's (192-token prompts with loss mask 0, 64-288 sampled tokens with mask 1, random
ids), the same in every process; the 2-process run gives each rank a contiguous half, as
train.py does. Tokens/s = unpadded tokens of the global batch / wall time of one update() call,
median over --steps after one warm-up step. The parent runs the 1-process cases itself (2 threads,
the whole machine, and 1 thread) and launches the 2-process case with torchrun in a subprocess
(OMP_NUM_THREADS=1: 2 ranks x 1 thread on 2 cores), --pairs times alternately.

    .venv/bin/python bench/train_step.py [--seqs 64] [--steps 3] [--pairs 2]
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import config as C  # noqa: E402
import tiny  # noqa: E402
import distributed  # noqa: E402
import optim  # noqa: E402
import train  # noqa: E402
from model import Transformer  # noqa: E402


def fake_batch(n: int, vocab: int, seed: int = 0) -> list:
    r = random.Random(seed)
    out = []
    for _ in range(n):
        p, a = 192, r.randint(64, 288)
        out.append(SimpleNamespace(ids=[r.randrange(vocab) for _ in range(p + a)], loss_mask=[0] * p + [1] * a))
    return out


def measure(model_dir: str, seqs: int, steps: int) -> dict:
    """Per-step seconds of train.update on this rank's share (all ranks run this together)."""
    cfg = C.load_config([os.path.join(ROOT, "configs", "tiny.yaml")])
    rank, world, device = distributed.setup_dist()
    model = Transformer.from_pretrained(model_dir, dtype=torch.float32, device=device)
    model = distributed.shard(model, world, device)
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, optim.lr_lambda(0, 100, "constant"))
    batch = fake_batch(seqs, model.config.vocab_size)
    adv = torch.tensor([random.Random(i).choice([-1.0, 1.0]) for i in range(seqs)])
    lo, hi = rank * seqs // world, (rank + 1) * seqs // world
    times, gn = [], []
    for _ in range(steps + 1):  # the first is a warm-up
        if world > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        m = train.update(model, None, opt, sch, batch[lo:hi], adv[lo:hi], cfg, world, device)
        times.append(time.perf_counter() - t0)
        gn.append(m["grad_norm"])
    tokens = sum(len(t.ids) for t in batch)
    res = {"world": world, "threads": torch.get_num_threads(), "tokens": tokens,
           "loss_tokens": sum(sum(t.loss_mask) for t in batch), "times": times[1:], "grad_norm": gn}
    if world > 1:  # rank 0's time is the step's: the ranks meet at every collective and start together
        torch.distributed.destroy_process_group()
    return res


def run_1proc(model_dir, seqs, steps, threads):
    torch.set_num_threads(threads)
    return measure(model_dir, seqs, steps)


def run_2proc(model_dir, seqs, steps):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.abspath(__file__), "--worker", model_dir, "--seqs", str(seqs), "--steps", str(steps)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        sys.exit(f"torchrun failed:\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads(lines[0][len("RESULT "):])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64, help="sequences in the global batch")
    ap.add_argument("--steps", type=int, default=3, help="timed update steps per run (+1 warm-up)")
    ap.add_argument("--pairs", type=int, default=2, help="alternating 1-process / 2-process runs")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:  # one rank of the torchrun case
        torch.set_num_threads(1)
        res = measure(a.worker, a.seqs, a.steps)
        if int(os.environ.get("RANK", 0)) == 0:
            print("RESULT " + json.dumps(res), flush=True)
        return
    cfg = C.load_config([os.path.join(ROOT, "configs", "tiny.yaml")])
    m = cfg.model
    d = tempfile.mkdtemp(prefix="bench_train_step_")
    tiny.build_tiny_model(d, vocab_size=m.tiny_vocab_size, hidden_size=m.tiny_hidden_size, layers=m.tiny_layers,
                          heads=m.tiny_heads, kv_heads=m.tiny_kv_heads, intermediate_size=m.tiny_intermediate_size)
    n_params = sum(p.numel() for p in Transformer.from_pretrained(d).parameters())
    print(f"model: configs/tiny.yaml shape, {n_params / 1e6:.2f}M params; batch {a.seqs} seqs; "
          f"micro_batch_tokens {cfg.optim.micro_batch_tokens}; {os.cpu_count()} cores")
    runs = {"1proc_2threads": [], "1proc_1thread": [], "2proc_1thread": []}
    tokens = None
    for _ in range(a.pairs):
        for name in runs:
            if name == "2proc_1thread":
                res = run_2proc(d, a.seqs, a.steps)
            else:
                res = run_1proc(d, a.seqs, a.steps, 2 if name == "1proc_2threads" else 1)
            tokens = res["tokens"]
            runs[name] += res["times"]
            print(f"  {name}: steps {', '.join(f'{t:.2f}' for t in res['times'])} s "
                  f"(grad norm {res['grad_norm'][0]:.3f})", flush=True)
    tps = {k: tokens / statistics.median(v) for k, v in runs.items()}
    for k, v in runs.items():
        print(f"{k:15s} median step {statistics.median(v):6.2f} s  {tps[k]:8.0f} tokens/s  ({len(v)} steps)")
    print(f"2 processes vs 1 process (2 threads): {tps['2proc_1thread'] / tps['1proc_2threads']:.2f}x; "
          f"vs 1 process 1 thread: {tps['2proc_1thread'] / tps['1proc_1thread']:.2f}x")
    print(f"update_tokens_per_s_1proc: {tps['1proc_2threads']:.0f}")
    print(f"update_tokens_per_s_2proc: {tps['2proc_1thread']:.0f}")
    print(f"update_speedup_2proc_vs_1proc: {tps['2proc_1thread'] / tps['1proc_2threads']:.2f}")


if __name__ == "__main__":
    main()
