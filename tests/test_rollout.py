"""Sampler and multi-turn loop: checked against transformers, full forwards and a real SQLite db.

    .venv/bin/pytest tests/test_rollout.py -q
"""
import sqlite3
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

import env
from sqltask import prompts
from toy import tiny
from conftest import ROOT
from config import DataConfig, EnvConfig, SamplingConfig
from engine.block_manager import BlockManager
from model import Transformer
from engine.paged_attention import PagedBatch, PagedKVCache
from rollout import generate, rollout
from sqltask.chat import conversation_wrapper, observation_ids
from engine.sampling import StopChecker, mix_py, row_key, sample_next, uniforms

torch.set_num_threads(2)
STOPS = ["</sql>", "</solution>"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny qwen2 built and saved by transformers (+ the tiny tokenizer), so our loader and
    sampler are compared with the reference on the same weights."""
    d = tmp_path_factory.mktemp("tiny")
    tok = tiny.build_tiny_tokenizer(d, vocab_size=512)
    cfg = Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True, initializer_range=0.3, eos_token_id=None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return Transformer.from_pretrained(tiny_dir)


def prompts_of(tok):
    texts = ["How many singers do we have?", "SELECT name FROM stadium WHERE capacity > 5000 ORDER BY",
             "List the names", "Zürich café 東京 <think>"]
    return [tok.encode(t) for t in texts]


def scfg(**kw):
    return replace(SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=24,
                                  max_context=512), **kw)


def new_tokens(t):
    return t.ids[len(t.prompt_ids):]


# -----------------------------------------------------------------------------
# sampling core


def test_uniforms_match_python_reference():
    keys = torch.tensor([row_key(3, i) for i in range(5)])
    pos = torch.tensor([0, 7, 100, 5, 123456789])
    want = [(mix_py((k + (p + 1) * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)) >> 40) / (1 << 24)
            for k, p in zip(keys.tolist(), pos.tolist())]
    assert uniforms(keys, pos).tolist() == pytest.approx(want, abs=0)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (4, 0.8)])
def test_sampler_frequencies_match_filtered_distribution(top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    T, n = 0.8, 40000
    p = torch.softmax(logits / T, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros(8, dtype=torch.bool)
    mass = 0.0
    for r, i in enumerate(order.tolist()):  # reference filter: top-k, then smallest top-p prefix
        if (top_k and r >= top_k) or mass >= top_p:
            break
        keep[i], mass = True, mass + p[i].item()
    want = torch.where(keep, p, 0) / p[keep].sum()
    keys = torch.tensor([row_key(0, i) for i in range(n)])
    tok, logp = sample_next(logits.expand(n, 8), keys, torch.zeros(n, dtype=torch.long),
                            temperature=T, top_p=top_p, top_k=top_k)
    freq = torch.bincount(tok, minlength=8).float() / n
    assert (freq[~keep] == 0).all()
    assert torch.allclose(freq, want, atol=0.01), (freq, want)
    assert torch.allclose(logp, torch.log_softmax(logits / T, -1)[tok])


def test_stop_string_split_across_tokens(tok):
    stop = StopChecker(tok, STOPS, eos_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    whole = tok.encode("<sql>SELECT 1</sql>")
    assert stop.check(whole) == "stop"
    pieces = tok.encode("<sql>SELECT 1") + [tok.encode(c)[0] for c in "</sql>"]  # one char per token
    assert len(tok.decode(pieces[-6:])) == 6
    hits = [stop.check(pieces[:i + 1]) for i in range(len(pieces))]
    assert hits == [None] * (len(pieces) - 1) + ["stop"]
    # "</so" + "lution>"-style splits inside multi-char tokens, and a stop before the turn start
    ids = tok.encode("x </so") + tok.encode("lution> y")
    first = next(i for i in range(len(ids)) if stop.check(ids[:i + 1]))
    assert "</solution>" in tok.decode(ids[:first + 1]) and "</solution>" not in tok.decode(ids[:first])
    assert stop.check(whole, start=len(whole) - 1) is None  # only this turn's tokens count
    assert stop.check(pieces + [tok.convert_tokens_to_ids("<|im_end|>")]) == "eos"


def test_generate_stops_on_split_stop_string(tok, model):
    """End to end: a scripted model writes </sql> one character per token; generation stops
    right after the '>' and keeps the stop string."""
    script = tok.encode("a b") + [tok.encode(c)[0] for c in "</sql>"] + tok.encode(" more text")
    out = generate(model, [tok.encode("a question?")], scfg(), STOPS, tok, seed=0, greedy=True,
                   logits_hook=Scripted([script]))[0]
    assert new_tokens(out) == script[:-len(tok.encode(" more text"))]
    assert (out.turn_stop, out.end_reason) == ("stop", "turn_budget") and out.text.endswith("</sql>")


# -----------------------------------------------------------------------------
# against transformers and full forwards


def test_greedy_matches_transformers_generate(tiny_dir, tok, model):
    hf = Qwen2ForCausalLM.from_pretrained(tiny_dir).eval()
    ps = prompts_of(tok)
    ours = generate(model, ps, scfg(max_new_tokens=20), [], tok, seed=0, greedy=True, eos=[])
    for p, t in zip(ps, ours):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          do_sample=False, max_new_tokens=20, min_new_tokens=20, pad_token_id=0)
        assert new_tokens(t) == ref[0, len(p):].tolist()
        assert len(set(new_tokens(t))) > 3  # a model that repeats one token would test little
        assert (t.turn_stop, t.end_reason) == ("length", "turn_cut") and t.loss_mask == [0] * len(p) + [1] * 20


SAME_LENGTH = ["How many pets are there?", "How many dogs are there?"]  # 17 tokens each, one word apart


def test_equal_length_prompts_each_match_transformers_greedy(tiny_dir, tok, model):
    """Two prompts of the same length but different ids, 2 copies of each in one batch: every
    row is transformers' greedy continuation of its own prompt (rows are told apart by their
    ids: grouping by length would decode one prompt from the other's cache)."""
    hf = Qwen2ForCausalLM.from_pretrained(tiny_dir).eval()
    distinct = [tok.encode(t) for t in SAME_LENGTH]
    assert len(distinct[0]) == len(distinct[1]) and distinct[0] != distinct[1]
    ours = generate(model, [p for p in distinct for _ in range(2)], scfg(max_new_tokens=12), [], tok, seed=0,
                    greedy=True, eos=[])
    refs = []
    for p in distinct:
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
        refs += [ref[0, len(p):].tolist()] * 2
    assert refs[0] != refs[2]  # the two prompts continue differently: a mix-up cannot pass
    assert [t.prompt_ids for t in ours] == [p for p in distinct for _ in range(2)]
    assert [new_tokens(t) for t in ours] == refs


def test_ragged_batch_equals_each_prompt_alone(tok, model):
    ps = prompts_of(tok)
    batch = generate(model, ps, scfg(), [], tok, seed=5, greedy=True, eos=[])
    for p, t in zip(ps, batch):
        assert new_tokens(generate(model, [p], scfg(), [], tok, seed=5, greedy=True, eos=[])[0]) == new_tokens(t)
    # sampled: row i's noise depends on (seed, i, position) only, so other rows do not matter
    batch = generate(model, ps, scfg(), [], tok, seed=5, eos=[])
    others = [tok.encode("a much longer and different prompt " * 3), ps[1], tok.encode("x"), ps[3]]
    mixed = generate(model, others, scfg(), [], tok, seed=5, eos=[])
    assert new_tokens(mixed[1]) == new_tokens(batch[1]) and new_tokens(mixed[3]) == new_tokens(batch[3])
    assert new_tokens(mixed[0]) != new_tokens(batch[0])


def test_paged_extend_then_decode_equals_full_forward(tok, model):
    """Prompts, then ragged observation chunks (one row gets none), then a decode step, through
    a paged cache whose blocks are handed out shuffled (so rows' blocks interleave), equal a full
    forward of each row's whole sequence."""
    ps = prompts_of(tok)
    obs = [tok.encode(" <observation>3</observation>"), [], tok.encode(" ok"), tok.encode("\n\nlonger one here")]
    bs = 4
    blocks = BlockManager(64, bs)
    blocks.free = [blocks.free[i] for i in torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    cache = PagedKVCache.for_model(model, 64, bs, torch.float32)
    tables, cached = [[] for _ in ps], [0] * len(ps)

    def feed(chunks):  # right padded, padding written to the scratch block
        T = max(len(c) for c in chunks)
        ids, pos, slots = [], [], []
        for b, c in enumerate(chunks):
            blocks.grow(tables[b], cached[b], cached[b] + len(c))
            ids.append(c + [0] * (T - len(c)))
            pos.append(list(range(cached[b], cached[b] + T)))
            slots.append([tables[b][p // bs] * bs + p % bs for p in range(cached[b], cached[b] + len(c))]
                         + [cache.scratch * bs] * (T - len(c)))
        width = max(map(len, tables))
        table = torch.tensor([t + [cache.scratch] * (width - len(t)) for t in tables])
        out = model.forward_paged(torch.tensor(ids), torch.tensor(pos), PagedBatch(cache, torch.tensor(slots), table))
        for b, c in enumerate(chunks):
            cached[b] += len(c)
        return out  # (B, T, V)

    with torch.no_grad():
        feed(ps)
        last = feed(obs)
        dec = feed([[5 + b] for b in range(len(ps))])[:, -1]  # (B, V)
        for b in range(len(ps)):
            full = ps[b] + obs[b]
            ref = model(torch.tensor([full + [5 + b]]))[0]  # (T, V) no cache
            if obs[b]:  # rows fed nothing return no meaningful logits
                assert torch.allclose(last[b, len(obs[b]) - 1], ref[len(full) - 1], atol=1e-4)
            assert torch.allclose(dec[b], ref[len(full)], atol=1e-4)
    assert cached == [len(p) + len(o) + 1 for p, o in zip(ps, obs)]
    assert len({b for t in tables for b in t}) == sum(map(len, tables))  # no block shared by two rows


def test_logprobs_match_full_forward_and_mask_is_sampled_tokens(tok, model):
    ps = prompts_of(tok)
    cfg = scfg(temperature=0.7)
    out = generate(model, ps, cfg, STOPS, tok, seed=1)
    for t in out:
        n = len(t.prompt_ids)
        assert t.loss_mask == [0] * n + [1] * (len(t.ids) - n)
        assert t.logprobs[:n] == [0.0] * n
        with torch.no_grad():
            lp, _ = model(torch.tensor([t.ids[:-1]]), targets=torch.tensor([t.ids[1:]]), temperature=0.7)
        assert torch.allclose(torch.tensor(t.logprobs[n:]), lp[0, n - 1:], atol=1e-4)


def test_seeded_sampling_reproduces_and_batching_changes_nothing(tok, model):
    ps = prompts_of(tok) * 2  # repeats share one prefill
    base = generate(model, ps, scfg(temperature=0.9, top_p=0.9), [], tok, seed=7, eos=[])
    again = generate(model, ps, scfg(temperature=0.9, top_p=0.9), [], tok, seed=7, eos=[])
    other = generate(model, ps, scfg(temperature=0.9, top_p=0.9), [], tok, seed=8, eos=[])
    assert [t.ids for t in base] == [t.ids for t in again]
    assert [t.ids for t in base] != [t.ids for t in other]
    assert base[0].ids != base[4].ids  # same prompt, different samples
    # eos + stop strings end rows at different steps; a tight KV budget evicts and recomputes rows;
    # max_decode_rows keeps rows waiting; small blocks split prompts over many blocks
    kw = dict(seed=3)
    ref = generate(model, ps, scfg(), STOPS, tok, **kw)
    longest = max(map(len, ps)) + 24
    for c in (scfg(kv_budget_tokens=longest), scfg(max_decode_rows=3), scfg(block_size=1), scfg(block_size=64)):
        got = generate(model, ps, c, STOPS, tok, **kw)
        assert [t.ids for t in got] == [t.ids for t in ref]
        for a, b in zip(got, ref):
            assert (a.turn_stop, a.end_reason) == (b.turn_stop, b.end_reason)
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


# -----------------------------------------------------------------------------
# multi-turn against a real SQLite database


class Scripted:
    """A logits hook that makes any model write scripts[k] in turn k (the last script repeats):
    every other token's logit is -inf, so the scripted token is sampled with logprob 0."""

    def __init__(self, scripts):
        self.scripts = scripts

    def __call__(self, logits, rows):
        out = torch.full_like(logits, float("-inf"))
        for b, r in enumerate(rows):
            s = self.scripts[min(r.num_turns, len(self.scripts)) - 1]
            out[b, s[min(len(r.ids) - r.turn_start, len(s) - 1)]] = 0.0
        return out


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    d = tmp_path_factory.mktemp("db")
    con = sqlite3.connect(d / "pets.sqlite")
    con.execute("CREATE TABLE pet (id INTEGER PRIMARY KEY, name TEXT, age INT)")
    con.executemany("INSERT INTO pet VALUES (?, ?, ?)", [(1, "rex", 3), (2, "tom", 5), (3, "kit", 1)])
    con.commit()
    con.close()
    return d


def example(db):
    return {"id": "t0", "source": "toy", "db_id": "pets", "db_path": "pets.sqlite",
            "question": "How many pets are there?", "evidence": "", "gold_sql": "SELECT count(*) FROM pet"}


TURN1 = "<think>count them</think>\n<sql>SELECT count(*) FROM pet</sql>"
TURN2 = "<think>three</think>\n<solution>SELECT count(*) FROM pet</solution>"


@pytest.mark.parametrize("conversation", ["single", "conversation"])
def test_multiturn_tool_call_then_solution(tok, db, model, conversation):
    scripts = [tok.encode(TURN1) + [0], tok.encode(TURN2) + [0]]  # [0]: never reached (stops first)
    ecfg = EnvConfig(conversation=conversation, max_turns=4, workers=1)
    ex = example(db)
    trajs = rollout(model, tok, [ex], ecfg, scfg(max_new_tokens=64, max_context=4096), DataConfig(), str(db),
                    n=2, seed=0, greedy=True, logits_hook=Scripted(scripts))
    assert len(trajs) == 2
    msgs = prompts.build_messages(ex, str(db), DataConfig())
    prompt = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    for t in trajs:
        assert t.prompt_ids == prompt and t.ids[:len(prompt)] == prompt
        assert (t.num_turns, t.num_tool_calls, t.finished, t.end_reason) == (2, 1, True, "answer")
        assert t.final_sql == "SELECT count(*) FROM pet"
        (a0, a1), (b0, b1) = t.turn_spans
        assert [tok.decode(t.ids[a0:a1]), tok.decode(t.ids[b0:b1])] == [TURN1, TURN2]
        assert t.loss_mask == [1 if a0 <= i < a1 or b0 <= i < b1 else 0 for i in range(len(t.ids))]
        assert all(lp == 0.0 for lp, k in zip(t.logprobs, t.loss_mask) if not k)
        obs = env.step_batch([str(db / "pets.sqlite")], [TURN1], [3], ecfg)[0].observation
        assert "3" in obs and "<observation>" in obs
        between = t.ids[a1:b0]
        if conversation == "single":
            assert between == tok.encode(obs)  # the env's exact string, tokenized once
        else:  # equals rendering the whole conversation with the chat template
            full = msgs + [{"role": "assistant", "content": TURN1}, {"role": "user", "content": obs.strip()}]
            want = tok.apply_chat_template(full, tokenize=False, add_generation_prompt=True)
            assert tok.decode(t.ids[:b0]) == want
            assert t.ids[:b0] == tok.encode(want)
        assert t.text == tok.decode(t.ids[len(prompt):])


def test_multiturn_max_turns_and_real_model_logprobs(tok, db, model):
    """Only tool calls -> max_turns; and a real model whose turns are cut by max_new_tokens
    (invalid -> the env's invalid observation) keeps logprobs equal to a full forward."""
    ecfg = EnvConfig(max_turns=3, workers=1)
    t = rollout(model, tok, [example(db)], ecfg, scfg(max_new_tokens=64, max_context=4096), DataConfig(),
                str(db), greedy=True, logits_hook=Scripted([tok.encode(TURN1) + [0]]))[0]
    assert (t.num_turns, t.num_tool_calls, t.finished, t.end_reason) == (3, 3, False, "turn_budget")
    cfg = scfg(temperature=0.8, max_new_tokens=6, max_context=4096)
    trajs = rollout(model, tok, [example(db)], ecfg, cfg, DataConfig(), str(db), n=3, seed=0)
    for t in trajs:
        assert t.num_turns == 3 and t.end_reason in ("turn_budget", "turn_cut")
        assert sum(t.loss_mask) == sum(b - a for a, b in t.turn_spans) == 18
        with torch.no_grad():
            lp, _ = model(torch.tensor([t.ids[:-1]]), targets=torch.tensor([t.ids[1:]]), temperature=0.8)
        got, ref = torch.tensor(t.logprobs[1:]), lp[0]
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        assert torch.allclose(got[mask], ref[mask], atol=1e-4)


def test_equal_length_questions_keep_their_own_logprobs(tok, db, model):
    """Two questions whose prompts have the same length, n=2 each, sampled over two turns: each
    episode's sampler logprobs equal a full forward of its own ids (a row decoded from another
    prompt's cache would not)."""
    exs = [dict(example(db), id=f"same{i}", question=q) for i, q in enumerate(SAME_LENGTH)]
    trajs = rollout(model, tok, exs, EnvConfig(max_turns=2, workers=1),
                    scfg(temperature=0.8, max_new_tokens=6, max_context=4096), DataConfig(), str(db), n=2, seed=1)
    assert len(trajs[0].prompt_ids) == len(trajs[2].prompt_ids) and trajs[0].prompt_ids != trajs[2].prompt_ids
    for t in trajs:
        with torch.no_grad():
            lp, _ = model(torch.tensor([t.ids[:-1]]), targets=torch.tensor([t.ids[1:]]), temperature=0.8)
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        assert torch.allclose(torch.tensor(t.logprobs[1:])[mask], lp[0][mask], atol=1e-4)


def test_conversation_wrapper_renders_suffix(tok):
    close, before, after = conversation_wrapper(tok)
    assert (close, before, after) == ("<|im_end|>", "\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("conversation,eos_steps_env", [("single", False), ("single", True), ("conversation", False)])
def test_eos_turn(tok, db, model, conversation, eos_steps_env):
    """A turn that ends with a sampled <|im_end|> and no tags: the single format ends the episode
    ("eos"), unless env.eos_steps_env (SkyRL's generator): then the env's invalid-action
    observation follows the EOS and the episode goes on. The conversation format treats it as an
    invalid turn, does not add a second <|im_end|>, and the history still equals the chat
    template's rendering."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    talk = "<think>no tags here</think>"
    hook = Scripted([tok.encode(talk) + [eos], tok.encode(TURN2) + [0]])
    ecfg = EnvConfig(conversation=conversation, max_turns=4, workers=1, eos_steps_env=eos_steps_env)
    ex = example(db)
    t = rollout(model, tok, [ex], ecfg, scfg(max_new_tokens=64, max_context=4096), DataConfig(), str(db),
                greedy=True, logits_hook=hook)[0]
    a0, a1 = t.turn_spans[0]
    assert t.ids[a1 - 1] == eos and t.loss_mask[a1 - 1] == 1
    if conversation == "single" and not eos_steps_env:
        assert (t.num_turns, t.end_reason, t.finished, len(t.ids)) == (1, "eos", False, a1)
        return
    assert (t.num_turns, t.end_reason, t.finished, t.num_tool_calls) == (2, "answer", True, 0)
    obs = env.step_batch([str(db / "pets.sqlite")], [talk], [3], ecfg)[0].observation
    assert ecfg.invalid_text in obs
    if conversation == "single":  # the observation text right after the EOS, then the next turn
        assert t.ids[a1:t.turn_spans[1][0]] == tok.encode(obs)
        assert t.text == tok.decode(t.ids[a0:]) and t.text.count("<|im_end|>") == 1
        return
    msgs = prompts.build_messages(ex, str(db), DataConfig())
    full = msgs + [{"role": "assistant", "content": talk}, {"role": "user", "content": obs.strip()}]
    want = tok.apply_chat_template(full, tokenize=False, add_generation_prompt=True)
    assert t.ids[:t.turn_spans[1][0]] == tok.encode(want)


def test_skyrl_configs_step_the_env_on_eos():
    from config import load_config
    for name in ("skyrl_sql_7b.yaml", "skyrl_sql_7b_2node.yaml", "skyrl_sql_7b_lora.yaml"):
        assert load_config([str(ROOT / "configs" / name)]).env.eos_steps_env, name
    assert not EnvConfig().eos_steps_env


def test_actions_protocol_episode_limit_is_step_budget(tok, db, model):
    """In the actions protocol an episode has env.step_budget generations (sql_env), not max_turns."""
    act = tok.encode("<action>DESCRIBE pet</action>") + [0]
    ecfg = EnvConfig(protocol="actions", max_turns=2, step_budget=4, workers=1)
    t = rollout(model, tok, [example(db)], ecfg, scfg(max_new_tokens=64, max_context=4096), DataConfig(), str(db),
                greedy=True, logits_hook=Scripted([act]))[0]
    assert (t.num_turns, t.num_tool_calls, t.end_reason) == (4, 4, "turn_budget")
    assert [s["kind"] for s in t.steps] == ["describe"] * 4


@pytest.mark.parametrize("conversation", ["single", "conversation"])
def test_observation_after_a_sampled_end_of_turn(tok, conversation):
    """After a sampled <|im_end|> the conversation wrapper does not close the turn again."""
    obs = EnvConfig().obs_template.format(result="n\n3", turns_left=2)
    if conversation == "conversation":  # after a sampled <|im_end|>, the wrapper does not close again
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        assert observation_ids(tok, obs, conversation, last_id=eos) == observation_ids(tok, obs, conversation)[1:]


def test_kv_cache_takes_the_dtype_passed(tok, model, monkeypatch):
    """The cache is in the compute dtype the caller passes (bf16 under mixed precision), not the
    parameters' dtype; attention runs in it, and greedy tokens still match an fp32 cache here."""
    import rollout as rollout_module
    made = []

    class Recording(rollout_module.Engine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self.cache.k.dtype)

    monkeypatch.setattr(rollout_module, "Engine", Recording)
    ps = prompts_of(tok)[:2]
    ref = generate(model, ps, scfg(max_new_tokens=6), [], tok, seed=0, greedy=True, eos=[])
    got = generate(model, ps, scfg(max_new_tokens=6), [], tok, seed=0, greedy=True, eos=[], dtype=torch.bfloat16)
    assert made == [torch.float32, torch.bfloat16]
    assert [t.ids[:len(t.prompt_ids) + 2] for t in got] == [t.ids[:len(t.prompt_ids) + 2] for t in ref]
