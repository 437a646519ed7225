"""Tiny offline assets: a byte-level BPE tokenizer (Qwen-style) and a random model as HF folders, and
a toy run's data and tiny model built when absent (prepare_assets).

No network. Tests and the embedded default config use these instead of a real checkpoint.

    tiny.prepare_assets(cfg, model.Transformer, sft.gold_texts)     # train.py: the toy set + tiny model
    tiny.build_tiny(model.Transformer, "DIR", texts, vocab_size=1024, family="qwen3", layers=4)
The model class and the warm start's texts come from the caller (this package imports nothing from
the top-level files): the tokenizer is trained on the run's own text, gold observations included.

The tokenizer is trained with Qwen2's own pre-tokenizer (NFC + Qwen's regex split + ByteLevel
without its regex): for a folder whose config says qwen2, AutoTokenizer returns Qwen2Tokenizer,
which rebuilds exactly that pre-tokenizer, so ids only agree if training used it.
Protocol tags (<think>, <sql>, ...) are plain text, as in Qwen, but are put in the corpus so
they merge into few tokens. eos = <|im_end|>, pad = <|endoftext|>.
Tests: .venv/bin/pytest tests/test_tiny.py
"""
from __future__ import annotations

import contextlib
import json
import os
import random
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from toy.build_lock import build_lock
from trainer.config_loader import ConfigError

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS, PAD = "<|im_end|>", "<|endoftext|>"
PROTOCOL = ["<think>", "</think>", "<sql>", "</sql>", "<solution>", "</solution>",
            "<observation>", "</observation>", "<reminder>", "</reminder>"]
# Qwen2's pre-tokenizer regex (transformers' tokenization_qwen2.py)
QWEN_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
              r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen-style ChatML; no default system message (Qwen3 style): callers pass their own
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# -----------------------------------------------------------------------------
# corpus


PROSE = """You are a data analyst. Given a database schema and a question, write one SQLite query
that answers it. Think step by step inside the think tags, run queries to explore the tables, and
give the final query inside the solution tags. Use only tables and columns that exist. Join tables
on their foreign keys, filter rows with WHERE, aggregate with GROUP BY and HAVING, sort with ORDER
BY, and keep at most a few rows with LIMIT. Strings are compared exactly; dates are stored as text
such as 2019-07-01. Error executing SQL: no such column. SQL Timeout. Truncated: showing the first
50 rows. The answer should contain the department name and the number of employees, ordered from
the largest to the smallest department, including departments without any employee."""


def default_corpus(n: int = 120, seed: int = 0) -> list[str]:
    """A small SQL-flavoured corpus (~70 KB): questions, DDL, multi-turn protocol text."""
    rng = random.Random(seed)
    tables = {"singer": ["singer_id", "name", "country", "age", "song_name"],
              "concert": ["concert_id", "concert_name", "theme", "stadium_id", "year"],
              "stadium": ["stadium_id", "location", "name", "capacity", "average"],
              "employees": ["employee_id", "first_name", "last_name", "salary", "department_id"],
              "orders": ["order_id", "customer_id", "order_date", "total_amount", "status"],
              "students": ["student_id", "name", "major", "gpa", "city"]}
    words = ["How many", "What is the", "List the", "Show all", "Find the", "Which", "Return the",
             "average", "maximum", "minimum", "total", "number of", "names of", "for each",
             "Zürich", "café", "São Paulo", "東京"]
    out = PROSE.split("\n") * 3
    for _ in range(n):
        t = rng.choice(list(tables))
        cols = tables[t]
        c1, c2 = rng.sample(cols, 2)
        agg = rng.choice(["COUNT(*)", f"AVG({c1})", f"MAX({c1})", f"MIN({c2})", f"SUM({c1})", c1])
        sql = f"SELECT {agg} FROM {t}"
        if rng.random() < 0.6:
            sql += f" WHERE {c2} {rng.choice(['=', '>', '<', '>=', 'LIKE'])} {rng.choice([rng.randint(0, 2024), repr(rng.choice(words))])}"
        if rng.random() < 0.3:
            sql += f" GROUP BY {c2} ORDER BY COUNT(*) DESC LIMIT {rng.randint(1, 10)}"
        ddl = f"CREATE TABLE {t} (\n  " + ",\n  ".join(f"{c} {rng.choice(['INTEGER', 'TEXT', 'REAL'])}" for c in cols) + f",\n  PRIMARY KEY ({cols[0]})\n);"
        q = f"{rng.choice(words[:7])} {' '.join(rng.sample(words, 2))} {c1.replace('_', ' ')} in {t}?"
        rows = "\n".join(f"| {rng.randint(0, 999)} | {rng.choice(words)} |" for _ in range(rng.randint(1, 3)))
        out.append(
            f"{ddl}\nQuestion: {q}\n<think>\nI need {c1} from the {t} table.\n</think>\n<sql>{sql};</sql>\n\n"
            f"<observation>| {c1} | {c2} |\n{rows}\n<reminder>You have {rng.randint(1, 5)} turns left to "
            f"complete the task.</reminder></observation>\n\n<think>The result looks right.</think>\n"
            f"<solution>{sql}</solution>")
    return out


