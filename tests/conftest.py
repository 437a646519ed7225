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


def torchrun_env(**extra: str) -> dict:
    """The environment for tests that start ranks under torchrun. They check CPU (gloo) equalities,
    so GPUs are hidden: on a CUDA machine each rank would otherwise take GPU LOCAL_RANK (NCCL) and
    2 ranks would need 2 GPUs. One thread per rank: 2 ranks on 2 cores, no oversubscription."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "disabled", **extra}
