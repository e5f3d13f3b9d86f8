"""1-bit Adam (Tang et al. 2021): full Adam while the variance settles, then frozen variance and a 1-bit
compressed, error-compensated all-reduce of the momentum instead of the gradient all-reduce.

Why our own: DeepSpeed removed its OneBitAdam in 0.19.7, and it never supported ZeRO. This one runs inside a
DeepSpeed engine at ZeRO stage 0 (``builder.build_engine`` selects it from ``"optimizer": {"type": "OneBitAdam"}``;
other stages are refused, see ``ds_config.check_optimizer_compat``) and uses torch.distributed directly.

Phases, with t the step number (1-based):

- t <= freeze_step (warm-up): exactly ``torch.optim.AdamW`` (same op order as its single-tensor path, so fp32
  results are bit-identical); DeepSpeed's engine all-reduces the gradients as usual.
- t > freeze_step: the engine's gradient all-reduce is switched off (``engine.enable_backward_allreduce = False``);
  each rank folds its *local* gradient into the synchronised momentum, the momenta are averaged with
  ``CompressedAllReduce`` (identical result on every rank), and the update divides by the frozen variance.
  Bias correction keeps using ``1 - beta1**t`` for the momentum and ``1 - beta2**freeze_step`` for the variance.
  Gradient clipping (DeepSpeed's) then acts on each rank's local gradient norm: there is no global gradient.

bf16/fp16: under a DeepSpeed bf16/fp16 config the engine wraps this optimizer (fp32 master weights, loss scaling
for fp16; its overflow check is all-reduced once the gradient all-reduce is off), so the optimizer sees fp32. Used
directly on low-precision parameters, states and the update are kept in fp32 and copied back.

Checkpoints: ``state_dict`` holds the moments (identical on all ranks) and the step; the per-rank error buffers
come from ``error_state_dict`` and are saved per rank by ``checkpoint.save_checkpoint``.
"""

from __future__ import annotations

import logging
import os

import torch

from ds_rlhf.engines.compression import CompressedAllReduce

logger = logging.getLogger(__name__)

CONFIG_KEYS = {"lr", "betas", "eps", "weight_decay", "freeze_step", "chunk_size", "log_every"}


