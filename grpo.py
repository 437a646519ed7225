"""GRPO's algorithm side: which groups a step keeps, the credit (each loss token's advantage), the
policy loss family (PPO-clip GRPO, GSPO, GSPO-token, CISPO) with optional rollout importance
correction, and the loss's input record. Tensor functions on typed inputs; the step that calls
them is train.grpo_step (sample, reward, keep mask, credit, update, sync), whose update loop
(train.update) builds one LossInputs per micro-batch and calls policy_loss on it.

Where to edit for an ablation:
  - the credit: a per-turn returns function (`outcome_returns` is the default, `lookup_bonus_returns`
    the worked example, grpo.lookup_bonus) picked in `turn_returns` by one grpo.* key; the group
    normalisation (`group_baseline`) and the broadcast to tokens are shared by every credit;
  - the loss: `policy_loss` (one LossInputs of (B, T) tensors and the grpo config group in, a scalar
    and metrics out);
  - which groups train: `keep_mask`; which of their episodes enter the loss: `loss_episodes`.

Normalisation contract. `policy_loss` returns Σ_{its tokens or sequences} ℓ / norm where `norm`
is the *global* normaliser of this optimizer step (masked tokens for token-mean, sequences
with ≥ 1 masked token otherwise, summed over every micro-batch of every rank). So the sum of
the returned losses over all micro-batches and all ranks is exactly the single-process loss of
the whole global batch, whatever the split. Each rank's backward therefore yields the gradient
of its own share; FSDP2's reduce-scatter *averages* over ranks (divides by world_size), so the
trainer multiplies the loss by world_size before backward (or, equivalently, turns FSDP's
division off). Run `python -m pytest tests/test_grpo.py tests/test_grpo_dist.py` to check it.
Padding a rank with an all-masked micro-batch is safe: its loss is 0 and it adds 0 to `norm`.
The contract holds for every loss variant and rollout correction: GSPO's sequence ratio and the
sequence-level corrections reduce over a row (one sequence per row), and a dropped token keeps
its place in `norm` (its loss is multiplied by 0). tests/test_grpo_losses.py checks each.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from trainer import packing
from trainer.distributed import all_gather_list, collective_device
from trainer.policy_update import BatchTokens
from trainer.rollout_correction import RolloutIS, is_weights, mismatch_metrics, seq_mean

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "drgrpo")


# -----------------------------------------------------------------------------
# advantages


def group_baseline(returns: Tensor, group_size: int, mode: str = "group", eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """The one group normalisation every credit shares: (baseline, scale), each (P*G,), for episode
    returns (P*G,) laid out group-major (prompt p's G samples at p*G .. p*G+G-1); an episode's
    advantage is (return - baseline) / scale.

    group: baseline mean_G, scale std_G + eps           GRPO / verl
    batch: baseline mean_G, scale std_batch + eps       std of the raw returns over the whole batch
                                                        (TRL scale_rewards="batch", Lite PPO): pass the
                                                        *global* returns so every rank agrees
    none:  baseline mean_G, scale 1                     Dr. GRPO
    std is torch.std's default, unbiased (n-1), as in verl. A group of one sample has no baseline:
    its advantage is 0 (verl instead uses mean 0, std 1, i.e. raw reward). A group with equal
    returns gets 0 in every mode (0 / (0 + eps)).
    """
    assert returns.dim() == 1 and returns.numel() % group_size == 0, (returns.shape, group_size)
    r = returns.float().view(-1, group_size)  # (P, G)
    baseline = r.mean(dim=1, keepdim=True).expand_as(r)
    if mode == "none":
        scale = torch.ones_like(r)
    elif mode == "group":
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
        scale = (std + eps).expand_as(r)
    elif mode == "batch":
        std = r.std() if r.numel() > 1 else r.new_zeros(())
        scale = (std + eps).expand_as(r)
    else:
        raise ValueError(f"advantage mode must be group, batch or none, got {mode!r}")
    return baseline.reshape(-1), scale.reshape(-1)


def advantages(rewards: Tensor, group_size: int, mode: str = "group", eps: float = 1e-6) -> Tensor:
    """Per-sample advantages (P*G,) of rewards (P*G,) laid out group-major: (r - baseline) / scale
    (group_baseline). An empty batch (every group filtered out) gives an empty tensor."""
    if rewards.numel() == 0:  # nothing to normalise (and no std warning)
        return rewards.float()
    baseline, scale = group_baseline(rewards, group_size, mode, eps)
    return (rewards.float() - baseline) / scale


def keep_mask_dynamic(rewards: Tensor, group_size: int) -> Tensor:
    """(P,) bool: True for groups whose rewards are not all equal (DAPO dynamic sampling).
    An all-equal group has zero advantage in every mode, so it only dilutes the batch.
    rewards: (P * group_size,) the rewards, or any per-episode score to filter on (exec_match)."""
    r = rewards.view(-1, group_size)
    return (r != r[:, :1]).any(dim=1)


def keep_mask(batch, group_size: int, metric: str) -> list[bool]:
    """Per episode: is its group kept (dynamic sampling)? batch: rollout.Episode list, whole groups
    of group_size in a row. metric: what must differ within a group, each episode's reward
    (shaping included) or its exec_match (some right, some wrong: DAPO's accuracy filter)."""
    assert metric in ("reward", "exec_match"), metric
    scores = torch.tensor([float(e.reward.value if metric == "reward" else e.reward.exec_match) for e in batch])
    return keep_mask_dynamic(scores, group_size).repeat_interleave(group_size).tolist()


# -----------------------------------------------------------------------------
# credit: each loss token's advantage


def _whole_batch(values: list[float], mode: str) -> tuple[Tensor, int]:
    """(the values the normalisation needs, where this rank's start in them): this rank's alone,
    except for the "batch" mode, whose std is the whole batch's: all-gathered (rank order)."""
    if mode != "batch" or not dist.is_initialized():
        return torch.tensor(values, dtype=torch.float32), 0
    every = all_gather_list([values])  # one list per rank
    return torch.tensor([x for r in every for x in r], dtype=torch.float32), sum(len(r) for r in every[:dist.get_rank()])


def outcome_returns(episode) -> list[float]:
    """The default credit: the outcome reward R on every turn (so every token gets the episode's
    advantage)."""
    return [episode.reward.value] * max(episode.trajectory.num_turns, 1)


def gold_literals(example: dict) -> list[str]:
    """The quoted string literals of the gold SQL that the question does not spell out (case
    aside): values the answer needs and only a lookup can show (the toy: the stored code 'Paris4k'
    of the question's 'Paris')."""
    found = [m.replace("''", "'") for m in re.findall(r"'((?:[^']|'')*)'", example["gold_sql"])]
    question = example.get("question", "").lower()
    return [x for x in dict.fromkeys(found) if x and x.lower() not in question]


def turn_rewards(episode, bonus: float) -> list[float]:
    """Per-turn rewards of one episode (grpo.lookup_bonus): `bonus` on the first tool turn whose
    observation shows a value the gold answer needs (gold_literals), 0 on every other turn (a
    later lookup that shows it again earns nothing: no farming). Tool turns are `sql` steps (tags
    protocol) and `query` steps (actions protocol)."""
    out = [0.0] * episode.trajectory.num_turns
    needed = gold_literals(episode.example)
    for k, step in enumerate(episode.trajectory.steps[:len(out)]):
        if step["kind"] in ("sql", "query") and any(x in step.get("observation", "") for x in needed):
            out[k] = bonus
            break
    return out


def lookup_bonus_returns(episode, bonus: float) -> list[float]:
    """The worked per-turn credit (grpo.lookup_bonus > 0): turn k's return is the outcome R plus the
    per-turn rewards from turn k on, R + Σ_{j≥k} b_j (reward-to-go, γ = 1; b: turn_rewards). The turn
    that first showed the value, and those before it, gain the bonus; the turns after it (the
    answer) are judged on the outcome alone."""
    bonuses = turn_rewards(episode, bonus) or [0.0]
    return [episode.reward.value + sum(bonuses[k:]) for k in range(len(bonuses))]


def turn_returns(episode, g) -> list[float]:
    """The credit's returns of one episode, one per turn (a new per-turn credit is one function like
    the two below and a grpo.* key that picks it here). Turn 0's return is the episode's whole
    return: its group's statistics are taken over those."""
    if g.lookup_bonus > 0:
        return lookup_bonus_returns(episode, g.lookup_bonus)
    return outcome_returns(episode)


def token_advantages(batch, g) -> list[Tensor]:
    """The credit: each episode's advantage per loss token, (n_loss_tokens,) each, in the order
    Trajectory.token_turns lists them. batch: this rank's rollout.Episode list (whole groups).

    Three moves, shared by every credit: each episode's per-turn returns (turn_returns); one group
    normalisation (group_baseline over the episodes' whole returns, grpo.advantage's mode: "none"
    divides by nothing, "batch" takes the std over every rank's batch), applied to every turn's
    return, (return_k - baseline) / scale; each token takes its turn's value."""
    returns = [torch.tensor(turn_returns(e, g), dtype=torch.float32) for e in batch]  # (turns,) each
    totals, start = _whole_batch([float(r[0]) for r in returns], g.advantage)  # every rank's in "batch"
    baseline, scale = group_baseline(totals, g.group_size, g.advantage, g.adv_eps) if len(totals) \
        else (totals, totals)
    out = []
    for i, (e, r) in enumerate(zip(batch, returns)):
        per_turn = (r - baseline[start + i]) / scale[start + i]  # (turns,)
        turn_of_token = torch.tensor(e.trajectory.token_turns(), dtype=torch.long).clamp(max=len(per_turn) - 1)
        out.append(per_turn[turn_of_token])
    return out


def loss_episodes(batch, advantages: list[Tensor], g) -> tuple[list, list[Tensor]]:
    """(trajectories, their per-token advantages) of the kept episodes that enter the loss: all of
    them, or with grpo.mask_truncated those that did not run out of room (Trajectory.truncated: a
    turn cut at sampling.max_new_tokens, or sampling.max_context reached). The advantages were
    computed over every kept episode, so a truncated episode's reward still sets its group's mean
    and std (TRL's mask_truncated_completions, DAPO's overlong filtering): the others are judged
    against the same baseline, and only the cut episode's own tokens, whose ending the policy never
    wrote, give no gradient. Leaving it out of the update's batch also leaves its tokens out of the
    loss normaliser (global_norm counts the trained masks). A rank left with none still runs the
    update (each_micro_batch pads it), so every rank joins its collectives."""
    pairs = [(e.trajectory, a) for e, a in zip(batch, advantages) if not (g.mask_truncated and e.trajectory.truncated)]
    return [t for t, _ in pairs], [a for _, a in pairs]


# -----------------------------------------------------------------------------
# normalisers and masked reductions


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    # where, not x*mask: a masked position holding inf/nan must not leak into the sum
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask (0 when the mask is empty)."""
    return masked_sum(x, mask) / mask.bool().sum().clamp(min=1)


def local_count(mask: Tensor, agg: str) -> int:
    """This mask's contribution to the normaliser: masked tokens for token-mean, else the
    number of sequences (rows) with at least one masked token (all-masked rows are padding)."""
    assert agg in AGGS, f"loss agg must be one of {AGGS}, got {agg!r}"
    m = mask.bool()
    return int(m.sum()) if agg == "token-mean" else int(m.any(dim=-1).sum())


def global_norm(mask_list: list[Tensor], agg: str, group=None) -> float:
    """The global normaliser for `policy_loss(norm=...)`: local_count summed over this rank's
    micro-batch masks, then all-reduced (SUM) over the process group if one is initialised.
    Every rank must call it (it is a collective). Never below 1, so an empty step gives loss 0."""
    n = sum(local_count(m, agg) for m in mask_list)
    if dist.is_available() and dist.is_initialized():
        dev = collective_device(group)  # NCCL reduces only GPU tensors, gloo only CPU ones
        t = torch.tensor([n], dtype=torch.int64, device=dev)  # int64: exact counts
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        n = int(t.item())
    return float(max(n, 1))


# -----------------------------------------------------------------------------
# the policy loss

LOSSES = ("grpo", "gspo", "gspo-token", "cispo")
# (ε_low, ε_high) when the config leaves clip_low/clip_high negative: PPO/GRPO's 0.2; GSPO's
# sequence ratio is a length-normalised geometric mean, so it clips at a far smaller ε
# (3e-4 / 4e-4, the GSPO paper); CISPO imposes no lower bound on its weight and tunes ε_high
# (MiniMax-M1).
DEFAULT_CLIP = {"grpo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "gspo-token": (3e-4, 4e-4), "cispo": (1.0, 0.28)}
LOG_RATIO_CLAMP = 20.0  # as SkyRL and verl: clamp log ρ before exp, so exp stays finite in fp32
K3_MAX = 10.0  # and cap the k3 KL term: one extreme token cannot make a step non-finite


def clip_range(loss: str, clip_low: float, clip_high: float) -> tuple[float, float]:
    """(ε_low, ε_high): the given values, or the loss's default (DEFAULT_CLIP) where negative."""
    assert loss in LOSSES, f"grpo.loss must be one of {LOSSES}, got {loss!r}"
    lo, hi = DEFAULT_CLIP[loss]
    return (lo if clip_low < 0 else clip_low), (hi if clip_high < 0 else clip_high)


@dataclass
class LossInputs:
    """The policy loss's inputs for one micro-batch, each (B, T): row b holds one sequence's loss
    tokens (the tokens it sampled), in order, zero-padded at the end (mask 0 there)."""
    logprobs: Tensor  # log π_θ(y_t) of the policy being trained (the gradient flows through it)
    old_logprobs: Tensor  # log π_old(y_t), the policy before this update (one optimizer step per
    #                       batch: logprobs.detach(), so every ratio is 1)
    ref_logprobs: Tensor | None  # the frozen KL reference's (None: no KL term, grpo.kl_beta 0)
    sampler_logprobs: Tensor | None  # the sampler's own log π_rollout(y_t) (mismatch, grpo.rollout_is)
    mask: Tensor  # 1.0 on loss tokens, 0.0 on padding
    advantages: Tensor  # each token's advantage (token_advantages: the credit)
    turns: Tensor  # long: each token's turn in its episode (0 = the first)
    entropy: Tensor | None  # the policy's entropy at each token (a metric)


def loss_inputs(logprobs: Tensor, entropy: Tensor, mb: packing.MicroBatch, idx: list[int],
                tokens: BatchTokens) -> LossInputs:
    """One micro-batch's LossInputs from its packed forward: logprobs and entropy (N,), the flat
    loss tokens of mb's sequences (mb.counts[k] of them for sequence idx[mb.members[k]] of the
    batch), and the batch's per-sequence values (tokens: old, reference and sampler logprobs,
    advantages, turns), each laid out (members, longest)."""
    seqs, counts = [idx[j] for j in mb.members], mb.counts

    def rows(per_seq: dict) -> Tensor:
        return packing.pad_flat(torch.cat([per_seq[i] for i in seqs]), counts)
    lp = packing.pad_flat(logprobs, counts)
    return LossInputs(logprobs=lp, old_logprobs=rows(tokens.old) if tokens.old is not None else lp.detach(),
                      ref_logprobs=rows(tokens.ref) if tokens.ref is not None else None,
                      sampler_logprobs=rows(tokens.sampler),
                      mask=packing.pad_flat(torch.ones_like(logprobs.detach()), counts),
                      advantages=rows(tokens.advantages), turns=rows(tokens.turns),
                      entropy=packing.pad_flat(entropy, counts))


def policy_loss(x: LossInputs, norm: float, g, max_len: int = 0) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss of one micro-batch, divided by the *global* `norm` (global_norm; see top).

    x: LossInputs, every field (B, T), one sequence per row (logp = x.logprobs, old = x.old_logprobs,
    A = x.advantages, per token; x.turns for a turn-aware loss). g: the grpo config group (loss,
    clip_low/clip_high, dual_clip_c, kl_beta, loss_agg, rollout_is*, drgrpo_max_len); max_len:
    sampling.max_context, Dr. GRPO's L when grpo.drgrpo_max_len is 0.
    ε_l, ε_h = clip_range(g.loss, g.clip_low, g.clip_high).
    log ρ_t = clamp(logp - old_logp, ±20); per token t of sequence i:
      grpo        ρ = exp(log ρ_t)                         PPO-clip: pg = -min(ρA, clip(ρ, 1-ε_l, 1+ε_h)A)
      gspo        ρ = s_i = exp(mean_t log ρ_it)           the same clip on the sequence ratio (GSPO)
      gspo-token  ρ = sg(s_i) · π_θ(y_t) / sg(π_θ(y_t))    value s_i, gradient per token (GSPO-token)
      cispo       pg = -sg(clip(ρ_t, 1-ε_l, 1+ε_h)) · A · logp    (CISPO: no token's gradient zeroed)
    dual-clip (not cispo): if dual_clip_c > 0 and A < 0: pg = min(pg, -c·A)    (verl)
    rollout correction: pg *= w_t, w from rollout_correction.is_weights(old, x.sampler_logprobs) when
        the sampler's logprobs are given (mismatch metrics are then logged; the weights only if
        grpo.rollout_is != none)
    ℓ = pg + kl_beta · k3,  k3 = min(exp(ref - logp) - (ref - logp) - 1, 10), ref - logp clamped ±20
    Aggregation (m = mask, agg = g.loss_agg, norm from global_norm(..., agg)):
        token-mean           Σ m·ℓ / norm                       norm = global masked tokens
        seq-mean-token-mean  Σ_seq (Σ_t m·ℓ / Σ_t m) / norm      norm = global sequences
        seq-mean-token-sum   Σ_seq Σ_t m·ℓ / norm                norm = global sequences
        drgrpo               Σ m·ℓ / (norm · max_len)            norm = global sequences
    GSPO's paper objective (per-sequence loss, mean over sequences) is gspo + seq-mean-token-mean.
    Metrics (detached 0-d tensors, masked means over this micro-batch's tokens): pg_loss
    (mean per-token pg), clip_frac (tokens where the clip was active: the clipped branch of the
    min, or for cispo the weight clipped), approx_kl (k3 estimate of KL(π_old‖π_θ)), ratio_max
    (of the ratio the loss used); when dual_clip_c > 0 dual_clip_frac; when kl_beta > 0 kl
    (mean k3 to ref); entropy if given; the mismatch and is_* metrics with the sampler's logprobs.
    """
    logp, old_logp, adv, mask = x.logprobs, x.old_logprobs, x.advantages, x.mask
    ref_logp, rollout_logp, entropy = x.ref_logprobs, x.sampler_logprobs, x.entropy
    loss, agg, dual_clip_c, kl_beta = g.loss, g.loss_agg, g.dual_clip_c, g.kl_beta
    max_len, rollout_is = g.drgrpo_max_len or max_len, RolloutIS.from_config(g)
    assert agg in AGGS, f"loss agg must be one of {AGGS}, got {agg!r}"
    eps_low, eps_high = clip_range(loss, g.clip_low, g.clip_high)
    assert dual_clip_c == 0.0 or dual_clip_c > 1.0, "dual-clip needs c > 1 (verl)"
    assert not (dual_clip_c and loss == "cispo"), "dual-clip bounds a PPO-clip loss; cispo has none"
    assert logp.shape == old_logp.shape == mask.shape, (logp.shape, old_logp.shape, mask.shape)
    m = mask.bool()
    logp = logp.float()
    zero = torch.zeros_like(logp)
    assert adv.shape == logp.shape, (adv.shape, logp.shape)
    A = adv.float()

    # Masked positions (prompt, tool output, padding) may hold anything, even -inf/nan: zero
    # the inputs there *before* exp so no inf/nan can reach the gradient through 0 * inf.
    A = torch.where(m, A, zero)
    log_ratio = torch.where(m, logp - old_logp.float(), zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    metrics = {}
    if loss == "cispo":
        ratio = torch.exp(log_ratio)
        weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high).detach()
        pg = -weight * A * torch.where(m, logp, zero)
        metrics["clip_frac"] = masked_mean((weight != ratio).float(), m)
    else:
        if loss == "grpo":
            ratio = torch.exp(log_ratio)
        else:
            seq_log_ratio = seq_mean(log_ratio, m)[:, None]  # (B, 1): log s_i
            if loss == "gspo-token":  # masked logp zeroed first: -inf - (-inf) would be nan
                logp_m = torch.where(m, logp, zero)
                seq_log_ratio = seq_log_ratio.detach() + logp_m - logp_m.detach()
            ratio = torch.exp(seq_log_ratio).expand_as(logp)
        pg1 = -A * ratio
        pg2 = -A * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        pg = torch.maximum(pg1, pg2)  # = -min(ρA, clip(ρ)A)
        metrics["clip_frac"] = masked_mean((pg2 > pg1).float(), m)
        if dual_clip_c > 0:
            # For A < 0 a huge ρ makes -ρA unbounded; cap the loss at -c·A (its gradient is then 0).
            pg3 = -A * dual_clip_c
            metrics["dual_clip_frac"] = masked_mean(((pg > pg3) & (A < 0)).float(), m)
            pg = torch.where(A < 0, torch.minimum(pg, pg3), pg)
    if rollout_logp is not None:
        metrics.update(mismatch_metrics(old_logp, rollout_logp, m))
        if rollout_is.kind != "none":
            w, is_metrics = is_weights(old_logp, rollout_logp, m, rollout_is)
            pg = pg * w
            metrics.update(is_metrics)
    token_loss = pg
    metrics["pg_loss"] = masked_mean(pg, m)

    if kl_beta > 0:
        assert ref_logp is not None, "kl_beta > 0 needs ref_logp"
        d = torch.where(m, ref_logp.float() - logp, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = (torch.exp(d) - d - 1.0).clamp(max=K3_MAX)  # ≥ 0, unbiased for KL(π_θ‖π_ref), low variance
        token_loss = token_loss + kl_beta * k3
        metrics["kl"] = masked_mean(k3, m)

    mf = m.to(token_loss.dtype)
    tok = token_loss * mf  # finite everywhere (masked inputs were zeroed), so masked grads are 0
    if agg == "token-mean":
        out = tok.sum() / norm
    elif agg == "seq-mean-token-mean":
        out = (tok.sum(-1) / mf.sum(-1).clamp(min=1)).sum() / norm  # empty rows add 0
    elif agg == "seq-mean-token-sum":
        out = tok.sum() / norm
    else:  # drgrpo: a constant normaliser, no length bias (Dr. GRPO)
        assert max_len and max_len > 0, "drgrpo needs max_len (config: grpo.drgrpo_max_len)"
        out = tok.sum() / (norm * max_len)

    with torch.no_grad():
        r_tok = torch.exp(log_ratio)
        metrics["approx_kl"] = masked_mean(r_tok - 1.0 - log_ratio, m)
        metrics["ratio_max"] = torch.where(m, ratio, zero).max()
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.float(), m)
    return out, {k: v.detach() for k, v in metrics.items()}
