"""One decode step of every running row, as one function that never reads the device from the host.

    state = DecodeState.empty(rows, width, window, scratch_block, device)   # or over DecodeRows' tensors
    decode_step(model, cache, state, candidates, params)                     # one token per active row
    # ... `steps` times (a window), then one host read of state.out_tokens[:, :steps], new, active, inexact

The step computes each row's KV slot from its block table and position, runs the paged forward,
samples with the row's counter-based key (sampling.sample_on_device), checks the turn's stop
conditions and updates the row state in place. Nothing in it waits on the host, so on CUDA the whole
step is captured in one graph per (batch, blocks) bucket (cuda_graphs.py) and, with
sampling.compile_decode, compiled first (inductor fuses the norms, RoPE, the slot arithmetic and the
sampling into a few kernels). The same function runs eagerly on CPU and for tests.

A row stops (stays frozen for the rest of the window: no new token, its K/V written to the scratch
block) once it samples a token that may end its turn (EOS, or one that can complete a stop string:
StopChecker.candidates), uses up its turn's budget, or, on the device path, draws a top-p sample
sample_on_device cannot settle (a nucleus wider than its prefilter): that row takes no token and is
flagged `inexact`; the runner samples it exactly on the host after the window (model_runner.py).

Tests: .venv/bin/pytest tests/test_decode_step.py
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.paged_attention import PagedBatch, PagedKVCache
from engine.sampling import SamplingParams, sample_next, sample_on_device


@dataclass
class DecodeState:
    """The decode batch on the device. (B,) per row unless noted; updated in place by decode_step.

    tokens: each row's input token (its last sampled one); positions: that token's position (= tokens
    cached before it); keys: sampling keys; left: tokens its turn may still sample; tables (B, W):
    block tables, scratch-padded; active: still decoding in this window; inexact: stopped on a
    sample the host must draw; new: tokens taken in this window; step () long: the window's step,
    the column out_tokens / out_logps (B, K) are written at."""
    tokens: torch.Tensor
    positions: torch.Tensor
    keys: torch.Tensor
    left: torch.Tensor
    tables: torch.Tensor
    active: torch.Tensor
    inexact: torch.Tensor
    new: torch.Tensor
    step: torch.Tensor
    out_tokens: torch.Tensor
    out_logps: torch.Tensor

    @classmethod
    def empty(cls, rows: int, width: int, window: int, scratch: int, device) -> "DecodeState":
        long = dict(dtype=torch.long, device=device)
        return cls(tokens=torch.zeros(rows, **long), positions=torch.zeros(rows, **long),
                   keys=torch.zeros(rows, **long), left=torch.zeros(rows, **long),
                   tables=torch.full((rows, width), scratch, **long),
                   active=torch.zeros(rows, dtype=torch.bool, device=device),
                   inexact=torch.zeros(rows, dtype=torch.bool, device=device), new=torch.zeros(rows, **long),
                   step=torch.zeros((), **long), out_tokens=torch.zeros(rows, window, **long),
                   out_logps=torch.zeros(rows, window, dtype=torch.float32, device=device))

    def start_window(self, rows: int) -> None:
        """A new window: the first `rows` rows decode (the rest are a graph bucket's padding), the
        counters start at zero."""
        self.active.fill_(False)
        self.active[:rows] = True
        self.inexact.fill_(False)
        self.new.zero_()
        self.step.zero_()


def decode_step(model, cache: PagedKVCache, state: DecodeState, candidates: torch.Tensor, params: SamplingParams,
                *, on_device: bool = True, logits_hook=None, kv=None) -> None:
    """One token for every active row of `state`, in place; no host read when on_device.

    candidates (V,) bool: tokens that may end a turn. on_device=False samples every row exactly
    in the step (sampling.sample_next: one host read when a top-p nucleus is wide; CPU, tests);
    logits_hook(logits (B, V)) -> logits: instrumentation (eager only). kv: the rows' K/V kept dense
    across steps (decode_kv.DecodeKV, eager gather path), fitted to the tables; None: gather them."""
    bs, W = cache.block_size, state.tables.shape[1]
    # (B,) the slot each row's input token goes to; a stopped row's position may lie past its table
    index = (state.positions // bs).clamp(max=W - 1)
    slots = state.tables.gather(1, index[:, None]).squeeze(1) * bs + state.positions % bs
    slots = torch.where(state.active, slots, cache.scratch * bs)  # a stopped row writes nowhere that counts
    batch = PagedBatch(cache, slots[:, None], state.tables, kv)
    logits = model.forward_paged(state.tokens[:, None], state.positions[:, None], batch)[:, -1]  # (B, V)
    if logits_hook is not None:
        logits = logits_hook(logits)
    sample = sample_on_device if on_device else sample_next
    out = sample(logits, state.keys, state.positions + 1, temperature=params.temperature, top_p=params.top_p,
                 top_k=params.top_k, greedy=params.greedy)
    tokens, logps = out[0], out[1]  # (B,), (B,)
    exact = out[2] if on_device else None
    take = state.active if exact is None else state.active & exact  # (B,) rows that take this token
    stops = state.active & (candidates[tokens] | (state.left <= 1))
    if exact is not None:
        state.inexact.logical_or_(state.active & ~exact)
        stops = stops | ~exact
    column = state.step.view(1)
    state.out_tokens.index_copy_(1, column, tokens[:, None])
    state.out_logps.index_copy_(1, column, logps.float()[:, None])
    step = take.long()
    state.tokens.copy_(torch.where(take, tokens, state.tokens))
    state.positions.add_(step)
    state.left.sub_(step)
    state.new.add_(step)
    state.active.logical_and_(~stops)
    state.step.add_(1)
