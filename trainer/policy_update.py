"""The update's plumbing: what train.update (the update of one batch: its loop reads top to bottom
there, each micro-batch's packed forward, grpo.loss_inputs, grpo.policy_loss, backward, then the
optimizer step) needs around the loss:

    tokens = batch_tokens(model, ref_model, trajs, advantages, cfg, device, step)   # per sequence, once per batch
    for idx in mini_batches(len(trajs), cfg.grpo):                            # ppo_epochs x mini_batches slices
        masks = loss_masks(trajs, idx)                                        # -> grpo.global_norm (a collective)
        for mb in micro_batches(model, trajs, idx, cfg, device):              # packed; every rank as many
            ...                                                               # forward, loss, backward
    metrics.add(loss_metrics, mask); metrics.step(grad_norm, overflowed); metrics.summary()

This file packs, scores the old and reference logprobs, and sums metrics; it never decides what
the loss or the credit is. Sequences are packed (trainer/packing.py: a prompt and its G responses
computed once, logprobs of the loss tokens only); every rank runs as many micro-batch passes
(distributed.each_micro_batch).
Tests: .venv/bin/pytest tests/test_packing.py (against the padded per-sequence reference)
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from trainer import packing
from trainer.distributed import each_micro_batch


@contextlib.contextmanager
def training_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """model.train(training) inside, the mode it found restored on exit. Only LoRA dropout
    (model.lora_dropout) reads the mode: on for the SFT and GRPO losses, off wherever logprobs
    stand for the policy itself (rollouts and evals: the engine sets eval mode; old/ref scoring)."""
    was_training = model.training
    model.train(training)
    try:
        yield
    finally:
        model.train(was_training)


def logprobs_of(model: nn.Module, mbs: list[packing.MicroBatch], temperature: float,
                device: torch.device) -> dict[int, Tensor]:
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


def mini_batches(n: int, grpo_cfg: "config.GRPOConfig") -> list[list[int]]:
    """The update's mini-batches over this rank's n trajectories, in order: each of
    grpo_cfg.ppo_epochs passes cuts them into grpo_cfg.mini_batches contiguous slices (one optimizer
    step each). n = 0 (a rank whose every episode was left out) still gives the same number of
    (empty) slices: the rank takes every optimizer step with the others."""
    slices = grpo_cfg.mini_batches
    bounds = [round(k * n / slices) for k in range(slices + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for _ in range(grpo_cfg.ppo_epochs) for k in range(slices)]


@dataclass
class BatchTokens:
    """Per-sequence values of the loss tokens, {sequence index: (n_loss_tokens,)}, fixed for the
    whole update: old (the policy before it; None with one optimizer step per batch: then the
    current logprobs detached stand for it), ref (the KL reference; None without a KL term),
    sampler (the sampler's logprobs), advantages (per token), turns (each token's turn) and ages
    (each token's age at the trainer's step: Trajectory.token_ages)."""
    old: dict | None
    ref: dict | None
    sampler: dict
    advantages: dict
    turns: dict
    ages: dict


def batch_tokens(model: nn.Module, ref_model: nn.Module | None, trajs: list, advantages: list[Tensor],
                 cfg: "config.Config", device: torch.device, step: int = 0) -> BatchTokens:
    """Score old / reference logprobs once per batch (only when needed) and collect the sampler's,
    the advantages (advantages[i]: trajectory i's, one per loss token), each token's turn and its
    age at the trainer's step `step`. trajs: rollout.Trajectory records."""
    grpo_cfg, budget, row_tokens = cfg.grpo, cfg.optim.micro_batch_tokens, cfg.optim.pack_row_tokens
    seqs, prompt_lens = _sequences(trajs)
    # each token's sampler logprob at the loss tokens, aligned like old_logp (rollout/trainer mismatch)
    sampler_lp = {i: torch.tensor([t.logprobs[j] for j in range(1, len(t.ids)) if t.loss_mask[j]],
                                  dtype=torch.float32, device=device) for i, t in enumerate(trajs)}
    need_old = grpo_cfg.ppo_epochs * grpo_cfg.mini_batches > 1
    mbs = packing.plan(seqs, prompt_lens, budget, row_tokens) if need_old or ref_model is not None else []
    old = logprobs_of(model, mbs, cfg.sampling.temperature, device) if need_old else None
    ref = logprobs_of(ref_model, mbs, cfg.sampling.temperature, device) if ref_model is not None else None
    adv = {i: a.to(device=device, dtype=torch.float32) for i, a in enumerate(advantages)}
    turns = {i: torch.tensor(t.token_turns(), dtype=torch.long, device=device) for i, t in enumerate(trajs)}
    ages = {i: torch.tensor(t.token_ages(step), dtype=torch.long, device=device) for i, t in enumerate(trajs)}
    return BatchTokens(old, ref, sampler_lp, adv, turns, ages)


def _sequences(trajs: list) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """(ids, loss_mask) per trajectory, and its prompt length where its ids start with its prompt
    (the shared prefix packing computes once per group; 0 = none)."""
    seqs = [(t.ids, t.loss_mask) for t in trajs]
    prompt_lens = [len(t.prompt_ids) if t.ids[:len(t.prompt_ids)] == t.prompt_ids else 0 for t in trajs]
    return seqs, prompt_lens


def loss_masks(trajs: list, idx: list[int]) -> list[Tensor]:
    """The loss masks of trajectories idx (each (len(ids) - 1,): token t+1 is a loss token), what
    grpo.global_norm counts for the optimizer step's normaliser."""
    return [torch.tensor(trajs[i].loss_mask[1:], dtype=torch.float32) for i in idx]


def micro_batches(model: nn.Module, trajs: list, idx: list[int], cfg: "config.Config",
                  device: torch.device) -> Iterator[packing.MicroBatch]:
    """The packed micro-batches of trajectories idx (packing.MicroBatch; its members index into
    idx), yielded with the model in training mode (dropout on: the loss's forwards) and every rank
    running as many passes (each_micro_batch). The caller runs each forward and backward before
    asking for the next."""
    seqs, prompt_lens = _sequences(trajs)
    mbs = packing.plan([seqs[i] for i in idx], [prompt_lens[i] for i in idx], cfg.optim.micro_batch_tokens,
                       cfg.optim.pack_row_tokens)
    with training_mode(model, True):
        yield from each_micro_batch(model, mbs, device, backward=True)


class UpdateMetrics:
    """The update's metrics over its micro-batches and optimizer steps: each loss metric weighted by
    its micro-batch's loss tokens (add), and one gradient norm per optimizer step (grad_norms)."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}  # {metric: [token-weighted sum, tokens]}
        self.grad_norms: list[float] = []
        self.overflows: list[bool] = []  # per optimizer step: skipped for a float16 gradient overflow

    def step(self, grad_norm: float, overflowed: bool) -> None:
        """One optimizer step's gradient norm (non-finite: skipped) and whether the skip was float16's
        loss-scale overflow (trainer/loss_scale.LossScaler.overflowed; never in other dtypes)."""
        self.grad_norms.append(grad_norm)
        self.overflows.append(overflowed)

    def add(self, metrics: dict[str, Tensor], mask: Tensor) -> None:
        tokens = float(mask.sum())
        for key, value in metrics.items():
            acc = self.sums.setdefault(key, [0.0, 0.0])
            acc[0] += float(value) * tokens
            acc[1] += tokens

    def summary(self) -> dict:
        """Each loss metric's token-weighted mean; grad_norm (mean over the optimizer steps not skipped
        for a float16 overflow: all of them when every step was) and grad_norm_max; skipped (1.0 when
        a step saw a non-finite norm and did not step, other than float16's overflow skips, which are
        the loss scaler's own metrics); grad_norms (every step's)."""
        out = {key: total / max(tokens, 1e-9) for key, (total, tokens) in self.sums.items()}
        steps = list(zip(self.grad_norms, self.overflows))
        norms = [norm for norm, overflowed in steps if not overflowed] or self.grad_norms
        skipped = any(not math.isfinite(norm) and not overflowed for norm, overflowed in steps)
        out.update(grad_norm=sum(norms) / len(norms), grad_norm_max=max(norms), skipped=float(skipped),
                   grad_norms=self.grad_norms)
        return out
