"""Shared-prompt packing (trainer/packing.py) against the padded per-sequence path it replaces: the same
per-token logprobs and entropies, and through train.update the same loss and gradients for every
loss aggregation, ppo_epochs × mini_batches, kl_beta > 0, activation checkpointing, multi-turn
trajectories (observation tokens masked), groups that fall back to the plain layout. ~60 s.

    python -m pytest -q tests/test_packing.py
"""
import copy
import math
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import config as C
import grpo
from trainer import packing
from conftest import grpo_update
from model import ModelArgs, Transformer
from rollout import Trajectory

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import padded  # noqa: E402  (bench/padded.py: the padded reference layout and the dense mask)

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
            trajs.append(Trajectory.of(prompt, ids, mask, logprobs))
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
    m = padded.dense_mask(torch.tensor([row.doc]), torch.tensor([row.seg]))[0, 0]
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
            adv_tokens = adv[idx][:, None].expand_as(lp)
            inputs = grpo.LossInputs(lp, old_lp, ref_lp, rollout_lp, mask, adv_tokens, torch.zeros_like(mask).long(), ent)
            loss, _ = grpo.policy_loss(inputs, norm, g, cfg.sampling.max_context)
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
    import update_dist_check
    from conftest import run_dist_check
    ref_file = tmp_path / "reference.pt"
    torch.save([update_dist_check.reference(case) for case in update_dist_check.CASES], ref_file)
    check = run_dist_check("update_dist_check.py", str(ref_file), timeout=240)
    results = check.results.get(0, [])
    assert check.returncode == 0 and len(results) == len(update_dist_check.CASES) * len(update_dist_check.UNITS), \
        check.why()
    assert all(line.endswith(" ok") for line in results), results


def test_skipped_when_one_of_the_batch_optimizer_steps_is_not_finite():
    """Two mini-batches: the first steps, the second's advantages are NaN so its gradient is not
    finite and its optimizer step is skipped. `skipped` is 1.0 (a step of the batch did not step,
    train.max_bad_steps counts it), grad_norms holds both norms in order, and the weights are those
    after the first step alone."""
    trajs = make_trajs(seed=1)
    n = len(trajs)
    adv = torch.ones(n)
    adv[n // 2:] = float("nan")  # mini-batch 2 of 2
    cfg = C.load_config(["--grpo.mini_batches=2", "--optim.grad_clip=1e9", "--optim.micro_batch_tokens=60",
                         "--sampling.temperature=0.9"])
    model, first_only = make_model(1), make_model(1)
    opt = SGDCapture(model)
    sch = SimpleNamespace(step=lambda: None)
    m = grpo_update(model, None, opt, sch, trajs, adv, cfg)
    assert m["skipped"] == 1.0
    assert math.isfinite(m["grad_norms"][0]) and not math.isfinite(m["grad_norms"][1])
    assert len(opt.grads) == 1  # only the finite step reached the optimizer
    half = C.load_config(["--optim.grad_clip=1e9", "--optim.micro_batch_tokens=60", "--sampling.temperature=0.9"])
    grpo_update(first_only, None, SGDCapture(first_only), sch, trajs[:n // 2], adv[:n // 2], half)
    for a, b in zip(model.parameters(), first_only.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    fresh = make_model(1)
    m = grpo_update(fresh, None, SGDCapture(fresh), sch, trajs, torch.ones(n), cfg)
    assert m["skipped"] == 0.0  # every step finite
