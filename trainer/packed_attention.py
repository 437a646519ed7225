"""Attention over packed rows (trainer/packing.py): a response attends to its unit's prompt and to
itself, never to its siblings or other units; a lone sequence is plainly causal.

The implementation is chosen by device, once per micro-batch (`for_rows`); the model calls
`attend(q, k, v, layer)` on what it gets, whichever it is:

- CPU, SegmentRows: every sequence gathered into its own short causal attention row. SDPA with a
  dense (B, 1, T, T) mask computes all T² pairs of a row (the CPU flash kernel skips nothing),
  almost all of them masked: a 16k-token row of 134-token sequences is >99% masked pairs. Here
  attention runs on *attention rows*, one per sequence, [prompt | own response], right-padded
  and plainly causal (`is_causal`, the flash kernel's cheap case). Only attention sees this
  layout: the projections, MLP, norms and LM head still run once per packed token, so a shared
  prompt is computed once in every linear layer (repeated only as attention keys/queries, where
  it costs P² per response). Rows are sorted by length and cut into buckets (one SDPA call
  each) whose rows are at least BUCKET_FILL of the bucket's longest. A shared prompt's own
  outputs come from its unit's first attention row (the same in every row: a causal prompt sees
  only itself). The same softmax over the same keys as the dense mask, up to float summation
  order (~1e-6 in fp32).
- CUDA, FlexRows: compiled FlexAttention with a BlockMask built from the row's structure
  (`block_mask`: O(T + (T/128)²), where create_block_mask evaluates all T² pairs: ~12 GB at
  T=32768); it skips masked blocks. Row widths are rounded up to its 128-token block (`width`):
  it compiles per shape.

    attention = for_rows(docs, segs, width, device)   # per micro-batch, from packing's row lists
    y = attention.attend(q, k, v, layer)              # q (B, T, H, D), k/v (B, T, Hk, D) -> (B, T, H, D)

Tests: pytest tests/test_packing.py tests/test_packed_attention.py
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FLEX_BLOCK = 128  # FlexAttention's default block size (tokens)


def for_rows(docs: list[list[int]], segs: list[list[int]], width: int, device):
    """The attention of one micro-batch's packed rows, by device: FlexRows on CUDA, SegmentRows
    elsewhere. docs, segs: per row, each token's unit index and segment (0 = the unit's shared
    prompt, or the whole sequence of a unit of one; j + 1 = response j), as packing.Row holds
    them; width: T, the padded row width."""
    if torch.device(device).type == "cuda":
        return flex_rows(docs, segs, width, device)
    return segment_rows(docs, segs, width, device)


def width(longest: int, device) -> int:
    """The padded width of a micro-batch whose longest row has `longest` tokens: CUDA rounds up
    to FlexAttention's block (it compiles per shape: few distinct widths, few compiles)."""
    return -(-longest // FLEX_BLOCK) * FLEX_BLOCK if torch.device(device).type == "cuda" else longest


# -----------------------------------------------------------------------------
# CPU: per-sequence attention rows

# a bucket's shortest row is at least this fraction of its longest: on the tiny config's GRPO
# batch (rows of 72-168 tokens) 0.9 pads 9% over the causal pairs (0.75: 29%) in ~5 SDPA calls
# per micro-batch and layer
BUCKET_FILL = 0.9

@dataclass
class SegmentRows:
    """Where each packed token sits in the attention rows (for_rows on a CPU)."""
    gather: list[torch.Tensor]  # per bucket (R, S) long: flat packed index b*T + t of attention row r's token s
    scatter: torch.Tensor  # (B*T,) long: index into the buckets' concatenated (R*S) outputs, per packed token

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """q (B, T, H, D), k, v (B, T, Hk, D) -> (B, T, H, D). Differentiable (index_select)."""
        B, T, H, D = q.shape
        Hk = k.shape[2]
        qf, kf, vf = q.reshape(B * T, H * D), k.reshape(B * T, Hk * D), v.reshape(B * T, Hk * D)
        outs = []
        for idx in self.gather:
            R, S = idx.shape
            flat = idx.reshape(-1)
            # (R, S, heads, D) gathered, then the (R, heads, S, D) view SDPA reads
            qs = qf.index_select(0, flat).view(R, S, H, D).transpose(1, 2)
            ks = kf.index_select(0, flat).view(R, S, Hk, D).transpose(1, 2)
            vs = vf.index_select(0, flat).view(R, S, Hk, D).transpose(1, 2)
            y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=Hk != H)
            outs.append(y.transpose(1, 2).reshape(R * S, H * D))
        flat_out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return flat_out.index_select(0, self.scatter).view(B, T, H, D)


