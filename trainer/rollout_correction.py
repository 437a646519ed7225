"""Rollout/trainer consistency: how far the sampler's logprobs drift from the trainer's, and
importance corrections for that drift and for the tokens' staleness. Pure tensor functions (no
model, no process group).

The sampler records log π_rollout(y_t) = log_softmax(logits / T)[y_t] for each sampled token; the
trainer recomputes log π_old(y_t) with the same temperature before the update. With the same
model code in fp32 they agree to ~1e-6; bf16 kernels, a different attention path, a stale weight
copy or a token sampled steps ago (stream.sampling_steps_ahead) make them drift, and the policy
gradient is then off-policy. The corrections reweight or drop tokens by the ratio
r_t = π_old(y_t) / π_rollout(y_t), or by a token's age a_t (the trainer's step minus the version
of the weights that sampled it: grpo.LossInputs.ages). All weights are constants: no gradient flows
through them. One registered function per value of grpo.rollout_is:

    none        w = 1
    token-tis   w_t = min(r_t, C)                                     truncated IS, per token
    seq-tis     w_i = min(Π_t r_t, C) on every token of sequence i     truncated IS, per sequence
    token-mis   w_t = 1 if α ≤ r_t ≤ β else 0                          masked IS (IcePop), per token
    seq-mis     w_i = 1 if α ≤ Π_t r_t ≤ β else 0                      masked IS, per sequence
    geo-mask    w_i = 1 if 1-δ ≤ exp(mean_t log r_t) ≤ 1+δ else 0       geometric sequence mask
    age-mask    w_t = 1 if a_t ≤ N else 0                              bounded staleness, per token

A dropped token keeps its place in the loss normaliser (its loss is multiplied by 0, as in
IcePop), so the global-normaliser contract of grpo.py holds unchanged. A row of the (B, T)
tensors is one sequence.

A new correction is one function here, decorated with `@register_correction(name, keys=..., ...)`,
and its hand-computed test in tests/test_rollout_correction.py: config.py offers every registered
name as a value of grpo.rollout_is, trainer/config_checks.py checks the keys against its
declaration (one that reads the ages needs stream.sampling_steps_ahead >= 1: at 0 every age is 0),
and the shared loss tests (split invariance, masked inf/nan) run on it through CORRECTIONS. The
function reads one CorrectionInputs and the correction's bounds (RolloutIS) and returns the (B, T)
weights.

    python -m pytest tests/test_rollout_correction.py -q
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from trainer.losses import LOG_RATIO_CLAMP, seq_mean, seq_sum

MISMATCH_TOL = 0.1  # |Δ logp| above which a token counts as mismatched in the metrics


@dataclass(frozen=True)
class RolloutIS:
    """One importance correction and its bounds (the grpo.rollout_is* keys); from the config:
    from_config(cfg.grpo)."""
    kind: str = "none"
    cap: float = 2.0  # C of the truncated kinds
    low: float = 0.5  # α of the masked kinds
    high: float = 5.0  # β of the masked kinds
    delta: float = 0.01  # δ of geo-mask
    max_age: int = 1  # N of age-mask: steps

    def __post_init__(self):
        assert self.kind in CORRECTIONS, f"rollout_is must be one of {list(CORRECTIONS)}, got {self.kind!r}"
        assert self.cap > 0 and 0 <= self.low <= self.high and self.delta > 0 and self.max_age >= 0, self

    @classmethod
    def from_config(cls, grpo_cfg) -> "RolloutIS":
        """grpo_cfg: config.GRPOConfig (its rollout_is* keys)."""
        return cls(grpo_cfg.rollout_is, grpo_cfg.rollout_is_cap, grpo_cfg.rollout_is_low, grpo_cfg.rollout_is_high,
                   grpo_cfg.rollout_is_delta, grpo_cfg.rollout_is_max_age)


# -----------------------------------------------------------------------------
# the registry


@dataclass(frozen=True)
class CorrectionInputs:
    """What a correction reads, each (B, T), one sequence per row."""
    log_ratio: Tensor  # log r_t = log π_old(y_t) - log π_rollout(y_t), ±LOG_RATIO_CLAMP, 0 outside the mask
    mask: Tensor  # bool: True on loss tokens
    ages: Tensor | None  # long: each token's age in steps (grpo.LossInputs.ages); None where the caller has none


CorrectionFn = Callable[[CorrectionInputs, RolloutIS], Tensor]  # -> (B, T) weights (zeroed outside the mask after)


@dataclass(frozen=True)
class CorrectionSpec:
    """One correction's declaration: its function and what it reads and reports."""
    name: str
    fn: CorrectionFn
    keys: tuple[str, ...]  # the grpo.* keys of its bounds (RolloutIS fields from_config reads)
    reports: str  # "cap": is_cap_frac (tokens at the cap); "drop": is_drop_frac (tokens dropped); "": neither
    ages: bool  # it reads CorrectionInputs.ages


CORRECTIONS: dict[str, CorrectionSpec] = {}


def register_correction(name: str, *, keys: tuple[str, ...] = (), reports: str = "",
                        ages: bool = False) -> Callable[[CorrectionFn], CorrectionFn]:
    """Decorator: register fn as the correction grpo.rollout_is=name, with its declaration."""
    def register(fn: CorrectionFn) -> CorrectionFn:
        assert name not in CORRECTIONS, f"correction {name!r} registered twice"
        assert reports in ("cap", "drop", ""), reports
        CORRECTIONS[name] = CorrectionSpec(name, fn, keys, reports, ages)
        return fn
    return register


