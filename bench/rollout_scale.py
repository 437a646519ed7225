"""Rollouts at scale: the paged engine vs worst-case KV reservation on a SkyRL-SQL-shaped workload.

The SkyRL-SQL recipe (configs/skyrl_sql_7b.yaml) holds 400k KV tokens per GPU for trajectories
capped at 29k tokens; reserving each row's cap runs 13 at a time, while real trajectories are a
few thousand tokens. This benchmark scales that workload down (every length as a fraction of
max_context, the budget at the recipe's budget / max_context ratio) and runs it twice on the same
engine, same random model, same seeds:

    paged       rows are admitted while their KV blocks fit (sampling.max_rows = 0)
    worst case  at most kv_budget_tokens // max_context rows at once (sampling.max_rows), i.e.
                each row reserves its cap, as the engine before the paged cache did. It still
                admits a new row as soon as one ends, so it is kinder than that engine's waves
                (every turn waiting for the slowest row of its wave): the speedup is a lower bound.

The workload: prompts with a long tail (schema prompts), G = 5 samples per prompt (they share the
prompt's blocks), 1-6 turns, per-turn lengths with a long tail up to max_new_tokens, observations
of varied length. The random model's turns are scripted by a logits hook that forces EOS at the
drawn length (and forbids it before); observations are drawn token ids. The work holds more KV
tokens than the budget, so the paged run evicts and recomputes rows when the pool runs out.

Printed last: kv_utilization (mean over decode steps of the pool's blocks in use / the pool),
concurrency_vs_worst_case (mean rows per decode step, paged / worst case) and
rollout_speedup_vs_worst_case (median over interleaved pairs of worst-case time / paged time).

    .venv/bin/python bench/rollout_scale.py [--pairs 3] [--prompts 48] [--threads 1]  # CPU, fp32
    python bench/rollout_scale.py --device cuda --shape qwen2.5-0.5b                # GPU, bf16

On CUDA it also prints tokens/s and the fraction of the HBM roofline (each decode step must read
every weight once plus the live rows' K/V; prefill time is included, so it is an underestimate),
and runs the paged engine with and without CUDA graphs (sampling.cuda_graphs).
"""
import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tiny  # noqa: E402
from config import SamplingConfig  # noqa: E402
from engine import Engine  # noqa: E402
from model import Transformer  # noqa: E402
from sampler import SHAPES, hbm_gbps  # noqa: E402  (bench/sampler.py: the script's folder is on sys.path)
from sampling import StopChecker, row_key  # noqa: E402
from scheduler import Sequence  # noqa: E402

RECIPE_BUDGET, RECIPE_CONTEXT, RECIPE_NEW = 400_000, 29_000, 3_000  # configs/skyrl_sql_7b.yaml, per GPU
G = 5


# -----------------------------------------------------------------------------
# the workload


@dataclass
class Plan:
    prompt: list[int]
    turn_lens: list[int]  # tokens each turn samples (the last one is EOS)
    observations: list[list[int]]  # ids appended after each turn but the last


def long_tail(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(median * math.exp(rng.gauss(0, sigma)))))


def make_workload(prompts: int, max_context: int, max_new: int, vocab: int, seed: int = 0) -> list[Plan]:
    """Lengths as SkyRL-SQL's scaled by max_context / 29000: prompts ~1.5k tokens (tail to ~10k),
    turns ~300 (tail to max_new), observations ~150 (tail to ~2k), 1-6 turns."""
    rng = random.Random(seed)
    s = max_context / RECIPE_CONTEXT
    plans = []
    for _ in range(prompts):
        prompt = [rng.randrange(vocab - 1) for _ in range(long_tail(rng, 1500 * s, 0.6, 8, round(10_000 * s)))]
        for _ in range(G):  # the G samples share the prompt and differ in everything after it
            turns = rng.choices(range(1, 7), weights=[15, 30, 25, 15, 10, 5])[0]
            lens = [long_tail(rng, 0.1 * max_new, 0.9, 2, max_new) for _ in range(turns)]
            obs = [[rng.randrange(vocab - 1) for _ in range(long_tail(rng, 150 * s, 1.0, 2, round(2000 * s)))]
                   for _ in range(turns - 1)]
            plans.append(Plan(prompt, lens, obs))
    return plans


