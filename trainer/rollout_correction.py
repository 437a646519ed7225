"""Rollout/trainer consistency: how far the sampler's logprobs drift from the trainer's, and
importance corrections for that drift. Pure tensor functions (no model, no process group).

The sampler records log π_rollout(y_t) = log_softmax(logits / T)[y_t] for each sampled token; the
trainer recomputes log π_old(y_t) with the same temperature before the update. With the same
model code in fp32 they agree to ~1e-6; bf16 kernels, a different attention path or a stale
weight copy make them drift, and the policy gradient is then off-policy. The corrections reweight
or drop tokens by the ratio r_t = π_old(y_t) / π_rollout(y_t) (all weights are constants: no
gradient flows through them):

    none        w = 1
    token-tis   w_t = min(r_t, C)                                     truncated IS, per token
    seq-tis     w_i = min(Π_t r_t, C) on every token of sequence i     truncated IS, per sequence
    token-mis   w_t = 1 if α ≤ r_t ≤ β else 0                          masked IS (IcePop), per token
    seq-mis     w_i = 1 if α ≤ Π_t r_t ≤ β else 0                      masked IS, per sequence
    geo-mask    w_i = 1 if 1-δ ≤ exp(mean_t log r_t) ≤ 1+δ else 0       geometric sequence mask

A dropped token keeps its place in the loss normaliser (its loss is multiplied by 0, as in
IcePop), so the global-normaliser contract of grpo.py holds unchanged. A row of the (B, T)
tensors is one sequence.

    python -m pytest tests/test_grpo.py -q -k rollout
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

KINDS = ("none", "token-tis", "seq-tis", "token-mis", "seq-mis", "geo-mask")
LOG_RATIO_CLAMP = 20.0  # exp(±20) is finite in fp32; beyond it one token would make a step inf
MISMATCH_TOL = 0.1  # |Δ logp| above which a token counts as mismatched in the metrics


@dataclass(frozen=True)
class RolloutIS:
    """One importance correction (see the table at the top); from the config: from_config(cfg.grpo)."""
    kind: str = "none"
    cap: float = 2.0  # C of the truncated kinds
    low: float = 0.5  # α of the masked kinds
    high: float = 5.0  # β of the masked kinds
    delta: float = 0.01  # δ of geo-mask

    def __post_init__(self):
        assert self.kind in KINDS, f"rollout_is must be one of {KINDS}, got {self.kind!r}"
        assert self.cap > 0 and 0 <= self.low <= self.high and self.delta > 0, self

    @classmethod
    def from_config(cls, grpo_cfg) -> "RolloutIS":
        """grpo_cfg: config.GRPOConfig (its rollout_is* keys)."""
        return cls(grpo_cfg.rollout_is, grpo_cfg.rollout_is_cap, grpo_cfg.rollout_is_low, grpo_cfg.rollout_is_high,
                   grpo_cfg.rollout_is_delta)


# -----------------------------------------------------------------------------
# per-sequence reductions (a row is a sequence)


def seq_sum(x: Tensor, mask: Tensor) -> Tensor:
    """(B, T) -> (B,): Σ_t over the masked tokens of each row (masked-out values never leak)."""
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum(-1)


def seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """(B, T) -> (B,): mean over the masked tokens of each row; 0 for an all-masked row."""
    return seq_sum(x, mask) / mask.bool().sum(-1).clamp(min=1)


# -----------------------------------------------------------------------------
# mismatch metrics and weights


def _log_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    """log r_t = log π_old - log π_rollout, 0 outside the mask, clamped to ±20."""
    d = old_logp.float() - rollout_logp.float()
    return torch.where(mask.bool(), d, torch.zeros_like(d)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@torch.no_grad()
def mismatch_metrics(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
                     tol: float = MISMATCH_TOL) -> dict[str, Tensor]:
    """Sampler vs trainer logprobs on the response tokens (mask), as 0-d tensors:
    mismatch_abs_mean / mismatch_abs_max: mean and max |log π_old - log π_rollout|;
    mismatch_kl: k3 estimate of KL(π_rollout‖π_old) from the sampled tokens, r - 1 - log r
        with r = π_old/π_rollout (≥ 0, unbiased since the tokens were drawn from π_rollout);
    mismatch_frac: share of tokens with |Δ| > tol."""
    on = mask.bool()
    n = on.sum().clamp(min=1)
    log_r = _log_ratio(old_logp, rollout_logp, on)
    gap = log_r.abs()
    return {"mismatch_abs_mean": gap.sum() / n,
            "mismatch_abs_max": gap.max() if gap.numel() else gap.new_zeros(()),
            "mismatch_kl": torch.where(on, torch.exp(log_r) - 1.0 - log_r, torch.zeros_like(log_r)).sum() / n,
            "mismatch_frac": (on & (gap > tol)).sum() / n}


@torch.no_grad()
def is_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
               cfg: RolloutIS) -> tuple[Tensor, dict[str, Tensor]]:
    """(B, T) constant weights for the per-token policy-gradient loss, and metrics
    (is_weight_mean over the masked tokens; is_drop_frac for the masked kinds, is_cap_frac for the
    truncated ones: the share of masked tokens dropped or capped)."""
    on = mask.bool()
    log_r = _log_ratio(old_logp, rollout_logp, on)  # (B, T)
    if cfg.kind == "none":
        weights = torch.ones_like(log_r)
    elif cfg.kind in ("token-tis", "token-mis"):
        ratio = torch.exp(log_r)
        weights = ratio.clamp(max=cfg.cap) if cfg.kind == "token-tis" else \
            ((ratio >= cfg.low) & (ratio <= cfg.high)).float()
    else:
        if cfg.kind == "geo-mask":
            ratio = torch.exp(seq_mean(log_r, on))  # (B,) geometric mean of the token ratios
            keep = (ratio >= 1.0 - cfg.delta) & (ratio <= 1.0 + cfg.delta)
        else:  # the sequence ratio Π_t r_t, in log space, clamped before exp
            ratio = torch.exp(seq_sum(log_r, on).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            keep = (ratio >= cfg.low) & (ratio <= cfg.high)
        seq_weights = ratio.clamp(max=cfg.cap) if cfg.kind == "seq-tis" else keep.float()  # (B,)
        weights = seq_weights[:, None].expand_as(log_r)
    weights = torch.where(on, weights, torch.zeros_like(weights))
    n = on.sum().clamp(min=1)
    metrics = {"is_weight_mean": weights.sum() / n}
    if cfg.kind.endswith("tis"):
        metrics["is_cap_frac"] = (on & (weights >= cfg.cap)).sum() / n
    elif cfg.kind != "none":
        metrics["is_drop_frac"] = (on & (weights == 0)).sum() / n
    return weights, metrics
