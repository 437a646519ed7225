"""grpo.py against hand-computed values, a loop reference, and a one-step learning check (the credit:
tests/test_credits.py; each registered loss: tests/test_grpo_losses.py).

    .venv/bin/pytest tests/test_grpo.py -q
"""
import math

import pytest
import torch

from conftest import loss_of
from grpo import AGGS, advantages, global_norm, keep_mask_dynamic
from trainer.losses import masked_mean

L = math.log
CLIP = dict(clip_low=0.2, clip_high=0.2)


def approx(x, y, tol=1e-6):
    return torch.allclose(torch.as_tensor(x, dtype=torch.float32),
                          torch.as_tensor(y, dtype=torch.float32), atol=tol, rtol=tol)


# -----------------------------------------------------------------------------
# advantages


def loop_advantages(rewards, G, mode, eps):
    """Reference: one group at a time, plain Python (verl's habit of a loop twin)."""
    r = [float(x) for x in rewards]
    n = len(r)
    mean_b = sum(r) / n
    std_b = math.sqrt(sum((x - mean_b) ** 2 for x in r) / (n - 1)) if n > 1 else 0.0
    out = []
    for p in range(n // G):
        g = r[p * G:(p + 1) * G]
        mu = sum(g) / G
        std_g = math.sqrt(sum((x - mu) ** 2 for x in g) / (G - 1)) if G > 1 else 0.0
        for x in g:
            if mode == "none":
                out.append(x - mu)
            elif mode == "group":
                out.append((x - mu) / (std_g + eps))
            else:
                out.append((x - mu) / (std_b + eps))
    return torch.tensor(out)


def test_group_advantage_hand():
    a = advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), 3, "group", eps=0.0)
    s = math.sqrt(((2 / 3) ** 2 + (1 / 3) ** 2 + (1 / 3) ** 2) / 2)  # unbiased: / (G-1)
    want = [(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, (1 / 3) / s, (1 / 3) / s, (-2 / 3) / s]
    assert approx(a, want)
    assert approx(a[0], 1.1547005)  # 2/sqrt(3)


def test_group_advantage_eps():
    a = advantages(torch.tensor([0.0, 1.0]), 2, "group", eps=0.5)
    s = math.sqrt((0.5 ** 2 + 0.5 ** 2) / 1)  # 0.7071
    assert approx(a, [-0.5 / (s + 0.5), 0.5 / (s + 0.5)])
    assert approx(a[1], 0.4142136)  # 0.5 / 1.2071


def test_batch_and_none_advantage_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    # group means 0.5 and 1.0 -> centred [0.5, -0.5, 0, 0]; batch std of raw rewards:
    # mean 0.75, var = (3·0.25² + 0.75²)/3 = 0.25 -> std 0.5
    assert approx(advantages(r, 2, "batch", eps=0.0), [1.0, -1.0, 0.0, 0.0])
    assert approx(advantages(r, 2, "batch", eps=0.5), [0.5, -0.5, 0.0, 0.0])
    assert approx(advantages(r, 2, "none"), [0.5, -0.5, 0.0, 0.0])
    # none ignores scale: rewards ×10 -> advantages ×10 (Dr. GRPO keeps the reward units)
    assert approx(advantages(r * 10, 2, "none"), [5.0, -5.0, 0.0, 0.0])


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
def test_empty_batch_advantages(mode):
    """Dynamic sampling can drop every group: no rewards -> no advantages, and no torch warning
    ("std(): degrees of freedom is <= 0") on the way."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = advantages(torch.zeros(0), 4, mode)
    assert a.shape == (0,) and a.dtype == torch.float32


def test_degenerate_groups():
    same = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    for mode in ("group", "batch", "none"):
        a = advantages(same, 3, mode)
        assert torch.isfinite(a).all() and approx(a, [0.0] * 6), mode
    one = torch.tensor([1.0, 0.0, -1.0])  # group_size 1: no baseline -> 0, never nan
    for mode in ("group", "batch", "none"):
        assert approx(advantages(one, 1, mode), [0.0, 0.0, 0.0]), mode
    assert approx(advantages(torch.tensor([3.0]), 1, "batch"), [0.0])


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
@pytest.mark.parametrize("G", [1, 2, 5])
def test_advantage_matches_loop(mode, G):
    g = torch.Generator().manual_seed(G)
    for eps in (1e-6, 0.1):
        r = torch.randint(-1, 2, (4 * G,), generator=g).float()  # SkyRL rewards -1/0/1
        r[:G] = 1.0  # one all-equal group
        assert approx(advantages(r, G, mode, eps), loop_advantages(r, G, mode, eps), 1e-5)
        r = torch.randn(4 * G, generator=g)
        assert approx(advantages(r, G, mode, eps), loop_advantages(r, G, mode, eps), 1e-5)


def test_bad_mode():
    with pytest.raises(ValueError):
        advantages(torch.zeros(4), 2, "grpo")


def test_dynamic_keep():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, -1.0, 0.0])
    assert keep_mask_dynamic(r, 2).tolist() == [False, True, False, True]
    assert keep_mask_dynamic(r, 4).tolist() == [True, True]
    assert keep_mask_dynamic(torch.tensor([2.0, 2.0, 2.0]), 3).tolist() == [False]


def test_dynamic_sampling_on_exec_match_drops_all_wrong_groups_that_differ_only_in_shaping():
    """Dense shaping makes an all-wrong group's rewards differ (0.025 vs 0.075): kept when the
    filter compares rewards, dropped when it compares exec_match; a group with a right answer is
    kept by both. Group 1: all wrong, shaping only; group 2: one right."""
    from types import SimpleNamespace

    import grpo
    from reward import Reward
    episodes = [SimpleNamespace(reward=Reward(v, m, True)) for v, m in
                [(0.025, False), (0.075, False), (1.05, True), (0.05, False)]]
    assert grpo.keep_mask(episodes, 2, "reward") == [True] * 4
    assert grpo.keep_mask(episodes, 2, "exec_match") == [False, False, True, True]


# -----------------------------------------------------------------------------
# the clipped surrogate


def one_row(ratios, adv, **kw):
    """Loss of one sequence whose tokens have the given ratios and per-token advantages."""
    old = torch.zeros(1, len(ratios))
    logp = torch.tensor([[L(x) for x in ratios]], requires_grad=True)
    a = torch.tensor([adv], dtype=torch.float32)
    mask = torch.ones_like(old)
    kw = {**CLIP, **kw}
    loss, met = loss_of(logp, old, a, mask, norm=len(ratios), **kw)
    loss.backward()
    return loss, met, logp.grad[0]


def test_clip_cases_hand():
    # A=+1 ρ=1.5 -> -min(1.5, 1.2) = -1.2  (clipped, grad 0)
    # A=+1 ρ=0.5 -> -min(0.5, 0.8) = -0.5  (unclipped: grad -ρA = -0.5)
    # A=-1 ρ=1.5 -> -min(-1.5, -1.2) = 1.5 (unclipped: grad -ρA = 1.5)
    # A=-1 ρ=0.5 -> -min(-0.5, -0.8) = 0.8 (clipped, grad 0)
    # A=+2 ρ=1.1 -> -2.2 inside the clip range
    loss, met, grad = one_row([1.5, 0.5, 1.5, 0.5, 1.1], [1, 1, -1, -1, 2])
    assert approx(loss, (-1.2 - 0.5 + 1.5 + 0.8 - 2.2) / 5)
    assert approx(grad, [0.0, -0.5 / 5, 1.5 / 5, 0.0, -2.2 / 5])
    assert approx(met["clip_frac"], 2 / 5)
    assert approx(met["pg_loss"], (-1.2 - 0.5 + 1.5 + 0.8 - 2.2) / 5)
    assert approx(met["ratio_max"], 1.5)
    kl = [x - 1 - L(x) for x in (1.5, 0.5, 1.5, 0.5, 1.1)]  # k3 of KL(old‖new)
    assert approx(met["approx_kl"], sum(kl) / 5)


def test_clip_higher_asymmetry():
    # ρ=1.25, A=+1: clipped at 1.2 with ε_high=0.2, free with ε_high=0.28 (DAPO)
    # ρ=0.75, A=-1: clipped at 0.8 by ε_low=0.2 in both
    sym, m_sym, g_sym = one_row([1.25, 0.75], [1, -1], clip_low=0.2, clip_high=0.2)
    hi, m_hi, g_hi = one_row([1.25, 0.75], [1, -1], clip_low=0.2, clip_high=0.28)
    assert approx(sym, (-1.2 + 0.8) / 2) and approx(m_sym["clip_frac"], 1.0)
    assert approx(hi, (-1.25 + 0.8) / 2) and approx(m_hi["clip_frac"], 0.5)
    assert approx(g_sym, [0.0, 0.0]) and approx(g_hi, [-1.25 / 2, 0.0])
    # and ρ=1.3 exceeds 1.28 again
    hi2, _, _ = one_row([1.3], [1], clip_low=0.2, clip_high=0.28)
    assert approx(hi2, -1.28)


def test_dual_clip_negative_advantage():
    # c=3. A=-1 ρ=5: clip1 = -min(-5, -1.2) = 5 -> min(5, 3) = 3 (grad 0)
    #      A=-2 ρ=5: clip1 = 10 -> min(10, 6) = 6
    #      A=-1 ρ=2: clip1 = 2 < 3 -> 2 (grad -ρA = 2)
    #      A=+1 ρ=5: positive advantage untouched -> -1.2
    ratios, adv = [5.0, 5.0, 2.0, 5.0], [-1, -2, -1, 1]
    loss, met, grad = one_row(ratios, adv, dual_clip_c=3.0)
    assert approx(loss, (3 + 6 + 2 - 1.2) / 4)
    assert approx(grad, [0.0, 0.0, 2 / 4, 0.0])
    assert approx(met["dual_clip_frac"], 2 / 4)
    off, _, _ = one_row(ratios, adv)  # without dual-clip
    assert approx(off, (5 + 10 + 2 - 1.2) / 4)
    with pytest.raises(AssertionError):
        one_row(ratios, adv, dual_clip_c=0.5)


def test_k3_kl_value_and_gradient_sign():
    # A=0 -> pg = 0, so loss = β·k3. d = ref - logp = ln 2: k3 = 2 - ln2 - 1 = 0.30685
    # d/dlogp k3 = 1 - e^d = -1: descent raises logp towards the reference
    beta = 0.1
    logp = torch.tensor([[0.0, L(0.5)]], requires_grad=True)
    ref = torch.tensor([[L(2.0), L(0.5) - L(2.0)]])  # second token: d = -ln2
    z = torch.zeros(1)
    loss, met = loss_of(logp, logp.detach(), z, torch.ones(1, 2), **CLIP, ref_logp=ref,
                            kl_beta=beta, norm=2.0)
    k_up = 2 - L(2) - 1           # d = +ln2
    k_down = 0.5 + L(2) - 1       # d = -ln2: e^-ln2 - (-ln2) - 1 = 0.19315
    assert approx(loss, beta * (k_up + k_down) / 2)
    assert approx(met["kl"], (k_up + k_down) / 2)
    loss.backward()
    assert approx(logp.grad[0], [beta * (1 - 2) / 2, beta * (1 - 0.5) / 2])
    assert logp.grad[0, 0] < 0 < logp.grad[0, 1]  # pulled up / pushed down towards ref
    with pytest.raises(AssertionError):
        loss_of(logp, logp.detach(), z, torch.ones(1, 2), **CLIP, kl_beta=beta, norm=2.0)


# -----------------------------------------------------------------------------
# aggregation and masks


def agg_batch():
    # ρ = 1 everywhere, so per-token loss is -A[b, t]: row 0 tokens -1, -2; row 1 token -4;
    # row 2 is all padding (must count neither as tokens nor as a sequence)
    A = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    logp = torch.zeros(3, 3, requires_grad=True)
    return logp, A, mask


@pytest.mark.parametrize("agg,norm,want", [
    ("token-mean", 3, (-1 - 2 - 4) / 3),
    ("seq-mean-token-mean", 2, ((-1 - 2) / 2 + (-4) / 1) / 2),
    ("seq-mean-token-sum", 2, ((-1 - 2) + (-4)) / 2),
    ("drgrpo", 2, (-1 - 2 - 4) / (2 * 4)),
])
def test_aggregation_hand(agg, norm, want):
    logp, A, mask = agg_batch()
    assert global_norm([mask], agg) == norm  # no process group: local count
    loss, _ = loss_of(logp, logp.detach(), A, mask, **CLIP, agg=agg, norm=norm, max_len=4)
    assert approx(loss, want)


def test_masked_tokens_get_zero_gradient():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 5, generator=g).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(3, 5, generator=g)
    ref = logp.detach() + 0.3 * torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]])
    # garbage where mask = 0 must not leak (rollout/prompt slots may hold anything)
    old = torch.where(mask.bool(), old, torch.full_like(old, -float("inf")))
    ref = torch.where(mask.bool(), ref, torch.full_like(ref, float("nan")))
    adv = torch.tensor([1.0, -2.0, 5.0])[:, None].expand(3, 5).clone()  # per-token form
    adv[mask == 0] = float("nan")
    for agg in AGGS:
        logp.grad = None
        loss, met = loss_of(logp, old, adv, mask, **CLIP,
                                dual_clip_c=3.0, ref_logp=ref, kl_beta=0.5, agg=agg,
                                norm=global_norm([mask], agg), max_len=5, entropy=torch.ones(3, 5))
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in met.values()), agg
        assert (logp.grad[mask == 0] == 0).all(), agg
        assert (logp.grad[mask == 1] != 0).all(), agg
        assert approx(met["entropy"], 1.0)


def test_global_norm_counts():
    m1 = torch.tensor([[1, 1, 0], [0, 0, 0]])
    m2 = torch.tensor([[True, True, True]])
    assert global_norm([m1, m2], "token-mean") == 5.0
    assert global_norm([m1, m2], "seq-mean-token-mean") == 2.0
    assert global_norm([torch.zeros(2, 3)], "token-mean") == 1.0  # never 0: empty step -> loss 0
    assert approx(masked_mean(torch.tensor([[2.0, 4.0, 100.0]]), torch.tensor([[1, 1, 0]])), 3.0)


@pytest.mark.parametrize("agg", AGGS)
def test_micro_batch_split_invariance(agg):
    """Micro-batch losses, each divided by the global norm, sum to the full-batch loss and
    give the same gradient, however unevenly the batch (and its tokens) are split."""
    g = torch.Generator().manual_seed(1)
    B, T = 7, 9
    logp = torch.randn(B, T, generator=g).requires_grad_()
    old = logp.detach() + 0.4 * torch.randn(B, T, generator=g)
    ref = logp.detach() + 0.4 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    lens = torch.tensor([9, 1, 4, 0, 7, 2, 5])
    mask = torch.arange(T)[None] < lens[:, None]
    kw = dict(**CLIP, dual_clip_c=3.0, ref_logp=None, kl_beta=0.05, agg=agg, max_len=T)

    def part_loss(rows, norm):
        return loss_of(logp[rows], old[rows], adv[rows], mask[rows],
                           **{**kw, "ref_logp": ref[rows]}, norm=norm)[0]

    full = part_loss(slice(0, B), global_norm([mask], agg))
    (g_full,) = torch.autograd.grad(full, logp)
    splits = [slice(0, 2), slice(2, 3), slice(3, 7)]
    norm = global_norm([mask[s] for s in splits], agg)
    parts = sum(part_loss(s, norm) for s in splits)
    (g_parts,) = torch.autograd.grad(parts, logp)
    assert approx(parts, full, 1e-6) and approx(g_parts, g_full, 1e-6)
    # dividing each micro-batch by its *local* count would differ (the bug this guards)
    local = sum(part_loss(s, global_norm([mask[s]], agg)) for s in splits) / len(splits)
    assert not approx(local, full, 1e-4)


# -----------------------------------------------------------------------------
# learning direction


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_sgd_step_moves_logp_with_advantage(agg, sign):
    """One SGD step on raw logits: A > 0 raises the sampled tokens' logp, A < 0 lowers it;
    a masked position's logits do not move."""
    torch.manual_seed(0)
    logits = torch.nn.Parameter(torch.randn(2, 4, 6))  # (B, T, V)
    tokens = torch.randint(0, 6, (2, 4))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])

    def logp_of():
        return torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]

    before = logp_of().detach()
    loss, _ = loss_of(logp_of(), before, torch.full((2,), sign), mask, **CLIP, agg=agg,
                          norm=global_norm([mask], agg), max_len=4)
    opt = torch.optim.SGD([logits], lr=0.5)
    loss.backward()
    opt.step()
    delta = logp_of().detach() - before
    m = mask.bool()
    assert (sign * delta[m] > 0).all()
    assert (delta[~m] == 0).all()
