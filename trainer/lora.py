"""LoRA adapters for model.py's Transformer, saved and loaded in PEFT's format.

The base weights are frozen (kept in their own dtype: bf16 in bf16 runs, never in the optimizer);
each targeted projection gets a trainable fp32 pair A (r, in), B (out, r), and computes

    y = x W^T + b + dropout(x) A^T B^T * alpha / r

model.py fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj`, so those modules
carry one adapter pair per part (q, k, v; gate, up), and the parts' outputs are concatenated
along the output like the fused weight's rows. That is exactly PEFT's LoRA on the separate HF
modules, so an adapter saved here loads into `peft.PeftModel` on the HF model (and back).

    from trainer import lora
    model = Transformer.from_pretrained(path)
    lora.apply(model, cfg.model)                 # cfg.model.lora_rank > 0; only adapters train
    lora.save_adapter(model, "ckpt/adapter", base_path=path)   # adapter_config.json + safetensors
    lora.load_adapter(model, "ckpt/adapter")     # resume (or start from a PEFT adapter)
    model.save_pretrained("hf", state_dict=lora.merged_state_dict(model))   # merged HF weights

Rollouts sample merged weights: policy_sampler.PolicySampler.refresh writes merged_weight(W,
layer.delta_weight()) = W + scale B A into its inference copy (plain matmuls for decoding); the
trained model itself always keeps W and its adapters apart.

    python bench/lora_memory.py configs/skyrl_sql_7b_lora.yaml   # per-device memory of LoRA vs full fine-tune

Tests: .venv/bin/pytest tests/test_lora.py -q (PEFT parity when peft is installed).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from trainer.config_checks import LORA_TARGETS, lora_targets

TARGETS = LORA_TARGETS  # q, k, v, o, gate, up, down
HF_MODULE = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
             "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj"}
PEFT_PREFIX = "base_model.model.model."  # PeftModel(CausalLM).model.layers... as PEFT saves it


# -----------------------------------------------------------------------------
# config


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]  # subset of TARGETS, in TARGETS order

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, model_cfg) -> "LoraSpec":
        """From config.ModelConfig's lora_* keys, with errors naming the key."""
        targets = lora_targets(model_cfg)
        if model_cfg.lora_rank <= 0:
            raise ValueError(f"model.lora_rank must be > 0 for LoRA, got {model_cfg.lora_rank}")
        if model_cfg.lora_alpha <= 0:
            raise ValueError(f"model.lora_alpha must be > 0, got {model_cfg.lora_alpha}")
        if not 0.0 <= model_cfg.lora_dropout < 1.0:
            raise ValueError(f"model.lora_dropout must be in [0, 1), got {model_cfg.lora_dropout}")
        return cls(int(model_cfg.lora_rank), float(model_cfg.lora_alpha), float(model_cfg.lora_dropout), targets)


# -----------------------------------------------------------------------------
# the adapted linear layer


class LoraLinear(nn.Linear):
    """nn.Linear whose output rows are split into named parts, some with a LoRA pair.

    Keeps the base's `weight`/`bias` under their names (so model.state_dict() still holds the
    base tensors where model.py expects them) and adds `lora_A.<part>` (r, in) and
    `lora_B.<part>` (part_rows, r), fp32. Built from an existing nn.Linear by `wrap`.
    """

    @classmethod
    def wrap(cls, base: nn.Linear, parts: list[tuple[str, int]], spec: LoraSpec) -> "LoraLinear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = base.in_features, base.out_features
        layer.weight, layer.bias = base.weight, base.bias  # the same Parameters: no copy
        assert sum(n for _, n in parts) == base.out_features, (parts, base.out_features)
        layer.parts = parts  # [(name, rows)] in output order, e.g. [("q", H D), ("k", Hk D), ("v", Hk D)]
        layer.scaling = spec.scaling
        layer.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        dev = base.weight.device
        layer.lora_A = nn.ParameterDict({
            name: nn.Parameter(torch.empty(spec.rank, base.in_features, device=dev, dtype=torch.float32))
            for name, _ in parts if name in spec.targets})
        layer.lora_B = nn.ParameterDict({
            name: nn.Parameter(torch.zeros(rows, spec.rank, device=dev, dtype=torch.float32))
            for name, rows in parts if name in spec.targets})
        if dev.type != "meta":
            layer.reset_adapters()
        return layer

    @torch.no_grad()
    def reset_adapters(self):
        """PEFT's init: A as nn.Linear's default (kaiming uniform), B = 0, so the delta is 0."""
        for a in self.lora_A.values():
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        for b in self.lora_B.values():
            b.zero_()

    def forward(self, x):  # x (..., in) -> (..., out)
        y = F.linear(x, self.weight, self.bias)
        # PEFT draws one dropout mask per HF module; the fused parts share x, hence one mask here
        # (each part's mask has the same distribution; only their correlation differs)
        h = self.lora_dropout(x)
        deltas = []
        for name, rows in self.parts:
            if name in self.lora_A:  # fp32 params cast to the compute dtype (FSDP2 mp does it already)
                a, b = self.lora_A[name], self.lora_B[name]
                deltas.append(F.linear(F.linear(h, a.to(h.dtype)), b.to(h.dtype)) * self.scaling)
            else:
                deltas.append(y.new_zeros(*y.shape[:-1], rows))
        return y + (deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1))

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """(out, in) fp32: scaling * B A per part, zero rows for untargeted parts."""
        return part_delta(self.parts, self.lora_A, self.lora_B, self.scaling, self.in_features, self.weight.device)

    def extra_repr(self):
        return (f"{self.in_features}, {self.out_features}, parts={[p for p, _ in self.parts]}, "
                f"lora={list(self.lora_A)}, scaling={self.scaling:g}")


