"""distributed.close(): the last call of train.py, eval.py and the 2-rank checks.

It runs in a fresh process (the test session's own process group stays up for other tests): a
one-rank group (gloo, or NCCL where a GPU is visible), a collective, close(). After it the group is gone, a second close() does
nothing, and the process exits 0. The 2-rank checks (tests/*_dist_check.py, train.py under
torchrun in test_train.py) end with it too; before it, 7 of 40 runs of one aborted at exit.

    pytest -q tests/test_distributed_close.py
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import torch, torch.distributed as dist
from trainer import distributed
rank, world, device = distributed.setup_dist(60)
t = torch.ones(3, device=device)  # NCCL (a GPU visible) takes device tensors only
dist.all_reduce(t)
distributed.close()
assert not dist.is_initialized(), "close() left the process group up"
distributed.close()  # no group: nothing to do
print("closed", t.tolist())
"""


def test_close_ends_the_group_and_exits_zero():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "closed [1.0, 1.0, 1.0]" in done.stdout
