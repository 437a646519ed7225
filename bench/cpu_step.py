"""CPU time of configs/tiny.yaml's GRPO update and SFT warm-start steps: today's settings vs the
reference they replaced, interleaved in ONE process (old, new, old, new, ...), medians of ratios.

  old  SDPA over a dense (B, 1, T, T) mask (`DenseRows`, the CPU attention trainer/packed_attention.py
       replaced) with optim.pack_row_tokens 512 and micro_batch_tokens 16384, AdamW's
       per-parameter loop (foreach=False), the LM head checkpointed even as a single chunk
       (`checkpointed_logprobs`, the code it replaced), per-block FSDP2 units: the code and
       settings before this benchmark was written
  new  configs/tiny.yaml and the code as they are (trainer/packed_attention.py: one causal attention
       row per sequence; foreach AdamW; no single-chunk recompute; model.fsdp_unit model)
  --against block: old is today's settings with per-block FSDP2 units (model.fsdp_unit block), so
       the ratios are those of the one-unit layout alone
  --against micro16k: old is today's settings with optim.micro_batch_tokens 16384 (tiny.yaml's
       before it became 4096)

Each arm has its own FSDP2-sharded copy of the same tiny model and its own AdamW, so both start
from the same weights; the first pair's update and SFT losses / grad norms are printed side by
side (the two layouts compute the same thing up to float rounding).

The batch: configs/tiny.yaml's shapes without a rollout. `--prompts` groups (global; default 80,
what dynamic sampling keeps of 128 when ~62% of the groups have mixed rewards: ~50k tokens) of
grpo.group_size trajectories: each prompt followed by the gold response (tool turn, real
observation, solution) of a randomly drawn training question, so lengths and loss masks are
those of real episodes. SFT: `--sft-steps` steps of sft.batch_size gold trajectories, the loop
body of sft.run_sft (plan, sft_loss_sum, backward, clip + AdamW).

    .venv/bin/python bench/cpu_step.py [--pairs 3] [--prompts 80] [--sft-steps 10]
    torchrun --standalone --nproc_per_node=2 bench/cpu_step.py     # as train.py runs: FSDP2 on gloo
    .venv/bin/python bench/cpu_step.py --profile new               # torch.profiler table of one arm
    torchrun --standalone --nproc_per_node=2 bench/cpu_step.py --against block
    torchrun --standalone --nproc_per_node=2 bench/cpu_step.py --against micro16k

Prints `update_speedup: X` and `sft_speedup: X` last (old time / new time, median of the pairs).
"""
import argparse
import copy
import os
import random
import statistics
import sys
import tempfile
import time
import types

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import config as C  # noqa: E402
from sqltask import chat, dataset  # noqa: E402
from trainer import optim  # noqa: E402
from trainer import packed_attention  # noqa: E402
from trainer import packing  # noqa: E402
import padded  # noqa: E402  (bench/padded.py: the dense mask)
import sft  # noqa: E402
from toy import tiny  # noqa: E402
import train  # noqa: E402
from trainer.loss_scale import LossScaler  # noqa: E402
from trainer.distributed import all_sum, close, each_micro_batch, setup_dist, shard  # noqa: E402
from model import Transformer  # noqa: E402
from rollout import Trajectory  # noqa: E402

FOR_ROWS = packed_attention.for_rows
OLD = {"pack_row_tokens": 512, "micro_batch_tokens": 16384, "dense": True, "fsdp_unit": "block"}
BLOCK = {"fsdp_unit": "block"}  # --against block: only the FSDP2 units differ
MICRO16K = {"micro_batch_tokens": 16384}  # --against micro16k: only the micro-batch size differs


def checkpointed_logprobs(self, h, targets, temperature):
    """Transformer._logprobs as it was: every chunk checkpointed, a single one included."""
    chunk = max(1, self.logits_chunk_elems // max(1, h.shape[0] * self.config.vocab_size))
    lps, ents = [], []
    for s in range(0, h.shape[1], chunk):
        args = (h[:, s:s + chunk], targets[:, s:s + chunk], temperature)
        lp, ent = (checkpoint(self._chunk_logprobs, *args, use_reentrant=False) if torch.is_grad_enabled()
                   else self._chunk_logprobs(*args))
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps, 1), torch.cat(ents, 1)


class DenseRows:
    """The old arm's CPU attention: SDPA over the rows' dense (B, 1, T, T) mask, every pair computed.
    Built like packed_attention.for_rows, which the old arm's passes are pointed at."""

    def __init__(self, docs, segs, width, device):
        doc = packing.pad(docs, -1, device, width=width)  # padding: its own unit, so no row is empty
        self.mask = padded.dense_mask(doc, packing.pad(segs, 0, device, width=width))

    def attend(self, q, k, v, layer=0):  # q (B, T, H, D), k/v (B, T, Hk, D) -> (B, T, H, D)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=self.mask, enable_gqa=True).transpose(1, 2)


