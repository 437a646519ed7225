"""Decode through PolicySampler, the path train.py samples on: tokens/s and % of the HBM roofline.

    python bench/policy_decode.py --device cuda --shape qwen2.5-0.5b --batches 64,256   # GPU, bf16
    python bench/policy_decode.py --smoke                                                # CPU check of this script

A random model of the shape (fp32, as the trainer holds it) is copied into a PolicySampler
(sampler.refresh: timed, it is the per-step weight sync), then each batch of B random prompts of
--prompt tokens samples --new tokens per row (EOS and stop strings off, so every row decodes all
of them) on the sampler's engine: the same pool, runner and CUDA graphs for every rollout of the
run. The first rollout of each (batch, path) captures the graphs and compiles FlexAttention; the
timed ones after it only replay (medians over --repeats).

Roofline: a decode step must read every weight once plus each row's K/V so far, so
tokens/s <= B * bandwidth / (weight bytes + B * mean context * K/V bytes per token). The bandwidth
is measured here (a device-to-device copy: bytes read + written per second) and the spec sheet's
is printed beside it. Decode time counts only the decode windows (prefill apart).
Headlines: decode_tok_s_b{B}_{path}, decode_roofline_pct_b{B}_{path}, refresh_ms.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from config import SamplingConfig  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from trainer.policy_sampler import PolicySampler  # noqa: E402
from engine.sampling import StopChecker, row_key  # noqa: E402
from engine.scheduler import Sequence  # noqa: E402

SHAPES = {  # the trained model's body; head_dim = hidden / heads, tied embeddings as Qwen2.5-0.5B
    "smoke": dict(vocab_size=512, hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, layers=28, heads=12, kv_heads=2, intermediate_size=8960),
}
SPEC_GBPS = {"H100 PCIe": 2000, "H100": 3350, "H200": 4800, "A100-SXM4-80GB": 2039, "A100": 1555}


def random_model(shape: dict, device) -> Transformer:
    """A Qwen2-shaped Transformer with N(0, 0.02) weights, built on the device (no folder)."""
    h, heads = shape["hidden_size"], shape["heads"]
    args = ModelArgs.from_hf({"model_type": "qwen2", "vocab_size": shape["vocab_size"], "hidden_size": h,
                              "intermediate_size": shape["intermediate_size"], "num_hidden_layers": shape["layers"],
                              "num_attention_heads": heads, "num_key_value_heads": shape["kv_heads"],
                              "head_dim": h // heads, "tie_word_embeddings": True, "rope_theta": 1e6,
                              "use_sliding_window": False})
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device)
    model.lm_head.weight = model.embed_tokens.weight  # to_empty unties
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=g)
    return model.eval()  # no buffers: RoPE frequencies are computed per device on first use


def copy_gbps(device) -> float:
    """Measured device memory bandwidth: a 1 GiB device-to-device copy, (read + write) bytes / s."""
    if device.type != "cuda":
        return 0.0
    src = torch.empty(1 << 29, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times) / 1e9


def roofline_tok_s(model, B: int, prompt: int, new: int, gbps: float, elem: int) -> float:
    a = model.config
    weights = sum(p.numel() for p in model.parameters()) * elem  # a tied matrix counted once
    kv_per_tok = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * elem
    mean_context = prompt + (new + 1) / 2
    return B * gbps * 1e9 / (weights + B * mean_context * kv_per_tok)


def sample_once(sampler: PolicySampler, prompts: list[list[int]], cfg: SamplingConfig, seed: int) -> dict:
    """One rollout of the prompts on the sampler's kept engine; prefill and decode windows timed apart."""
    engine = sampler.engine
    stopper = StopChecker(None, [], [], sampler.model.config.vocab_size)  # no EOS, no stop strings
    engine.reset(stopper, worst_case=[len(p) + cfg.max_new_tokens for p in prompts], greedy=False, cfg=cfg)
    seqs = [Sequence(list(p), key=row_key(seed, i), index=i) for i, p in enumerate(prompts)]
    engine.add(seqs)
    t_prefill = t_decode = 0.0
    while engine.busy():
        decode_steps = engine.stats["decode_steps"]
        t0 = time.perf_counter()
        ended = engine.step()  # every step ends in a host read of its samples: the clock is honest
        dt = time.perf_counter() - t0
        if engine.stats["decode_steps"] > decode_steps:
            t_decode += dt
        else:
            t_prefill += dt
        for s in ended:
            engine.finish(s)
    new = [len(s.ids) - len(p) for s, p in zip(seqs, prompts)]
    assert all(n == cfg.max_new_tokens for n in new), f"rows sampled {min(new)}..{max(new)} tokens, not all {cfg.max_new_tokens}"
    logps = torch.tensor([lp for s in seqs for lp in s.logprobs[-cfg.max_new_tokens:]])
    assert torch.isfinite(logps).all() and (logps <= 0).all(), "sampled logprobs must be finite and <= 0"
    return {"prefill_s": t_prefill, "decode_s": t_decode, "decode_tokens": sum(new) - len(seqs),
            "evictions": engine.evictions}


