"""model.py against transformers as the reference.

Random tiny models of each family are built by transformers itself (all with GQA), saved, and
loaded with our Transformer: logits, save round trip, paged KV-cache decoding, logprobs, activation
checkpointing and config errors. Run: .venv/bin/pytest tests/test_model.py -q
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from engine.block_manager import BlockManager
from model import Transformer
from engine.paged_attention import PagedBatch, PagedKVCache

V = 97
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CONFIGS = {
    "qwen2_tied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen2_untied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=False),
    "llama": lambda: LlamaConfig(**COMMON),
    "llama3_scaled": lambda: LlamaConfig(**COMMON, rope_theta=500000.0, rope_scaling=dict(LLAMA3)),
}


def build_hf(name, folder, **save_kw):
    """A transformers model with every parameter perturbed (norms != 1, biases != 0), saved."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(folder, **save_kw)
    return hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {n: (build_hf(n, root / n), root / n) for n in CONFIGS}


def ids_for(B=3, T=33, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def maxdiff(a, b):
    return (a - b).abs().max().item()


# -----------------------------------------------------------------------------
# logits against transformers


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(models, name):
    hf, folder = models[name]
    ours = Transformer.from_pretrained(folder)
    assert ours.config.model_type == hf.config.model_type
    x = ids_for()
    with torch.no_grad():
        assert maxdiff(ours(x), hf(x).logits) <= 1e-4


def test_tied_embeddings_share_one_parameter(models):
    ours = Transformer.from_pretrained(models["qwen2_tied"][1])
    assert ours.lm_head.weight is ours.embed_tokens.weight
    assert not ours.config.qk_norm and ours.config.qkv_bias and not ours.config.o_bias
    untied = Transformer.from_pretrained(models["qwen2_untied"][1])
    assert untied.lm_head.weight is not untied.embed_tokens.weight


def test_llama3_scaling_is_applied(models):
    """Without the scaling the logits must differ: the llama3 test above can fail."""
    hf, folder = models["llama3_scaled"]
    ours = Transformer.from_pretrained(folder)
    ours.config.rope_scaling = None
    ours._inv_freq.clear()
    x = ids_for()
    with torch.no_grad():
        assert maxdiff(ours(x), hf(x).logits) > 1e-3


def test_hub_style_config_spelling(models, tmp_path):
    """Hub files use top-level rope_theta / rope_scaling and torch_dtype."""
    hf, folder = models["llama3_scaled"]
    cfg = json.loads((folder / "config.json").read_text())
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    cfg["rope_scaling"] = rp
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    os.symlink(folder / "model.safetensors", tmp_path / "model.safetensors")
    ours = Transformer.from_pretrained(tmp_path)
    x = ids_for()
    with torch.no_grad():
        assert maxdiff(ours(x), hf(x).logits) <= 1e-4


def test_sharded_checkpoint_loads(tmp_path):
    hf = build_hf("qwen3", tmp_path, max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    x = ids_for()
    with torch.no_grad():
        assert maxdiff(Transformer.from_pretrained(tmp_path)(x), hf(x).logits) <= 1e-4


def test_bf16_load(models):
    hf, folder = models["qwen3"]
    ours = Transformer.from_pretrained(folder, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    x = ids_for()
    with torch.no_grad():
        out = ours(x)
        assert out.dtype == torch.bfloat16
        assert maxdiff(out.float(), hf(x).logits) < 0.5  # loose: bf16 rounding only


# -----------------------------------------------------------------------------
# our save -> transformers load


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_pretrained_loads_in_transformers(models, name, tmp_path):
    hf, folder = models[name]
    Transformer.from_pretrained(folder).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in sd) == (not hf.config.tie_word_embeddings)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    x = ids_for()
    with torch.no_grad():
        assert maxdiff(back(x).logits, hf(x).logits) <= 1e-5


def test_save_pretrained_sharded(models, tmp_path):
    hf, folder = models["qwen2_untied"]
    Transformer.from_pretrained(folder).save_pretrained(tmp_path, max_shard_bytes=20_000)
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 10
    x = ids_for()
    with torch.no_grad():
        ref = hf(x).logits
        assert maxdiff(Transformer.from_pretrained(tmp_path)(x), ref) <= 1e-5
        back = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
        assert maxdiff(back(x).logits, ref) <= 1e-5


# -----------------------------------------------------------------------------
# paged KV cache


class Paged:
    """A paged cache driven by hand: per-row block tables from a BlockManager whose free blocks
    are shuffled (rows' blocks interleave in the pool), chunks fed right padded."""

    def __init__(self, m, rows, block_size=4, n_blocks=64, dtype=torch.float32, seed=0):
        self.m, self.bs = m, block_size
        self.blocks = BlockManager(n_blocks, block_size)
        order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.blocks.free = [self.blocks.free[i] for i in order]
        self.cache = PagedKVCache.for_model(m, n_blocks, block_size, dtype)
        self.tables, self.cached = [[] for _ in range(rows)], [0] * rows

    def feed(self, x, lens=None):
        """x (B, T) right padded; lens[b] real tokens of row b (0: the row is untouched) -> (B, T, V)."""
        B, T = x.shape
        lens = [T] * B if lens is None else lens
        c = self.cache
        pos = torch.tensor([[self.cached[b] + t for t in range(T)] for b in range(B)])
        slots = torch.full((B, T), c.scratch * self.bs)
        for b in range(B):
            self.blocks.grow(self.tables[b], self.cached[b], self.cached[b] + lens[b])
            for t in range(lens[b]):
                p = self.cached[b] + t
                slots[b, t] = self.tables[b][p // self.bs] * self.bs + p % self.bs
        copies = self.blocks.pending_copies()
        if copies:
            c.copy_blocks(*torch.tensor(copies).unbind(1))
        width = max(1, max(map(len, self.tables)))
        table = torch.tensor([t + [c.scratch] * (width - len(t)) for t in self.tables])
        out = self.m.forward_paged(x, pos, PagedBatch(c, slots, table))
        self.cached = [n + k for n, k in zip(self.cached, lens)]
        return out


@pytest.mark.parametrize("name", ["qwen2_tied", "qwen3", "llama3_scaled"])
def test_prefill_then_decode_equals_full_forward(models, name):
    m = Transformer.from_pretrained(models[name][1])
    x = ids_for(T=30)
    cache = Paged(m, rows=3)
    with torch.no_grad():
        full = m(x)
        steps = [cache.feed(x[:, :11])] + [cache.feed(x[:, t:t + 1]) for t in range(11, 30)]
    assert maxdiff(torch.cat(steps, 1), full) <= 1e-4
    assert cache.cached == [30, 30, 30]


def test_fresh_prefill_path_equals_full_forward(models):
    """No cached tokens in any row (block_tables None): causal attention within the right-padded
    chunk, K/V written for the next steps."""
    m = Transformer.from_pretrained(models["qwen2_tied"][1])
    x = ids_for(T=13)
    cache = Paged(m, rows=3)
    lens = [13, 7, 10]
    slots = torch.full((3, 13), cache.cache.scratch * cache.bs)
    for b in range(3):
        cache.blocks.grow(cache.tables[b], 0, lens[b])
        slots[b, :lens[b]] = torch.tensor([cache.tables[b][p // 4] * 4 + p % 4 for p in range(lens[b])])
    with torch.no_grad():
        out = m.forward_paged(x, torch.arange(13)[None].expand(3, -1), PagedBatch(cache.cache, slots, None))
        cache.cached = lens
        nxt = cache.feed(x[:, :1])[:, 0]
        for b in range(3):
            ref = m(torch.cat([x[b:b + 1, :lens[b]], x[b:b + 1, :1]], 1))[0]
            assert maxdiff(out[b, :lens[b]], ref[:lens[b]]) <= 1e-4 and maxdiff(nxt[b], ref[-1]) <= 1e-4


@pytest.mark.parametrize("name", ["qwen3", "qwen2_tied"])  # RoPE on q, k apart (qk-norm) / fused
def test_ragged_chunks_equal_per_row_forward(models, name):
    """Right-padded chunks at different cache positions; a row with chunk length 0 is untouched."""
    m = Transformer.from_pretrained(models[name][1])
    x = ids_for(B=3, T=40, seed=3)
    chunks = [[12, 5, 0], [3, 9, 7], [1, 0, 1], [4, 8, 2]]  # tokens appended per row per call
    total = [sum(c[b] for c in chunks) for b in range(3)]
    cache = Paged(m, rows=3)
    got = [[] for _ in range(3)]
    pos = [0, 0, 0]
    with torch.no_grad():
        for lens in chunks:
            T = max(lens)
            inp = torch.zeros(3, T, dtype=torch.long)  # pad id 0: padded slots hold garbage
            for b in range(3):
                inp[b, :lens[b]] = x[b, pos[b]:pos[b] + lens[b]]
            before = cache.cache.k.clone()
            out = cache.feed(inp, lens)
            assert out.shape == (3, T, V)
            for b in range(3):
                got[b].append(out[b, :lens[b]])
                pos[b] += lens[b]
            assert cache.cached == pos
            for b in range(3):
                if lens[b] == 0:  # untouched row: its blocks are byte-identical
                    assert torch.equal(cache.cache.k[:, cache.tables[b]], before[:, cache.tables[b]])
        for b in range(3):
            ref = m(x[b:b + 1, :total[b]])[0]
            assert maxdiff(torch.cat(got[b]), ref) <= 1e-4


def test_shared_prompt_blocks_for_group_samples(models):
    """4 samples share one prefilled prompt's blocks (reference counts); each copies the partly
    filled last block before writing into it, so they decode apart and the prompt is unchanged."""
    m = Transformer.from_pretrained(models["llama"][1])
    prompt = ids_for(B=1, T=9, seed=4)
    cont = ids_for(B=4, T=6, seed=5)  # 4 different continuations of one prompt
    cache = Paged(m, rows=1)
    with torch.no_grad():
        cache.feed(prompt)
        source = cache.tables[0]
        shared = list(source)
        before = cache.cache.k[:, shared].clone()
        cache.tables = [cache.blocks.share(source) for _ in range(4)]
        cache.blocks.release(source)  # the source row leaves; its blocks stay held by the 4
        cache.cached = [9] * 4
        assert cache.blocks.refs[shared[0]] == 4 and cache.blocks.num_used == 3
        out = torch.cat([cache.feed(cont[:, t:t + 1]) for t in range(6)], 1)
        full = m(torch.cat([prompt.expand(4, -1), cont], 1))[:, 9:]
    assert maxdiff(out, full) <= 1e-4
    assert [t[:2] for t in cache.tables] == [shared[:2]] * 4  # full prompt blocks still shared
    assert len({t[2] for t in cache.tables}) == 4  # the partly filled block: one copy each (last one in place)
    assert torch.equal(cache.cache.k[:, shared[:2]], before[:, :2])


def test_cache_in_other_dtype_than_compute(models):
    """FSDP2 mixed precision: fp32 params, bf16 compute; a cache of another dtype still works."""
    m = Transformer.from_pretrained(models["qwen2_tied"][1])
    x = ids_for(T=12)
    cache = Paged(m, rows=3, dtype=torch.bfloat16)
    assert cache.cache.k.dtype == torch.bfloat16
    with torch.no_grad():
        out = torch.cat([cache.feed(x[:, :5])] + [cache.feed(x[:, t:t + 1]) for t in range(5, 12)], 1)
        assert out.dtype == torch.float32 and maxdiff(out, m(x)) < 0.05


# -----------------------------------------------------------------------------
# logprobs, entropy, gradients


def test_targets_logprobs_and_entropy(models):
    m = Transformer.from_pretrained(models["qwen2_untied"][1])
    x, tgt = ids_for(T=21), ids_for(T=21, seed=7)
    m.logits_chunk_elems = 5 * 3 * V  # force 5 chunks over T
    for temp in (1.0, 0.6):
        logits = m(x).float() / temp
        ref_lp = torch.log_softmax(logits, -1).gather(-1, tgt[..., None])[..., 0]
        ref_ent = torch.distributions.Categorical(logits=logits).entropy()
        lp, ent = m(x, targets=tgt, temperature=temp)
        assert lp.shape == ent.shape == (3, 21)
        assert maxdiff(lp, ref_lp) <= 1e-5 and maxdiff(ent, ref_ent) <= 1e-5
        (g_ref,) = torch.autograd.grad(ref_lp.sum(), m.norm.weight)
        (g,) = torch.autograd.grad(lp.sum(), m.norm.weight)
        assert maxdiff(g, g_ref) <= 1e-5


def test_activation_checkpointing_same_gradients(models):
    m = Transformer.from_pretrained(models["qwen3"][1]).train()
    x, tgt = ids_for(T=17), ids_for(T=17, seed=8)
    grads = []
    for on in (False, True):
        m.set_activation_checkpointing(on)
        m.zero_grad()
        lp, _ = m(x, targets=tgt)
        lp.mean().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert maxdiff(grads[0][n], grads[1][n]) <= 1e-6, n


# -----------------------------------------------------------------------------
# clear errors


def copy_folder(src, dst, cfg_edit=None, drop=None):
    cfg = json.loads((src / "config.json").read_text())
    if cfg_edit:
        cfg.update(cfg_edit)
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = load_file(src / "model.safetensors")
    if drop:
        del sd[drop]
    save_file(sd, dst / "model.safetensors")


def test_error_unsupported_model_type(models, tmp_path):
    copy_folder(models["llama"][1], tmp_path, {"model_type": "gpt2"})
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        Transformer.from_pretrained(tmp_path)


def test_error_missing_tensor(models, tmp_path):
    copy_folder(models["qwen2_untied"][1], tmp_path, drop="model.layers.1.self_attn.k_proj.bias")
    with pytest.raises(ValueError, match=r"missing tensors: \['model.layers.1.self_attn.k_proj.bias'\]"):
        Transformer.from_pretrained(tmp_path)


def test_error_shape_mismatch_and_unexpected(models, tmp_path):
    copy_folder(models["llama"][1], tmp_path, {"intermediate_size": 64})
    with pytest.raises(ValueError, match=r"shape mismatches: .*layers.0.mlp.down_proj.weight: file \(64, 96\)"):
        Transformer.from_pretrained(tmp_path)
    copy_folder(models["qwen3"][1], tmp_path, {"model_type": "llama"})  # q_norm/k_norm left over
    with pytest.raises(ValueError, match="unexpected tensors: .*q_norm"):
        Transformer.from_pretrained(tmp_path)


def test_error_missing_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        Transformer.from_pretrained(tmp_path)
