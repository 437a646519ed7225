"""The decode batch's K/V kept dense across steps: the gather path's copy of each row's blocks.

The gather path (paged_attention.py) reads a decode step's K/V as one dense (B, Hk, S, D) tensor
per layer: every row's blocks copied out of the pool, then SDPA with a mask. Copying all of them
again at every step moves the whole context of every row per layer per step (on a 2-core CPU,
about a fifth of a decode step). DecodeKV keeps that copy instead: a row's K/V is copied out once,
when the row joins the decode batch, and each step appends its new token to the copy as it writes
the pool. SDPA then reads the same values at the same positions under the same mask as a fresh
gather would, so the logits are bit for bit a gather's.

    kv = DecodeKV(cache)                          # one per decode batch (ModelRunner's DecodeRows)
    kv.select(B, kept_new, kept_src, joining)     # the batch changed: kept rows move, joining rows marked
    kv.fit(tables, tokens)                        # before a window: room for `tokens` columns, joining rows loaded
    decode_step(..., kv=kv)                       # each layer: kv.append(layer, k, v, plan.kv_index), kv.read(layer, S)

The pool stays the source of truth (prefill, shared prompts, later turns, recomputation); the
copy holds only rows of the current decode batch. Column width - 1 of each row is a dummy that
stopped rows write to (their position may lie past their blocks); it is never read.

Tests: .venv/bin/pytest tests/test_decode_kv.py tests/test_engine.py
"""
from __future__ import annotations

import torch


class DecodeKV:
    """k, v: (n_layers, R, Hk, width, D) in the cache's dtype, R >= the batch's rows: row b's token at
    position p is column p of buffer row b. The buffers are kept across batch changes (a change moves
    only the rows whose index changed, and only the columns in use) and zeroed only when they grow:
    a column a row has not written holds another row's finite K/V or zeros, which its attention mask
    never reads (SDPA gives a masked position weight exactly 0; never NaN, so 0 * it stays 0)."""

    def __init__(self, cache, max_tokens: int = 0):
        """max_tokens: the most positions a row can hold (sampling.max_context); widening doubles the
        columns but stops there (0: no cap). The copy is rows x columns x (the pool's bytes a token),
        zeroed when it grows: at 64 rows of 1.3k-token prompts and 128 new tokens, an uncapped
        doubling makes it 2600 columns where 1441 suffice (SmolLM2-135M, float32: 7.7 GB against 4.2)."""
        self.cache = cache
        self.max_tokens = max_tokens
        L, _, _, Hk, D = cache.k.shape
        self.k = cache.k.new_zeros(L, 0, Hk, 1, D)
        self.v = cache.v.new_zeros(L, 0, Hk, 1, D)
        self.rows = 0  # the decode batch's rows: buffer rows [0, rows)
        self.used = 0  # columns [0, used) hold the rows' K/V (the last fit's `tokens`); the rest is never read
        self.loading = torch.zeros(0, dtype=torch.long, device=cache.k.device)  # rows still to copy out

    @property
    def width(self) -> int:
        return self.k.shape[3]

    def select(self, rows: int, kept_new: torch.Tensor | None, kept_src: torch.Tensor | None,
               joining: torch.Tensor | None) -> None:
        """The decode batch is now `rows` rows: row kept_new[i] is the former row kept_src[i] (its
        copy moves with it), rows `joining` are copied out of the pool by the next fit()."""
        used = self.used
        if rows > self.k.shape[1]:  # more rows than the buffers hold: larger ones (at least twofold)
            k = self.k.new_zeros(self.k.shape[0], max(rows, 2 * self.k.shape[1]), *self.k.shape[2:])
            v = torch.zeros_like(k)
            if kept_new is not None:
                k[:, kept_new, :, :used], v[:, kept_new, :, :used] = self.k[:, kept_src, :, :used], self.v[:, kept_src, :, :used]
            self.k, self.v = k, v
        elif kept_new is not None:
            moved = kept_new != kept_src  # rows keep their place unless one before them left or joined
            if bool(moved.any()):
                new, src = kept_new[moved], kept_src[moved]  # the right side is gathered first: overlaps are safe
                self.k[:, new, :, :used], self.v[:, new, :, :used] = self.k[:, src, :, :used], self.v[:, src, :, :used]
        self.rows = rows
        self.loading = joining if joining is not None else self.loading[:0]

    def fit(self, tables: torch.Tensor, tokens: int) -> None:
        """Room for positions [0, tokens) plus the dummy column (widened at least twofold), then the
        joining rows' blocks copied out of the pool: tables (B, W) each row's block table."""
        if tokens + 1 > self.width:
            doubled = 2 * self.width if not self.max_tokens else min(2 * self.width, self.max_tokens + 1)
            width = max(tokens + 1, doubled)
            k = self.k.new_zeros(*self.k.shape[:3], width, self.k.shape[4])
            v = torch.zeros_like(k)
            k[..., :self.used, :], v[..., :self.used, :] = self.k[..., :self.used, :], self.v[..., :self.used, :]
            self.k, self.v = k, v
        self.used = tokens  # a window writes positions below it; a staying row holds none beyond
        if len(self.loading):
            bs = self.cache.block_size
            blocks = min(tables.shape[1], -(-tokens // bs))
            table = tables[self.loading, :blocks]  # (J, blocks)
            L, J, S = self.k.shape[0], len(self.loading), blocks * bs
            Hk, D = self.k.shape[2], self.k.shape[4]
            # (L, J, blocks, bs, Hk, D) -> (L, J, Hk, S, D): the same copy a gather makes, once per row
            self.k[:, self.loading, :, :S] = self.cache.k[:, table].view(L, J, S, Hk, D).transpose(2, 3)
            self.v[:, self.loading, :, :S] = self.cache.v[:, table].view(L, J, S, Hk, D).transpose(2, 3)
            self.loading = self.loading[:0]

    def index(self, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """(B Hk,) where each row's new K/V goes in a layer's flat (B Hk width, D) view: column
        positions[b] (B,) of each head, or the dummy column for a row whose slot (B,) is the
        pool's scratch (a stopped row: it writes nowhere that counts)."""
        B, Hk, W = self.rows, self.k.shape[2], self.width
        column = torch.where(slots == self.cache.scratch * self.cache.block_size, W - 1, positions)  # (B,)
        heads = torch.arange(B * Hk, device=positions.device).view(B, Hk)
        return (heads * W + column[:, None]).reshape(-1)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> None:
        """k, v (B, 1, Hk, D): one decode step's new tokens, into their columns (index())."""
        D = k.shape[-1]
        self.k[layer].view(-1, D).index_copy_(0, index, k.reshape(-1, D))
        self.v[layer].view(-1, D).index_copy_(0, index, v.reshape(-1, D))

    def read(self, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Hk, tokens, D) views of a layer's K and V: what a gather of `tokens` positions gives."""
        return self.k[layer, :self.rows, :, :tokens], self.v[layer, :self.rows, :, :tokens]
