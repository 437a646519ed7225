"""Distributed plumbing for train.py and eval.py: the process group, FSDP2 sharding, unsharding
the policy around a rollout, the few collectives the loop needs, and the per-device memory estimate.

One code path on every world size: without torchrun, setup_dist() builds a one-rank process group
in-process, and the model is always FSDP2-sharded (fp32 masters, model.dtype compute, fp32 grad
reduce). CPU uses gloo, CUDA nccl (FSDP2 works on CPU; FSDP1 does not).

    from trainer.distributed import close, compute_dtype, setup_dist, shard
    rank, world, device = setup_dist(cfg.train.dist_timeout_s)   # torchrun or plain python
    model = shard(fp32_model, compute_dtype(cfg), cfg.model.fsdp_unit)  # FSDP2 units: model.fsdp_unit
    ...
    close()                                    # last, on every rank

Costs under FSDP2 (measured by reading torch 2.13's fully_shard): with model.fsdp_unit=block a
training micro-batch all-gathers the root (embeddings, norm, lm_head) once (the root is not
resharded between forward and backward) and each block twice (forward, then again in backward);
with fsdp_unit=model the whole model once. The weight sync (policy_sampler.PolicySampler.refresh)
gathers one unit at a time into the sampler's copy.

Tests: pytest tests/test_precision.py tests/test_grpo_dist.py tests/test_train.py
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn


# -----------------------------------------------------------------------------
# process group


def setup_dist(timeout_s: float = 7200.0) -> tuple[int, int, torch.device]:
    """-> (rank, world, device). Always leaves a process group: torchrun's (RANK set), or a
    one-rank group built in-process (a HashStore, no network), so FSDP2 and its fp32-master /
    compute-dtype policy run the same on 1 rank as on N.

    timeout_s bounds every collective: one rank can wait that long at a barrier while another
    generates (a 7B multi-turn generate phase took ~1350 s in SkyRL-SQL reproductions) or writes
    a checkpoint. CUDA: the device is set before init_process_group and passed as device_id, so
    NCCL binds each rank to its own GPU (no rank-0 context on every process)."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if local_rank >= torch.cuda.device_count():  # CUDA's own error here is "invalid device ordinal"
            raise RuntimeError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible on this "
                               "node; use --nproc_per_node <= the GPU count, or CUDA_VISIBLE_DEVICES= for CPU ranks")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kw = {"timeout": datetime.timedelta(seconds=timeout_s)}
        if device.type == "cuda":
            kw["device_id"] = device
        if "RANK" in os.environ:
            dist.init_process_group(backend, **kw)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    return dist.get_rank(), dist.get_world_size(), device


