"""Training throughput of the GRPO update step (train.update: forward, backward, AdamW).

Default: shared-prompt packing (train.update) vs the padded per-sequence path it replaced
(`padded_update` below, one padded row per trajectory, every prompt computed G times), same
model, same batch, interleaved in ONE process (old, new, old, new, ...), median of the per-pair
ratios. Two batch shapes:
  tiny   configs/tiny.yaml's: ~63-token prompts, ~22-token answers, G=8
  skyrl  SkyRL-SQL-shaped, scaled down: prompts with a long tail, G=5, 1-3 turns with
         observation tokens (mask 0) between sampled turns
Prints `update_speedup_shared_prompt_tiny: X` and `update_speedup_shared_prompt_skyrl: X`.

    .venv/bin/python bench/train_step.py [--pairs 5]
    .venv/bin/python bench/train_step.py --device cuda [--shape qwen2.5-0.5b]   # bf16: peak memory, MFU
    .venv/bin/python bench/train_step.py --procs [--seqs 64] [--steps 3]         # 1 vs 2 processes (FSDP2, gloo)

--procs: tokens/s of train.update, 1 process vs 2 processes (torchrun, FSDP2 over gloo), same
global batch; the 2-process run gives each rank a contiguous half, as train.py does.
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
from toy import tiny  # noqa: E402
from trainer import distributed  # noqa: E402
import grpo  # noqa: E402
from trainer import packing  # noqa: E402
from trainer import optim  # noqa: E402
import train  # noqa: E402
from trainer.loss_scale import LossScaler  # noqa: E402
from padded import pack, token_logprobs  # noqa: E402  (this folder: the padded reference)
from model import Transformer  # noqa: E402
from rollout import Trajectory  # noqa: E402
from sampler import SHAPES  # noqa: E402


def traj(prompt, turns, r, vocab):
    """A fake trajectory: prompt, then (sampled, observation) token counts per turn."""
    ids, mask = list(prompt), [0] * len(prompt)
    for sampled, obs in turns:
        ids += [r.randrange(vocab) for _ in range(sampled + obs)]
        mask += [1] * sampled + [0] * obs
    return Trajectory.of(list(prompt), ids, mask, [-r.random() if m else 0.0 for m in mask])


def fake_batch(n: int, vocab: int, seed: int = 0) -> list:
    """--procs: n distinct 192-token prompts, 64-288 sampled tokens each."""
    r = random.Random(seed)
    return [traj([r.randrange(vocab) for _ in range(192)], [(r.randint(64, 288), 0)], r, vocab) for _ in range(n)]


def group_batch(shape: str, groups: int, vocab: int, seed: int = 0) -> list:
    """Groups of trajectories sharing a prompt, shaped like `shape` (see the top)."""
    r = random.Random(seed)
    out = []
    for _ in range(groups):
        if shape == "tiny":
            prompt, G = [r.randrange(vocab) for _ in range(r.randint(45, 80))], 8
            out += [traj(prompt, [(r.randint(12, 32), 0)], r, vocab) for _ in range(G)]
        else:  # skyrl: log-normal prompt lengths (median ~150, tail to ~800), 1-3 turns
            prompt, G = [r.randrange(vocab) for _ in range(min(800, int(r.lognormvariate(5.0, 0.6))))], 5
            for _ in range(G):
                n = r.randint(1, 3)
                out.append(traj(prompt, [(r.randint(15, 60), r.randint(10, 60) if k < n - 1 else 0)
                                         for k in range(n)], r, vocab))
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
        gn.append(packed_update(model, opt, sch, batch[lo:hi], adv[lo:hi], cfg, world, device))
        times.append(time.perf_counter() - t0)
    tokens = sum(len(t.ids) for t in batch)
    res = {"world": world, "threads": torch.get_num_threads(), "tokens": tokens,
           "loss_tokens": sum(sum(t.loss_mask) for t in batch), "times": times[1:], "grad_norm": gn}
    if world > 1:  # rank 0's time is the step's: the ranks meet at every collective and start together
        distributed.close()
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


def main_procs(a):
    if a.worker:  # one rank of the torchrun case
        torch.set_num_threads(1)
        res = measure(a.worker, a.seqs, a.steps)
        if int(os.environ.get("RANK", 0)) == 0:
            print("RESULT " + json.dumps(res), flush=True)
        return
    cfg = C.load_config([os.path.join(ROOT, "configs", "tiny.yaml")])
    m = cfg.model
    d = tempfile.mkdtemp(prefix="bench_train_step_")
    tiny.build_tiny_model(Transformer, d, vocab_size=m.tiny_vocab_size, hidden_size=m.tiny_hidden_size, layers=m.tiny_layers,
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


# -----------------------------------------------------------------------------
# packed vs padded, interleaved in one process


def padded_update(model, optimizer, scheduler, trajs, adv, cfg, device) -> dict:
    """The update before packing: one right-padded row per trajectory, micro-batches of ≤
    micro_batch_tokens padded tokens, the LM head on every position (ppo_epochs = mini_batches = 1)."""
    g, T = cfg.grpo, cfg.sampling.temperature
    masks = [torch.tensor(t.loss_mask[1:], dtype=torch.float32) for t in trajs]
    norm = grpo.global_norm(masks, g.loss_agg)
    optimizer.zero_grad(set_to_none=True)
    for mb in pack([len(t.ids) for t in trajs], cfg.optim.micro_batch_tokens):
        ids = packing.pad([trajs[i].ids for i in mb], 0, device)
        mask = packing.pad([trajs[i].loss_mask for i in mb], 0, device, torch.float32)[:, 1:]
        lp, ent = token_logprobs(model, ids, T)
        inputs = grpo.LossInputs(lp, lp.detach(), None, None, mask, adv[mb].to(device)[:, None] * mask,
                                 torch.zeros_like(mask, dtype=torch.long), ent)
        loss, _ = grpo.policy_loss(inputs, norm, g, cfg.sampling.max_context)
        loss.backward()
    return {"grad_norm": optim.step_optimizer(model, optimizer, scheduler, cfg.optim)}


def packed_update(model, optimizer, scheduler, trajs, adv, cfg, world, device) -> float:
    """The update as train.grpo_step runs it (packed): train.update (old logprobs when
    needed, then per mini-batch the update and the optimizer step). Returns the last step's gradient norm."""
    per_token = [adv[i].expand(len(t.token_turns())).clone() for i, t in enumerate(trajs)]
    m = train.update(train.Run(model, None, None, optimizer, scheduler, LossScaler(cfg.optim, torch.float32), None, cfg,
                               None, 0, world, device),
                     trajs, per_token)
    return m["grad_norms"][-1]


