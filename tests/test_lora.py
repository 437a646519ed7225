"""trainer/lora.py: LoRA on the fused projections, against PEFT on the transformers model as the reference.

Tiny random models of each family (qwen2 with q/k/v biases, qwen3 with q/k norms, llama) are
built by transformers; our LoRA-applied Transformer with random adapters is saved in PEFT's
format and loaded by `peft.PeftModel` (and a PEFT-made adapter by us): logits must agree.
Also: merged == adapter forward, only adapters train, dropout, save/load, errors, memory, and
FSDP2 sharding on 1 and 2 ranks (tests/lora_dist_check.py). The PEFT tests skip when peft is absent.

    .venv/bin/pytest tests/test_lora.py -q      (~30 s)
"""
import json
import re
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

import config as C
from trainer import memory
from trainer import lora
from conftest import ROOT, run_dist_check
from model import ModelArgs, Transformer

V = 97
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
FAMILIES = {"qwen2": lambda: Qwen2Config(**COMMON),  # q/k/v biases
            "qwen3": lambda: Qwen3Config(**COMMON, head_dim=24),  # q/k norms, head_dim != C/H
            "llama": lambda: LlamaConfig(**COMMON)}
ALL = "q,k,v,o,gate,up,down"
PEFT_MISSING = "peft not installed (pip install peft: a test-only dependency, see requirements-dev.txt)"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> saved transformers model with every parameter perturbed (biases, norms != 0/1)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, make in FAMILIES.items():
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(make(), attn_implementation="eager")
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        hf.save_pretrained(root / name)
        out[name] = root / name
    return out


def lora_cfg(targets=ALL, rank=4, alpha=8.0, dropout=0.0):
    return C.ModelConfig(lora_rank=rank, lora_alpha=alpha, lora_dropout=dropout, lora_targets=targets)


def lora_model(folder, targets=ALL, seed=1, **kw):
    """Our model with LoRA whose B is random too (PEFT's init has B = 0: the delta would be 0)."""
    model = Transformer.from_pretrained(folder)
    lora.apply(model, lora_cfg(targets, **kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def ids(B=2, T=17, seed=3):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def maxdiff(a, b):
    return (a - b).abs().max().item()


# -----------------------------------------------------------------------------
# parity with PEFT


@pytest.mark.parametrize("family,targets", [("qwen2", ALL), ("qwen3", ALL), ("llama", ALL),
                                            ("qwen2", "q,v"), ("llama", "k,o,up"), ("qwen3", "gate,down")])
def test_saved_adapter_gives_our_logits_in_peft(folders, tmp_path, family, targets):
    peft = pytest.importorskip("peft", reason=PEFT_MISSING)
    ours = lora_model(folders[family], targets).eval()
    lora.save_adapter(ours, tmp_path / "adapter", base_path=str(folders[family]))
    base = AutoModelForCausalLM.from_pretrained(folders[family], attn_implementation="eager")
    ref = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    # PEFT built as many adapter weights as we have (it only warns about keys it did not load:
    # the logits below catch those)
    n_ref = sum(p.numel() for n, p in ref.named_parameters() if "lora_" in n)
    assert n_ref == sum(v.numel() for v in lora.adapter_state_dict(ours).values()) > 0
    x = ids()
    with torch.no_grad():
        want = ref(x).logits
        assert maxdiff(ours(x), want) <= 1e-4
        with ref.disable_adapter():  # the adapters matter: without them the logits move
            assert maxdiff(ref(x).logits, want) > 1e-2


def test_peft_made_adapter_loads_into_ours(folders, tmp_path):
    """The other direction: an adapter written by PEFT itself (its names, its config)."""
    peft = pytest.importorskip("peft", reason=PEFT_MISSING)
    base = AutoModelForCausalLM.from_pretrained(folders["qwen3"], attn_implementation="eager")
    pcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                           lora_dropout=0.0, task_type="CAUSAL_LM")
    ref = peft.get_peft_model(base, pcfg)
    torch.manual_seed(5)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.2)
    ref.save_pretrained(tmp_path / "peft")
    ours = Transformer.from_pretrained(folders["qwen3"])
    lora.apply(ours, lora_cfg("q,v,up,down"))
    lora.load_adapter(ours, tmp_path / "peft")
    x = ids()
    with torch.no_grad():
        assert maxdiff(ours.eval()(x), ref.eval()(x).logits) <= 1e-4


