"""trainer/packed_attention.py: the CPU path (SegmentRows) against SDPA with the dense mask (forward and
gradients, buckets); the CUDA path's block mask built from the row's structure against
create_block_mask on random packings, its memory and time on a 32k-token row, flex_attention with
it against SDPA, and the packed forward through it against the CPU path. ~60 s.

    python -m pytest -q tests/test_packed_attention.py
"""
import random
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainer import packed_attention
from trainer import packing
from trainer.packed_attention import segment_rows
from test_packing import V, make_model, make_trajs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import padded  # noqa: E402  (bench/padded.py: the dense mask reference)
from update_mfu import AllocatedBytes  # noqa: E402  (bench/update_mfu.py: storage bytes every op returns)


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
    mask = padded.dense_mask(packing.pad([r.doc for r in rows], -1, "cpu", width=T),
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


# -----------------------------------------------------------------------------
# the FlexAttention block mask built from the row's structure


def packed_rows(rng, budget=2048):
    """(doc, seg) (B, T) of one micro-batch of random packed units: shared prompts with G
    responses, single sequences, prompts and responses on 64/128-token block edges, padding."""
    seqs, prompt_lens = [], []
    for _ in range(rng.randint(1, 6)):
        P = rng.choice([0, 1, 128, 256, rng.randint(2, 40), rng.randint(41, 300)])
        prompt = [rng.randrange(V) for _ in range(P)]
        for _ in range(rng.choice([1, 1, rng.randint(2, 8)])):
            n = rng.choice([1, 64, 128, rng.randint(2, 300)])
            seqs.append((prompt + [rng.randrange(V) for _ in range(n)], [0] * P + [1] * n))
            prompt_lens.append(P)
    mb = rng.choice(packing.plan(seqs, prompt_lens, budget, rng.choice([0, 0, 300, 700])))
    width = max(len(r.ids) for r in mb.rows) + rng.choice([0, 0, rng.randint(1, 200)])  # padding
    return (packing.pad([r.doc for r in mb.rows], -1, "cpu", width=width),
            packing.pad([r.seg for r in mb.rows], 0, "cpu", width=width))


def block_sets(num, idx):
    """Per (b, h, query block): the set of kv block indices listed (the order may differ)."""
    B, H, nq = num.shape
    return [[[set(idx[b, h, q, :num[b, h, q]].tolist()) for q in range(nq)] for h in range(H)] for b in range(B)]


def test_block_mask_equals_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    rng = random.Random(0)
    n_full = n_partial = n_multi_row = 0
    for trial in range(24):
        doc, seg = packed_rows(rng, budget=2048 if trial % 6 == 0 else 768)
        B, T = doc.shape
        ref = create_block_mask(packed_attention.mask_mod_of(doc, seg), B, None, T, T, device="cpu")
        if trial < 6:  # the per-pair rule partial blocks keep is the dense mask's
            assert torch.equal(create_mask(packed_attention.mask_mod_of(doc, seg), B, 1, T, T, device="cpu"),
                               padded.dense_mask(doc, seg)), trial
        got = packed_attention.block_mask(doc, seg)
        assert got.seq_lengths == (T, T) and got.BLOCK_SIZE == ref.BLOCK_SIZE, trial
        assert torch.equal(got.to_dense(), ref.to_dense()), trial
        for kind in ("kv", "full_kv", "q", "full_q"):
            assert block_sets(getattr(got, f"{kind}_num_blocks"), getattr(got, f"{kind}_indices")) == \
                block_sets(getattr(ref, f"{kind}_num_blocks"), getattr(ref, f"{kind}_indices")), (trial, kind)
        n_full += int(ref.full_kv_num_blocks.sum())
        n_partial += int(ref.kv_num_blocks.sum())
        n_multi_row += B > 1
    assert n_full > 10 and n_partial > 100 and n_multi_row > 2  # the packings exercise every case


def test_block_mask_32k_row_memory_and_time():
    from torch.nn.attention.flex_attention import create_block_mask
    # the counter sees create_block_mask's (T, T) mask: at T=1024 over 1 MB
    doc, seg = packed_rows(random.Random(1), budget=1024)
    with AllocatedBytes() as ref_alloc:
        create_block_mask(packed_attention.mask_mod_of(doc, seg), doc.shape[0], None, doc.shape[1], doc.shape[1], device="cpu")
    assert ref_alloc.total > doc.shape[0] * doc.shape[1] ** 2
    # one 32768-token row: 4 units of a 2048-token prompt and 8 responses of 300-1100 tokens, padded
    rng = random.Random(2)
    seqs, prompt_lens = [], []
    for _ in range(4):
        prompt = [rng.randrange(V) for _ in range(2048)]
        for _ in range(8):
            n = rng.randint(300, 1100)
            seqs.append((prompt + [1] * n, [0] * 2048 + [1] * n))
            prompt_lens.append(2048)
    (mb,) = packing.plan(seqs, prompt_lens, 32768)
    assert len(mb.rows) == 1 and len(mb.rows[0].ids) > 24000
    doc = packing.pad([mb.rows[0].doc], -1, "cpu", width=32768)
    seg = packing.pad([mb.rows[0].seg], 0, "cpu", width=32768)
    with AllocatedBytes() as alloc:
        bm = packed_attention.block_mask(doc, seg)
    assert alloc.total < 256 * 2 ** 20, alloc.total
    assert bm.kv_num_blocks.shape == (1, 1, 256) and int(bm.full_kv_num_blocks.sum()) > 0
    # one thread: on this shared 2-core machine two OpenMP threads spend 10-20 ms per parallel op
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            packed_attention.block_mask(doc, seg)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    # ~0.1 s here; a mask built from (T, T) pairs at T = 32768 takes minutes (and ~10 GB). 10 s
    # leaves a loaded machine its delay and still tells the two apart
    assert min(times) < 10.0, times


def test_block_mask_rejects_a_non_contiguous_layout():
    doc = torch.tensor([[0, 0, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="contiguous"):
        packed_attention.block_mask(doc, torch.zeros_like(doc))
    doc = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="contiguous"):  # response 1 split by response 2
        packed_attention.block_mask(doc, torch.tensor([[0, 1, 1, 2, 2, 1]]))


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
def test_flex_attention_with_block_mask_equals_sdpa_with_dense_mask():
    """Uncompiled flex_attention (CPU) with block_mask == SDPA with the dense bool mask."""
    from torch.nn.attention.flex_attention import flex_attention
    doc, seg = packed_rows(random.Random(3), budget=512)
    B, T = doc.shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 4, T, 16, generator=g)
    k, v = torch.randn(B, 2, T, 16, generator=g), torch.randn(B, 2, T, 16, generator=g)
    got = flex_attention(q, k, v, block_mask=packed_attention.block_mask(doc, seg), enable_gqa=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=padded.dense_mask(doc, seg),
                                                            enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
def test_packed_forward_with_flex_rows_equals_segment_rows(monkeypatch):
    """The CUDA path on CPU: packing.forward with FlexRows (block_mask and uncompiled
    flex_attention; no backward on CPU) gives the CPU path's (SegmentRows) logprobs. Eager flex
    evaluates mask_mod on every pair (it ignores the block lists), so this checks the model path
    and the per-pair rule; the blocks are checked against create_block_mask above."""
    from torch.nn.attention.flex_attention import flex_attention
    model = make_model(seed=4)
    trajs = make_trajs(n_groups=12, G=4, seed=4)  # rows of 3 FlexAttention blocks
    (mb, *_) = packing.plan([(t.ids, t.loss_mask) for t in trajs], [len(t.prompt_ids) for t in trajs], 800, 330)
    assert len(mb.rows) > 1 and len(mb.rows[0].ids) > 256
    with torch.no_grad():
        segments, _ = packing.forward(model, mb, "cpu", 1.0)
        monkeypatch.setattr(packed_attention, "for_rows", packed_attention.flex_rows)
        monkeypatch.setattr(packed_attention, "_flex_attention", lambda: flex_attention)
        flex, _ = packing.forward(model, mb, "cpu", 1.0)
    assert torch.allclose(segments, flex, atol=1e-5), (segments - flex).abs().max()
