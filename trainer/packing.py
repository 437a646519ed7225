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
responses, so it is listed G times). Who attends to whom inside a row is trainer/packed_attention.py's
(chosen by device); the FSDP2 rule that every rank runs as many passes is
distributed.each_micro_batch's.

    python -m pytest -q tests/test_packing.py
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainer import packed_attention


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
# the forward


def forward(model, mb: MicroBatch, device, temperature: float):
    """Logprobs and entropies of the micro-batch's loss tokens, each (N,), in member order."""
    rows = mb.rows
    plain = all(r.plain for r in rows)  # one sequence per row: causal, right padding is harmless
    longest = max(len(r.ids) for r in rows)
    width = longest if plain else packed_attention.width(longest, device)
    ids = pad([r.ids for r in rows], 0, device, width=width)  # (B, T)
    pos = pad([r.positions for r in rows], 0, device, width=width)
    B, T = ids.shape
    attention = None if plain else packed_attention.for_rows([r.doc for r in rows], [r.seg for r in rows], width,
                                                             device)
    src = torch.tensor([b * T + s for b, r in enumerate(rows) for s in r.src], dtype=torch.long, device=device)
    tgt = torch.tensor([t for r in rows for t in r.tgt], dtype=torch.long, device=device)
    return model(ids, tgt, positions=pos, attention=attention, loss_index=src, temperature=temperature)
