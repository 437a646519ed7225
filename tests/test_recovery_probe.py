"""bench/recovery_probe.py: an answer turned into a query, run by the env, and the policy's continuation
after it, through the real rollout on scripted turns (a tiny model made to write them).

    .venv/bin/pytest tests/test_recovery_probe.py -q
"""
import sys

import pytest

import config as C
import replay
import rollout
from conftest import ROOT
from sqltask.chat import render_prompt
from test_rollout import Scripted, db, example, model, scfg, tiny_dir, tok  # noqa: F401 (fixtures)

sys.path.insert(0, str(ROOT / "bench"))
import recovery_probe as probe  # noqa: E402

WRONG = "<think>the pets</think>\n<solution>SELECT count(*) FROM pets</solution>"  # no table `pets`: an error
EMPTY = "<think>old ones</think>\n<solution>SELECT count(*) FROM pet GROUP BY age HAVING age > 9</solution>"
RIGHT = "<think>fixed</think>\n<solution>SELECT count(*) FROM pet</solution>"
LOOKUP = "<think>look</think>\n<sql>SELECT name FROM pet</sql>"


def config(db, max_turns=3):
    cfg = C.load_config([])
    cfg.env.max_turns, cfg.env.workers = max_turns, 1
    cfg.data.db_root = str(db)
    cfg.sampling = scfg(max_new_tokens=64, max_context=2048)
    return cfg


def episodes_of(tok, db, model, cfg, scripts_per_example):
    """One greedy episode per scripted example (each its own rollout: Scripted writes one script)."""
    out = []
    for k, scripts in enumerate(scripts_per_example):
        ex = dict(example(db), id=f"t{k}")
        trajs = rollout.rollout(model, tok, [ex], cfg.env, cfg.sampling, cfg.data, str(db), greedy=True,
                                logits_hook=Scripted([tok.encode(s) + [0] for s in scripts]))
        ep, = rollout.reward_episodes(trajs, [ex], tok, cfg, n=1)
        out.append(ep)
    return out


@pytest.mark.parametrize("protocol", ["tags", "actions"])
def test_as_query_keeps_the_sql(protocol):
    if protocol == "tags":
        turn, sql = RIGHT, "SELECT count(*) FROM pet"
    else:
        turn, sql = "<action>ANSWER SELECT count(*) FROM pet</action>", "SELECT count(*) FROM pet"
    query = probe.as_query(turn, protocol)
    action = probe.env.parse_turn(query, protocol)
    assert action.kind in probe.QUERY_KINDS and action.arg == sql
    assert probe.as_query("<action>DESCRIBE pet</action>" if protocol == "actions" else LOOKUP, protocol) is None


def test_forced_failed_query_is_a_replayed_turn_and_recovery_is_counted(tok, db, model):
    """An answer that errors, forced into a query: the continuation's prompt is token for token the
    episode a replay of (query, answer) would have before its answer; a continuation that answers
    right is a recovery and a retry; one that repeats the failed answer is neither."""
    cfg = config(db)
    eps = episodes_of(tok, db, model, cfg, [[WRONG], [WRONG], [EMPTY], [RIGHT], [LOOKUP, RIGHT]])
    assert [bool(e.reward.exec_match) for e in eps] == [False, False, False, True, True]
    recs, starts = probe.force_queries(eps, tok, cfg)
    assert [r["case"] for r in recs] == ["failed", "failed", "empty", "rows", "queried"]
    assert "no such table" in recs[0]["observation"]
    # the forced conversation = a replay of the query turn, its observation, before the next turn
    prompt = render_prompt(tok, example(db), cfg.data, "tags", str(db))
    t, = replay.replay([[probe.as_query(WRONG, "tags"), RIGHT]], [str(db / "pets.sqlite")], cfg.env,
                       budget=cfg.env.max_turns, tokenizer=tok, prompt_ids=[prompt])
    assert starts[0][2] == t.ids[:t.turn_spans[1][0]]
    assert [s[3] for s in starts] == [2, 2, 2, 2]  # 3 turns, the answer was the first
    # continuations: 0 and 2 fix it, 1 repeats the failed answer, 3 keeps the right one
    for (rec, ex, prompt_ids, left), script in zip(starts, [RIGHT, WRONG, RIGHT, RIGHT]):
        probe.continue_episodes(model, tok, [(rec, ex, prompt_ids, left)], cfg,
                                logits_hook=Scripted([tok.encode(script) + [0]]))
    s = probe.summarise(recs)
    assert (s["failed"], s["empty"], s["rows"], s["queried"]) == (2, 1, 1, 1)
    assert (s["bad"], s["recovered"], s["retried"], s["requeried"]) == (3, 2, 2, 0)
    assert s["recovery_rate"] == pytest.approx(2 / 3)
    assert (s["rows_stayed_right"], s["rows_turned_right"], s["rows_turned_wrong"]) == (1, 0, 0)


def test_no_turn_left_and_no_answer_are_not_forced(tok, db, model):
    cfg = config(db, max_turns=1)
    recs, starts = probe.force_queries(episodes_of(tok, db, model, cfg, [[WRONG], [LOOKUP]]), tok, cfg)
    assert [r["case"] for r in recs] == ["no_turn_left", "no_answer"] and starts == []


def test_an_empty_result_that_is_right_is_no_failure():
    """A forced query that comes back empty on a question whose gold has no rows either is the right
    answer, not an event to recover from: counted apart, never as a recovery."""
    def rec(case, answer_right, right, final_sql="SELECT 1"):
        return {"case": case, "answer_right": answer_right, "right": right, "final_sql": final_sql,
                "answer": "SELECT 1", "requeried": False}
    s = probe.summarise([rec("empty", True, True), rec("empty", False, True, "SELECT 2"),
                         rec("failed", False, False), rec("empty", False, False)])
    assert (s["empty"], s["empty_right"], s["empty_right_stayed"]) == (3, 1, 1)
    assert (s["bad"], s["recovered"], s["retried"], s["recovery_rate"]) == (3, 1, 1, pytest.approx(1 / 3))
