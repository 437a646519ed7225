"""2 ranks through the credit and train.grpo_step (launched by tests/test_grpo_dist.py), for what
only a second rank shows:

    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 tests/grpo_step_dist_check.py

1. grpo.advantage "batch": each rank holds its own groups (other rewards, another count); the
   scale is the std over every rank's rewards (all-gathered), the baseline each episode's own
   group's mean. Every rank reports `ADV rank=R n=N a0 a1 ...`: its episodes' advantages in order
   (one per episode: every token of a one-turn episode has it), for the test to compare with a
   single-process computation of the whole batch.
2. grpo.mask_truncated with every kept episode of rank 1 truncated: rank 1 has nothing to train,
   rank 0 has. train.grpo_step (collect replaced by this rank's episodes, the update real: FSDP2,
   packed micro-batches, AdamW) must take both ranks through the update's collectives and to the
   end of the step. Every rank reports `STEP rank=R trained=T updated=0|1 grad_norm=G masked_frac=F
   refreshed=K`.
Results go through conftest.report (a file per rank). Collectives time out after 60 s
(setup_dist): a rank that skips the update fails its peer's next collective, not a hang.
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import config as C  # noqa: E402
import grpo  # noqa: E402
import rollout  # noqa: E402
import stream  # noqa: E402
import train  # noqa: E402
from conftest import report  # noqa: E402
from reward import Reward  # noqa: E402
from test_packing import make_model  # noqa: E402
from trainer import distributed, optim  # noqa: E402
from trainer.run_log import Phases  # noqa: E402

G = 4  # grpo.group_size of both parts
# per rank, its groups' rewards: rank 1 has fewer groups, and other spreads
REWARDS = {0: [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, -1.0], [0.5, 0.0, 0.0, 0.0]],
           1: [[1.0, 0.0, 1.0, 0.0], [-1.0, -1.0, 0.0, 1.0]]}


def episode(value: float, end_reason: str, n_tokens: int, group: int, first: int) -> rollout.Episode:
    """A one-turn episode: prompt [1, 2], then n_tokens sampled tokens first, first + 1, ..."""
    ids = [1, 2] + [first + k for k in range(n_tokens)]
    traj = rollout.Trajectory.of([1, 2], ids, [0, 0] + [1] * n_tokens, [0.0, 0.0] + [-1.0] * n_tokens, num_turns=1,
                                 end_reason=end_reason, turn_spans=[(2, len(ids))])
    return rollout.Episode(traj, Reward(value, value > 0, True), {}, group)


def batch_advantages(rank: int) -> None:
    g = C.load_config([f"--grpo.group_size={G}", "--grpo.advantage=batch"]).grpo
    eps = [episode(r, "answer", 2 + (i + j) % 3, i, 10 + j) for i, rewards in enumerate(REWARDS[rank])
           for j, r in enumerate(rewards)]
    adv = grpo.token_advantages(eps, g)
    assert all(torch.equal(a, a[:1].expand_as(a)) for a in adv)  # one value per episode
    report(f"ADV rank={rank} n={len(eps)} " + " ".join(repr(float(a[0])) for a in adv))


class CountingSampler:
    """Stands in for the PolicySampler: counts the weight syncs grpo_step asks for."""

    def __init__(self):
        self.refreshes = 0

    def refresh(self, model) -> None:
        self.refreshes += 1


class IdleStream:
    """Stands in for the RolloutStream: collect is replaced, so it decoded nothing; its step metrics
    (a collective every rank joins) are the real ones."""
    decode_steps = live_row_steps = 0
    share_episodes = 8
    step_metrics = stream.RolloutStream.step_metrics


class Printer:
    def print(self, line: str) -> None:
        print(line, flush=True)


def masked_step(rank: int, world: int, device: torch.device) -> None:
    cfg = C.load_config(["--grpo.group_size=2", "--grpo.mask_truncated=true", "--grpo.dynamic_sampling=false",
                         "--grpo.prompts_per_step=4", "--sampling.temperature=1.0", "--optim.lr=1e-3"])
    model = distributed.shard(make_model(), torch.float32)
    opt, sch = optim.make_optimizer(model, cfg.optim, cfg.optim.lr, 0, 10)
    # rank 0: two groups of answered episodes; rank 1: the same rewards, every episode cut short
    ends = ["answer"] * 4 if rank == 0 else ["context", "turn_cut", "turn_cut", "context"]
    kept = [episode(r, end, 3 + k, k // 2, 20 + 5 * k) for k, (r, end) in enumerate(zip([1.0, 0.0, 0.0, 1.0], ends))]
    train.collect = lambda run, rollouts, step, phase: (kept, kept)  # the episodes this rank sampled
    sampler = CountingSampler()
    run = train.Run(model, None, sampler, opt, sch, train.LossScaler(cfg.optim, torch.float32), None, cfg,
                    Printer(), rank, world, device)
    trained, _ = grpo.loss_episodes(kept, grpo.token_advantages(kept, cfg.grpo), cfg.grpo)
    _, _, metrics = train.grpo_step(run, IdleStream(), 0, Phases(distributed.PeakMemory(device)))
    report(f"STEP rank={rank} trained={len(trained)} updated={int('grad_norm' in metrics)} "
           f"grad_norm={metrics.get('grad_norm', float('nan'))!r} masked_frac={metrics['masked_frac']!r} "
           f"refreshed={sampler.refreshes}")


def main():
    rank, world, device = distributed.setup_dist(60)
    assert world == 2 and device.type == "cpu", "run with 2 CPU ranks (CUDA_VISIBLE_DEVICES=)"
    batch_advantages(rank)
    masked_step(rank, world, device)
    distributed.close()


if __name__ == "__main__":
    main()