def close(drain_timeout_s: float = 10.0) -> None:
    """End the process group so that every rank exits 0. Call it last, on every rank.

    A gloo worker thread lets go of a collective's tensors just after the collective has returned
    on the main thread, and letting go takes the GIL (the tensor's Python object is released with
    it). If the interpreter is already shutting down at that moment, Python ends the thread inside
    C++ and the process aborts (SIGABRT, "terminate called without an active exception") after a
    run that succeeded: 7 of 40 runs of a 2-rank test did, 1 of 60 with a barrier before the
    destroy. So the last collective is a sum on a tensor held here, and close() waits (sleeping,
    GIL released) until the worker holds no reference to it: 0 of 120 runs aborted. NCCL keeps
    its tensors on a watchdog thread that destroy_process_group shuts down itself."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        token = torch.zeros(1)
        dist.all_reduce(token)
        deadline = time.monotonic() + drain_timeout_s
        while token._use_count() > 1 and time.monotonic() < deadline:  # 1 = only this frame's reference
            time.sleep(0.001)
    else:
        dist.barrier()
    dist.destroy_process_group()


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor must live for a collective of the process group: gloo reduces CPU tensors,
    NCCL CUDA ones (this rank's current device). The one place that choice is made (the loss
    scaler's non-finite-loss flag, grpo.global_norm's token count)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(cfg: "config.Config") -> torch.dtype:
    """model.dtype is the compute dtype (trainer, reference, sampler); master weights, reduced
    gradients and AdamW states stay fp32. float16 also needs loss scaling (trainer/loss_scale.py)."""
    return COMPUTE_DTYPES[cfg.model.dtype]


def param_count(model: nn.Module) -> int:
    """Parameters of the whole model: under FSDP2 p.numel() of a DTensor is already the global
    count (not the local shard), so no ×world."""
    return sum(p.numel() for p in model.parameters())


# -----------------------------------------------------------------------------
# collectives (identity on one rank)


def all_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def map_shared(fn: Callable[[list], list], items: list, rank: int, world: int) -> list:
    """fn(items) -> one result per item, computed by the ranks together: each runs fn on its share
    (every world-th item from its rank); the results are all-gathered, so every rank returns the
    whole list, in item order (e.g. the data's gold check: each rank runs a share of the golds)."""
    if world == 1:
        return fn(items)
    mine = list(range(rank, len(items), world))
    out = [None] * len(items)
    for i, result in all_gather_list(list(zip(mine, fn([items[i] for i in mine])))):
        out[i] = result
    return out


def all_max(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.long, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_gather_list(xs: list) -> list:
    """Concatenate a python list over ranks, in rank order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(xs)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, xs)
    return [x for part in out for x in part]


# -----------------------------------------------------------------------------
# FSDP2


def shard(model: nn.Module, dtype: torch.dtype, unit: str = "block") -> nn.Module:
    """fully_shard the model on every world size (1 rank included): unit "block" makes each block
    its own FSDP2 unit, then the root (embeddings, final norm, lm_head); "model" makes the whole
    model one unit (config model.fsdp_unit says when each pays).

    The model must be loaded in fp32: those are the master weights (sharded, what AdamW updates).
    MixedPrecisionPolicy all-gathers them cast to `dtype` for forward/backward and reduce-scatters
    gradients in fp32, so bf16 compute never rounds an update of lr·step ≪ bf16's 2^-8 away (fp16:
    the same, and its gradients arrive multiplied by the loss scale, unscaled in fp32 by optim).
    Either unit shards every parameter on dim 0 over the ranks: same shards, same checkpoints.

    Frozen parameters (a LoRA base, requires_grad False) are cast to `dtype` here: they are never
    updated, so they need no fp32 master (half the memory in bf16). FSDP2 shards them in the same
    groups as the fp32 adapters: it needs one dtype only among a group's trainable parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if unit not in ("block", "model"):
        raise ValueError(f"model.fsdp_unit={unit!r}: expected block or model")
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad), \
        "load the model in fp32 (masters)"
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(dtype)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if unit == "block":
        for block in model.layers:
            fully_shard(block, mp_policy=mp)
    # the root is never resharded after forward: FSDP2 keeps a root's parameters gathered from
    # forward to backward (it would re-gather them at once), so a micro-batch costs one root
    # all-gather + one per block in forward, one per block in backward ("model": one all-gather).
    fully_shard(model, mp_policy=mp)
    return model


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units of a model, root first (empty when not sharded)."""
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def unsharded_class(model: nn.Module) -> type:
    """The model's own class: fully_shard swaps a sharded module's class for FSDP<Class>, a subclass
    of (FSDPModule, Class); a plain model's is its type."""
    from torch.distributed.fsdp import FSDPModule
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


# -----------------------------------------------------------------------------
# micro-batch passes: every rank runs as many as the rank with the most


def each_micro_batch(model: nn.Module, mbs: list, device: torch.device, *, backward: bool) -> Iterator:
    """Yield this rank's micro-batches in order; where another rank has more, run a dummy pass
    instead (FSDP2's collectives must match across ranks): forward only when the caller scores
    without gradients (backward=False), forward + zero backward when it accumulates a loss. The
    one accumulation loop of the update, old/ref logprobs and the SFT loss."""
    n = all_max(len(mbs), device)
    for mb in mbs:
        yield mb
    for _ in range(n - len(mbs)):
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)  # one token predicting another
        if backward:  # a zero-weight forward/backward: this rank's FSDP2 collectives in step with the others
            lp, _ = model(ids[:, :-1], ids[:, 1:])
            (lp * 0).sum().backward()
        else:
            model(ids)


class PeakMemory:
    """Peak CUDA memory per phase of a step (GB), reset at each phase's start, for comparing a
    GPU run with memory.memory_estimate(). Every phase() is a no-op off CUDA (peaks stays empty)."""

    def __init__(self, device: torch.device):
        self.device, self.peaks, self.starts = device, {}, {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        start = torch.cuda.memory_allocated(self.device) / 1024 ** 3
        try:
            yield
        finally:
            gb = torch.cuda.max_memory_allocated(self.device) / 1024 ** 3
            self.peaks[name] = max(self.peaks.get(name, 0.0), gb)
            self.starts[name] = max(self.starts.get(name, 0.0), start)

    def metrics(self) -> dict:
        """{"mem/<phase>_peak_gb": GB, "mem/<phase>_start_gb": GB allocated when it began} since the
        last call (then cleared): the start is what stays resident, the peak what the phase adds."""
        out = {f"mem/{k}_peak_gb": v for k, v in self.peaks.items()}
        out.update({f"mem/{k}_start_gb": v for k, v in self.starts.items()})
        self.peaks, self.starts = {}, {}
        return out


