"""RolloutStream.step_metrics on 2 gloo ranks (launched by tests/test_stream.py):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 tests/stream_dist_check.py

Each rank trains episodes of other ages at step 5: rank 0's tokens were sampled by versions 5 and 4
(ages 0 and 1), rank 1's by versions 5 and 2 (ages 0 and 3). Every rank must log the staleness of
all of them: maximum 3, mean 4/8, stale share 2/8, whichever rank holds the oldest token. Reports
`RESULT rank=<r> max=<x> mean=<y> stale=<z>` on each rank (conftest.report).
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import report  # noqa: E402
from rollout import Trajectory  # noqa: E402
from stream import RolloutStream  # noqa: E402
from trainer import distributed  # noqa: E402


def episode(versions: list[int]) -> Trajectory:
    """A finished episode: a 2-token prompt, then one sampled token per version (and one observation token)."""
    ids = [1, 2] + [3] * len(versions) + [4]
    mask = [0, 0] + [1] * len(versions) + [0]
    t = Trajectory.of([1, 2], ids, mask, [0.0] * len(ids))
    t.seq.versions = [0, 0] + versions + [0]
    return t


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # step_metrics reads the stream's counts of this step's decode steps and its open-episode cap;
    # the rest of a stream (sampler, engine, loop) plays no part in it
    stream = RolloutStream.__new__(RolloutStream)
    stream.share_episodes, stream.decode_steps, stream.live_row_steps = 4, 10, 20
    trained = [episode([5, 5, 4]), episode([5])] if rank == 0 else [episode([5, 2]), episode([5, 5])]
    m = stream.step_metrics(trained, 5, torch.device("cpu"))
    report(f"RESULT rank={rank} max={m['staleness_max']:g} mean={m['staleness_mean']:g} "
           f"stale={m['stale_token_frac']:g}")
    distributed.close()


if __name__ == "__main__":
    main()
