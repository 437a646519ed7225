"""PolicySampler.refresh from an FSDP2-sharded model on 2 ranks (or 1), launched by
tests/test_policy_sampler.py:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 tests/policy_sampler_dist_check.py

Every rank builds the same Transformer (plain, then with LoRA adapters of random B), keeps the
merged full weights (lora.merged_state_dict before sharding) as the reference, shards it as the
trainer does (distributed.shard, fp32) and refreshes an inference copy unit by unit. Reports
`RESULT <case> ok|MISMATCH` on rank 0 (conftest.report); exits non-zero on a mismatch.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config as C  # noqa: E402
from conftest import report  # noqa: E402
from trainer import distributed  # noqa: E402
from trainer import lora  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from trainer.policy_sampler import PolicySampler  # noqa: E402


def build(with_lora: bool) -> Transformer:
    torch.manual_seed(0)
    a = ModelArgs(model_type="qwen2", vocab_size=37, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=6, tie_word_embeddings=True, qkv_bias=True)
    model = Transformer(a)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    if with_lora:
        lora.apply(model, C.ModelConfig(lora_rank=4, lora_alpha=8.0, lora_targets="q,k,v,o,gate,up,down"))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_B." in n:
                    p.normal_(0, 0.1)
    return model


def check(with_lora: bool) -> bool:
    model = build(with_lora)
    want = {k: v.clone() for k, v in (lora.merged_state_dict(model) if with_lora else model.state_dict()).items()}
    model = distributed.shard(model, torch.float32)
    sampler = PolicySampler(model, C.SamplingConfig(kv_budget_tokens=256, block_size=16), dtype=torch.float32,
                            device="cpu")
    sampler.refresh(model)
    got = sampler.model.state_dict()
    ok = set(got) >= {k for k in want if "rotary" not in k} and all(torch.equal(got[k], want[k]) for k in want if k in got)
    # the sharded model is left sharded (refresh resharded every unit)
    ok &= all(hasattr(p, "to_local") for p in model.parameters())
    return ok


def main():
    dist.init_process_group("gloo")
    bad = False
    for case, with_lora in (("plain", False), ("lora", True)):
        ok = check(with_lora)
        flag = torch.tensor([0 if ok else 1])
        dist.all_reduce(flag)
        bad |= bool(flag.item())
        if dist.get_rank() == 0:
            report(f"RESULT {case} {'ok' if flag.item() == 0 else 'MISMATCH'}")
    distributed.close()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
