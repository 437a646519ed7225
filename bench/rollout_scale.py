"""Rollouts at scale through rollout.rollout: G samples per prompt, real tool turns, a KV pool smaller than the work.

What train.py and eval.py run: rollout.rollout on the toy set (real prompts, real SQLite tool
calls and observations), n = G samples per prompt, on a tiny random model whose turns a logits
hook scripts: each row writes 0-4 free tokens, then 0..max_turns-1 tool turns (the question's
lookup or gold query in <sql>), then its answer in <solution>. The KV budget is the SkyRL-SQL
recipe's ratio (400k tokens per GPU for 29k-token trajectories) times max_context, so the work
holds more KV tokens than the pool: rows are admitted as blocks free up, and evicted and
recomputed when the pool runs out.

Printed: the workload, the engine's counters (Engine.counters), where the pool's blocks
went, then the headline:

    prefilled_per_distinct_prompt_token  prompt tokens prefilled / distinct prompt tokens
                                         (1.0 = each prompt once, its G samples share it)
    kv_utilization                       mean over decode steps of blocks in use / pool blocks

kv_utilization counts every decode step alike, so the drain at the end (the last rows' long
turns, with nothing left to admit) pulls it down whatever the scheduler does; the breakdown
prints it separately for the steps where work was still waiting for blocks. It is a measure of
the pool's fill, not of efficiency: when the work fits in the pool (--prompts 6) it is the work's
size over the pool's (the pool is the smaller of the budget and the rows' worst cases, which count
every observation at its 4 x env.max_obs_chars-token bound, i.e. max_context per row), and
sharing a prompt's blocks lowers it; only a work larger than the pool shows how well the
scheduler keeps it full (the default: 32 prompts x 8, ~3.7x the pool).

    .venv/bin/python bench/rollout_scale.py [--prompts 32] [--group 8] [--threads 1]     # CPU, fp32
    python bench/rollout_scale.py --device cuda --shape qwen2.5-0.5b                        # GPU, bf16

With --shape the model has that shape (layers, widths) but the toy tokenizer's vocabulary.
"""
import argparse
import hashlib
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config as C  # noqa: E402
from sqltask import dataset  # noqa: E402
import rollout as rollout_module  # noqa: E402
from toy import tiny  # noqa: E402
from model import Transformer  # noqa: E402
import sft  # noqa: E402
from sampler import SHAPES  # noqa: E402  (bench/sampler.py: the script's folder is on sys.path)

RECIPE_BUDGET, RECIPE_CONTEXT = 400_000, 29_000  # configs/skyrl_sql_7b.yaml, per GPU


# -----------------------------------------------------------------------------
# the workload: scripted turns with real tool calls


