"""trainer/distributed.py's memory estimate on several ranks and the collective device, against
counts by hand. (The process group, FSDP2 and the collectives on 2 ranks: tests/test_grpo_dist.py,
tests/test_precision.py, tests/test_distributed_close.py.)

    .venv/bin/python -m pytest -q tests/test_distributed.py
"""
import pytest
import torch

import config as C
from model import ModelArgs, Transformer
from trainer import distributed, lora, memory

GB = 1024 ** 3
# a Qwen2.5-0.5B-shaped body (tied embeddings): big enough that every part of the estimate is
# far above float rounding, built on the meta device (no memory)
SHAPE = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, head_dim=64)


def meta_model() -> Transformer:
    with torch.device("meta"):
        return Transformer(ModelArgs(**SHAPE))


@pytest.mark.parametrize("dtype, nbytes", [("bfloat16", 2), ("float16", 2), ("float32", 4)])
def test_memory_estimate_shards_the_kl_reference_over_the_ranks_like_the_policy(dtype, nbytes):
    """grpo.kl_beta > 0 keeps a frozen reference on every rank, FSDP2-sharded like the policy (train.py
    shards it): per rank its weights are n x (compute-dtype bytes) / world, as the policy's fp32
    masters are n x 4 / world. On 1 rank both are whole; without the KL term there is none."""
    model = meta_model()
    n = sum(p.numel() for p in model.parameters())
    cfg = C.load_config([f"--model.dtype={dtype}", "--grpo.kl_beta=0.05"])
    no_kl = C.load_config([f"--model.dtype={dtype}", "--grpo.kl_beta=0"])
    for world in (1, 2, 4, 8):
        est = memory.memory_estimate(model, cfg, world)
        assert est["ref_weights"] == pytest.approx(nbytes * n / world / GB, rel=1e-12), (world, est)
        assert est["params"] == pytest.approx(4 * n / world / GB, rel=1e-12)
        without = memory.memory_estimate(model, no_kl, world)
        assert without["ref_weights"] == 0.0
        assert est["resident"] - without["resident"] == pytest.approx(est["ref_weights"], rel=1e-9)
        assert est["total"] == max(est["rollout"], est["update"])


def test_memory_estimate_of_a_lora_reference_is_the_base_sharded():
    """Under LoRA the reference is the frozen base without adapters (train.py: the base itself, every
    adapter starting at B = 0), sharded over the ranks in the compute dtype."""
    model = meta_model()
    n = sum(p.numel() for p in model.parameters())
    cfg = C.load_config(["--model.dtype=bfloat16", "--grpo.kl_beta=0.05", "--model.lora_rank=8"])
    lora.apply(model, cfg.model)
    assert sum(p.numel() for p in model.parameters()) > n  # the adapters
    for world in (1, 4):
        assert memory.memory_estimate(model, cfg, world)["ref_weights"] == pytest.approx(2 * n / world / GB,
                                                                                           rel=1e-12)


def test_the_collective_device_is_where_the_backend_reduces():
    """gloo reduces CPU tensors, NCCL the current CUDA device's: a tensor on collective_device()
    all-reduces on the group there is (the in-process one-rank group: gloo on a CPU machine)."""
    distributed.setup_dist(60)
    device = distributed.collective_device()
    flag = torch.ones(1, device=device)
    torch.distributed.all_reduce(flag)
    assert flag.item() == 1.0
    if torch.distributed.get_backend() == "gloo":
        assert device == torch.device("cpu")
