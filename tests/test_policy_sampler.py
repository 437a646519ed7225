"""policy_sampler.PolicySampler: one inference copy and one engine for a whole run.

- A sampler reused over 3 rollouts, the weights changed and refreshed between them, samples
  exactly (tokens, logprobs, loss masks) what a fresh engine samples on the same weights (CPU fp32).
- Its KV pool and runner are the same tensors/objects in every rollout (allocated once).
- refresh from a LoRA model gives lora.merged_state_dict's weights; from an FSDP2 model on 1 and
  2 ranks (tests/policy_sampler_dist_check.py) the full (merged) weights, the model left sharded.

    .venv/bin/pytest tests/test_policy_sampler.py -q
"""
import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

import config as C
from trainer import lora
from conftest import run_dist_check
from trainer.policy_sampler import PolicySampler
from rollout import rollout, sample_episodes
from test_rollout_share import DATA, db, example, tok_model  # noqa: F401  (fixtures)

SAMPLING = C.SamplingConfig(temperature=0.9, top_p=1.0, top_k=0, max_new_tokens=24, max_context=1024, block_size=4,
                            kv_budget_tokens=8192)


def test_reused_sampler_equals_fresh_engines(tok_model, db):  # noqa: F811
    tok, base = tok_model
    model = copy.deepcopy(base)
    ecfg = C.EnvConfig(max_turns=2, workers=1)
    exs = [example("How many pets are there?"), example("What is the oldest pet?")]
    sampler = PolicySampler(model, SAMPLING, device="cpu")
    pool, runner = sampler.engine.cache.k, sampler.engine.runner
    gen = torch.Generator().manual_seed(1)
    for i in range(3):
        if i:  # an "update": every weight moves
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        sampler.refresh(model)
        got = rollout(sampler.model, tok, exs, ecfg, SAMPLING, DATA, str(db), n=3, seed=i, engine=sampler.engine)
        want = rollout(model, tok, exs, ecfg, SAMPLING, DATA, str(db), n=3, seed=i)
        assert [t.ids for t in got] == [t.ids for t in want]
        assert [t.logprobs for t in got] == [t.logprobs for t in want]
        assert [t.loss_mask for t in got] == [t.loss_mask for t in want]
        assert [t.end_reason for t in got] == [t.end_reason for t in want]
        assert sampler.engine.cache.k is pool and sampler.engine.runner is runner  # allocated once
    assert pool.shape[1] == SAMPLING.kv_budget_tokens // SAMPLING.block_size + 1  # the budget's blocks + scratch


def test_rollout_before_refresh_is_an_error(tok_model, db):  # noqa: F811
    tok, model = tok_model
    cfg = C.Config(env=C.EnvConfig(), data=dataclasses.replace(DATA, db_root=str(db)), sampling=SAMPLING)
    with pytest.raises(RuntimeError, match="refresh"):
        sample_episodes(PolicySampler(model, SAMPLING, device="cpu"), tok, [example("q")], cfg, n=1, seed=0)


def test_refresh_merges_lora(tok_model):  # noqa: F811
    _, base = tok_model
    model = copy.deepcopy(base)
    lora.apply(model, C.ModelConfig(lora_rank=4, lora_alpha=8.0, lora_targets="q,k,v,o,gate,up,down"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    sampler = PolicySampler(model, SAMPLING, device="cpu")
    sampler.refresh(model)
    want, got = lora.merged_state_dict(model), sampler.model.state_dict()
    assert set(want) <= set(got)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not any(torch.equal(got[k], base.state_dict()[k]) for k in want if k.endswith("qkv_proj.weight"))


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("world", [1, 2])
def test_refresh_from_fsdp2(world):
    check = run_dist_check("policy_sampler_dist_check.py", nproc=world, timeout=240)
    assert check.returncode == 0 and check.results.get(0) == ["RESULT plain ok", "RESULT lora ok"], check.why()
