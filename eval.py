"""Evaluation entry point.

    python eval.py score --pred PRED.sql --gold dev_gold.sql --db-root DIR/database [--mode spider] [--out FILE]
                         [--verdicts OFFICIAL.verdicts.jsonl]

`score`: PRED has one SQL per line (line i <-> gold line i); GOLD has Spider's `SQL<TAB>db_id`
lines; databases are DIR/<db_id>/<db_id>.sqlite. Prints EX over the examples whose database
exists and is usable, and how many were skipped because it is missing or unusable (empty, corrupt,
unreadable: named on the same line). --out writes one JSON line per example
(index, db_id, exec_match, skipped, error). --verdicts compares our verdicts with a file of the
official evaluator's (fields index, exec_match, skipped) and prints the agreement.
In spider mode each prediction line goes through the official evaluation.py's input handling:
stripped, cut at its first TAB, " value " -> " 1 ". Other modes use the stripped line whole.

    python eval.py generate --model runs/tiny/ckpt_000024 [--out DIR]          # a checkpoint: its run's settings
    python eval.py generate --model DIR [--data FILE.jsonl] [--db-root DIR] [--n K] [--temperature T]
                            [--max-turns N] [--config YAML] [--out DIR] [--limit N] [--group.key=value ...]
    torchrun --standalone --nproc_per_node=2 eval.py generate ... [--samples K]   # split over ranks
      (torchrun reads `--n` as an ambiguous abbreviation of its own options: write --samples there)

`generate`: multi-turn episodes, then their rewards, as training runs them (policy_sampler.py,
episodes.rewards), greedy unless --temperature > 0 (default: the config's
sampling.eval_temperature). The settings (env / sampling / data / reward, train.threads) are a
checkpoint's own config.yaml when --model is a checkpoint (ckpt_<step>/ or its hf/) and --config
is not given, else --config's, else the defaults; flags and --group.key=value override them;
--data and --db-root default to data.eval_path and data.db_root. Nothing is downloaded: a
--model that is not a model folder is an error at once. Examples whose gold query fails on its
database are skipped and counted (as train.py's evals skip them). Writes in --out:
predictions.sql (one SQL per line in data order, on one line; a failed episode, i.e. no valid
solution, writes PLACEHOLDER, which always scores wrong; with --n > 1 the majority vote by
execution result), gold.sql (`SQL<TAB>db_id`, for `score`), traces.jsonl (one line per episode:
every turn's model text and observation, reward, exec_match, stop reason) and summary.json (EX
overall and by source, with --n > 1 pass@k and majority@k, mean turns and tool calls, format-
error rate, error recovery: episodes whose first query failed or returned no rows and how many of
them still ended right, the decoding label). Examples go in fixed chunks (a progress line with ETA after
each), dealt round-robin to ranks; each rank holds a full model copy; rank 0 gathers in order.
Summary EX uses reward.mode on the lines as written, so `score` on predictions.sql agrees.

Agreement with the official test-suite evaluator (taoyds/test-suite-sql-eval, exec match, default
settings): 972/972 per-example verdicts on both files in ../shared/data/spider_preds
(tests/test_eval_score.py). Deliberate differences, none of which occurs in those files:
- queries run in sandbox.py's read-only sandbox: a prediction that writes, attaches, etc. is an error
  (the official script executes it against the database file);
- each query has a timeout (--timeout, 30 s; the official one cannot interrupt a query), SQL text
  is capped at 100 KB and results at 1e6 rows / 64 MB;
- invalid UTF-8 in the database is decoded with replacement (official: dropped); both sides are
  decoded the same way, so verdicts differ only if two texts differ by invalid bytes alone;
- a blank prediction line is an empty (wrong) prediction at its position (the official script
  treats blank lines as separators between interaction sessions).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from sqltask import dataset
import env
import reward
from trainer import runguard
from sqltask import sandbox
from sqltask import spider_score
from trainer.distributed import all_sum
from rollout import sample_episodes

# -----------------------------------------------------------------------------
# the held-out evaluation of a run (train.py, sft.py) and the summaries of episodes


def summarise(episodes) -> dict:
    """Per-rank sums over rollout.Episode records (reduce_summary all-reduces them into means):
    count, reward, EX, format errors, turns, tool calls, response tokens."""
    return {"n": len(episodes), "reward": sum(e.reward.value for e in episodes),
            "ex": sum(float(e.reward.exec_match) for e in episodes),
            "format_err": sum(float(not e.reward.format_ok) for e in episodes),
            "turns": sum(e.trajectory.num_turns for e in episodes),
            "tool_calls": sum(e.trajectory.num_tool_calls for e in episodes),
            "resp_tokens": sum(int(sum(e.trajectory.loss_mask)) for e in episodes)}


def reduce_summary(s: dict, device) -> dict:
    keys = list(s)
    tot = dict(zip(keys, all_sum([s[k] for k in keys], device)))
    n = max(tot.pop("n"), 1)
    return {k: v / n for k, v in tot.items()}


def evaluate(sampler, tok, eval_ex, cfg, rank, world, device, log, step: int, prefix="eval") -> dict:
    """Held-out episodes split over ranks (greedy at sampling.eval_temperature 0) on the sampler's
    current weights (its owner refreshes it: train.py after an optimizer step, sft.py before an
    eval), their reduced metrics under `prefix/`, logged (log: run_log.Log) and printed on one
    line; returns the metrics."""
    mine = eval_ex[rank::world]
    T = cfg.sampling.eval_temperature  # greedy at 0, else sampled at T (as eval.py generate does)
    sampling = dataclasses.replace(cfg.sampling, temperature=T) if T > 0 else cfg.sampling
    t0 = time.time()
    episodes = sample_episodes(sampler, tok, mine, cfg, n=1, seed=cfg.train.seed + 10_000, greedy=T == 0,
                               sampling=sampling)
    seconds = time.time() - t0
    m = reduce_summary(summarise(episodes), device)
    m = {f"{prefix}/{k}": v for k, v in m.items()}
    # error recovery (eval.py generate's rule): episodes whose first query failed or returned no
    # rows, and of those the ones that still ended right; counts summed over ranks
    bad = [env.first_query_bad(e.trajectory.steps) for e in episodes]
    n_bad, n_rec = all_sum([sum(bad), sum(b and bool(e.reward.exec_match) for b, e in zip(bad, episodes))], device)
    m.update({f"{prefix}/first_query_bad": n_bad, f"{prefix}/recovered": n_rec})
    if n_bad:
        m[f"{prefix}/recovery_rate"] = n_rec / n_bad
    log.metrics(step, m)
    log.print(f"[{prefix} @ step {step}] EX {100 * m[prefix + '/ex']:.1f}%  reward {m[prefix + '/reward']:.3f}  "
              f"format-err {100 * m[prefix + '/format_err']:.1f}%  turns {m[prefix + '/turns']:.2f}  "
              f"tool-calls {m[prefix + '/tool_calls']:.2f}  first query empty/failed {n_bad:.0f}, "
              f"recovered {n_rec:.0f}  ({len(eval_ex)} examples, {seconds:.1f}s)")
    return m


# -----------------------------------------------------------------------------
# score (spider_score.py)


def cmd_score(args) -> None:
    t0 = time.time()
    for flag, path in (("--pred", args.pred), ("--gold", args.gold)):
        if not os.path.isfile(path):
            raise runguard.RunError(f"{flag} {path}: no such file")
    with open(args.pred) as fh:
        pred_lines = fh.read().split("\n")
    if pred_lines and pred_lines[-1] == "":
        pred_lines.pop()  # the final newline
    gold = spider_score.read_gold(args.gold)
    recs = spider_score.score(pred_lines, gold, args.db_root, args.mode, timeout_s=args.timeout,
                 keep_distinct=args.keep_distinct, workers=args.workers)
    unusable = unusable_databases(recs, args.db_root)  # corrupt, empty, unreadable: skipped, named
    for r in recs:
        if r["db_id"] in unusable:
            r.update(skipped=True, exec_match=False, error=unusable[r["db_id"]])
    done = [r for r in recs if not r["skipped"]]
    hits = sum(r["exec_match"] for r in done)
    n_bad = sum(r["db_id"] in unusable for r in recs)
    bad = (f", {n_bad} on an unusable database: " + "; ".join(f"{os.path.join(args.db_root, d, d + '.sqlite')}: {why}"
                                                                for d, why in sorted(unusable.items()))) if n_bad else ""
    print(f"mode {args.mode}: EX {hits}/{len(done)} = {100 * hits / max(1, len(done)):.2f}% "
          f"({len(recs) - len(done)} skipped: {len(recs) - len(done) - n_bad} database missing{bad}) "
          f"in {time.time() - t0:.1f}s")
    if args.out:
        with open(args.out, "w") as fh:
            for r in recs:
                fh.write(json.dumps(r) + "\n")
    if args.verdicts:
        agree, n, diff = spider_score.compare_verdicts(recs, args.verdicts)
        print(f"agreement with {os.path.basename(args.verdicts)}: {agree}/{n}"
              + (f"; differ at {diff}" if diff else ""))


def unusable_databases(recs: list[dict], db_root: str) -> dict[str, str]:
    """{db_id: what is wrong} for the databases present but not usable: an empty (0-byte) file, not
    a SQLite file, unreadable, no tables. Their examples would all score wrong for a reason that is
    no prediction's fault; `score` skips them and says why in its summary line."""
    out = {}
    for db_id in sorted({r["db_id"] for r in recs if not r["skipped"]}):
        if problem := dataset.database_problem(os.path.join(db_root, db_id, db_id + ".sqlite")):
            out[db_id] = problem
    return out


