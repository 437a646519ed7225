"""The rollout engine against an independent reference: one trajectory at a time, a full forward
(no cache) per sampled token, and the episode rules written out plainly.

Same tokens, same logprobs (<= 1e-5, fp32), same masks, turn spans, stop reasons, tool calls and
env records, for greedy and sampled decoding, both conversation formats, and budgets small
enough to force the engine to evict and recompute rows. A logits hook scripts what the random
model writes after a few freely sampled tokens (tool calls, bad SQL, answers, EOS, rambling), so
every episode rule is exercised.

    .venv/bin/pytest tests/test_engine.py -q
"""
import random
import sqlite3
from dataclasses import replace

import pytest
import torch

import env
import rollout as rollout_module
from toy import tiny
from config import DataConfig, EnvConfig, SamplingConfig
from model import Transformer
from rollout import generate, rollout
from sqltask.chat import conversation_wrapper, eos_ids, render_prompt
from engine.sampling import StopChecker, row_key, sample_next
from engine.scheduler import Sequence

torch.set_num_threads(2)
STOPS = ["</sql>", "</solution>"]
SCRIPT_SEED = 1
SHARPEN = 8.0  # entropy ~5.3 nats of 6.2; logits small enough that cached and full forwards agree to ~5e-6


# -----------------------------------------------------------------------------
# fixtures: a tiny random model with peaked distributions, a real SQLite database


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    tiny.build_tiny_tokenizer(d, vocab_size=512)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(d)
    model = tiny.build_tiny_model(Transformer, d, vocab_size=len(tok), hidden_size=64, layers=2, heads=4, kv_heads=2)
    with torch.no_grad():  # N(0, 0.02) weights give near-uniform logits; sharpen them
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(SHARPEN)
    return tok, model


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    d = tmp_path_factory.mktemp("db")
    con = sqlite3.connect(d / "pets.sqlite")
    con.execute("CREATE TABLE pet (id INTEGER PRIMARY KEY, name TEXT, age INT)")
    con.executemany("INSERT INTO pet VALUES (?, ?, ?)", [(i, f"pet{i}", i % 7) for i in range(40)])
    con.commit()
    con.close()
    return d


def examples():
    qs = ["How many pets are there?", "What is the name of the oldest pet, and how old is it exactly?"]
    return [{"id": f"q{i}", "source": "toy", "db_id": "pets", "db_path": "pets.sqlite", "question": q,
             "evidence": "", "gold_sql": "SELECT count(*) FROM pet"} for i, q in enumerate(qs)]


DATA = DataConfig(prompt_template="compact")  # short prompts: the reference is a full forward per token


def scfg(**kw):
    return replace(SamplingConfig(temperature=0.9, top_p=0.95, top_k=0, max_new_tokens=20,
                                  max_context=1024), **kw)


# -----------------------------------------------------------------------------
# scripted behaviour: after a few sampled tokens, force a text (one token per step)

ACTIONS = ["<sql>SELECT count(*) FROM pet</sql>", "<sql>SELECT name, age FROM pet WHERE age > 4</sql>",
           "<sql>SELECT nope FROM pet</sql>", "<think>x</think>\n<sql>SELECT max(age) FROM pet</sql>",
           "<solution>SELECT count(*) FROM pet</solution>", "<think>no tags</think>{eos}",
           None]  # None: ramble until max_new_tokens


class Script:
    """A logits hook: trajectory `index`, turn k writes `free` sampled tokens, then the scripted
    action's tokens (logits -inf elsewhere). What each (index, turn) does is drawn from `seed`."""

    def __init__(self, tok, seed, actions=ACTIONS):
        self.tok, self.seed, self.actions = tok, seed, actions
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")

    def plan(self, index, turn):
        rng = random.Random(self.seed * 1_000_003 + index * 1009 + turn)
        action = rng.choice(self.actions)
        forced = None if action is None else self.tok.encode(action.replace("{eos}", ""))
        if action is not None and "{eos}" in action:
            forced = forced + [self.eos]
        return rng.randint(0, 4), forced

    def __call__(self, logits, rows):
        logits = logits.clone()
        for b, r in enumerate(rows):
            free, forced = self.plan(r.index, r.num_turns)
            j = len(r.ids) - r.turn_start - free
            if forced is not None and 0 <= j < len(forced):
                logits[b] = float("-inf")
                logits[b, forced[j]] = 0.0
        return logits


