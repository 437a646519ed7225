"""bench/update_mfu.py's FLOP counting against hand counts (the kept attention pairs of a packed
row, the non-embedding parameters, the useful and hardware FLOPs of a micro-batch), the pair
count against the dense mask (bench/padded.py) on random packings, and a tiny CPU run of the benchmark.

    .venv/bin/python -m pytest -q tests/test_update_mfu.py
"""
import os
import random
import subprocess
import sys

import torch

from trainer import packing
from model import ModelArgs, Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import padded  # noqa: E402  (bench/padded.py: the dense mask reference)
import update_mfu  # noqa: E402

ARGS = ModelArgs(model_type="qwen2", vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, qkv_bias=True)


def hand_micro_batch():
    """One row: [prompt 3 | response 2 | response 1] of one unit, then a 4-token single sequence."""
    prompt = [5, 6, 7]
    seqs = [(prompt + [8, 9], [0, 0, 0, 1, 1]), (prompt + [10], [0, 0, 0, 1]), ([11, 12, 13, 14], [0, 1, 1, 1])]
    (mb,) = packing.plan(seqs, [3, 3, 0], 16)
    assert len(mb.rows) == 1 and mb.rows[0].seg == [0, 0, 0, 1, 1, 2, 0, 0, 0, 0]
    return mb


def test_kept_pairs_hand_count():
    # prompt 1 + 2 + 3 = 6; response 1: (3 + 1) + (3 + 2) = 9; response 2: 3 + 1 = 4;
    # the single sequence 1 + 2 + 3 + 4 = 10; the 2 padding tokens count nothing: 29
    mb = hand_micro_batch()
    doc = packing.pad([mb.rows[0].doc], -1, "cpu", width=12)
    seg = packing.pad([mb.rows[0].seg], 0, "cpu", width=12)
    assert update_mfu.kept_pairs(doc, seg) == 29


def test_kept_pairs_equal_the_dense_mask_on_random_packings():
    rng = random.Random(0)
    for _ in range(10):
        seqs, prompt_lens = [], []
        for _ in range(rng.randint(1, 5)):
            P = rng.choice([0, rng.randint(1, 30)])
            prompt = [rng.randrange(50) for _ in range(P)]
            for _ in range(rng.choice([1, rng.randint(2, 6)])):
                n = rng.randint(1, 40)
                seqs.append((prompt + [rng.randrange(50) for _ in range(n)], [0] * P + [1] * n))
                prompt_lens.append(P)
        mb = packing.plan(seqs, prompt_lens, 400, rng.choice([0, 120]))[0]
        width = max(len(r.ids) for r in mb.rows) + rng.randint(0, 9)
        doc = packing.pad([r.doc for r in mb.rows], -1, "cpu", width=width)
        seg = packing.pad([r.seg for r in mb.rows], 0, "cpu", width=width)
        dense = padded.dense_mask(doc, seg)[:, 0] & (doc >= 0)[:, :, None]  # padding queries left out
        assert update_mfu.kept_pairs(doc, seg) == int(dense.sum())


def test_flops_hand_count():
    # per block: qkv 32 x (4 + 2 + 2) x 8 = 2048 + bias 64, o 32 x 32 = 1024, gate_up 32 x 96 = 3072,
    # down 48 x 32 = 1536, two norms 64: 7808; two blocks + the final norm: 15648
    model = Transformer(ARGS)
    assert update_mfu.non_embedding_params(model) == 15648
    mb = hand_micro_batch()
    assert sum(mb.counts) == 6  # loss tokens: 2 + 1 + 3
    # useful: 6 x (N tokens + 2 L H D pairs + C V loss tokens) = 6 x (15648 x 10 + 128 x 29 + 32 x 97 x 6)
    useful = 6 * (156480 + 3712 + 18624)
    # hardware: 8 x (...) over the kernel's pairs and the padded width
    # CPU segment rows: [prompt | response 1] (5), [prompt | response 2] (4), the lone sequence (4);
    # buckets [5] and [4, 4]: 15 + 2 x 10 pairs
    cases = {("segments", 10): 8 * (156480 + 128 * 35 + 18624),
             ("causal", 10): 8 * (156480 + 128 * 55 + 18624),  # T (T + 1) / 2
             ("flex", 128): 8 * (15648 * 128 + 128 * 128 * 128 + 18624)}  # one 128 x 128 block, 128 tokens
    for (kernel, width), hardware in cases.items():
        c = update_mfu.microbatch_flops(ARGS, 15648, mb, width, kernel)
        assert c["useful"] == useful == 1072896, kernel
        assert c["hardware"] == hardware, kernel
        assert (c["tokens"], c["loss_tokens"], c["pairs"]) == (10, 6, 29)


def test_bench_runs_on_cpu():
    cmd = [sys.executable, os.path.join(ROOT, "bench", "update_mfu.py"), "--device", "cpu", "--tokens", "128",
           "--prompt", "16", "--group", "3", "--response", "12", "--micro-batches", "2", "--iters", "1",
           "--compare", "--peak-tflops", "0.001", "--threads", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    lines = dict(x.split(": ", 1) for x in p.stdout.splitlines() if x.startswith("update_"))
    assert float(lines["update_mfu"]) > 0 and float(lines["update_tflops"]) > 0
    assert float(lines["update_hw_mfu"]) > float(lines["update_mfu"])  # the recompute and the T^2 mask
    assert p.stdout.splitlines()[-1].startswith("update_mfu: ")
