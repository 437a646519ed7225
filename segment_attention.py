"""CPU attention for packed rows: every sequence gathered into its own short causal row.

A packed row (packing.py) holds units [prompt | response 1 | ... | response G] back to back;
each response attends to its unit's prompt and to itself. SDPA with a dense (B, 1, T, T) mask
computes all T² pairs of a row (the CPU flash kernel skips nothing), almost all of them masked:
a 16k-token row of 134-token sequences is >99% masked pairs. Here attention runs instead on
*attention rows*, one per sequence, [prompt | own response], right-padded and plainly causal
(`is_causal`, the flash kernel's cheap case). Only attention sees this layout: the projections,
MLP, norms and LM head still run once per packed token, so a shared prompt is computed once in
every linear layer (repeated only as attention keys/queries, where it costs P² per response).

    layout = segment_rows(docs, segs, T, device)   # per micro-batch, from packing's row lists
    y = layout.attend(q, k, v)                     # q (B, T, H, D), k/v (B, T, Hk, D) -> (B, T, H, D)

Attention rows are sorted by length and cut into buckets (one SDPA call each) whose rows are at
least BUCKET_FILL of the bucket's longest, so padding stays small when lengths vary (multi-turn).
A shared prompt's own outputs come from its unit's first attention row (they are the same in
every row: a causal prompt sees only itself). Numerically the same softmax over the same keys
as the dense mask, up to float summation order (~1e-6 in fp32).

Tests: pytest tests/test_packing.py tests/test_segment_attention.py
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# a bucket's shortest row is at least this fraction of its longest: on the tiny config's GRPO
# batch (rows of 72-168 tokens) 0.9 pads 9% over the causal pairs (0.75: 29%) in ~5 SDPA calls
# per micro-batch and layer
BUCKET_FILL = 0.9

# -----------------------------------------------------------------------------
# the layout


@dataclass
class SegmentRows:
    """Where each packed token sits in the attention rows. Passed to the model as its attn_mask."""
    gather: list[torch.Tensor]  # per bucket (R, S) long: flat packed index b*T + t of attention row r's token s
    scatter: torch.Tensor  # (B*T,) long: index into the buckets' concatenated (R*S) outputs, per packed token

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
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
