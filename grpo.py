"""GRPO's algorithm side: which groups a step keeps, the credit (each loss token's advantage), the
policy loss (one registered per-token function, and the parts every loss shares) with optional
rollout importance correction, and the loss's input record. Tensor functions on typed inputs; the
step that calls them is train.grpo_step (sample, reward, keep mask, credit, update, sync), whose
update loop (train.update) builds one LossInputs per micro-batch and calls policy_loss on it.

A group is the grpo.group_size episodes sampled from one prompt, laid out together (prompt p's at
p*G .. p*G+G-1): the advantage compares the episodes of a group, dynamic sampling keeps or drops a
group whole, and the stream starts a group's episodes together (the word means nothing else here).

Where to edit for an ablation:
  - the credit: one returns function registered in trainer/credits.py (`outcome_returns` is the
    default; `lookup_bonus_returns` and `turn_discount_returns` are per-turn credits), picked by
    grpo.credit; the group normalisation (`group_baseline`, with the floor below) and the
    broadcast to tokens (`token_advantages`) are shared by every credit;
  - the loss: one per-token function registered in trainer/losses.py with its default clip,
    picked by grpo.loss; `policy_loss` here does what every loss shares;
  - the rollout correction: one weights function registered in trainer/rollout_correction.py,
    picked by grpo.rollout_is; it reads each token's log π_old/π_rollout and its age (LossInputs.ages);
  - which groups train: `keep_mask`; which of their episodes enter the loss: `loss_episodes`.
The registries sit in trainer/ so that config.py can offer their names as the keys' values
(config.py cannot import this file: it imports config.py).

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

Three policies under streaming (stream.sampling_steps_ahead k >= 1; decoupled PPO, as AReaL's loss).
A trained token may have been sampled by weights up to k steps older than the trainer's (each token
records them: Trajectory.versions), and an episode can span several versions. Per token:
  - the behaviour policy π_b is what sampled it: LossInputs.sampler_logprobs, the sampler's own
    logprob recorded at sampling time (any version, plus the sampler/trainer float mismatch);
  - the proximal policy π_prox anchors the trust region: LossInputs.old_logprobs, the trainer's
    current weights before this batch's update (recomputed by a forward with several optimizer
    steps per batch, else logprobs.detach());
  - π_θ is being trained: LossInputs.logprobs.
The clip acts on r = π_θ/π_prox and the rollout correction's weight is π_prox/π_b
(rollout_correction.is_weights(old, sampler, ages)): token-tis caps it, token-mis masks it, so
`-(π_prox/π_b) · min(r·A, clip(r)·A)` is AReaL's decoupled loss with a capped behaviour weight. With
k = 0 the two differ only by the sampler's floats; with k >= 1 also by the steps between them, and
the mismatch metrics (`mismatch_*`) grow with the staleness: grpo.rollout_is != none is what
corrects for it (none trains as if π_b were π_prox). Each token's age (LossInputs.ages: the
trainer's step minus the version that sampled it, at most k) reaches the correction too: age-mask
drops the tokens older than grpo.rollout_is_max_age steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from trainer import packing
from trainer.credits import CREDITS
from trainer.distributed import all_gather_list, collective_device
from trainer.losses import LOG_RATIO_CLAMP, LOSSES, PgInputs, clip_range, masked_mean
from trainer.policy_update import BatchTokens
from trainer.rollout_correction import RolloutIS, is_weights, mismatch_metrics

if TYPE_CHECKING:
    from config import GRPOConfig
    from rollout import Episode, Trajectory

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "drgrpo")


# -----------------------------------------------------------------------------
# advantages


def group_baseline(returns: Tensor, group_size: int, mode: str = "group", eps: float = 1e-6,
                   floor: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The one group normalisation every credit shares: (baseline, scale), each (P*G,), for episode
    returns (P*G,) laid out group-major (prompt p's G samples at p*G .. p*G+G-1); an episode's
    advantage is (return - baseline) / scale.

    group: baseline mean_G, scale max(std_G, floor_G) + eps    GRPO / verl
    batch: baseline mean_G, scale max(std_batch, floor_G) + eps std of the raw returns over the whole
                                                           batch (TRL scale_rewards="batch", Lite PPO):
                                                           pass the *global* returns so every rank agrees
    none:  baseline mean_G, scale 1                        Dr. GRPO (reward units: no floor needed)
    floor: (P*G,) each episode's largest per-turn deviation (token_advantages), floor_G the largest
    in its group; None or 0 (the outcome credit, flat rewards): the scale is std + eps, bit for bit.
    std is torch.std's default, unbiased (n-1), as in verl. A group of one sample has no baseline:
    its advantage is 0 (verl instead uses mean 0, std 1, i.e. raw reward). A group with equal
    returns gets 0 in every mode (0 / (0 + eps)).
    """
    assert returns.dim() == 1 and returns.numel() % group_size == 0, (returns.shape, group_size)
    grouped = returns.float().view(-1, group_size)  # (P, G)
    baseline = grouped.mean(dim=1, keepdim=True).expand_as(grouped)
    if mode == "none":
        scale = torch.ones_like(grouped)
    elif mode in ("group", "batch"):
        if mode == "group":
            std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped[:, :1])  # (P, 1)
        else:
            std = grouped.std() if grouped.numel() > 1 else grouped.new_zeros(())  # ()
        if floor is not None:  # the per-turn credit's floor (token_advantages): never below its deviations
            std = torch.maximum(std, floor.float().view(-1, group_size).amax(dim=1, keepdim=True))
        scale = (std + eps).expand_as(grouped)
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
    grouped = rewards.view(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)


