"""Hugging Face model folders: load one into a model.Transformer, save one that transformers loads.

A folder is config.json + model.safetensors, or shards listed in model.safetensors.index.json.
Loading builds the model on the meta device and assigns the tensors read from the files
(`assign=True`), so a 7B model is never materialised twice; tensors are checked against the
config in HF's names (missing, unexpected, wrong shape: one error listing all). Our modules fuse
q/k/v into qkv_proj and gate/up into gate_up_proj (one matmul each): from_hf / to_hf are the only
name mapping. Saving streams one shard at a time and replaces the files atomically.

    model = Transformer.from_pretrained("runs/tiny/model", dtype=torch.bfloat16, device="cuda")  # hf_folder.load
    model.save_pretrained("out/hf", state_dict=None)                                            # hf_folder.save
This file knows the folder format and HF's names; model.py knows the model (it imports this file,
never the other way round: `load` gets a function that builds the model from config.json's dict,
and reads model.config, a model.ModelArgs, for the shapes).
Tests: .venv/bin/pytest tests/test_model.py (round trips against transformers).
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def load(path, build, dtype=None, device=None):
    """The model of an HF folder; build(config.json's dict) -> the model (on the meta device here;
    Transformer.from_pretrained passes Transformer.from_hf_config); dtype: default the
    folder's (float32 when unspecified)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"no config.json in {path!r}: not a Hugging Face model folder")
    with open(cfg_file) as f:
        hf = json.load(f)
    if dtype is None:  # the folder's dtype (float32 when unspecified)
        name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        dtype = getattr(torch, name) if isinstance(name, str) else name
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    device = torch.device(device or "cpu")
    with torch.device("meta"):
        model = build(hf)
    args = model.config
    # validate in HF names (what the user sees in the folder), then fuse
    want = {k: t.shape for k, t in to_hf(model.state_dict(), args)}  # meta: no memory
    hf_sd = _read_safetensors(path, dtype, device)
    if args.tie_word_embeddings:
        hf_sd.pop("lm_head.weight", None)  # some tied checkpoints store it anyway
    missing = sorted(set(want) - set(hf_sd))
    unexpected = sorted(set(hf_sd) - set(want))
    bad = [f"{k}: file {tuple(hf_sd[k].shape)} vs config {tuple(want[k])}"
           for k in sorted(set(hf_sd) & set(want)) if hf_sd[k].shape != want[k]]
    if missing or unexpected or bad:
        raise ValueError(f"checkpoint {str(path)!r} does not match its config.json:"
                         + (f"\n  missing tensors: {missing}" if missing else "")
                         + (f"\n  unexpected tensors: {unexpected}" if unexpected else "")
                         + (f"\n  shape mismatches: {bad}" if bad else ""))
    sd = from_hf(hf_sd, args)
    model.load_state_dict(sd, strict=False, assign=True)
    if args.tie_word_embeddings:  # assign replaced the parameter objects: tie again
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def save(model, path, state_dict=None, max_shard_bytes: int = 4 << 30) -> None:
    """Write config.json + model.safetensors (sharded with an index above max_shard_bytes).
    state_dict: a full state dict in the model's names (e.g. from FSDP2's
    get_model_state_dict(full_state_dict=True)); default model.state_dict() (an unsharded model)."""
    sd = model.state_dict() if state_dict is None else state_dict
    os.makedirs(path, exist_ok=True)
    for fn in os.listdir(path):  # stale weights of an earlier save (other shard layout)
        if fn.startswith("model") and fn.endswith((".safetensors", ".safetensors.index.json")):
            os.remove(os.path.join(path, fn))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf(sd["embed_tokens.weight"].dtype), f, indent=2)
    shards, cur, size = [], {}, 0  # stream: only one shard's split copies alive at a time
    for name, t in to_hf(sd, model.config):
        cur[name] = t.detach().to("cpu").contiguous()
        size += t.numel() * t.element_size()
        if size >= max_shard_bytes:
            shards.append(_flush(path, cur, len(shards)))
            cur, size = {}, 0
    if cur or not shards:
        shards.append(_flush(path, cur, len(shards)))
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for (tmp, _), final in zip(shards, names):
        os.replace(os.path.join(path, tmp), os.path.join(path, final))
    if len(shards) > 1:
        wmap = {k: final for (_, keys), final in zip(shards, names) for k in keys}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": wmap}, f, indent=2)


# -----------------------------------------------------------------------------
# HF name mapping: strip "model.", fuse q/k/v -> qkv_proj and gate/up -> gate_up_proj


def _flush(path, tensors, i):
    name = f".shard{i}.safetensors.tmp"
    save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
    return name, list(tensors)


def _read_safetensors(path, dtype, device) -> dict:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path!r}")
    out = {}
    for fn in files:
        with safe_open(os.path.join(path, fn), framework="pt", device="cpu") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k).to(device=device, dtype=dtype)
    return out


def from_hf(hf: dict, a) -> dict:
    """HF names -> ours (input already validated against the config)."""
    sd = {(k[6:] if k.startswith("model.") else k): v for k, v in hf.items()}
    for i in range(a.num_hidden_layers):
        for kind in ("weight", "bias"):
            p = f"layers.{i}.self_attn."
            if f"{p}q_proj.{kind}" in sd:
                sd[f"{p}qkv_proj.{kind}"] = torch.cat([sd.pop(f"{p}{x}_proj.{kind}") for x in "qkv"], 0)
            p = f"layers.{i}.mlp."
            if f"{p}gate_proj.{kind}" in sd:
                sd[f"{p}gate_up_proj.{kind}"] = torch.cat([sd.pop(f"{p}{x}_proj.{kind}") for x in ("gate", "up")], 0)
    return sd


def to_hf(sd: dict, a):
    """Yield (hf_name, tensor); fused tensors are split into separate copies; tied lm_head dropped."""
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    for k, t in sd.items():
        if k == "lm_head.weight":
            if not a.tie_word_embeddings:
                yield k, t
        elif ".qkv_proj." in k:
            for x, part in zip("qkv", t.split([q, kv, kv], 0)):
                yield "model." + k.replace("qkv_proj", f"{x}_proj"), part.clone()
        elif ".gate_up_proj." in k:
            for x, part in zip(("gate", "up"), t.chunk(2, 0)):
                yield "model." + k.replace("gate_up_proj", f"{x}_proj"), part.clone()
        else:
            yield "model." + k, t