# -----------------------------------------------------------------------------
# tokenizer


def build_tiny_tokenizer(out_dir, texts=None, vocab_size: int = 1024) -> Tokenizer:
    """Train a byte-level BPE with Qwen2's pre-tokenizer; save an HF tokenizer folder."""
    texts = list(texts) if texts else default_corpus()
    texts += [" ".join(PROTOCOL)] * 50  # so the tags merge into few tokens (they stay plain text)
    tok = Tokenizer(models.BPE())  # byte-level alphabet below: no unk needed
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tok.model.save(str(out_dir))  # vocab.json + merges.txt (slow-tokenizer files)
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                       "rstrip": False, "single_word": False, "special": True}
             for t in SPECIAL}
    cfg = {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added,
           "additional_special_tokens": SPECIAL[1:], "bos_token": None, "eos_token": EOS,
           "pad_token": PAD, "unk_token": None, "add_prefix_space": False, "errors": "replace",
           "clean_up_tokenization_spaces": False, "split_special_tokens": False,
           "model_max_length": 32768, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
    return tok


# -----------------------------------------------------------------------------
# model


def build_tiny_model(model_class, out_dir, family: str = "qwen2", vocab_size: int = 1024, hidden_size: int = 64,
                     layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate_size: int | None = None,
                     tie: bool = True, seed: int = 0, head_dim: int | None = None,
                     rope_scaling: dict | None = None, rope_theta: float = 10000.0,
                     extra_config: dict | None = None):
    """Random model (weights and biases N(0, 0.02) from `seed`, norms 1) saved as an HF folder.
    model_class: model.Transformer (its from_hf_config builds the architecture of a config.json)."""
    cfg = {"model_type": family, "vocab_size": vocab_size, "hidden_size": hidden_size,
           "intermediate_size": intermediate_size or 3 * hidden_size, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "head_dim": head_dim or hidden_size // heads, "rms_norm_eps": 1e-6,
           "rope_theta": rope_theta, "rope_scaling": rope_scaling, "tie_word_embeddings": tie,
           "max_position_embeddings": 32768, "attention_dropout": 0.0, **(extra_config or {})}
    if family == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    model = model_class.from_hf_config(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weight listed once; order is fixed
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(out_dir)
    return model.eval()


def build_tiny(model_class, out_dir, texts=None, vocab_size: int = 1024, **model_kw) -> str:
    """Tokenizer + model in one folder (model vocab >= tokenizer vocab, like real Qwen); model_class:
    model.Transformer."""
    tok = build_tiny_tokenizer(out_dir, texts, vocab_size)
    ids = {k: tok.token_to_id(v) for k, v in (("eos_token_id", EOS), ("pad_token_id", PAD))}
    extra = {**ids, "bos_token_id": None, **model_kw.pop("extra_config", {})}
    build_tiny_model(model_class, out_dir, vocab_size=max(vocab_size, tok.get_vocab_size()), extra_config=extra,
                     **model_kw)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": ids["eos_token_id"], "pad_token_id": ids["pad_token_id"]}, f)
    return str(out_dir)


# -----------------------------------------------------------------------------
# a run's assets (train.py, sweep.py, tests, benchmarks)


def prepare_toy_set(data_cfg) -> bool:
    """Build the toy set at data_cfg.db_root when data.prepare_toy asks and it is absent or from an
    older prepare_toy.py (its toy_version stamp). Returns whether it was built now. Decided and
    built under the folder's build lock: a run that finds another building it waits, then finds
    it built and reuses it."""
    from toy.prepare_toy import TOY_VERSION, prepare_toy
    if not data_cfg.prepare_toy:
        return False
    with build_lock(data_cfg.db_root):
        toy_stamp = Path(data_cfg.db_root) / "toy_version"
        stale = Path(data_cfg.train_path).exists() and (
            not toy_stamp.exists() or toy_stamp.read_text().strip() != str(TOY_VERSION))
        if stale and not _is_toy_set(data_cfg.train_path):
            raise ConfigError(f"data.prepare_toy is true but {data_cfg.train_path} is not a toy set (its records' "
                              f"source is not 'toy'): set data.prepare_toy false to train on it")
        if not stale and Path(data_cfg.train_path).exists():
            return False
        print(f"building the toy set (version {TOY_VERSION}) in {data_cfg.db_root}"
              + (" (the one there is from an older prepare_toy.py)" if stale else ""), flush=True)
        prepare_toy(data_cfg.db_root, seed=data_cfg.toy_seed)
        return True


# the tiny tokenizer's corpus (tokenizer_corpus): bumped when it changes, so that a tiny model built
# on another corpus (its tokenizer cuts the same text into other tokens) is built again
CORPUS_VERSION = 2


UNFINISHED = "unfinished"  # a tiny model folder's stamp while its build runs


def tiny_stamp(toy_version: int) -> str:
    """What a tiny model folder built on the toy set records in its toy_version file."""
    return f"{toy_version} corpus {CORPUS_VERSION}"


def prepare_assets(cfg, model_class, gold_texts) -> None:
    """Rank 0 of a run (cfg: config.Config): build the toy data and the tiny model if the config asks
    (data.prepare_toy, model.build_tiny) and they are absent, or stamped with another toy version
    (the model: or another tokenizer corpus, tiny_stamp). model_class: model.Transformer;
    gold_texts(examples, cfg, db_paths): the warm start's gold turns and observations as texts
    (sft.gold_texts), part of the tiny tokenizer's corpus (tokenizer_corpus).
    Safe when two runs start at once: both folders' build locks (toy/build_lock.py, the toy set's
    first, always in that order) are held from the first check to the last file, so a second run
    waits for the first's build and then reuses it."""
    with contextlib.ExitStack() as locks:
        if cfg.data.prepare_toy:
            locks.enter_context(build_lock(cfg.data.db_root))
        if cfg.model.build_tiny:
            locks.enter_context(build_lock(cfg.model.path))
        _prepare_assets(cfg, model_class, gold_texts)


def _prepare_assets(cfg, model_class, gold_texts) -> None:
    # A toy set from an older prepare_toy.py (its layout or codes changed since) is built again, and
    # so is a tiny model whose tokenizer was trained on it: the README's figures are for the current
    # set, and an old one silently gives others. Only what this code built is replaced: a toy folder
    # whose records say source "toy", a model folder carrying the toy_version stamp build_tiny
    # writes. A checkpoint's hf/ folder has no stamp and is never touched (its weights are a run's).
    rebuilt = prepare_toy_set(cfg.data)
    from toy.prepare_toy import TOY_VERSION
    model_stamp = Path(cfg.model.path) / "toy_version"
    has_config = (Path(cfg.model.path) / "config.json").exists()
    if cfg.model.build_tiny and has_config and model_stamp.exists() and model_stamp.read_text().strip() == UNFINISHED:
        print(f"the tiny model in {cfg.model.path} was not finished (its build stopped midway): building it again",
              flush=True)
        (Path(cfg.model.path) / "config.json").unlink()
    elif cfg.data.prepare_toy and cfg.model.build_tiny and has_config:
        if model_stamp.exists() and (rebuilt or model_stamp.read_text().strip() != tiny_stamp(TOY_VERSION)):
            print(f"the tiny model in {cfg.model.path} was built on another toy set or tokenizer corpus: "
                  f"building it again", flush=True)
            (Path(cfg.model.path) / "config.json").unlink()
        elif model_stamp.exists() and (other_shape := shape_differences(cfg.model)):
            print(f"the tiny model in {cfg.model.path} has another shape than model.tiny_* ask "
                  f"({', '.join(other_shape)}): building it again", flush=True)
            (Path(cfg.model.path) / "config.json").unlink()
        elif not model_stamp.exists() and rebuilt:
            print(f"note: {cfg.model.path} has no toy_version stamp (a checkpoint, or a tiny model built before "
                  f"stamps): used as it is; delete it to build a tiny model on the toy set just built", flush=True)
    if not (Path(cfg.model.path) / "config.json").exists():
        if not cfg.model.build_tiny:
            raise ConfigError(f"model.path {cfg.model.path} has no config.json (and model.build_tiny is false)")
        m = cfg.model
        texts = tokenizer_corpus(cfg, gold_texts)
        print(f"building a tiny {m.tiny_family} model + tokenizer in {m.path}", flush=True)
        # hf_folder writes config.json before the weights: a build killed in between would leave a
        # folder that looks built. The stamp says "unfinished" until the last file is written.
        Path(m.path).mkdir(parents=True, exist_ok=True)
        model_stamp.write_text(f"{UNFINISHED}\n")
        build_tiny(model_class, m.path, texts, vocab_size=m.tiny_vocab_size, family=m.tiny_family,
                   hidden_size=m.tiny_hidden_size, layers=m.tiny_layers, heads=m.tiny_heads,
                   kv_heads=m.tiny_kv_heads, intermediate_size=m.tiny_intermediate_size, seed=cfg.train.seed)
        if cfg.data.prepare_toy:  # its tokenizer was trained on this toy set
            model_stamp.write_text(f"{tiny_stamp(TOY_VERSION)}\n")
        else:
            model_stamp.unlink()


def shape_differences(m) -> list[str]:
    """How the model folder at m.path differs from the shape model.tiny_* ask (m: config.ModelConfig),
    as 'field folder -> config' strings; [] when it matches. A folder built by an older tiny.yaml
    (4 layers, say) would otherwise be reused, and give other figures than the config's."""
    with open(Path(m.path) / "config.json") as fh:
        have = json.load(fh)
    want = {"model_type": m.tiny_family, "hidden_size": m.tiny_hidden_size, "num_hidden_layers": m.tiny_layers,
            "num_attention_heads": m.tiny_heads, "num_key_value_heads": m.tiny_kv_heads,
            "intermediate_size": m.tiny_intermediate_size or 3 * m.tiny_hidden_size}
    return [f"{k} {have.get(k)} -> {v}" for k, v in want.items() if have.get(k) != v]


def _is_toy_set(train_path) -> bool:
    """Whether a records file was written by toy/prepare_toy.py (its first record's source)."""
    import json
    with open(train_path) as fh:
        first = fh.readline()
    try:
        return json.loads(first).get("source") == "toy"
    except (json.JSONDecodeError, AttributeError):
        return False


def tokenizer_corpus(cfg, gold_texts) -> list[str]:
    """Text the tiny tokenizer is trained on: rendered prompts, gold SQL, the protocol strings, and
    the warm start's gold turns with their observations. Without them the tags protocol's reminder
    ('<reminder>You have 2 turns left to complete the task.</reminder>') cost 30 tokens and the
    observations 107k of the toy warm start's 327k tokens; trained on them: 14, and 56k of 277k."""
    from sqltask import dataset, prompts
    exs = dataset.load_examples(cfg.data.train_path, cfg.data.db_root)
    # the warm start's own turns and observations (the reminder; DESCRIBE's tables in the actions protocol)
    texts = gold_texts(exs, cfg, [dataset.abs_db_path(ex, cfg.data.db_root) for ex in exs])
    for ex in exs:
        for msg in prompts.build_messages(ex, cfg.data.db_root, cfg.data, cfg.env.protocol):
            texts.append(msg["content"])
        texts.append(f"<think>{cfg.sft.think_text}</think>\n<sql>{ex['gold_sql']}</sql>")
        for look in (ex.get("first_lookup_sql"), ex.get("lookup_sql")):  # the toy set's tool turns:
            if look:                                                    # their words ("LIKE") get tokens too
                texts.append(f"<sql>{look}</sql>")
        texts.append(f"<solution>{ex['gold_sql']}</solution>")
    return texts