def segment_rows(docs: list[list[int]], segs: list[list[int]], width: int, device) -> SegmentRows:
    """docs, segs: per packed row, each token's unit index and segment (0 = the unit's shared
    prompt, or the whole sequence of a unit of one; j + 1 = response j), as packing.Row holds
    them; width: T, the padded row width. Padding tokens (t >= len(row)) get any output: no
    real token attends to them and they carry no loss."""
    seq_rows: list[list[int]] = []  # flat packed indices of each attention row
    owner: list[tuple[int, int]] = []  # per packed token with an output: (attention row, offset)
    flat_tok: list[int] = []
    for b, (doc, seg) in enumerate(zip(docs, segs)):
        base = b * width
        units: dict[int, dict[int, list[int]]] = {}
        for t, (d, s) in enumerate(zip(doc, seg)):
            units.setdefault(d, {}).setdefault(s, []).append(base + t)
        for parts in units.values():
            prompt = parts.get(0, [])
            responses = [parts[s] for s in sorted(parts) if s]
            if not responses:  # a lone sequence: one causal row
                responses, prompt = [prompt], []
            for j, resp in enumerate(responses):
                r = len(seq_rows)
                seq_rows.append(prompt + resp)
                own = resp if j else prompt + resp  # the prompt's outputs: from the first row
                start = 0 if j == 0 else len(prompt)
                flat_tok += own
                owner += [(r, start + i) for i in range(len(own))]
    if not seq_rows:
        raise ValueError("segment_rows: no tokens")
    # buckets: rows longest first; a new bucket once a row is shorter than BUCKET_FILL x its longest
    order = sorted(range(len(seq_rows)), key=lambda r: -len(seq_rows[r]))
    buckets: list[list[int]] = []
    for r in order:
        if not buckets or len(seq_rows[r]) < BUCKET_FILL * len(seq_rows[buckets[-1][0]]):
            buckets.append([])
        buckets[-1].append(r)
    gather, where, offset = [], {}, 0  # where[r] = flat output index of attention row r's token 0
    for rows in buckets:
        S = len(seq_rows[rows[0]])
        # padding keys repeat the row's first token: causal, so no real query reaches them
        gather.append(torch.tensor([seq_rows[r] + [seq_rows[r][0]] * (S - len(seq_rows[r])) for r in rows],
                                   dtype=torch.long, device=device))
        for i, r in enumerate(rows):
            where[r] = offset + i * S
        offset += len(rows) * S
    scatter = torch.zeros(len(docs) * width, dtype=torch.long)
    scatter[torch.tensor(flat_tok, dtype=torch.long)] = torch.tensor([where[r] + s for r, s in owner], dtype=torch.long)
    return SegmentRows(gather, scatter.to(device))

# -----------------------------------------------------------------------------
# CUDA: FlexAttention over the rows, masked blocks skipped

_FLEX = None


def _flex_attention():
    """flex_attention compiled (eager flex is a slow reference loop; compile gives the fused kernel).
    Default dynamic: the first width compiles static, a second width recompiles once with a symbolic
    length; dynamic=False would compile every micro-batch width anew and, past dynamo's recompile
    limit, fall back to the eager loop."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX = torch.compile(flex_attention)
    return _FLEX


def flex_rows(docs: list[list[int]], segs: list[list[int]], width: int, device) -> "FlexRows":
    """for_rows on CUDA (tests call it on a CPU too, with flex_attention uncompiled)."""
    # padding tokens form their own unit (doc -1): they see only each other, so no row is empty
    doc = torch.tensor([d + [-1] * (width - len(d)) for d in docs], dtype=torch.long, device=device)
    seg = torch.tensor([s + [0] * (width - len(s)) for s in segs], dtype=torch.long, device=device)
    return FlexRows(block_mask(doc, seg))


@dataclass
class FlexRows:
    """The rows' BlockMask (for_rows on CUDA); attend runs compiled FlexAttention with it."""
    block_mask: object  # torch.nn.attention.flex_attention.BlockMask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """q (B, T, H, D), k, v (B, T, Hk, D) -> (B, T, H, D): fused, never a (T, T) score matrix."""
        y = _flex_attention()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=self.block_mask,
                              enable_gqa=True)
        return y.transpose(1, 2)


def mask_mod_of(doc: torch.Tensor, seg: torch.Tensor):
    """FlexAttention's mask_mod for rows (B, T): same unit, causal, prompt or own response."""
    def mask_mod(b, h, q, k):
        return (doc[b, q] == doc[b, k]) & (k <= q) & ((seg[b, k] == 0) | (seg[b, k] == seg[b, q]))
    return mask_mod