def describe(plans: list[Plan], max_context: int) -> None:
    def pct(xs):
        xs = sorted(xs)
        return " ".join(f"p{q}={xs[min(len(xs) - 1, len(xs) * q // 100)]}" for q in (10, 50, 90, 99)) + f" max={xs[-1]}"
    total = [min(max_context, len(p.prompt) + sum(p.turn_lens) + sum(map(len, p.observations))) for p in plans]
    turns = [len(p.turn_lens) for p in plans]
    print(f"workload: {len(plans) // G} prompts x G={G} = {len(plans)} trajectories")
    print(f"  prompt tokens       {pct([len(p.prompt) for p in plans[::G]])}")
    print(f"  turns               " + " ".join(f"{k}:{turns.count(k)}" for k in range(1, 7)))
    print(f"  tokens per turn     {pct([n for p in plans for n in p.turn_lens])}")
    print(f"  observation tokens  {pct([len(o) for p in plans for o in p.observations])}")
    print(f"  trajectory tokens   {pct(total)}  (cap max_context={max_context}); all: {sum(total)}")


# -----------------------------------------------------------------------------
# one run


def run(model, plans: list[Plan], cfg: SamplingConfig, eos: int) -> tuple[float, dict, list[Sequence]]:
    """All episodes on one engine; the env is the plan (observations appended at once)."""
    def script(logits, seqs):  # EOS exactly at each turn's planned length
        n = [len(s.ids) - s.turn_start + 1 for s in seqs]  # the token about to be sampled is the n-th
        force = [i for i, s in enumerate(seqs) if n[i] >= plans[s.index].turn_lens[s.num_turns - 1]]
        logits[:, eos] = float("-inf")
        if force:
            rows = torch.tensor(force, device=logits.device)
            logits[rows] = float("-inf")
            logits[rows, eos] = 0.0
        return logits

    seqs = [Sequence(list(p.prompt), key=row_key(0, i), index=i) for i, p in enumerate(plans)]
    planned = [len(p.prompt) + sum(p.turn_lens) + sum(map(len, p.observations)) for p in plans]
    t0 = time.perf_counter()
    with Engine(model, cfg, StopChecker(None, [], [eos]), worst_case=[cfg.max_context] * len(seqs),
                dtype=model.embed_tokens.weight.dtype, logits_hook=script) as engine:
        engine.add(seqs)
        while engine.busy():
            ended = engine.step()
            for s in ended:
                plan, k = plans[s.index], s.num_turns
                if k == len(plan.turn_lens) or s.stop_reason == "max_context" \
                        or len(s.ids) + len(plan.observations[k - 1]) >= cfg.max_context:
                    engine.finish(s)
                    continue
                s.ids += plan.observations[k - 1]
                s.loss_mask += [0] * len(plan.observations[k - 1])
                s.logprobs += [0.0] * len(plan.observations[k - 1])
            engine.add([s for s in ended if s.status == "paused"])
        stats = dict(engine.stats, evictions=engine.evictions, pool_blocks=engine.blocks.num_blocks)
    if model.embed_tokens.weight.is_cuda:
        torch.cuda.synchronize()
    assert all(len(s.ids) == n for s, n in zip(seqs, planned) if n < cfg.max_context), "a trajectory left its plan"
    return time.perf_counter() - t0, stats, seqs


def summary(name: str, seconds: float, st: dict, seqs, model, gbps: float) -> str:
    steps = max(st["decode_steps"], 1)
    sampled = sum(sum(s.loss_mask) for s in seqs)
    line = (f"{name:22s} {seconds:7.2f}s  {sampled / seconds:8.0f} tok/s  rows/step {st['live_rows'] / steps:6.1f}  "
            f"kv pool in use {st['blocks_used'] / steps / st['pool_blocks']:.2f}  decode steps {st['decode_steps']}  "
            f"prefills {st['prefill_steps']}  evictions {st['evictions']}")
    if gbps:
        a, elem = model.config, model.embed_tokens.weight.element_size()
        weights = sum(p.numel() for p in model.parameters()) * elem
        kv_per_token = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * elem
        bytes_read = st["decode_steps"] * weights + st["tokens_live"] * kv_per_token
        line += f"  HBM roofline {bytes_read / seconds / (gbps * 1e9):.1%}"
    return line


