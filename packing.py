"""Shared-prompt packing: turn training sequences into padding-free micro-batch rows.

A GRPO group is G trajectories of one prompt. Training them as G padded rows computes the
prompt G times and pads every row to the longest one. Here a *unit* is one prompt followed by
its G responses (a "response" is everything after the prompt: sampled turns plus observation
tokens, the latter masked out of the loss but present as context):

    row:   [prompt P | response 1 | response 2 | ... | next unit's prompt | ...]
    each response attends to its prompt and to itself only (causal), never to its siblings;
    positions continue from the prompt's end for every response (RoPE sees what the sampler saw).

Units are packed, without padding, into rows of at most `budget` tokens (one row = one
micro-batch). A group that does not fit one row falls back to one unit per sequence (the plain
layout). A row holding a single sequence keeps plain causal attention (no mask). Groups are
detected by identical prompt ids, not assumed from the order.

Only loss tokens are scored: the LM head and log-softmax run on the positions whose next token
is in the loss mask (the prompt's last position predicts the first token of each of the G
responses, so it is listed G times).

    python -m pytest -q tests/test_packing.py
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from distributed import all_max
from segment_attention import segment_rows


# -----------------------------------------------------------------------------
# padded tensors (the one place lists of rows become a rectangle)


def pad(rows: list[list], value, device, dtype=torch.long, width: int = 0) -> torch.Tensor:
    """Rows of different lengths -> (len(rows), max(longest, width)) tensor, right-padded with `value`."""
    T = max(max((len(r) for r in rows), default=0), width)
    out = torch.full((len(rows), T), value, dtype=dtype, device=device)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=dtype, device=device)
    return out


def pad_flat(values: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """(sum(counts),) -> (len(counts), max(counts)) zero-padded, differentiable (index_copy)."""
    n, L = len(counts), max(counts, default=0)
    dest = torch.cat([torch.arange(c, device=values.device) + k * L for k, c in enumerate(counts)]) \
        if counts else torch.zeros(0, dtype=torch.long, device=values.device)
    return values.new_zeros(n * L).index_copy(0, dest, values).view(n, L)


# -----------------------------------------------------------------------------
# the plan: sequences -> units -> rows


@dataclass
class Row:
    """One packed micro-batch row, as python lists (tensors are built by `inputs`)."""
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    doc: list[int] = field(default_factory=list)  # unit index within the row, per token
    seg: list[int] = field(default_factory=list)  # 0 = shared prompt, j + 1 = response j of its unit
    src: list[int] = field(default_factory=list)  # per loss token: the row position that predicts it
    tgt: list[int] = field(default_factory=list)  # per loss token: its token id
    members: list[int] = field(default_factory=list)  # caller's sequence indices, in row order
    counts: list[int] = field(default_factory=list)  # loss tokens per member (member order)

    @property
    def plain(self) -> bool:  # a single sequence: plain causal attention
        return max(self.seg, default=0) == 0 and len(set(self.doc)) <= 1


def units(seqs: list[tuple[list[int], list[int]]], prompt_lens: list[int], budget: int):
    """(shared prefix length, member indices) per unit. Sequences whose first prompt_lens[i]
    ids are identical form one unit if it fits `budget`; otherwise each is its own unit."""
    groups: dict[tuple, list[int]] = {}
    for i, (ids, _) in enumerate(seqs):
        P = prompt_lens[i] if 0 < prompt_lens[i] < len(ids) else 0
        groups.setdefault((P, tuple(ids[:P])) if P else ("solo", i), []).append(i)
    out = []
    for key, members in groups.items():
        P = key[0] if key[0] != "solo" else 0
        size = P + sum(len(seqs[i][0]) - P for i in members)
        if P and len(members) > 1 and size <= budget:
            out.append((P, members))
        else:  # plain layout: the whole sequence is one segment
            out.extend((len(seqs[i][0]), [i]) for i in members)
    return out


def shared_prefix_lens(seqs: list[tuple[list[int], list[int]]]) -> list[int]:
    """prompt_lens for sequences of *different* prompts (SFT): groups whose members share their
    first P ids (the system prompt and a database's schema), chosen to maximise the tokens computed
    once; 0 for a sequence left alone. A prefix stops at a sequence's first loss token.

    Sorted by prompt, the best groups are contiguous runs: a group's shared length is the
    smallest common prefix of neighbours in the run, and a dynamic program over the split points
    (n² for n sequences of a micro-batch) picks the runs saving the most tokens."""
    n = len(seqs)
    limit = [mask.index(1) if 1 in mask else len(ids) - 1 for ids, mask in seqs]
    order = sorted(range(n), key=lambda i: seqs[i][0][:limit[i]])
    lcp = []  # lcp[k]: common prefix of order[k] and order[k + 1], within both limits
    for a, b in zip(order, order[1:]):
        x, y, m = seqs[a][0], seqs[b][0], min(limit[a], limit[b])
        k = 0
        while k < m and x[k] == y[k]:
            k += 1
        lcp.append(k)
    best, start = [0] * (n + 1), list(range(-1, n))  # best[j]: tokens saved over order[:j]
    for j in range(1, n + 1):
        best[j], start[j], m = best[j - 1], j - 1, 1 << 62
        for i in range(j - 2, -1, -1):  # the run order[i:j] shares min(lcp[i:j-1]) tokens
            m = min(m, lcp[i])
            if m == 0:
                break
            if best[i] + (j - i - 1) * m > best[j]:
                best[j], start[j] = best[i] + (j - i - 1) * m, i
    out, j = [0] * n, n
    while j > 0:
        i = start[j]
        shared = min(lcp[i:j - 1]) if j - i > 1 else 0
        for k in range(i, j):
            out[order[k]] = shared
        j = i
    return out


@dataclass
class MicroBatch:
    """Rows forwarded together as one (B, T) batch, right-padded to the longest row."""
    rows: list[Row]

    @property
    def members(self) -> list[int]:
        return [i for r in self.rows for i in r.members]

    @property
    def counts(self) -> list[int]:
        return [c for r in self.rows for c in r.counts]


def plan(seqs: list[tuple[list[int], list[int]]], prompt_lens: list[int] | None, budget: int,
         row_tokens: int = 0) -> list[MicroBatch]:
    """Micro-batches of ≤ `budget` tokens (rows × longest row) made of rows of ≤ `row_tokens`
    (0: = budget, one row per micro-batch); a unit larger than a row gets a row of its own.
    Rows are filled first-fit over units taken longest first. seqs: (ids, loss_mask) lists.

    Why rows shorter than the budget: without a block-sparse kernel (CPU: SDPA with a dense
    mask) attention costs T² per row, so long rows waste it on masked pairs; FlexAttention on
    CUDA skips masked blocks and one row per micro-batch is best there."""
    prompt_lens = prompt_lens or [0] * len(seqs)
    row_tokens = min(row_tokens or budget, budget)
    us = units(seqs, prompt_lens, row_tokens)
    size = [P + sum(len(seqs[i][0]) - P for i in m) for P, m in us]
    rows: list[Row] = []
    for u in sorted(range(len(us)), key=lambda u: -size[u]):
        row = next((r for r in rows if len(r.ids) + size[u] <= row_tokens), None)
        if row is None:
            row = Row()
            rows.append(row)
        _append(row, seqs, *us[u])
    mbs: list[MicroBatch] = []
    for row in sorted(rows, key=lambda r: -len(r.ids)):  # longest first: rows[0] sets the width
        if not mbs or len(mbs[-1].rows[0].ids) * (len(mbs[-1].rows) + 1) > budget:
            mbs.append(MicroBatch([]))
        mbs[-1].rows.append(row)
    return mbs


def _append(row: Row, seqs, P: int, members: list[int]):
    doc, off = (row.doc[-1] + 1 if row.doc else 0), len(row.ids)
    prompt = seqs[members[0]][0][:P]
    row.ids += prompt
    row.positions += range(P)
    row.doc += [doc] * P
    row.seg += [0] * P
    for j, i in enumerate(members):
        ids, mask = seqs[i]
        start = len(row.ids)  # row position of this member's token P
        row.ids += ids[P:]
        row.positions += range(P, len(ids))
        row.doc += [doc] * (len(ids) - P)
        row.seg += [j + 1] * (len(ids) - P)
        n = 0
        for t in range(1, len(ids)):
            if mask[t]:  # token t is predicted by token t - 1
                row.src.append(off + t - 1 if t - 1 < P else start + t - 1 - P)
                row.tgt.append(ids[t])
                n += 1
        row.members.append(i)
        row.counts.append(n)


# -----------------------------------------------------------------------------
# tensors and the forward

FLEX_BLOCK = 128  # FlexAttention's default block size (tokens)
# CPU: True = SDPA with attention_mask's dense (B, 1, T, T) mask, the layout segment_attention.py
# replaced (T² pairs per row, computed masked or not); kept as the reference bench/cpu_step.py
# and the tests compare against
CPU_DENSE_MASK = False


def attention_mask(doc: torch.Tensor, seg: torch.Tensor):
    """doc, seg (B, T). Query q may see key k iff same unit, k <= q, and k is in the prompt or in
    q's own response. CUDA: a FlexAttention BlockMask (fused, skips masked blocks, never a
    (T, T) matrix; `block_mask`); else a (B, 1, T, T) bool tensor for SDPA."""
    if doc.is_cuda:
        return block_mask(doc, seg)
    ar = torch.arange(doc.shape[1], device=doc.device)
    causal = ar[None, :] <= ar[:, None]  # (T, T)
    same = doc[:, :, None] == doc[:, None, :]  # (B, T, T)
    own = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])
    return (same & causal & own)[:, None]


def forward(model, mb: MicroBatch, device, temperature: float):
    """Logprobs and entropies of the micro-batch's loss tokens, each (N,), in member order."""
    rows = mb.rows
    plain = all(r.plain for r in rows)  # one sequence per row: causal, right padding is harmless
    width = max(len(r.ids) for r in rows)
    if torch.device(device).type == "cuda" and not plain:
        # FlexAttention is compiled per shape: widths rounded up to its 128-token block keep the
        # number of distinct shapes (and compiles) small
        width = -(-width // FLEX_BLOCK) * FLEX_BLOCK
    ids = pad([r.ids for r in rows], 0, device, width=width)  # (B, T)
    pos = pad([r.positions for r in rows], 0, device, width=width)
    B, T = ids.shape
    if plain:
        mask = None
    elif torch.device(device).type == "cpu" and not CPU_DENSE_MASK:
        # CPU: each sequence its own causal attention row (segment_attention.py), never T² pairs
        mask = segment_rows([r.doc for r in rows], [r.seg for r in rows], width, device)
    else:  # padding tokens form their own unit (doc -1): they see only each other, so no row is empty
        mask = attention_mask(pad([r.doc for r in rows], -1, device, width=width),
                              pad([r.seg for r in rows], 0, device, width=width))
    src = torch.tensor([b * T + s for b, r in enumerate(rows) for s in r.src], dtype=torch.long, device=device)
    tgt = torch.tensor([t for r in rows for t in r.tgt], dtype=torch.long, device=device)
    return model(ids, positions=pos, targets=tgt, temperature=temperature, attn_mask=mask, loss_index=src)


# -----------------------------------------------------------------------------
# micro-batch accumulation under FSDP2


def pad_to_same_count(mbs: list, device) -> list:
    """FSDP2 needs every rank to run the same number of forward/backward passes: None fills in."""
    n = all_max(len(mbs), device)
    return list(mbs) + [None] * (n - len(mbs))


def dummy(device):
    return torch.zeros(1, 2, dtype=torch.long, device=device)


def dummy_backward(model, device):
    """A zero-weight forward/backward: keeps this rank's FSDP2 collectives in step with the others."""
    lp, _ = model(dummy(device)[:, :-1], targets=dummy(device)[:, 1:])
    (lp * 0).sum().backward()


def each_micro_batch(model, mbs: list, device, *, backward: bool):
    """Yield this rank's micro-batches in order; where another rank has more, run a dummy pass
    instead (FSDP2's collectives must match across ranks): forward only when the caller scores
    without gradients (backward=False), forward + zero backward when it accumulates a loss. The
    one accumulation loop of the update, old/ref logprobs and the SFT loss."""
    for mb in pad_to_same_count(mbs, device):
        if mb is None:
            if backward:
                dummy_backward(model, device)
            else:
                model(dummy(device))
            continue
        yield mb


# -----------------------------------------------------------------------------
# the FlexAttention block mask, from the row's structure


def mask_mod_of(doc: torch.Tensor, seg: torch.Tensor):
    """FlexAttention's mask_mod for rows (B, T): same unit, causal, prompt or own response."""
    def mask_mod(b, h, q, k):
        return (doc[b, q] == doc[b, k]) & (k <= q) & ((seg[b, k] == 0) | (seg[b, k] == seg[b, q]))
    return mask_mod


def block_mask(doc: torch.Tensor, seg: torch.Tensor):
    """The FlexAttention BlockMask of `attention_mask`'s rule for rows doc, seg (B, T), built from
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