# -----------------------------------------------------------------------------
# the batch


def gold_data(cfg, tok, n: int):
    """(prompts, gold (ids, mask)) of n training questions drawn with a fixed seed."""
    exs = dataset.load_examples(cfg.data.train_path, cfg.data.db_root)
    random.Random(0).shuffle(exs)
    exs = exs[:n]
    prompts = [chat.render_prompt(tok, ex, cfg.data, cfg.env.protocol, cfg.data.db_root) for ex in exs]
    db_paths = [dataset.abs_db_path(ex, cfg.data.db_root) for ex in exs]
    return prompts, sft.build_dataset(exs, prompts, tok, cfg, db_paths)


def grpo_batch(prompts, data, n_prompts: int, G: int, seed: int) -> list[Trajectory]:
    """n_prompts groups of G trajectories: the prompt, then a random gold trajectory's response."""
    rng = random.Random(seed)
    out = []
    for p in prompts[:n_prompts]:
        for _ in range(G):
            ids, mask = data[rng.randrange(len(data))]
            first = mask.index(1)  # the response starts at the first model-side token
            full, loss_mask = list(p) + ids[first:], [0] * len(p) + mask[first:]
            out.append(Trajectory.of(list(p), full, loss_mask, [-rng.random() if m else 0.0 for m in loss_mask]))
    return out


# -----------------------------------------------------------------------------
# the two arms


