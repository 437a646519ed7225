"""Shared-prompt packing (packing.py) against the padded per-sequence path it replaces: the same
per-token logprobs and entropies, and through train.update the same loss and gradients for every
loss aggregation, ppo_epochs × mini_batches, kl_beta > 0, activation checkpointing, multi-turn
trajectories (observation tokens masked), groups that fall back to the plain layout. The
FlexAttention block mask built from the row's structure against create_block_mask on random
packings, its memory and time on a 32k-token row, and flex_attention with it against SDPA. ~60 s.

    python -m pytest -q tests/test_packing.py
"""
import copy
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import config as C
import grpo
import packing
from conftest import grpo_update
from model import ModelArgs, Transformer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import padded  # noqa: E402  (bench/padded.py: the padded reference layout)

V = 97


def make_model(seed=0, qk_norm=False):
    torch.manual_seed(seed)
    a = ModelArgs(model_type="qwen2", vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, qkv_bias=True, qk_norm=qk_norm)
    m = Transformer(a)
    for p in m.parameters():  # non-trivial weights (biases, norms) so any mask/position error shows
        torch.nn.init.normal_(p, std=0.3)
    return m.float()


def make_trajs(n_groups=3, G=4, seed=0, multi_turn=True):
    """Groups of G trajectories sharing a prompt; responses of different lengths with observation
    tokens (mask 0) between sampled turns; a few with an empty loss."""
    rng = random.Random(seed)
    trajs = []
    for g in range(n_groups):
        prompt = [rng.randrange(V) for _ in range(rng.randint(5, 12))]
        for s in range(G):
            ids, mask = list(prompt), [0] * len(prompt)
            for turn in range(rng.randint(1, 3) if multi_turn else 1):
                k = rng.randint(1, 6)
                ids += [rng.randrange(V) for _ in range(k)]
                mask += [1] * k
                if multi_turn and turn < 2:
                    k = rng.randint(1, 4)  # observation: context, not loss
                    ids += [rng.randrange(V) for _ in range(k)]
                    mask += [0] * k
            logprobs = [-rng.random() if m else 0.0 for m in mask]
            trajs.append(SimpleNamespace(prompt_ids=prompt, ids=ids, loss_mask=mask, logprobs=logprobs))
    rng.shuffle(trajs)  # groups are found by identical prompt ids, not by order
    return trajs


# -----------------------------------------------------------------------------
# the model: packed rows score exactly like padded rows


