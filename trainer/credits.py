"""The credits: one registered returns function per value of `grpo.credit`, each giving an episode's
return on each of its turns. grpo.token_advantages does everything the credits share (one group
normalisation over the episodes' returns, then each loss token takes its turn's value).

    from trainer.credits import CREDITS
    CREDITS["lookup_bonus"].returns(episode, grpo_cfg)   # [return of turn 0, turn 1, ...]
    python -m pytest tests/test_credits.py -q

A new credit is one function here, decorated with `@register_credit(name, keys=(...))`, and its
hand-computed test in tests/test_credits.py; a credit with a size adds its key to config.py's grpo
group (a field whose default is the off value, with a comment; a range in
trainer/config_checks.RANGES). config.py offers every registered name as a value of grpo.credit,
and config_checks refuses a credit's key set while another credit is picked, or a credit picked
with its keys off: either would silently train the outcome credit.

A returns function reads one rollout.Episode (its .reward.value R, .trajectory: num_turns and
steps, one env.step_record dict per turn; .example: the dataset record) and the grpo config group,
and returns one float per turn. Turn 0's return is the episode's whole return: the group's
baseline and spread are taken over those (grpo.group_baseline). These live in a package, not in
grpo.py, so that config.py can read the names (grpo.py imports config.py and rollout.py, and no
module config.py imports may import them back: tests/test_layout.py); so they take the Episode and
the config group as arguments, untyped here (a package imports nothing from the top level).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

ReturnsFn = Callable[[Any, Any], list[float]]  # (rollout.Episode, config.GRPOConfig) -> one return per turn


@dataclass(frozen=True)
class CreditSpec:
    """One credit's declaration: its returns function and the grpo.* keys it reads."""
    name: str
    returns: ReturnsFn
    keys: tuple[str, ...]  # grpo.* keys of its size; each key's default is its off value


CREDITS: dict[str, CreditSpec] = {}


def register_credit(name: str, *, keys: tuple[str, ...] = ()) -> Callable[[ReturnsFn], ReturnsFn]:
    """Decorator: register fn as the credit grpo.credit=name, reading the grpo keys `keys`."""
    def register(fn: ReturnsFn) -> ReturnsFn:
        assert name not in CREDITS, f"credit {name!r} registered twice"
        CREDITS[name] = CreditSpec(name, fn, keys)
        return fn
    return register


# -----------------------------------------------------------------------------
# the credits


@register_credit("outcome")
def outcome_returns(episode, grpo_cfg) -> list[float]:
    """The default: the outcome reward R on every turn (so every token gets the episode's advantage)."""
    return [episode.reward.value] * max(episode.trajectory.num_turns, 1)


def gold_literals(example: dict) -> list[str]:
    """The quoted string literals of the gold SQL that the question does not spell out (case
    aside): values the answer needs and only a lookup can show (the toy: the stored code 'Paris4k'
    of the question's 'Paris')."""
    found = [m.replace("''", "'") for m in re.findall(r"'((?:[^']|'')*)'", example["gold_sql"])]
    question = example.get("question", "").lower()
    return [x for x in dict.fromkeys(found) if x and x.lower() not in question]


def turn_rewards(episode, bonus: float) -> list[float]:
    """Per-turn rewards of one episode (grpo.lookup_bonus): `bonus` on the first tool turn whose
    observation shows a value the gold answer needs (gold_literals), 0 on every other turn (a
    later lookup that shows it again earns nothing: no farming). Tool turns are `sql` steps (tags
    protocol) and `query` steps (actions protocol); DESCRIBE and SAMPLE steps are not lookups."""
    out = [0.0] * episode.trajectory.num_turns
    needed = gold_literals(episode.example)
    for k, step in enumerate(episode.trajectory.steps[:len(out)]):
        if step["kind"] in ("sql", "query") and any(x in step.get("observation", "") for x in needed):
            out[k] = bonus
            break
    return out


@register_credit("lookup_bonus", keys=("lookup_bonus",))
def lookup_bonus_returns(episode, grpo_cfg) -> list[float]:
    """The worked per-turn credit: turn k's return is the outcome R plus the per-turn rewards from
    turn k on, R + Σ_{j≥k} b_j (reward-to-go, γ = 1; b_j: turn_rewards with b = grpo.lookup_bonus).
    The turn that first showed the value, and those before it, gain the bonus; the turns after it
    (the answer) are judged on the outcome alone."""
    bonuses = turn_rewards(episode, grpo_cfg.lookup_bonus) or [0.0]
    return [episode.reward.value + sum(bonuses[k:]) for k in range(len(bonuses))]


@register_credit("turn_discount", keys=("turn_discount",))
def turn_discount_returns(episode, grpo_cfg) -> list[float]:
    """The outcome discounted back from the answer: with K turns, turn k's return is
    γ^(K-1-k) · R (γ = grpo.turn_discount; the last turn gets R, each turn before it γ times the
    next). The whole return is turn 0's, γ^(K-1) · R: of two right episodes (R > 0) the group
    prefers the shorter, of two failed ones (R < 0) the longer, whose failure is discounted more;
    within an episode the later turns carry more of the outcome."""
    turns = max(episode.trajectory.num_turns, 1)
    return [grpo_cfg.turn_discount ** (turns - 1 - k) * episode.reward.value for k in range(turns)]
