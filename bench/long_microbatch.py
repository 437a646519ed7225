"""One long micro-batch through a real-shaped model: forward + backward, peak memory, time, MFU.

The SkyRL-SQL recipe trains Qwen2.5-Coder-7B on micro-batches of up to 32k tokens per GPU with
activation checkpointing. This builds that shape with random bf16 weights (nothing downloaded),
runs model.py's training forward (per-token logprobs, as the update does) and a backward over one
packed row of `--tokens` tokens, and prints the time and peak memory of each iteration. Weights
and gradients here are bf16 and unsharded: under the trainer's FSDP2 (fp32 masters, sharded
optimizer) the parameter-side memory differs, the activation side is this.

MFU counts 6·N·T for the matmuls plus 6·L·d·T² for causal attention (forward QKᵀ and PV, half the
T² positions, ×3 for the backward); the recompute of activation checkpointing is not counted, so
this is the useful-work MFU.

    python bench/long_microbatch.py                            # CUDA: 7B shape, 32768 tokens
    python bench/long_microbatch.py --device cpu --shape tiny --tokens 256   # a smoke run anywhere
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import ModelArgs, Transformer  # noqa: E402

SHAPES = {  # HF config.json fields of the real checkpoints (random weights here)
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_word_embeddings=False),
    "tiny": dict(model_type="qwen2", vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                 tie_word_embeddings=True),
}
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, spec sheets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=2, help="the first includes kernel selection")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    model_args = ModelArgs.from_hf(SHAPES[args.shape])
    with torch.device("meta"):
        model = Transformer(model_args)
    model = model.to_empty(device=device).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.set_activation_checkpointing(True)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    cuda = device.type == "cuda"
    peak_flops = next((v for k, v in PEAK_BF16_FLOPS.items() if cuda and k in torch.cuda.get_device_name()), 0.0)
    print(f"{args.shape}: {n_params / 1e9:.2f}B params, bf16, {args.tokens} tokens, activation checkpointing, "
          f"{torch.cuda.get_device_name() if cuda else 'cpu'}")

    ids = torch.randint(0, model_args.vocab_size, (1, args.tokens + 1), device=device)
    a = model_args
    flops = 6 * n_params * args.tokens + 6 * a.num_hidden_layers * a.num_attention_heads * a.head_dim * args.tokens ** 2
    for it in range(args.iters):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        start = time.perf_counter()
        logprobs, _entropy = model(ids[:, :-1], targets=ids[:, 1:], temperature=1.0)
        (-logprobs.mean()).backward()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan")
        mfu = flops / seconds / peak_flops if peak_flops else float("nan")
        print(f"iter {it}: {seconds:.2f} s  peak {peak:.1f} GiB  MFU {mfu:.1%}")
        for p in model.parameters():
            p.grad = None
    print(f"long_microbatch_seconds: {seconds:.2f}")
    print(f"long_microbatch_peak_gib: {peak:.1f}")
    print(f"long_microbatch_mfu: {mfu:.3f}")


if __name__ == "__main__":
    main()
