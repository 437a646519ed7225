"""The model and the sampler on a CUDA GPU, against references that do not share their kernels.

CPU machines skip this file (CI has no GPU); `bash bench/gpu.sh` runs it on one. What it checks:
- bf16 logits on CUDA are as close to the fp32 reference as transformers' own bf16 logits are;
- fp32 logits on CUDA equal fp32 on CPU (TF32 off), so the CUDA attention kernels compute the
  same function as the CPU path;
- the sampler on CUDA (KV cache, cached attention, fp32): greedy tokens equal the CPU sampler's,
  and each sampled token's recorded logprob equals a no-cache full forward's.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen3Config

import config as C
import rollout
from toy import tiny
from model import Transformer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.sh runs it)")

V = 151
COMMON = dict(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2)
CONFIGS = {"qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
           "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False)}


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def build_hf(name, folder):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(folder)
    return hf


def ids_for(B=4, T=200, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_logits_as_close_as_transformers_bf16(name, tmp_path):
    hf = build_hf(name, tmp_path)
    x = ids_for()
    with torch.no_grad():
        reference = hf(x).logits.float()  # fp32, CPU
        hf_bf16 = hf.to("cuda", torch.bfloat16)(x.cuda()).logits.float().cpu()
        ours = Transformer.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
        ours_bf16 = ours(x.cuda()).float().cpu()
    hf_err = (hf_bf16 - reference).abs().max().item()
    our_err = (ours_bf16 - reference).abs().max().item()
    assert our_err <= 2 * hf_err + 1e-2, (our_err, hf_err)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_cuda_equals_cpu(name, tmp_path):
    build_hf(name, tmp_path)
    x = ids_for()
    with torch.no_grad():
        cpu = Transformer.from_pretrained(tmp_path)(x)
        gpu = Transformer.from_pretrained(tmp_path, device="cuda")(x.cuda()).cpu()
    assert (cpu - gpu).abs().max().item() <= 1e-4


def _generate(model, tok, prompts, greedy):
    sampling = C.SamplingConfig(max_new_tokens=48, temperature=1.0, max_context=512)
    return rollout.generate(model, prompts, sampling, [], tok, seed=3, greedy=greedy, eos=[])


def test_sampler_on_cuda_matches_cpu_and_full_forward(tmp_path):
    folder = tiny.build_tiny(Transformer, tmp_path, vocab_size=512, hidden_size=128, heads=8, kv_heads=2)
    tok = AutoTokenizer.from_pretrained(folder)
    cpu_model = Transformer.from_pretrained(folder).eval()
    gpu_model = Transformer.from_pretrained(folder, device="cuda").eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 33, 64, 120, 5, 90)]
    with torch.no_grad():
        greedy_cpu = _generate(cpu_model, tok, prompts, greedy=True)
        greedy_gpu = _generate(gpu_model, tok, prompts, greedy=True)
        assert [t.ids for t in greedy_gpu] == [t.ids for t in greedy_cpu]
        sampled = _generate(gpu_model, tok, prompts, greedy=False)
        for t in sampled:  # the cached decode's logprobs vs one full forward of the whole row
            ids = torch.tensor([t.ids], device="cuda")
            logp = torch.log_softmax(gpu_model(ids)[0, :-1].float(), dim=-1)  # temperature 1
            full = logp.gather(1, ids[0, 1:, None])[:, 0].cpu()
            recorded = torch.tensor(t.logprobs[1:])
            mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
            assert mask.sum() > 0
            assert (full[mask] - recorded[mask]).abs().max().item() <= 1e-4