# -----------------------------------------------------------------------------
# generate: rollouts with the training code -> predictions, traces, summary

PLACEHOLDER = "SELECT __no_solution__"  # a failed episode's line: always an error, so always wrong
# (`SELECT 1 WHERE 0` would not do: it matches a gold that returns no rows)


def one_line(sql: str) -> str:
    """SQL on one line for a Spider-format file: whitespace runs -> one space, `--` comments ->
    /* */ (on one line they would swallow the rest), newlines/tabs inside a literal -> space
    (changes that literal; rare, and the summary scores exactly the line written)."""
    out = []
    for t in sandbox.sql_tokens(sql):
        if t.isspace():
            out.append(" ")
        elif t.startswith("--"):
            out.append("/*" + t[2:].replace("*/", "* /") + " */")
        else:
            out.append(re.sub(r"[\r\n\t]", " ", t))
    return "".join(out).strip()


def decoding_label(temperature: float, top_p: float, n: int) -> str:
    """How predictions were decoded: greedy, sampling or majority vote move scores by up to 10 points."""
    if temperature == 0:
        return "greedy"
    s = f"sampling T={temperature:g}" + (f" top_p={top_p:g}" if top_p < 1 else "")
    return s if n == 1 else f"majority@{n} over {s}"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def result_key(rows, mode: str):
    """What majority voting compares: the result as a set of rows (mode set) or a bag (bag, spider;
    spider's row order and column permutations are ignored for voting). 1 == 1.0 as in the reward."""
    rows = [tuple(r) for r in rows]
    return frozenset(rows) if mode == "set" else frozenset(collections.Counter(rows).items())


