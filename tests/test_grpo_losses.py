"""The registered losses (trainer/losses.py) through grpo.policy_loss, and its clamps: each loss
against hand-computed values and gradients from its paper's formula (a per-sequence reference
written from the GSPO paper), and, for every registered loss (parametrised from LOSSES, each
expectation read from its declaration), the policy gradient on-policy, the micro-batch split
contract × aggregation × rollout correction, extreme tokens and masked inf/nan. A new loss needs
its own hand-computed test here; the shared ones pick it up from the registry.

    .venv/bin/pytest tests/test_grpo_losses.py -q
"""
import math

import pytest
import torch

from conftest import loss_of
from grpo import AGGS, LossInputs, global_norm, policy_loss
from config import GRPOConfig
from trainer.losses import LOSSES, clip_range
from trainer.rollout_correction import CORRECTIONS, RolloutIS

L = math.log
CLIP = dict(clip_low=0.2, clip_high=0.2)


def approx(x, y, tol=1e-6):
    return torch.allclose(torch.as_tensor(x, dtype=torch.float32),
                          torch.as_tensor(y, dtype=torch.float32), atol=tol, rtol=tol)


def rows_of(log_ratios, adv, old=-1.0):
    """A padded (B, T) batch: row i has tokens with the given log ρ; old logp = `old` everywhere."""
    T = max(map(len, log_ratios))
    lr = torch.zeros(len(log_ratios), T)
    mask = torch.zeros(len(log_ratios), T)
    for i, r in enumerate(log_ratios):
        lr[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    old_logp = torch.full_like(lr, old)
    logp = (old_logp + lr).requires_grad_()
    return logp, old_logp, torch.tensor(adv, dtype=torch.float32), mask


# -----------------------------------------------------------------------------
# GSPO


def gspo_reference(logp, old, adv, mask, eps_low, eps_high):
    """The GSPO paper's objective, one sequence at a time: s_i = exp(mean_t log ρ_it),
    loss = -(1/G) Σ_i min(s_i A_i, clip(s_i, 1-ε_l, 1+ε_h) A_i)."""
    total = 0.0
    for i in range(logp.shape[0]):
        m = mask[i].bool()
        s = torch.exp((logp[i][m] - old[i][m]).mean())
        total = total - torch.minimum(s * adv[i], s.clamp(1 - eps_low, 1 + eps_high) * adv[i])
    return total / logp.shape[0]


def test_gspo_hand_values_and_gradients():
    # seq 0: log ρ = [0.1, -0.1] -> s = 1, A = +1: -1, unclipped, d/dlogp_t = -A s / |y| = -0.5
    # seq 1: log ρ = 0.3 × 3 -> s = e^0.3 = 1.3499 > 1.2, A = +1: clipped to -1.2, gradient 0
    # seq 2: log ρ = [ln 0.5] -> s = 0.5 < 0.8, A = -1: -min(-0.5, -0.8) = 0.8, clipped, gradient 0
    # seq 3: log ρ = [0.2, 0.4] -> s = e^0.3, A = -1: -min(-s, -1.2) = s, unclipped, grad s / 2
    # seq-mean-token-mean over 4 sequences (the paper's per-sequence mean)
    logp, old, adv, mask = rows_of([[0.1, -0.1], [0.3, 0.3, 0.3], [L(0.5)], [0.2, 0.4]], [1, 1, -1, -1])
    s = math.exp(0.3)
    loss, met = loss_of(logp, old, adv, mask, loss="gspo", **CLIP, agg="seq-mean-token-mean", norm=4)
    assert approx(loss, (-1 - 1.2 + 0.8 + s) / 4)
    loss.backward()
    want = torch.tensor([[-0.5, -0.5, 0], [0, 0, 0], [0, 0, 0], [s / 2, s / 2, 0]]) / 4
    assert approx(logp.grad, want)
    assert approx(met["clip_frac"], (3 + 1) / 8)  # seqs 1 and 2 clipped: 4 of 8 tokens
    assert approx(met["ratio_max"], s)
    # the paper's per-sequence objective gives the same value and gradient
    ref_logp = logp.detach().clone().requires_grad_()
    ref = gspo_reference(ref_logp, old, adv, mask, 0.2, 0.2)
    ref.backward()
    assert approx(ref, loss) and approx(ref_logp.grad, logp.grad)
    # token-mean instead: each token carries its sequence's loss, so sequences weigh by length;
    # d/dlogp_t = |y_i| · (d ℓ_i / d logp_t) / 8 = -A s / 8 for the unclipped rows
    tm, _ = loss_of(logp, old, adv, mask, loss="gspo", **CLIP, agg="token-mean", norm=8)
    assert approx(tm, (2 * -1 + 3 * -1.2 + 0.8 + 2 * s) / 8)
    (g_tm,) = torch.autograd.grad(tm, logp)
    assert approx(g_tm, torch.tensor([[-1, -1, 0], [0, 0, 0], [0, 0, 0], [s, s, 0]]) / 8)


@pytest.mark.parametrize("loss_name", ["gspo", "gspo-token"])
def test_gspo_matches_paper_on_random_batches(loss_name):
    g = torch.Generator().manual_seed(3)
    logp = torch.randn(6, 7, generator=g).requires_grad_()
    old = logp.detach() + 1e-3 * torch.randn(6, 7, generator=g)  # near on-policy: some clipped
    adv = torch.randn(6, generator=g)
    mask = (torch.arange(7)[None] < torch.tensor([7, 1, 4, 6, 2, 5])[:, None]).float()
    lo, hi = LOSSES[loss_name].clip
    loss, met = loss_of(logp, old, adv, mask, loss=loss_name, clip_low=-1, clip_high=-1,
                            agg="seq-mean-token-mean", norm=6)
    (grad,) = torch.autograd.grad(loss, logp)
    ref_logp = logp.detach().clone().requires_grad_()
    ref = gspo_reference(ref_logp, old, adv, mask, lo, hi)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    assert 0 < met["clip_frac"] < 1  # both branches exercised at GSPO's default ε
    assert approx(loss, ref) and approx(grad, ref_grad)


def test_gspo_token_per_token_advantages():
    # one sequence, log ρ = [0.1, -0.1] so s = 1, token advantages [1, 3], seq-mean-token-mean:
    # gspo-token: ℓ_t = -A_t sg(s) π_t/sg(π_t): value (-1 - 3)/2, d/dlogp_t = -A_t s / 2
    # gspo: ℓ_t = -A_t s(θ): same value; every token gets Σ_t (-A_t s / 2) / |y| = -1
    logp, old, _, mask = rows_of([[0.1, -0.1]], [0])
    A = torch.tensor([[1.0, 3.0]])
    tok, _ = loss_of(logp, old, A, mask, loss="gspo-token", **CLIP, agg="seq-mean-token-mean", norm=1)
    (g_tok,) = torch.autograd.grad(tok, logp)
    seq, _ = loss_of(logp, old, A, mask, loss="gspo", **CLIP, agg="seq-mean-token-mean", norm=1)
    (g_seq,) = torch.autograd.grad(seq, logp)
    assert approx(tok, -2.0) and approx(seq, -2.0)
    assert approx(g_tok, [[-0.5, -1.5]]) and approx(g_seq, [[-1.0, -1.0]])


# -----------------------------------------------------------------------------
# CISPO


def test_cispo_hand_values_and_gradients():
    # ρ = [1.5, 0.5, 1.0], A = [1, -1, 2], ε = (0.2, 0.28): weights sg(clip ρ) = [1.28, 0.8, 1.0]
    # ℓ_t = -w_t A_t logp_t with logp = ln(0.4 ρ); d/dlogp_t = -w_t A_t (token-mean over 3)
    logp, old, _, mask = rows_of([[L(1.5), L(0.5), 0.0]], [0], old=L(0.4))
    A = torch.tensor([[1.0, -1.0, 2.0]])
    lp = [L(0.6), L(0.2), L(0.4)]
    loss, met = loss_of(logp, old, A, mask, loss="cispo", clip_low=0.2, clip_high=0.28, norm=3)
    assert approx(loss, (-1.28 * lp[0] + 0.8 * lp[1] - 2 * lp[2]) / 3)
    loss.backward()
    assert approx(logp.grad, [[-1.28 / 3, 0.8 / 3, -2 / 3]])  # no token's gradient is zeroed
    assert approx(met["clip_frac"], 2 / 3)
    # PPO-clip zeroes the first two tokens' gradients on the same batch
    logp.grad = None
    loss_of(logp, old, A, mask, clip_low=0.2, clip_high=0.28, norm=3)[0].backward()
    assert approx(logp.grad, [[0.0, 0.0, -2 / 3]])
    # default ε: no lower bound (1 - 1.0 = 0), ε_high 0.28 -> weights [1.28, 0.5, 1.0]
    logp.grad = None
    loss_of(logp, old, A, mask, loss="cispo", clip_low=-1, clip_high=-1, norm=3)[0].backward()
    assert approx(logp.grad, [[-1.28 / 3, 0.5 / 3, -2 / 3]])
    with pytest.raises(AssertionError, match="dual-clip"):
        loss_of(logp, old, A, mask, loss="cispo", clip_low=-1, clip_high=-1, dual_clip_c=3.0, norm=3)


# -----------------------------------------------------------------------------
# SAPO


def test_sapo_hand_values_and_gradients():
    """The SAPO paper's gate, by hand: f(ρ) = (4/τ) σ(τ(ρ-1)), ℓ_t = -f(ρ_t) A_t, τ = 1.0 for A > 0
    and 1.05 for A < 0; d ℓ_t / d log π_θ = -A_t · 4σ(1-σ) · ρ_t. ρ = [1, 1.5, 0.5], A = [1, -1, 2],
    token-mean over 3: at ρ = 1 the value -2A/τ = -2 and the plain policy gradient -A = -1."""
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    rho, adv, tau = [1.0, 1.5, 0.5], [1.0, -1.0, 2.0], [1.0, 1.05, 1.0]
    want_loss = [-(4 / t) * sig(t * (r - 1)) * a for r, a, t in zip(rho, adv, tau)]
    want_grad = [-a * 4 * sig(t * (r - 1)) * (1 - sig(t * (r - 1))) * r for r, a, t in zip(rho, adv, tau)]
    assert approx(want_loss[0], -2.0) and approx(want_grad[0], -1.0)
    assert approx(want_loss[1], 2.393585, 1e-5) and approx(want_grad[1], 1.401210, 1e-5)
    logp, old, _, mask = rows_of([[0.0, L(1.5), L(0.5)]], [0])
    loss, met = loss_of(logp, old, torch.tensor([adv]), mask, loss="sapo", clip_low=-1, clip_high=-1, norm=3)
    assert approx(loss, sum(want_loss) / 3) and approx(met["pg_loss"], sum(want_loss) / 3)
    loss.backward()
    assert approx(logp.grad, [[g / 3 for g in want_grad]])
    assert approx(met["ratio_max"], 1.5) and "clip_frac" not in met  # no clip, so no clip metric
    # where PPO-clip (ε 0.2) zeroes a token's gradient (ρ = 1.5 with A > 0), SAPO's gate keeps a
    # smaller one: -4σ(0.5)(1 - σ(0.5)) · 1.5
    logp.grad = None
    loss_of(logp, old, torch.tensor([[1.0, 1.0, 1.0]]), mask, loss="sapo", clip_low=-1, clip_high=-1, norm=1)[0].backward()
    assert approx(logp.grad[0, 1], -4 * sig(0.5) * (1 - sig(0.5)) * 1.5)
    logp.grad = None
    loss_of(logp, old, torch.tensor([[1.0, 1.0, 1.0]]), mask, loss="grpo", **CLIP, norm=1)[0].backward()
    assert logp.grad[0, 1] == 0


# -----------------------------------------------------------------------------
# defaults and the config


@pytest.mark.parametrize("loss_name", LOSSES)
def test_clip_range_reads_the_declaration(loss_name):
    """clip < 0 takes the loss's declared default, an explicit value wins; a loss declared without
    a clip gets none (and the config refuses a clip for it: tests/test_config_checks.py)."""
    clip = LOSSES[loss_name].clip
    assert clip_range(loss_name, -1, -1) == clip
    if clip is not None:
        assert clip_range(loss_name, 0.1, -1) == (0.1, clip[1]) and clip_range(loss_name, -1, 0.5) == (clip[0], 0.5)
    else:
        assert clip_range(loss_name, 0.1, 0.5) is None


def test_declared_clips_are_the_papers():
    # PPO/GRPO ε 0.2; GSPO 3e-4 / 4e-4 on its sequence ratio; CISPO no lower bound (1 - 1.0 = 0), ε_high 0.28
    assert LOSSES["grpo"].clip == (0.2, 0.2)
    assert LOSSES["gspo"].clip == (3e-4, 4e-4) == LOSSES["gspo-token"].clip
    assert LOSSES["cispo"].clip == (1.0, 0.28)
    assert LOSSES["gspo"].sequence_ratio and LOSSES["gspo-token"].sequence_ratio and not LOSSES["grpo"].sequence_ratio
    assert not LOSSES["cispo"].dual_clip and LOSSES["grpo"].dual_clip  # CISPO has no PPO-clip min
    with pytest.raises(AssertionError, match="grpo.loss"):
        clip_range("ppo", 0.2, 0.2)


def test_gspo_default_clip_acts_on_the_sequence_ratio_and_drgrpo_length():
    # GSPO's ε is per sequence ratio: s = e^0.001 > 1 + 4e-4 is already clipped (A > 0)
    logp, old, adv, mask = rows_of([[0.001, 0.001]], [1])
    loss, _ = loss_of(logp, old, adv, mask, loss="gspo", clip_low=-1, clip_high=-1, norm=2)
    assert approx(loss, -(1 + 4e-4))
    # Dr. GRPO's L: sampling.max_context (the max_len argument) unless grpo.drgrpo_max_len is set.
    # One token of A = 1, ratio 1: loss -1 / (norm · L)
    logp, old, adv, mask = rows_of([[0.0]], [1])
    inputs = LossInputs(logp, old, None, None, mask, adv[:, None].expand_as(logp), torch.zeros_like(mask).long(), None)
    assert approx(policy_loss(inputs, 2.0, GRPOConfig(loss_agg="drgrpo"), 99)[0], -1 / (2 * 99))
    assert approx(policy_loss(inputs, 2.0, GRPOConfig(loss_agg="drgrpo", drgrpo_max_len=7), 99)[0], -1 / (2 * 7))


# -----------------------------------------------------------------------------
# robustness: clamps


@pytest.mark.parametrize("loss_name", LOSSES)
def test_extreme_tokens_stay_finite(loss_name):
    """A token 60 nats off (log ρ clamped to 20 before exp) and a reference 80 nats away (k3
    capped at 10) leave the loss, metrics and gradients finite."""
    logp = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-60.5, -1.0, 58.0]])  # log ρ = +60, 0, -60
    ref = torch.tensor([[79.5, -1.0, -2.0]])  # ref - logp = 80 for the first token
    for adv in (torch.tensor([1.0]), torch.tensor([-1.0])):
        logp.grad = None
        loss, met = loss_of(logp, old, adv, torch.ones(1, 3), loss=loss_name, clip_low=-1,
                                clip_high=-1, ref_logp=ref, kl_beta=0.1, agg="seq-mean-token-mean",
                                norm=1, rollout_logp=old - 50, rollout_is=RolloutIS("seq-tis"))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), loss_name
        assert all(torch.isfinite(v) for v in met.values()), met
        assert approx(met["kl"], 10 / 3)  # the first token's k3 capped at 10, the others 0
        # log ρ = (20, 0, -20) after the clamp; a sequence ratio is exp(mean) = 1
        assert approx(met["ratio_max"], 1.0 if LOSSES[loss_name].sequence_ratio else math.exp(20))


