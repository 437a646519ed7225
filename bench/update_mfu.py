"""MFU of the real GRPO update at the 7B recipe's shape: what one micro-batch and one optimizer
step of train.update cost, against the FLOPs of the useful work.

The batch: units of one shared prompt and G responses (each response: a sampled turn, an
observation that is context but not loss, a second sampled turn), packed by packing.plan into
rows of `--tokens` (the 7B configs: one 32768-token row per micro-batch). The model: random
weights in the shape of `--shape` (Qwen2.5-7B by default on CUDA, `--layers` of its 28 blocks),
fp32 masters sharded by distributed.shard (FSDP2 on a one-rank mesh), bf16 compute on CUDA
(fp32 on CPU, where bf16 matmuls are emulated and ~50x slower), activation checkpointing, the LM
head only on the loss tokens (`loss_index`), configs/skyrl_sql_7b.yaml's loss and optimizer. A
micro-batch is packing.forward + grpo.policy_loss + backward (packed_attention.for_rows: CUDA,
FlexAttention with packed_attention.block_mask; CPU, per-sequence causal SDPA rows); a step is train.update over
`--micro-batches` rows (forward/backward of each, clip, AdamW).

FLOPs (per multiply-add: 2 in forward, 4 in backward; N = parameters without the input embedding
and the LM head, L layers, H query heads of width D, C hidden, V vocabulary):
  useful   = 6 N tokens + 12 L H D kept_pairs + 6 C V loss_tokens
             tokens: real tokens (no padding); kept_pairs: the (query, key) pairs the mask keeps
  hardware = 8 N width_tokens + 16 L H D kernel_pairs + 8 C V loss_tokens
             the recompute of activation checkpointing (every block and the chunked LM head run
             their forward twice); width_tokens include padding; kernel_pairs: what the kernel
             visits (FlexAttention: its partial and full 128x128 blocks; causal SDPA: T(T+1)/2 a
             row; CPU segment rows: S(S+1)/2 per attention row, S its bucket's length)
`update_mfu` = useful FLOP/s over the peak (`--peak-tflops`; CUDA: the device's dense bf16 spec).
`--compare` times the same micro-batch with a dense causal kernel (SDPA is_causal over the whole
row, no mask: wrong attention across responses, same tokens), interleaved, to say how much of the
gap is the masked kernel. CPU has no stated peak: it prints TFLOP/s, and MFU as nan unless
`--peak-tflops` is given.

    .venv/bin/python bench/update_mfu.py                    # CPU: tiny shape, a smoke run (~1 min)
    python bench/update_mfu.py --device cuda --compare      # 7B shape, 32k rows, layers that fit
    python bench/update_mfu.py --device cuda --layers 28    # all 28 (needs ~20 bytes/param + activations)
    .venv/bin/python bench/update_mfu.py --mask-cost --threads 1   # block_mask vs create_block_mask
    .venv/bin/python bench/update_mfu.py --count-only [--layers 8]   # the 7B micro-batch's FLOP split
"""
import argparse
import contextlib
import os
import random
import statistics
import sys
import time
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
import config as C  # noqa: E402
from trainer import distributed  # noqa: E402
import grpo  # noqa: E402
from trainer import optim  # noqa: E402
from trainer import packed_attention  # noqa: E402
from trainer import packing  # noqa: E402
import train  # noqa: E402
from trainer.loss_scale import LossScaler  # noqa: E402
from long_microbatch import PEAK_BF16_FLOPS, SHAPES  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from rollout import Trajectory  # noqa: E402

BYTES_PER_PARAM = 20  # fp32 master + fp32 grad + two AdamW moments + foreach AdamW's temporaries


# -----------------------------------------------------------------------------
# the batch