def aggregate(groups: list[list[dict]], ks=None) -> dict:
    """groups[i][j] = sample j of example i: {"correct": bool, "key": its result_key, or None when
    it has no valid answer or the answer failed to run}. Majority vote by execution result: the most
    frequent key wins, ties go to the key seen first; the vote's prediction is the first sample with
    that key (sample 0 when no sample has one). Returns {"chosen": [j per example], "majority": EX
    of the chosen samples, "pass@k": {k: mean unbiased pass@k}} for k in 1, 2, 4, ... and n."""
    n = max((len(g) for g in groups), default=0)
    ks = ks or sorted({k for k in (1, 2, 4, 8, 16, 32, 64, n) if 1 <= k <= n})
    chosen = []
    for g in groups:
        counts = collections.Counter(s["key"] for s in g if s["key"] is not None)
        best = max(counts.values(), default=0)
        chosen.append(next((j for j, s in enumerate(g) if s["key"] is not None and counts[s["key"]] == best), 0))
    m = max(1, len(groups))
    return {"chosen": chosen, "majority": sum(bool(g[j]["correct"]) for g, j in zip(groups, chosen)) / m,
            "pass@k": {k: sum(pass_at_k(len(g), sum(bool(s["correct"]) for s in g), k) for g in groups) / m
                       for k in ks}}


