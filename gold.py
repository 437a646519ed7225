"""Gold episodes: what a perfect policy would do, written in the run's protocol, for the SFT warm start.

A gold episode is what a perfect policy would do, played through the real env (env.step_batch)
and tokenized exactly as rollout.rollout appends (token-in-token-out): each model turn is encoded
alone and ends on its protocol's stop string (no end-of-turn token after it: the rollout stops
there), each observation is rollout.observation_ids of the env's own output (the conversation
format's close/user/assistant wrapper included), so SFT and RL see the same tokens.

    tags     prompt | <think>{think}</think>\\n<sql>{lookup}</sql> | observation |
             <think>{think}</think>\\n<solution>{gold}</solution>
    actions  prompt | <action>DESCRIBE t</action> | observation | ... (each table the gold reads) |
             <action>QUERY {lookup}</action> | observation | <action>ANSWER {gold}</action>

Tool turns, in order: (actions only) DESCRIBE of every table the gold reads, in the order the
gold names them; the record's `first_lookup_sql` when non-empty (a natural lookup that finds no
rows: the episode shows the failure and the recovery); its `lookup_sql` when non-empty (the toy's
lookup whose observation shows the code the gold needs); without a lookup, with
`sft.with_tool_turn`, the gold itself as a check. An episode has at most rollout.max_turns(env)
generations: tool turns that do not fit are left out, DESCRIBEs first (from the last), then the
first lookup, so the answer always fits. The tags protocol thinks before each turn (SkyRL's rule:
every </observation> is followed by <think>); the actions protocol needs no think.

The model-side tokens carry mask 1 (the loss of sft.py), the prompt and observations 0.

    episodes = gold_episodes(examples, prompts, tokenizer, cfg, db_paths)   # GoldEpisode: ids, mask, turns
    data = build_dataset(examples, prompts, tokenizer, cfg, db_paths)      # (ids, mask) that fit max_context
Tests: .venv/bin/pytest tests/test_sft.py
"""
from __future__ import annotations

import functools
import sqlite3
from dataclasses import dataclass, field

import config as C
import env
import rollout
from sqltask import sandbox

# -----------------------------------------------------------------------------
# the gold episode's turns (text only)


@functools.lru_cache(maxsize=65536)
def tables_read(db_path: str, sql: str) -> tuple[str, ...]:
    """The tables a query reads, in the order the query first names them (SQLite's authorizer
    reports every table read while it compiles the query; nothing runs). Names as the database
    spells them. A query that does not compile raises ValueError naming it."""
    seen: list[str] = []

    def note(action, arg1, *_):
        if action == sqlite3.SQLITE_READ and arg1 and arg1 not in seen and not arg1.startswith("sqlite_"):
            seen.append(arg1)
        return sqlite3.SQLITE_OK

    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        con.set_authorizer(note)
        con.execute("EXPLAIN " + sandbox.trim_sql(sql))
    except sqlite3.Error as e:
        raise ValueError(f"gold query does not compile on {db_path}: {e}: {sql}") from None
    finally:
        con.close()
    words = [t.strip('"`[]').lower() for t in sandbox.sql_tokens(sql)]
    first = {name: words.index(name.lower()) if name.lower() in words else len(words) for name in seen}
    return tuple(sorted(seen, key=lambda name: first[name]))  # stable: the authorizer's order breaks ties


def gold_turns(example: dict, cfg: C.Config, db_path: str) -> list[str]:
    """The model-side text of each turn of a record's gold episode in cfg.env.protocol (see the
    module docstring); the last one ends the episode."""
    protocol, gold = cfg.env.protocol, example["gold_sql"]
    lookups = [q for q in (example.get("first_lookup_sql") or "", example.get("lookup_sql") or "") if q]
    check = [gold] if not lookups and cfg.sft.with_tool_turn else []
    # (sql, rank): the tool turns' queries; a higher rank is left out first when turns run short
    queries = [(q, 1) for q in lookups[:-1]] + [(q, 0) for q in lookups[-1:] + check]
    if protocol == "tags":
        think = f"<think>{cfg.sft.think_text}</think>\n"
        tools = [(f"{think}<sql>{q}</sql>", rank) for q, rank in queries]
        final = f"{think}<solution>{gold}</solution>"
    else:
        assert protocol == "actions", protocol
        tables = tables_read(db_path, gold)
        tools = ([(f"<action>DESCRIBE {t}</action>", 2 + len(tables) - i) for i, t in enumerate(tables)]
                 + [(f"<action>QUERY {q}</action>", rank) for q, rank in queries])
        final = f"<action>ANSWER {gold}</action>"
    # keep the tool turns that fit (the answer takes one generation), dropping the highest rank first
    room = max(0, rollout.max_turns(cfg.env) - 1)
    keep = sorted(range(len(tools)), key=lambda i: (tools[i][1], i))[:room]
    return [tools[i][0] for i in sorted(keep)] + [final]


# -----------------------------------------------------------------------------
# playing the turns through the env, tokenized as the rollout appends them