@pytest.mark.parametrize("budget,row_tokens", [(10_000, 0), (40, 0), (200, 70)])
def test_packed_logprobs_equal_padded(budget, row_tokens):
    model = make_model(qk_norm=True)
    trajs = make_trajs()
    seqs = [(t.ids, t.loss_mask) for t in trajs]
    mbs = packing.plan(seqs, [len(t.prompt_ids) for t in trajs], budget, row_tokens)
    assert sorted(i for mb in mbs for i in mb.members) == list(range(len(trajs)))
    limit = row_tokens or budget
    for mb in mbs:  # rows ≤ their limit unless a single sequence; micro-batches ≤ budget unless one row
        assert all(len(r.ids) <= limit or len(r.members) == 1 for r in mb.rows)
        assert len(mb.rows) == 1 or len(mb.rows) * max(len(r.ids) for r in mb.rows) <= budget
    if budget == 10_000:  # everything in one row, each group's prompt computed once
        assert len(mbs) == 1 and len(mbs[0].rows[0].ids) < sum(len(t.ids) for t in trajs)
    if row_tokens:
        assert any(len(mb.rows) > 1 for mb in mbs)  # several padded rows in one micro-batch
    with torch.no_grad():
        ids = packing.pad([t.ids for t in trajs], 0, "cpu")
        ref_lp, ref_ent = padded.token_logprobs(model, ids, 0.7)
        for mb in mbs:
            lp, ent = packing.forward(model, mb, "cpu", 0.7)
            for i, a, b in zip(mb.members, lp.split(mb.counts), ent.split(mb.counts)):
                m = torch.tensor(trajs[i].loss_mask[1:], dtype=torch.bool)
                assert a.shape[0] == int(m.sum())
                torch.testing.assert_close(a, ref_lp[i, :len(m)][m], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(b, ref_ent[i, :len(m)][m], atol=1e-5, rtol=1e-5)


def test_plain_row_uses_no_mask_and_plan_groups_by_prompt_ids():
    seqs = [([1, 2, 3, 4], [0, 0, 1, 1]), ([1, 2, 5], [0, 0, 1]), ([9, 2, 3], [0, 0, 1])]
    mb, = packing.plan(seqs, [2, 2, 2], budget=100)
    row, = mb.rows
    assert row.members == [0, 1, 2] and row.ids == [1, 2, 3, 4, 5, 9, 2, 3]
    assert row.positions == [0, 1, 2, 3, 2, 0, 1, 2] and row.seg == [0, 0, 1, 1, 2, 0, 0, 0]  # a lone sequence: one segment
    # loss token 3 of seq 0 and token 5 of seq 1 are both predicted by the shared prompt's last token
    assert row.src[0] == 1 and row.src[2] == 1 and row.counts == [2, 1, 1]
    solo, = packing.plan([seqs[0]], None, budget=100)
    assert solo.rows[0].plain and not row.plain
    m = packing.attention_mask(torch.tensor([row.doc]), torch.tensor([row.seg]))[0, 0]
    assert m[4].tolist() == [True, True, False, False, True, False, False, False]  # 5 sees prompt, self


def test_fp32_lm_head_matches_fp32_model_in_bf16():
    model = make_model()
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        ref, _ = model(ids[:, :-1], targets=ids[:, 1:])
        bf = copy.deepcopy(model).to(torch.bfloat16)
        lo, _ = bf(ids[:, :-1], targets=ids[:, 1:])
        bf.fp32_lm_head = True
        hi, _ = bf(ids[:, :-1], targets=ids[:, 1:])
    # the head in fp32 removes the head's bf16 rounding: closer to the fp32 model
    assert (hi - ref).abs().mean() < (lo - ref).abs().mean()


# -----------------------------------------------------------------------------
# train.update: packed gradients equal the padded per-sequence reference


class Capture:
    """An optimizer that records the gradients at each step instead of stepping."""

    def __init__(self, model):
        self.model, self.grads = model, []

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self):
        self.grads.append([p.grad.clone() for p in self.model.parameters()])


def reference_update(model, ref_model, trajs, adv, cfg):
    """The padded per-sequence path: one row per trajectory, old/ref logprobs per trajectory."""
    g, T = cfg.grpo, cfg.sampling.temperature
    need_old = g.ppo_epochs * g.mini_batches > 1
    with torch.no_grad():
        old = [padded.token_logprobs(model, torch.tensor([t.ids]), T)[0][0] for t in trajs]
        ref = [padded.token_logprobs(ref_model, torch.tensor([t.ids]), T)[0][0] for t in trajs] if ref_model else None
    grads, n = [], len(trajs)
    for _ in range(g.ppo_epochs):
        bounds = [round(k * n / g.mini_batches) for k in range(g.mini_batches + 1)]
        for k in range(g.mini_batches):
            idx = list(range(bounds[k], bounds[k + 1]))
            masks = [torch.tensor(trajs[i].loss_mask[1:], dtype=torch.float32) for i in idx]
            norm = grpo.global_norm(masks, g.loss_agg)
            model.zero_grad(set_to_none=True)
            ids = packing.pad([trajs[i].ids for i in idx], 0, "cpu")
            mask = packing.pad([trajs[i].loss_mask for i in idx], 0, "cpu", torch.float32)[:, 1:]
            lp, ent = padded.token_logprobs(model, ids, T)
            old_lp = packing.pad([old[i].tolist() for i in idx], 0.0, "cpu", torch.float32) if need_old else lp.detach()
            ref_lp = packing.pad([ref[i].tolist() for i in idx], 0.0, "cpu", torch.float32) if ref else None
            rollout_lp = packing.pad([trajs[i].logprobs[1:] for i in idx], 0.0, "cpu", torch.float32)
            loss, _ = grpo.policy_loss(lp, old_lp, adv[idx], mask, ref_logp=ref_lp, rollout_logp=rollout_lp,
                                       norm=norm, entropy=ent, **grpo.loss_kwargs(g, cfg.sampling.max_context))
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            # the same (plain SGD) step update() takes, so later mini-batches see the same weights
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
    return grads


