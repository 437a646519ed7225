"""2-rank FSDP2 gradient check for grpo.policy_loss (launched by tests/test_grpo_dist.py).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 tests/dist_grad_check.py

Every rank builds the same model (a tiny MLP LM, and model.py's Transformer — Qwen2-shaped,
tied embeddings, chunked checkpointed logprobs — when model.py is present) and global batch. A plain copy computes the
1-process reference gradient on the whole batch; a `fully_shard` copy computes the loss on this
rank's uneven share (different rows and token counts per rank, micro-batches, an all-masked
padding micro-batch), normalised by `global_norm` and scaled by world_size as grpo.py's contract
says. The gathered gradient must match the reference. Reports one `RESULT model=... case=...`
line (conftest.report) per model and case (loss variant, aggregation, rollout correction: CASES) on rank 0; exits
non-zero on a mismatch.
"""
import copy
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer import distributed  # noqa: E402
from conftest import loss_of, report  # noqa: E402
from grpo import AGGS, global_norm  # noqa: E402
from trainer.rollout_correction import RolloutIS  # noqa: E402

# (loss, aggregation, rollout correction): every aggregation for grpo, and each other variant
# with a sequence-level or token-level correction (the sampler's logprobs are noise off old's)
CASES = [("grpo", agg, "none") for agg in AGGS] + [
    ("gspo", "seq-mean-token-mean", "seq-tis"), ("gspo-token", "token-mean", "token-mis"),
    ("cispo", "token-mean", "token-tis")]

V, D, B, T = 37, 24, 10, 12  # odd sizes: FSDP pads uneven shards


class TinyLM(nn.Module):
    """Embedding -> 2 x (Linear + tanh) -> head: per-token logprobs of the next token."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids, targets):  # (B, T), (B, T) -> (B, T) logprobs of targets
        h = self.emb(ids)
        for blk in self.blocks:
            h = h + blk(h)
        # clone: FSDP2 warns when a wrapped module returns a view (in-place ops would skip its hook)
        return torch.log_softmax(self.head(h), -1).gather(-1, targets[..., None])[..., 0].clone()


def build_models():
    """name -> (model, its blocks to shard one by one, fn(model, ids, targets) -> (B, T) logp)."""
    torch.manual_seed(0)
    tiny = TinyLM()
    out = {"tiny": (tiny, lambda m: m.blocks, lambda m, ids, tgt: m(ids, tgt))}
    try:
        from model import ModelArgs, Transformer
    except ImportError:  # model.py not in this checkout: the tiny LM alone
        return out
    a = ModelArgs(model_type="qwen2", vocab_size=V, hidden_size=D, intermediate_size=40,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=6,
                  tie_word_embeddings=True, qkv_bias=True)
    tf = Transformer(a)
    with torch.no_grad():  # HF-like small init (nn.Linear defaults are fine; embeddings too big)
        tf.embed_tokens.weight.normal_(0, 0.1)
    tf.logits_chunk_elems = 4 * V * 5  # several logprob chunks, as for a real vocab
    out["transformer"] = (tf, lambda m: m.layers,
                          lambda m, ids, tgt: m(ids, targets=tgt, temperature=0.7)[0])
    # activation checkpointing recomputes each block in backward, under FSDP2 re-gathering it:
    # the gradients must still equal the 1-process ones
    tf_ckpt = copy.deepcopy(tf)
    tf_ckpt.set_activation_checkpointing(True)
    out["transformer+ckpt"] = (tf_ckpt, lambda m: m.layers,
                               lambda m, ids, tgt: m(ids, targets=tgt, temperature=0.7)[0])
    return out


def global_batch():
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    lens = torch.tensor([12, 3, 7, 1, 12, 5, 9, 2, 11, 6])  # ragged responses
    mask = torch.arange(T)[None] < lens[:, None]
    noise = 0.3 * torch.randn(3, B, T, generator=g)  # old/ref/rollout logprobs = current + noise
    adv = torch.randn(B, generator=g)
    return ids, mask, noise, adv


def loss_on(fwd, model, rows, mask, norm, case, batch):
    ids, _, noise, adv = batch
    loss_name, agg, correction = case
    logp = fwd(model, ids[rows, :-1], ids[rows, 1:])
    old, ref, rollout = (logp.detach() + noise[k, rows] for k in range(3))
    loss, _ = loss_of(logp, old, adv[rows], mask, loss=loss_name, clip_low=0.2, clip_high=0.28,
                      dual_clip_c=0.0 if loss_name == "cispo" else 3.0, ref_logp=ref, kl_beta=0.1,
                      agg=agg, norm=norm, max_len=T, rollout_logp=rollout,
                      rollout_is=RolloutIS(correction, cap=1.5, low=0.8, high=1.25))
    return loss


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "this check splits the batch for exactly 2 ranks"
    models = build_models()
    batch = global_batch()
    mask = batch[1]
    # Uneven split: rank 0 gets rows 0-6 (49 tokens) in 2 micro-batches, rank 1 rows 7-9
    # (19 tokens) plus an all-masked padding micro-batch, so both run 2 forward/backward calls.
    r0, r1, r2, pad = torch.arange(0, 4), torch.arange(4, 7), torch.arange(7, 10), torch.tensor([3])
    mbs = [(r0, mask[r0]), (r1, mask[r1])] if rank == 0 else [(r2, mask[r2]), (pad, mask[pad] & False)]
    ok = True
    for name, (base, blocks, fwd) in models.items():
        for case in CASES:
            agg = case[1]
            # 1-process reference on the whole global batch, normaliser counted by hand
            ref_model = copy.deepcopy(base)
            n_ref = float(mask.sum()) if agg == "token-mean" else float(mask.any(-1).sum())
            ref_loss = loss_on(fwd, ref_model, torch.arange(B), mask, n_ref, case, batch)
            ref_loss.backward()
            ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}

            model = copy.deepcopy(base)
            for blk in blocks(model):
                fully_shard(blk)
            fully_shard(model)
            norm = global_norm([m for _, m in mbs], agg)  # all-reduced over both ranks
            total = torch.zeros(())
            for rows, m in mbs:
                loss = loss_on(fwd, model, rows, m, norm, case, batch)
                (loss * world).backward()  # FSDP2's reduce-scatter averages over ranks
                total += loss.detach()
            dist.all_reduce(total)  # sum of every rank's micro-batch losses = the global loss
            max_diff = max((p.grad.full_tensor() - ref_grads[n]).abs().max().item()
                           for n, p in model.named_parameters())
            scale = max(g.abs().max().item() for g in ref_grads.values())
            # fp32 summation order differs (shards, micro-batches): 1e-6 relative to the scale
            good = (max_diff <= 1e-6 * max(1.0, scale) and norm == n_ref
                    and abs(total.item() - ref_loss.item()) <= 1e-6 * max(1.0, abs(ref_loss.item())))
            ok &= good
            if rank == 0:
                report(f"RESULT model={name} case={'/'.join(case)} norm={norm:g} loss={total.item():.7f} "
                       f"ref_loss={ref_loss.item():.7f} max_grad={scale:.3g} max_grad_diff={max_diff:.2e} "
                       f"{'ok' if good else 'MISMATCH'}")
    distributed.close()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