class HookRow:  # what the hook sees of a row: ids, turn_start, num_turns, index
    def __init__(self, ids, turn_start, num_turns, index):
        self.ids, self.turn_start, self.num_turns, self.index = ids, turn_start, num_turns, index


# -----------------------------------------------------------------------------
# the reference: no cache, one row at a time, the rules written out


@torch.no_grad()
def ref_turn(model, ids, key, index, num_turns, cfg, stopper, greedy, hook):
    """Sample one turn onto ids in place. Returns (new logprobs, stop reason)."""
    start = len(ids)
    budget = min(cfg.max_new_tokens, cfg.max_context - len(ids))
    lps = []
    while True:
        logits = model(torch.tensor([ids]))[:, -1].float()  # (1, V) full forward, no cache
        if hook is not None:
            logits = hook(logits, [HookRow(ids, start, num_turns, index)])
        tok, lp = sample_next(logits, torch.tensor([key]), torch.tensor([len(ids)]), temperature=cfg.temperature,
                              top_p=cfg.top_p, top_k=cfg.top_k, greedy=greedy)
        ids.append(int(tok))
        lps.append(float(lp))
        reason = stopper.check(ids, start)
        if reason is None and len(ids) - start >= budget:
            reason = "max_context" if budget < cfg.max_new_tokens else "length"
        if reason:
            return lps, reason


def ref_rollout(model, tok, exs, ecfg, cfg, db_root, *, n, seed, greedy, hook=None):
    conv = ecfg.conversation == "conversation"
    stopper = StopChecker(tok, env.STOP_STRINGS[ecfg.protocol], eos_ids(tok), model.config.vocab_size)
    close, before, after = conversation_wrapper(tok) if conv else ("", "", "")
    close_id = tok.convert_tokens_to_ids(close) if close else None
    out = []
    for i, ex in enumerate(exs):
        prompt = render_prompt(tok, ex, DATA, ecfg.protocol, db_root)
        for j in range(n):
            index = i * n + j
            t = dict(ids=list(prompt), mask=[0] * len(prompt), lps=[0.0] * len(prompt), spans=[], turns=0,
                     tools=0, final_sql="", finished=False, reason="", steps=[])
            ids = t["ids"]
            if len(ids) >= cfg.max_context:
                t["reason"] = "context"
            while not t["reason"]:
                t["turns"] += 1
                start = len(ids)
                lps, why = ref_turn(model, ids, row_key(seed, index), index, t["turns"], cfg, stopper, greedy, hook)
                t["mask"] += [1] * len(lps)
                t["lps"] += lps
                t["spans"].append((start, len(ids)))
                if why == "max_context" or (why == "eos" and not conv):
                    t["reason"] = "context" if why == "max_context" else "eos"
                    break
                left = ecfg.max_turns - t["turns"]
                res = env.step_batch([str(db_root / ex["db_path"])], [tok.decode(ids[start:])], [left], ecfg)[0]
                t["steps"].append(env.step_record(res))
                t["tools"] += res.action.kind in ("sql", "describe", "sample", "query")
                if res.action.kind in ("solution", "answer"):
                    t.update(finished=True, final_sql=res.action.arg, reason="answer")
                elif left <= 0:  # the budget's last turn: cut by max_new_tokens, or ended without an answer
                    t["reason"] = "turn_cut" if why == "length" else "turn_budget"
                else:
                    obs = res.observation
                    if conv:
                        obs = ("" if ids[-1] == close_id else close) + before + obs.strip() + after
                    obs_ids = tok.encode(obs, add_special_tokens=False)
                    if len(ids) + len(obs_ids) >= cfg.max_context:
                        t["reason"] = "context"
                    else:
                        ids += obs_ids
                        t["mask"] += [0] * len(obs_ids)
                        t["lps"] += [0.0] * len(obs_ids)
            t["text"] = tok.decode(ids[len(prompt):])
            out.append(t)
    return out


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.ids == w["ids"]
        assert g.loss_mask == w["mask"]
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w["lps"]), atol=1e-5, rtol=0)
        assert (g.turn_spans, g.num_turns, g.num_tool_calls) == (w["spans"], w["turns"], w["tools"])
        assert (g.end_reason, g.finished, g.final_sql) == (w["reason"], w["finished"], w["final_sql"])
        assert g.steps == w["steps"] and g.text == w["text"]