def turns_of(t, tokenizer) -> list[dict]:
    """Each turn's model text and the observation appended after it, decoded from the ids (what the
    model saw, template tokens included in the conversation format)."""
    out = []
    for k, (s, e) in enumerate(t.turn_spans):
        nxt = t.turn_spans[k + 1][0] if k + 1 < len(t.turn_spans) else len(t.ids)
        out.append({"text": tokenizer.decode(t.ids[s:e]), "observation": tokenizer.decode(t.ids[e:nxt])})
    return out


def generate_chunk(sampler, tok, exs: list[dict], first: int, cfg, n: int, seed: int, greedy: bool) -> list[dict]:
    """Episodes of exs (global indices first, first+1, ...) -> one record per episode, example-major.
    Rollout then reward as training runs them (rollout.sample_episodes), the answer scored as its
    predictions.sql line. The seed depends on the chunk only, so any split over ranks gives the same
    episodes."""
    spider = cfg.reward.mode == "spider"  # score the line as `score` will read it

    def answer(t) -> str:
        line = one_line(t.final_sql) if t.finished else ""
        return spider_score.official_pred_text(line) if spider else line
    episodes = sample_episodes(sampler, tok, exs, cfg, n=n, seed=seed, greedy=greedy, answers=answer)
    lines = [one_line(e.trajectory.final_sql) if e.trajectory.finished else "" for e in episodes]
    answers = [answer(e.trajectory) for e in episodes]
    keys = [None] * len(episodes)
    if n > 1:  # majority vote needs each answer's result
        todo = [i for i, (e, a) in enumerate(zip(episodes, answers)) if e.reward.format_ok and a.strip()]
        res = sandbox.run_sql_batch([(dataset.abs_db_path(episodes[i].example, cfg.data.db_root), answers[i])
                                     for i in todo], timeout_s=cfg.reward.timeout_s, max_rows=reward.REWARD_MAX_ROWS)
        for i, r in zip(todo, res):
            keys[i] = result_key(r.rows, cfg.reward.mode) if r.ok else None
    recs = []
    for k, (e, line) in enumerate(zip(episodes, lines)):
        t, rw, ex = e.trajectory, e.reward, e.example
        ok = rw.format_ok and bool(line)
        recs.append({"index": first + k // n, "sample": k % n, "id": ex["id"], "source": ex["source"],
                     "db_id": ex["db_id"], "question": ex["question"], "gold_sql": ex["gold_sql"],
                     "prediction": line if ok else PLACEHOLDER, "reward": rw.value,
                     "exec_match": bool(rw.exec_match), "format_ok": bool(rw.format_ok),
                     "error": rw.error or None, "stop_reason": t.stop_reason, "finished": t.finished,
                     "num_turns": t.num_turns, "num_tool_calls": t.num_tool_calls,
                     "response_tokens": int(sum(t.loss_mask)), "turns": turns_of(t, tok),
                     "first_query_bad": env.first_query_bad(t.steps), "_key": keys[k]})
    return recs


