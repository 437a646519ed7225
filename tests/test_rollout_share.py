"""rollout.rollout's batching of the engine's work: a prompt's n samples share one prefill, and
env.tool_wait (fixed | async) decides when rows whose tool calls ran rejoin.

Through rollout.rollout itself, multi-turn: prefilled tokens and peak KV blocks (engine
counters), each row's tokens and logprobs equal to an unshared run, prompts of equal length but
different ids never share; a slow tool call (an injected env.step_batch that blocks) holds the
other rows in fixed mode and not in async mode, and both modes sample the same tokens.

    .venv/bin/pytest tests/test_rollout_share.py -q
"""
import random
import sqlite3
import threading
import time
from dataclasses import replace

import pytest
import torch

import env
import rollout as rollout_module
from engine import scheduler as scheduler_module
from model import Transformer
from toy import tiny
from engine.block_manager import BlockManager
from config import DataConfig, EnvConfig, SamplingConfig
from rollout import rollout
from sqltask.tool_calls import ToolCalls
from sqltask.chat import render_prompt
from engine.scheduler import Scheduler, Sequence

torch.set_num_threads(2)
DATA = DataConfig(prompt_template="compact")
SAMPLING = SamplingConfig(temperature=0.9, top_p=1.0, top_k=0, max_new_tokens=24, max_context=1024, block_size=4)


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    tiny.build_tiny_tokenizer(d, vocab_size=512)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(d)
    model = tiny.build_tiny_model(Transformer, d, vocab_size=len(tok), hidden_size=64, layers=2, heads=4, kv_heads=2)
    with torch.no_grad():  # sharpen N(0, 0.02) weights: rows that attend to other K/V sample other tokens
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(8.0)
    return tok, model


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    d = tmp_path_factory.mktemp("db")
    con = sqlite3.connect(d / "pets.sqlite")
    con.execute("CREATE TABLE pet (id INTEGER PRIMARY KEY, name TEXT, age INT)")
    con.executemany("INSERT INTO pet VALUES (?, ?, ?)", [(i, f"pet{i}", i % 7) for i in range(20)])
    con.commit()
    con.close()
    return d


def example(question):
    return {"id": question, "source": "toy", "db_id": "pets", "db_path": "pets.sqlite", "question": question,
            "evidence": "", "gold_sql": "SELECT count(*) FROM pet"}


def equal_length_examples(tok, db):
    """Two examples whose prompts have the same length and different ids (a grouping by length
    would share them)."""
    lens = {}
    for word in ["pets", "cats", "dogs", "rows", "ages", "names", "birds", "fish"]:
        ex = example(f"How many {word} are there?")
        lens.setdefault(len(render_prompt(tok, ex, DATA, "tags", str(db))), []).append(ex)
    pair = next(exs[:2] for exs in lens.values() if len(exs) >= 2)
    prompts = [render_prompt(tok, ex, DATA, "tags", str(db)) for ex in pair]
    assert len(prompts[0]) == len(prompts[1]) and prompts[0] != prompts[1]
    return pair


class Script:
    """A logits hook: row `index`, turn k samples `free` tokens freely (EOS forbidden), then is forced
    to write a tool call (turns before its last) or its answer. Rows that attended to the wrong K/V
    sample other free tokens and logprobs."""

    def __init__(self, tok, tools_of=lambda index: index % 2, free_of=lambda index, turn: 2 + (index + turn) % 3,
                 sql_of=lambda index: "SELECT count(*) FROM pet"):
        self.tok, self.tools_of, self.free_of, self.sql_of = tok, tools_of, free_of, sql_of
        self.eos = rollout_module.eos_ids(tok)

    def forced(self, index, turn):
        text = f"<sql>{self.sql_of(index)}</sql>" if turn <= self.tools_of(index) else \
            "<solution>SELECT count(*) FROM pet</solution>"
        return self.tok.encode(text, add_special_tokens=False)

    def __call__(self, logits, rows):
        logits = logits.clone()
        logits[:, self.eos] = float("-inf")
        for b, r in enumerate(rows):
            forced = self.forced(r.index, r.num_turns)
            j = len(r.ids) - r.turn_start - self.free_of(r.index, r.num_turns)
            if 0 <= j < len(forced):
                logits[b] = float("-inf")
                logits[b, forced[j]] = 0.0
        return logits


# -----------------------------------------------------------------------------
# one prefill per distinct prompt


