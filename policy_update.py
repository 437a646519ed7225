"""The GRPO update of one batch of episodes, in the pieces train.main's loop calls by name:

    logps = batch_logprobs(model, ref_model, trajs, cfg, device)   # old / reference / sampler logprobs, once
    for idx in mini_batches(len(trajs), cfg.grpo):                 # ppo_epochs x mini_batches slices
        update(model, trajs, idx, adv, logps, cfg, world, device, sums)   # forward, policy loss, backward
        optim.step_optimizer(model, optimizer, scheduler, cfg.optim)      # then the optimizer step

Sequences are packed (packing.py: a prompt and its G responses computed once, logprobs of the loss
tokens only); every rank runs as many micro-batch passes (distributed.each_micro_batch).
Tests: .venv/bin/pytest tests/test_packing.py (against the padded per-sequence reference)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

import config as C
import grpo
import packing
from distributed import each_micro_batch


@contextlib.contextmanager
def training_mode(model, training: bool):
    """model.train(training) inside, the mode it found restored on exit. Only LoRA dropout
    (model.lora_dropout) reads the mode: on for the SFT and GRPO losses, off wherever logprobs
    stand for the policy itself (rollouts and evals: the engine sets eval mode; old/ref scoring)."""
    was_training = model.training
    model.train(training)
    try:
        yield
    finally:
        model.train(was_training)


def logprobs_of(model, mbs, temperature: float, device) -> dict[int, torch.Tensor]:
    """No-grad logprobs of every sequence's loss tokens: {sequence index: (n_loss_tokens,)}.
    Stored per sequence, so any later packing (mini-batches, epochs) can look them up.
    Eval mode (no dropout): old logprobs are the behaviour policy's, the one that sampled the
    tokens without dropout (its sampler logprobs are rollout_logp), and a dropout mask drawn here
    would add noise to every ratio pi/pi_old that the clip then acts on; the reference is a
    fixed policy, not a random draw of one."""
    out = {}
    with torch.no_grad(), training_mode(model, False):
        for mb in each_micro_batch(model, mbs, device, backward=False):
            lp, _ = packing.forward(model, mb, device, temperature)
            out.update(zip(mb.members, lp.split(mb.counts)))
    return out


def loss_layout(lp_flat, ent_flat, counts, members, old, ref, rollout_lp):
    """The packed forward's flat loss tokens -> the loss's (members, longest) per-sequence layout,
    padding masked out. lp_flat, ent_flat: (N,) loss tokens of a micro-batch, counts[k] of them
    for members[k]; old / ref / rollout_lp: {sequence index: (n_loss_tokens,)} (old None: one update
    per batch, so old = the current logprobs detached; ref None: no KL term). rollout_lp, the
    sampler's logprobs, feeds the rollout/trainer mismatch metrics and grpo.rollout_is.
    Returns lp, ent, mask, old_lp, ref_lp (or None), rollout_lp, each (members, longest)."""
    lp, ent = packing.pad_flat(lp_flat, counts), packing.pad_flat(ent_flat, counts)
    mask = packing.pad_flat(torch.ones_like(lp_flat.detach()), counts)
    old_lp = packing.pad_flat(torch.cat([old[i] for i in members]), counts) if old is not None else lp.detach()
    ref_lp = packing.pad_flat(torch.cat([ref[i] for i in members]), counts) if ref is not None else None
    rollout_logp = packing.pad_flat(torch.cat([rollout_lp[i] for i in members]), counts)
    return lp, ent, mask, old_lp, ref_lp, rollout_logp


def mini_batches(n: int, g: C.GRPOConfig) -> list[list[int]]:
    """The update's mini-batches over this rank's n trajectories, in order: each of g.ppo_epochs
    passes cuts them into g.mini_batches contiguous slices (one optimizer step each)."""
    bounds = [round(k * n / g.mini_batches) for k in range(g.mini_batches + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for _ in range(g.ppo_epochs) for k in range(g.mini_batches)]


@dataclass
class BatchLogprobs:
    """Per-sequence logprobs of the loss tokens, {sequence index: (n_loss_tokens,)}, fixed for the
    whole update: old (the policy before it; None with one optimizer step per batch: then the
    current logprobs detached stand for it), ref (the KL reference; None without a KL term) and
    rollout (the sampler's, for the rollout/trainer mismatch and grpo.rollout_is)."""
    old: dict | None
    ref: dict | None
    rollout: dict


def batch_logprobs(model, ref_model, trajs, cfg: C.Config, device) -> BatchLogprobs:
    """Score old / reference logprobs once per batch (only when needed) and collect the sampler's."""
    g, budget, row_tokens = cfg.grpo, cfg.optim.micro_batch_tokens, cfg.optim.pack_row_tokens
    seqs, prompt_lens = _sequences(trajs)
    # each token's sampler logprob at the loss tokens, aligned like old_logp (rollout/trainer mismatch)
    rollout_lp = {i: torch.tensor([t.logprobs[j] for j in range(1, len(t.ids)) if t.loss_mask[j]],
                                  dtype=torch.float32, device=device) for i, t in enumerate(trajs)}
    need_old = g.ppo_epochs * g.mini_batches > 1
    mbs = packing.plan(seqs, prompt_lens, budget, row_tokens) if need_old or ref_model is not None else []
    old = logprobs_of(model, mbs, cfg.sampling.temperature, device) if need_old else None
    ref = logprobs_of(ref_model, mbs, cfg.sampling.temperature, device) if ref_model is not None else None
    return BatchLogprobs(old, ref, rollout_lp)


def _sequences(trajs):
    """(ids, loss_mask) per trajectory, and its prompt length where its ids start with its prompt
    (the shared prefix packing computes once per group; 0 = none)."""
    seqs = [(t.ids, t.loss_mask) for t in trajs]
    prompt_lens = [len(t.prompt_ids) if t.ids[:len(t.prompt_ids)] == t.prompt_ids else 0 for t in trajs]
    return seqs, prompt_lens


def update(model, trajs, idx: list[int], adv, logps: BatchLogprobs, cfg: C.Config, world: int, device,
           sums: dict) -> None:
    """One mini-batch (trajectories idx) of the update: packed micro-batches, each forward, policy
    loss and backward, gradients accumulated for the optimizer step that follows. adv (n,) per
    trajectory. sums: {metric: [sum over loss tokens, loss tokens]}, added to (token-weighted means
    over the step's micro-batches)."""
    g, T = cfg.grpo, cfg.sampling.temperature
    seqs, prompt_lens = _sequences(trajs)
    adv = adv.tolist()
    masks = [torch.tensor(seqs[i][1][1:], dtype=torch.float32) for i in idx]
    norm = grpo.global_norm(masks, g.loss_agg)
    loss_kw = grpo.loss_kwargs(g, cfg.sampling.max_context)
    mbs = packing.plan([seqs[i] for i in idx], [prompt_lens[i] for i in idx], cfg.optim.micro_batch_tokens,
                       cfg.optim.pack_row_tokens)
    with training_mode(model, True):  # the loss forwards run with dropout (logprobs_of turns it off)
        for mb in each_micro_batch(model, mbs, device, backward=True):
            members = [idx[j] for j in mb.members]
            lp_flat, ent_flat = packing.forward(model, mb, device, T)  # (N,) loss tokens only
            lp, ent, mask, old_lp, ref_lp, rollout_logp = loss_layout(
                lp_flat, ent_flat, mb.counts, members, logps.old, logps.ref, logps.rollout)
            member_adv = torch.tensor([adv[i] for i in members], dtype=torch.float32, device=device)
            loss, m = grpo.policy_loss(lp, old_lp, member_adv, mask, ref_logp=ref_lp, rollout_logp=rollout_logp,
                                       norm=norm, entropy=ent, **loss_kw)
            (loss * world).backward()  # FSDP2 averages gradients over ranks; ×world makes it a sum
            w = float(mask.sum())
            for key, v in m.items():
                acc = sums.setdefault(key, [0.0, 0.0])
                acc[0] += float(v) * w
                acc[1] += w
