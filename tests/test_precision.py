"""fp32 master weights with bf16 compute on one rank: the same FSDP2 path as N ranks.

setup_dist() builds a one-rank gloo group in-process (no torchrun, no network), shard() wraps
the fp32 model with a bf16 MixedPrecisionPolicy. A step at lr 1e-6 must move the fp32 weights
by exactly AdamW's step computed by hand from the gradient (bf16 weights could not hold it),
and the weight sync (PolicySampler.refresh) must copy every unit's weights (FSDP2's unshard is not
recursive) and leave the training layout as it found it.

    pytest -q tests/test_precision.py
"""
import pytest
import torch
from torch.distributed.tensor import DTensor

from trainer import distributed
from model import ModelArgs, Transformer


def tiny_transformer(seed=0):
    torch.manual_seed(seed)
    a = ModelArgs(model_type="qwen2", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True, qkv_bias=True)
    return Transformer(a)


def full(p):
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


# -----------------------------------------------------------------------------


def test_bf16_compute_updates_fp32_masters_by_the_adamw_step(one_rank):
    model = distributed.shard(tiny_transformer().to(one_rank), torch.bfloat16)
    names = [n for n, _ in model.named_parameters()]
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters
    lr, eps, wd, b1, b2 = 1e-6, 1e-8, 0.01, 0.9, 0.999
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    seen = []  # the dtype a block's weight has inside forward
    h = model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(next(m.parameters()).dtype))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1)).to(one_rank)
    logp, _ = model(ids[:, :-1], targets=ids[:, 1:], temperature=1.0)
    h.remove()
    assert seen == [torch.bfloat16] and logp.dtype in (torch.bfloat16, torch.float32)
    (-logp.float().mean()).backward()
    before = {n: full(p) for n, p in model.named_parameters()}
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    assert all(g.dtype == torch.float32 for g in grads.values())
    opt.step()
    moved = 0
    for n, p in model.named_parameters():
        g, w = grads[n].double(), before[n].double()
        # AdamW's first step by hand: decay, then m̂ = g, v̂ = g², step = lr·m̂/(√v̂ + eps)
        m_hat, v_hat = (1 - b1) * g / (1 - b1), (1 - b2) * g * g / (1 - b2)
        expected = w * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps)
        got = full(p).double()
        assert p.dtype == torch.float32
        # fp32 arithmetic: within one fp32 ulp of |w| (1.2e-7 near 1), far below the 1e-6 step
        assert ((got - expected).abs() <= 2 ** -23 * w.abs() + 1e-10).all(), n
        moved += int(((got - w).abs() > 5e-7).sum())
    # the step is ~1e-6: a bf16 copy of these weights (spacing ~1e-3 near 0.3) would not have moved
    assert moved > 0.5 * sum(before[n].numel() for n in names)
    w = before["layers.0.mlp.down_proj.weight"] if "layers.0.mlp.down_proj.weight" in before else next(iter(before.values()))
    assert (w.bfloat16().float() == (w - 1e-6).bfloat16().float()).float().mean() > 0.9


@pytest.mark.parametrize("unit", ["block", "model"])
def test_weight_sync_copies_every_unit_then_leaves_the_shards(one_rank, unit):
    """PolicySampler.refresh gathers each FSDP2 unit (root and blocks) in turn: the copy holds the
    bf16 rounding of every fp32 master, and the trained model is back to its fp32 shards with
    the reshard policy it had (the weight sync changes no FSDP2 setting)."""
    from config import SamplingConfig
    from trainer.policy_sampler import PolicySampler
    plain = tiny_transformer()
    want = {n: p.detach().to(torch.bfloat16) for n, p in plain.named_parameters()}
    model = distributed.shard(plain.to(one_rank), torch.bfloat16, unit)
    units = distributed.fsdp_modules(model)
    assert len(units) == (1 + len(model.layers) if unit == "block" else 1)
    groups = [u._get_fsdp_state()._fsdp_param_group for u in units]
    policy = [g.post_forward_mesh_info for g in groups]
    sampler = PolicySampler(model, SamplingConfig(kv_budget_tokens=64, block_size=16), dtype=torch.bfloat16)
    sampler.refresh(model)
    for n, p in sampler.model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p.cpu(), want[n].cpu()), n
    for n, p in model.named_parameters():  # back to the fp32 shards only
        assert isinstance(p, DTensor) and p.dtype == torch.float32, n
    assert [g.post_forward_mesh_info for g in groups] == policy


def test_unknown_fsdp_unit_is_refused(one_rank):
    with pytest.raises(ValueError, match="fsdp_unit"):
        distributed.shard(tiny_transformer().to(one_rank), torch.float32, "layer")


def test_param_count_is_global_under_fsdp2(one_rank):
    plain = tiny_transformer()
    n = sum(p.numel() for p in plain.parameters())
    assert distributed.param_count(distributed.shard(plain.to(one_rank), torch.float32)) == n


def test_peak_memory_per_phase(one_rank):
    mem = distributed.PeakMemory(one_rank)
    with mem.phase("update"):
        x = torch.ones(64, 1024, 1024, device=one_rank)  # 256 MiB
        del x
    with mem.phase("reward"):
        pass
    m = mem.metrics()
    if one_rank.type != "cuda":  # off CUDA: no figures, and nothing breaks
        assert m == {}
        return
    assert m["mem/update_peak_gb"] >= 0.25 > m["mem/reward_peak_gb"] and mem.metrics() == {}