def keep_mask(batch: list[Episode], group_size: int, metric: str) -> list[bool]:
    """Per episode: is its group kept (dynamic sampling)? batch: rollout.Episode list, whole groups
    of group_size in a row. metric: what must differ within a group, each episode's reward
    (shaping included) or its exec_match (some right, some wrong: DAPO's accuracy filter)."""
    assert metric in ("reward", "exec_match"), metric
    scores = torch.tensor([float(e.reward.value if metric == "reward" else e.reward.exec_match) for e in batch])
    return keep_mask_dynamic(scores, group_size).repeat_interleave(group_size).tolist()


# -----------------------------------------------------------------------------
# credit: each loss token's advantage


def _whole_batch(wholes: list[float], floors: list[float], mode: str) -> tuple[Tensor, Tensor, int]:
    """(the whole returns the normalisation needs, their episodes' floors, where this rank's start
    in them): this rank's alone, except for the "batch" mode, whose std is the whole batch's:
    all-gathered (rank order)."""
    if mode != "batch" or not dist.is_initialized():
        return torch.tensor(wholes, dtype=torch.float32), torch.tensor(floors, dtype=torch.float32), 0
    every = all_gather_list([list(zip(wholes, floors))])  # one list of (whole, floor) per rank
    pairs = [pair for rank_pairs in every for pair in rank_pairs]
    start = sum(len(rank_pairs) for rank_pairs in every[:dist.get_rank()])
    return (torch.tensor([w for w, _ in pairs], dtype=torch.float32),
            torch.tensor([f for _, f in pairs], dtype=torch.float32), start)


def turn_returns(episode: Episode, grpo_cfg: GRPOConfig) -> list[float]:
    """The credit's returns of one episode, one per turn: the returns function grpo.credit names
    (trainer/credits.py). Turn 0's return is the episode's whole return: its group's statistics
    are taken over those."""
    return CREDITS[grpo_cfg.credit].returns(episode, grpo_cfg)


