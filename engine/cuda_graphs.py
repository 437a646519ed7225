"""CUDA graphs of the whole decode step, one per (batch size, block count, sampling) bucket.

On a GPU one decode step of a small batch is bound by launching its many small kernels, not by
the math; replaying a captured graph launches them all at once. The graph holds the whole step
(decode_step.py): slots, the forward, sampling with each row's key, the stop and budget checks and
the row-state update, so a window of K steps is K replays and one host read. A graph has static
shapes, so a step's rows are padded up to a batch bucket (padding rows are inactive: they write
into the scratch block and are never read) and its block tables up to a power-of-two number of
blocks (extra entries point at the scratch block and are masked). Graphs read and write one set of
static buffers (DecodeState of the largest bucket; a bucket uses its leading rows and blocks) and
share one memory pool. They are captured on first use, so a run captures only the buckets it
meets. With compile (sampling.compile_decode) the step is compiled by inductor before capture:
one compilation with dynamic batch and block counts serves every bucket.

    graphs = DecodeGraphs(model, cache, max_blocks, window, candidates, compile=True)
    state = graphs.load(tokens, positions, keys, left, tables, blocks)   # or None: run eagerly
    for _ in range(steps): graphs.replay(state, params)
    ... read state.out_tokens[:B, :steps], state.new[:B], state.active[:B], state.inexact[:B]

Used by model_runner.py when sampling.cuda_graphs is on and the model is on CUDA (never on CPU).
"""
from __future__ import annotations

import time
import warnings

import torch

from engine.decode_step import DecodeState, decode_step
from engine.sampling import SamplingParams

