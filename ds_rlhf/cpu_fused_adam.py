"""DeepSpeed's `FusedAdam` on the CPU accelerator, without the C++ JIT build of its `fused_adam` op.

A ds_config with `"optimizer": {"type": "Adam"|"AdamW"}` and no optimizer offload gets DeepSpeed's `FusedAdam`. On
the CPU accelerator its constructor JIT-compiles `fused_adam` (csrc/cpu/adam/fused_adam.cpp + cpu_adam_impl.cpp
against torch's headers: about 90 s on two cores), paid once per fresh extensions directory, i.e. by every fresh
checkout, CI run and `make demo`. That op is DeepSpeed's CPU Adam step (`ds_adam_step`) applied tensor by tensor;
`multi_tensor_adam` below is the same update in torch ops, with the op's signature, so `FusedAdam` itself (its
param groups, state layout, checkpoints, ZeRO wrappers) is unchanged and only its kernel is torch's.

The update, as cpu_adam_impl.cpp computes it (fp32 arithmetic, state in the state tensors' dtype):
    L2 mode (mode 0):   g += weight_decay * p
    m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
    denom = sqrt(v) / sqrt(1 - beta2^t) + eps          (bias corrections only with bias_correction=1)
    AdamW mode (mode 1): p -= lr * weight_decay * p
    p -= lr / (1 - beta1^t) * m / denom

`install()` makes the CPU accelerator's `FusedAdamBuilder.load()` return this module instead of compiling; GPUs
keep DeepSpeed's CUDA kernel. `DS_RLHF_NATIVE_CPU_FUSED_ADAM=1` keeps DeepSpeed's compiled op on CPU too.
"""

from __future__ import annotations

import math
import os
import sys

import torch

NATIVE_ENV = "DS_RLHF_NATIVE_CPU_FUSED_ADAM"


@torch.no_grad()  # FusedAdam hands bf16 parameters over as they are (leaves that require grad), not as .data
def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], lr: float,
                      beta1: float, beta2: float, epsilon: float, step: int, mode: int, bias_correction: int,
                      weight_decay: float) -> None:
    """In place, like DeepSpeed's op: tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]."""
    del chunk_size, noop_flag  # the CUDA op's chunking and overflow flag; the CPU op ignores both as well
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 / math.sqrt(1.0 - beta2**step) if bias_correction else 1.0
    for grad, param, exp_avg, exp_avg_sq in zip(*tensor_lists, strict=True):
        g, p = grad.float(), param.float()  # fp32 views of fp32 tensors, fp32 copies of bf16/fp16 ones
        m, v = exp_avg.float(), exp_avg_sq.float()
        if weight_decay > 0 and not mode:
            g = g.add(p, alpha=weight_decay)  # a new tensor: the gradient itself is left alone
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = v.sqrt().mul_(bc2).add_(epsilon)
        if weight_decay > 0 and mode:
            p.add_(p, alpha=-lr * weight_decay)
        p.addcdiv_(m, denom, value=-lr / bc1)
        for out, value in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
            if out.data_ptr() != value.data_ptr():
                out.copy_(value)


def install() -> bool:
    """On the CPU accelerator, serve `FusedAdamBuilder().load()` with this module (no JIT build). Returns whether it
    did (False on GPUs, or with DS_RLHF_NATIVE_CPU_FUSED_ADAM=1). Idempotent."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" or os.environ.get(NATIVE_ENV) == "1":
        return False
    builder = accelerator.get_op_builder("FusedAdamBuilder")
    if getattr(builder.load, "ds_rlhf_torch_op", False):
        return True

    def load(self, verbose=True):  # noqa: ARG001 - OpBuilder.load's signature
        return sys.modules[__name__]

    load.ds_rlhf_torch_op = True
    builder.load = load
    return True
