"""Episodes: rollout then reward, and their summaries, shared by the GRPO step (train.py), the
held-out evals, the warm start's stop check (sft.py) and eval.py generate.

    trajs = sampler.rollout(tok, examples, cfg.env, cfg.data, cfg.data.db_root, n=G, seed=s)  # train.py
    rws = rewards(trajs, examples, tok, cfg, n=G)                                            # one per episode
    trajs, rws, t_rollout, t_reward = run_episodes(sampler, tok, examples, cfg, n=1, seed=s, greedy=True)
    metrics = evaluate(sampler, tok, eval_examples, cfg, rank, world, device, log, step)     # eval/* keys

The sampler (policy_sampler.PolicySampler) holds the weights it samples: its owner refreshes it
after the weights change (train.py after an optimizer step, sft.py before an eval), never here.
summarise gives per-rank sums that reduce_summary all-reduces into means.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import config as C
import dataset
import env
import reward
import rollout
from distributed import PeakMemory, all_sum
from trainer.policy_sampler import PolicySampler


def episode(traj, example: dict, db_root, final_sql: str | None = None) -> dict:
    """The input reward.episode_rewards scores: one rollout.Trajectory of one dataset record.
    final_sql: the answer to execute, when the caller rewrote it (default traj.final_sql)."""
    return {"db_path": dataset.abs_db_path(example, db_root), "gold_sql": example["gold_sql"],
            "response": traj.text, "final_sql": traj.final_sql if final_sql is None else final_sql,
            "finished": traj.finished, "steps": traj.steps}


def rewards(trajs, examples, tok, cfg: C.Config, *, n: int = 1, final_sqls: list[str] | None = None) -> list[dict]:
    """reward.episode_rewards of each trajectory. examples: the rollout's, each repeated n times in
    trajs (example-major, as rollout returns them). final_sqls: the answers to execute when the caller
    rewrote them (eval.py scores its one-line predictions), default each trajectory's final_sql."""
    reps = [ex for ex in examples for _ in range(n)]
    answers = final_sqls or [None] * len(trajs)
    eps = [episode(t, ex, cfg.data.db_root, a) for t, ex, a in zip(trajs, reps, answers)]
    return reward.episode_rewards(eps, cfg.reward, cfg.env.protocol, rollout.conversation_pieces(tok, cfg.env))


def run_episodes(sampler: PolicySampler, tok, exs, cfg: C.Config, *, n: int, seed: int, greedy: bool,
                 sampling=None, mem: PeakMemory | None = None):
    """sampler.rollout then rewards, timed. Returns (trajs, reward dicts, t_rollout, t_reward).
    sampling: the SamplingConfig to decode with (default cfg.sampling); mem: records CUDA peaks."""
    phase = mem.phase if mem is not None else (lambda name: contextlib.nullcontext())
    t0 = time.time()
    with phase("rollout"):
        trajs = sampler.rollout(tok, exs, cfg.env, cfg.data, cfg.data.db_root, sampling_cfg=sampling or cfg.sampling,
                                n=n, seed=seed, greedy=greedy)
    t1 = time.time()
    with phase("reward"):
        rws = rewards(trajs, exs, tok, cfg, n=n)
    return trajs, rws, t1 - t0, time.time() - t1


def summarise(trajs, rewards) -> dict:
    """Per-rank sums (all-reduced by the caller): count, reward, EX, format errors, turns, tools."""
    return {"n": len(trajs), "reward": sum(r["reward"] for r in rewards),
            "ex": sum(float(r["exec_match"]) for r in rewards),
            "format_err": sum(float(not r["format_ok"]) for r in rewards), "turns": sum(t.num_turns for t in trajs),
            "tool_calls": sum(t.num_tool_calls for t in trajs),
            "resp_tokens": sum(int(sum(t.loss_mask)) for t in trajs)}


def reduce_summary(s: dict, device) -> dict:
    keys = list(s)
    tot = dict(zip(keys, all_sum([s[k] for k in keys], device)))
    n = max(tot.pop("n"), 1)
    return {k: v / n for k, v in tot.items()}


def evaluate(sampler: PolicySampler, tok, eval_ex, cfg, rank, world, device, log, step: int, prefix="eval"):
    """Held-out episodes split over ranks (greedy at sampling.eval_temperature 0) on the sampler's
    current weights, their reduced metrics under `prefix/`, logged (log: run_log.Log) and printed on
    one line; returns the metrics."""
    mine = eval_ex[rank::world]
    T = cfg.sampling.eval_temperature  # greedy at 0, else sampled at T (as eval.py does)
    sampling = dataclasses.replace(cfg.sampling, temperature=T) if T > 0 else cfg.sampling
    trajs, rws, rollout_s, _ = run_episodes(sampler, tok, mine, cfg, n=1, seed=cfg.train.seed + 10_000,
                                            greedy=T == 0, sampling=sampling)
    m = reduce_summary(summarise(trajs, rws), device)
    m = {f"{prefix}/{k}": v for k, v in m.items()}
    # error recovery (eval.py generate's rule): episodes whose first query failed or returned no
    # rows, and of those the ones that still ended right; counts summed over ranks
    bad = [env.first_query_bad(t.steps) for t in trajs]
    n_bad, n_rec = all_sum([sum(bad), sum(b and bool(r["exec_match"]) for b, r in zip(bad, rws))], device)
    m.update({f"{prefix}/first_query_bad": n_bad, f"{prefix}/recovered": n_rec})
    if n_bad:
        m[f"{prefix}/recovery_rate"] = n_rec / n_bad
    log.metrics(step, m)
    log.print(f"[{prefix} @ step {step}] EX {100 * m[prefix + '/ex']:.1f}%  reward {m[prefix + '/reward']:.3f}  "
              f"format-err {100 * m[prefix + '/format_err']:.1f}%  turns {m[prefix + '/turns']:.2f}  "
              f"tool-calls {m[prefix + '/tool_calls']:.2f}  first query empty/failed {n_bad:.0f}, "
              f"recovered {n_rec:.0f}  ({len(eval_ex)} examples, {rollout_s:.1f}s)")
    return m


def show_samples(log, trajs, rewards, exs, k=2):
    """Print the first k episodes in full with their reward and the gold (log: run_log.Log)."""
    for t, r, ex in list(zip(trajs, rewards, exs))[:k]:
        log.print(f"--- sample (reward {r['reward']:+.2f}, exec {r['exec_match']}, stop {t.stop_reason}, "
                  f"turns {t.num_turns}, tool calls {t.num_tool_calls}) "
                  f"Q: {ex['question']}\n{t.text}\n--- gold: {ex['gold_sql']}")
