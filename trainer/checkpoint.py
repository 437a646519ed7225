"""Checkpoints: atomic, world-size independent, and enough to continue a run exactly.

<out_dir>/ckpt_<step>/
    hf/            HF folder (config.json, model.safetensors, tokenizer): transformers loads it
                   (LoRA runs: the merged weights, only with model.lora_save_merged)
    adapter/       LoRA runs only: adapter_config.json + adapter_model.safetensors in PEFT's format,
                   PeftModel.from_pretrained(base, ckpt/adapter) loads it; the frozen base is not
                   saved again (it is model.path, or <out_dir>/base after a warm start)
    trainer.pt     optimizer (full state dict), scheduler, RNG states of every rank, step, extras:
                   tensors, lists, dicts, numbers and strings only, read back with
                   torch.load(weights_only=True), so resuming from a shared checkpoint runs no
                   code it carries (a trainer.pt that pickles anything else is refused, unread)
    config.yaml    the resolved config of the run
<out_dir>/warm_start/  the SFT warm start's save, laid out the same (sft.run_sft writes it every
                   sft.save_every steps, at its end and at a stop; the next run continues from it).
                   Superseded by ckpt_000000: removed once that is written

Written to a temporary folder and renamed into place, so a kill never leaves a half checkpoint.
Under FSDP2 the full state dicts are gathered to rank 0 (cpu_offload) on save; on load only
rank 0 reads the files and broadcasts into every rank's shards, so a run saved on N ranks
resumes on M and a node reads one copy, not one per rank.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from trainer import lora, runguard
from trainer.config_loader import ConfigError, all_keys, dump, from_dict


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    """This process's RNG states in plain types (tensors, lists, numbers, strings): what
    torch.load(weights_only=True) reads back without unpickling any object. numpy's and Python's
    states are tuples holding an ndarray / 625 ints: they are taken apart here."""
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
            "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict):
    """Restore rng_state()'s dict (or the tuples an older checkpoint of this project stored)."""
    torch.set_rng_state(s["torch"])
    n = s["numpy"]
    if isinstance(n, dict):
        n = (n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    np.random.set_state(n)
    py = s["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]) if isinstance(py, dict) else py)
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def full_model_state(model) -> dict:
    """Full (unsharded) state dict on rank 0's CPU; {} on other ranks. Works sharded or not."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


def save(out_dir: str, step: int, model, optimizer, scheduler, tokenizer, cfg, extra: dict,
         keep: int = 2, name: str = "") -> str | None:
    """Collective: every rank must call it. Returns the checkpoint path on rank 0. extra: plain
    types only (see the module docstring). name: the folder (replaced atomically; default
    ckpt_<step>, of which the `keep` latest are kept)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    lora_run = hasattr(model, "lora_spec")
    # LoRA: gather the adapters only (the base is frozen and on disk already), unless merged
    # HF weights are asked for
    msd = get_model_state_dict(model, options=opts) if not lora_run or cfg.model.lora_save_merged \
        else adapter_full_state(model)
    osd = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer is not None else None
    rngs = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(rngs, rng_state())
    else:
        rngs[0] = rng_state()
    path = None
    if _rank() == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        final = out / (name or f"ckpt_{step:06d}")
        tmp = out / f".tmp_{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        if lora_run:
            lora.save_adapter(model, tmp / "adapter", base_path=lora_base_path(cfg), state_dict=msd)
            if cfg.model.lora_save_merged:
                export_hf(model, lora.merged_state_dict(model, msd), tmp / "hf", tokenizer)
        else:
            export_hf(model, msd, tmp / "hf", tokenizer)
        torch.save({"step": step, "optimizer": osd, "scheduler": scheduler.state_dict() if scheduler else None,
                    "rng": rngs, "extra": extra}, tmp / "trainer.pt")
        (tmp / "config.yaml").write_text(dump(cfg))
        if tokenizer is not None:
            (tmp / "vocab_digest").write_text(vocab_digest(tokenizer) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # atomic on one filesystem
        # ckpt_000000 (the policy at GRPO start, after any warm start) is always kept: it is
        # the KL reference and the "before" of every comparison
        old = [p for p in sorted(out.glob("ckpt_*"))[:-keep] if p.name != "ckpt_000000"] \
            if keep > 0 and not name else []
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
        path = str(final)
    _barrier()
    return path


def adapter_full_state(model) -> dict:
    """{name: full fp32 CPU tensor} of the trainable parameters (the LoRA adapters). Collective:
    each DTensor's full_tensor() all-gathers it, in the same parameter order on every rank."""
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[n] = t.detach().to("cpu", torch.float32)
    return out if _rank() == 0 else {}


def lora_base_path(cfg) -> str:
    """The frozen base a LoRA run adapts: model.path, or after an SFT warm start of the full
    model, the warm weights in <out_dir>/base (written once, before LoRA is applied)."""
    return str(Path(cfg.train.out_dir) / "base") if cfg.sft.steps > 0 else cfg.model.path


def export_hf(model, full_sd: dict, folder: Path, tokenizer=None):
    """Write an HF folder from a gathered full state dict (rank 0 only)."""
    model.save_pretrained(str(folder), state_dict=full_sd)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))


WARM_START = "warm_start"  # <out_dir>/warm_start: the warm start's save


def warm_start_save(out_dir: str) -> str | None:
    """<out_dir>/warm_start when a warm start saved there (written whole or not at all)."""
    path = Path(out_dir) / WARM_START
    return str(path) if (path / "trainer.pt").exists() else None


def set_aside(out_dir: str) -> str | None:
    """A fresh start (train.resume=false) in an out_dir that holds an earlier run's checkpoints
    (or its warm start's save): they move to <out_dir>/earlier-<time>/ (rank 0, before anything is
    saved). Left in place, the old ckpt_000024 would outlive the new run's ckpt_000008 in the
    pruning (by step order) and a later resume would continue the old run. Returns the folder they
    went to, or None."""
    old = sorted(Path(out_dir).glob("ckpt_*")) + sorted(Path(out_dir).glob(WARM_START)) \
        if Path(out_dir).is_dir() else []
    if not old:
        return None
    import time
    dest = Path(out_dir) / f"earlier-{time.strftime('%Y%m%d-%H%M%S')}"
    dest.mkdir()
    for path in old:
        path.rename(dest / path.name)
    return str(dest)


def latest(out_dir: str) -> str | None:
    ckpts = sorted(Path(out_dir).glob("ckpt_*")) if Path(out_dir).is_dir() else []
    return str(ckpts[-1]) if ckpts else None


def load(path: str, model, optimizer, scheduler) -> dict:
    """Collective. Loads weights (a LoRA model: its adapters), optimizer, scheduler and this
    rank's RNG; returns the extras.

    Only rank 0 reads the files: the weights and the optimizer's full state are broadcast from
    it and each rank keeps its own shard (broadcast_from_rank0), the small rest (step, scheduler,
    every rank's RNG state) goes by one broadcast_object_list. The saved files are full state
    dicts, so any world size can load them."""
    rank = _rank()
    sd, osd, meta, error = {}, {}, None, ""
    if rank == 0:
        from safetensors.torch import load_file
        try:
            blob = read_trainer_state(Path(path) / "trainer.pt")
        except runguard.RunError as e:  # every rank raises it (below), none waits in a collective
            error = str(e)
    if rank == 0 and not error:
        if hasattr(model, "lora_spec"):  # adapters only: the base was loaded from its own folder
            sd = lora.read_adapter(model, Path(path) / "adapter")
        else:
            for f in sorted((Path(path) / "hf").glob("*.safetensors")):
                sd.update(load_file(str(f)))
            from trainer import hf_folder
            sd = hf_folder.from_hf(sd, model.config)  # HF names -> ours (fused qkv / gate-up)
            if model.config.tie_word_embeddings:
                sd["lm_head.weight"] = sd["embed_tokens.weight"]
        osd = blob["optimizer"] or {}
        meta = {k: blob[k] for k in ("step", "scheduler", "rng", "extra")}
        meta["has_optimizer"] = blob["optimizer"] is not None
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [meta if not error else {"error": error}]
        dist.broadcast_object_list(box, src=0)
        meta = box[0]
        error = meta.get("error", "")
    if error:
        raise runguard.RunError(error)
    bcast = dist.is_initialized() and dist.get_world_size() > 1
    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, strict=False,
                                                             broadcast_from_rank0=bcast))
    if optimizer is not None and meta["has_optimizer"]:
        set_optimizer_state_dict(model, optimizer, osd,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=bcast))
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    rngs = meta["rng"]
    if rank < len(rngs) and rngs[rank] is not None:
        set_rng_state(rngs[rank])
    return {"step": meta["step"], **meta["extra"]}