# -----------------------------------------------------------------------------
# the module itself


def test_initial_model_is_the_base_and_only_adapters_train(folders):
    base = Transformer.from_pretrained(folders["qwen2"])
    model = Transformer.from_pretrained(folders["qwen2"])
    spec = lora.apply(model, lora_cfg())
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x), base(x))  # B = 0
    layer = model.layers[0].self_attn.qkv_proj
    a = layer.lora_A["q"]  # kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))
    assert a.abs().max() <= 1 / 64 ** 0.5 and a.std() > 0.3 / 64 ** 0.5
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(re.search(r"\.lora_[AB]\.\w+$", n) for n in trainable)
    # 7 targets x 2 layers x (A and B); parts of the fused modules each have their own pair
    assert len(trainable) == 2 * 7 * 2 and spec.scaling == 2.0
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    with torch.no_grad():  # reset_adapters (e.g. after building on meta + to_empty): base again
        for p in model.parameters():
            if p.requires_grad:
                p.fill_(0.5)
        assert maxdiff(model(x), base(x)) > 1e-2
        for layer in lora.lora_layers(model).values():
            layer.reset_adapters()
        assert torch.equal(model(x), base(x))


def test_gradient_reaches_only_the_adapters(folders):
    grads = []
    for checkpointing in (False, True):  # activation checkpointing: the same adapter gradients
        model = lora_model(folders["llama"]).train()
        model.set_activation_checkpointing(checkpointing)
        logp, _ = model(ids()[:, :-1], targets=ids()[:, 1:])
        logp.mean().backward()
        for n, p in model.named_parameters():
            if p.requires_grad:
                assert p.grad is not None and p.grad.abs().sum() > 0, n
            else:
                assert p.grad is None, n
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert all(maxdiff(grads[0][n], grads[1][n]) <= 1e-6 for n in grads[0])


def test_sampler_gives_the_same_tokens_merged_or_not(folders):
    """The rollout path (KV cache, ragged prefill, decode): greedy tokens of the adapter forward and
    of the sampler's merged copy (PolicySampler.refresh, what training samples) agree."""
    from config import SamplingConfig
    from trainer.policy_sampler import PolicySampler
    from rollout import generate
    model = lora_model(folders["qwen2"]).eval()
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (5, 9, 3)]
    cfg = SamplingConfig(max_new_tokens=12, max_context=64, kv_budget_tokens=256)
    plain = generate(model, prompts, cfg, [], None, seed=0, greedy=True, eos=[])
    sampler = PolicySampler(model, cfg)
    sampler.refresh(model)
    merged = generate(sampler.model, prompts, cfg, [], None, seed=0, greedy=True, eos=[])
    base = Transformer.from_pretrained(folders["qwen2"])
    without = generate(base, prompts, cfg, [], None, seed=0, greedy=True, eos=[])
    assert [t.ids for t in plain] == [t.ids for t in merged] != [t.ids for t in without]


def test_gradient_matches_the_unfused_formula(folders):
    """d/dB_k of a loss through the fused module == through a hand-written k-only LoRA."""
    model = lora_model(folders["qwen2"], "k,up")
    layer = model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, 5, 64)
    out = layer(x)
    q_rows, kv_rows = 4 * 16, 2 * 16
    ak, bk = layer.lora_A["k"], layer.lora_B["k"]
    k_ref = x @ layer.weight[q_rows:q_rows + kv_rows].T + layer.bias[q_rows:q_rows + kv_rows] + x @ ak.T @ bk.T * 2.0
    assert maxdiff(out[..., q_rows:q_rows + kv_rows], k_ref) <= 1e-5
    base_rows = torch.cat([out[..., :q_rows], out[..., q_rows + kv_rows:]], -1)
    with torch.no_grad():  # q and v have no adapter: their rows are the plain base
        plain = x @ layer.weight.T + layer.bias
    assert maxdiff(base_rows, torch.cat([plain[..., :q_rows], plain[..., q_rows + kv_rows:]], -1)) <= 1e-6
    (g_out,) = torch.autograd.grad(out.square().sum(), [bk])
    (g_ref,) = torch.autograd.grad(k_ref.square().sum(), [bk])
    assert maxdiff(g_out, g_ref) <= 1e-4