# -----------------------------------------------------------------------------
# single turn


@pytest.mark.parametrize("greedy,top_k,top_p", [(True, 0, 1.0), (False, 0, 1.0), (False, 5, 1.0), (False, 0, 0.8)])
def test_generate_matches_reference(tok_model, greedy, top_k, top_p):
    tok, model = tok_model
    texts = ["How many singers do we have?", "SELECT name FROM stadium WHERE capacity > 5000 ORDER BY",
             "x", "Zürich café 東京 <think>" * 3]
    prompts = [tok.encode(t) for t in texts]
    prompts = prompts + prompts[:2]  # repeated prompts share one prefill
    cfg = scfg(top_k=top_k, top_p=top_p, max_new_tokens=24)
    eos = eos_ids(tok)
    stopper = StopChecker(tok, STOPS, eos, model.config.vocab_size)
    got = generate(model, prompts, cfg, STOPS, tok, seed=3, greedy=greedy)
    for i, (p, g) in enumerate(zip(prompts, got)):
        ids = list(p)
        lps, why = ref_turn(model, ids, row_key(3, i), i, 1, cfg, stopper, greedy, None)
        assert g.ids == ids and g.turn_stop == why
        assert g.loss_mask == [0] * len(p) + [1] * len(lps)
        assert torch.allclose(torch.tensor(g.logprobs[len(p):]), torch.tensor(lps), atol=1e-5, rtol=0)
    if not greedy:  # the samples differ between repeats of a prompt (own keys), not between runs
        assert got[0].ids != got[4].ids


# -----------------------------------------------------------------------------
# multi-turn episodes


@pytest.mark.parametrize("conversation", ["single", "conversation"])
@pytest.mark.parametrize("greedy", [False, True])
def test_rollout_matches_reference(tok_model, db, conversation, greedy):
    tok, model = tok_model
    ecfg = EnvConfig(conversation=conversation, max_turns=3, workers=1)
    cfg = scfg(max_new_tokens=16)
    hook = Script(tok, seed=SCRIPT_SEED)
    got = rollout(model, tok, examples(), ecfg, cfg, DATA, str(db), n=3, seed=5, greedy=greedy,
                  logits_hook=hook)
    want = ref_rollout(model, tok, examples(), ecfg, cfg, db, n=3, seed=5, greedy=greedy, hook=hook)
    assert_same(got, want)
    reasons = {w["reason"] for w in want}
    assert "answer" in reasons and reasons & {"turn_budget", "turn_cut"}, reasons  # the script reaches both ends
    assert sum(w["tools"] for w in want) >= 3