# What an older trainer.pt of this project pickled besides tensors and plain data: numpy's RNG
# state, a uint32 ndarray. The weights-only loader rebuilds it from these (numpy's array and dtype
# constructors, nothing that runs code) and the uint32 dtype's class; any other global is refused.
OLD_RNG_GLOBALS = {"numpy.ndarray", "numpy.dtype", "numpy._core.multiarray._reconstruct",
                   "numpy.core.multiarray._reconstruct"}


def read_trainer_state(path) -> dict:
    """A trainer.pt read by torch.load(weights_only=True): tensors, lists, dicts, numbers and
    strings, no object unpickled. Its pickle is scanned first: one that names any other function
    or class (e.g. a crafted file whose unpickling would run a command) is refused, unloaded, with
    a RunError naming the file. An older checkpoint of this project (numpy RNG state) still loads."""
    import importlib
    f = Path(path)
    try:
        unsafe = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(f)))
    except Exception as e:  # not a torch.save zip: a legacy pickle, a truncated file, ...
        raise runguard.RunError(f"{f} is not a checkpoint file this project wrote ({e}): refused, "
                                "nothing loaded") from None
    if set(unsafe) - OLD_RNG_GLOBALS:
        raise runguard.RunError(
            f"{f} refused: it pickles {', '.join(unsafe)}, which torch.load(weights_only=True) does not load "
            "(unpickling it could run any code); nothing was loaded or run. Resume only from checkpoints this "
            "project wrote")
    allowed = [type(np.dtype(np.uint32))] if unsafe else []  # an older checkpoint: numpy's RNG state
    for name in unsafe:
        module, _, attr = name.rpartition(".")
        allowed.append(getattr(importlib.import_module(module), attr))
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise runguard.RunError(f"{f} cannot be read as a checkpoint ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}): refused") from None


