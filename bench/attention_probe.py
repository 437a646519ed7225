"""GPU probe: which attention kernels take our shapes, and what decode / training attention costs.

Random tensors only (Qwen2.5-0.5B heads for decode: 14 query heads, 2 K/V heads, head dim 64;
bf16). Per layer and step, in ms, against the HBM floor of reading the K/V once. Candidates:
SDPA with a boolean length mask and enable_gqa (what model.py's cached path calls), the same
restricted to fused kernels (on CUDA, `sdpa_kernel` with fused backends only turns a silent
fallback to the math kernel, which materialises the whole score matrix, into an error), the GQA
group folded into the query axis, a paged pool gathered by a block table in two layouts, and
FlexAttention compiled over a contiguous cache. Then causal GQA forward+backward at training
lengths (0.5B heads at 8k tokens, 7B heads at 32k tokens).

    python bench/attention_probe.py            # CUDA only; ~1 min on an H100 (flex compiles)
"""
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
HBM_BYTES_PER_S = 3.0e12  # a round H100 figure for the floor column
DEVICE, DTYPE = "cuda", torch.bfloat16


def time_ms(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def report(name: str, fn) -> None:
    try:
        print(f"{name:64s} {time_ms(fn):8.3f} ms")
    except Exception as e:  # a kernel that refuses the shape is a result, not a crash
        print(f"{name:64s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:150]}")


# -----------------------------------------------------------------------------
# decode: one query token per row over a cache of S positions, rows of ragged length


def decode_probe(rows: int, cache_len: int, heads: int = 14, kv_heads: int = 2, head_dim: int = 64) -> None:
    group = heads // kv_heads
    q = torch.randn(rows, heads, 1, head_dim, device=DEVICE, dtype=DTYPE)
    k = torch.randn(rows, kv_heads, cache_len, head_dim, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    lengths = torch.randint(cache_len // 2, cache_len + 1, (rows,), device=DEVICE)
    valid = (torch.arange(cache_len, device=DEVICE) < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    kv_bytes = 2 * k.numel() * k.element_size()
    print(f"--- decode B={rows} S={cache_len}: K/V {kv_bytes / 1e6:.1f} MB/layer -> "
          f"{kv_bytes / HBM_BYTES_PER_S * 1e3:.3f} ms at {HBM_BYTES_PER_S / 1e12:.0f} TB/s")

    report("sdpa bool mask + enable_gqa (default backends)",
           lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=valid, enable_gqa=True))

    def fused_only():
        with sdpa_kernel(FUSED):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=valid, enable_gqa=True)
    report("sdpa bool mask + enable_gqa, fused kernels only", fused_only)

    q_folded = q.view(rows, kv_heads, group, head_dim)  # T=1: the group's heads become query positions
    additive = torch.zeros(rows, 1, 1, cache_len, device=DEVICE, dtype=DTYPE).masked_fill(~valid, float("-inf"))
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        def folded(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q_folded, k, v, attn_mask=additive)
        report(f"sdpa GQA folded into queries, additive mask, {backend.name}", folded)

    # a paged pool: blocks of 16 positions, a random block table per row
    block, n_blocks = 16, cache_len // 16
    pool_blocks = rows * n_blocks + 7
    table = torch.randperm(pool_blocks, device=DEVICE)[: rows * n_blocks].view(rows, n_blocks)
    pool_heads_first = torch.randn(pool_blocks, kv_heads, block, head_dim, device=DEVICE, dtype=DTYPE)

    def gather_heads_first():  # (B, n, Hk, bs, D) -> permute -> a copy per tensor
        kk = pool_heads_first[table].permute(0, 2, 1, 3, 4).reshape(rows, kv_heads, cache_len, head_dim)
        vv = pool_heads_first[table].permute(0, 2, 1, 3, 4).reshape(rows, kv_heads, cache_len, head_dim)
        with sdpa_kernel(FUSED):
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=valid, enable_gqa=True)
    report("paged pool (blocks, Hk, bs, D): gather + permute + fused sdpa", gather_heads_first)
    pool_positions_first = torch.randn(pool_blocks, block, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)

    def gather_positions_first():  # (B, n, bs, Hk, D) is already (B, S, Hk, D): one gather, a strided view
        kk = pool_positions_first[table].view(rows, cache_len, kv_heads, head_dim).transpose(1, 2)
        vv = pool_positions_first[table].view(rows, cache_len, kv_heads, head_dim).transpose(1, 2)
        with sdpa_kernel(FUSED):
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=valid, enable_gqa=True)
    report("paged pool (blocks, bs, Hk, D): gather + strided fused sdpa", gather_positions_first)

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention)

        def within_length(b, h, q_idx, kv_idx):
            return kv_idx < lengths[b]
        start = time.perf_counter()
        block_mask = create_block_mask(within_length, rows, None, 1, cache_len, device=DEVICE, BLOCK_SIZE=128)
        flex(q, k, v, block_mask=block_mask, enable_gqa=True)
        torch.cuda.synchronize()
        print(f"flex_attention first call (compile) {time.perf_counter() - start:.1f} s")
        report("flex_attention compiled, contiguous cache, length mask",
               lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True))
        report("create_block_mask (if rebuilt every step)",
               lambda: create_block_mask(within_length, rows, None, 1, cache_len, device=DEVICE, BLOCK_SIZE=128))
    except Exception as e:
        print("flex_attention FAILED", type(e).__name__, str(e)[:300])


# -----------------------------------------------------------------------------
# training: causal GQA forward + backward over one packed micro-batch


def training_probe(heads: int, kv_heads: int, head_dim: int, tokens: int) -> None:
    q = torch.randn(1, heads, tokens, head_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
    k = torch.randn(1, kv_heads, tokens, head_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)

    def forward_backward():
        with sdpa_kernel(FUSED):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.sum().backward()
    report(f"causal gqa fused fwd+bwd H={heads} Hk={kv_heads} D={head_dim} T={tokens}", forward_backward)


if __name__ == "__main__":
    assert torch.cuda.is_available(), "a CUDA probe: run it on a GPU machine"
    print(torch.__version__, torch.cuda.get_device_name())
    for rows, cache_len in [(64, 1024), (256, 1024), (256, 4096)]:
        decode_probe(rows, cache_len)
    training_probe(14, 2, 64, 8192)      # Qwen2.5-0.5B heads
    training_probe(28, 4, 128, 32768)    # Qwen2.5-7B heads, the SkyRL-SQL micro-batch
