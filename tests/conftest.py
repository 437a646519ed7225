"""Shared test setup: the repo root on sys.path, the location of the real Spider data."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")

# Real Spider data (read-only). Tests that need it skip with this message when it is absent.
SPIDER = Path(os.environ.get("SPIDER_DIR", ROOT.parent / "shared" / "data" / "spider"))
SPIDER_MISSING = f"real Spider data not found at {SPIDER} (set SPIDER_DIR to use it)"
HAVE_SPIDER = (SPIDER / "dev.json").exists() and (SPIDER / "database").is_dir()


def pytest_sessionfinish(session, exitstatus):
    """test_precision and test_lora_train build the in-process one-rank gloo group and leave it up
    for the session. Close it before pytest exits: a gloo worker thread still letting go of a
    collective's tensors while the interpreter shuts down aborts the process, and pytest's exit
    status with it (distributed.close waits for it)."""
    if "trainer.distributed" in sys.modules:
        sys.modules["trainer.distributed"].close()


def torchrun_env(**extra: str) -> dict:
    """The environment for tests that start ranks under torchrun. They check CPU (gloo) equalities,
    so GPUs are hidden: on a CUDA machine each rank would otherwise take GPU LOCAL_RANK (NCCL) and
    2 ranks would need 2 GPUs. One thread per rank: 2 ranks on 2 cores, no oversubscription."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "disabled", **extra}


def build_tiny_assets(d: Path) -> list[str]:
    """The toy set and a tiny model under d, built as a run builds them (tiny.prepare_assets).
    Returns the `group.key=value` settings that point a config at them (model.path is 5th)."""
    import config as C
    import sft
    from model import Transformer
    from toy import tiny
    settings = [f"data.train_path={d}/toy/train.jsonl", f"data.eval_path={d}/toy/eval.jsonl",
                f"data.db_root={d}/toy", "data.prepare_toy=true", f"model.path={d}/model",
                "model.build_tiny=true", "model.tiny_hidden_size=32", "model.tiny_layers=1",
                "model.tiny_heads=2", "model.tiny_kv_heads=1", "model.tiny_intermediate_size=64",
                "model.tiny_vocab_size=512"]
    tiny.prepare_assets(C.load_config(["--" + a for a in settings]), Transformer, sft.gold_texts)
    return settings


def loss_of(logp, old, adv, mask, *, ref_logp=None, rollout_logp=None, entropy=None, turns=None, **kw):
    """grpo.policy_loss on loose (B, T) tensors, packed into the LossInputs the update builds.
    adv: (B,) per sequence (expanded over its tokens) or (B, T) per token; kw: policy_loss's."""
    import torch

    import grpo
    from trainer.policy_update import LossInputs
    adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    turns = torch.zeros_like(mask, dtype=torch.long) if turns is None else turns
    return grpo.policy_loss(LossInputs(logp, old, ref_logp, rollout_logp, mask, adv, turns, entropy), **kw)


def grpo_update(model, ref_model, optimizer, scheduler, trajs, adv, cfg, world=1, device="cpu") -> dict:
    """One GRPO update as train.grpo_step runs it (policy_update.update_policy with grpo.PolicyLoss),
    on given trajectories and per-trajectory advantages adv (n,) (each spread over its loss tokens,
    grpo.token_advantages' default credit). Returns update_policy's metrics."""
    import torch

    import grpo
    from trainer import policy_update
    per_token = [adv[i].expand(len(t.token_turns())).clone() for i, t in enumerate(trajs)]
    return policy_update.update_policy(model, ref_model, optimizer, scheduler, trajs, per_token,
                                       grpo.PolicyLoss(cfg.grpo, cfg.sampling.max_context), cfg, world,
                                       torch.device(device))
