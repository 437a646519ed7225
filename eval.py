"""Evaluation: the held-out evals of a run, the random-policy floor, and three commands.

    python eval.py generate --model runs/tiny/ckpt_000040 [--out DIR]   # a checkpoint, with its run's settings
    python eval.py generate --model DIR [--data FILE.jsonl] [--db-root DIR] [--n K] [--temperature T]
                            [--max-turns N] [--config YAML] [--out DIR] [--limit N] [--group.key=value ...]
    torchrun --standalone --nproc_per_node=2 eval.py generate ... [--samples K]   # split over ranks
      (torchrun reads `--n` as an ambiguous abbreviation of its own options: write --samples there)
    python eval.py score --pred PRED.sql --gold dev_gold.sql --db-root DIR/database [--mode spider]
                         [--out FILE] [--verdicts OFFICIAL.verdicts.jsonl]
    python eval.py random --config configs/tiny.yaml [--split train] [--samples 4] [--show 1]

In a run (train.py, sft.py): `evaluate` (held-out episodes, greedy, the eval/* metrics) and
`report_random_floor` (the random policy's EX before GRPO, eval/random_*). Every path samples and
scores as training does: rollout.sample_episodes (the random floor: replay.replay of
sqltask/random_turns.py's turns), then reward.episode_rewards.

`generate`: multi-turn episodes of a model on a dataset, greedy unless --temperature > 0 (default:
sampling.eval_temperature). Its settings (env / sampling / data / reward, train.threads) are the
checkpoint's own config.yaml when --model is a checkpoint (ckpt_<step>/ or its hf/) and --config is
not given, else --config's, else the defaults; flags and --group.key=value override them. Nothing is
downloaded. Examples whose gold fails on its database are skipped and counted. Writes in --out:
predictions.sql (one SQL per line, data order; a failed episode writes predictions.PLACEHOLDER; with
--n > 1 the majority vote by execution result), gold.sql (for `score`), traces.jsonl (every turn's
text and observation, reward, exec_match, stop reason) and summary.json (EX overall and by source,
pass@k and majority@k, turns, tool calls, format errors, error recovery, the decoding label).
Examples go in fixed chunks dealt round-robin to ranks (the same episodes whatever the world size).

`score`: Spider's execution accuracy of a predictions file (sqltask/spider_score.py: the official
test-suite evaluator's rule, its agreement and deliberate differences); databases missing or
unusable are skipped and named. `random`: the random-policy floor on a config's data.
Tests: .venv/bin/pytest tests/test_eval_generate.py tests/test_eval_score.py tests/test_baseline.py
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import config as C
import env
import reward
import replay
import rollout
from rollout import sample_episodes
from sqltask import dataset, exec_match, random_turns, sandbox, spider_score
from sqltask.predictions import (PLACEHOLDER, decoding_label, one_line, result_key, spider_db_root,
                                 summarise_generation)
from model import Transformer
from trainer import config_checks, distributed, malloc_tuning, memory, runguard
from trainer.distributed import all_sum
from trainer.policy_sampler import PolicySampler

# -----------------------------------------------------------------------------
# the held-out evaluation of a run (train.py, sft.py) and the summaries of episodes


def summarise(episodes) -> dict:
    """Per-rank sums over rollout.Episode records (reduce_summary all-reduces them into means):
    count, reward, EX, format errors, turns, tool calls, response tokens, the overlong penalty,
    and per end reason (rollout.END_REASONS, every one, so every rank sums the same keys) and
    truncated (rollout.TRUNCATED) the episodes that ended so: fractions once reduced."""
    out = {"n": len(episodes), "reward": sum(e.reward.value for e in episodes),
           "ex": sum(float(e.reward.exec_match) for e in episodes),
           "format_err": sum(float(not e.reward.format_ok) for e in episodes),
           "turns": sum(e.trajectory.num_turns for e in episodes),
           "tool_calls": sum(e.trajectory.num_tool_calls for e in episodes),
           "resp_tokens": sum(int(sum(e.trajectory.loss_mask)) for e in episodes),
           "overlong_penalty": sum(e.reward.overlong_penalty for e in episodes),
           "truncated": sum(float(e.trajectory.truncated) for e in episodes)}
    for reason in rollout.END_REASONS:
        out[f"end_{reason}"] = sum(float(e.trajectory.end_reason == reason) for e in episodes)
    return out


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
    metrics = {f"{prefix}/{k}": v for k, v in reduce_summary(summarise(episodes), device).items()}
    # error recovery (eval.py generate's rule): episodes whose first query failed or returned no
    # rows, and of those the ones that still ended right; counts summed over ranks
    bad = [env.first_query_bad(e.trajectory.steps) for e in episodes]
    n_bad, n_rec = all_sum([sum(bad), sum(b and bool(e.reward.exec_match) for b, e in zip(bad, episodes))], device)
    metrics.update({f"{prefix}/first_query_bad": n_bad, f"{prefix}/recovered": n_rec})
    if n_bad:
        metrics[f"{prefix}/recovery_rate"] = n_rec / n_bad
    log.metrics(step, metrics)
    at = {k[len(prefix) + 1:]: v for k, v in metrics.items()}  # the keys without the prefix
    log.print(f"[{prefix} @ step {step}] EX {100 * at['ex']:.1f}%  reward {at['reward']:.3f}  "
              f"format-err {100 * at['format_err']:.1f}%  turns {at['turns']:.2f}  "
              f"tool-calls {at['tool_calls']:.2f}  truncated {100 * at['truncated']:.1f}%  "
              f"first query empty/failed {n_bad:.0f}, "
              f"recovered {n_rec:.0f}  ({len(eval_ex)} examples, {seconds:.1f}s)")
    return metrics


# -----------------------------------------------------------------------------
# the random-policy floor


def random_floor(examples: list[dict], cfg, *, seed: int, samples: int = 1) -> tuple[dict, list]:
    """The random policy's episodes (sqltask/random_turns.py: random tool calls over the real
    schema, then a random answer), played through the env (replay.replay) and scored by the same
    reward code as any rollout. Returns (summary: means of ex, reward, format_err, turns, tool_calls
    and n; the rollout.Episode list, example-major)."""
    db_paths, turns = random_turns.random_turns(examples, cfg.env, cfg.data.db_root, seed=seed, samples=samples)
    trajs = replay.replay(turns, db_paths, cfg.env, budget=cfg.env.max_turns)
    reps = [ex for ex in examples for _ in range(samples)]
    rewards = reward.episode_rewards([rollout.transcript(t, ex, cfg.data.db_root) for t, ex in zip(trajs, reps)],
                                     cfg.reward, cfg.env.protocol)
    episodes = [rollout.Episode(t, r, ex, k // samples) for k, (t, r, ex) in enumerate(zip(trajs, rewards, reps))]
    s = summarise(episodes)
    n = max(s.pop("n"), 1)
    return {**{k: v / n for k, v in s.items() if k != "resp_tokens"}, "n": len(episodes)}, episodes


def report_random_floor(examples: list[dict], cfg, log, warm: dict | None = None, step: int = 0) -> dict:
    """train.py's hook (rank 0, before GRPO): the floor on the held-out set, beside the warm
    start's held-out EX (warm: evaluate()'s metrics), logged as eval/random_ex and eval/random_reward.
    log: anything with print(str) and metrics(step, dict)."""
    s, _ = random_floor(examples, cfg, seed=cfg.train.seed + 20_000)
    log.metrics(step, {"eval/random_ex": s["ex"], "eval/random_reward": s["reward"]})
    line = f"[random baseline] EX {100 * s['ex']:.1f}%  reward {s['reward']:.3f}  tool-calls {s['tool_calls']:.2f}"
    if warm and "eval/ex" in warm:
        line += f"  | warm start held-out EX {100 * warm['eval/ex']:.1f}% (GRPO starts here; random is the floor)"
    log.print(line)
    return s


def cmd_random(args) -> None:
    cfg = C.load_config(([args.config] if args.config else []) + args.overrides)
    path = cfg.data.eval_path if args.split == "eval" else cfg.data.train_path
    from toy.tiny import prepare_toy_set
    prepare_toy_set(cfg.data)  # under the folder's build lock: two calls at once build it once
    limit = cfg.data.max_eval_examples if args.split == "eval" else cfg.data.max_train_examples
    try:
        examples = dataset.load_examples(path, cfg.data.db_root, limit)
    except dataset.DatasetError as e:
        raise dataset.DatasetError(f"{e} (set data.{args.split}_path / data.db_root, e.g. --data.db_root=DIR)") from None
    seed = cfg.train.seed + 20_000 if args.seed is None else args.seed
    s, episodes = random_floor(examples, cfg, seed=seed, samples=args.samples)
    for e in episodes[:args.show]:
        print(f"--- random episode (reward {e.reward.value:+.2f}, exec {e.reward.exec_match}) "
              f"Q: {e.example['question']}\n{e.trajectory.text}\n--- gold: {e.example['gold_sql']}")
    print(f"random baseline on {path} ({len(examples)} questions x {args.samples}, protocol {cfg.env.protocol}, "
          f"seed {seed}): EX {100 * s['ex']:.1f}%  reward {s['reward']:.3f}  format-err "
          f"{100 * s['format_err']:.1f}%  turns {s['turns']:.2f}  tool-calls {s['tool_calls']:.2f}")


# -----------------------------------------------------------------------------
# score (sqltask/spider_score.py)


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
    unusable = spider_score.unusable_databases(recs, args.db_root)  # corrupt, empty, unreadable: skipped, named
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


# -----------------------------------------------------------------------------
# generate: rollouts with the training code -> predictions, traces, summary

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
                                     for i in todo], timeout_s=cfg.reward.timeout_s, max_rows=exec_match.REWARD_MAX_ROWS)
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
                     "error": rw.error or None, "end_reason": t.end_reason,
                     "finished": t.finished,
                     "num_turns": t.num_turns, "num_tool_calls": t.num_tool_calls,
                     "response_tokens": t.generated_tokens, "turns": t.turn_texts(tok),
                     "first_query_bad": env.first_query_bad(t.steps), "_key": keys[k]})
    return recs


def resolve_model(path: str) -> tuple[str, str]:
    """--model: an HF folder, a checkpoint folder (ckpt_<step>/, whose hf/ is read) or a checkpoint's
    hf/ -> (the HF folder, the checkpoint's config.yaml or "" when it is no checkpoint's)."""
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


def inference_sampler(cfg, model_dir: str, device, rows: int):
    """The tokenizer and a sampler on the folder's weights for decoding only -> (tok, sampler, a line
    describing its KV pool). A full copy per rank in the compute dtype, no FSDP2: inference needs no
    fp32 masters, and ranks decode different chunks, which sharded weights (lock-step all-gathers)
    would forbid. The KV pool: sampling.kv_budget_tokens, or (auto) a share of the memory left beside
    the loaded weights, capped at `rows` episodes at sampling.max_context; a budget the memory cannot
    hold stops here, not in the OOM killer."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    dtype = distributed.compute_dtype(cfg)
    model = Transformer.from_pretrained(model_dir, dtype=dtype, device=device)
    kv_bytes = memory.kv_bytes_per_token(model.config, dtype)
    weights_gb = distributed.param_count(model) * dtype.itemsize / memory.GB
    available = memory.available_gb(device)
    tokens = memory.kv_budget(cfg.sampling, 0.0, kv_bytes, device, rows * cfg.sampling.max_context, available=available)
    memory.check_fits({"total": weights_gb + tokens * kv_bytes / memory.GB, "kv_cache": tokens * kv_bytes / memory.GB,
                       "rollout_weights": weights_gb}, device, weights_gb, available=available)
    sampler = PolicySampler.for_model(model, dataclasses.replace(cfg.sampling, kv_budget_tokens=tokens), dtype=dtype)
    return tok, sampler, (f"KV pool {tokens} tokens ({tokens * kv_bytes / memory.GB:.2f} GB; sampling.kv_budget_tokens="
                          f"{cfg.sampling.kv_budget_tokens}), weights {weights_gb:.2f} GB, {available[0]:.1f} GB "
                          f"{available[1]}")


