"""A/B of the CPU decode's kept K/V copy (engine/decode_kv.py) against a fresh gather per step.

Same setup as bench/sampler.py (~6M-param Qwen2-shaped random model, 64-token prompts, 128 new
tokens, temperature 1, EOS ignored, torch threads 2). Each pair runs, in one process and in
rotating order: transformers `generate`, our sampler as it is ("kept": DecodeKV), and our sampler
with the copy switched off for the measurement only ("gather": every step gathers every row's
blocks, the decode before DecodeKV). Printed: medians over pairs of HF/ours for both, and of
gather/kept. First it checks that both give the same tokens and logprobs, bit for bit, on a run
whose rows end at different steps (EOS on, top-p 0.9, temperature 0.7: the batch changes).

    .venv/bin/python bench/decode_kv_ab.py [--pairs 5] [--batches 16,64]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy import tiny  # noqa: E402
from config import SamplingConfig  # noqa: E402
from model import Transformer  # noqa: E402
from engine import model_runner  # noqa: E402
from rollout import generate  # noqa: E402

SHAPE = dict(vocab_size=4096, hidden_size=256, layers=6, heads=4, kv_heads=2, intermediate_size=768)


@contextmanager
def gather_every_step():
    """The runner without its kept K/V copy (DecodeRows.kv None: the gather path reads the pool)."""
    kept = model_runner.DecodeKV
    model_runner.DecodeKV = lambda cache: None
    try:
        yield
    finally:
        model_runner.DecodeKV = kept


def same_samples(model, vocab: int) -> None:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 40, (24,), generator=g)]
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=60, max_context=4096, cuda_graphs=False)
    eos = list(range(0, vocab, 97))  # ~1% of the vocabulary ends a row: rows end at different steps
    kept = generate(model, prompts, cfg, [], None, seed=3, eos=eos)
    with gather_every_step():
        gathered = generate(model, prompts, cfg, [], None, seed=3, eos=eos)
    lengths = sorted(len(t.ids) - len(p) for t, p in zip(kept, prompts))
    assert all(a.ids == b.ids and a.logprobs == b.logprobs for a, b in zip(kept, gathered)), "samples differ"
    print(f"same tokens and logprobs, bit for bit: 24 rows, new tokens {lengths[0]}..{lengths[-1]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    d = tempfile.mkdtemp(prefix="bench_decode_kv_")
    tiny.build_tiny_model(Transformer, d, **SHAPE)
    ours = Transformer.from_pretrained(d, dtype=torch.float32, device=torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    same_samples(ours, SHAPE["vocab_size"])
    cfg = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=128, max_context=4096, cuda_graphs=False)
    g = torch.Generator().manual_seed(0)
    for B in [int(x) for x in a.batches.split(",")]:
        prompts = torch.randint(0, SHAPE["vocab_size"], (B, 64), generator=g)
        plist = prompts.tolist()

        def run_hf():
            with torch.no_grad():
                hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                            top_k=0, top_p=1.0, max_new_tokens=128, min_new_tokens=128, pad_token_id=0,
                            eos_token_id=None)

        def run_kept():
            generate(ours, plist, cfg, [], None, seed=0, eos=[])

        def run_gather():
            with gather_every_step():
                generate(ours, plist, cfg, [], None, seed=0, eos=[])

        runs = {"hf": run_hf, "kept": run_kept, "gather": run_gather}
        for f in runs.values():  # warm-up
            f()
        times = {k: [] for k in runs}
        order = list(runs)
        for i in range(a.pairs):
            for k in order[i % 3:] + order[:i % 3]:  # rotate who goes first
                t = time.perf_counter()
                runs[k]()
                times[k].append(time.perf_counter() - t)
        ratio = lambda x, y: statistics.median(a / b for a, b in zip(times[x], times[y]))  # noqa: E731
        print(f"B={B:3d}  hf/kept {ratio('hf', 'kept'):.2f}x  hf/gather {ratio('hf', 'gather'):.2f}x  "
              f"gather/kept {ratio('gather', 'kept'):.2f}x  (median over {a.pairs} rotations; "
              f"seconds kept {', '.join(f'{t:.1f}' for t in times['kept'])}; "
              f"gather {', '.join(f'{t:.1f}' for t in times['gather'])}; hf {', '.join(f'{t:.1f}' for t in times['hf'])})")


if __name__ == "__main__":
    main()
