"""Decoder-only transformer (Qwen2/Qwen2.5, Qwen3, Llama) in plain PyTorch, loaded from HF folders.

RMSNorm, RoPE (default or "llama3" scaling), GQA attention via scaled_dot_product_attention
(the sampler's over a paged KV cache: paged_attention.py), SwiGLU MLP. Loads a local
Hugging Face folder (config.json + model.safetensors or a sharded model.safetensors.index.json)
on the meta device with `assign=True`, so a 7B model is never materialised twice, and saves
folders that transformers loads with the same logits.

    from model import Transformer
    model = Transformer.from_pretrained("runs/tiny/model")
    logits = model(idx)                                        # (B, T) -> (B, T, V)
    logp, ent = model(idx, targets, temperature=0.6)           # (B, T), (B, T): training and scoring
    logits = model.forward_paged(idx, pos, PagedBatch(...))    # the sampler: over its paged KV cache

Two forwards, one per job. forward(idx, targets) is nanoGPT's, plus what packed training rows
need (trainer/packing.py: positions, the rows' attention from packed_attention.for_rows, loss_index);
it is the one FSDP2 hooks (always called as model(...)). forward_paged is the sampler's, on a
plain model (engine/: the inference copy of trainer/policy_sampler.py). Attention layers call
`attention.attend(q, k, v, layer)` on what the forward was given (None: plain causal SDPA).

Internally q/k/v and gate/up are fused (one matmul each: markedly faster decode);
the only difference from HF names is that fusion (trainer/hf_folder.py: `to_hf` / `from_hf`, loading and saving).
Tests: .venv/bin/pytest tests/test_model.py (checks against transformers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer import hf_folder
from engine import paged_attention

FAMILIES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


# -----------------------------------------------------------------------------
# config


@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3"|"linear", factor, ...} or None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # qwen2: always; llama/qwen3: attention_bias
    o_bias: bool = False  # llama/qwen3: attention_bias
    mlp_bias: bool = False  # llama only
    qk_norm: bool = False  # qwen3
    max_position_embeddings: int = 32768
    hf_config: dict = field(default_factory=dict)  # the raw config.json, kept for save_pretrained

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArgs":
        mt = cfg.get("model_type")
        if mt not in FAMILIES:
            raise ValueError(f"unsupported model_type {mt!r}; supported: {sorted(FAMILIES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
        if cfg.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported")
        # rope: transformers 5 writes rope_parameters (theta inside); Hub files top-level rope_theta
        rp = dict(cfg.get("rope_parameters") or {})
        theta = rp.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or rp
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if rope_type not in ("default", "llama3", "linear"):
            raise ValueError(f"unsupported rope type {rope_type!r} (default, llama3, linear)")
        scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
        heads = cfg["num_attention_heads"]
        attn_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=mt, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if mt == "qwen2" else attn_bias, o_bias=False if mt == "qwen2" else attn_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if mt == "llama" else False,
            qk_norm=mt == "qwen3", max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            hf_config=dict(cfg))

    def to_hf(self, dtype: torch.dtype) -> dict:
        """config.json contents (transformers 5 spelling: rope_parameters, dtype)."""
        cfg = {k: v for k, v in self.hf_config.items()
               if k not in ("rope_theta", "rope_scaling", "torch_dtype", "transformers_version")}
        rope = {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})}
        cfg.update(model_type=self.model_type, architectures=[FAMILIES[self.model_type]],
                   vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                   intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                   num_attention_heads=self.num_attention_heads,
                   num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                   rms_norm_eps=self.rms_norm_eps, rope_parameters=rope, hidden_act="silu",
                   tie_word_embeddings=self.tie_word_embeddings,
                   max_position_embeddings=self.max_position_embeddings,
                   dtype=str(dtype).removeprefix("torch."))
        if self.model_type != "qwen2":
            cfg["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            cfg["mlp_bias"] = self.mlp_bias
        return cfg


def rope_inv_freq(a: ModelArgs, device=None) -> torch.Tensor:
    """(head_dim/2,) fp32 inverse frequencies, as transformers computes them."""
    d = a.head_dim
    inv = 1.0 / (a.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    s = a.rope_scaling
    if s and s["rope_type"] == "linear":
        inv = inv / s["factor"]
    elif s and s["rope_type"] == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)  # long waves: divide by factor
        smooth = (old / wavelen - lo) / (hi - lo)  # medium waves: interpolate
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = torch.where(medium, smoothed, scaled)
    return inv


# -----------------------------------------------------------------------------
# layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):  # normalise in fp32 like HF, scale in the param dtype
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear; float16 on CPU multiplies in fp32 and rounds the output to fp16 once. That is what
    a GPU's fp16 GEMM computes (fp16 inputs, fp32 accumulation, an fp16 result), and CPUs without
    native fp16 matrix units (AVX512-FP16, AMX-FP16) have no fast fp16 kernel: torch's ran ~6x
    slower than fp32 on the 2-core AMD EPYC VM (4096x128 @ 128x384: 41 ms against 6.4). Every
    other dtype and device: nn.Linear unchanged."""

    def forward(self, x):
        if x.dtype != torch.float16 or x.device.type != "cpu":
            return super().forward(x)
        bias = self.bias.float() if self.bias is not None else None
        return F.linear(x.float(), self.weight.float(), bias).to(torch.float16)