@pytest.fixture
def engines(monkeypatch):
    """The engines rollout/generate build in a test, to read their counters."""
    made = []

    class Recording(rollout_module.Engine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(rollout_module, "Engine", Recording)
    return made


@pytest.mark.parametrize("budget", [1 << 20, 400])
def test_rollout_matches_reference_under_small_budgets(tok_model, db, engines, budget):
    """A KV budget far below the work (rows evicted and recomputed) and a max_context that cuts
    turns and refuses observations change nothing."""
    tok, model = tok_model
    ecfg = EnvConfig(max_turns=5, workers=1)
    prompt_len = len(render_prompt(tok, examples()[1], DATA, "tags", str(db)))
    cfg = scfg(max_new_tokens=16, max_context=prompt_len + 120, kv_budget_tokens=budget)
    hook = Script(tok, seed=2)
    got = rollout(model, tok, examples(), ecfg, cfg, DATA, str(db), n=4, seed=9, logits_hook=hook)
    want = ref_rollout(model, tok, examples(), ecfg, cfg, db, n=4, seed=9, greedy=False, hook=hook)
    assert_same(got, want)
    assert "context" in {w["reason"] for w in want}
    assert (engines[0].evictions > 0) == (budget == 400)


# -----------------------------------------------------------------------------
# prompts of equal token length: rows are told apart by their ids, never by their length

SAME_LENGTH = ["How many pets are there?", "How many dogs are there?"]  # 17 tokens each, one word apart


@pytest.mark.parametrize("greedy", [True, False])
def test_equal_length_prompts_each_match_their_own_reference_turn(tok_model, greedy):
    """Two prompts of the same length but different ids, 3 samples of each submitted together:
    every row equals the reference turn of its own prompt (a scheduler that grouped prompts by
    length would decode the second prompt's rows from the first one's cache)."""
    tok, model = tok_model
    distinct = [tok.encode(t) for t in SAME_LENGTH]
    assert len(distinct[0]) == len(distinct[1]) and distinct[0] != distinct[1]
    prompts = [p for p in distinct for _ in range(3)]
    cfg = scfg(max_new_tokens=12)
    stopper = StopChecker(tok, STOPS, eos_ids(tok), model.config.vocab_size)
    got = generate(model, prompts, cfg, STOPS, tok, seed=4, greedy=greedy)
    turns = []
    for i, (p, g) in enumerate(zip(prompts, got)):
        ids = list(p)
        lps, why = ref_turn(model, ids, row_key(4, i), i, 1, cfg, stopper, greedy, None)
        assert g.prompt_ids == p and g.ids == ids and g.turn_stop == why
        assert torch.allclose(torch.tensor(g.logprobs[len(p):]), torch.tensor(lps), atol=1e-5, rtol=0)
        turns.append(ids[len(p):])
    assert turns[0] != turns[3]  # the two prompts' references differ: a mix-up cannot pass


def test_rollout_of_equal_length_prompts_matches_reference(tok_model, db):
    """Multi-turn: two questions whose rendered prompts have the same length, n=2 each; every
    episode equals the reference episode of its own question (observations included)."""
    tok, model = tok_model
    exs = [dict(examples()[0], id=f"same{i}", question=q) for i, q in enumerate(SAME_LENGTH)]
    rendered = [render_prompt(tok, ex, DATA, "tags", str(db)) for ex in exs]
    assert len(rendered[0]) == len(rendered[1]) and rendered[0] != rendered[1]
    ecfg = EnvConfig(max_turns=2, workers=1)
    cfg = scfg(max_new_tokens=12)
    hook = Script(tok, seed=SCRIPT_SEED)
    got = rollout(model, tok, exs, ecfg, cfg, DATA, str(db), n=2, seed=6, logits_hook=hook)
    want = ref_rollout(model, tok, exs, ecfg, cfg, db, n=2, seed=6, greedy=False, hook=hook)
    assert_same(got, want)
    assert [g.prompt_ids for g in got] == [r for r in rendered for _ in range(2)]


def test_budget_below_one_sequence_is_a_clear_error(tok_model):
    tok, model = tok_model
    with pytest.raises(ValueError, match="kv_budget_tokens=100 cannot hold one sequence of 124 tokens"):
        generate(model, [tok.encode("x" * 100)], scfg(max_new_tokens=24, kv_budget_tokens=100), STOPS, tok, seed=0)


# -----------------------------------------------------------------------------
# decode windows: tokens read back every few steps, turn ends found on the device


@pytest.fixture
def biased(tok_model):
    """The model with its logits pushed towards stop-string pieces, EOS and '>' (no logits hook,
    which would make every window one step): turns end on stop strings and EOS at random steps,
    and candidate tokens that end nothing ('>' alone) stop rows on the device by mistake."""
    tok, model = tok_model
    bias = torch.zeros(model.config.vocab_size)
    for text in ["</sql>", "</solution>", "<sql>SELECT count(*) FROM pet", ">", "<|im_end|>"]:
        bias[tok.encode(text)] += 3.0
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out + bias.to(out.dtype))
    yield tok, model
    handle.remove()


