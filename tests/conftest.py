"""Shared test setup: the repo root on sys.path, the location of the real Spider data."""
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")

# Real Spider data (read-only). Tests that need it skip with this message when it is absent.
SPIDER = Path(os.environ.get("SPIDER_DIR", ROOT.parent / "shared" / "data" / "spider"))
SPIDER_MISSING = f"real Spider data not found at {SPIDER} (set SPIDER_DIR to use it)"
HAVE_SPIDER = (SPIDER / "dev.json").exists() and (SPIDER / "database").is_dir()

# Tests that start 2 ranks under torchrun: on a machine with CUDA each rank takes GPU LOCAL_RANK
# (NCCL), so they need 2 GPUs there; CPU-only machines run them on gloo.
TWO_RANKS_POSSIBLE = not (torch.cuda.is_available() and torch.cuda.device_count() < 2)
TWO_RANKS_MISSING = "2 ranks under torchrun take 2 GPUs on a CUDA machine; this one has fewer"