# -----------------------------------------------------------------------------
# applying to a model


def _part_rows(model) -> dict[str, list[tuple[str, int]]]:
    a = model.config
    q, kv, i = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim, a.intermediate_size
    return {"self_attn.qkv_proj": [("q", q), ("k", kv), ("v", kv)],
            "self_attn.o_proj": [("o", a.hidden_size)],
            "mlp.gate_up_proj": [("gate", i), ("up", i)], "mlp.down_proj": [("down", a.hidden_size)]}


def apply(model, model_cfg) -> LoraSpec:
    """Freeze every parameter of `model`, then swap in LoraLinear where lora_targets asks.

    On the meta device the adapters are meta too: after to_empty, call reset_adapters on each
    of lora_layers(model) (or load an adapter).
    model_cfg: config.ModelConfig (or anything with the lora_* attributes). Returns the spec.
    """
    spec = LoraSpec.from_config(model_cfg)
    if lora_layers(model):
        raise ValueError("LoRA is already applied to this model")
    for p in model.parameters():
        p.requires_grad_(False)
    rows = _part_rows(model)
    for block in model.layers:
        for path, parts in rows.items():
            if not any(name in spec.targets for name, _ in parts):
                continue
            parent_name, child = path.split(".")
            parent = getattr(block, parent_name)
            setattr(parent, child, LoraLinear.wrap(getattr(parent, child), parts, spec))
    model.lora_spec = spec
    return spec


def lora_layers(model) -> dict[str, LoraLinear]:
    """{module name: layer}, e.g. "layers.0.self_attn.qkv_proj"."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """Only the adapters, in this model's names (…qkv_proj.lora_A.q)."""
    return {k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}


# -----------------------------------------------------------------------------
# merging: the one formula, for the sampler's weights (trainer/policy_sampler.py) and merged HF exports


def part_delta(parts, lora_A, lora_B, scaling: float, in_features: int, device) -> torch.Tensor:
    """(out, in) fp32 scaling * B A of a fused module's parts, zero rows for untargeted parts.
    parts: [(name, rows)] in output order; lora_A[name] (r, in), lora_B[name] (rows, r)."""
    rows = []
    for name, n in parts:
        if name in lora_A:
            rows.append(lora_B[name].float().to(device) @ lora_A[name].float().to(device) * scaling)
        else:
            rows.append(torch.zeros(n, in_features, device=device))
    return torch.cat(rows, 0)


