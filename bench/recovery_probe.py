"""Error recovery by intervention: does a policy read a failed or empty query's observation and fix it?

    .venv/bin/python bench/recovery_probe.py --model runs/recipe/s0/ckpt_000000 [--model CKPT2 ...]
                                             [--db-root $SPIDER_DIR] [--data FILE.jsonl] [--limit 100]
                                             [--out DIR] [--group.key=value ...]
    .venv/bin/python bench/recovery_probe.py --records DIR/NAME.jsonl [...]   # its figures again

The evals count recovery on the policy's own episodes (eval/recovery_rate: the first query failed or
returned no rows, and the episode still ended right). A policy that never queries before it answers
(SmolLM2 after a warm start on gold episodes that DESCRIBE, then ANSWER) gives that rate nothing to
count. This probe makes the event happen with the policy's own SQL:

1. greedy episodes on the held-out questions, as the evals run them (rollout.sample_episodes);
2. each episode that ended on an answer, with no query before it and a turn left after it, has that
   answer turn rewritten as a query of the same SQL (ANSWER -> QUERY; <solution> -> <sql>), tokenized
   as a replayed turn is, and run by the env: its observation is the rows, the error or the empty
   result that the answer would have produced;
3. the conversation so far, the forced query and its observation are the prompt of a greedy
   continuation with the turns the episode had left (rollout.rollout's `starts`);
4. of the forced queries of wrong answers that failed or returned no rows, the share whose
   continuation ends right is the recovery rate; `retried` counts those that answered with other SQL
   than the failed one. An empty result that is the right answer (the gold has no rows either) is no
   failure: counted apart. Forced queries that returned rows show whether seeing the rows keeps a
   right answer right.

Settings are the checkpoint's own (eval.py generate's rule). Writes DIR/<model name>.jsonl (one line
per probed episode) and prints, per model, headline lines `recovery_rate[NAME]: value` last.
Tests: .venv/bin/pytest tests/test_recovery_probe.py
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import env  # noqa: E402
import eval as evaluation  # noqa: E402
import rollout  # noqa: E402
from engine.sampling import row_key  # noqa: E402
from sqltask import dataset  # noqa: E402
from sqltask.chat import observation_ids  # noqa: E402

QUERY_KINDS = ("sql", "query")  # a query of either protocol (env.first_query_bad's rule)


def as_query(turn: str, protocol: str) -> str | None:
    """An answer turn rewritten as a query of the same SQL (the rest of the text kept), or None when
    the turn is no answer or the rewrite does not parse as that query."""
    if protocol == "actions":
        query = re.sub(r"(<action>\s*)ANSWER\b", r"\1QUERY", turn, count=1, flags=re.I)
    else:
        query = turn.replace("<solution>", "<sql>").replace("</solution>", "</sql>")
    said, meant = env.parse_turn(query, protocol), env.parse_turn(turn, protocol)
    return query if meant.kind in ("solution", "answer") and said.kind in QUERY_KINDS and said.arg == meant.arg else None


def force_queries(episodes, tok, cfg) -> tuple[list[dict], list[tuple]]:
    """Each episode's answer turned into a query and run by the env. -> (one record per episode,
    with its `case`; the continuations to sample: (record, example, prompt ids, turns left) for every
    forced query that ran). Cases: no_answer (it never answered), queried (a query came before the answer:
    its own first query is what the evals count), no_turn_left (the answer was its last allowed
    turn), unforceable (the rewrite does not parse as the same query), then the forced query's
    outcome: failed (an error or a timeout), empty (no rows) or rows."""
    budget, protocol = rollout.max_turns(cfg.env), cfg.env.protocol
    recs, todo = [], []
    for e in episodes:
        t = e.trajectory
        rec = {"id": e.example["id"], "db_id": e.example["db_id"], "question": e.example["question"],
               "gold_sql": e.example["gold_sql"], "answer": t.final_sql, "answer_right": bool(e.reward.exec_match)}
        recs.append(rec)
        left = budget - len(t.turn_spans)  # generations allowed after the answer's turn
        if not t.finished:
            rec["case"] = "no_answer"
        elif any(s["kind"] in QUERY_KINDS for s in t.steps):
            rec["case"] = "queried"
        elif left < 1:
            rec["case"] = "no_turn_left"
        else:
            start, end = t.turn_spans[-1]
            query = as_query(tok.decode(t.ids[start:end]), protocol)
            if query is None:
                rec["case"] = "unforceable"
            else:  # its case is the forced query's outcome, set below
                todo.append((rec, e, t.ids[:start], query, left))
    steps = env.step_batch([dataset.abs_db_path(e.example, cfg.data.db_root) for _, e, *_ in todo],
                           [query for *_, query, _ in todo], [left for *_, left in todo], cfg.env)
    starts = []
    for (rec, e, before, query, left), step in zip(todo, steps):
        res = step.result
        rec["case"] = "failed" if not (res and res.ok) else ("empty" if not res.rows else "rows")
        rec["observation"] = step.observation
        query_ids = tok.encode(query, add_special_tokens=False)  # a turn encoded alone, as replay.py does
        prompt = list(before) + query_ids + observation_ids(tok, step.observation, cfg.env.conversation, query_ids[-1])
        starts.append((rec, e.example, prompt, left))
    return recs, starts


def continue_episodes(model, tok, starts: list[tuple], cfg, engine=None, logits_hook=None) -> None:
    """Greedy continuations after each forced query, with the turns its episode had left (one rollout
    per number of turns left); fills each record's continuation, final answer and `right`. engine: a
    sampler's kept one on `model`; logits_hook: as rollout.rollout's (tests script the turns)."""
    for left in sorted({s[3] for s in starts}):
        group = [s for s in starts if s[3] == left]
        ecfg = dataclasses.replace(cfg.env, step_budget=left, max_turns=left)  # the turns after the forced one
        trajs = [rollout.Trajectory.start(prompt, row_key(0, i), i, 0, i) for i, (_, _, prompt, _) in enumerate(group)]
        dbs = [dataset.abs_db_path(ex, cfg.data.db_root) for _, ex, _, _ in group]
        exs = [ex for _, ex, _, _ in group]
        rollout.rollout(model, tok, exs, ecfg, cfg.sampling, cfg.data, cfg.data.db_root, greedy=True,
                        engine=engine, logits_hook=logits_hook, starts=(trajs, dbs))
        episodes = rollout.reward_episodes(trajs, exs, tok, dataclasses.replace(cfg, env=ecfg), n=1)
        for (rec, *_), ep in zip(group, episodes):
            t = ep.trajectory
            rec.update(continuation=t.text, final_sql=t.final_sql if t.finished else None,
                       right=bool(ep.reward.exec_match), requeried=any(s["kind"] in QUERY_KINDS for s in t.steps))


def summarise(recs: list[dict]) -> dict:
    """Counts per case, and the recovery figures. A failed or empty forced query of a wrong answer
    is the event: of those, how many ended right (recovered), answered with other SQL (retried) or
    queried again (requeried). An empty result can also be the right answer (the gold returns no
    rows): counted apart (empty_right, and how many stayed right). Of the forced queries that
    returned rows: how many answers stayed right, turned right or turned wrong."""
    s = {"n": len(recs), "ex": sum(r["answer_right"] for r in recs) / max(1, len(recs))}
    for case in ("no_answer", "queried", "no_turn_left", "unforceable", "failed", "empty", "rows"):
        s[case] = sum(r["case"] == case for r in recs)
    bad = [r for r in recs if r["case"] in ("failed", "empty") and not r["answer_right"]]
    norm = lambda sql: " ".join((sql or "").split()).rstrip(";").lower()  # noqa: E731
    s.update(bad=len(bad), recovered=sum(r["right"] for r in bad),
             retried=sum(r["final_sql"] is not None and norm(r["final_sql"]) != norm(r["answer"]) for r in bad),
             requeried=sum(r["requeried"] for r in bad),
             recovery_rate=sum(r["right"] for r in bad) / len(bad) if bad else None)
    empty_right = [r for r in recs if r["case"] == "empty" and r["answer_right"]]
    s.update(empty_right=len(empty_right), empty_right_stayed=sum(r["right"] for r in empty_right))
    rows = [r for r in recs if r["case"] == "rows"]
    s.update(rows_stayed_right=sum(r["answer_right"] and r["right"] for r in rows),
             rows_turned_right=sum(not r["answer_right"] and r["right"] for r in rows),
             rows_turned_wrong=sum(r["answer_right"] and not r["right"] for r in rows))
    return s


def probe(model_path: str, args) -> dict:
    """One model: its greedy episodes, the forced queries, the continuations -> summarise's dict."""
    import torch
    from rollout import sample_episodes
    t0 = time.time()
    cfg, model_dir, source = evaluation.generate_config(SimpleNamespace(
        model=model_path, config=args.config, overrides=args.overrides, n=1, chunk=1, limit=args.limit,
        max_turns=0, threads=None, temperature=0, db_root=args.db_root))
    torch.set_num_threads(args.threads or cfg.train.threads or torch.get_num_threads())
    exs = dataset.load_examples(args.data or cfg.data.eval_path, cfg.data.db_root, args.limit)
    errors = dataset.gold_failures(exs, cfg.reward)  # a gold that fails can never match: skipped
    exs, note = dataset.drop_failing_golds(exs, errors, args.data or cfg.data.eval_path)
    if note:
        print(f"WARNING: {note}")
    device = torch.device("cpu") if not torch.cuda.is_available() else torch.device("cuda")
    tok, sampler, pool = evaluation.inference_sampler(cfg, model_dir, device, len(exs))
    sampler.refresh(sampler.model)
    print(f"[{model_path}] settings from {source}; {len(exs)} questions; {pool}", flush=True)
    episodes = sample_episodes(sampler, tok, exs, cfg, n=1, seed=cfg.train.seed + 10_000, greedy=True)
    recs, starts = force_queries(episodes, tok, cfg)
    continue_episodes(sampler.model, tok, starts, cfg, engine=sampler.engine)
    s = summarise(recs)
    s.update(model=model_path, time_s=round(time.time() - t0, 1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_path.strip("/"))
        with open(os.path.join(args.out, name + ".jsonl"), "w") as fh:
            fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=[], help="a checkpoint (ckpt_<step>/), its hf/, or an HF folder")
    ap.add_argument("--records", action="append", default=[], help="a jsonl this probe wrote: summarised again, "
                    "nothing sampled")
    ap.add_argument("--config", default="", help="settings when --model is no checkpoint (eval.py generate's rule)")
    ap.add_argument("--data", default="", help="held-out jsonl (default: the settings' data.eval_path)")
    ap.add_argument("--db-root", default="", help="where the records' databases are (default: data.db_root)")
    ap.add_argument("--limit", type=int, default=100, help="first N questions (0 = all)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="runs/recovery_probe", help="one jsonl per model ('' = none)")
    args, args.overrides = ap.parse_known_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not args.model and not args.records:
        ap.error("give --model (probe a policy) or --records (summarise a probe's jsonl again)")
    results = [probe(m, args) for m in args.model]
    for path in args.records:
        with open(path) as fh:
            results.append(dict(summarise([json.loads(line) for line in fh]), model=path))
    for s in results:
        print(json.dumps(s))
    for s in results:
        rate = "n/a (no wrong answer's query failed)" if s["recovery_rate"] is None else f"{s['recovery_rate']:.3f}"
        print(f"recovery_rate[{s['model']}]: {rate} ({s['recovered']}/{s['bad']} wrong answers whose query "
              f"failed ({s['failed']}) or came back empty ({s['empty'] - s['empty_right']}); retried "
              f"{s['retried']}, requeried {s['requeried']}; EX {100 * s['ex']:.1f}%)")


if __name__ == "__main__":
    main()
