"""The random-policy floor (eval.random_floor: sqltask/random_turns.py's turns played by
rollout.replay) on the toy set: random episodes follow the protocol, their tool calls really ran,
they are scored like any rollout (checked against sqlite3 + a set comparison written here), the
same seed gives the same episodes, and train.py's hook logs eval/random_ex. ~5 s.

    .venv/bin/pytest tests/test_random_floor.py -q
"""
import sqlite3

import pytest

import config as C
import eval as evaluation
import reward
from sqltask import dataset, exec_match


def played(exs, cfg, seed, samples=1):
    """The floor's episodes, as the dicts these tests read."""
    _, episodes = evaluation.random_floor(exs, cfg, seed=seed, samples=samples)
    return [{"db_path": dataset.abs_db_path(e.example, cfg.data.db_root), "gold_sql": e.example["gold_sql"],
             "response": e.trajectory.text, "final_sql": e.trajectory.final_sql, "finished": e.trajectory.finished,
             "steps": e.trajectory.steps, "num_turns": e.trajectory.num_turns,
             "num_tool_calls": e.trajectory.num_tool_calls} for e in episodes]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy")
    from toy.prepare_toy import prepare_toy
    prepare_toy(str(d), seed=0)
    return str(d), dataset.load_examples(str(d / "eval.jsonl"), str(d), limit=60)


def cfg_for(root, *extra):
    return C.load_config([f"--data.db_root={root}", "--env.max_turns=4", "--env.workers=1", *extra])


def rows(db, sql):
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    except sqlite3.Error:
        return None
    finally:
        con.close()


def test_tags_episodes_are_well_formed_and_ran(toy):
    root, exs = toy
    cfg = cfg_for(root)
    eps = played(exs, cfg, seed=3, samples=2)
    assert len(eps) == 2 * len(exs)
    assert eps[0]["gold_sql"] == eps[1]["gold_sql"] == exs[0]["gold_sql"]  # example-major
    counts = {e["num_tool_calls"] for e in eps}
    assert counts == {0, 1, 2, 3}  # 0 .. max_turns-1 tool calls all occur
    for e in eps:
        assert reward.format_ok(e["response"], e["finished"]) == (True, "")
        assert e["num_turns"] == e["num_tool_calls"] + 1 and e["response"].count("<sql>") == e["num_tool_calls"]
        assert e["steps"][-1]["kind"] == "solution" and e["final_sql"].startswith("SELECT")
    # a tool call's observation shows what sqlite3 returns for that query
    e = next(e for e in eps if e["num_tool_calls"] and "COUNT(*)" in e["response"].split("</sql>")[0])
    sql = e["response"].split("<sql>")[1].split("</sql>")[0]
    obs = e["response"].split("<observation>")[1].split("</observation>")[0]
    assert str(rows(e["db_path"], sql)[0][0]) in obs


def test_scored_like_any_episode(toy):
    """EX of the summary == an independent sqlite3 + set comparison of final vs gold."""
    root, exs = toy
    cfg = cfg_for(root)
    # The toy's golds filter on a per-database code, so a random query almost never matches one
    # (0 of 180 here). For the comparison below to see matches too, 5 examples get as gold the
    # random answer their first episode will write: an episode's random stream depends on the seed
    # and its (example, sample) index, not on the gold, so the second run writes the same queries.
    first = played(exs, cfg, seed=0, samples=3)
    exs = [dict(ex, gold_sql=first[3 * i]["final_sql"]) if i < 5 else ex for i, ex in enumerate(exs)]
    s, episodes = evaluation.random_floor(exs, cfg, seed=0, samples=3)
    eps, rw = played(exs, cfg, seed=0, samples=3), [e.reward for e in episodes]
    assert [e["final_sql"] for e in eps] == [e["final_sql"] for e in first]
    mine = []
    for e in eps:
        pred, gold = rows(e["db_path"], e["final_sql"]), rows(e["db_path"], e["gold_sql"])
        mine.append(pred is not None and frozenset(pred) == frozenset(gold))
    assert [r.exec_match for r in rw] == mine
    assert s["ex"] == pytest.approx(sum(mine) / len(mine))
    assert s["reward"] == pytest.approx(sum(mine) / len(mine))  # tags: correct 1, wrong 0, format always ok
    assert s["format_err"] == 0.0 and s["n"] == 3 * len(exs)
    assert all(mine[3 * i] for i in range(5))  # the planted golds
    assert 5 / len(mine) <= s["ex"] < 0.5  # the rest are rarely hit at random


def test_actions_protocol_and_dense_reward(toy):
    root, exs = toy
    cfg = cfg_for(root, "--env.protocol=actions", "--reward.dense=true")
    s, episodes = evaluation.random_floor(exs, cfg, seed=1)
    eps, rw = played(exs, cfg, seed=1), [e.reward for e in episodes]
    kinds = {st["kind"] for e in eps for st in e["steps"][:-1]}
    assert kinds == {"describe", "sample", "query"}
    assert all(e["steps"][-1]["kind"] == "answer" and "<action>ANSWER " in e["response"] for e in eps)
    assert all(st["ok"] for e in eps for st in e["steps"][:-1])  # random actions name real tables/columns
    for e, r in zip(eps, rw):  # terminal + sql_env's shaping over the recorded steps
        gold = exec_match.gold_rows(e["db_path"], e["gold_sql"])
        assert r.value == pytest.approx(float(r.exec_match) + reward.dense_shaping(e["steps"], gold, cfg.reward))
    assert any(r.value != float(r.exec_match) for r in rw)


def test_seeded(toy):
    root, exs = toy
    cfg = cfg_for(root)
    a = played(exs[:10], cfg, seed=5)
    b = played(exs[:10], cfg, seed=5)
    c = played(exs[:10], cfg, seed=6)
    assert [e["response"] for e in a] == [e["response"] for e in b]
    assert [e["response"] for e in a] != [e["response"] for e in c]


def test_report_hook_logs_beside_warm_start(toy):
    root, exs = toy
    cfg = cfg_for(root)

    class Log:
        lines, logged = [], []

        def print(self, s):
            self.lines.append(s)

        def metrics(self, step, m):
            self.logged.append((step, m))

    log = Log()
    s = evaluation.report_random_floor(exs, cfg, log, {"eval/ex": 0.375})
    assert log.logged == [(0, {"eval/random_ex": s["ex"], "eval/random_reward": s["reward"]})]
    assert "[random baseline] EX" in log.lines[0] and "warm start held-out EX 37.5%" in log.lines[0]


def test_cli(toy, capsys):
    root, _ = toy
    evaluation.main(["random", f"--data.db_root={root}", f"--data.eval_path={root}/eval.jsonl",
                     f"--data.train_path={root}/train.jsonl", "--data.max_eval_examples=20", "--show", "1"])
    out = capsys.readouterr().out
    assert "--- random episode" in out and "random baseline on" in out and "(20 questions x 1" in out


def test_cli_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(dataset.DatasetError, match="dataset file not found: .*nope.jsonl .*set data.eval_path"):
        evaluation.main(["random", f"--data.eval_path={tmp_path}/nope.jsonl",
                         f"--data.train_path={tmp_path}/t.jsonl", "--data.prepare_toy=false"])