# -----------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="bench6m", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=0, help="default 48 on CPU, 32 on CUDA")
    ap.add_argument("--max-context", type=int, default=0, help="default 1450 on CPU, 4096 on CUDA")
    ap.add_argument("--pairs", type=int, default=0, help="default 3 on CPU, 1 on CUDA")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    max_context = a.max_context or (4096 if cuda else 1450)
    max_new = round(max_context * RECIPE_NEW / RECIPE_CONTEXT)
    budget = round(max_context * RECIPE_BUDGET / RECIPE_CONTEXT)  # the recipe's budget / row cap ratio
    pairs = a.pairs or (1 if cuda else 3)
    shape = SHAPES[a.shape]
    d = tempfile.mkdtemp(prefix="bench_rollout_scale_")
    tiny.build_tiny_model(d, **shape)
    model = Transformer.from_pretrained(d, dtype=dtype, device=dev)
    eos = shape["vocab_size"] - 1
    plans = make_workload(a.prompts or (32 if cuda else 48), max_context, max_new, shape["vocab_size"])
    where = torch.cuda.get_device_name(dev) if cuda else f"cpu, threads {a.threads}"
    print(f"model {a.shape} {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {dtype}; {where}")
    describe(plans, max_context)
    worst_rows = budget // max_context
    print(f"kv_budget_tokens {budget} (recipe ratio {RECIPE_BUDGET}/{RECIPE_CONTEXT}), max_context {max_context}, "
          f"max_new_tokens {max_new}, block {a.block_size}; worst case runs {worst_rows} rows")
    base = dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new, max_context=max_context,
                kv_budget_tokens=budget, block_size=a.block_size)
    arms = {"worst case": SamplingConfig(**base, max_rows=worst_rows, cuda_graphs=cuda),
            "paged": SamplingConfig(**base, cuda_graphs=cuda)}
    if cuda:
        arms["paged, no CUDA graphs"] = SamplingConfig(**base)
    gbps = hbm_gbps(dev) if cuda else 0.0
    for cfg in arms.values():  # warm-up (CUDA graph captures, allocator)
        run(model, plans[:2 * G], cfg, eos)
    times, last = {k: [] for k in arms}, {}
    for _ in range(pairs):
        for name, cfg in arms.items():
            seconds, stats, seqs = run(model, plans, cfg, eos)
            times[name].append(seconds)
            last[name] = stats, seqs
            print(summary(name, seconds, stats, seqs, model, gbps))
    (paged_stats, paged_seqs), (worst_stats, worst_seqs) = last["paged"], last["worst case"]
    same = sum(p.ids == w.ids for p, w in zip(paged_seqs, worst_seqs))
    print(f"identical tokens paged vs worst case: {same}/{len(plans)} trajectories"
          + ("" if cuda else " (counter-based sampling: batching never changes a sample on CPU fp32)"))
    ratios = [w / p for w, p in zip(times["worst case"], times["paged"])]
    print(f"pairs (worst case / paged time): {', '.join(f'{r:.2f}' for r in ratios)}; load {open('/proc/loadavg').read().split()[:3]}")
    steps = lambda st: max(st["decode_steps"], 1)  # noqa: E731
    print(f"kv_utilization: {paged_stats['blocks_used'] / steps(paged_stats) / paged_stats['pool_blocks']:.2f}")
    print(f"concurrency_vs_worst_case: "
          f"{(paged_stats['live_rows'] / steps(paged_stats)) / (worst_stats['live_rows'] / steps(worst_stats)):.2f}")
    print(f"rollout_speedup_vs_worst_case: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
