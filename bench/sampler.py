"""Our sampler (rollout.generate) vs transformers `generate` on the same random model.

~6M-param Qwen2-shaped model, 64-token prompts, 128 new tokens, temperature 1 (no top-k/top-p),
EOS ignored, batch 16 and 64, torch threads 2. Each pair runs both back to back in one process;
the ratio printed is the median over pairs of (HF time / our time).

    .venv/bin/python bench/sampler.py [--pairs 3] [--batches 16,64]
    python bench/sampler.py --device cuda --shape qwen2.5-0.5b --batches 64 [--cuda-graphs]   # GPU, bf16

With --device cuda (or --hbm-gbps) it also prints our decode throughput as a fraction of the
memory-bandwidth roofline: each decode step must read every weight once plus each row's K/V, so
tokens/s <= B * bandwidth / (weight bytes + mean K/V bytes per step). Prefill time is included in
the measured figure, so the fraction is a slight underestimate.
Also printed: the same ratio for a "sampler" that runs only the unavoidable kernels (the real
prefill, then per step each layer's GEMMs and attention, and the LM head): the ceiling of what
removing all other work (norms, RoPE, cache writes, sampling, Python) could reach.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy import tiny  # noqa: E402
from config import SamplingConfig  # noqa: E402
from model import Transformer  # noqa: E402
from engine.paged_attention import PagedBatch, PagedKVCache  # noqa: E402
from rollout import generate  # noqa: E402

SHAPES = {
    "bench6m": dict(vocab_size=4096, hidden_size=256, layers=6, heads=4, kv_heads=2, intermediate_size=768),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864),
}
HBM_GBPS = {"H100 PCIe": 2000, "H100": 3350, "H200": 4800, "A100-SXM4-80GB": 2039, "A100": 1555}  # spec sheets


def hbm_gbps(device) -> float:
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in HBM_GBPS.items() if k in name), 0.0)


def roofline_tok_s(model, B: int, prompt: int, new: int, gbps: float) -> float:
    """Decode tokens/s if each step only streamed the weights and the rows' K/V at `gbps`."""
    a = model.config
    elem = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters()) * elem  # a tied matrix is counted once
    kv_per_tok = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * elem
    mean_len = prompt + (new + 1) / 2  # cache length averaged over the decode steps
    return B * gbps * 1e9 / (weights + B * mean_len * kv_per_tok)


@torch.no_grad()
def kernels_only(model, prompts: torch.Tensor, new: int) -> None:
    """A lower bound on any sampler built from these kernels: our prefill of `prompts`, then `new`
    decode steps that run only each layer's GEMMs (qkv, o, gate-up, down), its attention over the
    real cache length, and the LM head. No norms, RoPE, residuals, cache writes or sampling."""
    B, P = prompts.shape
    a, w = model.config, model.embed_tokens.weight
    pool = PagedKVCache.for_model(model, -(-B * P // 16), 16, w.dtype)  # the prefill's compute, K/V writes included
    model.forward_paged(prompts, torch.arange(P, device=w.device).expand(B, P),
                        PagedBatch(pool, torch.arange(B * P, device=w.device).view(B, P), None),
                        logits_at=torch.full((B,), P - 1, device=w.device))
    H, Hk, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    ck = torch.zeros(a.num_hidden_layers, B, Hk, P + new, D, dtype=w.dtype, device=w.device)  # contiguous K/V
    x = torch.randn(B, 1, a.hidden_size, dtype=w.dtype, device=w.device)
    q = torch.randn(B, H, 1, D, dtype=w.dtype, device=w.device)
    for step in range(new):
        S = P + step + 1
        mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device=w.device)  # the sampler needs one (ragged rows)
        for i, layer in enumerate(model.layers):
            at = layer.self_attn
            at.qkv_proj(x)
            y = F.scaled_dot_product_attention(q, ck[i][:, :, :S], ck[i][:, :, :S], attn_mask=mask,
                                               enable_gqa=True)
            at.o_proj(y.transpose(1, 2).reshape(B, 1, H * D))
            layer.mlp.down_proj(layer.mlp.gate_up_proj(x)[..., :a.intermediate_size])
        model.lm_head(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="bench6m", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="", help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--cuda-graphs", action="store_true", help="sampling.cuda_graphs (CUDA only)")
    ap.add_argument("--hbm-gbps", type=float, default=0.0, help="memory bandwidth for the roofline "
                    "(default: the spec sheet of a known CUDA device; none on CPU)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    shape = SHAPES[a.shape]
    d = tempfile.mkdtemp(prefix="bench_sampler_")
    tiny.build_tiny_model(Transformer, d, **shape)
    ours = Transformer.from_pretrained(d, dtype=dtype, device=dev)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(dev).eval()
    gbps = a.hbm_gbps or (hbm_gbps(dev) if dev.type == "cuda" else 0.0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n_params = sum(p.numel() for p in ours.parameters())
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu, threads {a.threads}"
    print(f"model {a.shape} {shape} = {n_params / 1e6:.1f}M params, {dtype}; prompt {a.prompt}, new {a.new}; {where}"
          f"{'; CUDA graphs' if a.cuda_graphs else ''}")
    cfg = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=a.new, max_context=4096,
                         cuda_graphs=a.cuda_graphs)
    g = torch.Generator().manual_seed(0)
    speedups = {}
    for B in [int(x) for x in a.batches.split(",")]:
        prompts = torch.randint(0, shape["vocab_size"], (B, a.prompt), generator=g)
        plist, prompts = prompts.tolist(), prompts.to(dev)

        def run_hf():
            with torch.no_grad():
                out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=a.new,
                                  min_new_tokens=a.new, pad_token_id=0, eos_token_id=None)
            assert out.shape == (B, a.prompt + a.new)
            sync()

        def run_ours():
            out = generate(ours, plist, cfg, [], None, seed=0, eos=[])
            assert all(len(t.ids) == a.prompt + a.new for t in out)
            sync()

        def run_floor():
            kernels_only(ours, prompts, a.new)
            sync()

        run_hf(), run_ours(), run_floor()  # warm-up
        ratios, floors, th, to = [], [], [], []
        for _ in range(a.pairs):
            t0 = time.perf_counter()
            run_hf()
            t1 = time.perf_counter()
            run_ours()
            t2 = time.perf_counter()
            run_floor()
            t3 = time.perf_counter()
            th.append(t1 - t0), to.append(t2 - t1), ratios.append((t1 - t0) / (t2 - t1))
            floors.append((t1 - t0) / (t3 - t2))
        toks = B * a.new
        speedups[B] = statistics.median(ratios)
        ours_tok_s = toks / statistics.median(to)
        print(f"B={B:3d}  hf generate {toks / statistics.median(th):7.0f} tok/s   ours {ours_tok_s:7.0f} "
              f"tok/s   speedup {speedups[B]:.2f}x  (pairs: {', '.join(f'{r:.2f}' for r in ratios)})")
        print(f"B={B:3d}  kernels only (prefill + GEMMs + attention, nothing else): {statistics.median(floors):.2f}x "
              f"HF generate (pairs: {', '.join(f'{r:.2f}' for r in floors)})")
        if gbps:
            roof = roofline_tok_s(ours, B, a.prompt, a.new, gbps)
            print(f"B={B:3d}  roofline at {gbps:.0f} GB/s: {roof:.0f} tok/s; ours reaches {ours_tok_s / roof:.1%}")
    for B, s in speedups.items():
        print(f"speedup_vs_hf_generate_b{B}: {s:.2f}")


if __name__ == "__main__":
    main()
