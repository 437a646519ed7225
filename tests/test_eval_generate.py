"""eval.py generate: output files, data order, placeholders, agreement with `score`, majority vote
and pass@k against hand-computed values, and 2 processes (torchrun) == 1 process (greedy).

A tiny random model on the first toy examples (real rollouts: almost every episode fails), plus a
stub rollout that returns hand-written answers (right, wrong, erroring, multi-line, none) so that
EX, votes and pass@k have known values. ~30 s, most of it the torchrun launch.

    .venv/bin/pytest tests/test_eval_generate.py -q
"""
import itertools
import json
import os
import shutil
import sqlite3
import time

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, run_dist_check

import config as C
from sqltask import dataset
import eval as ev
from trainer import runguard
from sqltask import spider_score
import rollout
from model import Transformer
from sqltask import predictions
from toy import tiny
from rollout import Trajectory

from toy.prepare_toy import prepare_toy  # noqa: E402

LIMIT = 6
YAML = """data:
  prompt_template: compact
env:
  max_turns: 2
reward:
  mode: set
sampling:
  max_new_tokens: 12
  max_context: 1024
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    prepare_toy(d / "toy", seed=0)
    tiny.build_tiny(Transformer, str(d / "model"), vocab_size=512, hidden_size=32, layers=2, heads=2, kv_heads=1)
    (d / "cfg.yaml").write_text(YAML)
    data = str(d / "toy" / "eval.jsonl")
    base = ["generate", "--model", str(d / "model"), "--data", data, "--db-root", str(d / "toy"),
            "--config", str(d / "cfg.yaml"), "--limit", str(LIMIT), "--chunk", "2", "--threads", "1"]
    return d, data, base


def run_main(args):
    threads = torch.get_num_threads()
    try:
        ev.main(args)
    finally:
        torch.set_num_threads(threads)


def read_out(out):
    preds = open(os.path.join(out, "predictions.sql")).read().split("\n")
    assert preds[-1] == ""  # newline-terminated, one line per example
    traces = [json.loads(line) for line in open(os.path.join(out, "traces.jsonl"))]
    summary = json.load(open(os.path.join(out, "summary.json")))
    return preds[:-1], traces, summary


def rescore(out, db_root, mode="set"):
    """EX of predictions.sql by spider_score.score, the `eval.py score` code path."""
    preds, _, _ = read_out(out)
    gold = spider_score.read_gold(os.path.join(out, "gold.sql"))
    recs = spider_score.score(preds, gold, db_root, mode)
    return sum(r["exec_match"] for r in recs) / len(recs), [r["exec_match"] for r in recs]


# -----------------------------------------------------------------------------
# pure functions


def test_pass_at_k_matches_enumeration():
    """The closed form equals the fraction of k-subsets holding a correct sample."""
    for n in range(1, 7):
        for c in range(n + 1):
            correct = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                ref = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
                assert predictions.pass_at_k(n, c, k) == pytest.approx(ref)


def test_aggregate_hand_made():
    A, B, C = "A", "B", "C"  # stand-ins for result keys
    groups = [
        # 2 x A (wrong) beat 1 x B (right): vote wrong, pass@3 = 1, pass@1 = 1/3
        [{"correct": False, "key": A}, {"correct": True, "key": B}, {"correct": False, "key": A}],
        # two different SQL with the same (right) result outvote one wrong; the first of them is picked
        [{"correct": False, "key": C}, {"correct": True, "key": B}, {"correct": True, "key": B}],
        # tie 1-1 (+ a failed sample): the key seen first wins
        [{"correct": False, "key": None}, {"correct": True, "key": A}, {"correct": False, "key": C}],
        # nothing ran: sample 0 stands
        [{"correct": False, "key": None}, {"correct": False, "key": None}, {"correct": False, "key": None}],
    ]
    agg = predictions.aggregate(groups)
    assert agg["chosen"] == [0, 1, 1, 0]
    assert agg["majority"] == pytest.approx(2 / 4)
    assert set(agg["pass@k"]) == {1, 2, 3}
    # pass@1 = mean fraction correct: (1/3 + 2/3 + 1/3 + 0) / 4; pass@2 per group: 1-C(2,2)/C(3,2) = 2/3,
    # 1, 2/3, 0; pass@3: 1, 1, 1, 0
    assert agg["pass@k"][1] == pytest.approx((1 / 3 + 2 / 3 + 1 / 3) / 4)
    assert agg["pass@k"][2] == pytest.approx((2 / 3 + 1 + 2 / 3) / 4)
    assert agg["pass@k"][3] == pytest.approx(3 / 4)


def test_result_key_set_vs_bag():
    assert predictions.result_key([(1,), (1,)], "set") == predictions.result_key([(1.0,)], "set")  # 1 == 1.0, set
    assert predictions.result_key([(1,), (1,)], "bag") != predictions.result_key([(1,)], "bag")
    assert predictions.result_key([(1, "a"), (2, "b")], "bag") == predictions.result_key([[2, "b"], [1, "a"]], "bag")


def test_one_line_keeps_meaning(tmp_path):
    db = tmp_path / "t.sqlite"
    c = sqlite3.connect(db)
    c.execute("CREATE TABLE t (a INT, b TEXT)")
    c.executemany("INSERT INTO t VALUES (?,?)", [(1, "x"), (2, "y"), (3, "z")])
    sql = "SELECT a -- the id\nFROM t\t WHERE b != 'x' -- not x */ tricky\n\n  ORDER BY a /* multi\nline */"
    flat = predictions.one_line(sql)
    assert "\n" not in flat and "\t" not in flat and "\r" not in flat
    assert c.execute(flat).fetchall() == c.execute(sql).fetchall() == [(2,), (3,)]


def test_placeholder_scores_wrong_even_against_an_empty_gold(setup):
    d, data, _ = setup
    ex = dataset.load_examples(data, d / "toy", 1)[0]
    root = os.path.dirname(os.path.dirname(ex["db_file"]))
    gold = [("SELECT * FROM customers WHERE 0", ex["db_id"])]  # no rows: `SELECT 1 WHERE 0` would match
    for mode in ("set", "bag", "spider"):
        assert spider_score.score(["SELECT 1 WHERE 0"], gold, root, mode)[0]["exec_match"]
        assert not spider_score.score([predictions.PLACEHOLDER], gold, root, mode)[0]["exec_match"]


# -----------------------------------------------------------------------------
# the real rollout on a tiny random model, 1 process and torchrun


@pytest.fixture(scope="module")
def greedy_run(setup):
    d, data, base = setup
    out = str(d / "greedy")
    run_main(base + ["--out", out])
    return out


def test_files_order_and_placeholders(setup, greedy_run):
    d, data, _ = setup
    exs = dataset.load_examples(data, d / "toy", LIMIT)
    preds, traces, s = read_out(greedy_run)
    assert len(preds) == LIMIT and all(p.strip() and "\t" not in p for p in preds)
    assert [t["id"] for t in traces] == [e["id"] for e in exs]  # data order
    assert [t["index"] for t in traces] == list(range(LIMIT))
    for t, p in zip(traces, preds):
        assert t["prediction"] == p and t["chosen"]
        assert set(t) >= {"turns", "reward", "exec_match", "end_reason", "format_ok", "num_tool_calls"}
        assert 1 <= len(t["turns"]) == t["num_turns"] <= 2
        assert all(set(u) == {"text", "observation"} for u in t["turns"])
        if not t["format_ok"]:
            assert p == predictions.PLACEHOLDER and t["reward"] == -1.0
    assert s["decoding"] == "greedy" and s["n_examples"] == LIMIT and s["samples_per_example"] == 1
    assert s["format_error_rate"] == pytest.approx(sum(not t["format_ok"] for t in traces) / LIMIT)
    assert s["mean_turns"] == pytest.approx(sum(t["num_turns"] for t in traces) / LIMIT)
    assert set(s["ex_by_source"]) == {"toy"} and s["ex_by_source"]["toy"]["n"] == LIMIT
    gold = spider_score.read_gold(os.path.join(greedy_run, "gold.sql"))
    assert [g[1] for g in gold] == [e["db_id"] for e in exs]
    ex, _ = rescore(greedy_run, predictions.spider_db_root(exs))
    assert ex == pytest.approx(s["ex"])


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_torchrun_two_processes_match_one(setup, greedy_run):
    d, _, base = setup
    out = str(d / "greedy2")
    run = run_dist_check(str(ROOT / "eval.py"), *base, "--out", out, timeout=240)  # killed with its ranks past it
    assert run.returncode == 0, run.why()
    assert "2 process(es)" in run.output and "ETA" in run.output
    p1, t1, s1 = read_out(greedy_run)
    p2, t2, s2 = read_out(out)
    assert p2 == p1
    assert [[u["text"] for u in t["turns"]] for t in t2] == [[u["text"] for u in t["turns"]] for t in t1]
    assert s2["world_size"] == 2 and s2["ex"] == s1["ex"]


# -----------------------------------------------------------------------------
# a stub rollout with known answers: EX, votes and pass@k through the whole command

RIGHT, WRONG, ERROR = "right", "wrong", "error"


def answers_for(ex):
    """Per kind, an answer SQL for one toy example (the right ones written differently from gold)."""
    return {RIGHT: f"SELECT *\nFROM ({ex['gold_sql']}) -- same rows\n", WRONG: "SELECT 12345",
            ERROR: "SELECT nope FROM nowhere"}


def stub_rollout(plan):
    """plan[example id] = kinds of its samples (None = no solution). Episodes are example-major."""
    def fake(model, tok, exs, env_cfg, sampling_cfg, data_cfg, db_root, *, n=1, seed=0, greedy=False, dtype=None,
             logits_hook=None, stats=None, engine=None):
        out = []
        for ex in exs:
            for kind in plan[ex["id"]][:n]:
                if kind is None:
                    text, sql = "<think>hmm</think> I give up", ""
                else:
                    sql = answers_for(ex)[kind]
                    text = f"<think>ok</think>\n<solution>{sql}</solution>"
                ids = tok.encode(text)
                out.append(Trajectory.of([], ids, [1] * len(ids), [0.0] * len(ids),
                                         turn_spans=[(0, len(ids))], num_turns=1, final_sql=sql.strip(),
                                         end_reason="answer" if kind else "turn_budget", finished=kind is not None,
                                         text=text))
        return out
    return fake


def test_stub_greedy_ex_matches_score(setup, monkeypatch):
    d, data, base = setup
    exs = dataset.load_examples(data, d / "toy", LIMIT)
    kinds = [RIGHT, WRONG, ERROR, None, RIGHT, RIGHT]
    monkeypatch.setattr(rollout, "rollout", stub_rollout({e["id"]: [k] for e, k in zip(exs, kinds)}))
    out = str(d / "stub1")
    run_main(base + ["--out", out])
    preds, traces, s = read_out(out)
    assert preds[3] == predictions.PLACEHOLDER and preds[2] == "SELECT nope FROM nowhere"
    assert preds[0] == predictions.one_line(answers_for(exs[0])[RIGHT]) and "\n" not in preds[0]
    assert [t["exec_match"] for t in traces] == [k == RIGHT for k in kinds]
    assert s["ex"] == pytest.approx(3 / 6) and s["format_error_rate"] == pytest.approx(1 / 6)
    for mode in ("set", "bag", "spider"):  # every mode agrees here: whole-table answers
        ex, per = rescore(out, predictions.spider_db_root(exs), mode)
        assert ex == pytest.approx(s["ex"]) and per == [k == RIGHT for k in kinds]


def test_stub_majority_and_pass_at_k(setup, monkeypatch):
    d, data, base = setup
    exs = dataset.load_examples(data, d / "toy", LIMIT)
    plan = [[WRONG, RIGHT, WRONG],   # vote wrong (2 x same result), pass@3 1
            [ERROR, RIGHT, RIGHT],   # vote right; the error has no result
            [None, RIGHT, WRONG],    # tie 1-1: first seen (right, sample 1)
            [None, None, ERROR],     # nothing ran: sample 0, the placeholder
            [RIGHT, RIGHT, RIGHT],
            [WRONG, WRONG, ERROR]]
    monkeypatch.setattr(rollout, "rollout", stub_rollout({e["id"]: p for e, p in zip(exs, plan)}))
    out = str(d / "stub3")
    run_main(base + ["--out", out, "--n", "3", "--temperature", "0.7"])
    preds, traces, s = read_out(out)
    assert s["decoding"] == "majority@3 over sampling T=0.7 top_p=0.95" and s["samples_per_example"] == 3
    assert len(traces) == 3 * LIMIT and [(t["index"], t["sample"]) for t in traces] == \
        [(i, j) for i in range(LIMIT) for j in range(3)]
    chosen = [[t["sample"] for t in traces if t["index"] == i and t["chosen"]] for i in range(LIMIT)]
    assert chosen == [[0], [1], [1], [0], [0], [0]]
    assert preds[3] == predictions.PLACEHOLDER
    assert s["majority@3"] == pytest.approx(3 / 6) == s["ex"]
    n_right = [p.count(RIGHT) for p in plan]
    assert s["pass@k"]["1"] == pytest.approx(sum(n_right) / 18) == s["ex_per_sample"]
    assert s["pass@k"]["3"] == pytest.approx(4 / 6)
    assert s["pass@k"]["2"] == pytest.approx(sum(predictions.pass_at_k(3, c, 2) for c in n_right) / 6)
    ex, _ = rescore(out, predictions.spider_db_root(exs))
    assert ex == pytest.approx(s["ex"])


def test_stub_error_recovery(setup, monkeypatch):
    """The summary's error recovery counts episodes whose first query (not a DESCRIBE) failed or
    returned no rows, and those of them that still ended right."""
    d, data, base = setup
    exs = dataset.load_examples(data, d / "toy", LIMIT)
    step = lambda kind, ok, n_rows: {"kind": kind, "arg": "", "ok": ok, "rows": None, "n_rows": n_rows}  # noqa: E731
    plan = [([step("sql", False, None)], RIGHT),             # failed, recovered
            ([step("sql", True, 0), step("sql", True, 3)], RIGHT),  # empty, recovered
            ([step("sql", True, 0)], WRONG),                 # empty, not recovered
            ([step("sql", True, 2)], WRONG),                 # a good first query: not counted
            ([step("describe", False, None), step("query", True, 1)], RIGHT),  # first QUERY was fine
            ([], ERROR)]                                     # no tool call
    fake = stub_rollout({e["id"]: [kind] for e, (_, kind) in zip(exs, plan)})
    steps_of = {e["id"]: steps for e, (steps, _) in zip(exs, plan)}

    def with_steps(model, tok, chunk, *args, **kw):  # called once per chunk of examples
        trajs = fake(model, tok, chunk, *args, **kw)
        for t, ex in zip(trajs, chunk):
            t.steps = steps_of[ex["id"]]
        return trajs
    monkeypatch.setattr(rollout, "rollout", with_steps)
    out = str(d / "stub_recovery")
    run_main(base + ["--out", out])
    _, traces, s = read_out(out)
    assert [t["first_query_bad"] for t in traces] == [True, True, True, False, False, False]
    assert (s["first_query_bad"], s["recovered"]) == (3, 2) and s["recovery_rate"] == pytest.approx(2 / 3)


def test_greedy_with_n_gt_1_is_refused(setup):
    _, _, base = setup
    with pytest.raises(runguard.RunError, match="--temperature"):
        run_main(base + ["--n", "2", "--temperature", "0"])


# -----------------------------------------------------------------------------
# a checkpoint's own settings, bad --model values, golds that fail


@pytest.fixture(scope="module")
def checkpoint_dir(setup):
    """A folder laid out as checkpoint.save writes one: hf/ (the model) and config.yaml (the run's
    settings, none of them the defaults: compact template, 2 turns, 12 tokens a turn, set mode)."""
    d, data, _ = setup
    ck = d / "run" / "ckpt_000024"
    shutil.copytree(d / "model", ck / "hf")
    cfg = C.load_config([str(d / "cfg.yaml"), f"--data.eval_path={data}", f"--data.db_root={d / 'toy'}",
                         "--train.threads=1"])
    (ck / "config.yaml").write_text(C.dump(cfg))
    (ck / "trainer.pt").write_bytes(b"")
    return ck


def test_resolve_model(checkpoint_dir, tmp_path):
    ck = checkpoint_dir
    assert ev.resolve_model(str(ck)) == (str(ck / "hf"), str(ck / "config.yaml"))
    assert ev.resolve_model(str(ck / "hf")) == (str(ck / "hf"), str(ck / "config.yaml"))
    assert ev.resolve_model(str(ck.parent.parent / "model")) == (str(ck.parent.parent / "model"), "")
    lora_ck = tmp_path / "ckpt_000008"
    (lora_ck / "adapter").mkdir(parents=True)
    (lora_ck / "config.yaml").write_text("{}")
    with pytest.raises(C.ConfigError, match="a checkpoint without hf/ .*lora_save_merged"):
        ev.resolve_model(str(lora_ck))


def test_a_checkpoint_is_evaluated_with_its_own_settings(setup, checkpoint_dir, monkeypatch, capsys):
    """Before: the README's command (no --config) ran the defaults (SkyRL template, 6 turns, 3000
    tokens a turn) on a tiny checkpoint: no progress after 400 s, EX 0%. The checkpoint's
    config.yaml holds the run's settings; --data and --db-root default to its eval split."""
    d, data, _ = setup
    exs = dataset.load_examples(data, d / "toy", LIMIT)
    monkeypatch.setattr(rollout, "rollout", stub_rollout({e["id"]: [RIGHT] for e in exs}))
    for model in (checkpoint_dir, checkpoint_dir / "hf"):
        out = str(d / "from_ckpt")
        run_main(["generate", "--model", str(model), "--limit", str(LIMIT), "--out", out])
        _, _, s = read_out(out)
        assert (s["prompt_template"], s["max_turns"], s["max_new_tokens"], s["reward_mode"]) == ("compact", 2, 12, "set")
        assert s["settings"] == f"{checkpoint_dir / 'config.yaml'} (the checkpoint's)" and s["ex"] == 1.0
        assert s["model"] == str(checkpoint_dir / "hf") and s["data"] == data
    printed = capsys.readouterr().out
    assert "template compact, protocol tags (single), max_turns 2, max_new_tokens 12" in printed
    assert f"{LIMIT}/{LIMIT} examples | EX 100.0%" in printed  # the progress line
    # --config still wins over the checkpoint's own
    # (cfg.yaml names no data, so --data/--db-root are given: its defaults are runs/toy, absent on a fresh clone)
    run_main(["generate", "--model", str(checkpoint_dir), "--limit", "2", "--out", out, "--config", str(d / "cfg.yaml"),
              "--data", data, "--db-root", str(d / "toy"), "--env.max_turns=1"])
    assert read_out(out)[2]["max_turns"] == 1 and read_out(out)[2]["settings"] == str(d / "cfg.yaml")