def cmd_generate(args) -> None:
    # nothing is downloaded at run time: without this a --model that is not a folder is taken for a
    # hub name and retried for ~50 s (read when huggingface_hub is first imported)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    cfg, model_dir, source = generate_config(args)  # before the model is loaded: a bad flag fails at once
    import torch
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
    errors = distributed.map_shared(lambda xs: dataset.gold_failures(xs, cfg.reward), exs, rank, world)
    exs, note = dataset.drop_failing_golds(exs, errors, data)
    n_gold_failed = sum(bool(e) for e in errors)
    if note:
        say(f"WARNING: {note}")
    tok, sampler, pool = inference_sampler(cfg, model_dir, device, args.chunk * args.n)
    say(f"[{label}] {pool}")
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
            say(f"--- example 0 ({'correct' if first['exec_match'] else 'wrong'}, end {first['end_reason']}): "
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
    g.add_argument("--data", default="", help="canonical jsonl (sqltask/dataset.py; default: the config's data.eval_path)")
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
    r = sub.add_parser("random", help="the random-policy floor on a config's data",
                       description="Extra --group.key=value arguments override the config (as in train.py).")
    r.add_argument("--config", default=None, help="a YAML config (default: the embedded default)")
    r.add_argument("--split", choices=("eval", "train"), default="eval")
    r.add_argument("--samples", type=int, default=1, help="random episodes per question")
    r.add_argument("--seed", type=int, default=None, help="default: train.seed + 20000 (as in train.py)")
    r.add_argument("--show", type=int, default=0, help="print this many episodes in full")
    r.set_defaults(fn=cmd_random)
    args, extra = ap.parse_known_args(argv)  # generate, random: extra --group.key=value config overrides
    if extra and args.cmd not in ("generate", "random"):
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    args.fn(args)


if __name__ == "__main__":
    sys.exit(runguard.run_main(main))  # a user error: one line (rank 0), exit 1
