"""Multi-turn overhead of the sampler: 5 turns of 25 tokens with 40-token observations vs one
turn of 125 tokens, same batch, same random model as bench/sampler.py.

Runs the sampler's engine (engine/engine.py, the code path rollout() uses: a turn ends, the row keeps its
KV blocks, its observation is prefilled beside the others' decode) with a stub environment that
hands back 40 fixed token ids after each of the first 4 turns, so the ratio measures the sampler,
not SQLite.
Median over pairs of (multi-turn time / single-turn time), torch threads 2. Also printed: the
ratio of matmul FLOPs (the 160 observation tokens per row go through the model too, so the
compute alone is ~2x here; the ratio can only stay low where decode is overhead-bound).
Also printed, as a diagnostic of the engine itself: the multi-turn time over one turn of 125
tokens whose prompt already holds the 160 observation tokens (the same tokens through the same
model, but every decode step attends over the longer context). Near or below 1 means turns
(pausing, observation prefills) cost nothing beyond their tokens. And a floor: the
single-turn time plus only the forwards that feed the observations into the cache, timed in the
same pairs; no multi-turn sampler built on this model's forward can beat it by more than the
(turns - 1) decode steps the engine folds into those forwards (~3% of the single-turn time).

    .venv/bin/python bench/multiturn.py [--batches 16,64] [--pairs 3]   # headline: last batch
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy import tiny  # noqa: E402
from config import SamplingConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from model import Transformer  # noqa: E402
from engine.paged_attention import PagedBatch, PagedKVCache  # noqa: E402
from sampler import SHAPES  # noqa: E402  (bench/sampler.py: the script's folder is on sys.path)
from engine.sampling import StopChecker, row_key  # noqa: E402
from engine.scheduler import Sequence  # noqa: E402

SHAPE = SHAPES["bench6m"]


def run(model, prompts, turns, per_turn, obs):
    n = len(prompts[0]) + turns * per_turn + (turns - 1) * len(obs)
    cfg = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=per_turn, max_context=4096)
    seqs = [Sequence(list(p), key=row_key(0, i), index=i) for i, p in enumerate(prompts)]
    with Engine(model, cfg, StopChecker(None, [], []), worst_case=[n] * len(seqs)) as engine:
        engine.add(seqs)
        while engine.busy():
            ended = engine.step()
            for s in ended:  # stub env: an observation after each turn but the last
                if s.num_turns == turns:
                    engine.finish(s)
                    continue
                s.ids += obs
                s.loss_mask += [0] * len(obs)
                s.logprobs += [0.0] * len(obs)
            engine.add([s for s in ended if s.status == "paused"])
    assert all(len(s.ids) == n and sum(s.loss_mask) == turns * per_turn for s in seqs)


@torch.no_grad()
def observations_only(model, B, obs, turns=5, per_turn=25, prompt=64, block_size=16):
    """Only the forwards that push the observations into the cache, as the engine runs them (the
    observation of every row in one forward per turn boundary, at the cache length that boundary
    has). Any multi-turn sampler pays at least single-turn time + this."""
    per_row = -(-(prompt + turns * per_turn + (turns - 1) * len(obs)) // block_size)
    cache = PagedKVCache.for_model(model, B * per_row, block_size, model.embed_tokens.weight.dtype)
    tables = torch.arange(B * per_row).view(B, per_row)  # row b's blocks, in order
    x = torch.tensor([obs] * B)
    for k in range(1, turns):
        start = prompt + k * per_turn + (k - 1) * len(obs)
        positions = torch.arange(start, start + len(obs)).expand(B, -1)
        slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
        table = tables[:, :-(-(start + len(obs)) // block_size)]
        model.forward_paged(x, positions, PagedBatch(cache, slots, table), logits_at=torch.full((B,), len(obs) - 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    d = tempfile.mkdtemp(prefix="bench_multiturn_")
    tiny.build_tiny_model(Transformer, d, **SHAPE)
    model = Transformer.from_pretrained(d)
    g = torch.Generator().manual_seed(0)
    obs = torch.randint(0, SHAPE["vocab_size"], (40,), generator=g).tolist()
    # matmul MACs per token: layers (qkv, o, gate_up, down) + lm_head (sampled tokens only)
    h, i = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    kvd = SHAPE["kv_heads"] * h // SHAPE["heads"]
    layer, head = SHAPE["layers"] * (h * (h + 2 * kvd) + h * h + 3 * h * i), h * SHAPE["vocab_size"]
    flops = ((64 + 125 + 160) * layer + 125 * head) / ((64 + 125) * layer + 125 * head)
    for B in [int(x) for x in a.batches.split(",")]:
        prompts = torch.randint(0, SHAPE["vocab_size"], (B, 64), generator=g).tolist()
        long_prompts = [p + obs * 4 for p in prompts]  # same tokens, observations up front
        run(model, prompts, 5, 25, obs), run(model, prompts, 1, 125, obs)  # warm-up
        ratios, same, floor, tm, ts = [], [], [], [], []
        observations_only(model, B, obs)  # warm-up
        for _ in range(a.pairs):
            t0 = time.perf_counter()
            run(model, prompts, 5, 25, obs)
            t1 = time.perf_counter()
            run(model, prompts, 1, 125, obs)
            t2 = time.perf_counter()
            run(model, long_prompts, 1, 125, obs)
            t3 = time.perf_counter()
            tm.append(t1 - t0), ts.append(t2 - t1), ratios.append((t1 - t0) / (t2 - t1))
            same.append((t1 - t0) / (t3 - t2))
            observations_only(model, B, obs)
            floor.append(1 + (time.perf_counter() - t3) / (t2 - t1))
        overhead = statistics.median(ratios)
        print(f"B={B}: 5x25 tokens + 4x40-token observations {statistics.median(tm):.2f}s, 1x125 tokens "
              f"{statistics.median(ts):.2f}s, ratio {overhead:.3f} (pairs: {', '.join(f'{r:.3f}' for r in ratios)}); "
              f"matmul FLOP ratio {flops:.2f}; vs 1x125 after the same tokens {statistics.median(same):.3f} "
              f"(pairs: {', '.join(f'{r:.3f}' for r in same)})")
        print(f"B={B}: floor (1x125 tokens + the observation forwards alone) {statistics.median(floor):.3f} "
              f"(pairs: {', '.join(f'{r:.3f}' for r in floor)})")
        print(f"multiturn_vs_same_tokens_b{B}: {statistics.median(same):.3f}")
    print(f"multiturn_overhead: {overhead:.3f}")


if __name__ == "__main__":
    main()