BATCH_BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
RECOMPILE_LIMIT = 32  # dynamo's per-function compile cache: models x sampling modes x specialised sizes


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DecodeGraphs:
    def __init__(self, model, cache, max_blocks: int, window: int, candidates: torch.Tensor, *, compile: bool = False):
        """max_blocks: the most blocks a row can hold (max_context / block_size); window: the most
        decode steps between two host reads; candidates (V,) bool: tokens that may end a turn
        (replaced in place by set_candidates: graphs read its address)."""
        self.model, self.cache = model, cache
        self.max_rows, self.max_blocks = BATCH_BUCKETS[-1], _pow2(max_blocks)
        self.window = window
        self.state = DecodeState.empty(self.max_rows, self.max_blocks, window, cache.scratch, cache.k.device)
        self.candidates = candidates.clone()
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.step_fn = decode_step
        self.compiled = compile
        if compile:
            # the rows and blocks of a bucket are marked dynamic (_run): one compilation serves every
            # bucket (sizes 1 aside, which dynamo specialises); the cache's ints stay constants (with
            # dynamic=True they became symbols, and inductor could not lower flex over them); a new
            # model or sampling mode compiles again (guards), within the limit
            self.step_fn = torch.compile(decode_step, fullgraph=True)
            cache.static_flex = (self.max_rows, self.max_blocks)
            cfg = torch._dynamo.config
            if hasattr(cfg, "recompile_limit"):
                cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
        self.capture_s = 0.0  # seconds spent compiling and capturing (what a new bucket costs)
        self.compile_error = ""  # why compiling failed, when it did (the warning has its start)

    def warm_up(self, params: list[SamplingParams]) -> float:
        """Compile (or load from inductor's on-disk cache) and capture the step for each sampling
        mode before the first rollout, on a 2-row, 2-block bucket of inactive rows (they write
        only the scratch block); later buckets then cost a capture each. Returns the seconds."""
        t0 = self.capture_s
        long = dict(dtype=torch.long, device=self.state.tokens.device)
        dummy = torch.zeros(2, **long)
        for p in params:
            state = self.load(dummy, dummy, dummy, dummy, torch.full((2, 2), self.cache.scratch, **long), 2)
            state.active.fill_(False)
            self.replay(state, p)
        return self.capture_s - t0

    def set_candidates(self, candidates: torch.Tensor) -> None:
        self.candidates.copy_(candidates)

    def bucket(self, B: int, blocks: int) -> tuple[int, int] | None:
        rows = next((b for b in BATCH_BUCKETS if b >= B), None)
        width = _pow2(blocks)
        if rows is None or width > self.max_blocks:
            return None
        return rows, width

    def view(self, rows: int, width: int) -> DecodeState:
        """The bucket's DecodeState: views of the leading rows and blocks of the static buffers."""
        s = self.state
        return DecodeState(tokens=s.tokens[:rows], positions=s.positions[:rows], keys=s.keys[:rows],
                           left=s.left[:rows], tables=s.tables[:rows, :width], active=s.active[:rows],
                           inexact=s.inexact[:rows], new=s.new[:rows], step=s.step,
                           out_tokens=s.out_tokens[:rows], out_logps=s.out_logps[:rows])

    def load(self, tokens, positions, keys, left, tables, blocks: int) -> DecodeState | None:
        """Copy B rows (tokens, positions, keys, left (B,) long; tables (B, W), rows attend over
        their first `blocks` blocks) into the static buffers and start a window. Returns the
        bucket's state, or None if no bucket fits (then the caller runs the step eagerly)."""
        B = tokens.shape[0]
        fit = self.bucket(B, blocks)
        if fit is None:
            return None
        rows, width = fit
        state = self.view(rows, width)
        state.tokens[:B], state.positions[:B], state.keys[:B], state.left[:B] = tokens, positions, keys, left
        w = min(width, tables.shape[1])
        state.tables[:B, :w] = tables[:, :w]
        state.tables[:B, w:] = self.cache.scratch
        state.tokens[B:], state.positions[B:], state.left[B:] = 0, 0, 0  # padding rows: inactive
        state.tables[B:] = self.cache.scratch
        state.start_window(B)
        return state

    def replay(self, state: DecodeState, params: SamplingParams) -> None:
        """One decode step of the loaded window (captured the first time its bucket is met)."""
        key = (state.tokens.shape[0], state.tables.shape[1], params)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(state, params)
        graph.replay()

    def _run(self, state, params):
        if self.compiled:  # (rows,) and (rows, blocks): the sizes that change between buckets
            for t in _mutable(state) + [state.keys, state.tables]:
                if t.dim() and t.shape[0] > 1:
                    torch._dynamo.mark_dynamic(t, 0)
            if state.tables.shape[1] > 1:
                torch._dynamo.mark_dynamic(state.tables, 1)
        self.step_fn(self.model, self.cache, state, self.candidates, params)

    def _capture(self, state: DecodeState, params: SamplingParams) -> torch.cuda.CUDAGraph:
        t0 = time.perf_counter()
        try:
            graph = self._try_capture(state, params)
        except Exception as e:  # noqa: BLE001  (compile and capture errors come in many types)
            if not self.compiled:
                raise
            self.compile_error = f"{type(e).__name__}: {e}"
            warnings.warn(f"sampling.compile_decode: the compiled decode step failed ({type(e).__name__}: "
                          f"{str(e)[:300]}); capturing it uncompiled (set sampling.compile_decode=false)")
            self.step_fn, self.compiled = decode_step, False
            self.cache.static_flex = None
            graph = self._try_capture(state, params)
        self.capture_s += time.perf_counter() - t0
        return graph

    def _try_capture(self, state: DecodeState, params: SamplingParams) -> torch.cuda.CUDAGraph:
        # the warm-up (lazy initialisations, compilation) runs one real step: the row state is put
        # back after it; the K/V it wrote are the ones the replay writes
        saved = [t.clone() for t in _mutable(state)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(state, params)
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(_mutable(state), saved):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._run(state, params)
        self.pool = graph.pool()
        torch.cuda.synchronize()
        return graph


def _mutable(state: DecodeState) -> list[torch.Tensor]:
    """The tensors decode_step writes (the K/V pool aside)."""
    return [state.tokens, state.positions, state.left, state.active, state.inexact, state.new, state.step,
            state.out_tokens, state.out_logps]