def token_advantages(batch: list[Episode], grpo_cfg: GRPOConfig) -> list[Tensor]:
    """The credit: each episode's advantage per loss token, (n_loss_tokens,) each, in the order
    Trajectory.token_turns lists them. batch: this rank's rollout.Episode list (whole groups).

    Three moves, shared by every credit: each episode's per-turn returns (turn_returns); one group
    normalisation (group_baseline over the episodes' whole returns, grpo.advantage's mode: "none"
    divides by nothing, "batch" takes the std over every rank's batch), applied to every turn's
    return, (return_k - baseline) / scale; each token takes its turn's value.

    The floor: a group's scale is never below D, the largest per-turn deviation |return_k - return_0|
    of its episodes: scale = max(std, D) + eps ("none" divides by nothing and needs none). Why: turn
    k's advantage is (return_0 - baseline)/scale + (return_k - return_0)/scale, the whole return's
    place in its group plus the turn's deviation (a bonus, a discount). The std measures only the
    first; where a group's whole returns are equal or nearly so (std ~ 0) the deviations alone were
    divided by ~eps: a per-turn discount with dynamic sampling off logged pg_loss of 1e3 to 2e5 in
    2 steps. With the floor the deviation term is within ±1 and the whole-return term within GRPO's
    own bound (G-1)/√G (Samuelson: |x - mean| ≤ (n-1)/√n times the unbiased std), so
    |A_k| ≤ (G-1)/√G + 1 ("batch": 2(N-1)/√N + 1 over N episodes); tests/test_credits.py checks it
    on random groups. Where the outcomes spread more than the deviations (std ≥ D) nothing changes:
    the outcome credit (D = 0) is bit for bit GRPO's, and the lookup bonus b = 0.2 is unchanged in
    every group whose rewards differ by a whole point (std ≥ 0.8/√6 = 0.32 at G = 6). The other
    ways out were worse: pooling every turn's returns into the statistics reweighs even the outcome
    credit by turn counts; dropping groups with no spread needs a threshold for "nearly" and still
    divides the deviations by a std just above it. The floor keeps every group and caps what a
    deviation weighs at one unit of advantage."""
    returns = [torch.tensor(turn_returns(e, grpo_cfg), dtype=torch.float32) for e in batch]  # (turns,) each
    wholes = [float(r[0]) for r in returns]
    floors = [float((r - r[0]).abs().max()) for r in returns]  # D_i: 0 for the outcome credit
    totals, floor, start = _whole_batch(wholes, floors, grpo_cfg.advantage)  # every rank's in "batch"
    baseline, scale = (group_baseline(totals, grpo_cfg.group_size, grpo_cfg.advantage, grpo_cfg.adv_eps, floor)
                       if len(totals) else (totals, totals))
    out = []
    for i, (episode, per_turn_returns) in enumerate(zip(batch, returns)):
        per_turn = (per_turn_returns - baseline[start + i]) / scale[start + i]  # (turns,)
        turn_of_token = torch.tensor(episode.trajectory.token_turns(), dtype=torch.long).clamp(max=len(per_turn) - 1)
        out.append(per_turn[turn_of_token])
    return out


def loss_episodes(batch: list[Episode], advantages: list[Tensor],
                  grpo_cfg: GRPOConfig) -> tuple[list[Trajectory], list[Tensor]]:
    """(trajectories, their per-token advantages) of the kept episodes that enter the loss: all of
    them, or with grpo.mask_truncated those that did not run out of room (Trajectory.truncated: a
    turn cut at sampling.max_new_tokens, or sampling.max_context reached). The advantages were
    computed over every kept episode, so a truncated episode's reward still sets its group's mean
    and std (TRL's mask_truncated_completions, DAPO's overlong filtering): the others are judged
    against the same baseline, and only the cut episode's own tokens, whose ending the policy never
    wrote, give no gradient. Leaving it out of the update's batch also leaves its tokens out of the
    loss normaliser (global_norm counts the trained masks). A rank left with none still runs the
    update (each_micro_batch pads it), so every rank joins its collectives."""
    pairs = [(e.trajectory, a) for e, a in zip(batch, advantages)
             if not (grpo_cfg.mask_truncated and e.trajectory.truncated)]
    return [t for t, _ in pairs], [a for _, a in pairs]


# -----------------------------------------------------------------------------
# the normaliser


def local_count(mask: Tensor, agg: str) -> int:
    """This mask's contribution to the normaliser: masked tokens for token-mean, else the
    number of sequences (rows) with at least one masked token (all-masked rows are padding)."""
    assert agg in AGGS, f"loss agg must be one of {AGGS}, got {agg!r}"
    tokens = mask.bool()
    return int(tokens.sum()) if agg == "token-mean" else int(tokens.any(dim=-1).sum())


def global_norm(mask_list: list[Tensor], agg: str, group: dist.ProcessGroup | None = None) -> float:
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

K3_MAX = 10.0  # cap the k3 KL term (as SkyRL and verl): one extreme token cannot make a step non-finite


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
    ages: Tensor | None = None  # long: each token's age, the trainer's step minus the version of the weights
    #                             that sampled it (Trajectory.token_ages; 0 at stream.sampling_steps_ahead 0),
    #                             what an age-aware rollout correction reads (trainer/rollout_correction.py)


