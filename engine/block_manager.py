"""Which blocks of the paged KV cache each sequence holds (bookkeeping only; no tensors).

The KV cache (paged_attention.PagedKVCache) is one pool of fixed-size blocks per rank. A sequence's block
table lists the blocks holding its tokens in order: token p lives in block table[p // block_size]
at offset p % block_size. Blocks are taken as a sequence grows and given back when it ends or is
evicted. The G samples of a prompt share the prompt's blocks (reference counts): a shared block
is never written except the partly filled last one, which is copied first (copy on write) by the
sequence about to write into it. The copies are queued here and applied to the tensors by the
engine before its next forward.

    blocks = BlockManager(num_blocks=1000, block_size=16)
    blocks.grow(table, written=0, total=40)       # table covers 40 tokens: 3 blocks
    child = blocks.share(table)                   # a second sample of the same prompt
    blocks.grow(child, written=40, total=41)      # its block 2 is shared and partly filled: copied
    blocks.pending_copies()                       # -> [(src, dst)] for the tensors
    blocks.release(table)

Tests: .venv/bin/pytest tests/test_engine.py
"""
from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: lowest ids are handed out first
        self.refs = [0] * num_blocks  # sequences holding each block
        self.copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) not yet applied
        self.peak_used = 0  # most blocks in use at once (what the work needed of the pool)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _shared_tail(self, table: list[int], written: int) -> bool:
        """Is the block the next token goes to (at index `written`) partly filled and shared?"""
        return written % self.block_size != 0 and self.refs[table[written // self.block_size]] > 1

    def needed(self, table: list[int], written: int, total: int) -> int:
        """Free blocks that grow(table, written, total) takes."""
        return max(0, self.blocks_for(total) - len(table)) + (total > written and self._shared_tail(table, written))

    def grow(self, table: list[int], written: int, total: int) -> None:
        """Make `table` cover `total` tokens, of which the first `written` are in the cache."""
        if total > written and self._shared_tail(table, written):  # copy on write
            i = written // self.block_size
            new = self._take()
            self.copies.append((table[i], new))
            self.refs[table[i]] -= 1
            table[i] = new
        while len(table) < self.blocks_for(total):
            table.append(self._take())

    def share(self, table: list[int]) -> list[int]:
        """A second table holding the same blocks (a sample forked from a prefilled prompt)."""
        for b in table:
            self.refs[b] += 1
        return list(table)

    def release(self, table: list[int]) -> None:
        """Give the table's blocks back (those no other table holds become free) and empty it."""
        for b in reversed(table):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
        table.clear()

    def pending_copies(self) -> list[tuple[int, int]]:
        out, self.copies = self.copies, []
        return out

    def _take(self) -> int:
        if not self.free:
            raise RuntimeError("KV cache out of blocks (the scheduler should have made room first)")
        b = self.free.pop()
        self.refs[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return b
