"""Paged decode attention: FlexAttention over the blocks in place against the gather + SDPA reference.

On CPU flex runs compiled (inductor's C++ flex kernel; ~10 s to compile per head shape, once per
process). fp32 throughout; the two paths differ by summation order only: max |diff| <= 1e-5
(measured ~1e-6). Shapes: Qwen2.5-0.5B's attention (14 query heads, 2 K/V heads, head_dim 64) and
the tiny test model's (4 / 2 / 16); block_size 16; ragged rows from 1 token to many blocks; rows
that share their prefix blocks. Then whole sampled turns through the engine with either path.

    .venv/bin/pytest tests/test_paged_attention.py -q
"""
import sqlite3
import warnings
from dataclasses import replace

import pytest
import torch

from engine import paged_attention as pa
from model import Transformer
from toy import tiny
from config import DataConfig, EnvConfig, SamplingConfig
from engine.engine import Engine
from rollout import generate, rollout
from engine.sampling import StopChecker

torch.set_num_threads(2)
TOL = 1e-5
BS = 16


def paged_case(H, Hk, D, lengths, shared=(), n_blocks=80, seed=0):
    """A pool of random K/V and one decode step: row b holds lengths[b] tokens (its new token is the
    last, at position lengths[b] - 1). shared: (a, b, k) -> row b's first k blocks are row a's.
    Blocks are drawn from a shuffled pool, so a row's blocks are scattered. Returns
    (cache, tables (B, NB), positions (B, 1), slots (B, 1), q (B, 1, H, D), k, v (B, 1, Hk, D))."""
    g = torch.Generator().manual_seed(seed)
    cache = pa.PagedKVCache(1, n_blocks, BS, Hk, D, torch.float32, "cpu")
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    free = torch.randperm(n_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lengths]
    for a, b, k in shared:
        tables[b][:k] = tables[a][:k]
    NB = max(map(len, tables))
    table = torch.tensor([t + [cache.scratch] * (NB - len(t)) for t in tables])
    positions = torch.tensor(lengths)[:, None] - 1
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lengths)])[:, None]
    B = len(lengths)
    q = torch.randn(B, 1, H, D, generator=g)
    k, v = torch.randn(B, 1, Hk, D, generator=g), torch.randn(B, 1, Hk, D, generator=g)
    return cache, table, positions, slots, q, k, v


def run(path, cache, table, positions, slots, q, k, v):
    cache.attention = path
    plan = pa.prepare(pa.PagedBatch(cache, slots, table), positions)
    return pa.attend(q, k, v, plan, 0)


