"""Dynamic loss scaling for float16 compute (model.dtype float16): the loss is multiplied by a
scale before backward, the fp32 master gradients are divided by it before clipping, and a step
whose gradients are not finite is skipped and the scale lowered. torch.amp.GradScaler's rule, on
FSDP2's fp32 master shards:

    scaler = LossScaler(cfg.optim, compute_dtype(cfg), warn=log.print)   # inactive unless float16
    scaler.scale(loss * world).backward()                                # every micro-batch
    grad_norm = optim.step_optimizer(model, opt, sched, cfg.optim, scaler)  # unscale, clip, step or skip, update

Why: fp16 has 5 exponent bits. Its smallest normal number is 6.1e-5 (subnormals to 6e-8), and
gradients of a token-mean loss over thousands of tokens sit below that, so in fp16 they flush
to zero. Scaled by 2^16 they are representable; the largest fp16 value is 65504, so a scale too
large overflows to inf, which is seen in the gradient norm (clip_grad_norm_'s total norm is
global over ranks under FSDP2, so every rank sees the same verdict and skips the same steps).

Three outcomes per optimizer step (update()):
- clean: gradients finite. After optim.loss_scale_interval clean steps in a row the scale is
  multiplied by optim.loss_scale_growth, up to MAX_SCALE (2^127, float32's largest power of two:
  torch.amp.GradScaler keeps its float32 scale finite the same way; a Python float would grow on
  past float32's range, and the scaled loss, a float32 tensor, would then be inf on every step).
- overflow: the loss was finite on every rank but the scaled gradients were not. The step is
  skipped, the scale multiplied by optim.loss_scale_backoff (counted in overflow_skips) and the
  count of clean steps starts again from 0. Expected a few times at the start while the scale
  comes down to what the gradients allow.
- non-finite loss: the forward itself produced inf/NaN (in fp16: an activation above 65504) in
  any micro-batch of the step, on any rank. No scale fixes that; the step is skipped, counted in
  nonfinite_skips (it is a `skipped` step: train.max_bad_steps of those in a row stop the run),
  the scale is kept, the clean count starts again, and the first one is reported as an fp16
  activation overflow, once per run (a resumed run remembers it did).

Inactive (float32, bfloat16: their exponent is fp32's): scale 1, scale() returns the loss,
update() does nothing; the optimizer step is what it was without a scaler.
The state (scale, the clean-step count, both skip counts, whether the overflow was reported) is
plain numbers: state_dict() goes into the checkpoint's trainer.pt (weights_only loads it) and a
resumed run continues exactly.

Every place float16 changes a run, in the order a step meets them:
- config.py ModelConfig.dtype and OptimConfig.loss_scale_*; trainer/config_checks.py RANGES (the
  loss_scale_* ranges), dtype_problem and check_device_dtype (bfloat16 on a GPU without it: the
  error names float16).
- trainer/distributed.py compute_dtype (model.dtype -> torch.float16), shard (FSDP2's
  MixedPrecisionPolicy: fp16 parameters gathered for forward/backward, fp32 masters and fp32
  gradient reduce), memory_estimate (2 bytes per compute-dtype value).
- model.py Linear.forward: on CPU an fp16 matmul runs in fp32 and rounds once (what a GPU's fp16
  GEMM does; torch's CPU fp16 kernel is slow); Transformer._chunk_logprobs casts the logits to fp32
  before the log-softmax (model.fp32_lm_head: the head's matmul in fp32 too).
- the sampler: trainer/policy_sampler.py PolicySampler.__init__ (its weight copy in the compute
  dtype) and engine/engine.py Engine.__init__ (engine/paged_attention.py PagedKVCache.for_model:
  the KV cache in the compute dtype).
- where the loss is scaled: train.py update (each micro-batch, scaler.scale(loss * world)) and
  sft.py run_sft (the warm start's micro-batches); the warm start and GRPO share train.py main's
  one scaler.
- where it is unscaled and clipped: trainer/optim.py step_optimizer (unscale_, then
  clip_grad_norm_ on the true norm, then the step or the skip, then update()).
- where skips are counted: this file (update: overflow or non-finite loss) and
  trainer/policy_update.py UpdateMetrics (step: an overflow is not a `skipped` step, and the
  logged grad_norm is the mean over the steps taken); train.py main turns `skipped` into
  train.max_bad_steps.
- the checkpoint state: state_dict() under the key "loss_scale" of trainer.pt's extras, written
  by train.py main's checkpoint.save calls and sft.py run_sft's save, read back by train.py main
  and run_sft (load_state_dict).
Tests: .venv/bin/pytest tests/test_fp16.py tests/test_loss_scale.py
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from trainer.distributed import collective_device

MAX_SCALE = 2.0 ** 127  # float32's largest power of two: the scale never grows past it


class LossScaler:
    def __init__(self, optim_cfg: "config.OptimConfig", dtype: torch.dtype, warn: Callable[[str], None] = print):
        """optim_cfg: the optim config group (loss_scale_init, _growth, _backoff, _interval); dtype:
        the compute dtype (active only for float16); warn: where the one-time activation-overflow
        line goes."""
        self.active = dtype == torch.float16
        self.growth, self.backoff = optim_cfg.loss_scale_growth, optim_cfg.loss_scale_backoff
        self.interval = optim_cfg.loss_scale_interval
        self.scale_value = min(float(optim_cfg.loss_scale_init), MAX_SCALE) if self.active else 1.0
        self.clean_steps = 0  # clean optimizer steps since the last skip or growth
        self.overflow_skips = 0  # steps skipped because the scaled gradients overflowed (cumulative)
        self.nonfinite_skips = 0  # steps skipped because the loss itself was not finite (cumulative)
        self.last = ""  # the last update()'s verdict: clean, overflow, nonfinite_loss ('' inactive)
        self.warn, self.warned = warn, False
        self._loss_finite = None  # () bool tensor: every loss scaled since the last update was finite

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss x the scale, for backward. Notes (without a host sync) whether the loss was finite."""
        if not self.active:
            return loss
        finite = torch.isfinite(loss.detach()).all()
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        return loss * self.scale_value

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Divide the gradients (fp32 master shards under FSDP2) by the scale, in place: exact, the
        scale is a power of two with the default settings. Before clipping, so grad_clip reads true norms."""
        if not self.active:
            return
        inv = 1.0 / self.scale_value
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)

    def update(self, grads_finite: bool) -> str:
        """After the optimizer step (taken or skipped on grads_finite, the same on every rank):
        'clean', 'overflow' or 'nonfinite_loss' (module docstring); '' when inactive. Collective
        when active and the gradients were not finite: the ranks agree whether any loss was non-finite."""
        self.last = self._verdict(grads_finite) if self.active else ""
        return self.last

    @property
    def overflowed(self) -> bool:
        """The last optimizer step was skipped for an fp16 gradient overflow."""
        return self.last == "overflow"

    def _verdict(self, grads_finite: bool) -> str:
        loss_finite = self._loss_finite if self._loss_finite is not None else torch.ones((), dtype=torch.bool)
        self._loss_finite = None
        if grads_finite:
            self.clean_steps += 1
            if self.clean_steps >= self.interval:
                self.scale_value = min(self.scale_value * self.growth, MAX_SCALE)
                self.clean_steps = 0
            return "clean"
        self.clean_steps = 0
        flag = loss_finite.to(torch.float32).reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = flag.to(collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # a non-finite loss on any rank
        if bool(flag.item()):
            self.scale_value *= self.backoff
            self.overflow_skips += 1
            return "overflow"
        self.nonfinite_skips += 1
        if not self.warned:
            self.warned = True
            self.warn("WARNING: fp16 activation overflow: the "
                      "forward's loss is not finite (most likely an activation passed float16's largest value, 65504), so no "
                      "loss scale can help; the step was skipped. If it repeats: --model.dtype=bfloat16 where the "
                      "device has it, or float32 (reported once; later ones count in train/nonfinite_skips)")
        return "nonfinite_loss"

    def metrics(self) -> dict[str, float]:
        """train/ metrics of the scaler's state: the scale and the cumulative skip counts (empty when inactive)."""
        if not self.active:
            return {}
        return {"loss_scale": self.scale_value, "overflow_skips": float(self.overflow_skips),
                "nonfinite_skips": float(self.nonfinite_skips)}

    def summary(self) -> str:
        """One line of what the scaler did so far ('' when inactive)."""
        if not self.active:
            return ""
        return (f"loss scale {self.scale_value:g} ({self.overflow_skips} steps skipped for overflow, "
                f"{self.nonfinite_skips} for a non-finite loss)")

    def state_dict(self) -> dict[str, float | int | bool]:
        """Plain numbers (a checkpoint's trainer.pt loads them with weights_only=True)."""
        return {"scale": self.scale_value, "clean_steps": self.clean_steps, "overflow_skips": self.overflow_skips,
                "nonfinite_skips": self.nonfinite_skips, "warned": self.warned}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore state_dict()'s values; None (a checkpoint saved before loss scaling, or by a run
        in another dtype) keeps the initial state."""
        if not state or not self.active:
            return
        self.scale_value, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
        self.overflow_skips, self.nonfinite_skips = int(state["overflow_skips"]), int(state["nonfinite_skips"])
        self.warned = bool(state.get("warned", False))