def block_mask(doc: torch.Tensor, seg: torch.Tensor):
    """The FlexAttention BlockMask of the packed rule (mask_mod_of) for rows doc, seg (B, T), built from
    the row's structure in O(T + (T/128)²) memory and O(T log T + (T/128)²) time (the layout
    check sorts each row) on any device. create_block_mask would evaluate the rule on all T²
    pairs (gigabytes and tens of seconds for a 32k-token row).

    Needs what packing.plan lays out (else ValueError): each unit (doc value, padding's -1
    included) and each (unit, segment) is one contiguous span of its row; seg >= 0. Then, for a
    key block kb strictly before a query block qb (k < q for every pair), only the unit holding
    kb's last token can be shared with qb, so per block pair:
      some pair allowed  iff  doc[kb last] == doc[qb first] and (kb holds a prompt token of that
                              unit, or kb's last and qb's first token are in one segment span)
      every pair allowed iff  doc[kb first] == doc[qb last], qb lies within the row, and kb has
                              no response token before the segment span that holds all of qb
    A diagonal block is partial (each token sees itself; later keys are masked); kb > qb is
    empty. Partial blocks keep `mask_mod_of`'s per-pair rule; full blocks skip it."""
    from torch.nn.attention.flex_attention import BlockMask

    if doc.dim() != 2 or doc.shape != seg.shape or doc.shape[1] == 0:
        raise ValueError(f"block_mask needs doc and seg of one shape (B, T), T > 0; got "
                         f"{tuple(doc.shape)}, {tuple(seg.shape)}")
    B, T = doc.shape
    dev, blk = doc.device, FLEX_BLOCK
    doc, seg = doc.long(), seg.long()
    _check_contiguous(doc, seg)
    pos = torch.arange(T, device=dev).expand(B, T)
    new_doc = torch.ones(B, T, dtype=torch.bool, device=dev)
    new_doc[:, 1:] = doc[:, 1:] != doc[:, :-1]
    new_run = new_doc.clone()  # a "run": one (unit, segment) span
    new_run[:, 1:] |= seg[:, 1:] != seg[:, :-1]
    run = new_run.cumsum(1)  # (B, T) span id
    # (B, T) each: where the token's unit / span starts, the latest prompt / response token so far
    doc_start = torch.where(new_doc, pos, 0).cummax(1).values
    run_start = torch.where(new_run, pos, 0).cummax(1).values
    last_prompt = torch.where(seg == 0, pos, -1).cummax(1).values
    last_resp = torch.where(seg != 0, pos, -1).cummax(1).values

    nb = -(-T // blk)
    first = torch.arange(nb, device=dev) * blk  # (nb,) a block's first and last in-row position
    last = (first + blk).clamp(max=T) - 1
    complete = (first + blk <= T)[None, :, None]  # (1, nq, 1): a query block wholly in the row
    qi, ki = torch.arange(nb, device=dev)[:, None], torch.arange(nb, device=dev)[None, :]
    below = (ki < qi)[None]  # (1, nq, nk)
    doc_f, doc_l, run_f, run_l = doc[:, first], doc[:, last], run[:, first], run[:, last]  # (B, nb)
    # some allowed pair (kb < qb)
    kb_prompt = last_prompt[:, last] >= torch.maximum(first, doc_start[:, last])  # (B, nk)
    shared_unit = doc_l[:, None, :] == doc_f[:, :, None]  # (B, nq, nk) kb's last, qb's first token
    some = below & shared_unit & (kb_prompt[:, None, :] | (run_l[:, None, :] == run_f[:, :, None]))
    # every pair allowed: keys before `keep` (qb's span start if qb is one span, else kb's end)
    # must all be prompt tokens; keys from there on share qb's span
    one_span = run_f == run_l  # (B, nq)
    keep = torch.where(one_span, run_start[:, first], T)[:, :, None]  # (B, nq, 1)
    upto = torch.minimum(keep, (last + 1)[None, None, :]) - 1  # (B, nq, nk) last key to check
    resp_before = last_resp.gather(1, upto.clamp(min=0).view(B, -1)).view(B, nb, nb) >= first[None, None, :]
    full = below & complete & (doc_f[:, None, :] == doc_l[:, :, None]) & ~(resp_before & (upto >= first))
    partial = (some & ~full) | torch.eye(nb, dtype=torch.bool, device=dev)[None]
    kv_num, kv_idx = _ordered(partial[:, None])
    full_num, full_idx = _ordered(full[:, None])
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=blk,
                                    mask_mod=mask_mod_of(doc, seg), seq_lengths=(T, T))


def _ordered(dense: torch.Tensor):
    """(B, H, nq, nk) bool -> FlexAttention's (count (B, H, nq), indices (B, H, nq, nk)) int32:
    each query block's kv blocks, ascending, then the unused ones (create_block_mask's order)."""
    dense = dense.to(torch.int32)
    return dense.sum(-1, dtype=torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)


def _check_contiguous(doc: torch.Tensor, seg: torch.Tensor):
    """ValueError unless every doc value and every (doc, seg) pair is one contiguous span per row."""
    if (seg < 0).any():
        raise ValueError("block_mask: seg must be >= 0 (0 = prompt, j + 1 = response j)")
    keyed = (doc - doc.min()) * (int(seg.max()) + 1) + seg  # one int per (doc, seg)
    for name, key in (("unit (doc)", doc), ("(unit, segment)", keyed)):
        spans = 1 + (key[:, 1:] != key[:, :-1]).sum(1)
        srt = key.sort(1).values
        distinct = 1 + (srt[:, 1:] != srt[:, :-1]).sum(1)
        if (spans != distinct).any():
            raise ValueError(f"block_mask: each {name} must be one contiguous span of its row, as "
                             f"packing.plan lays them out")