def profile(sampler: PolicySampler, prompts, cfg: SamplingConfig, new: int) -> None:
    """One rollout under torch.profiler: where a decode step's time goes (device kernels against
    host-side op dispatch) and how many kernels each step launches outside the graph replay."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        sample_once(sampler, prompts, cfg, seed=99)
    events = prof.key_averages()
    device_sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(events.table(sort_by=device_sort, row_limit=20, max_name_column_width=60), flush=True)
    print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60), flush=True)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    replays = sum(e.count for e in events if e.key in ("cudaGraphLaunch",))
    steps = max(new - 1, 1)
    print(f"profile: {launches} kernel launches and {replays} graph replays in {steps} decode steps + prefill "
          f"({launches / steps:.1f} launches per step)", flush=True)
    print(f"launches_per_decode_step: {launches / steps:.1f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--paths", default="flex,gather", help="sampling.paged_attention values to compare")
    ap.add_argument("--prompt", type=int, default=768)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-graphs", action="store_true", help="sampling.cuda_graphs off")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, short: checks this script runs")
    ap.add_argument("--profile", action="store_true", help="after the timing, one rollout under torch.profiler: "
                    "the top ops by device and by host time, and kernel launches per decode step")
    a = ap.parse_args()
    if a.smoke:
        a.shape, a.device, a.batches, a.paths, a.prompt, a.new, a.repeats = "smoke", "cpu", "4", "gather", 24, 8, 1
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES[a.shape]
    model = random_model(shape, device).float()  # the trainer's fp32 copy; the sampler holds `dtype`
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = next((v for k, v in SPEC_GBPS.items() if k in name), 0.0) if device.type == "cuda" else 0.0
    measured = copy_gbps(device)
    print(f"{name}; torch {torch.__version__}; shape {a.shape} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
          f"params), {dtype}; prompt {a.prompt}, new {a.new}; bandwidth measured {measured:.0f} GB/s, spec {spec:.0f}")
    g = torch.Generator().manual_seed(0)
    elem = torch.finfo(dtype).bits // 8
    heads = []
    for path in a.paths.split(","):
        for B in [int(x) for x in a.batches.split(",")]:
            cfg = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=a.new, max_context=a.prompt + a.new,
                                 kv_budget_tokens=B * (a.prompt + a.new) + 64 * 16, cuda_graphs=not a.no_graphs,
                                 paged_attention=path)
            sampler = PolicySampler(model, cfg, dtype=dtype)
            refresh_s = []
            for _ in range(3):
                t0 = time.perf_counter()
                sampler.refresh(model)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                refresh_s.append(time.perf_counter() - t0)
            prompts = torch.randint(0, shape["vocab_size"], (B, a.prompt), generator=g).tolist()
            t0 = time.perf_counter()
            sample_once(sampler, prompts, cfg, seed=0)  # graphs captured, flex compiled
            first_s = time.perf_counter() - t0
            runs = [sample_once(sampler, prompts, cfg, seed=1 + r) for r in range(a.repeats)]
            decode_s = statistics.median(r["decode_s"] for r in runs)
            prefill_s = statistics.median(r["prefill_s"] for r in runs)
            tok_s = runs[0]["decode_tokens"] / decode_s
            graphs = sampler.engine.runner.graphs
            n_graphs = len(graphs.graphs) if graphs is not None else 0
            line = (f"{path:6s} B={B:3d}: decode {tok_s:8.0f} tok/s ({decode_s * 1e3 / (a.new - 1):.2f} ms/step), "
                    f"prefill {B * a.prompt / prefill_s:8.0f} tok/s, first rollout {first_s:.1f} s (capture + compile), "
                    f"{n_graphs} graphs, attention {sampler.engine.cache.attention}, refresh {1e3 * statistics.median(refresh_s):.1f} ms")
            for gbps, label in ((measured, "measured"), (spec, "spec")):
                if gbps:
                    roof = roofline_tok_s(model, B, a.prompt, a.new, gbps, elem)
                    line += f"; {100 * tok_s / roof:.1f}% of the {label} roofline ({roof:.0f} tok/s)"
            print(line, flush=True)
            heads.append(f"decode_tok_s_b{B}_{path}: {tok_s:.0f}")
            if measured:
                heads.append(f"decode_roofline_pct_b{B}_{path}: "
                             f"{100 * tok_s / roofline_tok_s(model, B, a.prompt, a.new, measured, elem):.1f}")
            heads.append(f"refresh_ms: {1e3 * statistics.median(refresh_s):.1f}")
            if a.profile:
                profile(sampler, prompts, cfg, a.new)
            del sampler
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print("\n".join(dict.fromkeys(heads)))


if __name__ == "__main__":
    main()