def merged_weight(weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """W + delta in fp32, rounded once to W's dtype (bf16: one rounding, not two)."""
    return (weight.float() + delta).to(weight.dtype)


@torch.no_grad()
def merged_state_dict(model, state_dict=None) -> dict[str, torch.Tensor]:
    """Base names only (what model.save_pretrained writes), weights with the adapters merged.

    state_dict: a full state dict of the LoRA model (e.g. FSDP2's get_model_state_dict with
    full_state_dict=True); default model.state_dict(). The model itself is left unchanged.
    """
    sd = dict(model.state_dict() if state_dict is None else state_dict)
    for name, layer in lora_layers(model).items():
        w = sd[f"{name}.weight"]
        a = {part: sd.pop(f"{name}.lora_A.{part}") for part in layer.lora_A}
        b = {part: sd.pop(f"{name}.lora_B.{part}") for part in layer.lora_B}
        sd[f"{name}.weight"] = merged_weight(w, part_delta(layer.parts, a, b, layer.scaling, w.shape[1], w.device))
    return sd


# -----------------------------------------------------------------------------
# PEFT format: adapter_config.json + adapter_model.safetensors


def _to_peft_name(ours: str) -> str:
    """layers.3.self_attn.qkv_proj.lora_A.q -> base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"""
    layer, rest = ours.split(".self_attn.", 1) if ".self_attn." in ours else ours.split(".mlp.", 1)
    kind, part = rest.split(".")[-2:]  # lora_A|lora_B, q|k|...
    return f"{PEFT_PREFIX}{layer}.{HF_MODULE[part]}.{kind}.weight"


def save_adapter(model, folder, base_path: str = "", state_dict=None):
    """Write `folder`/adapter_config.json + adapter_model.safetensors (PEFT's layout and names).

    state_dict: the model's full state dict (e.g. from FSDP2, on rank 0); default model's own.
    base_path: recorded as base_model_name_or_path (PEFT reads it to find the base model).
    """
    spec = model.lora_spec
    sd = adapter_state_dict(model) if state_dict is None else \
        {k: v for k, v in state_dict.items() if ".lora_A." in k or ".lora_B." in k}
    tensors = {_to_peft_name(k): v.detach().to("cpu", torch.float32).contiguous() for k, v in sd.items()}
    os.makedirs(folder, exist_ok=True)
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_path),
           "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
           "target_modules": sorted(HF_MODULE[t].split(".")[1] for t in spec.targets),
           "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "use_rslora": False,
           "use_dora": False, "modules_to_save": None, "inference_mode": True}
    tmp = os.path.join(folder, "adapter_model.safetensors.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(folder, "adapter_model.safetensors"))  # no half-written file
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def read_adapter(model, folder) -> dict[str, torch.Tensor]:
    """A PEFT adapter folder -> adapter state dict in this (LoRA-applied) model's names.

    Checks the folder's rank, alpha and targets against the model's spec and every tensor's
    name and shape; raises ValueError naming what differs.
    """
    cfg_file, w_file = (os.path.join(folder, f) for f in ("adapter_config.json", "adapter_model.safetensors"))
    if not (os.path.isfile(cfg_file) and os.path.isfile(w_file)):
        raise ValueError(f"{folder!r} is not a PEFT adapter folder (needs adapter_config.json "
                         "and adapter_model.safetensors)")
    with open(cfg_file) as f:
        cfg = json.load(f)
    spec = model.lora_spec
    targets = cfg.get("target_modules")
    targets = sorted([targets] if isinstance(targets, str) else targets or [])
    want = {"peft_type": "LORA", "r": spec.rank, "lora_alpha": spec.alpha,
            "target_modules": sorted(HF_MODULE[t].split(".")[1] for t in spec.targets),
            "use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}}
    have = {**cfg, "target_modules": targets, "r": cfg.get("r", 8), "lora_alpha": cfg.get("lora_alpha", 8), "use_rslora": cfg.get("use_rslora", False),
            "use_dora": cfg.get("use_dora", False), "rank_pattern": cfg.get("rank_pattern") or {},
            "alpha_pattern": cfg.get("alpha_pattern") or {}}
    diff = [f"{k}: folder {have.get(k)!r} vs model {v!r}" for k, v in want.items()
            if (float(have.get(k)) != float(v) if k == "lora_alpha" else have.get(k) != v)]
    if diff:
        raise ValueError(f"adapter {folder!r} does not match this model's LoRA config:\n  " + "\n  ".join(diff))
    ours = adapter_state_dict(model)
    by_peft = {_to_peft_name(k): k for k in ours}
    file_sd = load_file(w_file)
    file_sd = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
               for k, v in file_sd.items()}
    missing, unexpected = sorted(set(by_peft) - set(file_sd)), sorted(set(file_sd) - set(by_peft))
    bad = [f"{k}: file {tuple(file_sd[k].shape)} vs model {tuple(ours[by_peft[k]].shape)}"
           for k in sorted(set(file_sd) & set(by_peft)) if file_sd[k].shape != ours[by_peft[k]].shape]
    if missing or unexpected or bad:
        raise ValueError(f"adapter {folder!r} does not fit this model:"
                         + (f"\n  missing: {missing[:4]}{' ...' if len(missing) > 4 else ''}" if missing else "")
                         + (f"\n  unexpected: {unexpected[:4]}" if unexpected else "")
                         + (f"\n  shape mismatches: {bad[:4]}" if bad else ""))
    return {by_peft[k]: v.to(torch.float32) for k, v in file_sd.items()}


@torch.no_grad()
def load_adapter(model, folder):
    """Copy a PEFT adapter folder into the model's adapters (unsharded model; under FSDP2 pass
    read_adapter's dict to set_model_state_dict instead)."""
    sd = read_adapter(model, folder)
    params = dict(model.named_parameters())
    for k, v in sd.items():
        params[k].copy_(v)