def test_merged_equals_adapter_forward_and_hf_export(folders, tmp_path):
    """The sampler's merged copy (PolicySampler.refresh) gives the adapter forward's logits and
    leaves the trained model bit for bit; so does a merged HF export, through transformers alone."""
    from config import SamplingConfig
    from trainer.policy_sampler import PolicySampler
    model = lora_model(folders["qwen3"]).eval()
    x = ids()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sampler = PolicySampler(model, SamplingConfig(kv_budget_tokens=64))
    sampler.refresh(model)
    with torch.no_grad():
        want = model(x)
        assert maxdiff(sampler.model(x), want) <= 1e-5
    merged_w = sampler.model.layers[1].mlp.gate_up_proj.weight
    assert maxdiff(merged_w, before["layers.1.mlp.gate_up_proj.weight"]) > 1e-3  # the adapters moved it
    for n, p in model.named_parameters():  # the trained model is never changed
        assert torch.equal(p, before[n]), n
    # merged HF weights: transformers alone (no peft) gives the adapter model's logits
    sd = lora.merged_state_dict(model)
    assert not any(".lora_" in k for k in sd)
    model.save_pretrained(tmp_path / "hf", state_dict=sd)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    with torch.no_grad():
        assert maxdiff(hf(x).logits, want) <= 1e-4


# every fused projection partly targeted: qkv_proj [q, k, v] with one or two of its parts,
# gate_up_proj [gate, up] with one; each part's rows must land at its own output offset
PARTIAL = ["q,v,up", "k,gate", "v", "q,k,down", "k,v,o,up"]


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])  # qwen3: q rows != k rows (head_dim 24); qwen2: biases
@pytest.mark.parametrize("targets", PARTIAL)
def test_merged_export_with_some_targets_equals_adapter_forward(folders, tmp_path, family, targets):
    """lora.merged_state_dict of a model with a partial target list, saved as an HF folder:
    transformers and our loader give the adapter forward's logits; the rows of untargeted parts
    (and untargeted modules) are the base's bit for bit, every targeted part's rows moved."""
    model = lora_model(folders[family], targets=targets).eval()
    x = ids()
    with torch.no_grad():
        want = model(x)
    base = dict(model.state_dict())
    sd = lora.merged_state_dict(model)
    assert not any(".lora_" in k for k in sd)
    for name, layer in lora.lora_layers(model).items():
        start = 0
        for part, rows in layer.parts:
            merged, orig = sd[f"{name}.weight"][start:start + rows], base[f"{name}.weight"][start:start + rows]
            assert torch.equal(merged, orig) != (part in layer.lora_A), (name, part)
            start += rows
    weights = {f"{name}.weight" for name in lora.lora_layers(model)}
    assert all(torch.equal(v, base[k]) for k, v in sd.items() if k not in weights)
    model.save_pretrained(tmp_path / "hf", state_dict=sd)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    with torch.no_grad():
        assert maxdiff(hf(x).logits, want) <= 1e-4
        assert maxdiff(Transformer.from_pretrained(tmp_path / "hf")(x), want) <= 1e-4


def test_dropout_only_in_training(folders):
    model = lora_model(folders["qwen2"], dropout=0.5)
    plain = lora_model(folders["qwen2"], dropout=0.0)  # same seed: same adapters
    x = ids()
    with torch.no_grad():
        model.train()
        a, b = model(x), model(x)
        assert maxdiff(a, b) > 1e-3  # fresh masks per call
        model.eval()
        assert torch.equal(model(x), model(x)) and maxdiff(model(x), plain.eval()(x)) <= 1e-6


def test_bf16_base_with_fp32_adapters(folders):
    """The frozen base in bf16 (as in bf16 runs), adapters and their grads in fp32."""
    model = lora_model(folders["llama"])
    for n, p in model.named_parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    ref = lora_model(folders["llama"])
    x = ids()
    logp, _ = model(x[:, :-1], targets=x[:, 1:])
    logp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters() if not p.requires_grad)
    with torch.no_grad():
        assert maxdiff(logp, ref(x[:, :-1], targets=x[:, 1:])[0]) < 0.1  # bf16 compute


# -----------------------------------------------------------------------------
# save / load / errors