def summarise_generation(recs: list[dict], n: int, label: str) -> tuple[dict, list[str]]:
    """recs sorted by (index, sample) -> (summary, prediction lines in data order)."""
    groups = [recs[i:i + n] for i in range(0, len(recs), n)]
    assert all(g[j]["index"] == i and g[j]["sample"] == j for i, g in enumerate(groups) for j in range(n))
    agg = aggregate([[{"correct": r["exec_match"], "key": r["_key"]} for r in g] for g in groups]) if n > 1 else None
    chosen = agg["chosen"] if agg else [0] * len(groups)
    picks = [g[j] for g, j in zip(groups, chosen)]
    by_src: dict[str, list[int]] = {}
    for p in picks:
        by_src.setdefault(p["source"], []).append(p["exec_match"])
    E = max(1, len(recs))
    s = {"decoding": label, "n_examples": len(groups), "samples_per_example": n,
         "ex": sum(p["exec_match"] for p in picks) / max(1, len(picks)),
         "ex_by_source": {k: {"ex": sum(v) / len(v), "n": len(v)} for k, v in sorted(by_src.items())}}
    if agg:
        s.update({"ex_per_sample": sum(r["exec_match"] for r in recs) / E, f"majority@{n}": agg["majority"],
                  "pass@k": {str(k): v for k, v in agg["pass@k"].items()}})
    s.update({"mean_turns": sum(r["num_turns"] for r in recs) / E,
              "mean_tool_calls": sum(r["num_tool_calls"] for r in recs) / E,
              "format_error_rate": sum(not r["format_ok"] for r in recs) / E,
              "placeholder_rate": sum(p["prediction"] == PLACEHOLDER for p in picks) / max(1, len(picks)),
              # error recovery: of the episodes whose first query failed or returned nothing, the
              # share that still ended right (what reading an observation and retrying earns)
              "first_query_bad": sum(r["first_query_bad"] for r in recs),
              "recovered": sum(r["first_query_bad"] and r["exec_match"] for r in recs),
              "stop_reasons": dict(collections.Counter(r["stop_reason"] for r in recs).most_common())})
    s["recovery_rate"] = s["recovered"] / s["first_query_bad"] if s["first_query_bad"] else None
    for r in recs:
        r["chosen"] = r["sample"] == chosen[r["index"]]
    return s, [p["prediction"] for p in picks]


def spider_db_root(exs: list[dict]) -> str | None:
    """The folder `score --db-root` needs, when every database is <root>/<db_id>/<db_id>.sqlite."""
    roots = {os.path.dirname(os.path.dirname(ex["db_file"])) for ex in exs
             if os.path.basename(ex["db_file"]) == ex["db_id"] + ".sqlite"
             and os.path.basename(os.path.dirname(ex["db_file"])) == ex["db_id"]}
    return roots.pop() if len(roots) == 1 and all(ex["db_file"].endswith(".sqlite") for ex in exs) else None


def resolve_model(path: str) -> tuple[str, str]:
    """--model: an HF folder, a checkpoint folder (ckpt_<step>/, whose hf/ is read) or a checkpoint's
    hf/ -> (the HF folder, the checkpoint's config.yaml or "" when it is no checkpoint's)."""
    import config as C
    p = os.path.normpath(path)
    if not os.path.isdir(p):
        raise C.ConfigError(f"--model {path}: no such folder" if not os.path.exists(p) else f"--model {path}: not a folder")
    if os.path.isfile(os.path.join(p, "config.yaml")) and not os.path.isfile(os.path.join(p, "config.json")):
        ckpt, hf = p, os.path.join(p, "hf")  # the checkpoint folder itself
        if not os.path.isdir(hf):
            lora_only = os.path.isdir(os.path.join(p, "adapter"))
            raise C.ConfigError(f"--model {path}: a checkpoint without hf/" + (
                " (a LoRA run saves only adapter/ unless model.lora_save_merged; eval.py reads merged weights)"
                if lora_only else ""))
    elif os.path.basename(p) == "hf" and os.path.isfile(os.path.join(os.path.dirname(p), "config.yaml")):
        ckpt, hf = os.path.dirname(p), p
    else:
        return p, ""
    return hf, os.path.join(ckpt, "config.yaml")