@pytest.mark.parametrize("window", [8, 3])
def test_decode_windows_match_reference(biased, window):
    tok, model = biased
    prompts = [tok.encode(t) for t in ["How many singers?", "SELECT name FROM", "x", "Zürich café <think>"]] * 2
    cfg = scfg(max_new_tokens=30, decode_steps_per_sync=window)
    stopper = StopChecker(tok, STOPS, eos_ids(tok), model.config.vocab_size)
    got = generate(model, prompts, cfg, STOPS, tok, seed=11)
    false_alarms = 0
    candidates = stopper.candidates(model.config.vocab_size)
    for i, (p, g) in enumerate(zip(prompts, got)):
        ids = list(p)
        lps, why = ref_turn(model, ids, row_key(11, i), i, 1, cfg, stopper, False, None)
        assert g.ids == ids and g.turn_stop == why
        assert torch.allclose(torch.tensor(g.logprobs[len(p):]), torch.tensor(lps), atol=1e-5, rtol=0)
        false_alarms += int(candidates[g.ids[len(p):-1]].sum())
    assert {"stop", "eos", "length"} <= {g.turn_stop for g in got}, [g.turn_stop for g in got]
    assert false_alarms > 0  # rows the device stopped on a token that ended nothing decoded on


def test_a_row_that_stops_mid_window_records_versions_only_for_its_tokens(biased):
    """Rows stop at different steps of windows of 8 (stop strings, EOS, their budget): each keeps a
    version for exactly the tokens it kept, the engine's version on its sampled tokens, 0 elsewhere."""
    from engine.engine import Engine
    tok, model = biased
    prompts = [tok.encode(t) for t in ["How many singers?", "SELECT name FROM", "x", "Zürich café <think>"]] * 2
    cfg = scfg(max_new_tokens=30, decode_steps_per_sync=8)
    stopper = StopChecker(tok, STOPS, eos_ids(tok), model.config.vocab_size)
    seqs = [Sequence(list(p), key=row_key(3, i), index=i) for i, p in enumerate(prompts)]
    with Engine(model, cfg, stopper, worst_case=[len(p) + 30 for p in prompts]) as engine:
        engine.version = 7
        engine.add(seqs)
        while engine.busy():
            for s in engine.step():
                engine.finish(s)
    sampled = [len(s.ids) - len(p) for s, p in zip(seqs, prompts)]
    assert any((n - 1) % 8 for n in sampled), sampled  # after the prefill's token, some ended mid-window
    for s in seqs:
        assert s.versions == [7 if m else 0 for m in s.loss_mask], (s.index, len(s.versions), len(s.ids))


def test_decode_window_by_device(biased):
    """decode_steps_per_sync 0 picks the window by device (windows save syncs on CUDA; on CPU they
    only hold finished rows); a set value wins; a negative one is refused."""
    from engine.engine import window_steps
    assert window_steps(scfg(decode_steps_per_sync=0), torch.device("cpu")) == 1
    assert window_steps(scfg(decode_steps_per_sync=0), torch.device("cuda")) == 8
    assert window_steps(scfg(decode_steps_per_sync=3), torch.device("cpu")) == 3
    from engine.engine import Engine
    with pytest.raises(ValueError, match="decode_steps_per_sync"):
        Engine(biased[1], scfg(decode_steps_per_sync=-1), StopChecker(None, [], []), worst_case=[64])