class Arm:
    def __init__(self, name, cfg, model, settings):
        self.name, self.cfg, self.model, self.dense = name, cfg, model, settings.get("dense", False)
        self.cfg.optim.pack_row_tokens = settings.get("pack_row_tokens", cfg.optim.pack_row_tokens)
        self.cfg.optim.micro_batch_tokens = settings.get("micro_batch_tokens", cfg.optim.micro_batch_tokens)
        o = cfg.optim
        self.opt, self.sch = optim.make_optimizer(model, o, o.lr, 0, 1000)
        self.sft_opt, self.sft_sch = optim.make_optimizer(model, o, cfg.sft.lr, 0, 1000)
        if self.dense:  # the old arm: the code before, where it differs from a setting
            model._logprobs = types.MethodType(checkpointed_logprobs, model)
            for opt in (self.opt, self.sft_opt):
                opt.param_groups[0]["foreach"] = False

    def update(self, trajs, adv, world, device) -> tuple[float, dict]:
        packed_attention.for_rows = DenseRows if self.dense else FOR_ROWS
        t0 = time.perf_counter()
        per_token = [adv[i].expand(len(t.token_turns())).clone() for i, t in enumerate(trajs)]
        run = train.Run(self.model, None, None, self.opt, self.sch, LossScaler(self.cfg.optim, torch.float32), None, self.cfg,
                        None, 0, world, device)
        m = train.update(run, trajs, per_token)  # as train.grpo_step
        grad_norms = m.pop("grad_norms")
        return time.perf_counter() - t0, {**m, "grad_norm": grad_norms[-1]}

    def sft_steps(self, batches, world, device) -> tuple[float, list]:
        """sft.run_sft's loop body on each batch; -> (seconds, [(loss, grad norm)])."""
        packed_attention.for_rows = DenseRows if self.dense else FOR_ROWS
        o, out = self.cfg.optim, []
        t0 = time.perf_counter()
        for seqs in batches:
            n_tok = all_sum([sum(sum(m[1:]) for _, m in seqs)], device)[0]
            self.sft_opt.zero_grad(set_to_none=True)
            tot = 0.0
            mbs = packing.plan(seqs, None, o.micro_batch_tokens, o.pack_row_tokens)
            for mb in each_micro_batch(self.model, mbs, device, backward=True):
                loss_sum = sft.sft_loss_sum(self.model, [seqs[j] for j in mb.members], row_tokens=o.pack_row_tokens)
                (loss_sum / n_tok * world).backward()
                tot += loss_sum.detach().item()
            grad_norm = optim.step_optimizer(self.model, self.sft_opt, self.sft_sch, self.cfg.optim)
            out.append((all_sum([tot], device)[0] / n_tok, grad_norm))
        return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3, help="old/new pairs (after one warm-up pair)")
    ap.add_argument("--prompts", type=int, default=80, help="GRPO groups in the update (global)")
    ap.add_argument("--sft-steps", type=int, default=10, help="SFT steps per measurement")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--profile", choices=["old", "new"], default="", help="print one arm's torch.profiler table")
    ap.add_argument("--against", choices=["old", "block", "micro16k"], default="old",
                    help="the old arm: the settings before this benchmark, or today's with per-block FSDP2 "
                         "units, or with micro-batches of 16384 tokens")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rank, world, device = setup_dist()
    d = tempfile.gettempdir() + "/bench_cpu_step"  # every rank reads the same assets
    cfg = C.load_config([os.path.join(ROOT, "configs", "tiny.yaml"), f"--data.db_root={d}/toy",
                         f"--data.train_path={d}/toy/train.jsonl", f"--data.eval_path={d}/toy/eval.jsonl",
                         f"--model.path={d}/model"])
    if rank == 0:
        tiny.prepare_assets(cfg, Transformer, sft.gold_texts)
    if world > 1:
        torch.distributed.barrier()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    G, bs = cfg.grpo.group_size, cfg.sft.batch_size
    prompts, data = gold_data(cfg, tok, max(a.prompts, 600))
    trajs = grpo_batch(prompts, data, a.prompts, G, seed=0)
    per = len(trajs) // world  # contiguous halves, as train.py gives each rank its prompts
    trajs = trajs[rank * per:(rank + 1) * per]
    adv = torch.randn(len(trajs), generator=torch.Generator().manual_seed(rank))
    sft_batches = [[data[j] for j in idx] for idx in sft.batches(len(data), bs, a.sft_steps, 0, rank, world)]
    n_tok = all_sum([sum(len(t.ids) for t in trajs)], device)[0]
    n_shared = all_sum([sum(len(t.ids) - len(t.prompt_ids) for t in trajs) + len(trajs) // G
                        * round(statistics.mean(len(t.prompt_ids) for t in trajs))], device)[0]
    base = Transformer.from_pretrained(cfg.model.path, dtype=torch.float32)
    baseline = {"old": OLD, "block": BLOCK, "micro16k": MICRO16K}[a.against]
    arms = {name: Arm(name, copy.deepcopy(cfg), shard(copy.deepcopy(base), torch.float32,
                                                      s.get("fsdp_unit", cfg.model.fsdp_unit)), s)
            for name, s in (("old", baseline), ("new", {}))}
    say = print if rank == 0 else (lambda *x, **k: None)
    say(f"update: {a.prompts} groups x {G} = {a.prompts * G} trajectories, {n_tok:.0f} tokens "
        f"(~{n_shared:.0f} with each prompt once); SFT: {a.sft_steps} steps x {bs} sequences; "
        f"world {world}, {a.threads} thread(s) per process")
    say(f"old: {baseline}; new: fsdp_unit {cfg.model.fsdp_unit}, pack_row_tokens {arms['new'].cfg.optim.pack_row_tokens}, micro_batch_tokens "
        f"{arms['new'].cfg.optim.micro_batch_tokens}, segment attention")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        arm = arms[a.profile]
        arm.update(trajs, adv, world, device)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            arm.update(trajs, adv, world, device)
        say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            arm.sft_steps(sft_batches, world, device)
        say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        return
    upd, sft_r = [], []
    for pair in range(a.pairs + 1):  # pair 0: warm-up, and the numerics check (same start weights)
        res = {}
        for name in ("old", "new") if pair % 2 == 0 else ("new", "old"):
            tu, m = arms[name].update(trajs, adv, world, device)
            ts, losses = arms[name].sft_steps(sft_batches, world, device)
            res[name] = (tu, ts, m, losses)
        (tu_o, ts_o, m_o, l_o), (tu_n, ts_n, m_n, l_n) = res["old"], res["new"]
        if pair == 0:
            say(f"same start, same batch: update pg_loss {m_o['pg_loss']:.7f} vs {m_n['pg_loss']:.7f}, grad_norm "
                f"{m_o['grad_norm']:.7f} vs {m_n['grad_norm']:.7f}; first SFT step loss {l_o[0][0]:.7f} vs "
                f"{l_n[0][0]:.7f}, grad norm {l_o[0][1]:.7f} vs {l_n[0][1]:.7f}; last SFT loss {l_o[-1][0]:.7f} vs {l_n[-1][0]:.7f}")
        else:
            upd.append(tu_o / tu_n)
            sft_r.append(ts_o / ts_n)
        say(f"pair {pair}{' (warm-up)' if pair == 0 else ''}: update old {tu_o:.2f}s new {tu_n:.2f}s | "
            f"{a.sft_steps} SFT steps old {ts_o:.2f}s new {ts_n:.2f}s", flush=True)
    say(f"update ratios {[round(r, 2) for r in upd]}, SFT ratios {[round(r, 2) for r in sft_r]}")
    say(f"update_speedup: {statistics.median(upd):.2f}")
    say(f"sft_speedup: {statistics.median(sft_r):.2f}")
    if world > 1:
        close()


if __name__ == "__main__":
    main()
