"""Episodes: rollout then reward, and their summaries, shared by the GRPO step (train.py), the
held-out evals and the warm start's stop check (sft.py gets `evaluate` passed in).

    trajs, rewards, t_rollout, t_reward = run_episodes(model, tok, examples, cfg, n=G, seed=s, greedy=False)
    metrics = evaluate(model, tok, eval_examples, cfg, rank, world, device, log, step)   # eval/* keys

run_episodes samples on the trained model's PolicySampler (policy_sampler.py: an inference copy
refreshed from the current weights, LoRA merged, with one engine kept for the run) and scores
the episodes with reward.episode_rewards. summarise gives per-rank sums that reduce_summary
all-reduces into means.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref

import config as C
import eval as eval_lib
import reward
from distributed import PeakMemory, all_sum, compute_dtype
from policy_sampler import PolicySampler

def run_episodes(model, tok, exs, cfg: C.Config, *, n: int, seed: int, greedy: bool, sampling=None,
                 mem: PeakMemory | None = None):
    """Rollout on the model's PolicySampler (its inference copy refreshed from the current weights,
    LoRA merged) then rewards. Returns (trajs, reward dicts, t_rollout, t_reward).
    sampling: the SamplingConfig to decode with (default cfg.sampling); mem: records CUDA peaks."""
    phase = mem.phase if mem is not None else (lambda name: contextlib.nullcontext())
    t0 = time.time()
    sampler = _SAMPLERS.get(model)
    if sampler is None:  # once per trained model: the copy, its KV pool and buffers live for the run
        sampler = _SAMPLERS[model] = PolicySampler(model, cfg.sampling, dtype=compute_dtype(cfg))
    with phase("rollout"):
        sampler.refresh(model)  # one unit gathered at a time; the weights may have changed since the last call
        trajs = sampler.rollout(tok, exs, cfg.env, cfg.data, cfg.data.db_root, sampling_cfg=sampling or cfg.sampling,
                                n=n, seed=seed, greedy=greedy)
    t1 = time.time()
    rep = [ex for ex in exs for _ in range(n)]  # rollout returns the n samples of an example together
    with phase("reward"):
        rw = reward.episode_rewards([reward.episode(t, ex, cfg.data.db_root) for t, ex in zip(trajs, rep)],
                                    cfg.reward, cfg.env.protocol, reward.conversation_pieces(tok, cfg.env))
    return trajs, rw, t1 - t0, time.time() - t1


_SAMPLERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # trained model -> its PolicySampler


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


def evaluate(model, tok, eval_ex, cfg, rank, world, device, log, step: int, prefix="eval"):
    """Held-out episodes split over ranks (greedy at sampling.eval_temperature 0), their reduced
    metrics under `prefix/`, logged (log: train.Log) and printed on one line; returns the metrics."""
    mine = eval_ex[rank::world]
    T = cfg.sampling.eval_temperature  # greedy at 0, else sampled at T (as eval.py does)
    sampling = dataclasses.replace(cfg.sampling, temperature=T) if T > 0 else cfg.sampling
    trajs, rewards, rollout_s, _ = run_episodes(model, tok, mine, cfg, n=1, seed=cfg.train.seed + 10_000,
                                                greedy=T == 0, sampling=sampling)
    m = reduce_summary(summarise(trajs, rewards), device)
    m = {f"{prefix}/{k}": v for k, v in m.items()}
    # error recovery (eval.py generate's rule): episodes whose first query failed or returned no
    # rows, and of those the ones that still ended right; counts summed over ranks
    bad = [eval_lib.first_query_bad(t.steps) for t in trajs]
    n_bad, n_rec = all_sum([sum(bad), sum(b and bool(r["exec_match"]) for b, r in zip(bad, rewards))], device)
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
    """Print the first k episodes in full with their reward and the gold (log: train.Log)."""
    for t, r, ex in list(zip(trajs, rewards, exs))[:k]:
        log.print(f"--- sample (reward {r['reward']:+.2f}, exec {r['exec_match']}, stop {t.stop_reason}, "
                  f"turns {t.num_turns}, tool calls {t.num_tool_calls}) "
                  f"Q: {ex['question']}\n{t.text}\n--- gold: {ex['gold_sql']}")