def test_rollout_with_decode_windows_matches_reference(biased, db, engines):
    """Multi-turn, a KV budget that evicts, windows of 4: the same episodes as the reference."""
    tok, model = biased
    ecfg = EnvConfig(max_turns=3, workers=1)
    prompt_len = len(render_prompt(tok, examples()[1], DATA, "tags", str(db)))
    cfg = scfg(max_new_tokens=16, max_context=prompt_len + 120, kv_budget_tokens=400, decode_steps_per_sync=4)
    got = rollout(model, tok, examples(), ecfg, cfg, DATA, str(db), n=3, seed=4)
    want = ref_rollout(model, tok, examples(), ecfg, cfg, db, n=3, seed=4, greedy=False)
    assert_same(got, want)
    assert max(w["turns"] for w in want) >= 2 and engines[0].evictions > 0


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="decode windows replayed from CUDA graphs need a CUDA GPU (bench/gpu.sh runs the suite on one)")
def test_decode_windows_with_cuda_graphs_match_eager_on_cuda(tok_model):
    import copy
    tok, model = tok_model
    gpu = copy.deepcopy(model).cuda()
    prompts = [tok.encode(t) for t in ["How many singers?", "SELECT name FROM", "x"]] * 3
    eager = generate(gpu, prompts, scfg(max_new_tokens=40, cuda_graphs=False), STOPS, tok, seed=2)
    graphs = generate(gpu, prompts, scfg(max_new_tokens=40, cuda_graphs=True), STOPS, tok, seed=2)
    assert [t.ids for t in graphs] == [t.ids for t in eager]
    for a, b in zip(graphs, eager):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_decode_window_reservation_equals_growing_every_row():
    """Scheduler._decode_needs (one pass, only rows that take blocks are grown) reserves exactly
    what growing every running row with BlockManager.grow reserves: the same count (summed
    needed(), an upper bound), the same tables, the same copy-on-write pairs."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler, Sequence

    rnd = random.Random(0)
    for trial in range(200):
        bs = rnd.choice([1, 2, 4, 16])
        states = []
        for _ in range(2):  # the same random state twice: one per way of growing
            r = random.Random(trial)
            blocks = BlockManager(4096, bs)
            sched = Scheduler(blocks)
            lead = None
            for i in range(r.randint(1, 12)):
                n = r.randint(1, 40)
                s = Sequence(list(range(n)), key=i, index=i)
                if lead is not None and r.random() < 0.4:  # a sample sharing a prompt's blocks
                    s.ids = list(lead.ids)
                    s.block_table, s.num_cached = blocks.share(lead.block_table), lead.num_cached
                else:
                    blocks.grow(s.block_table, 0, n)
                    s.num_cached = n
                    lead = s
                s.turn_start, s.budget = len(s.ids), r.randint(1, 20)
                s.status = "running"
                sched.running.append(s)
            states.append((blocks, sched))
        steps = rnd.randint(1, 9)
        (b1, s1), (b2, s2) = states
        grow, need = s1._decode_needs(steps)
        assert need == sum(b2.needed(s.block_table, s.num_cached, min(s.num_cached + steps, s.turn_start + s.budget - 1))
                           for s in s2.running)
        free = b1.num_free, b2.num_free
        for s, reach in grow:
            b1.grow(s.block_table, s.num_cached, reach)
        for s in s2.running:
            b2.grow(s.block_table, s.num_cached, min(s.num_cached + steps, s.turn_start + s.budget - 1))
        taken = free[0] - b1.num_free
        assert taken == free[1] - b2.num_free and taken <= need  # rows sharing a tail: only the first copies
        assert [s.block_table for s in s1.running] == [s.block_table for s in s2.running]
        assert b1.pending_copies() == b2.pending_copies() and b1.refs == b2.refs


# -----------------------------------------------------------------------------
# memory pressure, through the engine's public API: who is preempted, and no block outlives its rows


def blocks_held(seqs) -> int:
    """Distinct KV blocks in the sequences' tables (a block shared copy-on-write counts once)."""
    return len(set().union(*(s.block_table for s in seqs)))


