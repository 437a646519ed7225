"""The credit: trainer/credits.py's returns functions against hand-computed returns, and
grpo.token_advantages (one group normalisation, each token its turn's value) against hand values.

    .venv/bin/pytest tests/test_credits.py -q
"""
import math
from types import SimpleNamespace

import pytest
import torch

import grpo
from config import GRPOConfig
from grpo import advantages
from reward import Reward
from rollout import Trajectory
from trainer.credits import CREDITS, gold_literals, turn_rewards


def approx(x, y, tol=1e-6):
    return torch.allclose(torch.as_tensor(x, dtype=torch.float32),
                          torch.as_tensor(y, dtype=torch.float32), atol=tol, rtol=tol)


def credit_episode(group, outcome, observations, question="customers in Paris", gold="SELECT * FROM c WHERE city = 'Paris4k'"):
    """A fake episode of len(observations) tool turns then an answer turn: prompt [0, 0], each turn
    2 sampled tokens then (tool turns) 1 observation token; steps as env.step_record writes them."""
    ids, mask, spans, steps = [0, 0], [0, 0], [], []
    for obs in observations:
        spans.append((len(ids), len(ids) + 2))
        ids, mask = ids + [1, 1, 9], mask + [1, 1, 0]
        steps.append({"kind": "sql", "arg": "SELECT", "ok": True, "rows": None, "n_rows": 1, "observation": obs})
    spans.append((len(ids), len(ids) + 2))
    ids, mask = ids + [1, 1], mask + [1, 1]
    steps.append({"kind": "solution", "arg": gold, "ok": False, "rows": None, "n_rows": None, "observation": ""})
    traj = Trajectory.of([0, 0], ids, mask, [0.0] * len(ids), turn_spans=spans, num_turns=len(spans), steps=steps)
    return SimpleNamespace(trajectory=traj, reward=Reward(outcome, outcome == 1.0, True),
                           example={"gold_sql": gold, "question": question}, group=group)


# -----------------------------------------------------------------------------
# the returns of each credit, by hand


def test_token_turns_follow_the_turn_spans():
    e = credit_episode(0, 1.0, ["x", "y"])
    assert e.trajectory.token_turns() == [0, 0, 1, 1, 2, 2]


def test_default_credit_is_the_episode_advantage_on_every_token():
    g = GRPOConfig(group_size=2)
    batch = [credit_episode(0, 1.0, ["Paris4k"]), credit_episode(0, 0.0, ["none"])]
    adv = grpo.token_advantages(batch, g)
    want = advantages(torch.tensor([1.0, 0.0]), 2, "group")
    assert [a.tolist() for a in adv] == [[want[0].item()] * 4, [want[1].item()] * 4]


def test_lookup_bonus_hand():
    """Returns 1 + 0.5 and 0 (mean 0.75, unbiased std 0.75 * sqrt 2): the first episode's lookup turn
    (its observation shows the code) gets (1.5 - 0.75) / std, its answer turn (1 - 0.75) / std; the
    second episode's turns (no code shown) (0 - 0.75) / std each."""
    batch = [credit_episode(0, 1.0, ["Paris4k | Paris_N"]), credit_episode(0, 0.0, ["Paris_N"])]
    std = 0.75 * math.sqrt(2)
    cfg = GRPOConfig(group_size=2, credit="lookup_bonus", lookup_bonus=0.5, adv_eps=0.0)
    assert CREDITS["lookup_bonus"].returns(batch[0], cfg) == [1.5, 1.0]
    adv = grpo.token_advantages(batch, cfg)
    assert approx(adv[0], [0.75 / std] * 2 + [0.25 / std] * 2) and approx(adv[1], [-0.75 / std] * 4)
    adv = grpo.token_advantages(batch, GRPOConfig(group_size=2, credit="lookup_bonus", lookup_bonus=0.5, advantage="none"))
    assert approx(adv[0], [0.75, 0.75, 0.25, 0.25]) and approx(adv[1], [-0.75] * 4)


def test_lookup_bonus_only_once_and_only_for_values_the_question_does_not_spell_out():
    e = credit_episode(0, 1.0, ["(0 rows)", "Paris4k", "Paris4k again"])
    assert turn_rewards(e, 0.2) == [0.0, 0.2, 0.0, 0.0]  # the first lookup that shows it
    direct = credit_episode(0, 1.0, ["Paris"], gold="SELECT * FROM c WHERE city = 'Paris'")
    assert gold_literals(direct.example) == [] and turn_rewards(direct, 0.2) == [0.0, 0.0]
    assert gold_literals({"gold_sql": "SELECT 'it''s', 'a', 'it''s'", "question": "q"}) == ["it's", "a"]


def test_lookup_bonus_in_the_actions_protocol_pays_the_query_that_shows_the_value():
    """The actions protocol's lookups are QUERY steps: the first query whose rows show the code earns
    the bonus; a DESCRIBE (schema) or SAMPLE step shows no looked-up value and earns nothing, even
    when its rows happen to hold the code."""
    e = credit_episode(0, 1.0, ["city TEXT", "Paris4k | 3", "Paris4k | 5"])
    for step, kind in zip(e.trajectory.steps, ["describe", "sample", "query"]):
        step["kind"] = kind
    e.trajectory.steps[-1]["kind"] = "answer"
    assert turn_rewards(e, 0.2) == [0.0, 0.0, 0.2, 0.0]
    e.trajectory.steps[1]["kind"] = "query"  # now the second step is the first query showing it
    assert turn_rewards(e, 0.2) == [0.0, 0.2, 0.0, 0.0]


@pytest.mark.parametrize("mode", ["group", "batch"])
def test_per_turn_credit_of_a_group_with_equal_returns_divides_by_eps(mode):
    """Both episodes found the code and answered right: whole returns 1.5 and 1.5, std 0. The scale is
    0 + eps (no 0/0): the lookup turns, at the baseline, get exactly 0; the answer turns, judged on
    the outcome 1.0 alone, get (1.0 - 1.5) / eps (finite). By hand, eps 0.01: -50. "batch" takes the
    std over the whole batch, here the same two returns."""
    batch = [credit_episode(0, 1.0, ["Paris4k"]), credit_episode(0, 1.0, ["Paris4k"])]
    cfg = GRPOConfig(group_size=2, credit="lookup_bonus", lookup_bonus=0.5, adv_eps=0.01, advantage=mode)
    adv = grpo.token_advantages(batch, cfg)
    for a in adv:
        assert torch.isfinite(a).all()
        assert approx(a, [0.0, 0.0, -50.0, -50.0])
    # the default credit on equal rewards: 0 on every token, every mode
    for m in ("group", "batch", "none"):
        adv = grpo.token_advantages(batch, GRPOConfig(group_size=2, advantage=m))
        assert all(a.abs().max() == 0 for a in adv)