def build(shape: dict, dtype, device):
    d = tempfile.mkdtemp(prefix="bench_train_step_")
    tiny.build_tiny_model(Transformer, d, **shape)
    model = Transformer.from_pretrained(d, dtype=dtype, device=device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sch


def main_ab(a):
    """Interleaved A/B: padded (old) then packed (new), --pairs times, median of per-pair ratios."""
    cuda = a.device == "cuda"
    device = torch.device(a.device)
    if a.row_tokens < 0:
        a.row_tokens = 0 if cuda else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = C.load_config([os.path.join(ROOT, "configs", "tiny.yaml")] + [f"--optim.micro_batch_tokens={a.mbt}"] * bool(a.mbt)
                        + [f"--optim.pack_row_tokens={a.row_tokens}"])
    m = cfg.model
    shape = SHAPES[a.shape] if a.shape else dict(
        vocab_size=m.tiny_vocab_size, hidden_size=m.tiny_hidden_size, layers=m.tiny_layers, heads=m.tiny_heads,
        kv_heads=m.tiny_kv_heads, intermediate_size=m.tiny_intermediate_size)
    model, opt, sch = build(shape, dtype, device)
    model.fp32_lm_head = cuda
    if cuda:
        model.set_activation_checkpointing(True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n_params = sum(p.numel() for p in model.parameters())
    load = os.getloadavg()
    print(f"model {n_params / 1e6:.2f}M params {dtype}, {a.device}; micro_batch_tokens "
          f"{cfg.optim.micro_batch_tokens}; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    for name in a.batches.split(","):
        trajs = group_batch(name, a.groups or (16 if name == "tiny" else 8), shape["vocab_size"])
        adv = torch.tensor([random.Random(i).choice([-1.0, 1.0]) for i in range(len(trajs))])
        mbs = packing.plan([(t.ids, t.loss_mask) for t in trajs], [len(t.prompt_ids) for t in trajs],
                           cfg.optim.micro_batch_tokens, cfg.optim.pack_row_tokens)
        padded_tok = sum(len(mb) * max(len(trajs[i].ids) for i in mb)
                         for mb in pack([len(t.ids) for t in trajs], cfg.optim.micro_batch_tokens))
        # tokens the packed forward computes: each micro-batch is (rows, longest row)
        packed_tok = sum(len(mb.rows) * max(len(r.ids) for r in mb.rows) for mb in mbs)
        print(f"{name}: {len(trajs)} trajectories, {sum(len(t.ids) for t in trajs)} tokens, padded layout "
              f"{padded_tok}, packed {packed_tok} in {len(mbs)} micro-batches of "
              f"{sum(len(mb.rows) for mb in mbs)} rows", flush=True)
        fns = {"padded": lambda: padded_update(model, opt, sch, trajs, adv, cfg, device),
               "packed": lambda: packed_update(model, opt, sch, trajs, adv, cfg, 1, device)}
        for fn in fns.values():  # warm-up (and CUDA: kernels, flex compile)
            fn()
        times = {k: [] for k in fns}
        for _ in range(a.pairs):
            for k, fn in fns.items():
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[k].append(time.perf_counter() - t0)
                if cuda:
                    peak = torch.cuda.max_memory_allocated() / 2**30
                    tok = padded_tok if k == "padded" else packed_tok
                    # MFU: 6 N per computed token (forward + backward), attention FLOPs left out
                    mfu = 6 * n_params * tok / times[k][-1] / (a.peak_tflops * 1e12)
                    print(f"  {k}: {times[k][-1]:.3f} s, peak memory {peak:.2f} GiB, MFU {mfu:.3f}", flush=True)
        ratios = [o / n for o, n in zip(times["padded"], times["packed"])]
        print(f"  padded {' '.join(f'{t:.3f}' for t in times['padded'])} s | packed "
              f"{' '.join(f'{t:.3f}' for t in times['packed'])} s | load {os.getloadavg()[0]:.2f}")
        print(f"update_speedup_shared_prompt_{name}: {statistics.median(ratios):.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5, help="interleaved padded/packed pairs")
    ap.add_argument("--batches", default="tiny,skyrl")
    ap.add_argument("--groups", type=int, default=0, help="groups per batch (default 16 tiny, 8 skyrl)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="", choices=["", *sorted(SHAPES)], help="default: configs/tiny.yaml's model")
    ap.add_argument("--mbt", type=int, default=0, help="optim.micro_batch_tokens (default: tiny.yaml's)")
    ap.add_argument("--row-tokens", type=int, default=-1,
                    help="optim.pack_row_tokens (default: 512 on CPU, 0 = one row per micro-batch on CUDA)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100 SXM)")
    ap.add_argument("--procs", action="store_true", help="1 vs 2 processes instead (see the top)")
    ap.add_argument("--seqs", type=int, default=64, help="--procs: sequences in the global batch")
    ap.add_argument("--steps", type=int, default=3, help="--procs: timed update steps per run (+1 warm-up)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.procs or a.worker:
        return main_procs(a)
    torch.set_num_threads(min(2, os.cpu_count() or 1)) if a.device == "cpu" else None
    main_ab(a)


if __name__ == "__main__":
    main()
