"""Gradient accumulation through the chunked log-prob head (`engines/policy_forward.py:sequence_logprobs`).

The trainers split an optimizer step into micro-batches, scale each micro-batch's loss themselves and call
`engine.backward(loss, scale_wrt_gas=False)` per micro-batch and `engine.step()` once (DeepSpeed's unmanaged
accumulation, `managed_gradient_accumulation: false`). Any split must give the update of one big batch, at every
ZeRO stage; the tiny model has tied input/output embeddings, so the head weight also gets the embedding's gradient.
"""

from __future__ import annotations

import pytest
import torch

from ds_rlhf.engines.builder import build_actor
from ds_rlhf.engines.hf_export import gather_state_dict
from ds_rlhf.engines.models import unwrap
from ds_rlhf.engines.policy_forward import sequence_logprobs
from tests.engines.workers import resolved

ROWS, LENGTH, STEPS = 8, 12, 2


def _batch():
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(5, 400, (ROWS, LENGTH), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # a padded row: its tail is neither attended to nor scored
    mask[6, 5:] = 0
    return ids, mask


def _loss_sum(engine, ids, mask):
    """Summed token NLL plus a small entropy bonus (the RL losses' two head outputs), over the real tokens."""
    logp, entropy = sequence_logprobs(engine, ids, mask, with_entropy=True, chunk_size=16)
    scored = mask[:, 1:].float()
    return -(logp * scored).sum() - 0.01 * (entropy * scored).sum()


def _train(model_path, config: str, micro: int, lora: dict | None):
    """The parameters after `STEPS` optimizer steps on the batch split into `micro` micro-batches, and the loss
    after them. Plain SGD: the parameter change is the accumulated gradient itself (Adam's normalisation would
    turn float-rounding differences of near-zero gradients into visible ones)."""
    cfg = resolved(config, world_size=1)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.5}}
    cfg["zero_allow_untested_optimizer"] = True  # torch.optim.SGD under ZeRO: DeepSpeed asks to be told
    cfg["managed_gradient_accumulation"] = False  # as run/context.py sets for every trained role
    torch.manual_seed(0)
    engine = build_actor(model_path, cfg, attn_impl="sdpa", lora=lora)
    ids, mask = _batch()
    total = mask[:, 1:].sum()
    for _ in range(STEPS):
        for i, m in zip(ids.chunk(micro), mask.chunk(micro)):
            engine.backward(_loss_sum(engine, i, m) / total, scale_wrt_gas=False)
        engine.step()
    with torch.no_grad():
        loss = float(_loss_sum(engine, ids, mask) / total)
    return gather_state_dict(unwrap(engine)), loss


@pytest.mark.parametrize("config, lora", [("zero2", None), ("zero3", None),
                                          ("zero3", {"r": 8, "lora_alpha": 32})],
                         ids=["zero2", "zero3", "zero3-lora"])
def test_micro_batches_give_the_update_of_one_batch(tiny_model_path, dist_single, config, lora):
    one, one_loss = _train(tiny_model_path, config, 1, lora)
    four, four_loss = _train(tiny_model_path, config, 4, lora)
    assert one.keys() == four.keys()
    worst = {name: (four[name] - one[name]).abs().max().item() for name in one}
    assert max(worst.values()) < 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert abs(four_loss - one_loss) < 1e-5, (four_loss, one_loss)