class SGDCapture(Capture):
    def step(self):
        super().step()
        with torch.no_grad():
            for p in self.model.parameters():
                p -= 0.05 * p.grad


# (aggregation, ppo_epochs, mini_batches, kl_beta, activation checkpointing, loss, rollout IS)
CASES = [(agg, 1, 1, 0.0, False, "grpo", "none") for agg in grpo.AGGS] + [
    ("token-mean", 2, 1, 0.0, False, "grpo", "none"), ("token-mean", 1, 2, 0.0, True, "grpo", "none"),
    ("seq-mean-token-mean", 2, 2, 0.1, False, "grpo", "none"), ("drgrpo", 2, 3, 0.1, True, "grpo", "none"),
    ("seq-mean-token-mean", 2, 1, 0.0, False, "gspo", "none"), ("token-mean", 1, 2, 0.0, False, "gspo-token", "seq-tis"),
    ("token-mean", 2, 2, 0.0, False, "cispo", "token-tis"), ("token-mean", 1, 1, 0.0, False, "grpo", "geo-mask")]


@pytest.mark.parametrize("agg,epochs,minis,kl,ckpt,loss,rollout_is", CASES)
def test_update_gradients_equal_padded_reference(agg, epochs, minis, kl, ckpt, loss, rollout_is):
    trajs = make_trajs(seed=1)
    adv = torch.randn(len(trajs), generator=torch.Generator().manual_seed(0))
    cfg = C.load_config([f"--grpo.loss={loss}", f"--grpo.rollout_is={rollout_is}", "--grpo.rollout_is_delta=0.5",
                         f"--grpo.loss_agg={agg}", f"--grpo.ppo_epochs={epochs}", f"--grpo.mini_batches={minis}",
                         f"--grpo.kl_beta={kl}", "--grpo.drgrpo_max_len=64", "--optim.grad_clip=1e9",
                         "--optim.micro_batch_tokens=60", f"--optim.pack_row_tokens={30 if ckpt else 0}",
                         "--sampling.temperature=0.9"])
    model = make_model(1)
    ref_model = make_model(2) if kl > 0 else None
    ref_copy = copy.deepcopy(model)
    opt = SGDCapture(model)
    model.set_activation_checkpointing(ckpt)
    sch = SimpleNamespace(step=lambda: None)
    out = grpo_update(model, ref_model, opt, sch, trajs, adv, cfg)
    want = reference_update(ref_copy, ref_model, trajs, adv, cfg)
    assert len(opt.grads) == len(want) == epochs * minis and out["skipped"] == 0.0
    for got_step, want_step in zip(opt.grads, want):
        for a, b in zip(got_step, want_step):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert all(p.grad is None for p in model.parameters())  # freed after the optimizer step


# -----------------------------------------------------------------------------
# 2 ranks (FSDP2, gloo): the packed update's gradients equal one process's


def test_update_two_ranks_equal_one_process(tmp_path):
    import subprocess
    import sys

    import update_dist_check
    from conftest import ROOT, torchrun_env
    ref_file = tmp_path / "reference.pt"
    torch.save([update_dist_check.reference(case) for case in update_dist_check.CASES], ref_file)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "update_dist_check.py"), str(ref_file)]
    p = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    results = [line for line in out.splitlines() if line.startswith("RESULT")]
    assert p.returncode == 0 and len(results) == len(update_dist_check.CASES) * len(update_dist_check.UNITS), \
        out[-4000:]
    assert all(line.endswith(" ok") for line in results), results


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
        ref = create_block_mask(packing.mask_mod_of(doc, seg), B, None, T, T, device="cpu")
        if trial < 6:  # the per-pair rule partial blocks keep is attention_mask's
            assert torch.equal(create_mask(packing.mask_mod_of(doc, seg), B, 1, T, T, device="cpu"),
                               packing.attention_mask(doc, seg)), trial
        got = packing.block_mask(doc, seg)
        assert got.seq_lengths == (T, T) and got.BLOCK_SIZE == ref.BLOCK_SIZE, trial
        assert torch.equal(got.to_dense(), ref.to_dense()), trial
        for kind in ("kv", "full_kv", "q", "full_q"):
            assert block_sets(getattr(got, f"{kind}_num_blocks"), getattr(got, f"{kind}_indices")) == \
                block_sets(getattr(ref, f"{kind}_num_blocks"), getattr(ref, f"{kind}_indices")), (trial, kind)
        n_full += int(ref.full_kv_num_blocks.sum())
        n_partial += int(ref.kv_num_blocks.sum())
        n_multi_row += B > 1
    assert n_full > 10 and n_partial > 100 and n_multi_row > 2  # the packings exercise every case


class AllocatedBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Sums the storage bytes every op returns (views excluded): a bound on peak tensor memory."""
    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t._is_view():
                self.total += t.untyped_storage().nbytes()
        return out


def test_block_mask_32k_row_memory_and_time():
    from torch.nn.attention.flex_attention import create_block_mask
    # the counter sees create_block_mask's (T, T) mask: at T=1024 over 1 MB
    doc, seg = packed_rows(random.Random(1), budget=1024)
    with AllocatedBytes() as ref_alloc:
        create_block_mask(packing.mask_mod_of(doc, seg), doc.shape[0], None, doc.shape[1], doc.shape[1], device="cpu")
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
        bm = packing.block_mask(doc, seg)
    assert alloc.total < 256 * 2 ** 20, alloc.total
    assert bm.kv_num_blocks.shape == (1, 1, 256) and int(bm.full_kv_num_blocks.sum()) > 0
    # one thread: on this shared 2-core machine two OpenMP threads spend 10-20 ms per parallel op
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            packing.block_mask(doc, seg)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    assert min(times) < 2.0, times


def test_block_mask_rejects_a_non_contiguous_layout():
    doc = torch.tensor([[0, 0, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="contiguous"):
        packing.block_mask(doc, torch.zeros_like(doc))
    doc = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="contiguous"):  # response 1 split by response 2
        packing.block_mask(doc, torch.tensor([[0, 1, 1, 2, 2, 1]]))


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
def test_flex_attention_with_block_mask_equals_sdpa_with_dense_mask():
    """Uncompiled flex_attention (CPU) with block_mask == SDPA with attention_mask's bool mask."""
    from torch.nn.attention.flex_attention import flex_attention
    doc, seg = packed_rows(random.Random(3), budget=512)
    B, T = doc.shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 4, T, 16, generator=g)
    k, v = torch.randn(B, 2, T, 16, generator=g), torch.randn(B, 2, T, 16, generator=g)
    got = flex_attention(q, k, v, block_mask=packing.block_mask(doc, seg), enable_gqa=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=packing.attention_mask(doc, seg),
                                                            enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
def test_packed_forward_with_block_mask_equals_dense_mask(monkeypatch):
    """The CUDA path on CPU: packing.forward with block_mask and (uncompiled; no backward on CPU)
    flex_attention in the model gives the dense-mask SDPA path's logprobs. Eager flex evaluates
    mask_mod on every pair (it ignores the block lists), so this checks the model path and the
    per-pair rule; the blocks are checked against create_block_mask above."""
    import model as model_module
    from torch.nn.attention.flex_attention import flex_attention
    model = make_model(seed=4)
    trajs = make_trajs(n_groups=12, G=4, seed=4)  # rows of 3 FlexAttention blocks
    (mb, *_) = packing.plan([(t.ids, t.loss_mask) for t in trajs], [len(t.prompt_ids) for t in trajs], 800, 330)
    assert len(mb.rows) > 1 and len(mb.rows[0].ids) > 256
    with torch.no_grad():
        dense, _ = packing.forward(model, mb, "cpu", 1.0)
        monkeypatch.setattr(packing, "attention_mask", packing.block_mask)
        monkeypatch.setattr(model_module, "_flex_attention", lambda: flex_attention)
        flex, _ = packing.forward(model, mb, "cpu", 1.0)
    assert torch.allclose(dense, flex, atol=1e-5), (dense - flex).abs().max()