def test_save_load_round_trip_is_exact(folders, tmp_path):
    model = lora_model(folders["qwen2"], "q,k,v,gate,up", seed=7)
    lora.save_adapter(model, tmp_path / "a", base_path="/models/base")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["base_model_name_or_path"] == "/models/base"
    assert cfg["target_modules"] == ["gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"]
    names = set(load_file(tmp_path / "a" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight" in names and len(names) == 2 * 5 * 2
    other = lora_model(folders["qwen2"], "q,k,v,gate,up", seed=8)
    lora.load_adapter(other, tmp_path / "a")
    sa, sb = lora.adapter_state_dict(model), lora.adapter_state_dict(other)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x), other(x))


def test_bad_adapters_and_configs_fail_clearly(folders, tmp_path):
    model = lora_model(folders["qwen2"])
    lora.save_adapter(model, tmp_path / "a")
    for kw, match in [({"rank": 8}, "r: folder 4 vs model 8"), ({"alpha": 16.0}, "lora_alpha"),
                      ({"targets": "q,v"}, "target_modules")]:
        with pytest.raises(ValueError, match=match):
            lora.load_adapter(lora_model(folders["qwen2"], **kw), tmp_path / "a")
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        lora.load_adapter(model, tmp_path / "nowhere")
    other_shape = Transformer.from_pretrained(folders["qwen3"])  # head_dim 24: other shapes
    lora.apply(other_shape, lora_cfg())
    with pytest.raises(ValueError, match="shape mismatches"):
        lora.load_adapter(other_shape, tmp_path / "a")
    with pytest.raises(ValueError, match="already applied"):
        lora.apply(model, lora_cfg())
    for kw, match in [({"targets": "q,attn"}, "lora_targets"), ({"targets": ""}, "lora_targets"),
                      ({"rank": 0}, "lora_rank"), ({"dropout": 1.0}, "lora_dropout")]:
        with pytest.raises(ValueError, match=match):
            lora.LoraSpec.from_config(lora_cfg(**kw))


# -----------------------------------------------------------------------------
# memory, sharding

QWEN_7B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
           "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "tie_word_embeddings": False}  # Qwen2.5-Coder-7B-Instruct's shape


def test_memory_estimate_of_the_7b_lora_recipe():
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_hf(QWEN_7B))
    cfg = C.load_config([str(ROOT / "configs" / "skyrl_sql_7b_lora.yaml")])
    lora.apply(model, cfg.model)
    est = memory.memory_estimate(model, cfg, world=8)  # the one estimate, after apply: LoRA's layout
    # per layer r (in + out) per part: q, o 3584+3584; k, v 3584+512; gate, up, down 3584+18944
    r = cfg.model.lora_rank
    per_layer = r * (2 * 7168 + 2 * 4096 + 3 * 22528)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 28 * per_layer
    gb, n_base = 1024 ** 3, 7_615_616_512  # Qwen2.5-7B's parameter count
    assert sum(p.numel() for p in model.parameters() if not p.requires_grad) == n_base
    assert abs(est["grads"] - 4 * 28 * per_layer / 8 / gb) < 1e-9
    assert abs(est["params"] - (2 * n_base + 4 * 28 * per_layer) / 8 / gb) < 1e-9
    assert abs(est["adam"] - 8 * 28 * per_layer / 8 / gb) < 1e-9


def test_memory_command_prints_lora_next_to_full(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_7B))  # only config.json is read
    sys.path.insert(0, str(ROOT / "bench"))
    import lora_memory
    lora_memory.main([str(ROOT / "configs" / "skyrl_sql_7b_lora.yaml"), f"--model.path={tmp_path}", "--world=2"])
    out = capsys.readouterr().out
    full, lo = map(float, re.search(r"world 2: full fine-tune ([\d.]+) GB/device, LoRA ([\d.]+)", out).groups())
    assert "rank 32, alpha 64" in out and 45 < lo < full - 45  # README: 53.7 vs 102.8 GB


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("world", [1, 2])  # 1: FSDP2 on one process (its gathered copies too)
def test_fsdp2_shards_lora(world):
    check = run_dist_check("lora_dist_check.py", nproc=world, timeout=240)
    results = dict(re.fullmatch(r"RESULT (\S+) .* (ok|MISMATCH)", line).groups() for line in check.results.get(0, []))
    assert check.returncode == 0 and results == {c: "ok" for c in ("fp32", "bf16_base", "train_step", "checkpoint",
                                                                       "merged_fp32", "merged_bf16")}, check.why()
