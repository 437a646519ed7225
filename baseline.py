"""The random baseline: the floor under "did it learn?".

Each episode draws its actions at random from the protocol instead of a model: a random number of
tool calls (random SELECTs over the database's real tables and columns; in the actions protocol
also DESCRIBE / SAMPLE of a random table), then a random answer of the same kind. Tool calls run
through the real environment (env.step_batch: the sandbox, the observations, the step records the
dense shaping reads), and episodes are scored by the same reward code as any rollout
(reward.episode_rewards), so the number is directly comparable with the held-out EX. Seeded and
deterministic: the same (examples, seed) give the same episodes.

train.py calls report() once before the first GRPO step (printed beside the warm start's held-out
EX, logged as eval/random_ex and eval/random_reward). Standalone:

    python baseline.py --config configs/tiny.yaml               # the config's held-out set
    python baseline.py --config configs/tiny.yaml --split train --samples 4 --show 1
    python baseline.py --config configs/X.yaml --data.db_root=/data/spider   # any config override

Tests: .venv/bin/pytest tests/test_baseline.py
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import config as C
from sqltask import dataset
import env
from sqltask import prompts
import reward

AGGREGATES = ("COUNT", "MIN", "MAX", "AVG", "SUM")

# -----------------------------------------------------------------------------
# random actions


def random_select(tables, rng: random.Random) -> str:
    """One random single-table SELECT over the schema (tables: prompts.read_schema's)."""
    if not tables:
        return "SELECT 1"
    t = rng.choice(tables)
    col = prompts.quote(rng.choice(t.columns).name) if t.columns else "*"
    shape = rng.randrange(5)
    if shape == 0:
        return f"SELECT * FROM {prompts.quote(t.name)} LIMIT {rng.randint(1, 5)}"
    if shape == 1:
        return f"SELECT {col} FROM {prompts.quote(t.name)}"
    if shape == 2:
        return f"SELECT DISTINCT {col} FROM {prompts.quote(t.name)}"
    if shape == 3:
        return f"SELECT COUNT(*) FROM {prompts.quote(t.name)}"
    return f"SELECT {rng.choice(AGGREGATES)}({col}) FROM {prompts.quote(t.name)}"


def random_tool_turn(tables, protocol: str, rng: random.Random) -> str:
    """The text of one random tool call, written as the model would write it."""
    if protocol == "tags":
        return f"<think>A random query.</think>\n<sql>{random_select(tables, rng)}</sql>"
    kind = rng.choice(("DESCRIBE", "SAMPLE", "QUERY"))
    if kind == "QUERY" or not tables:
        return f"<action>QUERY {random_select(tables, rng)}</action>"
    return f"<action>{kind} {rng.choice(tables).name}</action>"


def random_answer(tables, protocol: str, rng: random.Random) -> str:
    """The text of one random final answer (well formed: the floor measures content, not format)."""
    sql = random_select(tables, rng)
    if protocol == "tags":
        return f"<think>A random answer.</think>\n<solution>{sql}</solution>"
    return f"<action>ANSWER {sql}</action>"


# -----------------------------------------------------------------------------
# episodes


def random_episodes(examples: list[dict], env_cfg: C.EnvConfig, db_root, *, seed: int,
                    samples: int = 1) -> list[dict]:
    """samples episodes per example (example-major, like rollout.rollout), each a dict with what
    reward.episode_rewards reads (db_path, gold_sql, response, final_sql, finished, steps) plus
    num_turns and num_tool_calls. An episode makes 0 .. max_turns-1 tool calls, then answers."""
    protocol = env_cfg.protocol
    eps, rngs, schemas, n_tools = [], [], [], []
    for i, ex in enumerate(examples):
        db = dataset.abs_db_path(ex, db_root)
        tables = list(prompts.read_schema(db))
        for j in range(samples):
            rng = random.Random(seed * 1_000_003 + i * 1009 + j)  # one stream per episode
            rngs.append(rng)
            schemas.append(tables)
            n_tools.append(rng.randint(0, max(0, env_cfg.max_turns - 1)))
            eps.append({"db_path": db, "gold_sql": ex["gold_sql"], "response": "", "final_sql": "",
                        "finished": False, "steps": [], "num_turns": 0, "num_tool_calls": 0})
    for turn in range(max(n_tools, default=0)):  # one env.step_batch (one pool call) per turn
        live = [k for k in range(len(eps)) if n_tools[k] > turn]
        texts = [random_tool_turn(schemas[k], protocol, rngs[k]) for k in live]
        left = [env_cfg.max_turns - turn - 1 for _ in live]  # generations after this one (≥ 1 here)
        results = env.step_batch([eps[k]["db_path"] for k in live], texts, left, env_cfg)
        for k, text, res in zip(live, texts, results):
            e = eps[k]
            e["response"] += text + res.observation
            e["steps"].append(env.step_record(res))
            e["num_turns"] += 1
            e["num_tool_calls"] += 1
    for e, tables, rng in zip(eps, schemas, rngs):
        text = random_answer(tables, protocol, rng)
        action = env.parse_turn(text, protocol)
        e["response"] += text
        e["final_sql"], e["finished"] = action.arg, True
        e["steps"].append({"kind": action.kind, "arg": action.arg, "ok": False, "rows": None})
        e["num_turns"] += 1
    return eps


def run(examples: list[dict], cfg: C.Config, *, seed: int, samples: int = 1):
    """Random episodes scored like any rollout. Returns (summary, episodes, rewards); summary has
    ex, reward, format_err, turns, tool_calls (means over episodes) and n."""
    eps = random_episodes(examples, cfg.env, cfg.data.db_root, seed=seed, samples=samples)
    rw = reward.episode_rewards([reward.Transcript(e["db_path"], e["gold_sql"], e["response"], e["final_sql"],
                                                   e["finished"], e["steps"]) for e in eps], cfg.reward, cfg.env.protocol)
    n = max(len(eps), 1)
    summary = {"ex": sum(float(r.exec_match) for r in rw) / n, "reward": sum(r.value for r in rw) / n,
               "format_err": sum(float(not r.format_ok) for r in rw) / n,
               "turns": sum(e["num_turns"] for e in eps) / n, "tool_calls": sum(e["num_tool_calls"] for e in eps) / n,
               "n": len(eps)}
    return summary, eps, rw


def report(examples: list[dict], cfg: C.Config, log, warm: dict | None = None, step: int = 0) -> dict:
    """train.py's hook (rank 0, before GRPO): the floor on the held-out set, beside the warm
    start's held-out EX (warm: evaluate()'s metrics). log: anything with print(str) and
    metrics(step, dict)."""
    s, _, _ = run(examples, cfg, seed=cfg.train.seed + 20_000)
    log.metrics(step, {"eval/random_ex": s["ex"], "eval/random_reward": s["reward"]})
    line = f"[random baseline] EX {100 * s['ex']:.1f}%  reward {s['reward']:.3f}  tool-calls {s['tool_calls']:.2f}"
    if warm and "eval/ex" in warm:
        line += f"  | warm start held-out EX {100 * warm['eval/ex']:.1f}% (GRPO starts here; random is the floor)"
    log.print(line)
    return s


# -----------------------------------------------------------------------------
# command line


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Other arguments (--group.key=value) override the config.")
    ap.add_argument("--config", default=None, help="a YAML config (default: the embedded default)")
    ap.add_argument("--split", choices=("eval", "train"), default="eval")
    ap.add_argument("--samples", type=int, default=1, help="random episodes per question")
    ap.add_argument("--seed", type=int, default=None, help="default: train.seed + 20000 (as in train.py)")
    ap.add_argument("--show", type=int, default=0, help="print this many episodes in full")
    args, rest = ap.parse_known_args(argv)
    try:
        cfg = C.load_config(([args.config] if args.config else []) + rest)
    except C.ConfigError as e:
        sys.exit(f"config error: {e}")
    path = cfg.data.eval_path if args.split == "eval" else cfg.data.train_path
    if cfg.data.prepare_toy and not Path(cfg.data.train_path).exists():
        sys.path.insert(0, str(Path(__file__).parent / "data"))
        from toy.prepare_toy import prepare_toy
        prepare_toy(cfg.data.db_root, seed=cfg.data.toy_seed)
    limit = cfg.data.max_eval_examples if args.split == "eval" else cfg.data.max_train_examples
    try:
        examples = dataset.load_examples(path, cfg.data.db_root, limit)
    except (dataset.DatasetError, FileNotFoundError) as e:
        sys.exit(f"error: {e} (set data.{args.split}_path / data.db_root, e.g. --data.db_root=DIR)")
    seed = cfg.train.seed + 20_000 if args.seed is None else args.seed
    s, eps, rw = run(examples, cfg, seed=seed, samples=args.samples)
    for e, r, ex in list(zip(eps, rw, [x for x in examples for _ in range(args.samples)]))[:args.show]:
        print(f"--- random episode (reward {r.value:+.2f}, exec {r.exec_match}) Q: {ex['question']}\n"
              f"{e['response']}\n--- gold: {ex['gold_sql']}")
    print(f"random baseline on {path} ({len(examples)} questions x {args.samples}, protocol {cfg.env.protocol}, "
          f"seed {seed}): EX {100 * s['ex']:.1f}%  reward {s['reward']:.3f}  format-err "
          f"{100 * s['format_err']:.1f}%  turns {s['turns']:.2f}  tool-calls {s['tool_calls']:.2f}")
    return s


if __name__ == "__main__":
    main()