def loss_inputs(logprobs: Tensor, entropy: Tensor, mb: packing.MicroBatch, idx: list[int],
                tokens: BatchTokens) -> LossInputs:
    """One micro-batch's LossInputs from its packed forward: logprobs and entropy (N,), the flat
    loss tokens of mb's sequences (mb.counts[k] of them for sequence idx[mb.members[k]] of the
    batch), and the batch's per-sequence values (tokens: old, reference and sampler logprobs,
    advantages, turns, ages), each laid out (members, longest)."""
    seqs, counts = [idx[j] for j in mb.members], mb.counts

    def rows(per_seq: dict[int, Tensor]) -> Tensor:
        return packing.pad_flat(torch.cat([per_seq[i] for i in seqs]), counts)
    padded_logprobs = packing.pad_flat(logprobs, counts)
    return LossInputs(logprobs=padded_logprobs,
                      old_logprobs=rows(tokens.old) if tokens.old is not None else padded_logprobs.detach(),
                      ref_logprobs=rows(tokens.ref) if tokens.ref is not None else None,
                      sampler_logprobs=rows(tokens.sampler),
                      mask=packing.pad_flat(torch.ones_like(logprobs.detach()), counts),
                      advantages=rows(tokens.advantages), turns=rows(tokens.turns),
                      entropy=packing.pad_flat(entropy, counts), ages=rows(tokens.ages))