# -----------------------------------------------------------------------------
# the corrections


@register_correction("none")
def no_correction(x: CorrectionInputs, cfg: RolloutIS) -> Tensor:
    """w = 1: the sampler's tokens trained as if π_old had sampled them."""
    return torch.ones_like(x.log_ratio)


@register_correction("token-tis", keys=("rollout_is_cap",), reports="cap")
def token_tis(x: CorrectionInputs, cfg: RolloutIS) -> Tensor:
    """Truncated importance sampling per token: w_t = min(r_t, C)."""
    return torch.exp(x.log_ratio).clamp(max=cfg.cap)


@register_correction("seq-tis", keys=("rollout_is_cap",), reports="cap")
def seq_tis(x: CorrectionInputs, cfg: RolloutIS) -> Tensor:
    """Truncated importance sampling per sequence: w_i = min(Π_t r_t, C) on every token of sequence i
    (the product in log space, clamped before exp)."""
    ratio = torch.exp(seq_sum(x.log_ratio, x.mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (B,)
    return ratio.clamp(max=cfg.cap)[:, None].expand_as(x.log_ratio)


@register_correction("token-mis", keys=("rollout_is_low", "rollout_is_high"), reports="drop")
def token_mis(x: CorrectionInputs, cfg: RolloutIS) -> Tensor:
    """Masked importance sampling per token (IcePop): w_t = 1 if α ≤ r_t ≤ β else 0."""
    ratio = torch.exp(x.log_ratio)
    return ((ratio >= cfg.low) & (ratio <= cfg.high)).float()


@register_correction("seq-mis", keys=("rollout_is_low", "rollout_is_high"), reports="drop")
def seq_mis(x: CorrectionInputs, cfg: RolloutIS) -> Tensor:
    """Masked importance sampling per sequence: w_i = 1 if α ≤ Π_t r_t ≤ β else 0."""
    ratio = torch.exp(seq_sum(x.log_ratio, x.mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (B,)
    return ((ratio >= cfg.low) & (ratio <= cfg.high)).float()[:, None].expand_as(x.log_ratio)


@register_correction("geo-mask", keys=("rollout_is_delta",), reports="drop")
def geo_mask(x: CorrectionInputs, cfg: RolloutIS) -> Tensor:
    """Geometric sequence mask: w_i = 1 if 1-δ ≤ exp(mean_t log r_t) ≤ 1+δ else 0 (the length-normalised
    sequence ratio, so long and short sequences meet the same bound)."""
    ratio = torch.exp(seq_mean(x.log_ratio, x.mask))  # (B,) geometric mean of the token ratios
    return ((ratio >= 1.0 - cfg.delta) & (ratio <= 1.0 + cfg.delta)).float()[:, None].expand_as(x.log_ratio)


@register_correction("age-mask", keys=("rollout_is_max_age",), reports="drop", ages=True)
def age_mask(x: CorrectionInputs, cfg: RolloutIS) -> Tensor:
    """Bounded staleness, per token: w_t = 1 if a_t ≤ N else 0, a_t = s - v_t the token's age (the
    trainer's step s minus the version v_t of the weights that sampled it), N = grpo.rollout_is_max_age.
    The rule of torchrl's PolicyAgeFilter (an element is dropped when current_version -
    stamped_version > max_policy_lag) and of NeMo-RL's async GRPO (a trajectory older than
    max_trajectory_age_steps is not trained), applied to each token: an episode in flight across a
    weight sync spans several versions, and only its tokens older than N steps are dropped. With
    stream.sampling_steps_ahead = k no token is older than k, so N < k (config_checks refuses N >= k:
    it would mask nothing)."""
    return (x.ages <= cfg.max_age).float()


# -----------------------------------------------------------------------------
# mismatch metrics and weights


def _log_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    """log r_t = log π_old - log π_rollout, 0 outside the mask, clamped to ±LOG_RATIO_CLAMP."""
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
def is_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cfg: RolloutIS,
               ages: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """(B, T) constant weights for the per-token policy-gradient loss from the correction cfg.kind
    names (CORRECTIONS), and metrics: is_weight_mean over the masked tokens; is_cap_frac (a
    correction declared reports="cap": the share of masked tokens at the cap) or is_drop_frac
    (reports="drop": the share dropped). ages: (B, T) long, each token's age (grpo.LossInputs.ages),
    which a correction declared with ages=True needs."""
    spec = CORRECTIONS[cfg.kind]
    on = mask.bool()
    if spec.ages and ages is None:
        raise ValueError(f"grpo.rollout_is={spec.name} reads each token's age: pass LossInputs.ages")
    weights = spec.fn(CorrectionInputs(_log_ratio(old_logp, rollout_logp, on), on, ages), cfg)
    weights = torch.where(on, weights, torch.zeros_like(weights))
    n = on.sum().clamp(min=1)
    metrics = {"is_weight_mean": weights.sum() / n}
    if spec.reports == "cap":
        metrics["is_cap_frac"] = (on & (weights >= cfg.cap)).sum() / n
    elif spec.reports == "drop":
        metrics["is_drop_frac"] = (on & (weights == 0)).sum() / n
    return weights, metrics
