"""Per-device memory of a config's LoRA run next to its full fine-tune, for 1/2/4/8 devices
(trainer/memory.memory_estimate on the model built on the meta device from model.path's
config.json: nothing else is read, so a 7B config runs anywhere).

    .venv/bin/python bench/lora_memory.py configs/skyrl_sql_7b_lora.yaml [--world=2]

Tests: tests/test_lora.py (the README's 53.7 vs 102.8 GB at 2 devices).
"""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import config as C  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from trainer import lora, memory  # noqa: E402


def main(argv=None):
    """Print the per-device memory of a config's LoRA run next to its full fine-tune."""
    argv = list(sys.argv[1:] if argv is None else argv)
    worlds = [int(a.split("=", 1)[1]) for a in argv if a.startswith("--world=")] or [1, 2, 4, 8]
    cfg = C.load_config([a for a in argv if not a.startswith("--world=")])
    path = os.path.join(cfg.model.path, "config.json")
    if not os.path.isfile(path):
        sys.exit(f"error: {path} not found: model.path must be a local HF folder (only config.json is read)")
    with open(path) as f, torch.device("meta"):
        model = Transformer(ModelArgs.from_hf(json.load(f)))
    # one estimate for both layouts (memory.memory_estimate): frozen parameters count once in
    # the compute dtype with no grads or AdamW moments, so the same call after apply() is LoRA's
    full_by_world = {w: memory.memory_estimate(model, cfg, w) for w in worlds}  # before LoRA
    spec = lora.apply(model, cfg.model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"LoRA rank {spec.rank}, alpha {spec.alpha:g}, targets {','.join(spec.targets)}")
    for world, full in full_by_world.items():
        lo = memory.memory_estimate(model, cfg, world)
        print(f"world {world}: full fine-tune {full['total']:.1f} GB/device, LoRA {lo['total']:.1f} GB/device "
              f"(weights+grads+adam {lo['params'] + lo['grads'] + lo['adam']:.1f} vs "
              f"{full['params'] + full['grads'] + full['adam']:.1f}; trainable {trainable / 1e6:.1f}M "
              f"of {total / 1e9:.2f}B)")


if __name__ == "__main__":
    main()
