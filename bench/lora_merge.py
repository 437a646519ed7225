"""Rollouts with LoRA: merged weights vs the adapter forward, same sampler, same model.

A random model of bench/sampler.py's shapes with LoRA (default rank 32 on all seven
projections, SkyRL's recipe) samples B rows of `--new` tokens after a `--prompt`-token prompt
with rollout.generate (EOS ignored). "adapter": every projection adds its dropout(x) A^T B^T
per part (2 extra small matmuls per part); "merged": what training runs, the weight sync
(PolicySampler.refresh: the adapters folded into the sampler's plain copy, its cost inside the
timing) then sampling on that copy. Each pair runs both
back to back in one process; printed: the median over pairs of (adapter time / merged time),
last as `lora_merged_speedup_b<largest B>: x`.

    .venv/bin/python bench/lora_merge.py [--pairs 5] [--batches 16,64] [--rank 32]
    python bench/lora_merge.py --device cuda --shape qwen2.5-0.5b --batches 64,256    # GPU, bf16

On CUDA the adapters are cast to the compute dtype first, as FSDP2's mixed precision does.
"""
import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer import lora  # noqa: E402
from toy import tiny  # noqa: E402
from bench.sampler import SHAPES  # noqa: E402
from config import ModelConfig, SamplingConfig  # noqa: E402
from model import Transformer  # noqa: E402
from trainer.policy_sampler import PolicySampler  # noqa: E402
from rollout import generate  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--targets", default="q,k,v,o,gate,up,down")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="bench6m", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    d = tempfile.mkdtemp()
    tiny.build_tiny_model(Transformer, d, **SHAPES[args.shape])
    model = Transformer.from_pretrained(d, dtype=dtype, device=dev)
    lora.apply(model, ModelConfig(lora_rank=args.rank, lora_alpha=2.0 * args.rank, lora_targets=args.targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.01)
            if ".lora_" in n:
                p.data = p.data.to(dtype)  # FSDP2 mixed precision hands the forward bf16 adapters
    cfg = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=args.new, max_context=args.prompt + args.new + 8)
    # the sampler's own pool is unused here (generate builds one per call, for both arms): one sequence's worth
    sampler = PolicySampler(model, dataclasses.replace(cfg, kv_budget_tokens=cfg.max_context), dtype=dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"shape {args.shape}, {dtype}, LoRA rank {args.rank} on {args.targets}, device {dev}, "
          f"threads {args.threads}, load {os.getloadavg()[0]:.2f}", flush=True)
    headline = {}
    for B in [int(b) for b in args.batches.split(",")]:
        g = torch.Generator().manual_seed(B)
        prompts = torch.randint(0, model.config.vocab_size, (B, args.prompt), generator=g).tolist()

        def run_adapter():
            return generate(model, prompts, cfg, [], None, seed=0, eos=[])

        def run_merged():
            sampler.refresh(model)
            return generate(sampler.model, prompts, cfg, [], None, seed=0, eos=[])

        run_adapter(), run_merged()  # warm-up
        ratios, ta, tm, agree = [], [], [], []
        for _ in range(args.pairs):
            times = {}
            for name, fn in (("adapter", run_adapter), ("merged", run_merged)):
                sync()
                t0 = time.perf_counter()
                out = fn()
                sync()
                times[name] = (time.perf_counter() - t0, out)
            ta.append(times["adapter"][0])
            tm.append(times["merged"][0])
            ratios.append(times["adapter"][0] / times["merged"][0])
            a, m = times["adapter"][1], times["merged"][1]
            agree.append(statistics.mean(x.ids == y.ids for x, y in zip(a, m)))
        tok = B * args.new
        print(f"B={B}: adapter {tok / statistics.median(ta):.0f} tok/s, merged {tok / statistics.median(tm):.0f} tok/s, "
              f"adapter/merged time {statistics.median(ratios):.2f}x (pairs: {', '.join(f'{r:.2f}' for r in ratios)}; "
              f"rows identical {statistics.mean(agree):.0%}), load {os.getloadavg()[0]:.2f}", flush=True)
        headline[B] = statistics.median(ratios)
    B = max(headline)
    print(f"lora_merged_speedup_b{B}: {headline[B]:.2f}")  # adapter time / merged time


if __name__ == "__main__":
    main()
