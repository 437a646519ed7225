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
    (T, T) matrix); else a (B, 1, T, T) bool tensor for SDPA."""
    if doc.is_cuda:
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q, k):
            return (doc[b, q] == doc[b, k]) & (k <= q) & ((seg[b, k] == 0) | (seg[b, k] == seg[b, q]))
        B, T = doc.shape
        return create_block_mask(mask_mod, B, None, T, T, device=doc.device)
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