def policy_loss(inputs: LossInputs, norm: float, grpo_cfg: GRPOConfig,
                max_len: int = 0) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss of one micro-batch, divided by the *global* `norm` (global_norm; see top).

    inputs: LossInputs, every field (B, T), one sequence per row (logp = inputs.logprobs, old =
    inputs.old_logprobs, A = inputs.advantages, per token). grpo_cfg: the grpo config group (loss,
    clip_low/clip_high, dual_clip_c, kl_beta, loss_agg, rollout_is*, drgrpo_max_len); max_len:
    sampling.max_context, Dr. GRPO's L when grpo.drgrpo_max_len is 0.
    Shared preparation: masked positions zeroed, log ρ_t = clamp(logp - old_logp, ±LOG_RATIO_CLAMP).
    The loss: pg_t from trainer/losses.LOSSES[grpo.loss] (formula in its function's docstring: grpo
    PPO-clip, gspo / gspo-token on the sequence ratio, cispo, ...), with ε_l, ε_h =
    clip_range(grpo.loss, grpo.clip_low, grpo.clip_high) (the loss's declared default where < 0).
    Shared parts, after it:
      dual-clip (losses declared dual_clip): if dual_clip_c > 0 and A < 0: pg = min(pg, -c·A) (verl)
      rollout correction: pg *= w_t, w from rollout_correction.is_weights(old, sampler_logprobs, ages)
        (the correction grpo.rollout_is names in CORRECTIONS) when the sampler's logprobs are given
        (mismatch metrics are then logged; the weights only if grpo.rollout_is != none)
      ℓ = pg + kl_beta · k3,  k3 = min(exp(ref - logp) - (ref - logp) - 1, K3_MAX), ref - logp clamped
    Aggregation (mask, agg = grpo.loss_agg, norm from global_norm(..., agg)):
        token-mean           Σ mask·ℓ / norm                          norm = global masked tokens
        seq-mean-token-mean  Σ_seq (Σ_t mask·ℓ / Σ_t mask) / norm      norm = global sequences
        seq-mean-token-sum   Σ_seq Σ_t mask·ℓ / norm                   norm = global sequences
        drgrpo               Σ mask·ℓ / (norm · max_len)               norm = global sequences
    GSPO's paper objective (per-sequence loss, mean over sequences) is gspo + seq-mean-token-mean.
    Metrics (detached 0-d tensors, masked means over this micro-batch's tokens): pg_loss
    (mean per-token pg), the loss's own (clip_frac: tokens where its clip was active), approx_kl
    (k3 estimate of KL(π_old‖π_θ)), ratio_max (of the ratio the loss used); when dual_clip_c > 0
    dual_clip_frac; when kl_beta > 0 kl (mean k3 to ref); entropy if given; the mismatch and is_*
    metrics with the sampler's logprobs.
    """
    assert grpo_cfg.loss in LOSSES, f"grpo.loss must be one of {list(LOSSES)}, got {grpo_cfg.loss!r}"
    spec, agg, dual_clip_c, kl_beta = LOSSES[grpo_cfg.loss], grpo_cfg.loss_agg, grpo_cfg.dual_clip_c, grpo_cfg.kl_beta
    max_len, rollout_is = grpo_cfg.drgrpo_max_len or max_len, RolloutIS.from_config(grpo_cfg)
    assert agg in AGGS, f"loss agg must be one of {AGGS}, got {agg!r}"
    assert dual_clip_c == 0.0 or dual_clip_c > 1.0, "dual-clip needs c > 1 (verl)"
    assert not dual_clip_c or spec.dual_clip, f"dual-clip bounds a PPO-clip loss; {spec.name} has none"
    assert inputs.logprobs.shape == inputs.old_logprobs.shape == inputs.mask.shape == inputs.advantages.shape, \
        (inputs.logprobs.shape, inputs.old_logprobs.shape, inputs.mask.shape, inputs.advantages.shape)
    mask = inputs.mask.bool()
    logp = inputs.logprobs.float()
    zero = torch.zeros_like(logp)

    # Masked positions (prompt, tool output, padding) may hold anything, even -inf/nan: zero
    # the inputs there *before* exp so no inf/nan can reach the gradient through 0 * inf.
    adv = torch.where(mask, inputs.advantages.float(), zero)
    log_ratio = torch.where(mask, logp - inputs.old_logprobs.float(), zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    term = spec.fn(PgInputs(log_ratio, torch.where(mask, logp, zero), adv, mask, inputs.turns),
                   clip_range(spec.name, grpo_cfg.clip_low, grpo_cfg.clip_high))
    pg, metrics = term.pg, dict(term.metrics)
    if dual_clip_c > 0:
        # For A < 0 a huge ρ makes -ρA unbounded; cap the loss at -c·A (its gradient is then 0).
        pg_cap = -adv * dual_clip_c
        metrics["dual_clip_frac"] = masked_mean(((pg > pg_cap) & (adv < 0)).float(), mask)
        pg = torch.where(adv < 0, torch.minimum(pg, pg_cap), pg)
    if inputs.sampler_logprobs is not None:
        metrics.update(mismatch_metrics(inputs.old_logprobs, inputs.sampler_logprobs, mask))
        if rollout_is.kind != "none":
            weights, is_metrics = is_weights(inputs.old_logprobs, inputs.sampler_logprobs, mask, rollout_is,
                                             inputs.ages)
            pg = pg * weights
            metrics.update(is_metrics)
    token_loss = pg
    metrics["pg_loss"] = masked_mean(pg, mask)

    if kl_beta > 0:
        assert inputs.ref_logprobs is not None, "kl_beta > 0 needs ref_logprobs"
        d = torch.where(mask, inputs.ref_logprobs.float() - logp, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = (torch.exp(d) - d - 1.0).clamp(max=K3_MAX)  # ≥ 0, unbiased for KL(π_θ‖π_ref), low variance
        token_loss = token_loss + kl_beta * k3
        metrics["kl"] = masked_mean(k3, mask)

    mask_f = mask.to(token_loss.dtype)
    tok = token_loss * mask_f  # finite everywhere (masked inputs were zeroed), so masked grads are 0
    if agg == "token-mean":
        out = tok.sum() / norm
    elif agg == "seq-mean-token-mean":
        out = (tok.sum(-1) / mask_f.sum(-1).clamp(min=1)).sum() / norm  # empty rows add 0
    elif agg == "seq-mean-token-sum":
        out = tok.sum() / norm
    else:  # drgrpo: a constant normaliser, no length bias (Dr. GRPO)
        assert max_len and max_len > 0, "drgrpo needs max_len (config: grpo.drgrpo_max_len)"
        out = tok.sum() / (norm * max_len)

    with torch.no_grad():
        ratio_token = torch.exp(log_ratio)
        metrics["approx_kl"] = masked_mean(ratio_token - 1.0 - log_ratio, mask)
        metrics["ratio_max"] = torch.where(mask, term.ratio, zero).max()
        if inputs.entropy is not None:
            metrics["entropy"] = masked_mean(inputs.entropy.float(), mask)
    return out, {k: v.detach() for k, v in metrics.items()}
