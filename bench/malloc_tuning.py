"""CPU time of a rollout and of SFT steps with and without malloc_tuning.keep_freed_memory(),
in alternating fresh processes (the setting lasts for a process, so the two arms cannot share one):
off, on, on, off, ... one process per arm and pair, medians of the ratios.

Each process: configs/tiny.yaml, 1 thread, no process group. A rollout of `--prompts` training
questions x grpo.group_size samples (rollout.sample_episodes, the sampler train.py uses), then
`--sft-steps` SFT steps of half an sft.batch_size (one rank's share) on gold episodes.
--model: an HF folder; a warm-start checkpoint (runs/tiny/ckpt_000000/hf after the main command)
gives real episode lengths. The default, the untrained tiny model, never stops a turn early, so
its rollout is all long decodes.

    .venv/bin/python bench/malloc_tuning.py [--pairs 3] [--model runs/tiny/ckpt_000000/hf]

Prints `rollout_speedup: X` and `sft_step_speedup: X` last (off time / on time).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def arm(tuned: bool, model_path: str, prompts: int, sft_steps: int) -> dict:
    """One process's measurement (run in a fresh interpreter by main)."""
    from trainer import malloc_tuning
    if tuned and not malloc_tuning.keep_freed_memory():
        raise SystemExit("mallopt is unavailable here (not glibc): nothing to compare")
    import torch
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    import config as C
    from sqltask import chat, dataset
    from trainer import optim
    import sft
    from toy import tiny
    from model import Transformer
    from rollout import sample_episodes
    from trainer.policy_sampler import PolicySampler
    cfg = C.load_config([os.path.join(ROOT, "configs", "tiny.yaml")])
    tiny.prepare_toy_set(cfg.data)
    path = model_path or cfg.model.path
    tok = AutoTokenizer.from_pretrained(path)
    model = Transformer.from_pretrained(path, dtype=torch.float32)
    exs = dataset.load_examples(cfg.data.train_path, cfg.data.db_root)
    G = cfg.grpo.group_size
    sampler = PolicySampler(model, cfg.sampling)
    sampler.refresh(model)
    sample_episodes(sampler, tok, exs[:8], cfg, n=G, seed=0)  # warm-up
    t0 = time.perf_counter()
    sample_episodes(sampler, tok, exs[8:8 + prompts], cfg, n=G, seed=1)
    t_rollout = time.perf_counter() - t0
    prompts_txt = [chat.render_prompt(tok, ex, cfg.data, cfg.env.protocol, cfg.data.db_root) for ex in exs]
    data = sft.build_dataset(exs, prompts_txt, tok, cfg, [dataset.abs_db_path(e, cfg.data.db_root) for e in exs])
    opt, sch = optim.make_optimizer(model, cfg.optim, cfg.sft.lr, 0, 1000)
    rng = random.Random(0)
    model.train()

    def step():
        seqs = [data[j] for j in rng.sample(range(len(data)), cfg.sft.batch_size // 2)]
        opt.zero_grad(set_to_none=True)
        (sft.sft_loss_sum(model, seqs) / sum(sum(m[1:]) for _, m in seqs)).backward()
        optim.step_optimizer(model, opt, sch, cfg.optim)
    step()
    t0 = time.perf_counter()
    for _ in range(sft_steps):
        step()
    return {"rollout_s": t_rollout, "sft_step_s": (time.perf_counter() - t0) / sft_steps}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--model", default="", help="HF folder (default: configs/tiny.yaml's model.path)")
    ap.add_argument("--prompts", type=int, default=32, help="questions in the rollout (x grpo.group_size)")
    ap.add_argument("--sft-steps", type=int, default=20)
    ap.add_argument("--arm", choices=["on", "off"], help=argparse.SUPPRESS)  # the child process
    a = ap.parse_args()
    if a.arm:
        print(json.dumps(arm(a.arm == "on", a.model, a.prompts, a.sft_steps)))
        return
    ratios = {"rollout_s": [], "sft_step_s": []}
    for pair in range(a.pairs):
        res = {}
        for name in ("off", "on") if pair % 2 == 0 else ("on", "off"):
            out = subprocess.run([sys.executable, __file__, "--arm", name, "--model", a.model, "--prompts",
                                  str(a.prompts), "--sft-steps", str(a.sft_steps)], cwd=ROOT,
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(out.stderr[-3000:])
            res[name] = json.loads(out.stdout.strip().splitlines()[-1])
        for k in ratios:
            ratios[k].append(res["off"][k] / res["on"][k])
        print(f"pair {pair}: rollout off {res['off']['rollout_s']:.2f}s on {res['on']['rollout_s']:.2f}s | "
              f"SFT step off {res['off']['sft_step_s']:.3f}s on {res['on']['sft_step_s']:.3f}s", flush=True)
    print(f"ratios: rollout {[round(r, 2) for r in ratios['rollout_s']]}, SFT {[round(r, 2) for r in ratios['sft_step_s']]}")
    print(f"rollout_speedup: {statistics.median(ratios['rollout_s']):.2f}")
    print(f"sft_step_speedup: {statistics.median(ratios['sft_step_s']):.2f}")


if __name__ == "__main__":
    main()