def test_scheduler_groups_identical_prompts_across_adds_never_equal_lengths():
    """Identical prompts queued by separate add() calls form one group; a prompt of the same
    length with other ids is its own group; a prompt queued after its group was prefilled starts
    a new one."""
    sched = Scheduler(BlockManager(64, 4))
    a1, a2 = Sequence([1, 2, 3, 4, 5], key=0, index=0), Sequence([1, 2, 3, 4, 5], key=1, index=1)
    b = Sequence([1, 2, 3, 4, 6], key=2, index=2)  # same length, other ids
    for s in (a1, b, a2):
        sched.add([s])
    batch = sched.schedule()
    assert batch.kind == "prefill" and batch.seqs == [a1, b] and batch.chunks == [5, 5]
    assert a1.followers == [a2] and b.followers == []
    assert sched.prefilled_prompt_tokens == sched.prefilled_tokens == 10
    late = Sequence([1, 2, 3, 4, 5], key=3, index=3)
    sched.add([late])
    assert sched.new_groups == {(1, 2, 3, 4, 5): [late]}


def unshared(monkeypatch):
    """Scheduler.add as before sharing across calls: every sequence its own group (the reference)."""
    add = Scheduler.add

    def one_group_each(self, seqs):
        for s in seqs:
            self.new_groups.clear()
            add(self, [s])
    monkeypatch.setattr(scheduler_module.Scheduler, "add", one_group_each)


def test_rollout_prefills_each_prompt_once_and_rows_equal_unshared(tok_model, db, monkeypatch):
    """2 examples with prompts of equal length x n=4, tool turns then answers: each prompt is
    prefilled once (an observation only extends its own row), fewer blocks at peak, and every
    row's tokens, logprobs, masks and turns equal a run where nothing is shared."""
    tok, model = tok_model
    exs = equal_length_examples(tok, db)
    ecfg = EnvConfig(max_turns=3, workers=1)
    n, hook = 4, Script(tok)
    shared_stats, ref_stats = {}, {}
    got = rollout(model, tok, exs, ecfg, SAMPLING, DATA, str(db), n=n, seed=3, logits_hook=hook, stats=shared_stats)
    with monkeypatch.context() as patch:
        unshared(patch)
        want = rollout(model, tok, exs, ecfg, SAMPLING, DATA, str(db), n=n, seed=3, logits_hook=hook, stats=ref_stats)
    prompt_len = len(got[0].prompt_ids)
    assert shared_stats["prompt_prefill_tokens"] == 2 * prompt_len  # once per distinct prompt
    assert ref_stats["prompt_prefill_tokens"] == 2 * n * prompt_len
    # every other prefilled token: a turn's last sampled token + the observation after it
    continued = sum(b0 - a1 + 1 for t in got for (_, a1), (b0, _) in zip(t.turn_spans, t.turn_spans[1:]))
    assert sum(t.num_tool_calls for t in got) == 4 and continued > 0  # odd rows call a tool first
    assert shared_stats["evictions"] == 0 and shared_stats["prefill_tokens"] == 2 * prompt_len + continued
    assert shared_stats["peak_blocks"] < ref_stats["peak_blocks"]
    for g, w in zip(got, want):
        assert g.ids == w.ids and g.loss_mask == w.loss_mask and g.turn_spans == w.turn_spans
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-6, rtol=0)
        assert (g.end_reason, g.num_tool_calls, g.steps) == (w.end_reason, w.num_tool_calls, w.steps)
    samples = [g.ids[len(g.prompt_ids):g.turn_spans[0][0] + 2] for g in got]
    assert len(set(map(tuple, samples))) > n  # rows sampled their own tokens (not one per prompt)


def test_shared_rows_equal_unshared_under_evictions(tok_model, db, monkeypatch):
    """A pool far below the work: shared rows are evicted and recomputed; nothing changes."""
    tok, model = tok_model
    exs = equal_length_examples(tok, db)
    ecfg = EnvConfig(max_turns=3, workers=1)
    prompt_len = len(render_prompt(tok, exs[0], DATA, "tags", str(db)))
    ref_cfg = replace(SAMPLING, max_context=prompt_len + 200)  # the pool must hold one worst case
    cfg = replace(ref_cfg, kv_budget_tokens=prompt_len + 200)
    stats = {}
    got = rollout(model, tok, exs, ecfg, cfg, DATA, str(db), n=4, seed=4, logits_hook=Script(tok), stats=stats)
    with monkeypatch.context() as patch:
        unshared(patch)
        want = rollout(model, tok, exs, ecfg, ref_cfg, DATA, str(db), n=4, seed=4, logits_hook=Script(tok))
    assert stats["evictions"] > 0
    for g, w in zip(got, want):  # a recomputed row's logits come from a prefill forward: ~1e-6 apart
        assert g.ids == w.ids and g.turn_spans == w.turn_spans
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)


