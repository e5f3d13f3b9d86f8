"""The methods ds_rlhf runs inside vLLM's workers: `WeightSyncWorkerExtension`, injected into vLLM's worker class
through `worker_extension_cls` (`vllm_handle.VLLMHandle` names it by `EXTENSION`) and reached with `collective_rpc`.

With the in-process executors ("uni", and the SPMD "external_launcher" which subclasses it) `collective_rpc` calls
the worker directly with our tensors, so a colocated sync copies trainer tensors straight into vLLM's parameters on
the same device: nothing goes through the host. For a disaggregated engine the same extension joins a dedicated
weight group and receives flattened buckets.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ds_rlhf.rollout.vllm_shared import shared_report
from ds_rlhf.rollout.weights.group import WeightGroup, bucket_nbytes, plan_from_wire, unpack_bucket

EXTENSION = "ds_rlhf.rollout.vllm_worker.WeightSyncWorkerExtension"


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); methods run inside each vLLM worker.

    Names carry a `ds_rlhf_` prefix because vLLM refuses extensions whose attributes collide with the worker's.
    """

    def _ds_rlhf_model(self):
        return self.model_runner.model

    def ds_rlhf_load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._ds_rlhf_model().load_weights(iter(named_tensors))

    def _ds_rlhf_reload_target(self):
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def ds_rlhf_begin_reload(self) -> None:
        """Start vLLM's layerwise reload (what its own weight-transfer engines run around an update): the layers go
        back to the parameters they were built with (bf16 for online FP8), later `load_weights` calls buffer into
        them, and each layer is processed (quantized) and copied into its running tensors once complete."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self._ds_rlhf_reload_target())

    def ds_rlhf_end_reload(self) -> None:
        """Finish the layerwise reload: process the layers not completed yet, restore the untouched ones."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self._ds_rlhf_reload_target(), self.model_config)

    def ds_rlhf_reseed(self, seed: int) -> None:
        """Seed the generators vLLM's sampler draws from for requests without a seed of their own (torch's
        default CPU and CUDA generators of this worker; vLLM seeds the same ones at start-up)."""
        torch.manual_seed(seed)

    def ds_rlhf_packed_layers(self) -> list[str]:
        """Layers whose weights the CPU backend moved into a packed kernel (empty weight): sync can't reach them."""
        return [name for name, mod in self._ds_rlhf_model().named_modules()
                if hasattr(mod, "cpu_linear") and getattr(getattr(mod, "weight", None), "numel", lambda: 1)() == 0]

    def ds_rlhf_shared_report(self) -> dict:
        """`rollout.weight_transport shared`: the layout our loader placed the model in (HF name, element offset,
        shape per component) and the bytes of parameters outside the trainer's buffer (`vllm_shared.py`)."""
        return shared_report(self._ds_rlhf_model())

    def ds_rlhf_init_weight_group(self, host: str, port: int, world_size: int, backend: str,
                                  timeout_s: float) -> None:
        device = next(self._ds_rlhf_model().parameters()).device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # rank 0 is the trainer; vLLM worker r (its global rank inside this engine) is rank 1 + r.
        self._ds_rlhf_group = WeightGroup(host, port, world_size, 1 + int(self.rank), backend, timeout_s, device)

    def ds_rlhf_receive_buckets(self, wire_plan) -> None:
        group = getattr(self, "_ds_rlhf_group", None)
        if group is None:
            raise RuntimeError("weight group not initialised: call ds_rlhf_init_weight_group first")
        model = self._ds_rlhf_model()
        for metas in plan_from_wire(wire_plan):
            buf = torch.empty(bucket_nbytes(metas), dtype=torch.uint8, device=group.device)
            group.broadcast(buf).wait()
            model.load_weights(iter(unpack_bucket(buf, metas)))
            del buf

    def ds_rlhf_close_weight_group(self) -> None:
        group = getattr(self, "_ds_rlhf_group", None)
        if group is not None:
            group.close()
            self._ds_rlhf_group = None
