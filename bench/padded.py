"""The padded per-sequence update layout: the reference the packed path (packing.py) is measured
and tested against. Used by bench/train_step.py and tests/test_packing.py, not by training.

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


def token_logprobs(model, ids: torch.Tensor, temperature: float):
    """ids (B, T) → logp (B, T-1) of ids[:, 1:], entropy (B, T-1)."""
    return model(ids[:, :-1], targets=ids[:, 1:], temperature=temperature)


