"""The sampler's paged KV cache and attention over it.

PagedKVCache holds every layer's K/V in fixed-size blocks shared by all sequences (engine/block_manager.py
decides who holds which block; a sequence's block table lists its blocks in order). One forward
(PagedBatch) writes its tokens' K/V into their slots, then attends over each row's blocks. A
decode step (one token per row) reads them one of two ways, chosen by `PagedKVCache.attention`
(config sampling.paged_attention: auto = flex on CUDA, gather on CPU):

- gather, the reference and the CPU path: index_select every row's blocks into a dense
  (B, Hk, S, D) tensor padded to the longest row, then SDPA with a mask. The runner's eager
  decode keeps that copy across steps (PagedBatch.kv, decode_kv.py): a step appends its token
  instead of gathering every row's blocks again; the values SDPA reads are the same.
- flex: FlexAttention over the pool in place, nothing copied. A layer's pool is viewed as one
  sequence of (n_blocks + 1) * block_size tokens; a BlockMask lists each row's physical blocks
  (its block table) and a mask cuts its last block at the row's position. On CUDA the query
  batch is padded to a bucket so the batch size is static and inductor picks its flex-decoding
  kernel, which splits rows over KV (SPLIT_KV) when the batch alone does not fill the GPU.
  Chunks of several tokens (prefill, observations) always gather.

    cache = PagedKVCache.for_model(model, n_blocks, block_size, dtype, attention="auto")
    logits = model.forward_paged(idx, positions, PagedBatch(cache, slots, block_tables))
        # inside: plan = prepare(batch, positions) once, then every layer plan.attend(q, k, v, layer)

Tests: .venv/bin/pytest tests/test_paged_attention.py tests/test_model.py
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PATHS = ("auto", "gather", "flex")


# -----------------------------------------------------------------------------
# the pool and one forward's view of it


class PagedKVCache:
    """K/V of every layer in fixed-size blocks shared by all of the sampler's sequences.

    k, v: (n_layers, n_blocks + 1, block_size, n_kv_heads, head_dim). A sequence's block table
    lists the blocks holding its tokens in order (token p: block table[p // block_size], offset
    p % block_size). Block `scratch` (the last) is never handed out: padded tokens write there and
    padded table entries point there. Zero-initialised: attention reads slots past a row's length
    (masked out), so they must be finite. Tokens before heads: gathering a row's blocks is one copy
    whose transpose is the (B, heads, S, head_dim) view attention reads, and a layer's pool is one
    (1, heads, tokens, head_dim) sequence for flex without a copy.

    attention: how decode steps read the blocks, "gather" or "flex" (resolved from auto|gather|flex).
    """

    def __init__(self, n_layers, n_blocks, block_size, n_kv_heads, head_dim, dtype, device,
                 attention: str = "gather"):
        shape = (n_layers, n_blocks + 1, block_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size, self.scratch = block_size, n_blocks
        # (rows, blocks): the fixed shapes flex decode is padded to inside a compiled step with dynamic
        # sizes (set by cuda_graphs.DecodeGraphs when it compiles); None: the batch's own
        self.static_flex: tuple[int, int] | None = None
        self.attention = resolve(attention, self.k.device, block_size)
        self.fallback = attention == "auto"  # flex failing to build falls back to gather (warned)

    @classmethod
    def for_model(cls, model, n_blocks: int, block_size: int, dtype: torch.dtype,
                  attention: str = "gather") -> "PagedKVCache":
        """dtype: the compute dtype (bf16 under mixed precision), not necessarily the parameters'."""
        a = model.config
        return cls(a.num_hidden_layers, n_blocks, block_size, a.num_key_value_heads, a.head_dim, dtype,
                   model.embed_tokens.weight.device, attention)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block dst[i] := block src[i] in every layer (copy on write of a shared block)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


def resolve(attention: str, device: torch.device, block_size: int) -> str:
    """auto|gather|flex -> gather|flex on this device (auto: flex on CUDA, gather elsewhere)."""
    if attention not in PATHS:
        raise ValueError(f"sampling.paged_attention={attention!r}: expected one of {', '.join(PATHS)}")
    if attention == "auto":
        attention = "flex" if device.type == "cuda" else "gather"
    if attention == "flex" and device.type == "cuda" and block_size % 16:
        raise ValueError(f"sampling.paged_attention=flex on CUDA needs sampling.block_size a multiple of 16 "
                         f"(FlexAttention's smallest KV tile), got {block_size}")
    return attention


@dataclass
class PagedBatch:
    """Where one forward's tokens go in a PagedKVCache and which blocks each row attends over."""
    cache: PagedKVCache
    slots: torch.Tensor  # (B, T) long: block * block_size + offset of each token (scratch for padding)
    block_tables: torch.Tensor | None  # (B, NB) long: each row's blocks in order, scratch-padded
    # None: no row has cached tokens, so attention is causal within the chunk (right padding is harmless)
    kv: object = None  # decode_kv.DecodeKV: a decode step's rows' K/V kept dense (gather path); None: gather


@dataclass
class Plan:
    """One forward's attention inputs, shared by its layers (prepare)."""
    batch: PagedBatch
    positions: torch.Tensor  # (B, T) long
    slots: torch.Tensor  # (B T,) long
    # gather: (B, 1, T, S) bool, query t of row b sees slot j iff j <= its position
    mask: torch.Tensor | None = None
    flex: bool = False  # a decode step read in place
    kv_index: torch.Tensor | None = None  # (B Hk,) a decode step's columns in batch.kv (DecodeKV.index)
    block_mask: object = None  # flex: the BlockMask over the pool's blocks, built by the first layer

    def attend(self, q, k, v, layer: int):
        """What model.Attention calls: attend(q, k, v, self, layer) below."""
        return attend(q, k, v, self, layer)


def prepare(batch: PagedBatch, positions: torch.Tensor) -> Plan:
    """The attention inputs of one forward (positions (B, T) long), built once for all layers."""
    plan = Plan(batch, positions, batch.slots.reshape(-1))
    if batch.block_tables is None:
        return plan  # fresh chunk: causal within it
    if batch.cache.attention == "flex" and positions.shape[1] == 1:
        plan.flex = True
    else:
        plan.mask = gather_mask(batch, positions)
        if batch.kv is not None and positions.shape[1] == 1:
            plan.kv_index = batch.kv.index(positions[:, 0], batch.slots[:, 0])
    return plan


def gather_mask(batch: PagedBatch, positions: torch.Tensor) -> torch.Tensor:
    S = batch.block_tables.shape[1] * batch.cache.block_size
    return (torch.arange(S, device=positions.device) <= positions[:, :, None])[:, None]  # (B, 1, T, S)


def fused_attention_only(device: torch.device):
    """On CUDA, SDPA may only use a fused kernel: a silent fallback to the math kernel (repeated K/V,
    the whole score matrix in memory) becomes an error. CPU: no restriction."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


# -----------------------------------------------------------------------------
# attention: write the new K/V, then read each row's blocks


def attend(q, k, v, plan: Plan, layer: int) -> torch.Tensor:
    """Write k/v into their slots of `layer`, then attend over each row's blocks. -> (B, T, H, D)

    q (B, T, H, D); k, v (B, T, Hk, D). Fresh chunks (no block tables): causal within the chunk.
    A decode step reads the blocks in place (flex) or a gather of them; longer chunks gather.
    """
    batch = plan.batch
    cache = batch.cache
    k_pool, v_pool = cache.k[layer], cache.v[layer]  # (n_blocks + 1, block_size, Hk, D)
    B, T, H, D = q.shape
    Hk = k.shape[2]
    if k_pool.dtype != q.dtype:  # cache in another dtype than the compute: attend in its dtype
        q, k, v = q.to(k_pool.dtype), k.to(k_pool.dtype), v.to(k_pool.dtype)
    # index_copy_ on a flat view: ~50x faster than index_put on CPU decode
    k_pool.view(-1, Hk, D).index_copy_(0, plan.slots, k.reshape(-1, Hk, D))
    v_pool.view(-1, Hk, D).index_copy_(0, plan.slots, v.reshape(-1, Hk, D))
    if batch.block_tables is None:
        return sdpa(q, k.transpose(1, 2), v.transpose(1, 2), None)
    if plan.flex:
        y = _flex_or_fallback(q, k_pool, v_pool, plan)
        if y is not None:
            return y
    S = plan.mask.shape[-1]
    if plan.kv_index is not None:  # the rows' K/V already copied out (decode_kv.py): append this token
        batch.kv.append(layer, k, v, plan.kv_index)
        return sdpa(q, *batch.kv.read(layer, S), plan.mask)
    table = batch.block_tables.reshape(-1)
    kc = k_pool.index_select(0, table).view(B, S, Hk, D).transpose(1, 2)  # (B, Hk, S, D) strided view
    vc = v_pool.index_select(0, table).view(B, S, Hk, D).transpose(1, 2)
    return sdpa(q, kc, vc, plan.mask)


def sdpa(q, k, v, mask):
    """SDPA of q (B, T, H, D) over k, v (B, Hk, S, D) -> (B, T, H, D), in a form fused kernels take.

    mask (B, 1, T, S) bool, or None: causal. Decode (T = 1): the G = H / Hk query heads of each K/V
    head are folded into the query axis, q (B, Hk, G, D) (a view: query head h = hk G + g reads
    K/V head hk, as enable_gqa), and the mask broadcasts over them; every fused kernel (fp32 too)
    takes that and reads each K/V head once. Otherwise enable_gqa: flash and cuDNN take it in
    bf16/fp16; CUDA has no fused GQA kernel in fp32 (tests only), so K/V are repeated there.
    """
    B, T, H, D = q.shape
    Hk = k.shape[1]
    if T == 1 and mask is not None:
        y = F.scaled_dot_product_attention(q.reshape(B, Hk, H // Hk, D), k, v, attn_mask=mask)
        return y.reshape(B, 1, H, D)
    gqa = Hk != H
    if gqa and q.is_cuda and q.dtype == torch.float32:
        k, v, gqa = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1), False
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, is_causal=mask is None,
                                       enable_gqa=gqa)
    return y.transpose(1, 2)


# -----------------------------------------------------------------------------
# flex: the decode step over the blocks in place

_FLEX = {}  # device type -> compiled decode function
BATCH_FLOOR = 16  # CUDA: the query batch is padded to a power of two >= this (a few static shapes)
RECOMPILE_LIMIT = 32  # dynamo's per-function compile cache, raised once flex decode is first used


def flex_block_mask(cache: PagedKVCache, tables: torch.Tensor, positions: torch.Tensor, q_len: int):
    """BlockMask for one decode step of q_len query rows per (row, K/V head): row b (at position
    positions[b], tables (B, NB) its blocks) reads its first positions[b] // bs blocks whole and its
    last block up to offset positions[b] % bs.

    KV index j of the mask is the pool's token j (block j // bs). Every block is listed as partial
    (the mask is evaluated on it): given full blocks, inductor's flex-decoding kernel sizes its KV
    splits by the whole pool's length, so no row would be split; partial blocks are split by each
    row's own length. CUDA: rows padded to a bucket (padding rows read no block). CPU: inductor's
    CPU kernel wants the index tensor as wide as the pool (tests only; no padding of rows there:
    it compiles with a dynamic batch)."""
    from torch.nn.attention.flex_attention import BlockMask
    B, NB = tables.shape
    bs, dev = cache.block_size, tables.device
    cuda = dev.type == "cuda"
    if torch.compiler.is_compiling() and cache.static_flex:
        # inside the compiled decode step (cuda_graphs.py), whose batch and block counts are dynamic:
        # flex gets fixed shapes, the most rows and blocks a graph holds (padding rows read no block;
        # inductor's flex lowering of dynamic sizes failed on torch 2.11: "name 'Min' is not defined")
        rows, width = cache.static_flex
    else:
        rows = max(BATCH_FLOOR, 1 << (B - 1).bit_length()) if cuda else B
        width = NB if cuda else cache.scratch + 1
    n = (positions // bs + 1).clamp(max=NB)  # (B,) blocks row b reads
    counts = torch.zeros(rows, 1, 1, dtype=torch.int32, device=dev)
    counts[:B, 0, 0] = n.to(torch.int32)
    indices = torch.zeros(rows, 1, 1, width, dtype=torch.int32, device=dev)
    indices[:B, 0, 0, :NB] = tables.to(torch.int32)
    last = torch.full((rows,), cache.scratch, dtype=torch.long, device=dev)  # (rows,) each row's last block
    last[:B] = tables.gather(1, (n - 1)[:, None])[:, 0]
    off = torch.zeros(rows, dtype=torch.long, device=dev)  # (rows,) the new token's offset in it
    off[:B] = positions % bs

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx // bs != last[b]) | (kv_idx % bs <= off[b])

    tokens = (cache.scratch + 1) * bs
    return BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=(128, bs), mask_mod=mask_mod,
                                    seq_lengths=(q_len, tokens), compute_q_blocks=False)


def _decode(q, k, v, block_mask, kernel_options):
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention(q, k, v, block_mask=block_mask, kernel_options=kernel_options)


def flex_decode(q, k_pool, v_pool, block_mask, block_size: int) -> torch.Tensor:
    """q (B, 1, H, D) over a layer's pool (n_blocks + 1, block_size, Hk, D) -> (B, 1, H, D).

    The G = H / Hk query heads of a K/V head are the query axis, q (rows, Hk, G, D), so the kernel
    sees no GQA (its decoding kernel takes only power-of-two groups; Qwen2.5-0.5B has 7) and reads
    each K/V head once per row."""
    B, _, H, D = q.shape
    Hk = k_pool.shape[2]
    G = H // Hk
    rows = block_mask.kv_num_blocks.shape[0]
    qf = q.reshape(B, Hk, G, D)
    if rows > B:
        qf = torch.cat([qf, qf.new_zeros(rows - B, Hk, G, D)])
    k = k_pool.view(1, -1, Hk, D).transpose(1, 2)  # (1, Hk, pool tokens, D): a view, batch broadcast
    v = v_pool.view(1, -1, Hk, D).transpose(1, 2)
    kind = q.device.type
    if torch.compiler.is_compiling():  # inside the compiled decode step (cuda_graphs.py): traced with it
        options = {"BLOCK_N": min(block_size, 64)} if kind == "cuda" else None
        return _decode(qf, k, v, block_mask, options)[:B].reshape(B, 1, H, D)
    if kind not in _FLEX:
        _FLEX[kind] = torch.compile(_decode, dynamic=True)
        # one compile per (batch bucket, dtype) on CUDA: past dynamo's recompile limit (8) a call would
        # run flex eagerly, which materialises the scores over the whole pool
        cfg = torch._dynamo.config
        if hasattr(cfg, "recompile_limit"):
            cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.mark_static(qf, 2)  # G: a dynamic G equal to the batch size broke inductor's C++ kernel
    options = None
    if kind == "cuda":
        torch._dynamo.mark_static(qf, 0)  # static batch: inductor's flex-decoding kernel (split over KV)
        options = {"BLOCK_N": min(block_size, 64)}  # a KV tile must divide a block
    y = _FLEX[kind](qf, k, v, block_mask, options)  # (rows, Hk, G, D)
    return y[:B].reshape(B, 1, H, D)


def _flex_or_fallback(q, k_pool, v_pool, plan: Plan):
    """flex_decode, or None after switching the cache to gather when flex cannot be built here and
    the path was auto (sampling.paged_attention=flex raises instead)."""
    cache = plan.batch.cache
    try:
        if plan.block_mask is None:  # q_len: the query heads per K/V head
            plan.block_mask = flex_block_mask(cache, plan.batch.block_tables, plan.positions[:, 0],
                                              q.shape[2] // k_pool.shape[2])
        return flex_decode(q, k_pool, v_pool, plan.block_mask, cache.block_size)
    except Exception as e:  # noqa: BLE001  (compile errors come in many types)
        if not cache.fallback:
            raise
        warnings.warn(f"paged attention: FlexAttention failed on {q.device} ({type(e).__name__}: {e}); "
                      "decoding with the gather path (set sampling.paged_attention=gather to skip flex)")
        cache.attention, plan.flex = "gather", False
        plan.mask = gather_mask(plan.batch, plan.positions)
        return None
