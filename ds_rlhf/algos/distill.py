"""Full-distribution distillation losses (pure functions of logits)."""

from __future__ import annotations

import torch


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """Token mean over `N` response tokens of DeepSpeed's generalized Jensen-Shannon divergence between the student's
    and the teacher's next-token distributions (`deepspeed.runtime.rollout.opsd.generalized_jsd_loss`), from logits
    `[N, V]` each (computed in fp32, both divided by `temperature`). `beta` 0: forward KL(teacher || student);
    1: reverse KL(student || teacher); between: `beta KL(t || m) + (1 - beta) KL(s || m)` with the mixture
    `m = beta t + (1 - beta) s`. Gradient flows into `student_logits` only if the caller detaches the teacher's.
    0 for `N` = 0 (still in the graph)."""
    from deepspeed.runtime.rollout.opsd import generalized_jsd_loss  # deepspeed is imported lazily

    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 2:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must both be [N, V]")
    mask = torch.ones(1, student_logits.shape[0], device=student_logits.device)
    out = generalized_jsd_loss(student_logits.float()[None], teacher_logits.float()[None], mask, beta=beta,
                               temperature=temperature)
    return out.loss