def by_hand(cache, tables, positions, q):
    """Attention of each row over its tokens, read block by block in Python (fp64)."""
    out = []
    for b in range(q.shape[0]):
        n = int(positions[b, 0]) + 1
        idx = [int(tables[b, p // BS]) * BS + p % BS for p in range(n)]
        keys = cache.k[0].reshape(-1, *cache.k.shape[3:])[idx].double()  # (n, Hk, D)
        vals = cache.v[0].reshape(-1, *cache.v.shape[3:])[idx].double()
        H, Hk = q.shape[2], keys.shape[1]
        kh, vh = keys.repeat_interleave(H // Hk, 1), vals.repeat_interleave(H // Hk, 1)  # (n, H, D)
        scores = torch.einsum("hd,nhd->hn", q[b, 0].double(), kh) / q.shape[-1] ** 0.5
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), vh))
    return torch.stack(out)[:, None].float()  # (B, 1, H, D)


# -----------------------------------------------------------------------------
# one decode step


@pytest.mark.parametrize("H,Hk,D", [(14, 2, 64), (4, 2, 16)])
def test_flex_equals_gather_on_ragged_rows_and_shared_blocks(H, Hk, D):
    # 1 token; a block exactly full; one past it; many blocks; rows 4 and 5 share row 3's first 5
    # blocks (samples of one prompt), then go on in blocks of their own
    lengths = [1, 16, 17, 300, 90, 100, 33]
    case = paged_case(H, Hk, D, lengths, shared=[(3, 4, 5), (3, 5, 5)])
    gather = run("gather", *case)
    flex = run("flex", *case)
    assert (flex - gather).abs().max() <= TOL
    cache, table, positions = case[:3]
    assert (gather - by_hand(cache, table, positions, case[4])).abs().max() <= TOL  # the reference itself


def test_flex_reads_only_each_rows_own_tokens():
    """Tokens after a row's position (in its last block and in the blocks its table lists past it)
    and other rows' blocks never leak in: changing them leaves the output as it was."""
    cache, table, positions, slots, q, k, v = paged_case(4, 2, 16, [5, 40, 21], n_blocks=20, seed=1)
    before = run("flex", cache, table, positions, slots, q, k, v)
    flat = cache.k[0].view(-1, 2, 16)
    used = {int(table[b, p // BS]) * BS + p % BS for b in range(3) for p in range(int(positions[b, 0]) + 1)}
    unused = torch.tensor(sorted(set(range(flat.shape[0])) - used))
    flat[unused] = 1e3  # would dominate any softmax that saw them
    cache.v[0].view(-1, 2, 16)[unused] = 1e3
    after = run("flex", cache, table, positions, slots, q, k, v)
    assert (after - before).abs().max() <= TOL


def test_single_row_and_batch_of_one():
    case = paged_case(4, 2, 16, [37], seed=2)
    assert (run("flex", *case) - run("gather", *case)).abs().max() <= TOL


def test_paths_resolve_and_bad_names_are_clear():
    assert pa.resolve("auto", torch.device("cpu"), 16) == "gather"
    assert pa.resolve("auto", torch.device("cuda"), 16) == "flex"
    assert pa.resolve("flex", torch.device("cpu"), 16) == "flex"
    with pytest.raises(ValueError, match="paged_attention='fast'.*auto, gather, flex"):
        pa.resolve("fast", torch.device("cpu"), 16)
    with pytest.raises(ValueError, match="block_size a multiple of 16"):
        pa.resolve("flex", torch.device("cuda"), 8)


def test_auto_falls_back_to_gather_when_flex_fails(monkeypatch):
    """auto: a flex that cannot be built warns once and the cache decodes by gather from then on;
    flex asked for by name raises."""
    case = paged_case(4, 2, 16, [3, 20], seed=3)
    want = run("gather", *case)

    def broken(*a, **kw):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(pa, "flex_decode", broken)
    cache = case[0]
    cache.fallback = True
    with pytest.warns(UserWarning, match="FlexAttention failed.*no kernel"):
        got = run("flex", *case)
    assert cache.attention == "gather" and (got - want).abs().max() <= TOL
    cache.fallback = False
    with pytest.raises(RuntimeError, match="no kernel"):
        run("flex", *case)


# -----------------------------------------------------------------------------
# whole turns through the engine


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    tiny.build_tiny_tokenizer(d, vocab_size=512)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(d)
    model = tiny.build_tiny_model(Transformer, d, vocab_size=len(tok), hidden_size=64, layers=2, heads=4, kv_heads=2)
    with torch.no_grad():  # peaked distributions, as tests/test_engine.py
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(8.0)
    return tok, model


def test_seeded_turns_sample_the_same_tokens_with_flex_and_gather(tok_model):
    """Ragged prompts (repeats share their prompt blocks), turns crossing several 16-token blocks,
    decode windows of 4, rows ending at different steps: the same tokens and logprobs."""
    tok, model = tok_model
    # a clean compile cache: flex's compile here must not depend on what earlier tests of the process
    # compiled (on the H200 it failed once after other tests of its xdist worker, and passed alone)
    torch._dynamo.reset()
    texts = ["How many singers do we have?", "SELECT name FROM stadium WHERE capacity > 5000 ORDER BY", "x",
             "Zürich café 東京 <think>" * 3]
    prompts = [tok.encode(t) for t in texts] * 2
    cfg = SamplingConfig(temperature=0.9, top_p=0.95, max_new_tokens=40, max_context=1024, decode_steps_per_sync=4)
    stops = ["</sql>", "</solution>"]
    gather = generate(model, prompts, replace(cfg, paged_attention="gather"), stops, tok, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no silent fallback
        flex = generate(model, prompts, replace(cfg, paged_attention="flex"), stops, tok, seed=7)
    assert [t.ids for t in flex] == [t.ids for t in gather]
    assert max(len(t.ids) - len(p) for t, p in zip(gather, prompts)) > 2 * BS  # rows span several blocks
    for a, b in zip(flex, gather):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=TOL, rtol=0)


class ToolCall:
    """A logits hook: each row's first turn writes 3 sampled tokens, then a tool call (forced)."""

    def __init__(self, tok):
        self.call = tok.encode(" <sql>SELECT count(*) FROM pet</sql>")

    def __call__(self, logits, rows):
        logits = logits.clone()
        for b, r in enumerate(rows):
            j = len(r.ids) - r.turn_start - 3
            if r.num_turns == 1 and 0 <= j < len(self.call):
                logits[b] = float("-inf")
                logits[b, self.call[j]] = 0.0
        return logits


def test_seeded_multi_turn_rollout_is_the_same_with_flex_and_gather(tok_model, tmp_path):
    """Two samples per question share their prompt's blocks (copied on write), observations are
    prefilled into rows that have cached tokens (those chunks gather), the next turns decode
    through flex: the same episodes as with gather everywhere."""
    tok, model = tok_model
    con = sqlite3.connect(tmp_path / "pets.sqlite")
    con.execute("CREATE TABLE pet (id INTEGER PRIMARY KEY, name TEXT, age INT)")
    con.executemany("INSERT INTO pet VALUES (?, ?, ?)", [(i, f"pet{i}", i % 7) for i in range(40)])
    con.commit()
    con.close()
    exs = [{"id": f"q{i}", "source": "toy", "db_id": "pets", "db_path": "pets.sqlite", "question": q,
            "evidence": "", "gold_sql": "SELECT count(*) FROM pet"}
           for i, q in enumerate(["How many pets are there?", "What is the name of the oldest pet?"])]
    ecfg, data = EnvConfig(max_turns=2, workers=1), DataConfig(prompt_template="compact")
    cfg = SamplingConfig(temperature=0.9, top_p=0.95, max_new_tokens=24, max_context=1024)
    runs = {path: rollout(model, tok, exs, ecfg, replace(cfg, paged_attention=path), data, str(tmp_path), n=2,
                          seed=5, logits_hook=ToolCall(tok))
            for path in ("gather", "flex")}
    assert [t.ids for t in runs["flex"]] == [t.ids for t in runs["gather"]]
    assert all(t.num_tool_calls == 1 and t.num_turns == 2 for t in runs["gather"])
    for a, b in zip(runs["flex"], runs["gather"]):
        assert a.loss_mask == b.loss_mask
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=TOL, rtol=0)


def test_engine_attention_path_by_config_and_device(tok_model):
    """sampling.paged_attention: flex named stays flex on a CPU; auto is gather there."""
    _, model = tok_model
    cfg = SamplingConfig(max_new_tokens=8, max_context=64, paged_attention="flex")
    with Engine(model, cfg, StopChecker(None, [], []), worst_case=[64]) as engine:
        assert engine.cache.attention == "flex"
    with Engine(model, replace(cfg, paged_attention="auto"), StopChecker(None, [], []), worst_case=[64]) as engine:
        assert engine.cache.attention == "gather"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's CUDA kernels need a GPU (bench/gpu.sh)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_flex_equals_gather_on_cuda(dtype, tol):
    cache, table, positions, slots, q, k, v = paged_case(14, 2, 64, [1, 16, 17, 300, 90, 100, 33],
                                                         shared=[(3, 4, 5), (3, 5, 5)])
    dev = torch.device("cuda")
    cache.k, cache.v = cache.k.to(dev, dtype), cache.v.to(dev, dtype)
    args = [t.to(dev) for t in (table, positions, slots)] + [t.to(dev, dtype) for t in (q, k, v)]
    gather, flex = run("gather", cache, *args), run("flex", cache, *args)
    assert (flex.float() - gather.float()).abs().max() <= tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's CUDA kernels need a GPU (bench/gpu.sh)")
@pytest.mark.parametrize("graphs", [False, True])
def test_seeded_turns_on_cuda_sample_the_same_tokens_with_flex_and_gather(tok_model, graphs):
    """The engine on CUDA (fp32): flex in place, eager or replayed from CUDA graphs, against gather."""
    import copy
    tok, model = tok_model
    gpu = copy.deepcopy(model).cuda()
    prompts = [tok.encode(t) for t in ["How many singers?", "SELECT name FROM", "x", "Zürich café <think>" * 4]] * 3
    cfg = SamplingConfig(temperature=0.9, top_p=0.95, max_new_tokens=40, max_context=1024, cuda_graphs=graphs)
    stops = ["</sql>", "</solution>"]
    gather = generate(gpu, prompts, replace(cfg, paged_attention="gather"), stops, tok, seed=2)
    flex = generate(gpu, prompts, replace(cfg, paged_attention="flex"), stops, tok, seed=2)
    assert [t.ids for t in flex] == [t.ids for t in gather]
    for a, b in zip(flex, gather):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