def rotate(x, cos, sin):  # x (B, T, H, D); cos/sin (B, T, 1, D): HF's rotate_half convention
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer  # this layer's index in the sampler's paged KV cache
        self.h, self.hk, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.qkv_proj = Linear(a.hidden_size, (self.h + 2 * self.hk) * self.d, bias=a.qkv_bias)
        self.o_proj = Linear(self.h * self.d, a.hidden_size, bias=a.o_bias)
        if a.qk_norm:  # qwen3: RMSNorm over head_dim, per head, before RoPE
            self.q_norm, self.k_norm = RMSNorm(self.d, a.rms_norm_eps), RMSNorm(self.d, a.rms_norm_eps)
        self.qk_norm = a.qk_norm

    def forward(self, x, cos, sin, attention=None):
        """x (B, T, C). attention: None = plain causal; else a packed row's (trainer/packed_attention.py)
        or the sampler's paged cache (paged_attention.Plan): its attend(q, k, v, layer)."""
        B, T, _ = x.shape
        H, Hk, D = self.h, self.hk, self.d
        qkv = self.qkv_proj(x)  # (B, T, (H + 2 Hk) D)
        v = qkv[..., (H + Hk) * D:].view(B, T, Hk, D)
        if self.qk_norm:  # qwen3: per-head norms before RoPE, so q and k are rotated separately
            q, k = qkv[..., :H * D].view(B, T, H, D), qkv[..., H * D:(H + Hk) * D].view(B, T, Hk, D)
            q, k = rotate(self.q_norm(q), cos, sin), rotate(self.k_norm(k), cos, sin)
        else:  # q and k are adjacent in the fused projection: one RoPE over all H + Hk heads
            q, k = rotate(qkv[..., :(H + Hk) * D].view(B, T, H + Hk, D), cos, sin).split([H, Hk], 2)
        if attention is None:
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                               enable_gqa=True).transpose(1, 2)
        else:
            y = attention.attend(q, k, v, self.layer)  # (B, T, H, D)
        return self.o_proj(y.reshape(B, T, H * D).to(x.dtype))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_up_proj = Linear(a.hidden_size, 2 * a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a, layer)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)

    def forward(self, x, cos, sin, attention=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


# -----------------------------------------------------------------------------
# model


class Transformer(nn.Module):
    logits_chunk_elems = 1 << 25  # targets=: fp32 logits per chunk (~128 MB); tests lower it

    def __init__(self, config: ModelArgs):
        super().__init__()
        a = self.config = config
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a, i) for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.activation_checkpointing = False
        self.fp32_lm_head = False  # bf16/fp16 runs: the head's matmul and log-softmax in fp32 (config model.fp32_lm_head)
        self._inv_freq = {}  # device -> fp32 inv_freq; not a buffer, so .to(bf16) and meta never touch it

    def set_activation_checkpointing(self, enabled: bool):
        self.activation_checkpointing = bool(enabled)

    def _rope(self, positions, dtype):  # positions (B|1, T) -> cos, sin (B|1, T, 1, D)
        dev = positions.device
        if dev not in self._inv_freq:
            self._inv_freq[dev] = rope_inv_freq(self.config, dev)
        freqs = positions[..., None].float() * self._inv_freq[dev]  # (B, T, D/2) fp32, as HF
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, idx, targets=None, *, positions=None, attention=None, loss_index=None, temperature: float = 1.0):
        """idx (B, T) long. targets None: logits (B, T, V). targets (B, T): (logprobs of targets,
        entropy), each (B, T), of logits / temperature, in chunks over T so (B, T, V) fp32 logits
        are never all alive at once (7B vocab is 152k).

        Packed rows (packing.forward): positions (B, T) (a response continues its prompt's
        positions; default arange), attention (packed_attention.for_rows: who attends to whom;
        default causal), loss_index (N,): the flat positions b*T + t whose next token is scored;
        then targets is (N,), the LM head and log-softmax run on those N positions only ->
        logprobs, entropy (N,). A position may appear several times (a shared prompt's last
        token predicts G responses)."""
        B, T = idx.shape
        if positions is None:
            positions = torch.arange(T, device=idx.device)[None, :]
        h = self.embed_tokens(idx)  # (B, T, C)
        cos, sin = self._rope(positions, h.dtype)  # compute dtype (FSDP2 mixed precision: bf16)
        ckpt = self.activation_checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            if ckpt:
                h = checkpoint(layer, h, cos, sin, attention, use_reentrant=False)
            else:
                h = layer(h, cos, sin, attention)
        h = self.norm(h)
        if targets is None:
            return self.lm_head(h)
        if loss_index is not None:  # (N, C) hidden states of the loss positions only, as one row
            lp, ent = self._logprobs(h.reshape(B * T, -1)[loss_index][None], targets[None], temperature)
            # lp[0] would be a view: FSDP2 warns that an in-place op on a view output of the root
            # module drops its pre-backward hook. A copy of N floats is free.
            return lp[0].clone(), ent[0].clone()
        return self._logprobs(h, targets, temperature)

    def forward_paged(self, idx, positions, batch: paged_attention.PagedBatch, logits_at=None):
        """The sampler's forward over its paged KV cache (a plain model: engine/, cuda_graphs.py).
        idx, positions (B, T) long; token t of row b is written to slot batch.slots[b, t] and sees
        the row's cached tokens at positions <= positions[b, t]. -> logits (B, T, V), or with
        logits_at (B,) long only those at position logits_at[b] of each row, (B, V) (a prefill
        never builds (B, T, V) for long prompts and a 152k vocab)."""
        B, T = idx.shape
        plan = paged_attention.prepare(batch, positions)  # slots, masks: once for all layers
        h = self.embed_tokens(idx)
        cos, sin = self._rope(positions, h.dtype)
        with paged_attention.fused_attention_only(idx.device):
            for layer in self.layers:
                h = layer(h, cos, sin, plan)
        h = self.norm(h)
        if logits_at is not None:
            return self.lm_head(h[torch.arange(B, device=idx.device), torch.as_tensor(logits_at, device=idx.device)])
        return self.lm_head(h)

    def _logprobs(self, h, targets, temperature):
        """(logprobs, entropy), each (B, T), of logits/temperature, in chunks over T.

        Each chunk is recomputed in backward (checkpoint), so only one (B, chunk, V) fp32 block
        is alive at a time; a single chunk is not (nothing would be freed between chunks, and the
        recompute is a whole LM head forward: ~8% of the tiny model's update FLOPs). Entropy is a
        diagnostic: no gradient flows through it.
        """
        B, T, _ = h.shape
        chunk = max(1, self.logits_chunk_elems // max(1, B * self.config.vocab_size))
        lps, ents = [], []
        for s in range(0, T, chunk):
            args = (h[:, s:s + chunk], targets[:, s:s + chunk], temperature)
            if torch.is_grad_enabled() and chunk < T:
                lp, ent = checkpoint(self._chunk_logprobs, *args, use_reentrant=False)
            else:
                lp, ent = self._chunk_logprobs(*args)
            lps.append(lp)
            ents.append(ent)
        return torch.cat(lps, 1), torch.cat(ents, 1)

    def _chunk_logprobs(self, h, targets, temperature):
        if self.fp32_lm_head:  # bf16/fp16 hidden states and weight upcast: the matmul itself in fp32
            logits = F.linear(h.float(), self.lm_head.weight.float())
        else:
            logits = self.lm_head(h).float()
        logp = torch.log_softmax(logits / temperature, dim=-1)  # (B, c, V)
        lp = logp.gather(-1, targets[..., None]).squeeze(-1)
        with torch.no_grad():
            ent = -(logp.exp() * logp).sum(-1)
        return lp, ent

    # -------------------------------------------------------------------------
    # HF folders (trainer/hf_folder.py)

    @classmethod
    def from_hf_config(cls, hf: dict) -> "Transformer":
        """The model (uninitialised: on the current device, meta when loading) of an HF config.json's dict."""
        return cls(ModelArgs.from_hf(hf))

    @classmethod
    def from_pretrained(cls, path, dtype=None, device=None) -> "Transformer":
        """The model of a local HF folder (config.json + safetensors); dtype: default the folder's."""
        return hf_folder.load(path, cls.from_hf_config, dtype, device)

    def save_pretrained(self, path, state_dict=None, max_shard_bytes: int = 4 << 30):
        """Write an HF folder that transformers loads; state_dict: a full one (FSDP2), default ours."""
        hf_folder.save(self, path, state_dict, max_shard_bytes)
