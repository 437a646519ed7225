"""The SFT warm start's gold episodes (sqltask/gold_turns.py's turns, played by sft.gold_episodes
through rollout.replay), in every protocol x conversation format: played
through the env they are well formed and get the full reward, and their tokens are exactly what a
rollout appends when it is forced to write them (token-in-token-out). ~1 min on 2 cores.

    .venv/bin/pytest tests/test_sft.py -q
"""
import re

import pytest
import torch
from conftest import build_tiny_assets

import config as C
from sqltask import dataset
import reward
import rollout
import sft
from model import Transformer
from sqltask import chat, gold_turns

PAIRS = [(p, c) for p in ("tags", "actions") for c in ("single", "conversation")]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The toy set and a tiny model + tokenizer (as a run builds them), and a few records: direct
    and lookup questions, joins, held-out databases, and one with a first lookup that fails."""
    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp("assets")
    settings = build_tiny_assets(d)
    root = d / "toy"
    train = dataset.load_examples(root / "train.jsonl", root)
    recs = dataset.load_examples(root / "eval.jsonl", root)[:8] + train[::170]
    joined = next(r for r in train if r["lookup_sql"] and " JOIN " in r["gold_sql"])
    # the natural first try: the word as the question says it, which the database stores as a code
    m = re.fullmatch(r"SELECT DISTINCT (\w+) FROM (\w+) WHERE \1 LIKE '(\w+)%'", joined["lookup_sql"])
    first = {**joined, "id": "first-lookup", "first_lookup_sql": f"SELECT DISTINCT {m[1]} FROM {m[2]} WHERE {m[1]} = '{m[3]}'"}
    recs.append(first)
    assert any(r["lookup_sql"] for r in recs) and any(not r["lookup_sql"] for r in recs)
    tok = AutoTokenizer.from_pretrained(d / "model")
    return ["--" + s for s in settings], root, recs, tok, Transformer.from_pretrained(d / "model")


def make_cfg(assets, protocol, conversation, *extra):
    return C.load_config(["configs/tiny.yaml", *assets[0], f"--env.protocol={protocol}",
                          f"--env.conversation={conversation}", "--reward.dense=true", "--env.step_budget=6",
                          "--env.max_turns=4", "--env.workers=1", "--sampling.max_new_tokens=96", *extra])


def play(assets, cfg):
    _, root, recs, tok, _ = assets
    dbs = [dataset.abs_db_path(r, root) for r in recs]
    prompts = [chat.render_prompt(tok, r, cfg.data, cfg.env.protocol, root) for r in recs]
    return prompts, dbs, sft.gold_episodes(recs, prompts, tok, cfg, dbs)


def turns_of(rec, cfg, db):
    return gold_turns.gold_turns(rec, cfg, db, rollout.max_turns(cfg.env))


class Force:
    """A logits hook that makes the model write gold[row] token by token (every other logit -inf)."""

    def __init__(self, golds):
        self.golds = golds

    def __call__(self, logits, rows):
        out = torch.full_like(logits, float("-inf"))
        for b, r in enumerate(rows):
            gold = self.golds[r.index]
            out[b, gold[len(r.ids)] if len(r.ids) < len(gold) else 0] = 0.0
        return out


# -----------------------------------------------------------------------------


@pytest.mark.parametrize("protocol, conversation", PAIRS)
def test_gold_episodes_are_well_formed_and_get_the_full_reward(assets, protocol, conversation):
    _, root, recs, tok, _ = assets
    cfg = make_cfg(assets, protocol, conversation)
    prompts, dbs, eps = play(assets, cfg)
    pieces = chat.conversation_pieces(tok, cfg.env)
    scores = reward.episode_rewards([rollout.transcript(e, r, root) for r, e in zip(recs, eps)], cfg.reward,
                                    protocol, pieces)
    for r, e, s, p in zip(recs, eps, scores, prompts):
        assert s.format_ok and s.exec_match, (s, e.text)
        assert e.ids[:len(p)] == p and not any(e.loss_mask[:len(p)])
        kinds = [st["kind"] for st in e.steps]
        lookups = [q for q in (r.get("first_lookup_sql", ""), r["lookup_sql"]) if q]
        if protocol == "tags":
            assert s.value == cfg.reward.correct
            assert kinds == ["sql"] * len(lookups) + ["solution"], kinds
            assert e.text.endswith(f"<solution>{r['gold_sql']}</solution>")  # the rollout stops there
        else:  # every tool call new and successful: the dense shaping only adds
            assert all(st["ok"] for st in e.steps[:-1]) and s.value > cfg.reward.correct, s
            assert kinds == ["describe"] * len(gold_turns.tables_read(dataset.abs_db_path(r, root), r["gold_sql"])) + \
                ["query"] * len(lookups) + ["answer"], kinds
            assert e.text.endswith(f"<action>ANSWER {r['gold_sql']}</action>")
        assert [st["arg"] for st in e.steps if st["kind"] in ("sql", "query")] == lookups
        if r["id"] == "first-lookup":  # the failed lookup, then the one that shows the code and its twin
            assert [st["n_rows"] for st in e.steps if st["kind"] in ("sql", "query")] == [0, 2]
            assert e.text.count("(0 rows)") == 1
        model_side = tok.decode([i for i, m in zip(e.ids, e.loss_mask) if m])
        assert "<observation>" not in model_side and "<|im_start|>" not in model_side  # never trained on


@pytest.mark.parametrize("protocol, conversation", PAIRS)
def test_gold_tokens_are_what_a_forced_rollout_appends(assets, protocol, conversation):
    """Token-in-token-out: a rollout made to write the gold tokens ends where the gold ends, with
    the same ids, loss mask, env steps and answer (the observations and chat-template tokens
    between the turns are the rollout's own)."""
    _, root, recs, tok, model = assets
    cfg = make_cfg(assets, protocol, conversation)
    _, _, eps = play(assets, cfg)
    trajs = rollout.rollout(model, tok, recs, cfg.env, cfg.sampling, cfg.data, str(root), greedy=True,
                            logits_hook=Force([e.ids for e in eps]))
    for t, e in zip(trajs, eps):
        assert t.ids == e.ids and t.loss_mask == e.loss_mask, (tok.decode(t.ids[len(t.prompt_ids):]), e.text)
        assert (t.steps, t.final_sql, t.finished, t.text) == (e.steps, e.final_sql, True, e.text)
        assert (t.end_reason, t.turn_stop) == ("answer", "stop")


def test_tool_turns_that_do_not_fit_are_left_out_describes_first(assets):
    """The answer always fits the episode's generations; DESCRIBEs go first (the last one first),
    then the failed first lookup; the lookup that shows the code stays longest."""
    _, root, recs, tok, _ = assets
    rec = recs[-1]
    db = dataset.abs_db_path(rec, root)
    tables = gold_turns.tables_read(db, rec["gold_sql"])
    assert len(tables) == 2 and rec["gold_sql"].index(tables[0]) < rec["gold_sql"].index(tables[1])
    first, lookup = rec["first_lookup_sql"], rec["lookup_sql"]
    ask = lambda budget: [t.split(" ", 1)[0].strip("<action>") for t in  # noqa: E731
                          turns_of(rec, make_cfg(assets, "actions", "single", f"--env.step_budget={budget}"), db)]
    assert ask(6) == ["DESCRIBE", "DESCRIBE", "QUERY", "QUERY", "ANSWER"]
    assert ask(4) == ["DESCRIBE", "QUERY", "QUERY", "ANSWER"]
    assert ask(2) == ["QUERY", "ANSWER"] and ask(1) == ["ANSWER"]
    turns = turns_of(rec, make_cfg(assets, "actions", "single", "--env.step_budget=3"), db)
    assert turns == [f"<action>QUERY {first}</action>", f"<action>QUERY {lookup}</action>",
                     f"<action>ANSWER {rec['gold_sql']}</action>"]
    turns = turns_of(rec, make_cfg(assets, "tags", "single", "--env.max_turns=2"), db)
    assert [re.sub(r"<think>.*?</think>\n", "", t) for t in turns] == [f"<sql>{lookup}</sql>",
                                                                      f"<solution>{rec['gold_sql']}</solution>"]
    # a direct question: the gold itself as a check with sft.with_tool_turn, else no tool turn
    direct = next(r for r in recs if not r["lookup_sql"])
    ddb = dataset.abs_db_path(direct, root)
    on = make_cfg(assets, "actions", "single", "--sft.with_tool_turn=true")
    assert turns_of(direct, on, ddb)[-2:] == [f"<action>QUERY {direct['gold_sql']}</action>",
                                                    f"<action>ANSWER {direct['gold_sql']}</action>"]
    off = make_cfg(assets, "actions", "single", "--sft.with_tool_turn=false")
    assert all(t.startswith("<action>DESCRIBE") for t in turns_of(direct, off, ddb)[:-1])


def test_a_gold_the_env_does_not_read_as_meant_is_an_error(assets, monkeypatch):
    _, root, recs, tok, _ = assets
    cfg = make_cfg(assets, "actions", "single")
    db = dataset.abs_db_path(recs[0], root)
    with pytest.raises(ValueError, match="does not compile"):
        turns_of({**recs[0], "gold_sql": "SELECT nope FROM nowhere"}, cfg, db)
    bad = {**recs[0], "lookup_sql": "SELECT 1</action>"}  # the stop string inside the query: cut short
    with pytest.raises(ValueError, match="first stop string"):
        sft.gold_episodes([bad], [[]], None, cfg, [db])
    for turns, why in [(["<action>DESCRIPTION orders</action>"], "read as invalid"),  # no such action
                       (["<action>ANSWER SELECT 1</action>"] * 2, "read as answer, done=True")]:  # ends too early
        monkeypatch.setattr(sft, "gold_turns", lambda *a, turns=turns: turns)
        with pytest.raises(ValueError, match=why):
            sft.gold_episodes([recs[0]], [[]], None, cfg, [db])


def test_build_dataset_leaves_out_golds_over_max_context(assets):
    _, root, recs, tok, _ = assets
    cfg = make_cfg(assets, "actions", "single")
    prompts, dbs, eps = play(assets, cfg)
    assert sft.build_dataset(recs, prompts, tok, cfg, dbs) == [(e.ids, e.loss_mask) for e in eps]
    ctx = sorted(len(e.ids) for e in eps)[len(eps) // 2]
    small = make_cfg(assets, "actions", "single", f"--sampling.max_context={ctx}")
    assert len(sft.build_dataset(recs, prompts, tok, small, dbs)) == sum(len(e.ids) <= ctx for e in eps) < len(recs)
    with pytest.raises(ValueError, match="no gold episode fits"):
        sft.build_dataset(recs, prompts, tok, make_cfg(assets, "actions", "single", "--sampling.max_context=8"), dbs)
