"""FSDP2 check of a LoRA model on 2 ranks (or 1), launched by tests/test_lora.py.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 tests/lora_dist_check.py

Every rank builds the same Qwen2-shaped Transformer with LoRA on all seven projections (random
B, so every adapter gets a gradient) and the same global batch; each rank takes half the rows.
Reports one `RESULT <case> ... ok|MISMATCH` line per case on rank 0 (conftest.report), exits non-zero
on a mismatch:
- fp32:         fully_shard per block + root; the gathered adapter gradients equal the
                1-process gradient on the whole batch; the frozen base gets none.
- bf16_base:    frozen base in bf16, adapters in fp32 in the same fully_shard groups (FSDP2
                requires one dtype only among the trainable parameters of a group), bf16
                compute / fp32 reduce; grads fp32 on adapters only, close to the fp32
                reference; an AdamW step changes adapters only.
- train_step:   the trainer's own path (distributed.shard, optim.make_optimizer): AdamW holds
                only the adapters, and one step on N ranks gives the 1-process weights (all of
                them: the base does not move).
- checkpoint:   checkpoint.save (adapter/ in PEFT's format + AdamW state) on N ranks, then
                checkpoint.load into a fresh model: identical adapters and moments on every rank.
- merged_fp32, merged_bf16: the sampler's copy refreshed from the sharded model
                (PolicySampler.refresh: units gathered one at a time, adapters merged; fp32, and
                bf16 base and compute) gives the adapter forward's logits, and the sharded model
                is left bit-identical.
"""
import copy
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer import checkpoint  # noqa: E402
from conftest import report  # noqa: E402
import config as C  # noqa: E402
from trainer import distributed  # noqa: E402
from trainer import lora  # noqa: E402
from trainer import optim  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from trainer.policy_sampler import PolicySampler  # noqa: E402

V, B, T = 37, 6, 11