# -----------------------------------------------------------------------------
# env.tool_wait


SLOW_SQL = "SELECT name FROM pet"  # row 0's tool call; the injected step_batch holds its batch


def slow_step_batch(monkeypatch, others: int, hold_s: float):
    """env.step_batch where a batch holding SLOW_SQL waits until the `others` other rows have had
    their answers stepped (or hold_s passes). Returns a dict: whether the others finished first."""
    real, done, seen = env.step_batch, threading.Event(), []
    lock = threading.Lock()
    record = {}

    def step_batch(db_paths, texts, turns_left, cfg):
        if any(SLOW_SQL in t for t in texts):
            record["others_first"] = done.wait(hold_s)
            return real(db_paths, texts, turns_left, cfg)
        out = real(db_paths, texts, turns_left, cfg)
        with lock:
            seen.extend(t for t in texts if "<solution>" in t)
            if len(seen) >= others:
                done.set()
        return out
    monkeypatch.setattr(env, "step_batch", step_batch)
    return record


@pytest.mark.parametrize("tool_wait", ["fixed", "async"])
def test_slow_tool_call_holds_only_its_row_in_async(tok_model, db, monkeypatch, tool_wait):
    """Row 0's tool call is slow. fixed: the loop waits for it at its due step, so the other rows
    cannot finish first (the slow call times out its hold). async: the others decode, run their
    own tool calls and answer while it is held. Both sample exactly what an unhurried run does."""
    tok, model = tok_model
    ex = example("How many pets are there?")
    n = 4
    hook = Script(tok, tools_of=lambda i: 1, free_of=lambda i, turn: 1 if i == 0 else 3,
                  sql_of=lambda i: SLOW_SQL if i == 0 else "SELECT count(*) FROM pet")
    ecfg = EnvConfig(max_turns=3, workers=1)
    want = rollout(model, tok, [ex], ecfg, SAMPLING, DATA, str(db), n=n, seed=5, logits_hook=hook)
    # fixed: the others' calls queue behind the held one, so they can never answer first: a short
    # hold ends it; async: a bound far above the time the others need on a loaded machine
    hold_s = 1.0 if tool_wait == "fixed" else 120.0
    record = slow_step_batch(monkeypatch, others=n - 1, hold_s=hold_s)
    t0 = time.perf_counter()
    got = rollout(model, tok, [ex], EnvConfig(max_turns=3, workers=1, tool_wait=tool_wait), SAMPLING, DATA,
                  str(db), n=n, seed=5, logits_hook=hook)
    seconds = time.perf_counter() - t0
    assert record["others_first"] == (tool_wait == "async")
    if tool_wait == "async":
        assert seconds < hold_s  # nobody waited for the hold to run out
    for g, w in zip(got, want):
        assert g.ids == w.ids and g.turn_spans == w.turn_spans and g.steps == w.steps
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)  # other batches: fp32 sums ~1e-6 apart
    assert [g.num_tool_calls for g in got] == [1] * n and {g.end_reason for g in got} == {"answer"}


def test_async_samples_equal_fixed_with_random_tool_delays(tok_model, db, monkeypatch):
    """Tool results that arrive after random delays change which steps rows rejoin at, never what
    any row samples."""
    tok, model = tok_model
    exs = equal_length_examples(tok, db)
    ecfg = EnvConfig(max_turns=3, workers=1)
    want = rollout(model, tok, exs, ecfg, SAMPLING, DATA, str(db), n=3, seed=6, logits_hook=Script(tok))
    real, rng = env.step_batch, random.Random(0)

    def jittered(*args):
        time.sleep(rng.uniform(0, 0.05))
        return real(*args)
    monkeypatch.setattr(env, "step_batch", jittered)
    got = rollout(model, tok, exs, EnvConfig(max_turns=3, workers=1, tool_wait="async"), SAMPLING, DATA, str(db),
                  n=3, seed=6, logits_hook=Script(tok))
    for g, w in zip(got, want):
        assert g.ids == w.ids and g.turn_spans == w.turn_spans and g.steps == w.steps
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)  # other batches: fp32 sums ~1e-6 apart


def test_unknown_tool_wait_is_a_clear_error():
    with pytest.raises(ValueError, match="env.tool_wait='sometimes'"):
        ToolCalls(EnvConfig(tool_wait="sometimes"), env.step_batch)
