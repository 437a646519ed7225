"""toy/tiny.py: the tokenizer round-trips through AutoTokenizer, the folder loads in transformers and ours.

Run: .venv/bin/pytest tests/test_tiny.py -q
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from toy import tiny
import sft
from model import Transformer

TEXTS = [
    "SELECT T1.name, COUNT(*) FROM singer AS T1 JOIN concert AS T2 ON T1.id = T2.singer_id GROUP BY 1;",
    "<think>\nThe user wants Zürich, São Paulo and 東京 ✓ 😀</think>\n<sql>SELECT 1</sql>",
    "<solution>SELECT name FROM t WHERE city = 'cafe\u0301'</solution>",  # decomposed é: NFC
    "\n\n<observation>| a |\n| 12345 |\n<reminder>You have 3 turns left.</reminder></observation>\n\n",
    "<|im_start|>user\n  two  spaces\tand tabs\r\n<|im_end|>\n<|endoftext|>",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    tiny.build_tiny(Transformer, out, vocab_size=700, family="qwen2", hidden_size=32, layers=2, heads=4, kv_heads=2)
    return out


def test_autotokenizer_ids_equal_raw_tokenizer(folder):
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(folder)
    # Qwen2Tokenizer rebuilds the pre-tokenizer (Qwen's regex split + NFC): ids only agree because
    # the tiny BPE was trained with that same pre-tokenizer
    assert type(hf).__name__ == "Qwen2Tokenizer"
    for text in TEXTS:
        ids = raw.encode(text).ids
        assert hf(text)["input_ids"] == ids, text
        assert hf.decode(ids) == raw.decode(ids, skip_special_tokens=False)
    assert hf.decode(raw.encode(TEXTS[1]).ids) == TEXTS[1]  # byte-level: lossless


def test_special_tokens_and_protocol_tags(folder):
    hf = AutoTokenizer.from_pretrained(folder)
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
    for t in tiny.SPECIAL:
        assert len(hf(t)["input_ids"]) == 1, t
    for tag in tiny.PROTOCOL:  # plain text, but merged into a few tokens
        ids = hf(tag)["input_ids"]
        assert 1 <= len(ids) <= 3 and not set(ids) & set(hf.all_special_ids), tag
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["eos_token_id"] == hf.eos_token_id and cfg["pad_token_id"] == hf.pad_token_id


def test_chat_template(folder):
    hf = AutoTokenizer.from_pretrained(folder)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many?"},
            {"role": "assistant", "content": "<sql>SELECT 1</sql>"}]
    text = hf.apply_chat_template(msgs, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHow many?<|im_end|>\n"
                    "<|im_start|>assistant\n<sql>SELECT 1</sql><|im_end|>\n")
    gen = hf.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert gen.endswith("<|im_start|>user\nHow many?<|im_end|>\n<|im_start|>assistant\n")


def test_model_folder_loads_in_transformers_and_ours(folder):
    ours = Transformer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert ours.config.vocab_size == hf.config.vocab_size >= len(AutoTokenizer.from_pretrained(folder))
    x = torch.randint(0, ours.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_other_families_deterministic(tmp_path, family):
    kw = dict(family=family, vocab_size=300, hidden_size=32, heads=4, kv_heads=2, tie=False)
    a = tiny.build_tiny_model(Transformer, tmp_path / "a", seed=3, **kw)
    b = tiny.build_tiny_model(Transformer, tmp_path / "b", seed=3, **kw)
    c = tiny.build_tiny_model(Transformer, tmp_path / "c", seed=4, **kw)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["embed_tokens.weight"], sc["embed_tokens.weight"])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "a", attn_implementation="eager").eval()
    x = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (a(x) - hf(x).logits).abs().max().item() <= 1e-5


def test_build_tiny_from_a_corpus(tmp_path):
    """A llama-family tiny model whose tokenizer merges the corpus's words."""
    texts = [f"How many rows in table_{i}? SELECT COUNT(*) FROM table_{i}" for i in range(50)]
    out = tmp_path / "m"
    tiny.build_tiny(Transformer, out, texts, 400, family="llama", hidden_size=32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == 32
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_ids_to_tokens(tok(" table")["input_ids"]) == ["Ġtable"]  # merged from the corpus


def test_an_older_toy_set_and_its_tiny_model_are_built_again(tmp_path):
    """A clone that ran an older prepare_toy.py keeps runs/toy and runs/tiny/model: the next run
    must not train on them silently (other codes, another tokenizer). prepare_assets sees their
    toy_version stamp and builds both again; a current pair is left alone."""
    import os
    from pathlib import Path
    from conftest import build_tiny_assets
    from toy.prepare_toy import TOY_VERSION
    build_tiny_assets(tmp_path)
    train, weights = tmp_path / "toy" / "train.jsonl", tmp_path / "model" / "model.safetensors"
    assert (tmp_path / "toy" / "toy_version").read_text().strip() == str(TOY_VERSION)
    assert (tmp_path / "model" / "toy_version").read_text().strip() == tiny.tiny_stamp(TOY_VERSION)
    os.utime(train, (1, 1)), os.utime(weights, (1, 1))
    build_tiny_assets(tmp_path)  # current: nothing rebuilt
    assert train.stat().st_mtime == 1 and weights.stat().st_mtime == 1
    (tmp_path / "toy" / "toy_version").write_text("1\n")  # as an older prepare_toy.py left it
    train.write_text(train.read_text().replace("SELECT", "SELECT ", 1))
    before = train.read_text()
    build_tiny_assets(tmp_path)
    assert train.read_text() != before and train.stat().st_mtime > 1  # the set, built again
    assert weights.stat().st_mtime > 1  # and the model whose tokenizer was trained on the old one
    assert (tmp_path / "toy" / "toy_version").read_text().strip() == str(TOY_VERSION)


def test_a_tiny_model_of_another_shape_is_built_again(tmp_path, capsys):
    """A clone keeps runs/tiny/model from an older tiny.yaml (another layer count, say): the next
    run builds the shape its config asks for instead of training the old one silently. A folder
    without the build stamp (a checkpoint's hf/) is used as it is, whatever its shape."""
    import config as C
    from conftest import build_tiny_assets
    settings = build_tiny_assets(tmp_path)  # 1 layer
    ckpt = tmp_path / "ckpt" / "hf"
    shutil.copytree(tmp_path / "model", ckpt)
    (ckpt / "toy_version").unlink()
    capsys.readouterr()
    for path in (tmp_path / "model", ckpt):
        tiny.prepare_assets(C.load_config(["--" + a for a in settings] + ["--model.tiny_layers=2",
                                                                          f"--model.path={path}"]), Transformer, sft.gold_texts)
    assert json.loads((tmp_path / "model" / "config.json").read_text())["num_hidden_layers"] == 2
    assert "num_hidden_layers 1 -> 2" in capsys.readouterr().out
    assert json.loads((ckpt / "config.json").read_text())["num_hidden_layers"] == 1


def test_a_checkpoint_or_foreign_data_is_never_overwritten(tmp_path, capsys):
    """model.path may be a trained checkpoint's hf/ folder (no toy_version stamp): rebuilding the
    toy set must not replace its weights with a random tiny model. And data.prepare_toy over a
    records file that is not the toy's is refused, not overwritten."""
    from pathlib import Path
    import config as C
    from conftest import build_tiny_assets
    settings = build_tiny_assets(tmp_path)
    ckpt = tmp_path / "ckpt_000032" / "hf"
    shutil.copytree(tmp_path / "model", ckpt)
    (ckpt / "toy_version").unlink()  # checkpoint.export_hf writes config, weights, tokenizer: no stamp
    from safetensors.torch import load_file, save_file
    trained = {k: v + 0.5 for k, v in load_file(ckpt / "model.safetensors").items()}  # not what a build gives
    save_file(trained, ckpt / "model.safetensors", metadata={"format": "pt"})
    weights = (ckpt / "model.safetensors").read_bytes()
    (tmp_path / "toy" / "toy_version").write_text("1\n")  # an older toy set: it is built again
    cfg = C.load_config(["--" + a for a in settings] + [f"--model.path={ckpt}"])
    tiny.prepare_assets(cfg, Transformer, sft.gold_texts)
    assert (tmp_path / "toy" / "toy_version").read_text().strip() != "1"
    assert (ckpt / "model.safetensors").read_bytes() == weights and (ckpt / "config.json").exists()
    assert "has no toy_version stamp" in capsys.readouterr().out
    # someone's own records under a config that says prepare_toy: refused, the file kept
    mine = tmp_path / "mine"
    mine.mkdir()
    records = json.dumps({"id": "q1", "source": "spider", "db_id": "x", "question": "?", "gold_sql": "SELECT 1"})
    (mine / "train.jsonl").write_text(records + "\n")
    cfg = C.load_config(["--" + a for a in settings] + [f"--data.train_path={mine}/train.jsonl",
                                                        f"--data.db_root={mine}"])
    with pytest.raises(ValueError, match="not a toy set"):
        tiny.prepare_assets(cfg, Transformer, sft.gold_texts)
    assert (mine / "train.jsonl").read_text() == records + "\n"


def test_two_runs_starting_at_once_build_the_assets_once(tmp_path):
    """The README's seeds 1 and 2 started together on a fresh clone share runs/toy and
    runs/tiny/model. Two processes released at the same instant build one folder (the toy set and
    a tiny model, tiny.prepare_assets as train.py calls it): one builds, the other waits for its
    lock and then finds both built and reuses them. Before the lock both built, both wrote
    toy/database/<db>/<db>.sqlite.tmp, and one's rename found the file gone (FileNotFoundError)."""
    import subprocess
    import sys
    from conftest import ROOT
    from sqltask.dataset import load_examples
    go, shared = tmp_path / "go", tmp_path / "shared"
    code = ("import os, sys, time\n"
            f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
            "from pathlib import Path\n"
            "import conftest, config, sft, model, toy.tiny\n"  # imported before the start: only the build races
            "print('ready', flush=True)\n"
            f"while not os.path.exists({str(go)!r}):\n"
            "    time.sleep(0.005)\n"
            f"conftest.build_tiny_assets(Path({str(shared)!r}))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.communicate()[0][-3000:]
    go.touch()
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [out[-3000:] for out in outs]
    assert sum("building the toy set" in out for out in outs) == 1, outs
    assert sum("building a tiny" in out for out in outs) == 1, outs
    # what both go on with: the whole set, a model that loads, no temp file left behind
    assert len(load_examples(shared / "toy" / "train.jsonl", shared / "toy")) > 1000
    Transformer.from_pretrained(str(shared / "model"))
    assert not [p for p in shared.rglob("*") if p.name.endswith(".tmp")]


def test_a_tiny_model_built_beside_data_it_does_not_prepare_is_built_once(tmp_path, capsys, loop_assets):
    """model.build_tiny with data.prepare_toy false (a tiny model on data the run does not build):
    once built, its folder holds no 'unfinished' stamp (a model not trained on the toy set gets
    none), so the next run uses it instead of building it again."""
    import config as C
    own = tmp_path / "own_model"
    cfg = C.load_config(loop_assets + ["--data.prepare_toy=false", f"--model.path={own}"])
    capsys.readouterr()
    for _ in range(2):
        tiny.prepare_assets(cfg, Transformer, sft.gold_texts)
    assert capsys.readouterr().out.count("building a tiny") == 1
    assert not (own / "toy_version").exists()
    Transformer.from_pretrained(str(own))


def test_a_tiny_model_build_stopped_midway_is_built_again(tmp_path, monkeypatch, capsys):
    """The tiny model's folder gets config.json before its weights: a run killed in between left a
    folder that looked built, and the next run loaded it (no weights). The stamp says "unfinished"
    until the build's last file, so the next run builds it again."""
    from conftest import build_tiny_assets
    real = tiny.build_tiny_model

    def killed_after_config(model_class, out_dir, **kw):
        (Path(out_dir) / "config.json").write_text("{}")  # what hf_folder.save writes first
        raise KeyboardInterrupt  # the run stopped here
    monkeypatch.setattr(tiny, "build_tiny_model", killed_after_config)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_assets(tmp_path)
    assert (tmp_path / "model" / "config.json").exists() and not (tmp_path / "model" / "model.safetensors").exists()
    monkeypatch.setattr(tiny, "build_tiny_model", real)
    capsys.readouterr()
    build_tiny_assets(tmp_path)
    assert "was not finished (its build stopped midway): building it again" in capsys.readouterr().out
    Transformer.from_pretrained(str(tmp_path / "model"))
    from toy.prepare_toy import TOY_VERSION
    assert (tmp_path / "model" / "toy_version").read_text().strip() == tiny.tiny_stamp(TOY_VERSION)
