"""The GRPO update of one batch of episodes (train.grpo_step calls update_policy):

    metrics = update_policy(model, ref_model, optimizer, scheduler, trajs, advantages, loss, cfg, world, device)
    # = tokens = batch_tokens(model, ref_model, trajs, advantages, cfg, device)    # per sequence, once
    #   for idx in mini_batches(len(trajs), cfg.grpo):                  # ppo_epochs x mini_batches slices
    #       update(model, trajs, idx, tokens, loss, cfg, world, device, sums)   # forward, loss, backward
    #       optim.step_optimizer(model, optimizer, scheduler, cfg.optim)      # then the optimizer step

Per micro-batch, the loss sees one LossInputs: (B, T) tensors, row b one sequence's loss tokens
(its sampled tokens, in order). `loss` is grpo.PolicyLoss (anything with `norm(masks)` and
`__call__(inputs, norm) -> (loss, metrics)`): this file packs, scores and accumulates, and never
decides what the loss or the credit is. Sequences are packed (trainer/packing.py: a prompt and its G
responses computed once, logprobs of the loss tokens only); every rank runs as many micro-batch
passes (distributed.each_micro_batch).
Tests: .venv/bin/pytest tests/test_packing.py (against the padded per-sequence reference)
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer import optim
from trainer import packing
from trainer.distributed import each_micro_batch


@dataclass
class LossInputs:
    """The policy loss's inputs for one micro-batch, each (B, T): row b holds one sequence's loss
    tokens (the tokens it sampled), in order, zero-padded at the end (mask 0 there)."""
    logprobs: Tensor  # log π_θ(y_t) of the policy being trained (the gradient flows through it)
    old_logprobs: Tensor  # log π_old(y_t), the policy before this update (one optimizer step per
    #                       batch: logprobs.detach(), so every ratio is 1)
    ref_logprobs: Tensor | None  # the frozen KL reference's (None: no KL term, grpo.kl_beta 0)
    sampler_logprobs: Tensor  # the sampler's own log π_rollout(y_t) (rollout/trainer mismatch, grpo.rollout_is)
    mask: Tensor  # 1.0 on loss tokens, 0.0 on padding
    advantages: Tensor  # each token's advantage (grpo.token_advantages: the credit)
    turns: Tensor  # long: each token's turn in its episode (0 = the first)
    entropy: Tensor  # the policy's entropy at each token (a metric)


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


def loss_inputs(logprobs: Tensor, entropy: Tensor, counts: list[int], members: list[int],
                tokens: "BatchTokens") -> LossInputs:
    """A micro-batch's LossInputs: the packed forward's flat loss tokens (N,) (counts[k] of them for
    sequence members[k]) and the batch's per-sequence values, laid out (members, longest)."""
    def rows(per_seq: dict) -> Tensor:
        return packing.pad_flat(torch.cat([per_seq[i] for i in members]), counts)
    lp = packing.pad_flat(logprobs, counts)
    return LossInputs(logprobs=lp, old_logprobs=rows(tokens.old) if tokens.old is not None else lp.detach(),
                      ref_logprobs=rows(tokens.ref) if tokens.ref is not None else None,
                      sampler_logprobs=rows(tokens.sampler),
                      mask=packing.pad_flat(torch.ones_like(logprobs.detach()), counts),
                      advantages=rows(tokens.advantages), turns=rows(tokens.turns),
                      entropy=packing.pad_flat(entropy, counts))


