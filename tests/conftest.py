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
    if "distributed" in sys.modules:
        sys.modules["distributed"].close()


def torchrun_env(**extra: str) -> dict:
    """The environment for tests that start ranks under torchrun. They check CPU (gloo) equalities,
    so GPUs are hidden: on a CUDA machine each rank would otherwise take GPU LOCAL_RANK (NCCL) and
    2 ranks would need 2 GPUs. One thread per rank: 2 ranks on 2 cores, no oversubscription."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "disabled", **extra}


def build_tiny_assets(d: Path) -> list[str]:
    """The toy set and a tiny model under d, built as a run builds them (tiny.prepare_assets).
    Returns the `group.key=value` settings that point a config at them (model.path is 5th)."""
    import config as C
    import tiny
    settings = [f"data.train_path={d}/toy/train.jsonl", f"data.eval_path={d}/toy/eval.jsonl",
                f"data.db_root={d}/toy", "data.prepare_toy=true", f"model.path={d}/model",
                "model.build_tiny=true", "model.tiny_hidden_size=32", "model.tiny_layers=1",
                "model.tiny_heads=2", "model.tiny_kv_heads=1", "model.tiny_intermediate_size=64",
                "model.tiny_vocab_size=512"]
    tiny.prepare_assets(C.load_config(["--" + a for a in settings]))
    return settings


def grpo_update(model, ref_model, optimizer, scheduler, trajs, adv, cfg, world=1, device="cpu") -> dict:
    """One GRPO update as train.main's loop runs it: policy_update.batch_logprobs once, then per mini-batch
    (policy_update.mini_batches) policy_update.update and optim.step_optimizer. Returns the token-weighted loss
    metrics, grad_norms (one per optimizer step) and skipped (1.0 if any step was skipped)."""
    import math

    import optim
    import torch
    import policy_update
    device = torch.device(device)
    sums, grad_norms = {}, []
    logps = policy_update.batch_logprobs(model, ref_model, trajs, cfg, device)
    for idx in policy_update.mini_batches(len(trajs), cfg.grpo):
        policy_update.update(model, trajs, idx, adv, logps, cfg, world, device, sums)
        grad_norms.append(optim.step_optimizer(model, optimizer, scheduler, cfg.optim))
    out = {k: v / max(w, 1e-9) for k, (v, w) in sums.items()}
    return {**out, "grad_norms": grad_norms, "skipped": float(not all(math.isfinite(g) for g in grad_norms))}
