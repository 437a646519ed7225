"""The rollout phase of a GRPO step against transformers `generate` on the same token counts.

    python bench/rollout_vs_generate.py configs/tiny.yaml --model.path=runs/gpu_grpo/ckpt_000004/hf [...]
    python bench/rollout_vs_generate.py configs/tiny.yaml --smoke     # CPU check: few prompts and tokens

Ours: one multi-turn rollout of grpo.prompts_per_step training prompts x grpo.group_size samples
on a PolicySampler, as train.py runs it (SQL tool calls, observations appended, the sampler's
graphs captured in a first rollout outside the timing). Theirs: for each turn k, one
`generate` call with as many rows as episodes reached turn k, prompts as long as those episodes'
mean context at turn k (random ids: no tool, no observations), and as many new tokens as the
longest turn k sampled (generate runs every row that long; min_new_tokens forces it). That is a
lower bound on what `generate` would need for the same episodes (it gets the tool calls and
the prefix sharing for free), so the ratio is conservative.
Headline: rollout_speedup_vs_generate (generate seconds / our rollout seconds).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config as C  # noqa: E402
from sqltask import dataset  # noqa: E402
from toy import tiny  # noqa: E402
from trainer.distributed import compute_dtype  # noqa: E402
from model import Transformer  # noqa: E402
import rollout as rollout_module  # noqa: E402
import sft  # noqa: E402
from trainer.policy_sampler import PolicySampler  # noqa: E402


def turn_shapes(trajs) -> list[tuple[int, float, int]]:
    """Per turn k: (episodes that reached it, their mean context length at its start, the most
    tokens any of them sampled in it)."""
    shapes = []
    for k in range(max(len(t.turn_spans) for t in trajs)):
        spans = [t.turn_spans[k] for t in trajs if len(t.turn_spans) > k]
        shapes.append((len(spans), statistics.mean(s for s, _ in spans), max(e - s for s, e in spans)))
    return shapes


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    smoke = "--smoke" in argv
    argv = [a for a in argv if a != "--smoke"]
    if smoke:  # few prompts and tokens, fp32 (the model: model.path, built on the toy set if absent)
        argv += ["--grpo.prompts_per_step=2", "--grpo.group_size=2", "--sampling.max_new_tokens=8",
                 "--model.dtype=float32", "--sampling.kv_budget_tokens=20000"]
    cfg = C.load_config(argv)
    tiny.prepare_assets(cfg, Transformer, sft.gold_texts)  # the toy set (and a tiny model) when the config asks and they are absent
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = compute_dtype(cfg)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    examples = dataset.load_examples(cfg.data.train_path, cfg.data.db_root, cfg.grpo.prompts_per_step)
    model = Transformer.from_pretrained(cfg.model.path, dtype=torch.float32, device=device)
    sampler = PolicySampler(model, cfg.sampling, dtype=dtype)
    sampler.refresh(model)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def ours(seed):
        sync()
        t0 = time.perf_counter()
        trajs = rollout_module.rollout(sampler.model, tok, examples, cfg.env, cfg.sampling, cfg.data, cfg.data.db_root,
                                       n=cfg.grpo.group_size, seed=seed, engine=sampler.engine)
        sync()
        return trajs, time.perf_counter() - t0

    ours(0)  # graphs captured, flex compiled
    trajs, t_ours = ours(1)
    shapes = turn_shapes(trajs)
    sampled = sum(int(sum(t.loss_mask)) for t in trajs)
    del sampler
    hf = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype).to(device).eval()
    g = torch.Generator().manual_seed(0)

    def theirs():
        total = 0.0
        for rows, context, new in shapes:
            ids = torch.randint(5, hf.config.vocab_size, (rows, max(1, round(context))), generator=g).to(device)
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=cfg.sampling.temperature,
                            top_p=cfg.sampling.top_p, top_k=0, max_new_tokens=new, min_new_tokens=new,
                            pad_token_id=0, eos_token_id=None)
            sync()
            total += time.perf_counter() - t0
        return total

    theirs()  # warm-up
    t_theirs = theirs()
    print(f"{len(trajs)} episodes, {sampled} sampled tokens; per turn (rows, mean context, longest turn): "
          + ", ".join(f"({r}, {c:.0f}, {n})" for r, c, n in shapes))
    print(f"ours (PolicySampler.rollout, tool calls included) {t_ours:.2f} s = {sampled / t_ours:.0f} tok/s; "
          f"transformers generate on the same turn shapes {t_theirs:.2f} s")
    print(f"rollout_speedup_vs_generate: {t_theirs / t_ours:.2f}")


if __name__ == "__main__":
    main()
