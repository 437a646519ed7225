"""The CPU packed attention (segment_attention.py) against SDPA with packing's dense mask, and the
SFT prefix sharing (packing.shared_prefix_lens) against per-sequence scoring. ~10 s.

    python -m pytest -q tests/test_segment_attention.py
"""
import random

import pytest
import torch
import torch.nn.functional as F

import packing
import sft
from segment_attention import segment_rows
from test_packing import V, make_model, make_trajs


def random_rows(seed):
    """Packed rows as packing.plan builds them: units of a prompt + responses, lone sequences."""
    trajs = make_trajs(n_groups=4, G=3, seed=seed)
    seqs = [(t.ids, t.loss_mask) for t in trajs]
    lens = [len(t.prompt_ids) for t in trajs]
    lens[0] = 0  # one sequence outside its group: a unit of one in a row with others
    return [r for mb in packing.plan(seqs, lens, budget=10_000, row_tokens=45) for r in mb.rows]


@pytest.mark.parametrize("seed", [0, 1])
def test_attend_equals_dense_mask_forward_and_backward(seed):
    rows = random_rows(seed)
    assert len(rows) > 1 and any(len(set(r.doc)) > 1 for r in rows) and any(max(r.seg) > 0 for r in rows)
    B, T, H, Hk, D = len(rows), max(len(r.ids) for r in rows), 4, 2, 8
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, h, D, generator=g, requires_grad=True) for h in (H, Hk, Hk))
    mask = packing.attention_mask(packing.pad([r.doc for r in rows], -1, "cpu", width=T),
                                  packing.pad([r.seg for r in rows], 0, "cpu", width=T))
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, enable_gqa=True).transpose(1, 2)
    out = segment_rows([r.doc for r in rows], [r.seg for r in rows], T, "cpu").attend(q, k, v)
    real = packing.pad([[1] * len(r.ids) for r in rows], 0, "cpu", width=T).bool()  # (B, T): not padding
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)
    w = torch.randn(B, T, H, D, generator=g) * real[..., None, None]  # loss on real tokens only
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_buckets_cut_padding():
    # lengths 20, 19 and 5, 5: two buckets, neither padded past its own longest row
    docs = [[0] * 20 + [1] * 5, [0] * 19 + [1] * 5]
    layout = segment_rows(docs, [[0] * 25, [0] * 24], 25, "cpu")
    assert sorted(tuple(x.shape) for x in layout.gather) == [(2, 5), (2, 20)]


def test_packed_forward_segments_equal_dense():
    model = make_model(qk_norm=True)
    trajs = make_trajs(seed=3)
    seqs = [(t.ids, t.loss_mask) for t in trajs]
    mbs = packing.plan(seqs, [len(t.prompt_ids) for t in trajs], budget=200, row_tokens=70)
    with torch.no_grad():
        for mb in mbs:
            new, _ = packing.forward(model, mb, "cpu", 0.7)
            packing.CPU_DENSE_MASK = True
            try:
                old, _ = packing.forward(model, mb, "cpu", 0.7)
            finally:
                packing.CPU_DENSE_MASK = False
            torch.testing.assert_close(new, old, atol=1e-5, rtol=1e-5)


# -----------------------------------------------------------------------------
# SFT: prefixes shared across different prompts


def test_shared_prefix_lens_groups_common_starts():
    sys_ = [1, 2, 3]
    seqs = [(sys_ + [10, 11, 12, 20], [0] * 6 + [1]),  # schema A, question 20
            (sys_ + [10, 11, 12, 21, 5], [0] * 6 + [1, 1]),  # schema A, question 21
            (sys_ + [40, 41, 42], [0] * 5 + [1]),  # schema B: only the system prompt in common
            ([7, 8, 9], [0, 1, 1])]  # nothing in common
    lens = packing.shared_prefix_lens(seqs)
    # best: A's two share 6 tokens (saves 6); adding B to them would share 3 x 2 = 6, no better
    # than 6 + 0; the prefix never reaches a loss token
    assert lens[0] == lens[1] == 6 and lens[3] == 0
    assert lens[2] in (0, 3)
    # a prefix stops at the first loss token
    assert packing.shared_prefix_lens([([1, 2, 3, 4], [0, 1, 1, 1]), ([1, 2, 3, 5], [0, 1, 1, 1])]) == [1, 1]


def test_sft_loss_with_shared_prefixes_equals_per_sequence():
    model = make_model()
    rng = random.Random(0)
    system = [rng.randrange(V) for _ in range(6)]
    schemas = [[rng.randrange(V) for _ in range(5)] for _ in range(2)]
    seqs = []
    for i in range(7):
        prompt = system + schemas[i % 2] + [rng.randrange(V) for _ in range(rng.randint(1, 4))]
        resp = [rng.randrange(V) for _ in range(rng.randint(2, 6))]
        seqs.append((prompt + resp, [0] * len(prompt) + [1] * len(resp)))
    lens = packing.shared_prefix_lens(seqs)
    assert min(lens) >= 6 and max(lens) >= 11  # every prompt shares the system part, some a schema too
    mb, = packing.plan(seqs, lens, budget=1 << 30)
    assert len(mb.rows[0].ids) < sum(len(s[0]) for s in seqs) - 5 * 6  # prefixes computed once
    with torch.no_grad():
        total = sft.sft_loss_sum(model, seqs)
        ref = 0.0
        for ids, mask in seqs:
            lp, _ = model(torch.tensor([ids[:-1]]), targets=torch.tensor([ids[1:]]))
            ref += -(lp[0] * torch.tensor(mask[1:])).sum()
    torch.testing.assert_close(total, ref, atol=1e-4, rtol=1e-5)
