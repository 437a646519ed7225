"""Decode through PolicySampler, the path train.py samples on: tokens/s and % of the HBM roofline.

    python bench/policy_decode.py --device cuda --shapes qwen2.5-0.5b,qwen2.5-7b --batches 64,256   # GPU, bf16
    python bench/policy_decode.py --smoke                                                            # CPU check

A random model of each shape (the trainer's copy: fp32 as the trainer holds it, bf16 for 7B to
spare 15 GB) is copied into a PolicySampler (sampler.refresh: timed, it is the per-step weight
sync; the first one also compiles the decode step), then each batch of B random prompts of
--prompt tokens samples --new tokens per row (EOS and stop strings off, temperature 1 and no top-p:
random weights give flat distributions, whose top-p nuclei would all go to the host sampler) on
the sampler's engine. Arms (--arms): `graphs` (the default config: the whole decode step captured
in one CUDA graph per bucket), `compiled` (sampling.compile_decode: the step compiled by inductor
first). The first rollout of each (batch, arm) captures its buckets; the timed
ones after it only replay (medians over --repeats).

Roofline: a decode step must read every weight once plus each row's K/V so far, so
tokens/s <= B * bandwidth / (weight bytes + B * mean context * K/V bytes per token). The bandwidth
is measured here (a device-to-device copy: bytes read + written per second) and the spec sheet's
is printed beside it. Decode time counts only the decode windows (prefill apart).
--profile: for the largest batch of each shape, one rollout under torch.profiler: wall time per
decode step against the device's busy time, kernels per step, host launches per step.
Headlines: decode_roofline_pct_{0.5b,7b}_b{B} (the default config's arm; others get _ARM),
decode_tok_s_..., refresh_ms_...
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

SHAPES = {  # the trained model's body; head_dim = hidden / heads; Qwen2.5 ties embeddings below 7B
    "smoke": dict(vocab_size=512, hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128, tie=True),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864,
                         tie=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, layers=28, heads=12, kv_heads=2, intermediate_size=8960,
                         tie=True),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, layers=28, heads=28, kv_heads=4, intermediate_size=18944,
                       tie=False),
}
SHORT = {"qwen2.5-0.5b": "0.5b", "qwen2.5-1.5b": "1.5b", "qwen2.5-7b": "7b", "smoke": "smoke"}
SPEC_GBPS = {"H100 PCIe": 2000, "H100": 3350, "H200": 4800, "A100-SXM4-80GB": 2039, "A100": 1555}


def random_model(shape: dict, device, dtype=torch.float32) -> Transformer:
    """A Qwen2-shaped Transformer with N(0, 0.02) weights in dtype, built on the device (no folder)."""
    h, heads = shape["hidden_size"], shape["heads"]
    args = ModelArgs.from_hf({"model_type": "qwen2", "vocab_size": shape["vocab_size"], "hidden_size": h,
                              "intermediate_size": shape["intermediate_size"], "num_hidden_layers": shape["layers"],
                              "num_attention_heads": heads, "num_key_value_heads": shape["kv_heads"],
                              "head_dim": h // heads, "tie_word_embeddings": shape["tie"], "rope_theta": 1e6,
                              "use_sliding_window": False})
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device).to(dtype)
    if shape["tie"]:
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


def profile(sampler: PolicySampler, prompts, cfg: SamplingConfig, new: int, label: str) -> None:
    """One rollout under torch.profiler: wall time per decode step against the device's busy time,
    kernels run per step (inside graph replays or not) and host launches per step."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        run = sample_once(sampler, prompts, cfg, seed=99)
    events = prof.key_averages()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=15, max_name_column_width=60), flush=True)
    steps = max(new - 1, 1)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    replays = sum(e.count for e in events if e.key == "cudaGraphLaunch")
    busy_ms = sum(e.self_device_time_total for e in events) / 1e3  # kernel time, prefill included
    device = getattr(torch.autograd.DeviceType, "CUDA", None)
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) == device] if cuda else []
    wall_ms = 1e3 * (run["decode_s"] + run["prefill_s"])
    print(f"profile {label}: wall {1e3 * run['decode_s'] / steps:.2f} ms per decode step; device busy "
          f"{busy_ms / steps:.2f} ms per step ({100 * busy_ms / max(wall_ms, 1e-9):.0f}% of the rollout's wall time, "
          f"prefill included); {len(kernels) / steps:.0f} kernels, {replays / steps:.2f} graph replays and "
          f"{launches / steps:.1f} host kernel launches per decode step", flush=True)
    print(f"kernels_per_decode_step_{label}: {len(kernels) / steps:.0f}")
    print(f"launches_per_decode_step_{label}: {launches / steps:.1f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen2.5-0.5b", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--shape", default="", help="one shape (same as --shapes)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--arms", default="graphs,compiled", help="graphs (the step in CUDA graphs: the default config), "
                    "compiled (sampling.compile_decode: compiled first), eager (no graphs)")
    ap.add_argument("--paths", default="auto", help="sampling.paged_attention values")
    ap.add_argument("--prompt", type=int, default=768)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, short: checks this script runs")
    ap.add_argument("--profile", action="store_true", help="after the timing of each shape's largest batch, one "
                    "rollout under torch.profiler (first arm)")
    a = ap.parse_args()
    shapes = (a.shape or a.shapes).split(",")
    if a.smoke:
        shapes, a.device, a.batches, a.prompt, a.new, a.repeats = ["smoke"], "cpu", "4", 24, 8, 1
        a.arms, a.paths = "eager", "gather"
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = next((v for k, v in SPEC_GBPS.items() if k in name), 0.0) if device.type == "cuda" else 0.0
    measured = copy_gbps(device)
    print(f"{name}; torch {torch.__version__}; {dtype}; prompt {a.prompt}, new {a.new}; bandwidth measured "
          f"{measured:.0f} GB/s, spec {spec:.0f}", flush=True)
    batches = [int(x) for x in a.batches.split(",")]
    arms = a.arms.split(",")
    heads = []
    for shape_name in shapes:
        shape, short = SHAPES[shape_name], SHORT[shape_name]
        big = shape["hidden_size"] >= 3000
        model = random_model(shape, device, dtype if big else torch.float32)  # the trainer's copy
        print(f"shape {shape_name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, trainer copy "
              f"{next(model.parameters()).dtype}", flush=True)
        g = torch.Generator().manual_seed(0)
        elem = torch.finfo(dtype).bits // 8
        for path in a.paths.split(","):
            for B in batches:
                prompts = torch.randint(0, shape["vocab_size"], (B, a.prompt), generator=g).tolist()
                for arm in arms:
                    cfg = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=a.new, max_context=a.prompt + a.new,
                                         kv_budget_tokens=B * (a.prompt + a.new) + 64 * 16,
                                         cuda_graphs=arm != "eager", compile_decode=arm == "compiled",
                                         paged_attention=path)
                    t0 = time.perf_counter()
                    sampler = PolicySampler(model, cfg, dtype=dtype)
                    refresh_s = []
                    for _ in range(3):  # the first also compiles the step (or loads it from the disk cache)
                        t0 = time.perf_counter()
                        sampler.refresh(model)
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        refresh_s.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    sample_once(sampler, prompts, cfg, seed=0)  # this batch's buckets captured
                    first_s = time.perf_counter() - t0
                    runs = [sample_once(sampler, prompts, cfg, seed=1 + r) for r in range(a.repeats)]
                    decode_s = statistics.median(r["decode_s"] for r in runs)
                    prefill_s = statistics.median(r["prefill_s"] for r in runs)
                    tok_s = runs[0]["decode_tokens"] / decode_s
                    graphs = sampler.engine.runner.graphs
                    compiled = graphs is not None and graphs.compiled
                    line = (f"{short} {arm:8s} B={B:3d}: decode {tok_s:8.0f} tok/s ({decode_s * 1e3 / (a.new - 1):.2f} "
                            f"ms/step), prefill {B * a.prompt / prefill_s:8.0f} tok/s, warm-up {sampler.warm_up_s:.1f} s"
                            f"{' (compiled)' if compiled else ''}, first rollout {first_s:.1f} s, "
                            f"{len(graphs.graphs) if graphs is not None else 0} graphs, attention "
                            f"{sampler.engine.cache.attention}, refresh {1e3 * statistics.median(refresh_s[1:]):.1f} ms")
                    for gbps, label in ((measured, "measured"), (spec, "spec")):
                        if gbps:
                            roof = roofline_tok_s(model, B, a.prompt, a.new, gbps, elem)
                            line += f"; {100 * tok_s / roof:.1f}% of the {label} roofline ({roof:.0f} tok/s)"
                    print(line, flush=True)
                    if graphs is not None and graphs.compile_error:
                        print(f"compile error ({short}, {arm}): {graphs.compile_error[-3000:]}", flush=True)
                    default_arm = "compiled" if SamplingConfig().compile_decode else "graphs"
                    tag = f"{short}_b{B}" + ("" if arm == default_arm and path == "auto" else f"_{arm}")
                    tag += "" if path == "auto" else f"_{path}"
                    heads.append(f"decode_tok_s_{tag}: {tok_s:.0f}")
                    if measured:
                        pct = 100 * tok_s / roofline_tok_s(model, B, a.prompt, a.new, measured, elem)
                        heads.append(f"decode_roofline_pct_{tag}: {pct:.1f}")
                    heads.append(f"refresh_ms_{short}: {1e3 * statistics.median(refresh_s[1:]):.1f}")
                    if a.profile and B == batches[-1] and arm == arms[0]:
                        profile(sampler, prompts, cfg, a.new, f"{short}_b{B}_{arm}")
                    del sampler
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # headline lines last, the default arm's roofline figures at the very end
    heads = list(dict.fromkeys(heads))
    print("\n".join([h for h in heads if not h.startswith("decode_roofline_pct_")]
                    + [h for h in heads if h.startswith("decode_roofline_pct_")]))


if __name__ == "__main__":
    main()
