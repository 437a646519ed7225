"""The engine's own cost per decode step: what the host adds on top of a forward that costs nothing.

A near-free model (1 layer, hidden 32, 2 heads of 16, vocab 512, random N(0, 0.02) weights)
decodes B rows of 16-token prompts for 128 new tokens each (no EOS, no stop strings, temperature
1, no top-p: plain inverse-CDF sampling over the vocabulary) through engine.Engine, the path
rollout.generate and rollout.rollout use. The decode step time is the time of the engine's decode
work divided by the decode forwards it ran (prefill excluded). If the host's work per step did not
grow with the batch, B=256 would cost about what B=16 costs; the ratio of the two is the headline.
B=16 and B=256 alternate in one process (pairs), the ratio is the median over pairs.

The model's decode forwards are timed apart (module hooks: on a CPU every op is synchronous), so
the step splits into the forward (its attention, LM head: compute that grows with B even in a
near-free model) and everything else (sampling's softmax and cumulative sum over the vocabulary,
and the engine's host work); `outside_forward_ratio_b256_vs_b16` is the ratio of the latter.

Second, top-p sampling alone at the 0.5B shape's vocabulary (151936) and B=256 on peaked logits
(32 likely tokens per row: the nucleus closes inside the prefilter, as a trained model's
mostly does at temperature 0.6): sampling.sample_next
(top-k prefilter) against the full-vocabulary sort it replaced, interleaved; the ratio printed is
sort time / prefilter time (median of pairs).

    nice -n 5 .venv/bin/python bench/engine_overhead.py [--pairs 5] [--threads 1] [--new 128]

The script uses only Engine, Sequence and StopChecker's public interface, so the same file run
in a checkout of an older engine measures that engine (how the figures in the commit messages
were taken: each ratio from one process, never a time from one run against another run's).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from config import SamplingConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from engine.sampling import StopChecker, row_key  # noqa: E402
from engine.scheduler import Sequence  # noqa: E402

PROMPT = 16
VOCAB = 512


def near_free_model() -> Transformer:
    cfg = {"model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
           "tie_word_embeddings": True}
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_hf(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
    return model.eval()


class ForwardClock:
    """Seconds spent in the model's one-token (decode) forwards, via forward hooks."""

    def __init__(self, model):
        self.seconds, self.start = 0.0, None
        model.register_forward_pre_hook(self.pre)
        model.register_forward_hook(self.post)

    def pre(self, module, args):
        self.start = time.perf_counter() if args[0].shape[1] == 1 else None

    def post(self, module, args, out):
        if self.start is not None:
            self.seconds += time.perf_counter() - self.start


@torch.no_grad()
def decode_ms(model, rows: int, new: int, clock: ForwardClock | None = None) -> tuple[float, float]:
    """(milliseconds per decode step of `rows` rows, prefill excluded; of which in the forward)."""
    cfg = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=new, max_context=PROMPT + new + 1,
                         kv_budget_tokens=rows * (PROMPT + new + 16))
    gen = torch.Generator().manual_seed(rows)
    prompts = torch.randint(0, VOCAB, (rows, PROMPT), generator=gen).tolist()
    seqs = [Sequence(list(p), key=row_key(0, i), index=i) for i, p in enumerate(prompts)]
    spent, decode_steps = 0.0, 0
    in_forward = clock.seconds if clock else 0.0
    with Engine(model, cfg, StopChecker(None, [], []), worst_case=[PROMPT + new] * rows) as engine:
        engine.add(seqs)
        while engine.busy():
            prefills, decodes = engine.stats["prefill_steps"], engine.stats["decode_steps"]
            start = time.perf_counter()
            for s in engine.step():
                engine.finish(s)
            elapsed = time.perf_counter() - start
            if engine.stats["prefill_steps"] == prefills:  # a decode step (or window of them)
                spent += elapsed
                decode_steps += engine.stats["decode_steps"] - decodes
    assert all(len(s.ids) == PROMPT + new for s in seqs), "every row samples `new` tokens"
    forward = (clock.seconds - in_forward) if clock else 0.0
    return 1e3 * spent / decode_steps, 1e3 * forward / decode_steps


def sampling_ms(pairs: int, rows: int, vocab: int = 151936) -> tuple[float, float, float]:
    """(prefilter ms, full sort ms, median sort / prefilter) for one top-p 0.95 sampling call;
    None in a checkout whose sampler has no prefilter."""
    from engine import sampling
    if not hasattr(sampling, "PREFILTER"):
        return None
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen)  # (rows, vocab): 32 likely tokens per row
    likely = torch.randint(0, vocab, (rows, 32), generator=gen)
    logits.scatter_add_(1, likely, 9.0 + 2.0 * torch.randn(rows, 32, generator=gen))
    keys = torch.arange(rows)
    positions = torch.zeros(rows, dtype=torch.long)

    def prefilter():
        return sampling.sample_next(logits, keys, positions, temperature=0.6, top_p=0.95)

    def full_sort():
        u = sampling.uniforms(keys, positions)[:, None]
        return sampling._sorted_top_p(logits / 0.6, u, 0.95)

    assert torch.equal(prefilter()[0], full_sort()[0])
    times = {prefilter: [], full_sort: []}
    for _ in range(pairs):
        for fn in (full_sort, prefilter):
            start = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - start)
    ratio = statistics.median(s / p for s, p in zip(times[full_sort], times[prefilter]))
    return 1e3 * statistics.median(times[prefilter]), 1e3 * statistics.median(times[full_sort]), ratio


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new", type=int, default=128, help="tokens sampled per row")
    ap.add_argument("--sample-rows", type=int, default=256, help="rows of the top-p sampling comparison")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = near_free_model()
    clock = ForwardClock(model)
    decode_ms(model, 16, 16)  # warm-up
    small, large, ratios, fwd, outside = [], [], [], {16: [], 256: []}, []
    for _ in range(args.pairs):
        (s, fs), (b, fb) = decode_ms(model, 16, args.new, clock), decode_ms(model, 256, args.new, clock)
        small.append(s)
        large.append(b)
        ratios.append(b / s)
        fwd[16].append(fs)
        fwd[256].append(fb)
        outside.append((b - fb) / (s - fs))
        print(f"pair: b16 {s:.3f} ms (forward {fs:.3f})  b256 {b:.3f} ms (forward {fb:.3f})  ratio {ratios[-1]:.2f}",
              flush=True)
    sampled = sampling_ms(args.pairs, args.sample_rows)
    if sampled is not None:
        pre, full, speedup = sampled
        print(f"top_p_sample_ms_prefilter_b{args.sample_rows}_v151936: {pre:.1f}")
        print(f"top_p_sample_ms_full_sort_b{args.sample_rows}_v151936: {full:.1f}")
        print(f"top_p_sort_over_prefilter: {speedup:.1f}")
    for rows, ms in fwd.items():
        print(f"decode_forward_ms_b{rows}: {statistics.median(ms):.3f}")
    print(f"outside_forward_ratio_b256_vs_b16: {statistics.median(outside):.2f}")
    print(f"decode_step_ms_b16: {statistics.median(small):.3f}")
    print(f"decode_step_ms_b256: {statistics.median(large):.3f}")
    print(f"decode_step_ratio_b256_vs_b16: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