class Script:
    """A logits hook: row `index`, turn k writes `free` sampled tokens (EOS forbidden), then a
    forced text: a tool call while k <= its tool turns, else its answer. Drawn from (seed, index)."""

    def __init__(self, tok, examples, group: int, max_turns: int, seed: int = 0):
        self.tok, self.examples, self.group, self.max_turns, self.seed = tok, examples, group, max_turns, seed
        self.eos = rollout_module.eos_ids(tok)
        self.cache = {}

    def plan(self, index: int, turn: int) -> tuple[int, list[int]]:
        if (index, turn) not in self.cache:
            rng = random.Random(self.seed * 1_000_003 + index)
            tools = rng.randrange(self.max_turns)  # tool turns before the answer
            frees = [rng.randint(0, 4) for _ in range(self.max_turns)]
            ex = self.examples[index // self.group]
            query = ex.get("lookup_sql") or ex["gold_sql"]
            text = f"<sql>{query}</sql>" if turn <= tools else f"<solution>{ex['gold_sql']}</solution>"
            self.cache[index, turn] = frees[turn - 1], self.tok.encode(text, add_special_tokens=False)
        return self.cache[index, turn]

    def __call__(self, logits, rows):
        logits = logits.clone()
        logits[:, self.eos] = float("-inf")
        for b, r in enumerate(rows):
            free, forced = self.plan(r.index, r.num_turns)
            j = len(r.ids) - r.turn_start - free
            if 0 <= j < len(forced):
                logits[b] = float("-inf")
                logits[b, forced[j]] = 0.0
        return logits


class Recording(rollout_module.Engine):
    """The engine rollout builds, recording per decode step the blocks in use and whether any
    sequence was still waiting to be (re)admitted."""

    runs: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trace = []  # (blocks in use, work waiting) per decode step
        Recording.runs.append(self)

    def step(self):
        decodes = self.stats["decode_steps"]
        ended = super().step()
        if self.stats["decode_steps"] > decodes:
            waiting = bool(self.scheduler.new or self.scheduler.returning)
            self.trace.append((self.blocks.num_used, waiting))
        return ended


# -----------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="", choices=[""] + sorted(SHAPES), help="default: a tiny model")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8, help="G samples per prompt")
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--budget-tokens", type=int, default=0, help="default: the recipe's ratio x max_context")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tool-wait", default="fixed", choices=["fixed", "async"])
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    root = tempfile.mkdtemp(prefix="bench_rollout_scale_")
    settings = [f"data.train_path={root}/toy/train.jsonl", f"data.eval_path={root}/toy/eval.jsonl",
                f"data.db_root={root}/toy", "data.prepare_toy=true", f"model.path={root}/model",
                "model.build_tiny=true", "model.tiny_hidden_size=32", "model.tiny_layers=1", "model.tiny_heads=2",
                "model.tiny_kv_heads=1", "model.tiny_intermediate_size=64", "model.tiny_vocab_size=512",
                f"env.max_turns={a.max_turns}", "env.workers=1", f"env.tool_wait={a.tool_wait}",
                f"sampling.max_context={a.max_context}", f"sampling.block_size={a.block_size}"]
    cfg = C.load_config([os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml")]
                        + ["--" + s for s in settings])
    tiny.prepare_assets(cfg, Transformer, sft.gold_texts)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    if a.shape:  # that shape, the toy tokenizer's vocabulary
        tiny.build_tiny_model(Transformer, f"{root}/shaped", **dict(SHAPES[a.shape], vocab_size=len(tok)))
        model = Transformer.from_pretrained(f"{root}/shaped", dtype=dtype, device=dev)
    else:
        model = Transformer.from_pretrained(cfg.model.path, dtype=dtype, device=dev)
    budget = a.budget_tokens or round(a.max_context * RECIPE_BUDGET / RECIPE_CONTEXT)
    scfg = C.SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64, max_context=a.max_context,
                            kv_budget_tokens=budget, block_size=a.block_size, cuda_graphs=dev.type == "cuda")
    examples = dataset.load_examples(cfg.data.train_path, cfg.data.db_root)[:a.prompts]
    hook = Script(tok, examples, a.group, a.max_turns)
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu, threads {a.threads}"
    print(f"model {a.shape or 'tiny'} {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, {dtype}; {where}")

    rollout_module.Engine = Recording
    stats = {}
    t0 = time.perf_counter()
    trajs = rollout_module.rollout(model, tok, examples, cfg.env, scfg, cfg.data, cfg.data.db_root, n=a.group,
                                   seed=0, dtype=dtype, logits_hook=hook, stats=stats)
    seconds = time.perf_counter() - t0
    trace = Recording.runs[-1].trace

    prompts = {tuple(t.prompt_ids) for t in trajs}
    distinct = sum(map(len, prompts))
    tokens = [len(t.ids) for t in trajs]
    print(f"workload: {len(examples)} prompts x G={a.group} = {len(trajs)} trajectories, max_turns {a.max_turns}, "
          f"tool_wait {a.tool_wait}; distinct prompt tokens {distinct} (x G = {distinct * a.group})")
    print(f"  turns {sum(t.num_turns for t in trajs)}, tool calls {sum(t.num_tool_calls for t in trajs)}, "
          f"end reasons {sorted({t.end_reason for t in trajs})}; tokens all {sum(tokens)}, max {max(tokens)}")
    bs, pool = a.block_size, stats["pool_blocks"]
    print(f"kv pool {pool} blocks of {bs} ({budget} budget tokens; the work's tokens / pool tokens "
          f"{sum(tokens) / (pool * bs):.2f}), {seconds:.1f} s")
    print("engine: " + ", ".join(f"{k} {v}" for k, v in stats.items()))
    steps = max(stats["decode_steps"], 1)
    waiting = [used for used, wait in trace if wait]
    print(f"pool in use: mean {stats['blocks_used'] / steps / pool:.2f} over {steps} decode steps; "
          f"{sum(waiting) / max(len(waiting), 1) / pool:.2f} over the {len(waiting)} steps with work waiting for "
          f"blocks, {sum(u for u, w in trace if not w) / max(len(trace) - len(waiting), 1) / pool:.2f} over the "
          f"{len(trace) - len(waiting)} draining; peak {stats['peak_blocks'] / pool:.2f}")
    print(f"rows per decode step {stats['live_rows'] / steps:.1f}; digest of every trajectory's ids "
          f"{hashlib.sha1(repr([t.ids for t in trajs]).encode()).hexdigest()[:12]} (equal digests: equal samples)")
    print(f"prefilled_per_distinct_prompt_token: {stats['prompt_prefill_tokens'] / distinct:.2f}")
    print(f"kv_utilization: {stats['blocks_used'] / steps / pool:.2f}")


if __name__ == "__main__":
    main()