@dataclass
class GoldEpisode:
    ids: list[int]  # prompt + every turn and observation (empty in text mode)
    mask: list[int]  # aligned to ids: 1 on the model's turns
    text: str = ""  # everything after the prompt (reward.format_ok reads it)
    steps: list[dict] = field(default_factory=list)  # env.step_record of each turn
    final_sql: str = ""
    finished: bool = False  # the last turn ended the episode with an answer
    segments: list[str] = field(default_factory=list)  # turn, observation, turn, ..., in text


def gold_episodes(examples, prompts, tokenizer, cfg: C.Config, db_paths) -> list[GoldEpisode]:
    """Every record's gold episode played through env.step_batch (one batch per turn index) and
    tokenized as rollout.rollout appends it: prompts are rendered prompt ids (render_prompts).
    tokenizer None: text only (segments, text), for a tokenizer's training corpus. A gold whose
    turns the env does not read as meant (an invalid action, a tool turn that ends the episode,
    an answer that does not) raises ValueError naming the record."""
    budget = rollout.max_turns(cfg.env)
    turns = [gold_turns(ex, cfg, str(dbp)) for ex, dbp in zip(examples, db_paths)]
    eps = [GoldEpisode(list(p) if tokenizer else [], [0] * len(p) if tokenizer else []) for p in prompts]
    for k in range(max(map(len, turns), default=0)):
        live = [i for i, t in enumerate(turns) if k < len(t)]
        said = {}
        for i in live:  # the model's turn: encoded alone, decoded for the env as the rollout does
            ids = tokenizer.encode(turns[i][k], add_special_tokens=False) if tokenizer else []
            said[i] = (ids, tokenizer.decode(ids) if tokenizer else turns[i][k])
            eps[i].ids.extend(ids)
            eps[i].mask.extend([1] * len(ids))
            eps[i].segments.append(said[i][1])
        stops = env.STOP_STRINGS[cfg.env.protocol]
        for i in live:  # the rollout ends a turn at its first stop string: the gold's must end on it
            text = said[i][1]
            if min((text.find(x) + len(x) for x in stops if x in text), default=-1) != len(text):
                raise ValueError(f"gold episode of {examples[i].get('id')}: turn {k + 1} ({text!r}) does not end "
                                 f"at its first stop string {stops}")
        results = env.step_batch([str(db_paths[i]) for i in live], [said[i][1] for i in live],
                                 [budget - (k + 1)] * len(live), cfg.env)
        for i, res in zip(live, results):
            last, ep = k == len(turns[i]) - 1, eps[i]
            ep.steps.append(env.step_record(res))
            if res.action.kind == "invalid" or res.done != last or (last and res.action.kind not in ("solution", "answer")):
                raise ValueError(f"gold episode of {examples[i].get('id')}: turn {k + 1} ({said[i][1]!r}) was read as "
                                 f"{res.action.kind}, done={res.done}")
            if last:
                ep.finished, ep.final_sql = True, res.action.arg
                continue
            if tokenizer:
                obs = rollout.observation_ids(tokenizer, res.observation, cfg.env.conversation, said[i][0][-1])
                ep.ids.extend(obs)
                ep.mask.extend([0] * len(obs))
            ep.segments.append(res.observation)
    for ep, p in zip(eps, prompts):
        ep.text = tokenizer.decode(ep.ids[len(p):]) if tokenizer else "".join(ep.segments)
    return eps


def gold_trajectory(example: dict, prompt_ids: list[int], tokenizer, cfg: C.Config, db_path: str):
    """-> (ids, mask): one record's gold episode (gold_episodes for one)."""
    ep, = gold_episodes([example], [prompt_ids], tokenizer, cfg, [db_path])
    return ep.ids, ep.mask


def gold_texts(examples, cfg: C.Config, db_paths) -> list[str]:
    """The text of every gold turn and observation (a tiny tokenizer's corpus: its tokens then
    cover what the warm start trains on)."""
    return [s for ep in gold_episodes(examples, [[]] * len(examples), None, cfg, db_paths) for s in ep.segments]


def end_of_turn_id(tokenizer) -> int:
    """The token the chat template closes an assistant turn with (Qwen: <|im_end|>, Llama 3:
    <|eot_id|>); the tokenizer's eos_token when there is no template or it adds none."""
    marker = "\x00END\x00"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # no chat template
        text = ""
    tail = text[text.rfind(marker) + len(marker):] if marker in text else ""
    for token in sorted(tokenizer.get_added_vocab(), key=len, reverse=True):
        if token and tail.startswith(token):
            return tokenizer.convert_tokens_to_ids(token)
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has neither an end-of-turn token in its chat template nor an eos_token")
    return tokenizer.eos_token_id


def build_dataset(examples, prompts, tokenizer, cfg: C.Config, db_paths) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) of every gold episode that fits sampling.max_context (longer ones are left out;
    none fitting is an error: the warm start would have nothing to train on)."""
    out = [(ep.ids, ep.mask) for ep in gold_episodes(examples, prompts, tokenizer, cfg, db_paths)
           if len(ep.ids) <= cfg.sampling.max_context]
    if examples and not out:
        raise ValueError(f"no gold episode fits sampling.max_context {cfg.sampling.max_context}: nothing to warm start on")
    return out