def unit(rng: random.Random, vocab: int, prompt: int, group: int, response: int, obs_frac: float) -> list:
    """One prompt's G trajectories (train.update's fields): sampled turn, observation, sampled turn."""
    prompt_ids = [rng.randrange(vocab) for _ in range(prompt)]
    obs = int(response * obs_frac)
    first = (response - obs) // 2
    out = []
    for _ in range(group):
        ids = prompt_ids + [rng.randrange(vocab) for _ in range(response)]
        mask = [0] * prompt + [1] * first + [0] * obs + [1] * (response - first - obs)
        out.append(Trajectory.of(prompt_ids, ids, mask, [-rng.random() if m else 0.0 for m in mask]))
    return out


def make_batch(a, vocab: int, seed: int = 0) -> list:
    """`micro_batches` rows' worth of units: as many units as fit `tokens` per row."""
    per_row = a.tokens // (a.prompt + a.group * a.response)
    if per_row < 1:
        raise SystemExit(f"a unit of {a.prompt} + {a.group} x {a.response} tokens does not fit a {a.tokens}-token row")
    rng = random.Random(seed)
    return [t for _ in range(per_row * a.micro_batches)
            for t in unit(rng, vocab, a.prompt, a.group, a.response, a.obs_frac)]


# -----------------------------------------------------------------------------
# FLOP counting


def kept_pairs(doc: torch.Tensor, seg: torch.Tensor) -> int:
    """(query, key) pairs packing's mask keeps in rows doc, seg (B, T), padding (doc < 0) left out:
    a prompt token sees its prompt up to itself; a response token the whole prompt before it
    and its own response up to itself. O(T), the layout packing.plan makes (prompt first)."""
    B, T = doc.shape
    pos = torch.arange(T).expand(B, T)
    new_doc = torch.ones(B, T, dtype=torch.bool)
    new_doc[:, 1:] = doc[:, 1:] != doc[:, :-1]
    new_run = new_doc.clone()
    new_run[:, 1:] |= seg[:, 1:] != seg[:, :-1]
    doc_start = torch.where(new_doc, pos, 0).cummax(1).values
    run_start = torch.where(new_run, pos, 0).cummax(1).values
    prompt = (seg == 0).long().cumsum(1)  # prompt tokens up to each position (inclusive)
    before_doc = torch.where(doc_start > 0, prompt.gather(1, (doc_start - 1).clamp(min=0)), 0)
    prompt_seen = prompt - before_doc  # its unit's prompt tokens at or before it
    own = torch.where(seg == 0, 0, pos - run_start + 1)
    return int(torch.where(doc >= 0, prompt_seen + own, 0).sum())


def non_embedding_params(model) -> int:
    """Parameters without the input embedding and the LM head (tied or not): the 6N part."""
    skip = {id(model.embed_tokens.weight), id(model.lm_head.weight)}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def flops(a: ModelArgs, n_params: int, tokens: int, loss_tokens: int, pairs: int, recompute: bool) -> float:
    """6 (or 8 with the recompute) x [N tokens + 2 L H D pairs + C V loss_tokens]."""
    k = 8 if recompute else 6
    return k * (n_params * tokens + 2 * a.num_hidden_layers * a.num_attention_heads * a.head_dim * pairs
                + a.hidden_size * a.vocab_size * loss_tokens)


