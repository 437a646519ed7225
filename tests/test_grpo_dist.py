"""2 ranks under FSDP2 (gloo, CPU) give the 1-process gradient of the GRPO loss.

Launches tests/dist_grad_check.py with torchrun (free port via --standalone) and checks that
for every case (loss variant, aggregation, rollout correction) the gathered FSDP2 gradient
matches the single-process one on the same global batch, split unevenly across ranks, for a
tiny MLP LM and (when present) model.py's Transformer. ~20 s.

    .venv/bin/pytest tests/test_grpo_dist.py -q
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import torchrun_env
from dist_grad_check import CASES

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_fsdp2_two_ranks_match_one_process():
    env = torchrun_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist_grad_check.py")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    found = re.findall(r"RESULT model=(\S+) case=(\S+) .* max_grad_diff=\S+ (ok|MISMATCH)", out)
    results = {(m, a): r for m, a, r in found}
    models = ["tiny"] + (["transformer", "transformer+ckpt"] if (ROOT / "model.py").exists() else [])
    assert p.returncode == 0 and results == {(m, "/".join(c)): "ok" for m in models for c in CASES}, out[-4000:]
