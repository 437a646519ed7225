"""The padded per-sequence update layout and the dense attention mask: the references the packed
path (trainer/packing.py, trainer/packed_attention.py) is measured and tested against. Used by bench/ and tests/,
not by training.

    for mb in pack([len(t.ids) for t in trajs], budget):      # micro-batches of sequence indices
        lp, ent = token_logprobs(model, ids, temperature)    # ids (B, T) padded
"""
from __future__ import annotations

import torch


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Micro-batches of sequence indices, longest first, padded size ≤ budget tokens (≥ 1 seq each).
    The padded per-sequence layout: kept as the reference the packed path is measured against."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    mbs, cur = [], []
    for i in order:
        if cur and lengths[cur[0]] * (len(cur) + 1) > budget:
            mbs.append(cur)
            cur = []
        cur.append(i)
    return mbs + ([cur] if cur else [])


def dense_mask(doc: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """The packed rows' attention rule as a dense (B, 1, T, T) bool mask for SDPA (True = may
    attend), the reference trainer/packed_attention.py is tested against. doc, seg (B, T): query q may see
    key k iff same unit, k <= q, and k is in the prompt (seg 0) or in q's own response."""
    ar = torch.arange(doc.shape[1], device=doc.device)
    causal = ar[None, :] <= ar[:, None]  # (T, T)
    same = doc[:, :, None] == doc[:, None, :]  # (B, T, T)
    own = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])
    return (same & causal & own)[:, None]


def token_logprobs(model, ids: torch.Tensor, temperature: float):
    """ids (B, T) → logp (B, T-1) of ids[:, 1:], entropy (B, T-1)."""
    return model(ids[:, :-1], targets=ids[:, 1:], temperature=temperature)


