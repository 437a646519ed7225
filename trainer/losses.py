"""The policy loss family: one registered function per value of `grpo.loss`, each computing the
per-token policy-gradient term from the log-ratios and advantages, and declaring its defaults
beside it. grpo.policy_loss does everything the losses share (masking, the log-ratio clamp, then
after the registered function: dual-clip, rollout correction, the KL term, aggregation, metrics).

    from trainer.losses import LOSSES, clip_range
    LOSSES["gspo"].clip                    # (3e-4, 4e-4): its default (ε_low, ε_high)
    python -m pytest tests/test_grpo_losses.py -q

A new loss is one function here, decorated with `@register_loss(name, clip=..., ...)`, and its
test in tests/test_grpo_losses.py: config.py offers every registered name as a value of
grpo.loss, trainer/config_checks.py checks the keys against its declaration, and the shared tests
(split invariance, masked inf/nan, extreme tokens) run on it through LOSSES. The function reads
one PgInputs and its (ε_low, ε_high) (None for a loss declared without a clip) and returns a PgTerm.
It lives in a package, not in grpo.py, so that config.py can read the names: grpo.py imports
config.py (its types), and no module config.py imports may import it back (tests/test_layout.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

# a log-ratio (log ρ, the rollout correction's log r, the KL's log π_ref/π_θ) is clamped to ±20 before
# exp, as SkyRL and verl do: exp(±20) is finite in fp32, and beyond it one token would make a step inf
LOG_RATIO_CLAMP = 20.0

# -----------------------------------------------------------------------------
# masked reductions (the losses', the rollout corrections' and grpo.policy_loss's)


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    # where, not x*mask: a masked position holding inf/nan must not leak into the sum
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask (0 when the mask is empty)."""
    return masked_sum(x, mask) / mask.bool().sum().clamp(min=1)


def seq_sum(x: Tensor, mask: Tensor) -> Tensor:
    """(B, T) -> (B,): Σ_t over the masked tokens of each row (a row is one sequence; masked-out
    values never leak)."""
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum(-1)


def seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """(B, T) -> (B,): mean over the masked tokens of each row; 0 for an all-masked row."""
    return seq_sum(x, mask) / mask.bool().sum(-1).clamp(min=1)


# -----------------------------------------------------------------------------
# the registry


@dataclass(frozen=True)
class PgInputs:
    """What a loss reads, each (B, T), one sequence per row; masked positions (prompt, tool
    output, padding) hold 0 in every float field, so no inf/nan there reaches exp or a gradient."""
    log_ratio: Tensor  # log ρ_t = log π_θ(y_t) - log π_old(y_t), clamped to ±LOG_RATIO_CLAMP (gradient through π_θ)
    logprobs: Tensor  # log π_θ(y_t) (gradient)
    advantages: Tensor  # A_t, each token's advantage (the credit)
    mask: Tensor  # bool: True on loss tokens
    turns: Tensor  # long: each token's turn in its episode (0 = the first), for a turn-aware loss


@dataclass
class PgTerm:
    """What a loss returns."""
    pg: Tensor  # (B, T) the per-token policy-gradient loss, before dual-clip, rollout correction and KL
    ratio: Tensor  # (B, T) the ratio it used (the ratio_max metric): ρ_t, or a sequence's s_i on its tokens
    metrics: dict[str, Tensor] = field(default_factory=dict)  # its own, e.g. clip_frac; 0-d tensors


LossFn = Callable[[PgInputs, tuple[float, float] | None], PgTerm]


@dataclass(frozen=True)
class LossSpec:
    """One loss's declaration: its function and the defaults and properties beside it."""
    name: str
    fn: LossFn
    clip: tuple[float, float] | None  # default (ε_low, ε_high) where grpo.clip_low/clip_high are < 0;
    #                                   None: no clip (grpo.clip_low/clip_high must stay < 0)
    dual_clip: bool  # grpo.dual_clip_c applies: a PPO-clip min whose loss -c·A can cap for A < 0
    sequence_ratio: bool  # its ratio is one per sequence (GSPO's s_i), not one per token


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, *, clip: tuple[float, float] | None, dual_clip: bool = False,
                  sequence_ratio: bool = False) -> Callable[[LossFn], LossFn]:
    """Decorator: register fn as the loss grpo.loss=name, with its declaration."""
    def register(fn: LossFn) -> LossFn:
        assert name not in LOSSES, f"loss {name!r} registered twice"
        LOSSES[name] = LossSpec(name, fn, clip, dual_clip, sequence_ratio)
        return fn
    return register


def clip_range(loss: str, clip_low: float, clip_high: float) -> tuple[float, float] | None:
    """(ε_low, ε_high): the given values, or the loss's declared default where negative; None for
    a loss declared without a clip."""
    assert loss in LOSSES, f"grpo.loss must be one of {list(LOSSES)}, got {loss!r}"
    if LOSSES[loss].clip is None:
        return None
    low, high = LOSSES[loss].clip
    return (low if clip_low < 0 else clip_low), (high if clip_high < 0 else clip_high)