def microbatch_flops(a: ModelArgs, n_params: int, mb, width: int, kernel: str) -> dict:
    """Useful and hardware FLOPs of one micro-batch forwarded at `width` tokens a row.
    kernel: flex (FlexAttention block mask) | causal (SDPA is_causal) | segments (CPU: per-sequence rows)."""
    doc = packing.pad([r.doc for r in mb.rows], -1, "cpu", width=width)
    seg = packing.pad([r.seg for r in mb.rows], 0, "cpu", width=width)
    B = len(mb.rows)
    tokens, loss_tokens, pairs = sum(len(r.ids) for r in mb.rows), sum(mb.counts), kept_pairs(doc, seg)
    if kernel == "flex":
        bm = packed_attention.block_mask(doc, seg)
        kernel_pairs = int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum()) * packed_attention.FLEX_BLOCK ** 2
    elif kernel == "causal":
        kernel_pairs = B * width * (width + 1) // 2
    else:
        rows = packed_attention.segment_rows([r.doc for r in mb.rows], [r.seg for r in mb.rows], width, "cpu")
        kernel_pairs = sum(R * S * (S + 1) // 2 for R, S in (tuple(g.shape) for g in rows.gather))
    return {"tokens": tokens, "width_tokens": B * width, "loss_tokens": loss_tokens, "pairs": pairs,
            "kernel_pairs": kernel_pairs,
            "useful": flops(a, n_params, tokens, loss_tokens, pairs, recompute=False),
            "hardware": flops(a, n_params, B * width, loss_tokens, kernel_pairs, recompute=True)}


def forward_width(mb, device) -> int:
    """The width packing.forward pads a micro-batch to (CUDA: multiples of FlexAttention's block)."""
    width = max(len(r.ids) for r in mb.rows)
    return width if all(r.plain for r in mb.rows) else packed_attention.width(width, device)


# -----------------------------------------------------------------------------
# the model and the timed passes


def build(a, cfg, device):
    """Random fp32 masters of the shape, FSDP2 on the one-rank group, the optimizer."""
    hf = dict(SHAPES[a.shape])
    if a.layers:
        hf["num_hidden_layers"] = a.layers
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_hf(hf))
    model = model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.set_activation_checkpointing(True)
    model.fp32_lm_head = cfg.model.fp32_lm_head
    n_params = non_embedding_params(model)
    total = sum(p.numel() for p in model.parameters())
    model = distributed.shard(model.train(), distributed.compute_dtype(cfg))
    o = cfg.optim
    opt, sched = optim.make_optimizer(model, o, o.lr, 0, 100)
    return model, opt, sched, n_params, total