def build():
    torch.manual_seed(0)
    a = ModelArgs(model_type="qwen2", vocab_size=V, hidden_size=24, intermediate_size=40,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=6,
                  tie_word_embeddings=True, qkv_bias=True)
    model = Transformer(a)
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 0.1)
    lora.apply(model, C.ModelConfig(lora_rank=4, lora_alpha=8.0, lora_targets="q,k,v,o,gate,up,down"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    return model


def loss_on(model, ids, rows):
    logp, _ = model(ids[rows, :-1], targets=ids[rows, 1:])
    return -logp.sum() / (B * T)  # global token mean: each rank's share of the same normaliser


def shard(model, mp=None):
    for block in model.layers:
        fully_shard(block, mp_policy=mp or MixedPrecisionPolicy())
    fully_shard(model, mp_policy=mp or MixedPrecisionPolicy())
    return model


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = build()
    ids = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(1))
    rows = torch.arange(B).chunk(world)[rank]
    results = {}

    # 1-process reference on the whole batch
    ref = copy.deepcopy(base)
    loss_on(ref, ids, torch.arange(B)).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    scale = max(g.abs().max().item() for g in ref_grads.values())

    # fp32: adapter grads gathered == reference; no grads on the frozen base
    model = shard(copy.deepcopy(base))
    (loss_on(model, ids, rows) * world).backward()  # FSDP2's reduce-scatter averages over ranks
    diff = max((full(p.grad) - ref_grads[n]).abs().max().item()
               for n, p in model.named_parameters() if p.requires_grad)
    no_base_grads = all(p.grad is None for p in model.parameters() if not p.requires_grad)
    results["fp32"] = (diff <= 1e-6 * max(1.0, scale) and no_base_grads, f"max_grad_diff={diff:.2e}")

    # bf16 base + fp32 adapters in the same groups, bf16 compute / fp32 reduce
    model = copy.deepcopy(base)
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    shard(model, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    (loss_on(model, ids, rows) * world).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    dtypes_ok = (all(g is not None and g.dtype == torch.float32 for g in grads.values())
                 and all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
                 and all(p.dtype == torch.bfloat16 and p.grad is None
                         for p in model.parameters() if not p.requires_grad))
    rel = max((full(g) - ref_grads[n]).norm().item() / ref_grads[n].norm().item() for n, g in grads.items())
    frozen_before = {n: full(p).clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters_before = {n: full(p).clone() for n, p in model.named_parameters() if p.requires_grad}
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2).step()
    stepped = (all(torch.equal(full(p), frozen_before[n]) for n, p in model.named_parameters() if not p.requires_grad)
               and all(not torch.equal(full(p), adapters_before[n])
                       for n, p in model.named_parameters() if p.requires_grad))
    results["bf16_base"] = (dtypes_ok and rel < 0.05 and stepped, f"max_rel_grad_err={rel:.2e}")

    # train_step: the trainer's path (distributed.shard, optim.make_optimizer over the adapters),
    # one AdamW step on this rank's rows == the same step on the whole batch in one process
    o = C.OptimConfig(weight_decay=0.01)
    ref = copy.deepcopy(base)
    ref_opt, _ = optim.make_optimizer(ref, o, 1e-2, 0, 10)
    loss_on(ref, ids, torch.arange(B)).backward()
    ref_opt.step()
    model = distributed.shard(copy.deepcopy(base), torch.float32)
    opt, _ = optim.make_optimizer(model, o, 1e-2, 0, 10)
    only_adapters = len(opt.param_groups[0]["params"]) == sum(p.requires_grad for p in model.parameters())
    (loss_on(model, ids, rows) * world).backward()
    opt.step()
    refp = dict(ref.named_parameters())
    diff = max((full(p) - refp[n]).abs().max().item() for n, p in model.named_parameters())
    results["train_step"] = (diff <= 1e-6 and only_adapters, f"max_weight_diff={diff:.2e}")

    # checkpoint: save the stepped model's adapter/ + AdamW state on N ranks, load into a fresh
    # sharded LoRA model (other random adapters): rank 0 reads, every rank gets its shards
    box = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    cfg = C.Config()
    cfg.model.lora_rank, cfg.model.lora_alpha, cfg.sft.steps = 4, 8.0, 0
    ck = checkpoint.save(box[0], 1, model, opt, None, None, cfg, {"cursor": 0})
    fresh = build()
    with torch.no_grad():
        for n, p in fresh.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)
    fresh = distributed.shard(fresh, torch.float32)
    fresh_opt, _ = optim.make_optimizer(fresh, o, 1e-2, 0, 10)
    checkpoint.load(str(Path(box[0]) / "ckpt_000001"), fresh, fresh_opt, None)
    wd = max((full(p) - full(q)).abs().max().item() for p, q in zip(model.parameters(), fresh.parameters()))
    sd, fsd = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    md = max((full(sd[i][k]) - full(fsd[i][k])).abs().max().item() for i in sd for k in ("exp_avg", "exp_avg_sq"))
    saved = rank != 0 or (Path(ck) / "adapter" / "adapter_model.safetensors").exists()
    results["checkpoint"] = (wd == 0 and md == 0 and saved, f"max_weight_diff={wd:.1e} max_adam_diff={md:.1e}")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(box[0], ignore_errors=True)

    # the sampler's merged copy of the sharded model: same logits, the model untouched (fp32; bf16 base + compute)
    for case, bf16, tol in (("merged_fp32", False, 1e-5), ("merged_bf16", True, 0.1)):
        model = copy.deepcopy(base)
        if bf16:
            for p in model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
        shard(model, MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None)
        local_before = {n: p.to_local().clone() for n, p in model.named_parameters()}
        sampler = PolicySampler(model, C.SamplingConfig(kv_budget_tokens=64),
                                dtype=torch.bfloat16 if bf16 else torch.float32)
        sampler.refresh(model)  # every unit gathered in turn, then resharded
        untouched = all(torch.equal(p.to_local(), local_before[n]) for n, p in model.named_parameters())
        with torch.no_grad():
            want = model(ids[:, :-1]).float()
            got = sampler.model(ids[:, :-1]).float()
            merged_diff = (got - want).abs().max().item()
            sampler.refresh(model)  # again, from the state a forward leaves (the root stays gathered)
            after = model(ids[:, :-1]).float()
        results[case] = (merged_diff <= tol and untouched and torch.equal(after, want),
                         f"merged_vs_adapter={merged_diff:.2e}")

    ok = True
    for case, (good, info) in results.items():
        ok &= good
        if rank == 0:
            report(f"RESULT {case} {info} {'ok' if good else 'MISMATCH'}")
    distributed.close()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
