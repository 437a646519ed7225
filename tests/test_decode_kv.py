"""DecodeKV (engine/decode_kv.py): the decode rows' K/V kept dense holds what a fresh gather of each
row's blocks reads, through rows joining, moving, a stopped row's write and widening.

    .venv/bin/pytest tests/test_decode_kv.py
"""
import torch

from engine.decode_kv import DecodeKV
from engine.paged_attention import PagedKVCache

L, BS, HK, D = 2, 4, 2, 3


def pool():
    torch.manual_seed(0)
    cache = PagedKVCache(L, 10, BS, HK, D, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    return cache


def by_hand(cache, table, tokens, layer):
    """(Hk, tokens, D): token p of a row is offset p % bs of block table[p // bs], read one by one."""
    k = torch.stack([cache.k[layer, table[p // BS], p % BS] for p in range(tokens)], 1)
    v = torch.stack([cache.v[layer, table[p // BS], p % BS] for p in range(tokens)], 1)
    return k, v


def test_joining_rows_read_their_blocks_and_kept_rows_move_with_them():
    cache = pool()
    tables = torch.tensor([[3, 7, 1], [0, 2, 9], [5, 4, 6]])
    kv = DecodeKV(cache)
    kv.select(3, None, None, torch.tensor([0, 1, 2]))
    kv.fit(tables, 3 * BS)
    for layer in range(L):
        for b in range(3):
            k, v = kv.read(layer, 3 * BS)
            hk, hv = by_hand(cache, tables[b].tolist(), 3 * BS, layer)
            assert torch.equal(k[b], hk) and torch.equal(v[b], hv)
    # rows 2 and 0 stay (as rows 0 and 2), a new row 1 joins with its own blocks
    kv.select(3, torch.tensor([0, 2]), torch.tensor([2, 0]), torch.tensor([1]))
    tables = torch.tensor([[5, 4, 6], [8, 10, 10], [3, 7, 1]])
    kv.fit(tables, 3 * BS)
    k, _ = kv.read(1, 3 * BS)
    for b in range(3):
        assert torch.equal(k[b], by_hand(cache, tables[b].tolist(), 3 * BS, 1)[0])


def test_a_step_appends_its_token_and_a_stopped_row_writes_no_read_column():
    cache = pool()
    tables = torch.tensor([[3, 7], [0, 2]])
    kv = DecodeKV(cache)
    kv.select(2, None, None, torch.tensor([0, 1]))
    kv.fit(tables, 2 * BS)
    before = kv.read(0, 2 * BS)[0].clone()
    positions = torch.tensor([5, 6])
    slots = torch.tensor([7 * BS + 1, cache.scratch * BS])  # row 1 stopped: the scratch slot
    k_new, v_new = torch.randn(2, 1, HK, D), torch.randn(2, 1, HK, D)
    kv.append(0, k_new, v_new, kv.index(positions, slots))
    k, v = kv.read(0, 2 * BS)
    assert torch.equal(k[0, :, 5], k_new[0, 0]) and torch.equal(v[0, :, 5], v_new[0, 0])
    expected = before.clone()
    expected[0, :, 5] = k_new[0, 0]
    assert torch.equal(k, expected)  # row 1 unchanged at every column a step reads


def test_widening_keeps_what_was_written():
    cache = pool()
    tables = torch.tensor([[3, 7, 1, 2]])
    kv = DecodeKV(cache)
    kv.select(1, None, None, torch.tensor([0]))
    kv.fit(tables, BS)
    k_new = torch.randn(1, 1, HK, D)
    kv.append(1, k_new, k_new, kv.index(torch.tensor([2]), torch.tensor([3 * BS + 2])))
    kv.fit(tables, 4 * BS)
    assert kv.width > 4 * BS
    k, _ = kv.read(1, 4 * BS)
    assert torch.equal(k[0, :, 2], k_new[0, 0])
    assert torch.equal(k[0, :, :2], by_hand(cache, [3], 2, 1)[0])


def test_widening_stops_at_the_longest_row():
    """Doubling stops at max_tokens (+ the dummy column); a window past it still gets its columns."""
    cache = pool()
    tables = torch.tensor([[3, 7, 1, 2]])
    kv = DecodeKV(cache, max_tokens=3 * BS)
    kv.select(1, None, None, torch.tensor([0]))
    kv.fit(tables, 2 * BS)
    kv.fit(tables, 2 * BS + 1)
    assert kv.width == 3 * BS + 1  # not 2 x (2 BS + 1)
    kv.fit(tables, 4 * BS)
    assert kv.width == 4 * BS + 1
    k, _ = kv.read(1, 4 * BS)
    assert torch.equal(k[0, :, :2 * BS], by_hand(cache, [3, 7], 2 * BS, 1)[0])  # loaded at the first fit, kept
