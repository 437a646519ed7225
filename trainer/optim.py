"""The optimizer and its learning-rate schedule, shared by the SFT warm start and GRPO.

AdamW over the parameters train.py passes: under FSDP2 these are the fp32 master shards, so the
moments are fp32 and sharded too, whatever model.dtype computes in.

    opt, sched = make_optimizer(model, cfg.optim, lr, warmup_steps, total_steps)
    grad_norm = step_optimizer(model, opt, sched, cfg.optim, scaler)   # unscale, clip, skip if non-finite, step

Tests: pytest tests/test_train.py -k lr_schedule; tests/test_loss_scale.py (unscale before clip, skips)
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from trainer.loss_scale import LossScaler


# -----------------------------------------------------------------------------


def lr_lambda(warmup: int, total: int, schedule: str = "constant", min_ratio: float = 0.0) -> Callable[[int], float]:
    """Multiplier of the base lr at optimizer step `step`: linear warmup over `warmup` steps, then
    constant or cosine down to min_ratio at `total`."""
    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if schedule == "cosine":
            t = min(1.0, (step - warmup) / max(1, total - warmup))
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
        return 1.0
    return f


def make_optimizer(model: nn.Module, optim_cfg: "config.OptimConfig", lr: float, warmup: int,
                   total: int) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable (fp32 master) parameters + its LambdaLR schedule (optim_cfg: the
    optim config group). Under LoRA only the adapters: the frozen base gets no moments and no
    weight decay."""
    # foreach: CPU's default is a per-parameter loop, ~3x slower on FSDP2's DTensors (~150 ms of
    # a tiny SFT step); the same arithmetic, identical results (CUDA's default already)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            betas=(optim_cfg.beta1, optim_cfg.beta2), weight_decay=optim_cfg.weight_decay, foreach=True)
    schedule = lr_lambda(warmup, total, optim_cfg.schedule, optim_cfg.min_lr_ratio)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


def step_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                   optim_cfg: "config.OptimConfig", scaler: LossScaler | None = None) -> float:
    """Unscale (scaler: float16's loss scaler), clip to optim_cfg.grad_clip, step unless the
    gradient norm is non-finite, then let the scaler update its scale. Returns the norm before
    clipping (non-finite: the step was skipped; scaler.overflowed says whether for an fp16
    overflow). Gradients are freed afterwards (set to None) so they are not held through the next
    rollout. The order matters in float16: the gradients arrive multiplied by the loss scale
    (2^16 by default), and clipped before unscaling they would be clipped by a norm that many
    times too large (every step clipped, the logged norm the scaled one)."""
    if scaler is not None:
        scaler.unscale_(model.parameters())  # fp32 master gradients: clip reads the true norm
    # under FSDP2 the total norm is global (DTensor shards reduced over ranks): every rank skips alike
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg.grad_clip)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.update(finite)
    return float(grad_norm)
