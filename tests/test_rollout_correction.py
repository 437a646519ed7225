"""trainer/rollout_correction.py (sampler vs trainer logprobs: mismatch metrics, truncated / masked IS,
the geometric sequence mask, the age mask) against hand-computed values, how policy_loss applies
them, and the registry config.py and the shared loss tests read (CORRECTIONS).

    .venv/bin/pytest tests/test_rollout_correction.py -q
"""
import math

import pytest
import torch

from conftest import loss_of
from trainer.rollout_correction import CORRECTIONS, RolloutIS, is_weights, mismatch_metrics

L = math.log


def approx(x, y, tol=1e-6):
    return torch.allclose(torch.as_tensor(x, dtype=torch.float32),
                          torch.as_tensor(y, dtype=torch.float32), atol=tol, rtol=tol)


def batch():
    """Row 0: token ratios r = π_old/π_rollout = [3, 0.4, 1]; row 1: [1.1, 1.1] and a padding
    slot holding garbage; row 2: all padding."""
    rollout = torch.full((3, 3), -2.0)
    old = rollout + torch.tensor([[L(3), L(0.4), 0.0], [L(1.1), L(1.1), 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    rollout[1, 2] = float("nan")
    old[2] = -float("inf")
    return old, rollout, mask


def test_mismatch_metrics_hand():
    old, rollout, mask = batch()
    met = mismatch_metrics(old, rollout, mask, tol=0.5)
    d = [L(3), L(0.4), 0.0, L(1.1), L(1.1)]
    assert approx(met["mismatch_abs_mean"], sum(abs(x) for x in d) / 5)
    assert approx(met["mismatch_abs_max"], L(3))
    # k3 of KL(π_rollout‖π_old) with r = π_old/π_rollout: r - 1 - log r per token
    assert approx(met["mismatch_kl"], sum(math.exp(x) - 1 - x for x in d) / 5)
    assert approx(met["mismatch_frac"], 2 / 5)  # |ln 3| and |ln 0.4| exceed 0.5
    same = mismatch_metrics(old, old, mask)
    assert all(v == 0 for v in same.values())


@pytest.mark.parametrize("kind,want,extra", [
    ("none", [[1, 1, 1], [1, 1, 0]], {}),
    ("token-tis", [[2, 0.4, 1], [1.1, 1.1, 0]], {"is_cap_frac": 1 / 5}),  # min(r, 2)
    ("token-mis", [[0, 0, 1], [1, 1, 0]], {"is_drop_frac": 2 / 5}),  # r outside [0.5, 2.5]
    # sequence ratios: Π r = 1.2 and 1.21
    ("seq-tis", [[1.2] * 3, [1.21, 1.21, 0]], {"is_cap_frac": 0.0}),
    ("seq-mis", [[1, 1, 1], [1, 1, 0]], {"is_drop_frac": 0.0}),
    # geometric means: 1.2^(1/3) = 1.0627 (outside 1 ± 0.05, dropped), 1.1 (dropped)
    ("geo-mask", [[0, 0, 0], [0, 0, 0]], {"is_drop_frac": 1.0}),
])
def test_is_weights_hand(kind, want, extra):
    old, rollout, mask = batch()
    cfg = RolloutIS(kind, cap=2.0, low=0.5, high=2.5, delta=0.05)
    w, met = is_weights(old, rollout, mask, cfg)
    assert approx(w[:2], want) and (w[2] == 0).all() and not w.requires_grad
    n = sum(map(sum, want))
    assert approx(met["is_weight_mean"], n / 5)
    for k, v in extra.items():
        assert approx(met[k], v), k


def test_sequence_bounds_and_geo_mask_keep():
    old, rollout, mask = batch()
    # seq-mis with β = 1.205 drops row 1 (Π r = 1.21) and keeps row 0 (1.2)
    w, met = is_weights(old, rollout, mask, RolloutIS("seq-mis", low=0.5, high=1.205))
    assert approx(w[:2], [[1, 1, 1], [0, 0, 0]]) and approx(met["is_drop_frac"], 2 / 5)
    # δ = 0.07 keeps row 0 (1.0627) and drops row 1 (1.1)
    w, _ = is_weights(old, rollout, mask, RolloutIS("geo-mask", delta=0.07))
    assert approx(w[:2], [[1, 1, 1], [0, 0, 0]])
    # seq-tis caps a long sequence's product: Π r = 1.21 with C = 1.15
    w, met = is_weights(old, rollout, mask, RolloutIS("seq-tis", cap=1.15))
    assert approx(w[:2], [[1.15] * 3, [1.15, 1.15, 0]]) and approx(met["is_cap_frac"], 1.0)


def test_bad_kind_is_a_clear_error():
    with pytest.raises(AssertionError, match="rollout_is must be one of"):
        RolloutIS("tis")


def test_policy_loss_applies_weights_to_pg_only():
    # on-policy (logp = old, ρ = 1): per-token pg = -A, so the weighted loss is -Σ w A / norm;
    # the KL term is not reweighted. token-tis weights [2, 0.4, 1] on row 0, [1.1, 1.1] on row 1.
    old, rollout, mask = batch()
    old = torch.where(mask.bool(), old, torch.zeros_like(old))
    logp = old.clone().requires_grad_()
    adv = torch.tensor([1.0, -2.0, 5.0])
    ref = old + torch.where(mask.bool(), torch.full_like(old, L(2)), torch.zeros_like(old))
    k3 = 2 - L(2) - 1
    kw = dict(clip_low=0.2, clip_high=0.2, ref_logp=ref, kl_beta=0.1, norm=5)
    plain, met0 = loss_of(logp, old, adv, mask, **kw)
    assert approx(plain, (-3 * 1 + 2 * 2 + 5 * 0.1 * k3) / 5)
    assert "mismatch_kl" not in met0  # no rollout_logp: nothing logged
    logged, met1 = loss_of(logp, old, adv, mask, rollout_logp=rollout, **kw)
    assert approx(logged, plain) and approx(met1["mismatch_abs_max"], L(3)) and "is_weight_mean" not in met1
    tis, met = loss_of(logp, old, adv, mask, rollout_logp=rollout, rollout_is=RolloutIS("token-tis"), **kw)
    assert approx(tis, (-(2 + 0.4 + 1) + 2 * (1.1 + 1.1) + 5 * 0.1 * k3) / 5)
    tis.backward()
    # d/dlogp of -w A ρ at ρ = 1 is -w A; of β k3 it is β (1 - e^{ref - logp}) = -β
    want = torch.tensor([[-2, -0.4, -1], [2.2, 2.2, 0], [0, 0, 0]]) / 5
    want = want - 0.1 * mask / 5
    assert approx(logp.grad, want)
    assert approx(met["is_weight_mean"], (2 + 0.4 + 1 + 1.1 + 1.1) / 5)


# -----------------------------------------------------------------------------
# the age mask: tokens sampled more than N steps before the trainer's step


AGES = torch.tensor([[0, 2, 1], [1, 3, 9], [5, 5, 5]])  # row 1's third slot and row 2 are padding


def test_age_mask_hand():
    """w_t = 1 if a_t ≤ N else 0, whatever the ratio: N = 1 keeps ages 0 and 1, N = 0 only 0."""
    old, rollout, mask = batch()
    w, met = is_weights(old, rollout, mask, RolloutIS("age-mask", max_age=1), AGES)
    assert approx(w[:2], [[1, 0, 1], [1, 0, 0]]) and (w[2] == 0).all()
    assert approx(met["is_drop_frac"], 2 / 5) and approx(met["is_weight_mean"], 3 / 5)
    w, _ = is_weights(old, rollout, mask, RolloutIS("age-mask", max_age=0), AGES)
    assert approx(w[:2], [[1, 0, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="reads each token's age"):
        is_weights(old, rollout, mask, RolloutIS("age-mask"))


def test_policy_loss_drops_the_tokens_older_than_max_age():
    """On-policy (ρ = 1) the per-token pg is -A; age-mask with N = 1 keeps row 0's tokens 0 and 2
    (A = 1) and row 1's token 0 (A = -3): loss (-2 + 3) / 5, the dropped tokens still counted in the
    normaliser, and no gradient through them."""
    old, rollout, mask = batch()
    old = torch.where(mask.bool(), old, torch.zeros_like(old))
    logp = old.clone().requires_grad_()
    loss, met = loss_of(logp, old, torch.tensor([1.0, -3.0, 5.0]), mask, rollout_logp=rollout, ages=AGES, norm=5,
                        rollout_is=RolloutIS("age-mask", max_age=1), clip_low=0.2, clip_high=0.2)
    assert approx(loss, (-2 + 3) / 5) and approx(met["is_drop_frac"], 2 / 5)
    loss.backward()
    assert approx(logp.grad, torch.tensor([[-1, 0, -1], [3, 0, 0], [0, 0, 0]]) / 5)


def test_every_registered_correction_is_a_value_of_the_key_and_its_bounds_are_keys():
    """config.py offers exactly the registered corrections as grpo.rollout_is; each correction's
    declared keys are grpo keys with a range (trainer/config_checks.RANGES)."""
    import dataclasses
    from config import GRPOConfig
    from trainer.config_checks import RANGES
    field = next(f for f in dataclasses.fields(GRPOConfig) if f.name == "rollout_is")
    assert set(field.metadata["choices"]) == set(CORRECTIONS)
    assert all(f"grpo.{key}" in RANGES for spec in CORRECTIONS.values() for key in spec.keys)
