"""2-rank check of float16 loss scaling under FSDP2 (launched by tests/test_fp16.py).

    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 tests/fp16_dist_check.py

Both ranks build the same model, shard it in fp16 (fp32 masters) and take three optimizer steps
through optim.step_optimizer with a LossScaler at 2^16. Step 1: rank 1's loss is multiplied by
2^20 (its scaled fp16 backward overflows), rank 0's is not. Step 2: rank 1's loss is NaN. Step 3:
both plain. Every rank must see the same verdicts (overflow, nonfinite_loss, clean): the gradient
norm is global and the loss flag all-reduced, so no rank steps alone. Every rank reports
`RESULT rank=R verdicts=... scale=S overflow=N nonfinite=M moved=1|0` (moved: the weights
changed at step 3 only) through conftest.report: a file per rank.
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import config as C  # noqa: E402
from conftest import report  # noqa: E402
from test_packing import make_model  # noqa: E402
from trainer import distributed, optim  # noqa: E402
from trainer.loss_scale import LossScaler  # noqa: E402


def main():
    rank, world, device = distributed.setup_dist(120)
    cfg = C.load_config([])
    model = distributed.shard(make_model(), torch.float16)
    opt, sch = optim.make_optimizer(model, cfg.optim, 1e-3, 0, 10)
    scaler = LossScaler(cfg.optim, torch.float16)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(rank))
    verdicts, moved = [], []
    for factor in [2.0 ** 20, float("nan"), 1.0]:
        before = [p.detach().to_local().clone() for p in model.parameters()]
        logp, _ = model(ids[:, :-1], ids[:, 1:])
        loss = -logp.mean() * (factor if rank == 1 else 1.0)
        scaler.scale(loss * world).backward()
        optim.step_optimizer(model, opt, sch, cfg.optim, scaler)
        verdicts.append(scaler.last)
        moved.append(any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters())))
    ok_moved = int(moved == [False, False, True])
    report(f"RESULT rank={rank} verdicts={','.join(verdicts)} scale={scaler.scale_value:g} "
           f"overflow={scaler.overflow_skips} nonfinite={scaler.nonfinite_skips} moved={ok_moved}")
    distributed.close()


if __name__ == "__main__":
    main()
