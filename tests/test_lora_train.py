"""LoRA through the trainer: train.update on an FSDP2 LoRA model with merged-weight rollouts
moves only the adapters (the base stays bit-identical, AdamW holds nothing else), and its
checkpoint's adapter/ loads in PEFT with our logits; model.lora_dropout changes the update's
loss but not old-logprob scoring; a train.py LoRA run that learns, with dropout, resumes exactly
from ckpt_<step>/adapter. The 2-rank step equality is tests/lora_dist_check.py's `train_step` case
(run by tests/test_lora.py).

    .venv/bin/python -m pytest -q tests/test_lora_train.py
"""
import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from trainer import checkpoint
import config as C
from trainer import distributed
import grpo
from trainer import lora
from trainer import optim
from trainer import packing
import rollout
from toy import tiny
from conftest import grpo_update
from model import Transformer
from trainer.policy_sampler import PolicySampler
from test_train import assert_resumed_steps_learn_alike, learning_args, run_train

PEFT_MISSING = "peft not installed (pip install peft: a test-only dependency, see requirements-dev.txt)"


# -----------------------------------------------------------------------------
# in process: train.update on a sharded LoRA model


def test_lora_update_trains_only_adapters(tmp_path):
    """A few GRPO updates through train.update (reward = fraction of sampled tokens in the lower
    half of the vocabulary: dense, so every group has a signal), rollouts on the sampler's copy
    with the adapters merged (PolicySampler.refresh, as train.py): every adapter B moves, the base stays bit-identical,
    AdamW holds exactly the adapters, and the policy's logits move away from the base's.
    (A random tiny base's logits barely depend on its hidden state, so a reward rise is not
    asserted here: README's LoRA section has the held-out EX gain on the warm-started model.)"""
    tiny.build_tiny(Transformer, str(tmp_path), None, vocab_size=300, hidden_size=32, layers=1, heads=2, kv_heads=1, seed=0)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    distributed.setup_dist()
    torch.manual_seed(0)
    cfg = C.load_config(["--sampling.temperature=1.0", "--sampling.top_p=1.0", "--sampling.max_new_tokens=6",
                         "--optim.lr=0.03", "--optim.grad_clip=1.0", "--optim.weight_decay=0.0",
                         "--grpo.group_size=8", "--model.lora_rank=8", "--model.lora_alpha=16"])
    model = Transformer.from_pretrained(str(tmp_path))
    lora.apply(model, cfg.model)
    model = distributed.shard(model, torch.float32)
    opt, sch = optim.make_optimizer(model, cfg.optim, cfg.optim.lr, 0, 100)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in adapters.values()}
    base_before = {n: p.to_local().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters_before = {n: p.to_local().clone() for n, p in adapters.items()}
    prompt = tok.encode("<|im_start|>user\nsay a<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        logits_before = model(ids)
    G, P = cfg.grpo.group_size, 4
    sampler = PolicySampler(model, dataclasses.replace(cfg.sampling, kv_budget_tokens=4096))
    for step in range(4):
        sampler.refresh(model)  # weight sync, as train.py: adapters merged into the sampler's copy
        trajs = rollout.generate(sampler.model, [prompt] * (P * G), cfg.sampling, [], tok, seed=step, eos=[])
        r = torch.tensor([sum(int(i < 150) for i, m in zip(t.ids, t.loss_mask) if m) / max(1, sum(t.loss_mask))
                          for t in trajs])
        model.train()
        m = grpo_update(model, None, opt, sch, trajs, grpo.advantages(r, G, "group"), cfg)
        assert m["grad_norms"][0] > 0
    assert all(torch.equal(p.to_local(), base_before[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert all(not torch.equal(p.to_local(), adapters_before[n]) for n, p in adapters.items() if ".lora_B." in n)
    with torch.no_grad():
        assert (model(ids) - logits_before).abs().max() > 1e-4

    # checkpoint.save of the sharded model: ckpt/adapter in PEFT's format gives our logits
    cfg = C.load_config([f"--model.path={tmp_path}", "--sft.steps=0", "--model.lora_rank=8",
                         "--model.lora_alpha=16", f"--train.out_dir={tmp_path / 'run'}"])
    ck = Path(checkpoint.save(cfg.train.out_dir, 1, model, opt, sch, tok, cfg, {"cursor": 0}))
    assert not (ck / "hf").exists()  # the base is not saved again (no lora_save_merged)
    with torch.no_grad():
        want = model(ids)
    ours = Transformer.from_pretrained(str(tmp_path))
    lora.apply(ours, cfg.model)
    lora.load_adapter(ours, ck / "adapter")
    with torch.no_grad():
        assert (ours(ids) - want).abs().max() <= 1e-5
    peft = pytest.importorskip("peft", reason=PEFT_MISSING)
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(base, str(ck / "adapter")).eval()(ids).logits
    assert (got - want).abs().max() <= 1e-4


def dropout_update(tmp_path, dropout: float, monkeypatch):
    """One rollout batch (fixed trajectories and advantages) through train.update with 2
    mini-batches on a sharded LoRA model with model.lora_dropout = dropout, seeded. Returns
    (the adapters after, [(grad enabled, model.training) at every packing.forward call])."""
    if not (tmp_path / "config.json").exists():
        tiny.build_tiny(Transformer, str(tmp_path), None, vocab_size=300, hidden_size=32, layers=1, heads=2, kv_heads=1, seed=0)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    distributed.setup_dist()
    cfg = C.load_config(["--sampling.temperature=1.0", "--sampling.top_p=1.0", "--sampling.max_new_tokens=6",
                         "--optim.lr=0.03", "--optim.weight_decay=0.0", "--grpo.group_size=4",
                         "--grpo.mini_batches=2", "--model.lora_rank=8", "--model.lora_alpha=16",
                         f"--model.lora_dropout={dropout}"])
    torch.manual_seed(0)
    model = Transformer.from_pretrained(str(tmp_path))
    lora.apply(model, cfg.model)  # same seed: the same A whatever the dropout
    model = distributed.shard(model, torch.float32)
    opt, sch = optim.make_optimizer(model, cfg.optim, cfg.optim.lr, 0, 100)
    prompt = tok.encode("<|im_start|>user\nsay a<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    sampler = PolicySampler(model, dataclasses.replace(cfg.sampling, kv_budget_tokens=4096))
    sampler.refresh(model)
    trajs = rollout.generate(sampler.model, [prompt] * 8, cfg.sampling, [], tok, seed=0, eos=[])
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)
    modes, real_forward = [], packing.forward

    def recording_forward(model_, *a, **kw):
        modes.append((torch.is_grad_enabled(), model_.training))
        return real_forward(model_, *a, **kw)
    monkeypatch.setattr(packing, "forward", recording_forward)
    torch.manual_seed(1)
    m = grpo_update(model, None, opt, sch, trajs, adv, cfg)
    monkeypatch.undo()
    assert all(g > 0 for g in m["grad_norms"])
    assert not model.training  # the mode it found (from_pretrained: eval) is restored
    return {n: p.full_tensor().clone() for n, p in model.named_parameters() if p.requires_grad}, modes


def test_lora_dropout_changes_the_update_and_old_logprobs_are_scored_without_it(tmp_path, monkeypatch):
    """model.lora_dropout > 0 changes the adapters one update gives (the loss runs in training
    mode), while the old logprobs of a multi-mini-batch update are scored in eval mode: they
    stand for the policy that sampled, which ran without dropout."""
    plain, modes_plain = dropout_update(tmp_path, 0.0, monkeypatch)
    dropped, modes = dropout_update(tmp_path, 0.5, monkeypatch)
    assert plain.keys() == dropped.keys()
    assert any(not torch.equal(plain[n], dropped[n]) for n in plain if ".lora_B." in n)
    assert modes == modes_plain and (False, False) in modes and (True, True) in modes
    assert all(grad == training for grad, training in modes)  # scoring: no grad, eval; loss: grad, train


# -----------------------------------------------------------------------------
# train.py end to end


def lora_args(tmp_path):
    """A LoRA run on a warm-started base that learns (rewards vary within groups), with dropout
    on the adapters: its masks come from the torch RNG that checkpoints save and restore."""
    return learning_args(tmp_path) + ["--model.lora_rank=4", "--model.lora_alpha=8", "--train.steps=4",
                                      "--train.save_every=1", "--train.keep_checkpoints=10", "--grpo.kl_beta=0.01",
                                      "--model.lora_dropout=0.1", "--optim.warmup_steps=3"]


def test_lora_run_resumes_exactly_and_its_adapter_loads_in_peft(tmp_path):
    """4 steps straight vs the same run resumed from its step-2 checkpoint: the adapters (and
    the training metrics) are identical on a run that learns with dropout (grad_norm > 0); the
    base is never rewritten; PEFT on the base + the saved adapter gives our logits, and the
    merged hf/ gives them in plain transformers."""
    args = lora_args(tmp_path) + ["--model.lora_save_merged=true"]
    p = run_train(args, tmp_path / "straight")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    assert "LoRA: rank 4, alpha 8, targets q,k,v,o,gate,up,down" in out and "M trainable" in out, out[-3000:]
    run = tmp_path / "straight"
    ck = run / "ckpt_000004"
    assert sorted(x.name for x in (ck / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    # the optimizer state holds the adapters only
    osd = torch.load(ck / "trainer.pt", weights_only=True)["optimizer"]  # plain data: no object unpickled
    assert osd["state"] and all(".lora_A." in k or ".lora_B." in k for k in osd["state"])

    # resume from step 2 of a copy: identical adapters and per-step metrics after it
    shutil.copytree(run, tmp_path / "resumed")
    for s in (3, 4):
        shutil.rmtree(tmp_path / "resumed" / f"ckpt_{s:06d}")
    base_bytes = (tmp_path / "resumed" / "base" / "model.safetensors").read_bytes()
    p = run_train(args, tmp_path / "resumed")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0 and "resumed from" in out and "at step 2" in out, out[-3000:]
    assert "warm start" not in out  # the base is not trained again on resume
    assert (tmp_path / "resumed" / "base" / "model.safetensors").read_bytes() == base_bytes
    name = "ckpt_000004/adapter/adapter_model.safetensors"
    assert (run / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes()
    assert_resumed_steps_learn_alike(run, tmp_path / "resumed", (3, 4))

    # our model from the base + the saved adapter, against the merged hf/ and PEFT (the
    # adapters were trained: every B moved off 0)
    ours = Transformer.from_pretrained(str(run / "base"))
    lora.apply(ours, C.ModelConfig(lora_rank=4, lora_alpha=8.0))
    lora.load_adapter(ours, ck / "adapter")
    assert all(p.abs().max() > 0 for n, p in ours.named_parameters() if ".lora_B." in n)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        want = ours(ids)
        from transformers import AutoModelForCausalLM
        merged = AutoModelForCausalLM.from_pretrained(str(ck / "hf"), dtype=torch.float32)(ids).logits
    assert (merged - want).abs().max() <= 1e-4
    peft = pytest.importorskip("peft", reason=PEFT_MISSING)
    base = AutoModelForCausalLM.from_pretrained(str(run / "base"), dtype=torch.float32)
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(base, str(ck / "adapter")).eval()(ids).logits
    assert (got - want).abs().max() <= 1e-4