def layers_that_fit(shape: str, tokens: int) -> int:
    """CUDA: the most blocks whose masters, gradients and AdamW states fit 85% of free memory after
    the embedding, the LM head and ~0.25 MB of activations per token of the row (the 7B 32k-token
    checkpointed micro-batch of bench/long_microbatch.py: ~7 GB beyond its weights and grads)."""
    with torch.device("meta"):
        one = Transformer(ModelArgs.from_hf({**SHAPES[shape], "num_hidden_layers": 1}))
    block = sum(p.numel() for p in one.layers[0].parameters())
    rest = sum(p.numel() for p in one.parameters()) - block
    free = torch.cuda.mem_get_info()[0] * 0.85 - BYTES_PER_PARAM * rest - 0.25e6 * tokens
    return max(1, min(SHAPES[shape]["num_hidden_layers"], int(free // (BYTES_PER_PARAM * block))))


@contextlib.contextmanager
def causal_kernel():
    """packing.forward with no packed attention: SDPA is_causal over each whole row (same tokens and shapes)."""
    saved = packed_attention.for_rows
    packed_attention.for_rows = lambda docs, segs, width, device: None
    try:
        yield
    finally:
        packed_attention.for_rows = saved


def microbatch_pass(model, mb, cfg, device, sync) -> float:
    """Seconds of one micro-batch as train.update runs it: forward, LossInputs, policy loss, backward."""
    model.zero_grad(set_to_none=True)
    sync()
    start = time.perf_counter()
    lp_flat, ent_flat = packing.forward(model, mb, device, cfg.sampling.temperature)
    lp, ent = packing.pad_flat(lp_flat, mb.counts), packing.pad_flat(ent_flat, mb.counts)
    mask = packing.pad_flat(torch.ones_like(lp_flat.detach()), mb.counts)
    adv = torch.tensor([(-1.0) ** i for i in range(len(mb.counts))], device=device)[:, None] * mask
    inputs = grpo.LossInputs(lp, lp.detach(), None, None, mask, adv, torch.zeros_like(mask, dtype=torch.long), ent)
    loss, _ = grpo.policy_loss(inputs, float(mask.sum()), cfg.grpo, cfg.sampling.max_context)
    loss.backward()
    sync()
    return time.perf_counter() - start


def optimizer_step(model, opt, sched, trajs, adv, cfg, device):
    """One optimizer step of the update as train.grpo_step runs it: train.update over
    every micro-batch (one mini-batch), then optim.step_optimizer (clip + AdamW)."""
    per_token = [adv[i].expand(len(t.token_turns())).clone() for i, t in enumerate(trajs)]
    train.update(train.Run(model, None, None, opt, sched, LossScaler(cfg.optim, torch.float32), None, cfg, None, 0, 1,
                           device), trajs, per_token)


def peak_gib(cuda: bool) -> float:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan")


def count_only(a):
    """The FLOP split of one micro-batch at the CUDA shape (no model run, any machine): what the
    useful count leaves out and what the recompute and each kernel add."""
    hf = {**SHAPES[a.shape], **({"num_hidden_layers": a.layers} if a.layers else {})}
    with torch.device("meta"):
        meta = Transformer(ModelArgs.from_hf(hf))
    margs, n_params = meta.config, non_embedding_params(meta)
    trajs = make_batch(a, margs.vocab_size)
    mb = packing.plan([(t.ids, t.loss_mask) for t in trajs], [len(t.prompt_ids) for t in trajs], a.tokens, 0)[0]
    width = packed_attention.width(max(len(r.ids) for r in mb.rows), "cuda")  # as on CUDA
    L, HD = margs.num_hidden_layers, margs.num_attention_heads * margs.head_dim
    for kernel in ("flex", "causal"):
        c = microbatch_flops(margs, n_params, mb, width, kernel)
        causal = len(mb.rows) * c["tokens"] * (c["tokens"] + 1) // 2
        attn, head = 12 * L * HD * c["pairs"], 6 * margs.hidden_size * margs.vocab_size * c["loss_tokens"]
        print(f"{a.shape} x {L} layers ({n_params / 1e9:.3f}B non-embedding), {c['tokens']} tokens, "
              f"{c['loss_tokens']} loss tokens, {kernel}: useful {c['useful'] / 1e15:.3f} PFLOP (attention "
              f"{attn / c['useful']:.1%}, LM head {head / c['useful']:.1%}; kept pairs {c['pairs'] / causal:.1%} of "
              f"causal), hardware {c['hardware'] / 1e15:.3f} PFLOP = {c['hardware'] / c['useful']:.2f}x useful "
              f"(kernel pairs {c['kernel_pairs'] / causal:.1%} of causal)")
        print(f"update_hw_over_useful_{kernel}: {c['hardware'] / c['useful']:.3f}")


# -----------------------------------------------------------------------------
# --mask-cost: building the block mask from the structure vs create_block_mask


class AllocatedBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Sums the storage bytes every op returns (views excluded): a bound on peak tensor memory."""
    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t._is_view():
                self.total += t.untyped_storage().nbytes()
        return out


def mask_cost(device):
    """One row of a 6144-token prompt shared by 500-token responses, as long as T: the seconds
    (median of 3, the allocation counter off) and allocated MB of each way to build its BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask
    for T in (4096, 8192, 32768):
        P = min(6144, T // 2)
        doc = torch.zeros(1, T, dtype=torch.long, device=device)
        seg = torch.cat([torch.zeros(P, dtype=torch.long), 1 + torch.arange(T - P) // 500])[None].to(device)
        ways = {"block_mask": lambda: packed_attention.block_mask(doc, seg)}
        if T <= 8192:  # create_block_mask at 32768 allocates ~12 GB
            ways["create_block_mask"] = lambda: create_block_mask(packed_attention.mask_mod_of(doc, seg), 1, None, T, T,
                                                                  device=device)
        for name, fn in ways.items():
            with AllocatedBytes() as alloc:
                fn()
            times = []
            for _ in range(3):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            print(f"T={T:6d} {name:18s} {statistics.median(times):7.3f} s  {alloc.total / 2 ** 20:9.1f} MB allocated")


# -----------------------------------------------------------------------------
# main


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="", choices=["", *sorted(SHAPES)],
                    help="default: qwen2.5-7b on CUDA, tiny on CPU")
    ap.add_argument("--layers", type=int, default=0, help="blocks (0: CUDA as many as fit, else the shape's)")
    ap.add_argument("--tokens", type=int, default=0, help="row (= micro-batch) tokens: 32768 on CUDA, 512 on CPU")
    ap.add_argument("--prompt", type=int, default=0, help="shared prompt tokens (2048 CUDA, 64 CPU)")
    ap.add_argument("--group", type=int, default=5, help="responses per prompt (SkyRL-SQL: 5)")
    ap.add_argument("--response", type=int, default=0, help="tokens per response (1152 CUDA, 32 CPU)")
    ap.add_argument("--obs-frac", type=float, default=0.25, help="share of a response that is observation (no loss)")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--iters", type=int, default=3, help="timed repeats (after one warm-up)")
    ap.add_argument("--compare", action="store_true", help="also time a dense causal kernel on the same tokens")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak (default: CUDA device's spec)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument("--dtype", default="", choices=["", "bfloat16", "float32"],
                    help="compute dtype (masters stay fp32): bfloat16 on CUDA, float32 on CPU (emulated bf16)")
    ap.add_argument("--mask-cost", action="store_true", help="only time/measure building the block mask")
    ap.add_argument("--count-only", action="store_true", help="only the FLOP split of a CUDA-shaped micro-batch")
    a = ap.parse_args()
    if a.count_only:  # the CUDA defaults, counted on any machine
        a.shape, a.tokens = a.shape or "qwen2.5-7b", a.tokens or 32768
        a.prompt, a.response, a.micro_batches = a.prompt or 2048, a.response or 1152, 1
        return count_only(a)
    cuda = a.device.startswith("cuda")
    if cuda != torch.cuda.is_available():
        raise SystemExit(f"--device {a.device} but CUDA available = {torch.cuda.is_available()}")
    if not cuda:
        torch.set_num_threads(a.threads)
    if a.mask_cost:
        return mask_cost(a.device)
    a.shape = a.shape or ("qwen2.5-7b" if cuda else "tiny")
    a.tokens = a.tokens or (32768 if cuda else 512)
    a.prompt = a.prompt or (2048 if cuda else 64)
    a.response = a.response or (1152 if cuda else 32)
    if cuda and not a.layers:
        a.layers = layers_that_fit(a.shape, a.tokens)
    _rank, _world, device = distributed.setup_dist()
    dtype = a.dtype or ("bfloat16" if cuda else "float32")
    cfg = C.load_config([os.path.join(ROOT, "configs", "skyrl_sql_7b.yaml"), f"--optim.micro_batch_tokens={a.tokens}",
                         "--optim.pack_row_tokens=0", f"--model.dtype={dtype}"])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, opt, sched, n_params, total = build(a, cfg, device)
    margs = model.config
    name = torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)"
    peak = a.peak_tflops * 1e12 or next((v for k, v in PEAK_BF16_FLOPS.items() if cuda and k in name), 0.0)
    print(f"{a.shape}: {margs.num_hidden_layers} layers, {total / 1e9:.3f}B params ({n_params / 1e9:.3f}B without "
          f"embedding and LM head), fp32 masters, {cfg.model.dtype} compute, FSDP2 1 rank, activation "
          f"checkpointing, {name}; "
          + (f"peak {peak / 1e12:.3g} TFLOP/s" if peak else "no peak stated (MFU nan; --peak-tflops)"), flush=True)

    trajs = make_batch(a, margs.vocab_size)
    seqs = [(t.ids, t.loss_mask) for t in trajs]
    mbs = packing.plan(seqs, [len(t.prompt_ids) for t in trajs], a.tokens, 0)
    kernel = "flex" if cuda else "segments"
    counts = [microbatch_flops(margs, n_params, mb, forward_width(mb, device), kernel) for mb in mbs]
    c0 = counts[0]
    causal_pairs = len(mbs[0].rows) * c0["tokens"] * (c0["tokens"] + 1) // 2
    print(f"batch: {len(trajs)} trajectories ({a.prompt}-token prompts x {a.group} responses of {a.response}, "
          f"{a.obs_frac:.0%} observation) in {len(mbs)} micro-batches; micro-batch 0: {c0['tokens']} tokens "
          f"(width {c0['width_tokens']}), {c0['loss_tokens']} loss tokens, kept pairs {c0['pairs'] / causal_pairs:.1%} "
          f"of causal, kernel pairs ({kernel}) {c0['kernel_pairs'] / causal_pairs:.1%}", flush=True)

    def report(label, seconds, count):
        useful, hw = count["useful"] / seconds, count["hardware"] / seconds
        mfu, hw_mfu = (useful / peak, hw / peak) if peak else (float("nan"), float("nan"))
        print(f"  {label}: {seconds:.3f} s  useful {useful / 1e12:.3g} TFLOP/s (MFU {mfu:.3f})  hardware "
              f"{hw / 1e12:.3g} TFLOP/s (MFU {hw_mfu:.3f})  peak mem {peak_gib(cuda):.1f} GiB", flush=True)
        return mfu, hw_mfu, useful

    # one micro-batch: forward + loss + backward (the first call compiles FlexAttention on CUDA)
    mb = mbs[0]
    kinds = {"mask": contextlib.nullcontext, **({"causal": causal_kernel} if a.compare else {})}
    for ctx in kinds.values():
        with ctx():
            microbatch_pass(model, mb, cfg, device, sync)
    times = {k: [] for k in kinds}
    for _ in range(a.iters):  # interleaved: mask, causal, mask, causal, ...
        for k, ctx in kinds.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            with ctx():
                times[k].append(microbatch_pass(model, mb, cfg, device, sync))
    print(f"per micro-batch (median of {a.iters}):")
    mb_mfu, mb_hw, _ = report(f"{kernel} mask", statistics.median(times["mask"]), c0)
    if a.compare:
        causal = microbatch_flops(margs, n_params, mb, forward_width(mb, device), "causal")
        causal["useful"] = c0["useful"]  # the same useful work, done by a kernel that visits T^2 / 2
        report("causal (no mask)", statistics.median(times["causal"]), causal)
        ratio = statistics.median(m / c for m, c in zip(times["mask"], times["causal"]))
        print(f"  mask / causal time: {ratio:.2f} (median of interleaved pairs)")

    # one optimizer step: train.update over all micro-batches (clip + AdamW included)
    adv = torch.tensor([(-1.0) ** i for i in range(len(trajs))])
    model.zero_grad(set_to_none=True)
    optimizer_step(model, opt, sched, trajs, adv, cfg, device)  # warm-up: AdamW states
    steps = []
    for _ in range(a.iters):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        optimizer_step(model, opt, sched, trajs, adv, cfg, device)
        sync()
        steps.append(time.perf_counter() - start)
    step_count = {k: sum(c[k] for c in counts) for k in ("useful", "hardware")}
    print(f"per optimizer step ({len(mbs)} micro-batches, median of {a.iters}):")
    step_mfu, step_hw, step_flops = report("train.update", statistics.median(steps), step_count)

    print(f"update_microbatch_s: {statistics.median(times['mask']):.3f}")
    print(f"update_hw_mfu_microbatch: {mb_hw:.4g}")
    print(f"update_mfu_microbatch: {mb_mfu:.4g}")
    if a.compare:
        print(f"update_mask_over_causal_time: {ratio:.2f}")
    print(f"update_step_s: {statistics.median(steps):.3f}")
    print(f"update_tflops: {step_flops / 1e12:.4g}")
    print(f"update_hw_mfu: {step_hw:.4g}")
    print(f"update_mfu: {step_mfu:.4g}")
    distributed.close()


if __name__ == "__main__":
    main()
