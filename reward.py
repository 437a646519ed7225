"""The RL reward of an episode: its format (SkyRL-SQL's rules), its answer's execution match
(sqltask/exec_match.py: set, bag or Spider's rule), sql_env's dense shaping in the actions protocol,
DAPO's soft overlong punishment on the episode's generated tokens (reward.overlong_*).
One Reward per episode; `Reward.value` is the scalar GRPO's advantages compare.

    rewards = episode_rewards(transcripts, cfg.reward, protocol, template_pieces)   # rollout.sample_episodes
    python reward.py DB.sqlite "PRED SQL" "GOLD SQL" [set|bag|spider]              # one execution match

Where to edit for an ablation of the reward: episode_rewards (the outcome and the shaping); the credit
of a turn is grpo.py's (grpo.token_advantages).
Tests: .venv/bin/pytest tests/test_reward.py
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

from config import RewardConfig
from sqltask.exec_match import execution_match, gold_rows, match_batch

# -----------------------------------------------------------------------------
# episode rewards

# A tag SkyRL rejects inside the solution: <think>, <sql>, <observation>, opening or closing, in any
# case and any variant form (`<SQL>`, `</sql >`, `<observation id=1>`, `<think/>`). `\b` keeps
# `<sqlite>` or `<sql_x>` legal, and <reminder> is deliberately not on the list (as in SkyRL).
_TAG_IN_SOLUTION = re.compile(r"</?(think|sql|observation)\b", re.I)
_OBS_END = re.compile(r"</observation>", re.I)


def format_ok(response_text: str, finished: bool, template_pieces: tuple[str, ...] = ()) -> tuple[bool, str]:
    """SkyRL-SQL's format rules on the text of the whole episode (every turn and observation
    after the prompt). Valid when all hold:
      - a solution was written before max_turns (`finished`);
      - exactly one `<solution>`, and exactly one `</solution>` after it (a stray `</solution>`
        earlier in the episode does not count);
      - no <think>/<sql>/<observation> tag of any case or form inside the solution;
      - at least one `<think>` … `</think>` block somewhere;
      - every `</observation>` (any case) before the solution is followed, after whitespace, by
        `<think>` (any case): the model must think about each tool result before acting.
    template_pieces: chat-template text the conversation format inserts between messages (e.g.
    "<|im_end|>\\n<|im_start|>user\\n"); removed first, so the rules see the messages' contents
    joined, as SkyRL's env does. The single-message format needs none."""
    t = response_text
    for piece in sorted(template_pieces, key=len, reverse=True):  # longest first: pieces overlap
        if piece:
            t = t.replace(piece, "")
    if not finished:
        return False, "no solution before max_turns"
    if t.count("<solution>") != 1:
        return False, "need exactly one <solution>"
    before, tail = t.split("<solution>", 1)
    if tail.count("</solution>") != 1:
        return False, "need exactly one </solution> after <solution>"
    if _TAG_IN_SOLUTION.search(tail.split("</solution>", 1)[0]):
        return False, "tags inside the solution"
    i = t.find("<think>")
    if i < 0 or t.find("</think>", i + len("<think>")) < 0:
        return False, "no <think>…</think> block"
    for m in _OBS_END.finditer(before):
        if not before[m.end():].lstrip().lower().startswith("<think>"):
            return False, "no <think> right after an observation"
    return True, ""


def dense_shaping(steps: list[dict], gold: list | None, cfg: RewardConfig) -> float:
    """sql_env's shaping over an actions episode, per step (cfg.dense_*): a step cost; a repeated
    action (same kind + normalised arg) costs `repeat` and earns nothing else (so repeats cannot be
    farmed); a new successful action earns exec_ok + new_info (new_info capped over the episode);
    a QUERY earns progress x the gain in Jaccard(rows, gold rows) over the best so far. Each step
    clamped to [dense_step_min, dense_step_max]."""
    seen, info, best, total = set(), 0.0, 0.0, 0.0
    gold_set = set(map(tuple, gold)) if gold is not None else None
    for s in steps:
        if s["kind"] == "answer":  # the terminal reward scores it
            continue
        r = cfg.dense_step
        key = (s["kind"], " ".join((s.get("arg") or "").lower().split()))
        if key in seen:
            r += cfg.dense_repeat
        else:
            seen.add(key)
            if s.get("ok"):
                gain = max(0.0, min(cfg.dense_new_info, cfg.dense_new_info_cap - info))
                info += gain
                r += cfg.dense_exec_ok + gain
                if s["kind"] == "query" and gold_set is not None and s.get("rows") is not None:
                    rows = set(map(tuple, s["rows"]))
                    union = rows | gold_set
                    jac = len(rows & gold_set) / len(union) if union else 1.0
                    if jac > best:
                        r += cfg.dense_progress * (jac - best)
                        best = jac
        total += min(max(r, cfg.dense_step_min), cfg.dense_step_max)
    return total


