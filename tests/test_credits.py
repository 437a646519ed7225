"""The credit: trainer/credits.py's returns functions against hand-computed returns, and
grpo.token_advantages (one group normalisation, each token its turn's value) against hand values,
a plain-Python loop reference and, on many random groups, the bound every advantage must keep.

    .venv/bin/pytest tests/test_credits.py -q
"""
import math
import random
from types import SimpleNamespace

import pytest
import torch

import grpo
from config import GRPOConfig
from grpo import advantages
from reward import Reward
from rollout import Trajectory
from trainer.config_checks import RANGES
from trainer.credits import CREDITS, CreditSpec, gold_literals, turn_rewards


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
    second episode's turns (no code shown) (0 - 0.75) / std each. The floor (the largest per-turn
    deviation, 0.5) is below the std: the std is the scale."""
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


def test_turn_discount_returns_hand():
    # γ = 0.9, outcome -1 over 3 turns: γ², γ, 1 times -1; one turn: the outcome itself
    cfg = GRPOConfig(credit="turn_discount", turn_discount=0.9)
    assert approx(CREDITS["turn_discount"].returns(credit_episode(0, -1.0, ["a", "b"]), cfg), [-0.81, -0.9, -1.0])
    assert CREDITS["turn_discount"].returns(credit_episode(0, 1.0, []), cfg) == [1.0]


def test_turn_discount_advantages_hand():
    """γ = 0.5. Group 1: a 3-turn right episode (returns 0.25, 0.5, 1) beside a 1-turn right one (1):
    whole returns 0.25 and 1, mean 0.625, std 0.75 / sqrt 2 = 0.53; the largest deviation,
    |1 - 0.25| = 0.75, is above it and is the scale: (0.25, 0.5, 1 | 1) - 0.625 over 0.75 =
    (-0.5, -1/6, 0.5 | 0.5). Group 2: a 2-turn right episode (0.5, 1) beside a 1-turn wrong one (-1):
    mean -0.25, std 1.5 / sqrt 2 = 1.0607 above the deviation 0.5: (0.75, 1.25 | -0.75) / 1.0607."""
    cfg = GRPOConfig(group_size=2, credit="turn_discount", turn_discount=0.5, adv_eps=0.0)
    adv = grpo.token_advantages([credit_episode(0, 1.0, ["a", "b"]), credit_episode(0, 1.0, [])], cfg)
    assert approx(adv[0], [-0.5, -0.5, -1 / 6, -1 / 6, 0.5, 0.5]) and approx(adv[1], [0.5, 0.5])
    adv = grpo.token_advantages([credit_episode(1, 1.0, ["a"]), credit_episode(1, -1.0, [])], cfg)
    std = 1.5 / math.sqrt(2)
    assert approx(adv[0], [0.75 / std] * 2 + [1.25 / std] * 2) and approx(adv[1], [-0.75 / std] * 2)


@pytest.mark.parametrize("mode", ["group", "batch"])
def test_a_group_with_equal_whole_returns_is_floored_not_divided_by_eps(mode):
    """A blow-up the floor prevents. Lookup bonus 0.5, both episodes found the code and answered right: whole
    returns 1.5 and 1.5, std 0. Without the floor the answer turns got (1.0 - 1.5) / eps (-5e5 at
    eps 1e-6); with it the scale is the largest deviation 0.5 (+ eps): lookup turns 0, answer turns
    -0.5 / 0.5 = -1. Turn discount 0.5, two right 3-turn episodes: returns (0.25, 0.5, 1) each, the
    scale 0.75: (0, 1/3, 1) where it was (0, 2.5e5, 7.5e5). "batch" takes the std over the same returns."""
    batch = [credit_episode(0, 1.0, ["Paris4k"]), credit_episode(0, 1.0, ["Paris4k"])]
    adv = grpo.token_advantages(batch, GRPOConfig(group_size=2, credit="lookup_bonus", lookup_bonus=0.5, advantage=mode))
    assert all(approx(a, [0.0, 0.0, -1.0, -1.0], 1e-5) for a in adv)
    batch = [credit_episode(0, 1.0, ["a", "b"]), credit_episode(0, 1.0, ["a", "b"])]
    adv = grpo.token_advantages(batch, GRPOConfig(group_size=2, credit="turn_discount", turn_discount=0.5, advantage=mode))
    assert all(approx(a, [0.0, 0.0, 1 / 3, 1 / 3, 1.0, 1.0], 1e-5) for a in adv)
    # the default credit on equal rewards: 0 on every token, every mode
    for m in ("group", "batch", "none"):
        adv = grpo.token_advantages(batch, GRPOConfig(group_size=2, advantage=m))
        assert all(a.abs().max() == 0 for a in adv)


# -----------------------------------------------------------------------------
# every advantage is finite and bounded, on random groups


def loop_reference(returns: list[list[float]], G: int, mode: str, eps: float) -> list[list[float]]:
    """The rule in plain Python, one group at a time: baseline = the group's mean whole return
    (turn 0's); scale = max(std, D) + eps with std unbiased (the group's, or the batch's whole
    returns' in "batch") and D the group's largest |return_k - return_0|; 1 in "none"."""
    wholes = [r[0] for r in returns]
    n = len(wholes)
    mean_b = sum(wholes) / n
    std_b = math.sqrt(sum((x - mean_b) ** 2 for x in wholes) / (n - 1))
    out = []
    for p in range(n // G):
        group = returns[p * G:(p + 1) * G]
        mean = sum(r[0] for r in group) / G
        std = math.sqrt(sum((r[0] - mean) ** 2 for r in group) / (G - 1)) if mode == "group" else std_b
        floor = max(abs(x - r[0]) for r in group for x in r)
        scale = 1.0 if mode == "none" else max(std, floor) + eps
        out += [[(x - mean) / scale for x in r] for r in group]
    return out


def bound(returns: list[list[float]], G: int, mode: str, p: int) -> float:
    """What the rewards allow an advantage of group p, derived in grpo.token_advantages: A_k =
    (r_0 - mean)/scale + (r_k - r_0)/scale with scale ≥ max(std, D). The second term is within ±1
    (|r_k - r_0| ≤ D). The first: in "group" |r_0 - mean_G| ≤ (G-1)/√G · std_G (Samuelson's
    inequality, for the unbiased std); in "batch" |r_0 - mean_G| ≤ |r_0 - mean_B| + |mean_B - mean_G|
    ≤ 2 (N-1)/√N · std_B over the N episodes. In "none" nothing is divided: A_k = r_k - mean_G lies
    within the range of the group's returns (mean_G is between its smallest and largest)."""
    if mode == "group":
        return (G - 1) / math.sqrt(G) + 1
    if mode == "batch":
        n = len(returns)
        return 2 * (n - 1) / math.sqrt(n) + 1
    values = [x for r in returns[p * G:(p + 1) * G] for x in r]
    return max(values) - min(values)


def random_batch(rng: random.Random, G: int, outcomes: str) -> list:
    """3 groups of G episodes with 0-3 tool turns each, some showing the code. outcomes: equal (one
    SkyRL reward per group), skyrl (each -1, 0 or 1), near (a group's rewards 1 + k·2^-10: nearly
    equal, exact in float32) or normal."""
    batch = []
    for p in range(3):
        same = rng.choice([-1.0, 0.0, 1.0])
        for _ in range(G):
            outcome = {"equal": same, "skyrl": rng.choice([-1.0, 0.0, 1.0]), "near": 1.0 + rng.randrange(4) * 2 ** -10,
                       "normal": rng.gauss(0, 1)}[outcomes]
            observations = [rng.choice(["Paris4k", "(0 rows)"]) for _ in range(rng.randrange(4))]
            batch.append(credit_episode(p, outcome, observations))
    return batch


def random_size(key: str, rng: random.Random) -> float:
    """A random value of grpo.<key> inside its range (trainer/config_checks.RANGES), never its
    bound: a credit's size."""
    rule = RANGES[f"grpo.{key}"][0]
    if rule.startswith(">"):
        return float(rule.lstrip(">= ")) + rng.uniform(0.01, 2.0)
    low, high = (float(x) for x in rule[1:-1].split(","))
    return rng.uniform(low + 0.05 * (high - low), high)


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
@pytest.mark.parametrize("credit", [*CREDITS, "any_returns"])
def test_every_advantage_is_finite_and_bounded_on_random_groups(mode, credit, monkeypatch):
    """Over random groups (equal, SkyRL, nearly equal and normal outcomes) every registered credit,
    each with random sizes of the keys it declares, and "any_returns" (a stand-in credit giving each
    turn any return, up to 100x apart): every advantage is finite, within the bound above, and equal
    to the loop reference; the outcome credit's are GRPO's flat advantages bit for bit."""
    rng = random.Random(f"{mode}-{credit}")
    monkeypatch.setitem(CREDITS, "any_returns", CreditSpec("any_returns", lambda e, cfg: e.any_returns, ()))
    for trial in range(24):
        G = rng.choice([2, 3, 4, 6])
        batch = random_batch(rng, G, ["equal", "skyrl", "near", "normal"][trial % 4])
        for e in batch:
            size = rng.choice([1e-3, 1.0, 100.0])
            e.any_returns = [rng.gauss(0, size) for _ in range(e.trajectory.num_turns)]
        cfg = GRPOConfig(group_size=G, advantage=mode, credit=credit, adv_eps=rng.choice([1e-6, 1e-2]),
                         **{key: random_size(key, rng) for key in CREDITS[credit].keys})
        returns = [CREDITS[credit].returns(e, cfg) for e in batch]
        adv = grpo.token_advantages(batch, cfg)
        want = loop_reference(returns, G, mode, cfg.adv_eps)
        for i, (e, a) in enumerate(zip(batch, adv)):
            assert torch.isfinite(a).all()
            limit = bound(returns, G, mode, i // G)
            assert a.abs().max() <= limit * (1 + 1e-4) + 1e-5, (mode, credit, trial, a, limit)
            per_token = [want[i][k] for k in e.trajectory.token_turns()]
            # float32 against float64: a nearly equal group's r - mean loses ~1e-7 over a scale ~1e-3
            assert approx(a, per_token, 1e-3), (mode, credit, trial, a, per_token)
        if credit == "outcome":
            flat = advantages(torch.tensor([e.reward.value for e in batch]), G, mode, cfg.adv_eps)
            assert all(torch.equal(a, flat[i].expand_as(a)) for i, a in enumerate(adv))