def vocab_digest(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary (token -> id): the ids a checkpoint's
    embedding and LM head rows stand for."""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


# keys a resumed run may change: length, cadence, output, logging and the FSDP2 unit layout (the same
# shards either way), never the recipe
RESUMABLE_KEYS = {"train.steps", "train.log_every", "train.sample_every", "train.sample_rows", "train.eval_every",
                  "train.save_every",
                  "train.keep_checkpoints", "train.resume", "train.out_dir", "train.threads",
                  "train.dist_timeout_s", "train.max_bad_steps", "wandb.mode", "wandb.project", "wandb.name",
                  "model.build_tiny", "data.prepare_toy", "env.workers", "model.lora_save_merged",
                  "model.fsdp_unit", "sft.save_every"}


def changed_keys(saved, current) -> list[str]:
    """Keys whose values differ between a checkpoint's config and this run's, minus RESUMABLE_KEYS."""
    a, b = all_keys(saved), all_keys(current)
    return [k for k in a if a[k] != b[k] and k not in RESUMABLE_KEYS]


def check_resumable(ck: str, cfg, tokenizer=None):
    """Refuse to continue a checkpoint trained under another recipe (a silent mix of two runs),
    unless --train.resume=force. Only RESUMABLE_KEYS (length, cadence, logging) may change.
    tokenizer: the run's; a checkpoint saved with another vocabulary is refused too (its weights
    index other tokens: e.g. the tiny model at model.path was built again on a new corpus while
    the out_dir kept the old run's checkpoints, under an unchanged config)."""
    stamp = Path(ck) / "vocab_digest"
    if tokenizer is not None and stamp.exists() and cfg.train.resume != "force":
        if stamp.read_text().strip() != vocab_digest(tokenizer):
            raise ConfigError(f"{ck} was trained with another tokenizer than {cfg.model.path}'s (another "
                              "vocabulary): use another train.out_dir, or --train.resume=force to continue anyway")
    saved = from_dict(type(cfg)(), yaml.safe_load((Path(ck) / "config.yaml").read_text()))  # over the defaults
    diff = changed_keys(saved, cfg)
    if diff and cfg.train.resume != "force":
        a, b = all_keys(saved), all_keys(cfg)
        lines = "\n".join(f"  {k}: {a[k]!r} (checkpoint) -> {b[k]!r} (now)" for k in diff)
        raise ConfigError(f"{ck} was trained with a different config:\n{lines}\n"
                          "use another train.out_dir, or --train.resume=force to continue anyway")