def test_the_latest_admitted_sequence_is_preempted_first(tok_model):
    """Three prompts admitted A, B, C (A the longest, C the shortest) into a pool that holds their
    prompts but not their turns: the first sequence evicted is C, the latest admitted (not the one
    holding the most blocks, not the oldest), and the others decode on untouched."""
    from engine.engine import Engine
    from engine.scheduler import Sequence
    tok, model = tok_model
    prompts = [list(range(3, 3 + n)) for n in (14, 10, 6)]  # A, B, C
    cfg = scfg(max_new_tokens=16, block_size=4, kv_budget_tokens=4 * 12)  # 12 blocks; the turns need 6+7+4+...
    with Engine(model, cfg, StopChecker(None, [], []), worst_case=[len(p) + 16 for p in prompts]) as engine:
        seqs = [Sequence(list(p), key=row_key(0, i), index=i) for i, p in enumerate(prompts)]
        engine.add(seqs)
        first = engine.step()  # one prefill admits all three, in order
        assert first == [] and [s.status for s in seqs] == ["running"] * 3
        evicted = []
        while engine.busy() and not evicted:
            cached = [s.num_cached for s in seqs]
            for s in engine.step():
                engine.finish(s)
            evicted = [s.index for s, before in zip(seqs, cached)
                       if before and s.num_cached == 0 and s.status != "done"]
        assert evicted == [2] and engine.evictions == 1, evicted
        assert [s.status for s in seqs[:2]] == ["running"] * 2  # A and B kept their blocks
        while engine.busy():
            for s in engine.step():
                engine.finish(s)
        assert all(s.status == "done" and len(s.ids) == len(p) + 16 for s, p in zip(seqs, prompts))
        assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("block_size", [4, 5])
def test_shared_blocks_are_freed_once_no_row_holds_them(tok_model, block_size):
    """Many multi-turn episodes whose G samples share their prompt's blocks (the partly filled
    last one copied on write), in a pool far too small, so rows are evicted, recomputed and paused
    over and over: after every step the pool's used blocks are exactly those the live rows' tables
    hold (a block freed while a row holds it, or held by no row, breaks it), and once every row has
    finished the whole pool is free. A leak would show only as a pool that runs dry in a long run."""
    from engine.engine import Engine
    from engine.scheduler import Sequence
    tok, model = tok_model
    G, turns, new = 3, 3, 6
    prompts = [list(range(3, 3 + n)) for n in (11, 9, 13, 7)]  # last blocks partly filled: copy on write
    longest = max(len(p) for p in prompts) + turns * (new + 2)
    cfg = scfg(max_new_tokens=new, block_size=block_size, kv_budget_tokens=3 * longest)
    rnd = random.Random(block_size)
    with Engine(model, cfg, StopChecker(None, [], []), worst_case=[longest] * (G * len(prompts))) as engine:
        seqs = [Sequence(list(p), key=row_key(1, i * G + j), index=i * G + j) for i, p in enumerate(prompts)
                for j in range(G)]
        engine.add(seqs)
        paused, steps = [], 0
        while engine.busy() or paused:
            for s in engine.step():
                paused.append(s)
            steps += 1
            # the caller keeps some paused rows a while (tool calls), then continues or ends them
            for s in [s for s in paused if rnd.random() < 0.5]:
                paused.remove(s)
                if s.num_turns < turns:
                    s.ids += [5, 6]  # an observation
                    s.loss_mask += [0, 0]
                    s.logprobs += [0.0, 0.0]
                    engine.add([s])
                else:
                    engine.finish(s)
            assert engine.blocks.num_used == blocks_held(seqs), steps
        assert engine.evictions > 0 and all(s.status == "done" and s.num_turns == turns for s in seqs)
        assert engine.blocks.num_free == engine.blocks.num_blocks
        assert engine.blocks.peak_used <= engine.blocks.num_blocks
