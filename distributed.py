"""Distributed plumbing for train.py and eval.py: the process group, FSDP2 sharding, unsharding
the policy around a rollout, the few collectives the loop needs, and the per-device memory estimate.

Works on one process too (no process group: every collective is the identity). CPU uses gloo,
CUDA uses nccl with bf16 compute / fp32 reduce (GUIDE §5: FSDP2 works on CPU, FSDP1 does not).

    from distributed import setup_dist, shard
    rank, world, device = setup_dist()           # under torchrun or plain python
    model = shard(model, world, device)          # fully_shard each block, then the root

Tests: .venv/bin/pytest tests/test_train.py
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

import config as C
from model import Transformer

def setup_dist():
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, world, device


def all_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def all_max(v: int, device) -> int:
    t = torch.tensor([v], dtype=torch.long, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_gather_list(xs: list) -> list:
    """Concatenate a python list over ranks, in rank order."""
    if not dist.is_initialized():
        return list(xs)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, xs)
    return [x for part in out for x in part]


def shard(model: Transformer, world: int, device):
    """fully_shard each block, then the root. Mixed precision (bf16 compute, fp32 reduce) on GPU."""
    if world == 1:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


@contextlib.contextmanager
def unsharded(model):
    """Gather the full weights once for a whole rollout (no all-gather per decode step)."""
    if not hasattr(model, "unshard"):
        yield
        return
    model.unshard()
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        model.reshard()
        model.set_reshard_after_forward(True)


def memory_estimate(model: Transformer, cfg: C.Config, world: int) -> dict:
    """GB per device: sharded fp32 params + grads + AdamW states, unsharded weights in rollout, KV."""
    n = sum(p.numel() for p in model.parameters())
    a = model.config
    gb = 1024 ** 3
    unsharded_bytes = 2 if cfg.model.dtype == "bfloat16" or torch.cuda.is_available() else 4
    kv_per_tok = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * unsharded_bytes
    # activations of one micro-batch: the block inputs kept by checkpointing (or every block's
    # intermediates without it), plus one block's worth recomputed in backward
    tok, per_block = cfg.optim.micro_batch_tokens, (4 * a.hidden_size + 3 * a.intermediate_size) * unsharded_bytes
    acts = tok * (a.hidden_size * unsharded_bytes * a.num_hidden_layers + per_block) \
        if cfg.model.activation_checkpointing else tok * per_block * a.num_hidden_layers
    est = {"params": 4 * n / world / gb, "grads": 4 * n / world / gb, "adam": 8 * n / world / gb,
           "rollout_weights": unsharded_bytes * n / gb, "kv_cache": cfg.sampling.kv_budget_tokens * kv_per_tok / gb,
           "activations": acts / gb}
    est["total"] = sum(est.values())
    return est