class OneBitAdam(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 freeze_step: int = 100, chunk_size: int = 128, group=None, log_every: int = 1):
        if freeze_step < 1:
            raise ValueError(f"freeze_step must be >= 1 (the variance needs a warm-up), got {freeze_step}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.freeze_step, self.chunk_size, self.group, self.log_every = int(freeze_step), chunk_size, group, log_every
        self.global_step = 0
        self._engine = None
        self._comm: CompressedAllReduce | None = None
        self._pending_errors: dict | None = None
        self.last_comm: dict = {}
        self.comm_totals = {"compressed_bytes": 0, "fp32_allreduce_bytes": 0, "compressed_steps": 0}

    @property
    def compressing(self) -> bool:
        """True once warm-up is over: the next step uses local gradients and compressed momentum."""
        return self.global_step >= self.freeze_step

    def bind_engine(self, engine) -> None:
        """Let the optimizer switch the engine's gradient all-reduce off after warm-up (and back on after a load)."""
        if getattr(engine, "mpu", None) is not None:
            raise ValueError("OneBitAdam supports pure data parallelism only (the engine has a model-parallel mpu)")
        self._engine = engine
        self._apply_comm_mode()

    def _apply_comm_mode(self) -> None:
        if self._engine is not None:
            self._engine.enable_backward_allreduce = not self.compressing

    def _params(self):
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.global_step == 0 and self._is_state_probe():
            return loss
        t = self.global_step + 1
        compress = t > self.freeze_step
        work = []  # (param, fp32 view of the param, group)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                param = p if p.dtype == torch.float32 else p.float()
                grad = p.grad if p.grad.dtype == torch.float32 else p.grad.float()
                if wd != 0:
                    param.mul_(1 - lr * wd)
                state["exp_avg"].lerp_(grad, 1 - beta1)
                if not compress:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                work.append((p, param, group))
        if compress and work:
            self._sync_momentum([self.state[p]["exp_avg"] for p, _, _ in work])
        for p, param, group in work:
            beta1, beta2 = group["betas"]
            bias_correction1 = 1 - beta1 ** t
            bias_correction2 = 1 - beta2 ** min(t, self.freeze_step)
            step_size = group["lr"] / bias_correction1
            denom = (self.state[p]["exp_avg_sq"].sqrt() / bias_correction2 ** 0.5).add_(group["eps"])
            param.addcdiv_(self.state[p]["exp_avg"], denom, value=-step_size)
            if param is not p:
                p.copy_(param)
        self.global_step = t
        if t == self.freeze_step:
            logger.info("1-bit Adam: warm-up done after %d steps; variance frozen, momentum compression on", t)
            self._apply_comm_mode()
        return loss

    def _is_state_probe(self) -> bool:
        """DeepSpeed's fp16/bf16 wrapper calls ``step()`` once at start-up with all-zero gradients just to create
        optimizer state. Counting that as step 1 would shift bias correction and apply weight decay, so the first
        call with only zero gradients creates the state and returns."""
        params = self._params()
        if any(self.state[p] for p in params) or any(p.grad.any() for p in params):
            return False
        for p in params:
            self.state[p]["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            self.state[p]["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        return True

    def _sync_momentum(self, moments: list[torch.Tensor]) -> None:
        flat = torch.cat([m.reshape(-1) for m in moments])
        if self._comm is None or self._comm.numel != flat.numel():
            self._comm = CompressedAllReduce(flat.numel(), flat.device, self.chunk_size, self.group)
            if self._pending_errors is not None:
                self._comm.load_state_dict(self._pending_errors)
                self._pending_errors = None
        synced = self._comm(flat)
        offset = 0
        for m in moments:
            m.copy_(synced[offset: offset + m.numel()].view_as(m))
            offset += m.numel()
        self.last_comm = dict(self._comm.last_stats, step=self.global_step + 1, compressed=True)
        for key in ("compressed_bytes", "fp32_allreduce_bytes"):
            self.comm_totals[key] += self.last_comm[key]
        self.comm_totals["compressed_steps"] += 1
        if self.log_every and self.comm_totals["compressed_steps"] % self.log_every == 0 and _rank() == 0:
            logger.info("1-bit Adam step %d: sent %d bytes/rank vs %d for an fp32 all-reduce (ratio %.4f)",
                        self.last_comm["step"], self.last_comm["compressed_bytes"],
                        self.last_comm["fp32_allreduce_bytes"], self.last_comm["ratio"])

    # -- checkpointing -------------------------------------------------------------------------------------------
    def state_dict(self):
        state = super().state_dict()
        state["onebit"] = {"global_step": self.global_step, "freeze_step": self.freeze_step,
                           "chunk_size": self.chunk_size}
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        super().load_state_dict(state_dict)
        if extra is not None:
            self.global_step = extra["global_step"]
        self._apply_comm_mode()

    def error_state_dict(self) -> dict | None:
        """This rank's error-feedback buffers (None before the first compressed step)."""
        if self._comm is not None:
            return self._comm.state_dict()
        return self._pending_errors

    def load_error_state_dict(self, state: dict | None) -> None:
        if state is None:
            self._comm, self._pending_errors = None, None
        elif self._comm is not None:
            self._comm.load_state_dict(state)
        else:
            self._pending_errors = state


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def onebit_from_config(opt_cfg: dict, param_groups) -> OneBitAdam:
    """Build OneBitAdam from a resolved ds_config ``"optimizer"`` section (unknown keys are an error)."""
    params = dict(opt_cfg.get("params", {}))
    unknown = set(params) - CONFIG_KEYS
    if unknown:
        raise ValueError(f"unknown OneBitAdam params in ds_config: {sorted(unknown)}; allowed: {sorted(CONFIG_KEYS)}")
    if "freeze_step" not in params:
        raise ValueError("ds_config key 'optimizer.params.freeze_step' is required for OneBitAdam")
    return OneBitAdam(param_groups, **params)


def find_onebit(engine) -> OneBitAdam | None:
    """The OneBitAdam inside a DeepSpeed engine (possibly wrapped by its fp16/bf16 optimizer), if any."""
    for opt in (getattr(engine, "basic_optimizer", None), getattr(engine, "optimizer", None)):
        while opt is not None:
            if isinstance(opt, OneBitAdam):
                return opt
            opt = getattr(opt, "optimizer", None)
    return None
