"""The sampler-trainer mismatch per compute dtype: float32, bfloat16, float16.

One set of fp32 weights; for each dtype, train.py's layout: the weights as FSDP2 masters computing
in that dtype (distributed.shard on a one-rank group), the sampler's inference copy and KV cache in
that dtype (trainer/policy_sampler.PolicySampler, refreshed from the masters). Episodes are sampled
with the engine, then their sampled tokens are scored again by the training forward (the packed
forward of the update: policy_update.logprobs_of over packing.plan). Per dtype, over every sampled
token, with r = log π_trainer(y) - log π_sampler(y):

    kl_k3       mean of exp(r) - 1 - r   (k3 estimate of KL(π_sampler || π_trainer), tokens drawn from the sampler)
    abs_mean    mean |r|      abs_max    max |r|

Two models: (a) a warm start (an HF folder, e.g. <out_dir>/ckpt_000000/hf of the main command),
sampled on the toy prompts through rollout.sample_episodes (the loop and reward a GRPO step's rounds run); (b) a
random model of the Qwen2.5-0.5B shape (N(0, 0.02) weights, as bench/policy_decode.py builds it),
a few random prompts decoded by the engine (rollout.generate; EOS ignored). The headline lines come
last: abs_mean of float16 over bfloat16 per model, and the larger of the two (goal <= 0.2).

    .venv/bin/python bench/mismatch.py --warm runs/tiny/ckpt_000000/hf [--config configs/tiny.yaml]
    .venv/bin/python bench/mismatch.py --smoke       # tiny sizes, seconds (tests/test_fp16.py runs it)
CPU: fp16 matmuls have no fast kernel on most CPUs (~6x slower than fp32 on the 2-core AMD EPYC
VM), bf16 ones use AVX512-BF16 where present; the figures are the same on any device up to
kernel rounding, the times are not.
"""
import argparse
import gc
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config as C  # noqa: E402
import sft  # noqa: E402
from model import Transformer  # noqa: E402
from rollout import generate, sample_episodes  # noqa: E402
from sqltask import dataset  # noqa: E402
from toy import tiny  # noqa: E402
from trainer import distributed, packing, policy_update  # noqa: E402
from trainer.policy_sampler import PolicySampler  # noqa: E402
from policy_decode import SHAPES, random_model  # noqa: E402  (bench/policy_decode.py)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mismatch(trajs, model, cfg, device) -> dict:
    """kl_k3, abs_mean, abs_max of r = trainer - sampler logprob over every sampled (loss) token."""
    seqs, prompt_lens = policy_update._sequences(trajs)
    mbs = packing.plan(seqs, prompt_lens, cfg.optim.micro_batch_tokens, cfg.optim.pack_row_tokens)
    trainer = policy_update.logprobs_of(model, mbs, cfg.sampling.temperature, device)  # {i: (n_i,)}
    r = torch.cat([trainer[i].double().cpu() - torch.tensor([t.logprobs[j] for j in range(1, len(t.ids))
                                                             if t.loss_mask[j]], dtype=torch.float64)
                   for i, t in enumerate(trajs)])  # (N,) one per sampled token
    return {"kl_k3": float((r.exp() - 1 - r).mean()), "abs_mean": float(r.abs().mean()),
            "abs_max": float(r.abs().max()), "tokens": r.numel()}


def run_dtype(make_fp32_model, dtype, cfg, device, sample) -> dict:
    """train.py's layout in `dtype` (fp32 masters, sampler copy), sample(sampler) -> trajectories, their mismatch."""
    model = distributed.shard(make_fp32_model(), dtype, cfg.model.fsdp_unit)
    sampler = PolicySampler(model, cfg.sampling, dtype=dtype)
    sampler.refresh(model)  # the weight sync: masters rounded to dtype, as every GRPO step
    t0 = time.time()
    trajs = sample(sampler)
    out = mismatch(trajs, model, cfg, device)
    out["seconds"] = time.time() - t0
    del model, sampler, trajs
    gc.collect()  # FSDP2's hooks hold reference cycles: a 0.5B model per dtype would otherwise stay (OOM at 11 GB)
    return out


def report(name: str, results: dict) -> float:
    for dt, m in results.items():
        print(f"{name} {dt:9s} kl_k3 {m['kl_k3']:.3e}  abs_mean {m['abs_mean']:.3e}  abs_max {m['abs_max']:.3e}  "
              f"({m['tokens']} tokens, {m['seconds']:.1f} s)")
    ratio = results["float16"]["abs_mean"] / max(results["bfloat16"]["abs_mean"], 1e-30)
    kl_ratio = results["float16"]["kl_k3"] / max(results["bfloat16"]["kl_k3"], 1e-30)
    print(f"{name}: fp16/bf16 abs_mean {ratio:.3f}, kl_k3 {kl_ratio:.3f}")
    return ratio