@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_on_policy_every_loss_is_the_policy_gradient(loss_name, agg):
    """At π_θ = π_old (ρ = 1 on every token, as with one optimizer step per batch) every surrogate's
    gradient is the policy gradient: d loss / d log π_θ(y_t) = -A_i / norm for token-mean, and
    -A_i / (|y_i| · norm) for seq-mean-token-mean (REINFORCE with the advantage; each loss's clip
    or gate is inactive at ρ = 1). Rows of 3, 1 and 2 tokens, advantages 1.5, -2, 0.5."""
    logp, old, adv, mask = rows_of([[0.0, 0.0, 0.0], [0.0], [0.0, 0.0]], [1.5, -2.0, 0.5], old=-1.3)
    norm = global_norm([mask], agg)
    loss, met = loss_of(logp, old, adv, mask, loss=loss_name, clip_low=-1, clip_high=-1, agg=agg, norm=norm)
    (grad,) = torch.autograd.grad(loss, logp)
    lengths = torch.tensor([3.0, 1.0, 2.0])[:, None]
    want = -adv[:, None] / norm * (1.0 if agg == "token-mean" else 1.0 / lengths) * mask
    assert approx(grad, want), (loss_name, agg)
    assert approx(met["ratio_max"], 1.0) and approx(met.get("clip_frac", 0.0), 0.0)


