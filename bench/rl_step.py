"""One full RL step of configs/tiny.yaml (or --config), split into rollout / reward / update (one process).

Builds the toy set and the tiny random model of configs/tiny.yaml in a temp folder (the run's own
asset builder), then runs train.py's own step, train.grpo_step (sample and reward, keep mask,
credit, update, weight sync), on prompts_per_step x group_size episodes with the run's optimizer
(optim.make_optimizer). A random model never writes a solution, so every episode runs all
max_turns turns to max_new_tokens: the rollout share is the worst case (pass --model a trained
checkpoint's hf/ folder for a realistic one). With the random model grpo.dynamic_sampling is off
(it would drop every group: all rewards are -1), so the update runs on all P x G episodes, again
the worst case; with --model the config's keep mask applies. Step 1 is a warm-up (SQL pool
start-up, page cache); the headline is the median of the later steps.

    .venv/bin/python bench/rl_step.py [--steps 3] [--threads 2] [--model DIR] [--prompts 32] [--toy DIR]
        [--config configs/tiny_actions.yaml]

--config: another toy recipe (default configs/tiny.yaml); with --model, a checkpoint of that recipe.

--toy DIR reads DIR/toy (e.g. one copy of runs/toy for two commits compared back to back).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import config as C  # noqa: E402
from sqltask import dataset  # noqa: E402
from trainer import optim  # noqa: E402
from toy import tiny  # noqa: E402
import train  # noqa: E402
from trainer.distributed import PeakMemory  # noqa: E402
from eval import summarise  # noqa: E402
from model import Transformer  # noqa: E402
import sft  # noqa: E402
from trainer.run_log import Log, Phases  # noqa: E402
from trainer.policy_sampler import PolicySampler  # noqa: E402
from trainer.loss_scale import LossScaler  # noqa: E402
from stream import RolloutStream  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3, help="RL steps (the first is a warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="", help="HF folder (default: tiny.yaml's random model)")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per step (default: the config's)")
    ap.add_argument("--toy", default="", help="a folder holding toy/ (default: build it in a temp folder)")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.yaml"), help="the toy recipe")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    d = a.toy or tempfile.mkdtemp(prefix="bench_rl_step_")
    cfg = C.load_config([a.config, f"--data.db_root={d}/toy",
                         f"--data.train_path={d}/toy/train.jsonl", f"--data.eval_path={d}/toy/eval.jsonl",
                         f"--model.path={a.model or d + '/model'}", f"--train.out_dir={d}/run"])
    if a.prompts:
        cfg.grpo.prompts_per_step = a.prompts
    if not a.model:
        cfg.grpo.dynamic_sampling = False  # a random model's groups are all equal: keep them all
    t0 = time.time()
    tiny.prepare_assets(cfg, Transformer, sft.gold_texts)
    print(f"assets built in {time.time() - t0:.1f}s")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    model = Transformer.from_pretrained(cfg.model.path, dtype=torch.float32)
    exs = dataset.load_examples(cfg.data.train_path, cfg.data.db_root)
    o, P, G, cpu = cfg.optim, cfg.grpo.prompts_per_step, cfg.grpo.group_size, torch.device("cpu")
    opt, sch = optim.make_optimizer(model, o, o.lr, o.warmup_steps, a.steps)
    sampler = PolicySampler(model, cfg.sampling)
    sampler.refresh(model)  # the weights GRPO starts from (train.main syncs once before its loop)
    run = train.Run(model, None, sampler, opt, sch, LossScaler(o, torch.float32), tok, cfg, Log(cfg, rank=1), rank=0,
                    world=1, device=cpu)
    stream = RolloutStream(sampler, tok, exs, cfg, 0, 1)  # the run's prompt order (stream.sampling_steps_ahead: the config's)
    print(f"{os.path.basename(a.config)}: {P} prompts x {G} samples, max_turns {cfg.env.max_turns}, max_new_tokens "
          f"{cfg.sampling.max_new_tokens}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"1 process, {a.threads} threads, dynamic sampling {'on' if cfg.grpo.dynamic_sampling else 'off'}")
    rows = []
    for step in range(a.steps):
        phase = Phases(PeakMemory(cpu))
        t0 = time.time()
        kept, seen, _ = train.grpo_step(run, stream, step, phase)  # the step train.main runs
        total = time.time() - t0
        t = phase.pop()
        t_roll, t_rew, t_upd = t.get("rollout", 0.0), t.get("reward", 0.0), t.get("update", 0.0) + t.get("sync", 0.0)
        s = summarise(seen)
        rows.append((t_roll, t_rew, t_upd, total))
        print(f"step {step + 1}{' (warm-up)' if step == 0 and a.steps > 1 else ''}: total {total:.1f}s = rollout "
              f"{t_roll:.1f}s + reward {t_rew:.2f}s + update and sync {t_upd:.1f}s | {s['resp_tokens']} sampled "
              f"tokens ({s['resp_tokens'] / max(t_roll, 1e-9):.0f}/s), turns {s['turns'] / s['n']:.2f}, "
              f"reward {s['reward'] / s['n']:+.2f}, {len(kept)} episodes trained", flush=True)
    stream.close()
    timed = rows[1:] or rows
    med = [statistics.median(r[i] for r in timed) for i in range(4)]
    print(f"median of {len(timed)} step(s): rollout {med[0]:.1f}s ({100 * med[0] / med[3]:.0f}%), reward "
          f"{med[1]:.2f}s ({100 * med[1] / med[3]:.0f}%), update and sync {med[2]:.1f}s ({100 * med[2] / med[3]:.0f}%)")
    print(f"rl_step_s: {med[3]:.1f}")


if __name__ == "__main__":
    main()
