"""2-rank check of train.update on packed micro-batches (launched by tests/test_packing.py).

    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 tests/update_dist_check.py REF.pt

REF.pt: `torch.save([reference(case) for case in CASES], path)`, computed in one plain process.

Every rank builds the same model and the same global batch of multi-turn GRPO groups. The
reference is train.update on a plain model over the whole batch in one process. Each rank runs train.update on an FSDP2-sharded copy over its contiguous share (as train.py splits
a batch), the two shares having different groups, token counts and micro-batch counts (the rank
with fewer runs dummy passes). The optimizer records the gathered gradients instead of stepping:
they must equal the 1-process ones for every case (loss aggregation, ppo_epochs × mini_batches,
kl_beta, loss variant), with either FSDP2 unit (model.fsdp_unit). Reports
`RESULT case=... unit=... max_grad_diff=... ok|MISMATCH` on rank 0 (conftest.report).
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import config as C  # noqa: E402
from trainer import distributed  # noqa: E402
from conftest import grpo_update, report  # noqa: E402
from test_packing import make_model, make_trajs  # noqa: E402

# (loss aggregation, ppo_epochs, mini_batches, kl_beta, loss)
CASES = [("token-mean", 1, 1, 0.0, "grpo"), ("seq-mean-token-mean", 2, 2, 0.1, "grpo"),
         ("drgrpo", 1, 2, 0.0, "grpo"), ("token-mean", 1, 1, 0.0, "cispo")]


class Capture:
    """Records the (gathered) gradients at each step instead of stepping."""

    def __init__(self, model):
        self.model, self.grads = model, []

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)

    def step(self):
        grads = []
        for p in self.model.parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads.append(g.detach().clone())
        self.grads.append(grads)


def run(model, ref_model, trajs, adv, cfg, world):
    opt = Capture(model)
    sch = type("NoSchedule", (), {"step": lambda self: None})()
    grpo_update(model, ref_model, opt, sch, trajs, adv, cfg, world)
    return opt.grads


def setup(case):
    """-> (cfg, base model, reference model or None, trajectories, advantages) of one case."""
    agg, epochs, minis, kl, loss = case
    cfg = C.load_config([f"--grpo.loss_agg={agg}", f"--grpo.ppo_epochs={epochs}", f"--grpo.mini_batches={minis}",
                         f"--grpo.kl_beta={kl}", f"--grpo.loss={loss}", "--grpo.drgrpo_max_len=64",
                         "--optim.grad_clip=1e9", "--optim.micro_batch_tokens=60"])
    trajs = make_trajs(n_groups=4, G=4, seed=3)
    adv = torch.randn(len(trajs), generator=torch.Generator().manual_seed(0))
    return cfg, make_model(1), (make_model(2) if kl > 0 else None), trajs, adv


def reference(case):
    """1-process gradients (no process group): update() over the batch ordered so that its
    contiguous mini-batch k is rank 0's k-th slice followed by rank 1's k-th slice, which is what
    the 2 ranks' mini-batch k holds together."""
    cfg, base, ref, trajs, adv = setup(case)
    minis = cfg.grpo.mini_batches
    order = []
    for k in range(minis):
        for s in SHARES:
            order += s[round(k * len(s) / minis):round((k + 1) * len(s) / minis)]
    bounds = [round(k * len(order) / minis) for k in range(minis + 1)]
    sizes = [sum(len(s[round(k * len(s) / minis):round((k + 1) * len(s) / minis)]) for s in SHARES)
             for k in range(minis)]
    assert sizes == [bounds[k + 1] - bounds[k] for k in range(minis)], "slices must line up"
    return run(base, ref, [trajs[i] for i in order], adv[order], cfg, 1)


# model.fsdp_unit: per block (what a 7B needs) or the whole model as one unit (the tiny model)
UNITS = ("block", "model")

# rank 0's share: the first 9 trajectories, rank 1's the other 7 (uneven; groups cut across ranks)
SHARES = [list(range(0, 9)), list(range(9, 16))]


def main(reference_file):
    rank, world, device = distributed.setup_dist()
    assert world == 2 and device.type == "cpu", "run with 2 CPU ranks (CUDA_VISIBLE_DEVICES=)"
    wants = torch.load(reference_file)
    failed = False
    for case, want in zip(CASES, wants):
        for unit in UNITS:
            cfg, base, ref, trajs, adv = setup(case)
            idx = SHARES[rank]
            sharded = distributed.shard(base, torch.float32, unit)
            ref_sharded = distributed.shard(ref, torch.float32, unit) if ref is not None else None
            got = run(sharded, ref_sharded, [trajs[i] for i in idx], adv[idx], cfg, world)
            if rank == 0:
                diff = max((a - b).abs().max().item() for gs, ws in zip(got, want) for a, b in zip(gs, ws))
                ok = len(got) == len(want) and diff <= 1e-5
                failed |= not ok
                report(f"RESULT case={'/'.join(map(str, case))} unit={unit} max_grad_diff={diff:.2e} "
                       f"{'ok' if ok else 'MISMATCH'}")
    distributed.close()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv[1])