def warm_start_part(path: str, cfg, device, prompts: int) -> dict:
    """(a): the warm start sampled on `prompts` training prompts x grpo.group_size, per dtype."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    examples = dataset.load_examples(cfg.data.train_path, cfg.data.db_root, prompts)
    out = {}
    for name, dtype in DTYPES.items():
        out[name] = run_dtype(lambda: Transformer.from_pretrained(path, dtype=torch.float32, device=device), dtype,
                              cfg, device, lambda s: [e.trajectory for e in sample_episodes(
                                  s, tok, examples, cfg, n=cfg.grpo.group_size, seed=1234)])
    return out


def random_part(shape: dict, cfg, device, seqs: int, prompt_len: int, new_tokens: int) -> dict:
    """(b): a random model of `shape`, `seqs` random prompts decoded `new_tokens` tokens at T = 1."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, shape["vocab_size"], (prompt_len,), generator=g).tolist() for _ in range(seqs)]
    s = cfg.sampling
    s.temperature, s.top_p, s.max_new_tokens, s.max_context = 1.0, 1.0, new_tokens, prompt_len + new_tokens
    s.kv_budget_tokens = seqs * (prompt_len + new_tokens) + 4 * s.block_size
    out = {}
    for name, dtype in DTYPES.items():
        out[name] = run_dtype(lambda: random_model(shape, device), dtype, cfg, device,
                              lambda sp: generate(sp.model, prompts, s, [], None, seed=7, eos=[], dtype=dtype))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", default="", help="the warm start's HF folder (e.g. runs/tiny/ckpt_000000/hf)")
    ap.add_argument("--config", default="configs/tiny.yaml", help="its recipe: data, sampling, packing")
    ap.add_argument("--prompts", type=int, default=32, help="(a) training prompts, x grpo.group_size episodes")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES), help="(b) the random model's shape")
    ap.add_argument("--seqs", type=int, default=4, help="(b) random prompts")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--parts", default="warm,random", help="which models: warm, random or both")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: a tiny warm start built in a temporary "
                                                         "folder, the smoke shape for (b)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    _, _, device = distributed.setup_dist(600)
    cfg = C.load_config([a.config])
    tmp = None
    if a.smoke:  # a tiny random "warm start" and the toy set in a temporary folder
        tmp = tempfile.TemporaryDirectory()
        d = tmp.name
        cfg = C.load_config([a.config, f"--data.train_path={d}/toy/train.jsonl", f"--data.eval_path={d}/toy/eval.jsonl",
                             f"--data.db_root={d}/toy", f"--model.path={d}/model", "--model.tiny_hidden_size=32",
                             "--model.tiny_layers=1", "--model.tiny_heads=2", "--model.tiny_kv_heads=1",
                             "--model.tiny_intermediate_size=64", "--model.tiny_vocab_size=400",
                             "--sampling.max_new_tokens=16", "--grpo.group_size=2"])
        tiny.prepare_assets(cfg, Transformer, sft.gold_texts)
        a.warm, a.prompts, a.shape, a.seqs, a.new_tokens = cfg.model.path, 4, "smoke", 2, 8
    parts = a.parts.split(",")
    if "warm" in parts and not a.warm:
        sys.exit("--warm: a warm start's HF folder is needed, e.g. runs/tiny/ckpt_000000/hf after "
                 "`torchrun --standalone --nproc_per_node=2 train.py configs/tiny.yaml --train.steps=0` (or --smoke)")
    ratios = {}
    if "warm" in parts:
        print(f"(a) warm start {a.warm}: {a.prompts} prompts x {cfg.grpo.group_size}, T {cfg.sampling.temperature}")
        ratios["warm"] = report("warm", warm_start_part(a.warm, cfg, device, a.prompts))
    if "random" in parts:
        print(f"(b) random {a.shape}: {a.seqs} prompts of {a.prompt_len} tokens + {a.new_tokens} sampled, T 1")
        ratios["random"] = report(f"random_{a.shape}", random_part(SHAPES[a.shape], cfg, device, a.seqs,
                                                                   a.prompt_len, a.new_tokens))
    for name, ratio in ratios.items():
        print(f"mismatch_abs_mean_fp16_over_bf16_{name}: {ratio:.4f}")
    print(f"mismatch_abs_mean_fp16_over_bf16: {max(ratios.values()):.4f}")  # the worse model; goal <= 0.2 on each
    distributed.close()
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
