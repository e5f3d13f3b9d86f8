"""The low-memory mode's shared base (`model.share_base` with `model.lora_rank > 0`): the frozen reference is the
actor's own module with its LoRA adapters switched off, instead of a second copy of the weights.

With LoRA the actor's base weights never change, so "the base model" and "the actor with its adapters disabled"
compute the same function. `AdapterOffReference` is what `RLParts.reference` holds in that mode: an object that
`recipes/policy_update.py:forward_logprobs` and `engines/policy_forward.py:sequence_logprobs` use like a model.
`sequence_logprobs` calls `unwrap(model, peft=True)` (this object: it is no wrapper and has no `get_base_model`),
then `get_decoder()` and `get_output_embeddings()`; the decoder given here runs the actor's decoder inside peft's
`disable_adapter()`, in eval mode and without autograd, then puts the actor's mode back. The head (peft's
`all-linear` never adapts the output layer) is the actor's own.

`sequence_logprobs` calls these submodules directly (for the actor itself it calls the same submodules inside the
engine's forward), so DeepSpeed's ZeRO-3 module hooks gather the partitioned weights as in the actor's passes; the
reference's passes run without autograd, so the engine's per-forward gradient-accumulation bookkeeping has nothing
to count for them.

peft's `disable_adapter()` also sets `requires_grad=False` on the adapters and `True` again on exit; DeepSpeed keeps
its gradient hooks across that (`tests/engines/test_shared_base.py` trains after reference passes).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ds_rlhf.engines.models import unwrap


class _AdapterOffCall:
    """A submodule of the actor called with the actor's adapters disabled (what `get_decoder()` returns)."""

    def __init__(self, owner: AdapterOffReference, module: torch.nn.Module):
        self.owner, self.module = owner, module

    def __call__(self, *args, **kwargs):
        with self.owner.adapter_off():
            return self.module(*args, **kwargs)


class AdapterOffReference:
    """The frozen reference as a view of a LoRA actor (an engine or a peft module): no weights of its own."""

    role = "reference"
    trainable = False

    def __init__(self, actor):
        peft_module = unwrap(actor)
        if not callable(getattr(peft_module, "disable_adapter", None)):
            raise ValueError("model.share_base=true takes the reference from the actor with its LoRA adapters "
                             f"disabled, but the actor ({type(peft_module).__name__}) has no adapters: set "
                             "--model.lora_rank > 0, or --model.share_base false for a separate reference model")
        self.actor = actor
        self._peft = peft_module
        self._base = unwrap(actor, peft=True)

    @contextmanager
    def adapter_off(self):
        """The actor's base model: adapters disabled, eval mode, no autograd; the actor's state is restored after."""
        training = self._peft.training
        self._peft.train(False)
        try:
            with torch.no_grad(), self._peft.disable_adapter():
                yield self._base
        finally:
            self._peft.train(training)

    # ---- what sequence_logprobs / forward_logprobs use ----
    def get_decoder(self) -> _AdapterOffCall:
        return _AdapterOffCall(self, self._base.get_decoder())

    def get_output_embeddings(self) -> torch.nn.Module:
        return self._base.get_output_embeddings()

    def eval(self) -> AdapterOffReference:
        return self  # every pass runs in eval mode (adapter_off); the actor's own mode is left alone

    def train(self, mode: bool = True) -> AdapterOffReference:
        return self  # frozen

    def __call__(self, *args, **kwargs):
        """A full forward of the base model (logits), like calling a frozen reference engine."""
        with self.adapter_off():
            return self._peft(*args, **kwargs)

    def parameters(self):
        return iter(())  # owns no weights: they are the actor's

    def num_parameters(self) -> int:
        return 0