def test_a_missing_model_is_an_immediate_error_without_the_network(setup, tmp_path):
    """A --model that does not exist was once taken for a hub name and retried for 49 s."""
    _, data, _ = setup
    t0 = time.time()
    with pytest.raises(C.ConfigError, match=f"--model {tmp_path}/nope: no such folder"):
        run_main(["generate", "--model", str(tmp_path / "nope"), "--data", data])
    only_config = tmp_path / "only_config"  # "need sentencepiece or tiktoken" before
    only_config.mkdir()
    shutil.copy(setup[0] / "model" / "config.json", only_config)
    with pytest.raises(C.ConfigError, match="--model .*only_config: no tokenizer"):
        run_main(["generate", "--model", str(only_config), "--data", data, "--db-root", str(setup[0] / "toy")])
    assert time.time() - t0 < 30  # at once (~0.1 s): a hub lookup retried for 49 s; 30 s leaves load its delay
    with pytest.raises(C.ConfigError, match="--chunk must be >= 1, got 0"):
        run_main(["generate", "--model", str(setup[0] / "model"), "--data", data, "--chunk", "0"])


def test_examples_whose_gold_fails_are_skipped_and_counted(setup, tmp_path, monkeypatch, capsys):
    """A gold that fails on its database makes its question score 0 whatever the model writes: it is
    dropped (as train.py's evals drop it), counted in summary.json and named in a WARNING line."""
    d, data, base = setup
    lines = open(data).read().splitlines()[:LIMIT]
    broken = json.loads(lines[1])
    broken["gold_sql"] = "SELECT no_such_column FROM customers"
    lines[1] = json.dumps(broken)
    bad = tmp_path / "eval.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    exs = dataset.load_examples(data, d / "toy", LIMIT)
    monkeypatch.setattr(rollout, "rollout", stub_rollout({e["id"]: [RIGHT] for e in exs}))
    run_main([*base[:4], str(bad), *base[5:], "--out", str(tmp_path / "out")])
    _, traces, s = read_out(tmp_path / "out")
    assert s["n_examples"] == LIMIT - 1 and s["skipped_gold_fails"] == 1 and s["ex"] == 1.0
    assert [t["id"] for t in traces] == [e["id"] for i, e in enumerate(exs) if i != 1]
    assert f"WARNING: {bad}: skipped 1 of {LIMIT} examples whose gold query fails on its database: {bad}:2: " \
           "no such column: no_such_column" in capsys.readouterr().out