# -----------------------------------------------------------------------------
# the losses (ρ_t = π_θ(y_t) / π_old(y_t); sg = stop-gradient)


def ppo_clip(ratio: Tensor, advantages: Tensor, mask: Tensor, clip: tuple[float, float]) -> PgTerm:
    """PPO-clip on any ratio: pg = -min(ρA, clip(ρ, 1-ε_l, 1+ε_h)A); clip_frac: the tokens where
    the clipped branch of the min is the one taken."""
    eps_low, eps_high = clip
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)  # = -min(ρA, clip(ρ)A)
    return PgTerm(pg, ratio, {"clip_frac": masked_mean((pg_clipped > pg_unclipped).float(), mask)})


# PPO/GRPO's ε = 0.2 on each side
@register_loss("grpo", clip=(0.2, 0.2), dual_clip=True)
def grpo_clip(x: PgInputs, clip: tuple[float, float]) -> PgTerm:
    """GRPO: PPO-clip on the token ratio ρ_t = exp(log ρ_t)."""
    return ppo_clip(torch.exp(x.log_ratio), x.advantages, x.mask, clip)


# GSPO's sequence ratio is a length-normalised geometric mean, so it clips at a far smaller ε
# (3e-4 / 4e-4, the GSPO paper)
@register_loss("gspo", clip=(3e-4, 4e-4), dual_clip=True, sequence_ratio=True)
def gspo(x: PgInputs, clip: tuple[float, float]) -> PgTerm:
    """GSPO: the same clip on the sequence ratio s_i = exp(mean_t log ρ_it), on every token of
    sequence i (with seq-mean-token-mean, the paper's per-sequence objective)."""
    seq_log_ratio = seq_mean(x.log_ratio, x.mask)[:, None]  # (B, 1): log s_i
    return ppo_clip(torch.exp(seq_log_ratio).expand_as(x.log_ratio), x.advantages, x.mask, clip)


@register_loss("gspo-token", clip=(3e-4, 4e-4), dual_clip=True, sequence_ratio=True)
def gspo_token(x: PgInputs, clip: tuple[float, float]) -> PgTerm:
    """GSPO-token: s_it = sg(s_i) · π_θ(y_t)/sg(π_θ(y_t)): the value of s_i, the gradient per
    token, so each token can carry its own advantage. (Masked logprobs are 0: -inf - (-inf)
    would be nan.)"""
    seq_log_ratio = seq_mean(x.log_ratio, x.mask)[:, None]  # (B, 1): log s_i
    seq_log_ratio = seq_log_ratio.detach() + x.logprobs - x.logprobs.detach()  # (B, T)
    return ppo_clip(torch.exp(seq_log_ratio).expand_as(x.log_ratio), x.advantages, x.mask, clip)


# CISPO imposes no lower bound on its weight (ε_low 1.0: 1 - ε_low = 0) and tunes ε_high (MiniMax-M1)
@register_loss("cispo", clip=(1.0, 0.28))
def cispo(x: PgInputs, clip: tuple[float, float]) -> PgTerm:
    """CISPO: pg = -sg(clip(ρ_t, 1-ε_l, 1+ε_h)) · A · log π_θ(y_t): the clipped ratio is a constant
    weight, so no token's gradient is zeroed. clip_frac: the tokens whose weight was clipped."""
    eps_low, eps_high = clip
    ratio = torch.exp(x.log_ratio)
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high).detach()
    pg = -weight * x.advantages * x.logprobs
    return PgTerm(pg, ratio, {"clip_frac": masked_mean((weight != ratio).float(), x.mask)})


# SAPO's temperatures (the paper's 1.0 and 1.05): τ_neg > τ_pos makes the gate fade sooner for
# negative advantages, whose update raises the logits of many unsampled tokens at once (less stable)
@register_loss("sapo", clip=None)
def sapo(x: PgInputs, clip: None, tau_pos: float = 1.0, tau_neg: float = 1.05) -> PgTerm:
    """SAPO (Soft Adaptive Policy Optimization): a smooth, temperature-controlled gate on the token
    ratio in place of a hard clip:
        pg_t = -f(ρ_t) · A_t,   f(ρ) = (4/τ) · σ(τ(ρ - 1)),   τ = τ_pos if A_t > 0 else τ_neg
    Its gradient, d pg_t / d log π_θ = -A_t · 4σ(1-σ) · ρ_t (σ at τ(ρ_t - 1)), is the policy gradient
    -A_t at ρ = 1 and fades smoothly as ρ leaves 1, where PPO-clip zeroes it at the band's edge.
    Declared without a clip: grpo.clip_low/clip_high stay < 0."""
    ratio = torch.exp(x.log_ratio)
    tau = torch.where(x.advantages > 0, tau_pos, tau_neg)
    gate = 4.0 / tau * torch.sigmoid(tau * (ratio - 1.0))
    return PgTerm(-gate * x.advantages, ratio)
