"""The policy's sampler for a whole run: an inference copy of the weights and one engine, kept.

    sampler = PolicySampler(model, sampling_cfg, dtype=torch.bfloat16)  # model: the trained one
    sampler.refresh(model)                     # after every optimizer step: weights copied in place
    episodes = rollout.sample_episodes(sampler, tok, examples, cfg, n=5, seed=step)   # its model and engine
    sampler = PolicySampler.for_model(Transformer.from_pretrained(hf_folder), sampling_cfg, dtype=...)  # eval.py

The trained model is FSDP2-sharded (fp32 masters, maybe LoRA adapters); sampling on it would
gather every unit for the rollout and rebuild the engine (KV pool, buffers, CUDA graphs) each
time. The sampler instead keeps a plain model.Transformer in the compute dtype (no FSDP2 hooks,
so CUDA graphs are captured on it once per (batch, blocks) bucket for the run) and one
engine.Engine whose KV pool holds sampling.kv_budget_tokens tokens, allocated once; every rollout
resets the engine's scheduler and blocks and reuses the rest.

refresh() is the one unshard-and-merge path: it gathers the FSDP2 units one at a time (root, then
each block: the peak is one unit gathered on top of the copy), folds LoRA adapters into their
base weights (lora.merged_weight: W + scaling B A in fp32, rounded to W's dtype once) and copies
into the copy's parameters in place (their addresses, which captured graphs read, never change).
A model without FSDP2 is copied the same way. The trained model is never changed.

Memory: one compute-dtype copy of the weights per rank (7B in bf16: ~15 GB) on top of the
trainer's shards, plus the KV pool (sampling.kv_budget_tokens x the model's KV bytes per token).
Tests: .venv/bin/pytest tests/test_policy_sampler.py
"""
from __future__ import annotations

import dataclasses

import torch

from engine.engine import Engine
from engine.sampling import SamplingParams, StopChecker
from trainer import lora, memory
from trainer.distributed import fsdp_modules, unsharded_class


class PolicySampler:
    def __init__(self, model, cfg, *, dtype: torch.dtype | None = None, device=None):
        """model: the trained model (FSDP2 or plain, LoRA or not): its config, buffers and weights
        (call refresh before sampling). cfg: config.SamplingConfig (its block size and KV budget
        size the pool; auto, unsized by the caller, is sized here: see _pool_tokens). dtype: the
        compute dtype (default: the model's first parameter's)."""
        first = next(model.parameters())
        device = torch.device(device) if device is not None else _local(first).device
        dtype = dtype or first.dtype
        with torch.device("meta"):
            copy = unsharded_class(model)(model.config)  # model.Transformer, without FSDP2's hooks
        copy = copy.to_empty(device=device)
        if model.config.tie_word_embeddings:  # to_empty gives each module its own tensor: tie again
            copy.lm_head.weight = copy.embed_tokens.weight
        for p in copy.parameters():
            p.data = p.data.to(dtype)
        copy.fp32_lm_head = getattr(model, "fp32_lm_head", False)
        self._keep(copy, cfg, dtype)
        self.refreshed = False

    @classmethod
    def for_model(cls, model, cfg, *, dtype: torch.dtype) -> "PolicySampler":
        """The sampler of a plain model used as it is (eval.py generate: a checkpoint loaded straight
        into the inference model, in the compute dtype; no trained model to copy from): refresh is
        then never needed."""
        sampler = cls.__new__(cls)
        sampler._keep(model, cfg, dtype)
        sampler.refreshed = True
        sampler._warm_up()
        return sampler

    def _keep(self, model, cfg, dtype):
        """The inference model and its engine, kept for the run."""
        self.device = model.embed_tokens.weight.device
        cfg = dataclasses.replace(cfg, kv_budget_tokens=_pool_tokens(model, cfg, dtype, self.device))
        self.model, self.cfg, self.dtype = model.eval().requires_grad_(False), cfg, dtype
        # the pool: the whole budget, allocated once (an empty stop rule until the first rollout)
        self.engine = Engine(self.model, cfg, StopChecker(None, [], []), worst_case=[cfg.kv_budget_tokens],
                             dtype=dtype)
        self.warm_up_s = 0.0

    def _warm_up(self) -> None:
        """CUDA graphs of a compiled step: compile it (inductor's on-disk cache makes a resumed
        process's compile a load) for the run's sampling and for greedy evals, once the copy holds
        real weights (the warm-up's K/V go to the scratch block, which must stay finite)."""
        graphs = self.engine.runner.graphs
        if graphs is not None and graphs.compiled:
            self.warm_up_s = graphs.warm_up([SamplingParams.of(self.cfg), SamplingParams.of(self.cfg, greedy=True)])

    @torch.no_grad()
    def refresh(self, model) -> None:
        """Copy the trained model's current weights (adapters merged) into the inference copy."""
        dst = dict(self.model.named_parameters())
        for name, buf in self.model.named_buffers():
            buf.copy_(_local(model.get_buffer(name)))
        adapters = {f"{n}.weight": layer for n, layer in lora.lora_layers(model).items()}
        units = fsdp_modules(model)
        prefixes = {m: n for n, m in model.named_modules() if m in units} if units else {model: ""}
        for unit, prefix in prefixes.items():
            own = _own_parameters(unit, prefix, prefixes)
            if units:
                unit.unshard()
            try:
                for name, param in own(unit):
                    if ".lora_A." in name or ".lora_B." in name:
                        continue
                    if name not in dst:
                        raise KeyError(f"refresh: {name} has no parameter in the inference model")
                    value = param.detach()
                    if name in adapters:  # LoRA: W + scale B A, the one merge formula
                        value = lora.merged_weight(value, adapters[name].delta_weight())
                    dst[name].copy_(value)
            finally:
                if units:
                    unit.reshard()
        if not self.refreshed:
            self.refreshed = True
            self._warm_up()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _own_parameters(unit, prefix: str, prefixes: dict):
    """A function giving (full name, parameter) of the unit's own parameters (not those of a
    nested unit), read after unshard (FSDP2 swaps in the gathered tensors)."""
    nested = [p for m, p in prefixes.items() if m is not unit and (prefix == "" or p.startswith(prefix + "."))]
    head = prefix + "." if prefix else ""

    def own(module):
        for name, param in module.named_parameters():
            full = head + name
            if not any(full.startswith(p + ".") for p in nested):
                yield full, param
    return own


# auto with no work given: at most this many tokens (the pool's size before auto existed), within memory
UNSIZED_WORK_TOKENS = 1_000_000


def _pool_tokens(model, cfg, dtype: torch.dtype, device: torch.device) -> int:
    """The pool's size in tokens: cfg.kv_budget_tokens, or for auto (a caller that did not size it,
    as train.py and eval.py do with the whole run's memory in view) kv_memory_fraction of the memory
    available now, capped at UNSIZED_WORK_TOKENS (the sampler does not know its work)."""
    if cfg.kv_budget_tokens != "auto":
        return int(cfg.kv_budget_tokens)
    kv_bytes = memory.kv_bytes_per_token(model.config, dtype)
    return memory.kv_budget(cfg, 0.0, kv_bytes, device, UNSIZED_WORK_TOKENS)
