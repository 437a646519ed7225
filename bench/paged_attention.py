"""Decode attention over the paged KV cache: FlexAttention in place against gather + SDPA.

One decode step's attention at the Qwen2.5-0.5B shape (14 query heads, 2 K/V heads, head_dim
64, block_size 16): every row's new K/V written into its slot, then attention over the row's
blocks (rows of ragged length, uniform in [context/2, 3 context/2], blocks scattered over the
pool) for `--layers` layers, the way a forward runs it (paged_attention.prepare once, attend per
layer). On CUDA each path's forward is captured in a CUDA graph and replayed (what the engine
does with sampling.cuda_graphs), so the figure is the GPU's time, not Python's; on CPU it runs
eagerly. The two paths alternate (pairs); the speed ratio is the median over pairs. On CUDA the
roofline is the K/V bytes a row must read (its own tokens, once) plus the new K/V written, at the
device's HBM bandwidth (--hbm-tbps, default from the device name: H100 3.35, H200 4.8).

    .venv/bin/python bench/paged_attention.py                                  # CPU, small
    python bench/paged_attention.py --device cuda --batches 64,256 --context 1024   # bench/gpu.sh
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import paged_attention as pa  # noqa: E402

H, HK, D, BS = 14, 2, 64, 16  # Qwen2.5-0.5B attention
HBM_TBPS = {"H100": 3.35, "H200": 4.8}


def decode_case(rows, context, layers, dtype, device, seed=0):
    """A pool holding `rows` rows of ragged length and one decode step's inputs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(context // 2, 3 * context // 2 + 1, (rows,), generator=g).tolist()
    blocks = [-(-n // BS) for n in lengths]
    n_blocks = sum(blocks)
    cache = pa.PagedKVCache(layers, n_blocks, BS, HK, D, dtype, device)
    cache.k.normal_()
    cache.v.normal_()
    free = torch.randperm(n_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(n)] for n in blocks]
    NB = max(blocks)
    table = torch.tensor([t + [cache.scratch] * (NB - len(t)) for t in tables], device=device)
    positions = torch.tensor(lengths, device=device)[:, None] - 1
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lengths)], device=device)
    q = torch.randn(rows, 1, H, D, generator=g).to(device, dtype)
    k, v = (torch.randn(rows, 1, HK, D, generator=g).to(device, dtype) for _ in range(2))
    kv_bytes = sum(lengths) * 2 * HK * D * cache.k.element_size()  # per layer: each row's tokens once
    return cache, table, positions, slots[:, None], q, k, v, kv_bytes


def forward_fn(path, cache, table, positions, slots, q, k, v, layers):
    def forward():
        cache.attention = path
        plan = pa.prepare(pa.PagedBatch(cache, slots, table), positions)
        with pa.fused_attention_only(q.device):
            return [pa.attend(q, k, v, plan, layer) for layer in range(layers)]
    return forward


def timer(fn, device, iters):
    """fn -> seconds per call (median of `iters`-call runs is taken by the caller's pairs)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def graphed(forward, device):
    """On CUDA: the forward captured once and replayed; elsewhere the forward itself."""
    if device.type != "cuda":
        return forward
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile and warm up outside the graph
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph.replay


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="")
    ap.add_argument("--context", type=int, default=0, help="mean tokens per row (default 1024 CUDA, 256 CPU)")
    ap.add_argument("--layers", type=int, default=0, help="layers per forward (default 24 CUDA, 2 CPU)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--iters", type=int, default=0, help="forwards per timing (default 50 CUDA, 5 CPU)")
    ap.add_argument("--hbm-tbps", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in (args.batches or ("64,256" if cuda else "16,64")).split(",")]
    context = args.context or (1024 if cuda else 256)
    layers = args.layers or (24 if cuda else 2)
    iters = args.iters or (50 if cuda else 5)
    dtype = torch.bfloat16 if cuda else torch.float32
    hbm = args.hbm_tbps
    if cuda and not hbm:
        name = torch.cuda.get_device_name(device)
        hbm = next((v for k, v in HBM_TBPS.items() if k in name), 0.0)
        print(f"device: {name}, HBM {hbm or '?'} TB/s")
    lines = []
    for rows in batches:
        *case, kv_bytes = decode_case(rows, context, layers, dtype, device)
        want = forward_fn("gather", *case, layers)()[-1]
        got = forward_fn("flex", *case, layers)()[-1]
        err = (got.float() - want.float()).abs().max().item()
        runs = {path: graphed(forward_fn(path, *case, layers), device) for path in ("gather", "flex")}
        times = {path: [] for path in runs}
        for _ in range(args.pairs):
            for path, fn in runs.items():
                times[path].append(timer(fn, device, iters) / layers)
        ratio = statistics.median(g / f for g, f in zip(times["gather"], times["flex"]))
        us = {path: 1e6 * statistics.median(t) for path, t in times.items()}
        print(f"B={rows} context~{context}: gather {us['gather']:.1f} us/layer, flex {us['flex']:.1f} us/layer, "
              f"max |flex - gather| {err:.2e}", flush=True)
        lines += [f"gather_decode_attention_us_per_layer_b{rows}: {us['gather']:.1f}",
                  f"flex_decode_attention_us_per_layer_b{rows}: {us['flex']:.1f}",
                  f"flex_speedup_over_gather_b{rows}: {ratio:.2f}"]
        if cuda and hbm:
            moved = kv_bytes + 2 * rows * HK * D * case[0].k.element_size()  # read each row's K/V, write the new
            for path in runs:
                lines.append(f"{path}_decode_attention_hbm_roofline_pct_b{rows}: "
                             f"{100 * moved / (hbm * 1e12) / (us[path] / 1e6):.1f}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