def overlong_penalty(generated_tokens: int, cfg: RewardConfig) -> float:
    """DAPO's soft overlong punishment (verl's overlong buffer), times reward.overlong_penalty_factor:
    with L the episode's generated tokens, L_max = reward.overlong_max_len, L_cache =
    reward.overlong_buffer_len,
        0                                   L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache   L_max - L_cache < L <= L_max   (falls linearly to -1)
        -1                                  L > L_max
    L_cache 0: off (0). Multi-turn: L counts the model's own tokens over every turn (loss mask 1),
    not the tool's observations, which the policy does not write (DAPO's response is one turn)."""
    L, cache, high = generated_tokens, cfg.overlong_buffer_len, cfg.overlong_max_len
    if cache <= 0 or L <= high - cache:
        return 0.0
    return cfg.overlong_penalty_factor * (((high - cache) - L) / cache if L <= high else -1.0)


@dataclass
class Transcript:
    """What the reward reads of one episode (rollout.transcript builds it from a trajectory)."""
    db_path: str  # the example's database
    gold_sql: str
    response: str  # every turn and observation after the prompt, as text
    final_sql: str  # the answer to execute ("" when none)
    finished: bool  # the episode ended with an answer (a solution / ANSWER)
    steps: list[dict] = field(default_factory=list)  # env.step_record of each env step (dense shaping reads them)
    generated_tokens: int = 0  # the model's own tokens over every turn (loss mask 1; overlong_penalty reads it)


@dataclass
class Reward:
    """One episode's reward: `value` is the scalar GRPO's advantages use; the rest explain it."""
    value: float  # correct / wrong / format_error (or no_answer), plus the dense shaping when on
    exec_match: bool  # the answer's result equals the gold's (reward.mode)
    format_ok: bool  # tags: SkyRL's format rules hold; actions: an ANSWER within the budget
    error: str = ""  # why not: the SQL error, the format rule broken, "" when right
    overlong_penalty: float = 0.0  # the soft overlong punishment included in value (<= 0; 0 when off)


def episode_rewards(episodes: list[Transcript], cfg: RewardConfig, protocol: str = "tags",
                    template_pieces: tuple[str, ...] = ()) -> list[Reward]:
    """One Reward per transcript. All predictions run in one pool call.
    template_pieces: see format_ok (the conversation format's chat-template text)."""
    fmts = [format_ok(e.response, e.finished, template_pieces) if protocol == "tags"
            else (bool(e.finished), "" if e.finished else "no ANSWER before the step budget")
            for e in episodes]
    # every gold runs (cached; dense shaping needs it even without an answer), a prediction only
    # when the format is fine
    matches = match_batch([(e.db_path, (e.final_sql or "") if ok else "", e.gold_sql)
                           for e, (ok, _) in zip(episodes, fmts)],
                          cfg.mode, timeout_s=cfg.timeout_s, keep_distinct=cfg.keep_distinct)
    out = []
    for e, (fmt_ok, why), (match, err) in zip(episodes, fmts, matches):
        err = err if fmt_ok else why
        if not fmt_ok:  # tags: malformed (format_error); actions: no ANSWER within the budget (no_answer)
            value = cfg.format_error if protocol == "tags" else cfg.no_answer
        else:
            value = cfg.correct if match else cfg.wrong
        # an episode without an ANSWER gets no shaping under dense_needs_answer (see RewardConfig)
        if protocol == "actions" and cfg.dense and (e.finished or not cfg.dense_needs_answer):
            value += dense_shaping(e.steps or [], gold_rows(e.db_path, e.gold_sql, cfg.mode, cfg.keep_distinct), cfg)
        penalty = overlong_penalty(e.generated_tokens, cfg)  # added to every episode's reward, as DAPO's
        out.append(Reward(value + penalty, match, fmt_ok, err, penalty))
    return out


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    print(execution_match(sys.argv[1], sys.argv[2], sys.argv[3], *sys.argv[4:]))
