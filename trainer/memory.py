"""What a run needs against what the device has: the memory left to a rank, the `auto` KV budget,
and the stop of a config that cannot fit, before anything large is allocated.

    sampling_cfg, est = memory.size_kv_pool(model, cfg, world, device, n_eval, log.print)   # train.py, sft.py
    budget = memory.kv_budget(cfg.sampling, still_needed_gb, kv_bytes, device, work_tokens)  # eval.py: tokens
    memory.check_fits(estimate, device, resident_gb)   # ConfigError: one line, the estimate, the memory, the keys

The sampler's KV pool is the one allocation sized by a knob rather than by the model: a pool of
sampling.kv_budget_tokens tokens is allocated whole when the sampler is built (a 135M Llama in
float32 takes 46 KB a token, so a million tokens is 46 GB: a CPU run would meet the kernel's OOM
killer, which prints nothing). `auto` (the default) sizes it as vLLM's gpu_memory_utilization does:
a fraction (sampling.kv_memory_fraction) of the memory left once everything else the run will hold
at its peak is counted (the estimate's other parts: weights, the sampler's copy, AdamW, gradients,
one micro-batch's activations), and never more than the work can use (work_tokens: the rows the run
holds at once x max_context), so a machine with room to spare allocates the same pool as any other
and schedules the same batches. The memory left is, on a GPU, what the driver reports free; on a CPU,
the kernel's MemAvailable (or a cgroup's limit, when lower) shared by the ranks on this host.
A rank's figure is measured after its model is loaded, so what is already resident is not counted
twice. Ranks take the smallest budget of any (a collective), so every rank schedules alike and a
refusal is the same line on every rank.
Tests: .venv/bin/pytest tests/test_memory.py
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainer.config_loader import ConfigError
from trainer.distributed import collective_device, compute_dtype, param_count

GB = 1024 ** 3


def kv_bytes_per_token(arch, dtype: torch.dtype) -> int:
    """K and V of one token over every layer: 2 x layers x kv_heads x head_dim x bytes."""
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * dtype.itemsize


def memory_estimate(model: nn.Module, cfg: "config.Config", world: int) -> dict[str, float]:
    """GB per device of one rank's phases, for the FSDP2 layout used on every world size (one rank
    included). Call it before shard() (it reads the blocks) and, for a LoRA run, after lora.apply.

    Parts: params (fp32 masters sharded over `world`; frozen parameters, a LoRA base, once in the
    compute dtype), grads and adam (fp32, trainable only, sharded), rollout_weights (the sampler's
    full copy in the compute dtype, adapters merged), kv_cache (the sampler's pool: 0 while
    sampling.kv_budget_tokens is auto, kv_budget's figure once resolved), gathered_unit
    (the largest FSDP2 unit all-gathered in the compute dtype: the whole model with
    model.fsdp_unit "model"; with "block" the root, which stays gathered from forward to backward,
    plus one block), unit_grads (that unit's trainable gradients unsharded before the
    reduce-scatter: compute dtype, then fp32), activations (one micro-batch), ref_weights (the
    frozen KL reference when grpo.kl_beta > 0: the base without adapters in the compute dtype,
    sharded; 0 without KL).
    Phases: resident (between phases: gradients are freed after every optimizer step), rollout
    (resident + one unit gathered by sampler.refresh), update (resident + grads + a gathered unit
    + its unsharded gradients + activations); total = the larger peak."""
    n = param_count(model)
    budget = cfg.sampling.kv_budget_tokens
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora_params = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
    arch = model.config  # model.ModelArgs: the shape
    gb = 1024 ** 3
    unsharded_bytes = compute_dtype(cfg).itemsize  # 2 for bfloat16 and float16
    kv_per_tok = kv_bytes_per_token(arch, compute_dtype(cfg))
    # activations of one micro-batch: the block inputs kept by checkpointing (or every block's
    # intermediates without it), plus one block's worth recomputed in backward
    tok = cfg.optim.micro_batch_tokens
    per_block = (4 * arch.hidden_size + 3 * arch.intermediate_size) * unsharded_bytes
    acts = tok * (arch.hidden_size * unsharded_bytes * arch.num_hidden_layers + per_block) \
        if cfg.model.activation_checkpointing else tok * per_block * arch.num_hidden_layers
    # the largest unit: (all params, trainable params) gathered at once
    if cfg.model.fsdp_unit == "model":
        unit, unit_trainable = n, trainable
    else:
        block = list(model.layers[0].parameters())
        blocks_n = len(model.layers) * sum(p.numel() for p in block)
        blocks_trainable = len(model.layers) * sum(p.numel() for p in block if p.requires_grad)
        unit = n - blocks_n + blocks_n // len(model.layers)
        unit_trainable = trainable - blocks_trainable + blocks_trainable // len(model.layers)
    grad_bytes = unsharded_bytes + 4 if unsharded_bytes != 4 else 4  # compute-dtype grads, fp32 for the reduce
    weights = 4 * trainable + unsharded_bytes * (n - trainable)
    est = {"params": weights / world / gb, "grads": 4 * trainable / world / gb, "adam": 8 * trainable / world / gb,
           "rollout_weights": unsharded_bytes * (n - lora_params) / gb,
           "kv_cache": (0 if budget == "auto" else budget) * kv_per_tok / gb,
           "gathered_unit": unsharded_bytes * unit / gb, "unit_grads": grad_bytes * unit_trainable / gb,
           "activations": acts / gb,
           "ref_weights": unsharded_bytes * (n - lora_params) / world / gb if cfg.grpo.kl_beta > 0 else 0.0}
    est["resident"] = est["params"] + est["adam"] + est["rollout_weights"] + est["kv_cache"] + est["ref_weights"]
    est["rollout"] = est["resident"] + est["gathered_unit"]
    est["update"] = est["resident"] + est["grads"] + est["gathered_unit"] + est["unit_grads"] + est["activations"]
    est["total"] = max(est["rollout"], est["update"])
    return est


def _cgroup_room() -> float | None:
    """Bytes this process's cgroup (v2) may still take, or None when unlimited or unknown."""
    base = Path("/sys/fs/cgroup")
    try:
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return float(int(limit) - int((base / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def available_gb(device: torch.device, local_ranks: int | None = None) -> tuple[float, str]:
    """(GB this rank may still allocate, where the figure comes from). CUDA: the device's free memory
    (a GPU per rank). CPU: MemAvailable (capped by a cgroup limit) divided by the ranks on this host
    (torchrun's LOCAL_WORLD_SIZE when local_ranks is None)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free / GB, f"free on {device}"
    ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = float(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:  # not Linux: the physical memory, as the best figure there is
        avail = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    room = _cgroup_room()
    if room is not None:
        avail = min(avail, room)
    where = "available RAM" + (f" / {ranks} ranks on this host" if ranks > 1 else "")
    return avail / ranks / GB, where


def _smallest(value: float) -> float:
    """The smallest of every rank's value (a no-op without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def work_tokens(cfg, world: int, n_eval: int) -> int:
    """The most KV tokens a rank's work can use at once: the most rows it holds together (a GRPO
    round's groups, one more chunk's share when sampling ahead; every held-out question of its
    share in an eval; a warm-start stop check) x sampling.max_context."""
    g = cfg.grpo
    round_rows = -(-g.prompts_per_step // world) * g.group_size * (2 if cfg.stream.sampling_steps_ahead else 1)
    check_rows = -(-cfg.sft.stop_check_questions // world) if cfg.sft.steps and cfg.sft.stop_at_train_ex else 0
    return max(round_rows, -(-n_eval // world), check_rows) * cfg.sampling.max_context


def kv_budget(sampling_cfg, still_needed_gb: float, kv_bytes: int, device: torch.device,
              work_tokens: int, *, available: tuple[float, str] | None = None) -> int:
    """The KV pool's size in tokens: sampling.kv_budget_tokens when it is a number, else (auto)
    kv_memory_fraction x (available - still_needed_gb), in whole blocks, capped at work_tokens.
    still_needed_gb: what the run will still allocate at its peak besides the pool. Raises
    ConfigError when auto leaves less than one sequence of max_context."""
    if sampling_cfg.kv_budget_tokens != "auto":
        return int(sampling_cfg.kv_budget_tokens)
    free_gb, where = available or available_gb(device)
    room_gb = sampling_cfg.kv_memory_fraction * (free_gb - still_needed_gb)
    tokens = int(max(room_gb, 0.0) * GB // kv_bytes)
    block = sampling_cfg.block_size
    work = -(-max(work_tokens, sampling_cfg.max_context) // block) * block  # whole blocks
    tokens = int(_smallest(min(tokens // block * block, work)))
    if tokens < sampling_cfg.max_context:
        raise ConfigError(
            f"sampling.kv_budget_tokens=auto: {free_gb:.1f} GB {where}, {still_needed_gb:.1f} GB of it needed "
            f"besides the KV cache, leaves {max(room_gb, 0):.2f} GB (sampling.kv_memory_fraction="
            f"{sampling_cfg.kv_memory_fraction:g}) for {tokens} tokens at {kv_bytes / 1024:.0f} KB a token, less than "
            f"one sequence of sampling.max_context={sampling_cfg.max_context}: lower sampling.max_context, "
            f"optim.micro_batch_tokens or the model's size, or free memory")
    return tokens


# the keys that shrink each part of memory_estimate, named when a config cannot fit
LOWER = {"kv_cache": "sampling.kv_budget_tokens (or auto)", "activations": "optim.micro_batch_tokens",
         "adam": "model.lora_rank (LoRA) or more ranks", "grads": "model.lora_rank (LoRA) or more ranks",
         "params": "more ranks", "rollout_weights": "model.dtype (bfloat16)", "gathered_unit": "model.fsdp_unit=block",
         "unit_grads": "model.fsdp_unit=block", "ref_weights": "grpo.kl_beta=0 (no reference)"}


def check_fits(estimate: dict[str, float], device: torch.device, resident_gb: float = 0.0,
               *, available: tuple[float, str] | None = None) -> None:
    """ConfigError (one line) when the estimate's peak exceeds what this rank may hold: the memory
    available now plus resident_gb (what the rank already holds of the estimate, e.g. the loaded
    weights). Names the estimate, the memory, and the keys that shrink its largest parts."""
    free_gb, where = available or available_gb(device)
    have = _smallest(free_gb + resident_gb)
    if estimate["total"] <= have:
        return
    parts = sorted((k for k in LOWER if estimate.get(k, 0) > 0), key=lambda k: -estimate[k])[:3]
    biggest = ", ".join(f"{k} {estimate[k]:.1f} GB: {LOWER[k]}" for k in parts)
    raise ConfigError(f"memory: this config needs about {estimate['total']:.1f} GB per rank, {have:.1f} GB is "
                      f"{where} ({device}): lower the largest parts ({biggest})")


def size_kv_pool(model: nn.Module, cfg, world: int, device: torch.device, n_eval: int,
                 say: Callable[[str], None]) -> tuple:
    """A training run's memory, before its sampler is built (train.py; sft.py's LoRA warm start):
    memory_estimate of the loaded model (before shard()), the KV pool resolved when auto, the
    estimate printed, and check_fits. Returns (the sampling config with the pool's size, the
    estimate). n_eval: held-out questions an eval decodes at once (over every rank)."""
    est = memory_estimate(model, cfg, world)
    sampling_cfg = cfg.sampling
    available = available_gb(device)
    resident = param_count(model) * next(model.parameters()).element_size() / GB  # the loaded weights
    if sampling_cfg.kv_budget_tokens == "auto":
        kv_bytes = kv_bytes_per_token(model.config, compute_dtype(cfg))
        # still to allocate at the peak: everything but the (sharded) weights, the pool not yet counted
        tokens = kv_budget(sampling_cfg, est["total"] - est["params"], kv_bytes, device,
                           work_tokens(cfg, world, n_eval), available=available)
        sampling_cfg = dataclasses.replace(sampling_cfg, kv_budget_tokens=tokens)
        est = memory_estimate(model, dataclasses.replace(cfg, sampling=sampling_cfg), world)
        say(f"sampling.kv_budget_tokens=auto: {tokens} tokens ({est['kv_cache']:.2f} GB) of {available[0]:.1f} GB "
            f"{available[1]}")
    say("memory estimate per device (GB): " + ", ".join(f"{k} {v:.2f}" for k, v in est.items()))
    check_fits(est, device, resident, available=available)
    return sampling_cfg, est