def generate_config(args):
    """The run's settings: the checkpoint's own config.yaml (its prompt template, turns, tokens per
    turn, reward mode) when --model is a checkpoint and --config is not given, else --config, else
    the defaults; then --group.key=value, then the flags. -> (cfg, the HF folder, where the settings
    came from)."""
    import yaml

    import config as C
    from trainer import config_checks
    model_dir, ckpt_config = resolve_model(args.model)
    base, source = None, args.config or "the defaults (no --config, --model is no checkpoint)"
    if not args.config and ckpt_config:
        try:
            base = C.from_dict(yaml.safe_load(Path(ckpt_config).read_text()) or {})
        except (OSError, yaml.YAMLError) as e:
            raise C.ConfigError(f"cannot read the checkpoint's config {ckpt_config}: {e}") from None
        source = f"{ckpt_config} (the checkpoint's)"
    cfg = C.load_config(([args.config] if args.config else []) + args.overrides, base=base)
    for flag, value, ok in (("--n/--samples", args.n, args.n >= 1), ("--chunk", args.chunk, args.chunk >= 1),
                            ("--limit", args.limit, args.limit >= 0), ("--max-turns", args.max_turns, args.max_turns >= 0),
                            ("--threads", args.threads, args.threads is None or args.threads >= 0),
                            ("--temperature", args.temperature, args.temperature is None or args.temperature >= 0)):
        if not ok:
            raise C.ConfigError(f"{flag} must be >= {1 if flag in ('--n/--samples', '--chunk') else 0}, "
                                f"got {value}")
    if args.db_root:
        cfg.data.db_root = args.db_root
    if args.max_turns:
        cfg.env.max_turns = args.max_turns
    config_checks.validate(cfg)  # world 1: an eval's ranks put no constraint on the config
    config_checks.check_model_folder(model_dir, "--model")
    return cfg, model_dir, source


