"""2 ranks under FSDP2 (gloo, CPU) give the 1-process gradient of the GRPO loss, the 1-process
"batch" advantages, and a step in which one rank has nothing to train.

Launches tests/dist_grad_check.py with torchrun (conftest.run_dist_check) and checks that
for every case (loss variant, aggregation, rollout correction) the gathered FSDP2 gradient
matches the single-process one on the same global batch, split unevenly across ranks, for a
tiny MLP LM and (when present) model.py's Transformer. ~20 s. Then tests/grpo_step_dist_check.py
(~15 s): the "batch" advantages, and grpo.mask_truncated leaving one rank nothing to train.

    .venv/bin/pytest tests/test_grpo_dist.py -q
"""
import re

import pytest
import torch.distributed as dist

import config as C
from conftest import ROOT, run_dist_check
from dist_grad_check import CASES


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_fsdp2_two_ranks_match_one_process():
    check = run_dist_check("dist_grad_check.py", timeout=200)
    found = [re.fullmatch(r"RESULT model=(\S+) case=(\S+) .* max_grad_diff=\S+ (ok|MISMATCH)", line)
             for line in check.results.get(0, [])]
    results = {(m[1], m[2]): m[3] for m in found if m}
    models = ["tiny"] + (["transformer", "transformer+ckpt"] if (ROOT / "model.py").exists() else [])
    assert check.returncode == 0 and results == {(m, "/".join(c)): "ok" for m in models for c in CASES}, check.why()


# -----------------------------------------------------------------------------
# the credit and train.grpo_step on 2 ranks (tests/grpo_step_dist_check.py, one launch for both)


@pytest.fixture(scope="module")
def step_check():
    # within the per-test limit: a rank that skips the update makes its peer's collective time out (60 s)
    return run_dist_check("grpo_step_dist_check.py", timeout=200)


def test_batch_advantages_on_two_ranks_are_those_of_one_process(step_check):
    """grpo.advantage "batch" with other groups on each rank: every rank's episodes get (reward -
    their own group's mean) / (the std of every rank's rewards + eps), the values a single process
    computes on the whole batch (test_grpo.loop_advantages, plain Python), rank 0's episodes
    first. Using rank 0's baselines on rank 1 (or a rank's own std) would not match."""
    from grpo_step_dist_check import G, REWARDS
    from test_grpo import loop_advantages
    every = [r for rank in (0, 1) for group in REWARDS[rank] for r in group]
    want = loop_advantages(every, G, "batch", C.load_config([]).grpo.adv_eps).tolist()
    got = {}
    for rank in (0, 1):
        line = next((x for x in step_check.results.get(rank, []) if x.startswith("ADV ")), "")
        head = f"ADV rank={rank} n={G * len(REWARDS[rank])} "
        assert line.startswith(head), step_check.why()
        got[rank] = [float(x) for x in line[len(head):].split()]
    assert got[0] + got[1] == pytest.approx(want, rel=1e-6, abs=1e-6), (got, want)
    assert len(set(map(abs, got[1]))) > 1  # rank 1's episodes differ: a wrong baseline would show


@pytest.mark.timeout(300)
def test_mask_truncated_with_a_rank_left_with_nothing_joins_the_update(step_check):
    """Every kept episode of rank 1 is truncated (grpo.mask_truncated leaves it nothing to train),
    rank 0's are not: both ranks run the update (its collectives: the loss normaliser, FSDP2's
    gathers and reduce-scatters, the global grad norm), take the same optimizer step, sync the
    sampler once and finish the step. A rank that skipped the update would leave its peer in a
    collective: the check then fails on the collective's 60-s limit, not by hanging."""
    lines = {rank: next((x for x in step_check.results.get(rank, []) if x.startswith("STEP ")), "")
             for rank in (0, 1)}
    fields = {rank: dict(kv.split("=") for kv in line.split()[1:]) for rank, line in lines.items() if line}
    assert step_check.returncode == 0 and sorted(fields) == [0, 1], step_check.why()
    assert fields[0]["trained"] == "4" and fields[1]["trained"] == "0"
    for rank in (0, 1):
        assert fields[rank]["updated"] == "1" and fields[rank]["refreshed"] == "1", fields
        assert float(fields[rank]["masked_frac"]) == 0.5  # 4 of the 8 kept episodes, over both ranks
    assert fields[0]["grad_norm"] == fields[1]["grad_norm"] and 0 < float(fields[0]["grad_norm"]) < float("inf")
