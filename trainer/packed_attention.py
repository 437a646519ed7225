"""Attention over packed rows (trainer/packing.py): a response attends to its unit's prompt and to
itself, never to its siblings or other units; a lone sequence is plainly causal.

The implementation is chosen by device, once per micro-batch (`for_rows`); the model calls
`attend(q, k, v, layer)` on what it gets, whichever it is:

- CPU, SegmentRows: every sequence cut into its own short causal attention row. SDPA with a
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
    """Where each packed token sits in the attention rows (for_rows on a CPU), as contiguous spans.

    The flat (B*T) token axis is cut into spans in order (`sizes`): each unit's prompt, each of its
    responses (a lone sequence is one span), each packed row's padding. An attention row is one or
    two spans ([prompt | response]) then zeros up to its bucket's width, so a bucket is one
    torch.cat of spans: its backward is a split, a copy. (Gathering rows with index_select instead
    costs a scatter-add per tensor and layer in backward: on a 2-core CPU, 0.9 of the 1.2 s that
    one SmolLM2-135M layer's attention took over a 3.1k-token row of 4 prompts x 4 responses.)
    The outputs are cut the same way (`out_sizes`) and put back in flat order (`out_order`)."""
    sizes: list[int]  # the flat token axis in spans, in order (sum: B*T)
    buckets: list[tuple[int, list[tuple[list[int], int]]]]  # (S, per row: (its span indices, padding))
    out_sizes: list[int]  # the buckets' concatenated (R*S) outputs in spans, in order
    out_order: list[int]  # per flat span: the output span holding its tokens, or -1 - n for n padding tokens

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """(rows, width) of each bucket: one SDPA call each."""
        return [(len(rows), S) for S, rows in self.buckets]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """q (B, T, H, D), k, v (B, T, Hk, D) -> (B, T, H, D). Differentiable (split and cat)."""
        B, T, H, D = q.shape
        Hk = k.shape[2]
        spans = [x.reshape(B * T, -1).split(self.sizes) for x in (q, k, v)]
        outs = []
        for S, rows in self.buckets:
            R = len(rows)
            qs, ks, vs = (_bucket(parts, rows).view(R, S, heads, D).transpose(1, 2)
                          for parts, heads in zip(spans, (H, Hk, Hk)))
            # right padding after each row's tokens: causal, so no real query reaches it
            y = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=Hk != H)
            outs.append(y.transpose(1, 2).reshape(R * S, H * D))
        flat_out = outs[0] if len(outs) == 1 else torch.cat(outs)
        pieces = flat_out.split(self.out_sizes)
        return torch.cat([pieces[i] if i >= 0 else flat_out.new_zeros(-1 - i, H * D)
                          for i in self.out_order]).view(B, T, H, D)


def _bucket(spans: tuple[torch.Tensor, ...], rows: list[tuple[list[int], int]]) -> torch.Tensor:
    """(R*S, width): each row's spans, then its padding (zeros), one row after another."""
    parts = []
    for span_ids, pad in rows:
        parts += [spans[i] for i in span_ids]
        if pad:
            parts.append(spans[0].new_zeros(pad, spans[0].shape[1]))
    return torch.cat(parts)


def segment_rows(docs: list[list[int]], segs: list[list[int]], width: int, device) -> SegmentRows:
    """docs, segs: per packed row, each token's unit index and segment (0 = the unit's shared
    prompt, or the whole sequence of a unit of one; j + 1 = response j), as packing.Row holds
    them (each unit, and each of its segments, contiguous); width: T, the padded row width.
    Padding tokens (t >= len(row)) get zeros: no real token attends to them and they carry no
    loss. device: unused (the layout is plain lists)."""
    sizes: list[int] = []  # the flat token axis in spans
    seq_rows: list[list[int]] = []  # each attention row's spans: [own] or [prompt, own]
    for doc, seg in zip(docs, segs):
        t = 0
        while t < len(doc):  # one unit: its prompt span (seg 0), then one span per response
            unit, spans = doc[t], {}
            while t < len(doc) and doc[t] == unit:
                start, part = t, seg[t]
                while t < len(doc) and doc[t] == unit and seg[t] == part:
                    t += 1
                if part in spans:
                    raise ValueError("segment_rows: a unit's segment must be one contiguous span")
                spans[part] = len(sizes)
                sizes.append(t - start)
            responses = [spans[p] for p in sorted(spans) if p]
            if not responses:  # a lone sequence: one causal row
                seq_rows.append([spans[0]])
            else:
                seq_rows += [[spans[0], r] if 0 in spans else [r] for r in responses]
        if width > len(doc):
            sizes.append(width - len(doc))  # the row's padding: a span no attention row reads
    if not seq_rows:
        raise ValueError("segment_rows: no tokens")
    length = [sum(sizes[i] for i in row) for row in seq_rows]
    # buckets: rows longest first; a new bucket once a row is shorter than BUCKET_FILL x its longest
    order = sorted(range(len(seq_rows)), key=lambda r: -length[r])
    groups: list[list[int]] = []
    for r in order:
        if not groups or length[r] < BUCKET_FILL * length[groups[-1][0]]:
            groups.append([])
        groups[-1].append(r)
    # the outputs: every attention row's tokens in bucket order; a shared prompt's are read from its
    # unit's first response row (a causal prompt sees only itself: the same in every row)
    first_row: dict[int, int] = {}  # flat span -> the first attention row holding it
    for r, row in enumerate(seq_rows):
        for i in row:
            first_row.setdefault(i, r)
    out_sizes: list[int] = []
    source: dict[int, int] = {}  # flat span -> output span
    buckets = []
    for rows in groups:
        S = length[rows[0]]
        buckets.append((S, [(seq_rows[r], S - length[r]) for r in rows]))
        for r in rows:
            for i in seq_rows[r]:
                if first_row[i] == r:
                    source[i] = len(out_sizes)
                out_sizes.append(sizes[i])
            if S > length[r]:
                out_sizes.append(S - length[r])  # the row's padding outputs: read by no span
    out_order = [source[i] if i in source else -1 - n for i, n in enumerate(sizes)]
    return SegmentRows(sizes, buckets, out_sizes, out_order)

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
