"""Synchronous steps against streaming ones (stream.sampling_steps_ahead), interleaved in one process.

    .venv/bin/python bench/sync_vs_stream.py --warm runs/tiny/ckpt_000000/hf [--steps 8] [--pairs 2] [--ahead 1]
        [--prompts 64] [--threads 2]
    # a real model's tail: the recipe's warm start, k = 0, 1 and 2 (every arm alternating in each pair)
    .venv/bin/python bench/sync_vs_stream.py --warm runs/smollm2_sql_env/ckpt_000000/hf \
        --config configs/smollm2_sql_env.yaml --set data.db_root=$SPIDER_DIR --set grpo.dynamic_sampling=false \
        --set sampling.kv_budget_tokens=102400 --ahead 1,2 --prompts 16 --steps 2 --pairs 1
    # (dynamic sampling off: every sampled episode is trained, so "per trained episode" always has a
    # figure; a fixed KV pool: every arm batches alike on any machine)

--warm: the main command's policy before its first GRPO step (its ckpt_000000/hf, after the warm
start): a random model never answers, so its episodes all run the same turns and there is no tail
to fill. Each arm trains `--steps` GRPO steps of configs/tiny.yaml from that warm start in this
process (train.grpo_step, one rank), the arms alternating sync, stream, sync, stream, ... `--pairs`
times; every arm starts from the same weights and prompt order.

Printed per arm, then the medians over pairs:
- decode steps per trained episode (the engine's decode steps during the steps' rounds over the
  episodes trained): the schedule's count, the same on any machine; goal >= 1.6x fewer with k = 1;
- the live-row fraction: rows decoded per decode step over the open-episode cap (a rank share's
  episodes, the synchronous peak); goal >= 0.8 with k = 1;
- the share of decode steps under a quarter of the arm's peak rows (the tail: steps that run a
  nearly empty batch, each costing a whole weight read on a GPU);
- rollout seconds per trained token on this CPU (a CPU decode step costs about in proportion to its
  rows, so fewer, fuller steps gain little here);
- a GPU projection, labelled as one: the measured rows of every decode step, each step priced by the
  H200 decode step times per batch size measured before (bench/RESULTS.md, "Third/Fourth GPU
  session"): Qwen2.5-0.5B 3.74 ms at B=64 and 5.84 ms at B=256 (a line through both), Qwen2.5-7B
  14.10 ms at B=256 (a fixed weight read plus a per-row K/V read, the roofline's shape at ~1k tokens
  of context, scaled to that one measured point). Decode only: prefill and the tool's time left out.
The headline lines come last.
"""
import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import config as C  # noqa: E402
import train  # noqa: E402
from engine.engine import Engine  # noqa: E402
from model import Transformer  # noqa: E402
from sqltask import dataset  # noqa: E402
from stream import RolloutStream  # noqa: E402
from trainer import optim  # noqa: E402
from trainer.distributed import PeakMemory  # noqa: E402
from trainer.loss_scale import LossScaler  # noqa: E402
from trainer.policy_sampler import PolicySampler  # noqa: E402
from trainer.run_log import Log, Phases  # noqa: E402


def h200_step_ms(rows: int, shape: str) -> float:
    """The projected decode step time (ms) of `rows` rows on the H200 (module docstring)."""
    if shape == "0.5b":  # measured: 3.74 ms at 64 rows, 5.84 at 256 (flex, whole-step graphs)
        return 3.74 + (5.84 - 3.74) * (rows - 64) / (256 - 64)
    # 7B: 15.2 GB of bf16 weights and 57 KB of K/V per token x ~1k tokens per row, at the measured
    # 4.2 TB/s copy bandwidth: 3.62 ms + 0.0136 ms a row; measured 14.10 ms at 256 rows (1.99x that)
    return 14.10 / (3.62 + 0.0136 * 256) * (3.62 + 0.0136 * rows)


