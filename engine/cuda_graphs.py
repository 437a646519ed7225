"""CUDA graphs of the sampler's decode forward, one per (batch size, block count) bucket.

On a GPU one decode step of a small batch is bound by launching its few hundred small kernels,
not by the math; replaying a captured graph launches them all at once. A graph has static
shapes, so a step's rows are padded up to a batch bucket (padding rows write into the scratch
block and are ignored) and its block tables up to a power-of-two number of blocks (extra entries
point at the scratch block and are masked). Graphs are captured on first use and share one memory
pool; the logits of a replay are read before the next replay. Used by engine.py when
sampling.cuda_graphs is on and the model is on CUDA (never on CPU); sampling stays eager.

    graphs = DecodeGraphs(model, cache, max_blocks)
    logits = graphs.run(tokens, positions, slots, tables, blocks)   # (B, V), or None: run eagerly
"""
from __future__ import annotations

import torch

from engine.paged_attention import PagedBatch

BATCH_BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DecodeGraphs:
    def __init__(self, model, cache, max_blocks: int):
        self.model, self.cache = model, cache
        self.max_rows, self.max_blocks = BATCH_BUCKETS[-1], _pow2(max_blocks)
        long = dict(dtype=torch.long, device=cache.k.device)
        self.scratch_slot = cache.scratch * cache.block_size
        # static inputs every graph reads (each step copies its rows in)
        self.tokens = torch.zeros(self.max_rows, 1, **long)
        self.positions = torch.zeros(self.max_rows, 1, **long)
        self.slots = torch.full((self.max_rows, 1), self.scratch_slot, **long)
        self.tables = torch.full((self.max_rows, self.max_blocks), cache.scratch, **long)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def run(self, tokens, positions, slots, tables, blocks: int):
        """One decode forward: tokens, positions, slots (B,) long; tables (B, W) long, rows attend
        over their first `blocks` blocks. Returns logits (B, V), or None if no bucket fits."""
        B = tokens.shape[0]
        rows = next((b for b in BATCH_BUCKETS if b >= B), None)
        width = _pow2(blocks)
        if rows is None or width > self.max_blocks:
            return None
        self.tokens[:B, 0] = tokens
        self.positions[:B, 0] = positions
        self.slots[:B, 0] = slots
        w = min(width, tables.shape[1])
        self.tables[:B, :w] = tables[:, :w]
        self.tables[:B, w:width] = self.cache.scratch
        self.tokens[B:rows], self.positions[B:rows] = 0, 0
        self.slots[B:rows], self.tables[B:rows, :width] = self.scratch_slot, self.cache.scratch
        if (rows, width) not in self.graphs:
            self.graphs[rows, width] = self._capture(rows, width)
        graph, logits = self.graphs[rows, width]
        graph.replay()
        return logits[:B]

    def _forward(self, rows: int, width: int) -> torch.Tensor:
        cache = PagedBatch(self.cache, self.slots[:rows], self.tables[:rows, :width])
        return self.model.forward_paged(self.tokens[:rows], self.positions[:rows], cache)[:, -1]

    def _capture(self, rows: int, width: int):
        # the inputs already hold this step's rows, so the warm-up writes the K/V the replay writes
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph: lazy initialisations
            self._forward(rows, width)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(rows, width)
        self.pool = graph.pool()
        return graph, logits
