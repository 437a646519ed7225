"""A GGUF checkpoint -> an HF folder (trainer/gguf_folder.py), checked on a tiny Llama that this test
writes with gguf's own writer the way llama.cpp's converter does (q/k rows permuted for its rope,
matrices quantized to Q4_1 in blocks of 32, the tokenizer as token and merge lists), so CI needs no
download. The reference is the source model with each matrix replaced by gguf's own dequantization of
what was written: the converted folder must give its logits, in our model and in transformers.

    .venv/bin/python -m pytest -q tests/test_gguf_folder.py
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package (requirements.txt) reads and writes GGUF files")

from model import Transformer  # noqa: E402
from trainer import config_checks, gguf_folder  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128  # every row a multiple of Q4_1's block of 32
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer():
    """A byte-level BPE trained on a few lines, with ChatML's two special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["SELECT name FROM singer WHERE age > 30 ORDER BY name", "How many singers are there?"] * 20
    tok.train_from_iterator(text, trainer)
    return tok


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's q/k rows from HF's rotate-half layout to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q4_1(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the bytes written, gguf's dequantization of them)."""
    q = gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
    return q, gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_1).reshape(w.shape)


def write_tiny_gguf(path):
    """A tiny tied-embedding Llama as a Q4_1 GGUF; returns (the reference HF model holding the
    dequantized weights, the tokenizer it was written with)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = tiny_tokenizer()
    vocab = tok.get_vocab_size()
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg).eval()
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    spec = json.loads(tok.to_str())
    tokens = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    deq = {}

    def matrix(name, hf_name, permute_heads=0):
        data = sd[hf_name]
        q, back = q4_1(llama_permute(data, permute_heads) if permute_heads else data)
        w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        # the permutation moves whole rows and Q4_1 blocks lie within a row: undoing it on the
        # dequantized rows gives the dequantized HF rows
        deq[hf_name] = llama_permute_back(back, permute_heads) if permute_heads else back

    matrix("token_embd.weight", "model.embed_tokens.weight")
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        matrix(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", HEADS)
        matrix(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", KV_HEADS)
        matrix(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight")
        matrix(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight")
        matrix(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight")
        matrix(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight")
        matrix(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref.load_state_dict({k: torch.from_numpy(deq.get(k, v)) for k, v in sd.items() if k != "lm_head.weight"},
                        strict=False)
    ref.tie_weights()
    return ref, tok


def llama_permute_back(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    ref, tok = write_tiny_gguf(root / "tiny.Q4_1.gguf")
    out = gguf_folder.convert(root / "tiny.Q4_1.gguf", root / "hf")
    return ref, tok, out, root


def test_the_folder_gives_the_dequantized_models_logits_in_ours_and_transformers(converted):
    from transformers import AutoModelForCausalLM
    ref, _, out, _ = converted
    assert config_checks.model_folder_problem(str(out)) == ""  # a folder train.py accepts
    idx = torch.randint(0, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(idx).logits
        ours = Transformer.from_pretrained(str(out), dtype=torch.float32)(idx)
        theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()(idx).logits
    # Q4_1 weights differ from the source model's by far more than this: a wrong scale, a missed
    # q/k permutation or a swapped tensor fails
    assert (want - ref.__class__(ref.config).eval()(idx).logits).abs().max() > 1e-2
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(theirs, want, rtol=1e-4, atol=1e-4)


def test_the_folder_keeps_the_tokenizer_and_chat_template_and_drops_the_quantization_entry(converted):
    from transformers import AutoTokenizer
    _, tok, out, root = converted
    loaded = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert loaded.get_vocab() == tok.get_vocab()
    text = "SELECT name FROM singer WHERE age > 30"
    assert loaded.encode(text, add_special_tokens=False) == tok.encode(text).ids
    messages = [{"role": "user", "content": "How many singers are there?"}]
    assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nHow many singers are there?<|im_end|>\n<|im_start|>assistant\n"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    stamp = json.loads((out / gguf_folder.SOURCE_STAMP).read_text())
    assert stamp["sha256"] == gguf_folder.sha256(root / "tiny.Q4_1.gguf") and stamp["gguf_file"] == "tiny.Q4_1.gguf"


def test_a_gguf_file_given_as_the_model_is_refused_naming_the_converter(converted):
    _, _, _, root = converted
    problem = config_checks.model_folder_problem(str(root / "tiny.Q4_1.gguf"))
    assert problem.startswith("a GGUF file, not a model folder") and "prepare_smollm2.py" in problem


def test_a_conversion_replaces_the_folder_whole(converted, tmp_path):
    _, _, _, root = converted
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier build")
    gguf_folder.convert(root / "tiny.Q4_1.gguf", out)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".model.*.tmp"))  # the temporary folder was renamed, not left
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        gguf_folder.convert(tmp_path / "missing.gguf", tmp_path / "never")