def cmd_generate(args) -> None:
    # nothing is downloaded at run time: without this a --model that is not a folder is taken for a
    # hub name and retried for ~50 s (read when huggingface_hub is first imported)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    cfg, model_dir, source = generate_config(args)  # before the model is loaded: a bad flag fails at once
    import torch
    from transformers import AutoTokenizer

    from trainer import distributed
    from trainer import malloc_tuning
    from trainer.policy_sampler import PolicySampler
    data = args.data or cfg.data.eval_path
    T = cfg.sampling.eval_temperature if args.temperature is None else args.temperature
    if args.n > 1 and T == 0:
        raise runguard.RunError("--n > 1 needs --temperature > 0 (greedy samples would all be the same)")
    greedy = T == 0
    if not greedy:
        cfg.sampling.temperature = T
    label = decoding_label(T, cfg.sampling.top_p, args.n)
    exs = dataset.load_examples(data, cfg.data.db_root, args.limit)  # every rank: the same files, the same error
    rank, world, device = distributed.setup_dist(cfg.train.dist_timeout_s)
    if device.type == "cpu":  # large CPU tensors reuse freed heap memory, no fresh pages per step
        malloc_tuning.keep_freed_memory()
    threads = cfg.train.threads if args.threads is None else args.threads  # tiny.yaml: 1 per process
    if threads:
        torch.set_num_threads(threads)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    say(f"[{label}] settings from {source}: template {cfg.data.prompt_template}, protocol {cfg.env.protocol} "
        f"({cfg.env.conversation}), max_turns {cfg.env.max_turns}, max_new_tokens {cfg.sampling.max_new_tokens}, "
        f"max_context {cfg.sampling.max_context}, reward mode {cfg.reward.mode}")
    # a gold that fails on its database could never be matched: skipped and counted, as train.py's
    # evals skip it (each rank runs a share; all ranks skip the same ones)
    mine_idx = list(range(rank, len(exs), world))
    errors = [""] * len(exs)
    for i, err in distributed.all_gather_list([(i, e) for i, e in zip(
            mine_idx, dataset.gold_failures([exs[i] for i in mine_idx], cfg.reward)) if e]):
        errors[i] = err
    exs, note = dataset.drop_failing_golds(exs, errors, data)
    n_gold_failed = sum(bool(e) for e in errors)
    if note:
        say(f"WARNING: {note}")
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    # a full copy per rank in the compute dtype, no FSDP2: inference only (no fp32 masters needed)
    # and ranks decode different chunks, which sharded weights (lock-step all-gathers) would forbid
    sampler = PolicySampler.from_pretrained(model_dir, cfg.sampling, dtype=distributed.compute_dtype(cfg),
                                            device=device)
    say(f"[{label}] {model_dir} on {data}: {len(exs)} examples x {args.n}, {world} process(es), chunks of "
        f"{args.chunk} (a progress line after each)")
    # fixed chunks dealt round-robin to ranks: the same rollout calls whatever the world size
    starts = list(range(0, len(exs), args.chunk))
    mine, recs = list(enumerate(starts))[rank::world], []
    t_gen = time.time()
    for done, (c, s) in enumerate(mine, 1):
        recs += generate_chunk(sampler, tok, exs[s:s + args.chunk], s, cfg, args.n,
                               args.seed * 1_000_003 + c, greedy)
        n_ep = max(1, len(recs))
        approx = min(len(exs), sum(min(args.chunk, len(exs) - s) for _, s in mine[:done]) * world)
        el = time.time() - t_gen
        say(f"[{label}] {approx}/{len(exs)} examples{' (rank 0 x ' + str(world) + ')' if world > 1 else ''} | "
            f"EX {100 * sum(r['exec_match'] for r in recs) / n_ep:.1f}% "
            f"fmt-err {100 * sum(not r['format_ok'] for r in recs) / n_ep:.1f}% "
            f"turns {sum(r['num_turns'] for r in recs) / n_ep:.2f} | {el:.0f}s, "
            f"ETA {el / done * (len(mine) - done):.0f}s")
    recs = distributed.all_gather_list(recs)
    if rank == 0:
        recs.sort(key=lambda r: (r["index"], r["sample"]))
        summary, preds = summarise_generation(recs, args.n, label)
        summary.update({"model": model_dir, "data": data, "settings": source, "skipped_gold_fails": n_gold_failed,
                        "reward_mode": cfg.reward.mode, "prompt_template": cfg.data.prompt_template,
                        "max_turns": cfg.env.max_turns, "max_new_tokens": cfg.sampling.max_new_tokens,
                        "temperature": T, "top_p": cfg.sampling.top_p,
                        "seed": args.seed, "world_size": world, "time_s": time.time() - t0})
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "predictions.sql"), "w") as fh:
            fh.writelines(p + "\n" for p in preds)
        with open(os.path.join(args.out, "gold.sql"), "w") as fh:
            fh.writelines(f"{one_line(ex['gold_sql'])}\t{ex['db_id']}\n" for ex in exs)
        with open(os.path.join(args.out, "traces.jsonl"), "w") as fh:
            for r in recs:
                r.pop("_key")
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
        with open(os.path.join(args.out, "summary.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
        first = recs[0] if recs else None
        if first:
            say(f"--- example 0 ({'correct' if first['exec_match'] else 'wrong'}, stop {first['stop_reason']}): "
                f"{first['question']}\n" + "".join(t["text"] + t["observation"] for t in first["turns"])[:800])
        extra = (f" | pass@{args.n} {100 * summary['pass@k'][str(args.n)]:.1f}% "
                 f"per-sample {100 * summary['ex_per_sample']:.1f}%") if args.n > 1 else ""
        srcs = ", ".join(f"{k} {100 * v['ex']:.1f}% ({v['n']})" for k, v in summary["ex_by_source"].items())
        say(f"[{label}] EX {100 * summary['ex']:.2f}% ({srcs}){extra} | fmt-err "
            f"{100 * summary['format_error_rate']:.1f}% | turns {summary['mean_turns']:.2f} tool calls "
            f"{summary['mean_tool_calls']:.2f} | first query failed/empty {summary['first_query_bad']}, "
            f"recovered {summary['recovered']} | {len(exs)} examples in {summary['time_s']:.0f}s")
        root = spider_db_root(exs)
        say(f"wrote {args.out}/predictions.sql, gold.sql, traces.jsonl, summary.json"
            + (f"; rescore: python eval.py score --pred {args.out}/predictions.sql --gold {args.out}/gold.sql "
               f"--db-root {root} --mode {cfg.reward.mode}" if root else ""))
    distributed.close()


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="multi-turn rollouts of a model on a dataset, scored",
                       description="Extra --group.key=value arguments override the config (as in train.py).")
    g.add_argument("--model", required=True, help="HF folder, a checkpoint (ckpt_<step>/) or its hf/")
    g.add_argument("--data", default="", help="canonical jsonl (dataset.py; default: the config's data.eval_path)")
    g.add_argument("--db-root", default="", help="the records' db_path is relative to this (default: data.db_root)")
    g.add_argument("--n", "--samples", dest="n", type=int, default=1,  # torchrun takes --n as its own
                   help="samples per example (> 1: pass@k, majority vote); under torchrun write --samples")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: sampling.eval_temperature)")
    g.add_argument("--max-turns", type=int, default=0, help="generations per episode (default: the config's)")
    g.add_argument("--config", default="", help="YAML with env / sampling / data / reward settings (default: the "
                   "checkpoint's own config.yaml when --model is a checkpoint)")
    g.add_argument("--out", default="runs/eval", help="output folder")
    g.add_argument("--limit", type=int, default=0, help="first N examples only")
    g.add_argument("--chunk", type=int, default=32, help="examples per rollout call (progress granularity)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None,
                   help="torch threads per process (0 = torch's choice; default: the config's train.threads)")
    g.set_defaults(fn=cmd_generate)


# -----------------------------------------------------------------------------
# command line


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("score", help="execution accuracy of a predictions file")
    s.add_argument("--pred", required=True, help="one SQL per line")
    s.add_argument("--gold", required=True, help="lines 'SQL<TAB>db_id' (Spider's dev_gold.sql)")
    s.add_argument("--db-root", required=True, help="folder with <db_id>/<db_id>.sqlite")
    s.add_argument("--mode", default="spider", choices=["spider", "set", "bag"])
    s.add_argument("--out", default="", help="per-example JSON lines")
    s.add_argument("--verdicts", default="", help="official verdicts (jsonl) to compare with")
    s.add_argument("--timeout", type=float, default=30.0, help="per query, seconds")
    s.add_argument("--keep-distinct", action="store_true", help="spider mode: do not remove DISTINCT")
    s.add_argument("--workers", type=int, default=0, help="SQL worker processes (0 = all cores)")
    s.set_defaults(fn=cmd_score)
    add_generate_parser(sub)
    args, extra = ap.parse_known_args(argv)  # generate: extra --group.key=value config overrides
    if extra and args.cmd != "generate":
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    args.fn(args)


if __name__ == "__main__":
    sys.exit(runguard.run_main(main))  # a user error: one line (rank 0), exit 1