def test_k3_cap_value():
    # ref - logp = 30: exp(30) - 31 would dominate; capped at 10, and its gradient is then 0
    logp = torch.tensor([[0.0]], requires_grad=True)
    loss, met = loss_of(logp, logp.detach(), torch.zeros(1), torch.ones(1, 1), **CLIP,
                            ref_logp=torch.tensor([[30.0]]), kl_beta=1.0, norm=1)
    loss.backward()
    assert approx(loss, 10.0) and approx(met["kl"], 10.0) and logp.grad.item() == 0.0


# -----------------------------------------------------------------------------
# the normalisation contract for every variant


@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("agg", AGGS)
def test_micro_batch_split_invariance_all_losses(loss_name, agg):
    g = torch.Generator().manual_seed(5)
    B, T = 7, 9
    logp = torch.randn(B, T, generator=g).requires_grad_()
    old = logp.detach() + 0.2 * torch.randn(B, T, generator=g)
    ref = logp.detach() + 0.2 * torch.randn(B, T, generator=g)
    rollout = old + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.arange(T)[None] < torch.tensor([9, 1, 4, 0, 7, 2, 5])[:, None]
    ages = torch.randint(0, 3, (B, T), generator=g)
    clip = dict(clip_low=0.2, clip_high=0.28) if LOSSES[loss_name].clip else {}
    for kind in CORRECTIONS:
        kw = dict(loss=loss_name, **clip, kl_beta=0.05, agg=agg, max_len=T,
                  rollout_is=RolloutIS(kind, cap=1.5, low=0.7, high=1.4, delta=0.3, max_age=1))

        def part_loss(rows, norm):
            return loss_of(logp[rows], old[rows], adv[rows], mask[rows], ref_logp=ref[rows],
                               rollout_logp=rollout[rows], ages=ages[rows], norm=norm, **kw)[0]

        full = part_loss(slice(0, B), global_norm([mask], agg))
        (g_full,) = torch.autograd.grad(full, logp)
        splits = [slice(0, 2), slice(2, 3), slice(3, 7)]
        norm = global_norm([mask[s] for s in splits], agg)
        parts = sum(part_loss(s, norm) for s in splits)
        (g_parts,) = torch.autograd.grad(parts, logp)
        assert approx(parts, full) and approx(g_parts, g_full), (loss_name, agg, kind)
        assert (g_full[~mask] == 0).all() and g_full[mask].abs().sum() > 0, (loss_name, agg, kind)