def mini_batches(n: int, g) -> list[list[int]]:
    """The update's mini-batches over this rank's n trajectories, in order: each of g.ppo_epochs
    passes cuts them into g.mini_batches contiguous slices (one optimizer step each)."""
    bounds = [round(k * n / g.mini_batches) for k in range(g.mini_batches + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for _ in range(g.ppo_epochs) for k in range(g.mini_batches)]


@dataclass
class BatchTokens:
    """Per-sequence values of the loss tokens, {sequence index: (n_loss_tokens,)}, fixed for the
    whole update: old (the policy before it; None with one optimizer step per batch: then the
    current logprobs detached stand for it), ref (the KL reference; None without a KL term),
    sampler (the sampler's logprobs), advantages (per token) and turns (each token's turn)."""
    old: dict | None
    ref: dict | None
    sampler: dict
    advantages: dict
    turns: dict


def batch_tokens(model, ref_model, trajs, advantages: list[Tensor], cfg, device) -> BatchTokens:
    """Score old / reference logprobs once per batch (only when needed) and collect the sampler's,
    the advantages (advantages[i]: trajectory i's, one per loss token) and each token's turn."""
    g, budget, row_tokens = cfg.grpo, cfg.optim.micro_batch_tokens, cfg.optim.pack_row_tokens
    seqs, prompt_lens = _sequences(trajs)
    # each token's sampler logprob at the loss tokens, aligned like old_logp (rollout/trainer mismatch)
    sampler_lp = {i: torch.tensor([t.logprobs[j] for j in range(1, len(t.ids)) if t.loss_mask[j]],
                                  dtype=torch.float32, device=device) for i, t in enumerate(trajs)}
    need_old = g.ppo_epochs * g.mini_batches > 1
    mbs = packing.plan(seqs, prompt_lens, budget, row_tokens) if need_old or ref_model is not None else []
    old = logprobs_of(model, mbs, cfg.sampling.temperature, device) if need_old else None
    ref = logprobs_of(ref_model, mbs, cfg.sampling.temperature, device) if ref_model is not None else None
    adv = {i: a.to(device=device, dtype=torch.float32) for i, a in enumerate(advantages)}
    turns = {i: torch.tensor(t.token_turns(), dtype=torch.long, device=device) for i, t in enumerate(trajs)}
    return BatchTokens(old, ref, sampler_lp, adv, turns)


def _sequences(trajs):
    """(ids, loss_mask) per trajectory, and its prompt length where its ids start with its prompt
    (the shared prefix packing computes once per group; 0 = none)."""
    seqs = [(t.ids, t.loss_mask) for t in trajs]
    prompt_lens = [len(t.prompt_ids) if t.ids[:len(t.prompt_ids)] == t.prompt_ids else 0 for t in trajs]
    return seqs, prompt_lens


def update(model, trajs, idx: list[int], tokens: BatchTokens, loss, cfg, world: int, device,
           sums: dict, scaler=None) -> None:
    """One mini-batch (trajectories idx) of the update: packed micro-batches, each forward, its
    LossInputs, the loss and backward, gradients accumulated for the optimizer step that follows.
    loss: grpo.PolicyLoss (norm(masks) once: the global normaliser; then loss(inputs, norm)).
    sums: {metric: [sum over loss tokens, loss tokens]}, added to (token-weighted means over the
    step's micro-batches). scaler: trainer/loss_scale.LossScaler (float16's loss scale), or None."""
    T = cfg.sampling.temperature
    seqs, prompt_lens = _sequences(trajs)
    norm = loss.norm([torch.tensor(seqs[i][1][1:], dtype=torch.float32) for i in idx])  # a collective
    mbs = packing.plan([seqs[i] for i in idx], [prompt_lens[i] for i in idx], cfg.optim.micro_batch_tokens,
                       cfg.optim.pack_row_tokens)
    with training_mode(model, True):  # the loss forwards run with dropout (logprobs_of turns it off)
        for mb in each_micro_batch(model, mbs, device, backward=True):
            lp_flat, ent_flat = packing.forward(model, mb, device, T)  # (N,) loss tokens only
            inputs = loss_inputs(lp_flat, ent_flat, mb.counts, [idx[j] for j in mb.members], tokens)
            out, m = loss(inputs, norm)
            out = out * world  # FSDP2 averages gradients over ranks; ×world makes it a sum
            (scaler.scale(out) if scaler is not None else out).backward()  # float16: × the loss scale too
            w = float(inputs.mask.sum())
            for key, v in m.items():
                acc = sums.setdefault(key, [0.0, 0.0])
                acc[0] += float(v) * w
                acc[1] += w


def update_policy(model, ref_model, optimizer, scheduler, trajs, advantages: list[Tensor], loss, cfg, world: int,
                  device, scaler=None) -> dict:
    """The whole update of one batch: batch_tokens once, then per mini-batch (ppo_epochs x
    mini_batches) update and the optimizer step. advantages[i]: trajectory i's per loss token
    (grpo.token_advantages); loss: grpo.PolicyLoss. Returns the update's metrics: each loss metric
    token-weighted over the micro-batches, grad_norm (mean over the optimizer steps),
    grad_norm_max, skipped (1.0 when a step saw a non-finite norm and did not step, other than
    float16's overflow skips: those are the loss scaler's, see scaler.metrics()) and grad_norms
    (the list). scaler: trainer/loss_scale.LossScaler, or None (no loss scaling)."""
    sums, grad_norms, overflows = {}, [], []  # {metric: [token-weighted sum, tokens]}; per optimizer step
    tokens = batch_tokens(model, ref_model, trajs, advantages, cfg, device)  # old / ref, once per batch
    for idx in mini_batches(len(trajs), cfg.grpo):
        update(model, trajs, idx, tokens, loss, cfg, world, device, sums, scaler)  # forward, loss, backward
        grad_norms.append(optim.step_optimizer(model, optimizer, scheduler, cfg.optim, scaler))  # non-finite: skipped
        overflows.append(scaler is not None and scaler.overflowed)
    m = {k: v / max(w, 1e-9) for k, (v, w) in sums.items()}
    # the norms of the steps not skipped for an fp16 overflow (all of them: their inf, as without a scaler)
    kept = [x for x, o in zip(grad_norms, overflows) if not o] or grad_norms
    m.update(grad_norm=sum(kept) / len(kept), grad_norm_max=max(kept),
             skipped=float(any(not math.isfinite(x) and not o for x, o in zip(grad_norms, overflows))),
             grad_norms=grad_norms)
    return m