def run_arm(cfg, warm: str, ahead: int, steps: int, tok, exs) -> dict:
    """`steps` GRPO steps from the warm start with stream.sampling_steps_ahead = ahead: the tail's
    counts, the rollout seconds, the trained tokens and each decode step's rows."""
    cfg.stream.sampling_steps_ahead = ahead
    torch.manual_seed(cfg.train.seed)
    model = Transformer.from_pretrained(warm, dtype=torch.float32)
    o, cpu = cfg.optim, torch.device("cpu")
    opt, sch = optim.make_optimizer(model, o, o.lr, o.warmup_steps, steps)
    sampler = PolicySampler(model, cfg.sampling)
    sampler.refresh(model)
    run = train.Run(model, None, sampler, opt, sch, LossScaler(o, torch.float32), tok, cfg, Log(cfg, rank=1), 0, 1, cpu)
    stream = RolloutStream(sampler, tok, exs, cfg, 0, 1)
    rows_per_step, count = [], Engine._count_decode

    def traced(engine, seqs, n):  # every decode step's rows (a window of n steps: n steps of len(seqs) rows)
        rows_per_step.extend([len(seqs)] * n)
        count(engine, seqs, n)
    Engine._count_decode = traced
    out = {"decode_steps": 0.0, "live_rows": 0.0, "episodes": 0, "tokens": 0, "rollout_s": 0.0, "ex": [], "per_step": []}
    try:
        for step in range(steps):
            phase = Phases(PeakMemory(cpu))
            kept, seen, m = train.grpo_step(run, stream, step, phase)
            t = phase.pop()
            trained = len(kept)
            out["per_step"].append((m["decode_steps_per_episode"] * trained, trained))
            out["decode_steps"] += m["decode_steps_per_episode"] * trained
            out["live_rows"] += m["live_row_frac"] * m["decode_steps_per_episode"] * trained
            out["episodes"] += trained
            out["tokens"] += sum(e.trajectory.generated_tokens for e in kept)
            out["rollout_s"] += t.get("rollout", 0.0)
            out["ex"].append(sum(float(e.reward.exec_match) for e in seen) / max(len(seen), 1))
    finally:
        Engine._count_decode = count
        stream.close()
    out["rows_per_step"] = rows_per_step
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm", required=True, help="the main command's ckpt_000000/hf (the policy after its warm start)")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.yaml"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--ahead", default="1", help="stream.sampling_steps_ahead of the streaming arm; a list "
                    "(1,2): one streaming arm each, the first compared with sync in the headline")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override (data.db_root=..., repeatable)")
    ap.add_argument("--prompts", type=int, default=64, help="grpo.prompts_per_step (one rank)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="/tmp/bench_stream")
    a = ap.parse_args()
    if not os.path.exists(os.path.join(a.warm, "config.json")):
        sys.exit(f"--warm {a.warm}: not a model folder (run the main command first: runs/tiny/ckpt_000000/hf)")
    torch.set_num_threads(a.threads)
    aheads = [int(k) for k in a.ahead.split(",")]
    cfg = C.load_config([a.config, f"--model.path={a.warm}", "--sft.steps=0", f"--train.out_dir={a.out}",
                         f"--grpo.prompts_per_step={a.prompts}"] + [f"--{kv}" for kv in a.set])
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.warm, local_files_only=True)
    exs = dataset.load_examples(cfg.data.train_path, cfg.data.db_root)
    P, G = cfg.grpo.prompts_per_step, cfg.grpo.group_size
    print(f"{P} prompts x {G} samples a step, {a.steps} steps an arm, {a.pairs} pairs, 1 process, {a.threads} threads; "
          f"streaming: stream.sampling_steps_ahead={a.ahead}", flush=True)
    names = [("sync", 0), ("stream", aheads[0])] + [(f"stream_k{k}", k) for k in aheads[1:]]
    arms = {name: [] for name, _ in names}
    for pair in range(a.pairs):
        for name, ahead in names:
            t0 = time.time()
            r = run_arm(cfg, a.warm, ahead, a.steps, tok, exs)
            r["per_episode"] = r["decode_steps"] / r["episodes"]
            later = r["per_step"][1:] or r["per_step"]  # step 1 is the same work in both arms (nothing ahead yet)
            r["per_episode_later"] = sum(x for x, _ in later) / sum(n for _, n in later)
            r["live_frac"] = r["live_rows"] / r["decode_steps"]
            r["s_per_token"] = r["rollout_s"] / r["tokens"]
            peak = max(r["rows_per_step"], default=0)
            r["under_quarter"] = sum(b < peak / 4 for b in r["rows_per_step"]) / max(len(r["rows_per_step"]), 1)
            for shape in ("0.5b", "7b"):
                r[f"gpu_{shape}"] = sum(h200_step_ms(b, shape) for b in r["rows_per_step"]) / r["episodes"]
            arms[name].append(r)
            print(f"pair {pair + 1} {name:6s}: decode steps/episode {r['per_episode']:.3f}, live-row fraction "
                  f"{r['live_frac']:.3f}, decode steps under a quarter of the peak {r['under_quarter']:.3f}, rollout {1e3 * r['s_per_token']:.3f} ms/trained token, sampled EX "
                  f"{100 * statistics.mean(r['ex']):.1f}%, {r['episodes']} episodes trained ({time.time() - t0:.0f} s)",
                  flush=True)

    def med(name, key):
        return statistics.median(r[key] for r in arms[name])
    ratio = statistics.median(s["per_episode"] / t["per_episode"] for s, t in zip(arms["sync"], arms["stream"]))
    time_ratio = statistics.median(s["s_per_token"] / t["s_per_token"] for s, t in zip(arms["sync"], arms["stream"]))
    later = statistics.median(s["per_episode_later"] / t["per_episode_later"] for s, t in zip(arms["sync"], arms["stream"]))
    print(f"decode steps per trained episode from step 2 on (step 1 starts with nothing ahead): sync "
          f"{med('sync', 'per_episode_later'):.3f}, stream {med('stream', 'per_episode_later'):.3f}, sync/stream {later:.2f}")
    print(f"CPU rollout time per trained token: sync {1e3 * med('sync', 's_per_token'):.3f} ms, stream "
          f"{1e3 * med('stream', 's_per_token'):.3f} ms (sync/stream {time_ratio:.2f}, median of pairs)")
    for shape in ("0.5b", "7b"):
        s, t = med("sync", f"gpu_{shape}"), med("stream", f"gpu_{shape}")
        print(f"GPU projection (H200 decode step times, Qwen2.5-{shape.upper()} shape; a projection, not a "
              f"measurement): decode ms per trained episode: sync {s:.2f}, stream {t:.2f}, sync/stream {s / t:.2f}")
    for name, ahead in names[2:]:
        print(f"k={ahead}: decode steps per trained episode {med(name, 'per_episode'):.3f}, live-row fraction "
              f"{med(name, 'live_frac'):.3f}, decode steps under a quarter of the peak {med(name, 'under_quarter'):.3f}")
    print(f"under_quarter_peak_sync: {med('sync', 'under_quarter'):.3f}")
    print(f"under_quarter_peak_stream: {med('stream', 'under_quarter'):.3f}")
    print(f"decode_steps_per_episode_sync: {med('sync', 'per_episode'):.3f}")
    print(f"decode_steps_per_episode_stream: {med('stream', 'per_episode'):.3f}")
    print(f"live_row_frac_sync: {med('sync', 'live_frac'):.3f}")
    print(f"live_row_frac_stream: {med('stream', 'live_frac'):.3f}")
    print(f"decode_steps_ratio_sync_over_stream: {ratio:.2f}")


if __name__ == "__main__":
    main()