# -----------------------------------------------------------------------------
# masked positions may hold anything


@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("bad", [-math.inf, math.nan])
def test_masked_positions_holding_inf_or_nan(loss_name, bad):
    """-inf/nan at masked positions of logp, old, ref, rollout and entropy give the same (finite)
    loss, metrics and gradient as zeros there, for every rollout correction and aggregation."""
    g = torch.Generator().manual_seed(11)
    B, T = 4, 6
    mask = torch.arange(T)[None] < torch.tensor([6, 2, 0, 4])[:, None]
    mask[0, 0] = False  # a masked position before the loss tokens (a prompt / tool output)
    base = {k: torch.randn(B, T, generator=g) - 1.0 for k in ("logp", "old", "ref", "rollout", "ent")}
    adv = torch.randn(B, generator=g)
    ages = torch.randint(0, 3, (B, T), generator=g)
    spec = LOSSES[loss_name]
    clip = dict(clip_low=0.2, clip_high=0.28) if spec.clip else {}
    for kind in CORRECTIONS:
        for agg in AGGS:
            kw = dict(loss=loss_name, **clip, kl_beta=0.05, agg=agg, max_len=T, ages=ages,
                      dual_clip_c=3.0 if spec.dual_clip else 0.0,
                      rollout_is=RolloutIS(kind, cap=1.5, low=0.7, high=1.4, delta=0.3, max_age=1))
            out = []
            for fill in (0.0, bad):
                t = {k: torch.where(mask, v, torch.full_like(v, fill)) for k, v in base.items()}
                logp = t["logp"].requires_grad_()
                loss, met = loss_of(logp, t["old"], adv, mask, ref_logp=t["ref"], rollout_logp=t["rollout"],
                                        entropy=t["ent"], norm=global_norm([mask], agg), **kw)
                (grad,) = torch.autograd.grad(loss, logp)
                out.append((loss, met, grad))
            (l0, m0, g0), (l1, m1, g1) = out
            where = (loss_name, kind, agg, bad)
            assert torch.isfinite(l1) and torch.isfinite(g1).all(), where
            assert approx(l1, l0) and torch.equal(g1, g0), where
            assert all(approx(m1[k], m0[k]) for k in m0), where
