"""The config schema's sections (`model`, `data`, `optim`, `rollout`, `dpo`, `run`; `rl` in `config_rl.py`): one
dataclass each, every field with its default, its rule (`opt(...)`: choices, bounds) and a `# comment` that `--help`
shows, and the section's own cross-field rules in its `check` (rules that read several sections:
`config_rules.py`). `ds_rlhf/config.py` puts them together (`Config`) and parses, validates and prints them; import
them from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ds_rlhf.errors import ConfigError

# rollout.weight_transport: our IPC buffer / weight group, vLLM's engines, or one buffer the engines' weights live in
WEIGHT_TRANSPORTS = ("own", "vllm", "shared")


def opt(default: Any, *, choices: Any = None, ge: float | None = None, gt: float | None = None,
        le: float | None = None, lt: float | None = None) -> Any:
    """A schema field with its rule: `choices` (a tuple, or the name of an algorithm registry in
    `ds_rlhf.algos.registry.ALL`, read when checked so entries registered later count) and numeric bounds."""
    rule = {k: v for k, v in dict(choices=choices, ge=ge, gt=gt, le=le, lt=lt).items() if v is not None}
    return field(default=default, metadata={"rule": rule})


@dataclass
class ModelConfig:
    path: str = "tiny"  # HF directory or Hub id (org/name[@rev]); "tiny" / "tiny:small" build the offline tiny model
    tokenizer: str = ""  # defaults to `path`
    dtype: str = opt("auto", choices=("auto", "fp32", "bf16", "fp16"))  # auto: bf16 on GPUs with bf16, fp32 on CPU
    attn_impl: str = "auto"  # auto | sdpa | eager | flash_attention_2 | varlen
    kernels: str = opt("auto", choices=("auto", "liger", "none"))  # fused RMSNorm/SwiGLU/rotary; auto: liger on CUDA
    gradient_checkpointing: bool = False
    lora_rank: int = opt(0, ge=0)  # 0 = full fine-tuning
    lora_alpha: int = opt(16, gt=0)
    lora_targets: str = "all-linear"
    share_base: bool = False  # with lora_rank > 0: one frozen base for all roles (reference = actor, adapter off)
    # with lora_rank > 0: the actor's / critic's frozen base linear layers in 4-bit NF4 or int8 (bitsandbytes)
    quantize_base: str = opt("none", choices=("none", "nf4", "int8"))

    def planned_precision(self, device: str) -> str:
        """The trainer's precision as a memory plan on `device` ("cuda" | "cpu") takes it, without probing a GPU:
        `dtype`, auto = bf16 on CUDA, fp32 elsewhere (`engines.ds_config.pick_precision` resolves it for a run)."""
        return self.dtype if self.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")

    def check(self) -> None:
        if self.share_base and self.lora_rank <= 0:
            raise ConfigError("model.share_base=true needs LoRA: the reference is the actor with its adapters "
                              "disabled, and full fine-tuning changes the base weights; set --model.lora_rank (e.g. "
                              "16) or --model.share_base false")
        if self.quantize_base != "none" and self.lora_rank <= 0:  # its ZeRO stage: config_rules
            raise ConfigError(f"model.quantize_base={self.quantize_base} quantizes the frozen base under LoRA "
                              "adapters, and full fine-tuning trains the base weights; set --model.lora_rank (e.g. "
                              "16) or --model.quantize_base none")


@dataclass
class DataConfig:
    train: str = ""  # Arrow store directory written by data_prep/
    eval: str = ""
    eval_fraction: float = opt(0.0, ge=0, lt=1)  # hold out this share of `train` when `eval` is empty (SFT/RM)
    max_prompt_len: int = opt(256, ge=1)  # RL prompt tokens; the store's longest is checked before training
    overlong_prompts: str = opt("error", choices=("error", "drop"))  # RL prompts over max_prompt_len: refuse | skip
    max_len: int = opt(512, ge=2)  # SFT/RM sequence length
    micro_batch_tokens: int = opt(0, ge=0)  # token budget per micro-batch; 0 = fixed `optim.micro_batch_size`
    rl_packing: bool = False  # RL: each micro-batch as one padding-free packed row (needs micro_batch_tokens)
    # RL log-prob passes: each group's shared prompt forwarded once (recipes/shared_prompt_batch.py); auto: on with
    # rollout.n_samples > 1, no rl_packing and a prompt share worth it (recipes/policy_update.py:shared_prompt)
    rl_shared_prompt: str = opt("auto", choices=("auto", "on", "off"))
    shuffle: bool = True
    reader: str = opt("auto", choices=("auto", "uring", "mmap"))  # auto | uring | mmap

    def check(self) -> None:
        if self.rl_packing and self.micro_batch_tokens <= 0:
            raise ConfigError("data.rl_packing=true packs each RL micro-batch up to a token budget: set "
                              f"data.micro_batch_tokens > 0 (got {self.micro_batch_tokens})")
        if self.rl_packing and self.rl_shared_prompt == "on":
            raise ConfigError("data.rl_shared_prompt=on forwards padded prompt and response rows, and "
                              "data.rl_packing=true packs each micro-batch into one row for a kernel that reads no "
                              "cache: choose one (--data.rl_shared_prompt auto picks off under packing)")


@dataclass
class OptimConfig:
    lr: float = opt(1e-6, gt=0)
    critic_lr: float = opt(5e-6, gt=0)
    weight_decay: float = opt(0.0, ge=0)
    betas: tuple[float, float] = opt((0.9, 0.95), ge=0, lt=1)  # Adam's (beta1, beta2), each in [0, 1)
    eps: float = opt(1e-8, gt=0)
    warmup_steps: int = opt(0, ge=0)
    grad_clip: float = opt(1.0, ge=0)  # 0 = no clipping
    micro_batch_size: int = opt(4, ge=1)  # sequences per micro-batch (per rank) when no token budget is set
    batch_size: int = opt(32, ge=1)  # SFT/RM: sequences (pairs) per optimizer step per rank
    rm_margin: float = 0.0  # RM: margin in the Bradley-Terry loss -log sigmoid(r_c - r_r - margin)


@dataclass
class RolloutConfig:
    backend: str = opt("auto", choices=("auto", "vllm", "hf"))  # auto (vLLM if importable, else HF generate)
    placement: str = opt("colocated", choices=("colocated", "sidecar", "disaggregated"))  # see docs/MULTI_GPU.md
    async_generation: bool = False  # generate step k+1 while step k trains (off-policy: max_staleness; TIS-corrected)
    # async: generation may use weights up to max_staleness updates older than the trainer's; the engine gets new
    # weights once every max_staleness steps, its batches 1 .. max_staleness updates old (docs/ASYNC.md)
    max_staleness: int = opt(1, ge=1)  # async: most updates a batch's weights may lag (N: a weight sync every N steps)
    # partial rollouts: each generate call stops every sample at this many new tokens; unfinished samples continue
    # in the next step's call (newer weights) and a prompt's group trains once all its samples finished, so no step
    # waits for its longest samples. A sample spans at most ceil(max_new_tokens / this) weight versions (rollout/
    # partial.py); 0 = off
    partial_tokens: int = opt(0, ge=0)  # partial rollouts: new tokens per sample per call (0 = whole responses)
    # the weight sync hands the weights over without waiting for the engine to load them (an engine in its own
    # process, one training rank: sidecar / server); its acknowledgement and the sync canary are checked when the
    # batch generated with them is collected, before it trains. Async and synchronous mode (there, not the last step)
    overlap_sync: bool = True  # do not wait for the engine's load and canary (checked before training)
    # gpu_memory_utilization is split evenly too; why several: vLLM's decode is bound by per-step host work, and N
    # processes run N of those loops at once (rollout/server/sharded.py)
    sidecar_engines: int = opt(1, ge=1)  # sidecar: vLLM processes on the GPU, the batch split between them
    # sidecar: the trainer and the engines each on a share of the GPU's SMs instead of taking turns (run/gpu_split.py):
    # mps: a CUDA MPS daemon of the run's own (no change to the compute mode), each process's active-thread percentage;
    # green: CUDA green contexts (refused with what is missing); auto: mps where it can run, else off (time-slicing)
    sm_split: str = opt("off", choices=("off", "mps", "green", "auto"))  # off | mps | green | auto
    engine_sm_percent: int = opt(0, ge=0, le=100)  # sm_split: the engines' % of SMs; 0 = from the planned work
    trainer_sm_percent: int = opt(0, ge=0, le=100)  # sm_split: the trainer's % of SMs; 0 = 100 - the engines'
    # own: our CUDA-IPC buffer (sidecar) / weight group (disaggregated); vllm: vLLM's weight_transfer engine, IPC on
    # the sidecar (vLLM 0.26's ipc_engine imports ray and requests), NCCL on a disaggregated server (GPU only);
    # shared (sidecar, tensor parallel 1, no FP8, no adapter sync): every sidecar engine's weights are views of one
    # buffer of the trainer's (CUDA IPC; a /dev/shm file on CPU), held once for all engines; a sync writes into it
    weight_transport: str = opt("own", choices=WEIGHT_TRANSPORTS)  # own | vllm | shared: sidecars share one weight copy
    n_samples: int = opt(4, ge=1)  # responses per prompt
    max_new_tokens: int = opt(128, ge=1)
    temperature: float = opt(1.0, gt=0)
    top_p: float = opt(1.0, gt=0, le=1)  # nucleus sampling; the trainer's log-probs use the same truncated distribution
    top_k: int = opt(-1, ge=-1)  # -1 or 0 = off; the trainer's log-probs use the same truncated distribution
    # request: a seed per request (samples independent of the rest of the batch, but vLLM loops over seeded
    # requests at every decode step); batch: one seed per generate call (resume-exact all the same)
    seeding: str = opt("batch", choices=("batch", "request"))  # batch: one seed per call; request: one per request
    max_model_len: int = opt(0, ge=0)  # 0 = max_prompt_len + max_new_tokens
    # vLLM's share of the device. Left unset on a GPU (no run.max_gpu_memory_gb, engines on the training GPU): the
    # engines' weights, warm-up and KV cache over the device (memory/engine_budget.py); set: vLLM sizes its KV cache
    # from it. The default is the most the automatic KV cache lets the engines take
    gpu_memory_utilization: float = opt(0.5, gt=0, le=1)
    # vLLM's KV cache in GiB; 0 = auto: the sequences the engines hold at once at full context (on GPUs x 1.25,
    # unless gpu_memory_utilization is given or a cap splits the GPU; on CPU at most gpu_memory_utilization of the
    # host memory; memory/kv_cache.py)
    kv_cache_gb: float = opt(0.0, ge=0)
    sleep: bool = True  # free vLLM weights + KV cache while DeepSpeed trains (GPU only)
    sleep_level: int = opt(2, choices=(1, 2))  # 1: keep a CPU copy of the weights; 2: drop them (then a full sync)
    devices: str = ""  # disaggregated: GPU ids for the vLLM server, e.g. "4,5,6,7" (must not hold a training rank)
    tensor_parallel_size: int = opt(1, ge=1)  # vLLM TP (disaggregated: over `devices`; colocated: over ranks)
    bucket_mb: int = opt(1024, ge=1)  # weight-sync gather bucket
    canary_threshold: float = opt(0.0, ge=0)  # 0 = default; |logp trainer - rollout|: max in fp32, mean in bf16
    # weight sync of a LoRA actor: merged (base + B@A, every step) or adapter (vLLM LoRA: base once, adapters per
    # step; needs model.lora_rank > 0, colocated vLLM, no level-2 sleep); auto = merged (see docs/LOW_MEMORY.md)
    lora_sync: str = opt("auto", choices=("auto", "merged", "adapter"))
    # vLLM engine options (every placement; the HF backend ignores them). Defaults leave vLLM's own choice.
    async_scheduling: str = opt("auto", choices=("auto", "true", "false"))  # vLLM async scheduling; auto: vLLM decides
    max_num_seqs: int = opt(0, ge=0)  # vLLM: most sequences per engine step; 0 = vLLM's default
    max_num_batched_tokens: int = opt(0, ge=0)  # vLLM: most tokens per engine step; 0 = vLLM's default
    cudagraph_sizes: str = ""  # vLLM CUDA-graph batch sizes, comma list ("8,16,32"); "" = vLLM's (ignored on CPU)
    enforce_eager: bool = False  # vLLM without CUDA graphs / torch.compile (always eager on CPU)
    # FP8 rollouts (docs/FP8_ROLLOUTS.md): vLLM holds the linear layers' weights in FP8 (e4m3), quantized from the
    # trainer's weights at start and again at every sync (vLLM's online FP8 with its layerwise reload); training
    # stays in its own precision; CUDA vLLM only; the mismatch correction (rl.mismatch) stays on unless set
    quantization: str = opt("none", choices=("none", "fp8"))  # rollout engine weights: none (as trained) | fp8
    fp8_scales: str = opt("tensor", choices=("tensor", "block"))  # fp8: one scale per weight | per 128x128 block
    # the rollout engines' weight and compute precision, apart from model.dtype (e.g. fp32 training with bf16
    # rollouts): the weight sync casts to it and the mismatch correction (rl.mismatch) covers the rounding; auto = the
    # trainer's resolved precision; vLLM on CPU takes fp32 only, vLLM's FP8 quantizes bf16/fp16 weights only
    dtype: str = opt("auto", choices=("auto", "fp32", "bf16", "fp16"))  # the engines' precision; auto: as model.dtype

    def cudagraph_size_list(self) -> list[int]:
        """`cudagraph_sizes` as ints (ConfigError naming the key when it is not a comma list of ints >= 1)."""
        try:
            sizes = [int(s) for s in self.cudagraph_sizes.split(",") if s.strip()]
        except ValueError:
            sizes = [0]
        if (self.cudagraph_sizes.strip() and not sizes) or any(s < 1 for s in sizes):
            raise ConfigError(f"rollout.cudagraph_sizes={self.cudagraph_sizes!r}: give a comma list of batch sizes "
                              "(integers >= 1), e.g. 8,16,32,64; \"\" = vLLM's default sizes")
        return sizes

    def vllm_options(self) -> dict:
        """The vLLM engine options set away from their defaults, as `make_rollout_engine` keywords (empty by
        default, so vLLM keeps its own choices): async_scheduling (bool), max_num_seqs, max_num_batched_tokens,
        cudagraph_sizes (list of ints), enforce_eager; with FP8 rollouts quantization and fp8_scales."""
        out: dict = {}
        if self.async_scheduling != "auto":
            out["async_scheduling"] = self.async_scheduling == "true"
        if self.max_num_seqs:
            out["max_num_seqs"] = self.max_num_seqs
        if self.max_num_batched_tokens:
            out["max_num_batched_tokens"] = self.max_num_batched_tokens
        if sizes := self.cudagraph_size_list():
            out["cudagraph_sizes"] = sizes
        if self.enforce_eager:
            out["enforce_eager"] = True
        if self.quantization != "none":
            out.update(quantization=self.quantization, fp8_scales=self.fp8_scales)
        return out

    def _check_vllm_options(self) -> None:
        sizes = self.cudagraph_size_list()
        if sizes and self.enforce_eager:
            raise ConfigError(f"rollout.cudagraph_sizes={self.cudagraph_sizes!r} with rollout.enforce_eager true: "
                              "eager mode captures no CUDA graphs; drop one of the two")
        if 0 < self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"rollout.max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                              f"rollout.max_num_seqs={self.max_num_seqs}: vLLM needs at least one token per "
                              "sequence in a step")
        if sizes and self.max_num_batched_tokens and max(sizes) > self.max_num_batched_tokens:
            raise ConfigError(f"rollout.cudagraph_sizes={self.cudagraph_sizes!r}: sizes above "
                              f"rollout.max_num_batched_tokens={self.max_num_batched_tokens} can never run (vLLM "
                              "drops them); keep every size <= it")

    def engine_precision(self, trainer_precision: str) -> str:
        """The rollout engines' precision (fp32 | bf16 | fp16): `dtype`, or with auto the trainer's resolved
        precision `trainer_precision`. The one rule the engine, the memory plan and the run's checks read."""
        return trainer_precision if self.dtype == "auto" else self.dtype

    def sync_mode(self) -> str:
        """The weight sync `WeightSync(mode=...)` runs: "adapter" only when asked for, else "merged"."""
        return "adapter" if self.lora_sync == "adapter" else "merged"

    def _check_lora_sync(self) -> None:
        if self.lora_sync != "adapter":
            return
        allowed = "allowed: auto, merged, adapter"
        if self.backend == "hf" or self.placement != "colocated":
            raise ConfigError(f"rollout.lora_sync=adapter needs the colocated vLLM engine's LoRA support, got "
                              f"rollout.backend={self.backend}, rollout.placement={self.placement} ({allowed}): use "
                              "--rollout.lora_sync merged, or --rollout.backend vllm --rollout.placement colocated")
        if self.sleep and self.sleep_level >= 2:
            raise ConfigError("rollout.lora_sync=adapter with rollout.sleep_level=2: level 2 drops vLLM's base "
                              f"weights at every sleep and adapter sync never sends them again ({allowed}): use "
                              "--rollout.sleep_level 1, --rollout.sleep false, or --rollout.lora_sync merged")

    def _check_quantization(self) -> None:
        if self.quantization == "none":
            if self.fp8_scales != "tensor":
                raise ConfigError(f"rollout.fp8_scales={self.fp8_scales} sets the scales of FP8 rollouts: add "
                                  "--rollout.quantization fp8 or leave rollout.fp8_scales at tensor")
            return
        where = f"rollout.quantization={self.quantization}"
        if self.dtype == "fp32":
            raise ConfigError(fp8_fp32_refusal(f"rollout.dtype=fp32 with {where}"))
        if self.backend == "hf":
            raise ConfigError(f"{where} runs vLLM's FP8 kernels; rollout.backend=hf generates with the trainer's "
                              "own model (no FP8): use --rollout.backend vllm (or auto) or --rollout.quantization none")
        if self.lora_sync == "adapter":
            raise ConfigError(f"{where} with rollout.lora_sync=adapter: adapter sync serves LoRA adapters over the "
                              "base vLLM loaded once; use --rollout.lora_sync merged with FP8 rollouts")

    def _check_sm_split(self) -> None:
        shares = [f"rollout.{k}={v}" for k, v in (("engine_sm_percent", self.engine_sm_percent),
                                                  ("trainer_sm_percent", self.trainer_sm_percent)) if v]
        if self.sm_split == "off" and shares:
            raise ConfigError(f"{' and '.join(shares)} sets a share of the SMs, but rollout.sm_split=off (the "
                              "processes take turns on the GPU): add --rollout.sm_split mps (or auto), or leave them 0")
        if self.sm_split in ("mps", "green") and (self.placement != "sidecar" or self.backend == "hf"):
            raise ConfigError(f"rollout.sm_split={self.sm_split} splits the GPU between the trainer and the vLLM "
                              f"engine processes beside it; it needs --rollout.placement sidecar (got placement="
                              f"{self.placement}, backend={self.backend}): use sidecar, or --rollout.sm_split off")

    def _check_shared_weights(self) -> None:
        if self.weight_transport != "shared":
            return
        why = ("rollout.placement sidecar" if self.placement != "sidecar" or self.backend == "hf" else
               "rollout.quantization none (vLLM's FP8 rewrites the weights after loading)"
               if self.quantization != "none" else
               "rollout.tensor_parallel_size 1" if self.tensor_parallel_size > 1 else
               "rollout.lora_sync merged (vLLM's LoRA adapters are not in the shared buffer)"
               if self.lora_sync == "adapter" else None)
        if why is not None:
            raise ConfigError(f"rollout.weight_transport=shared makes the sidecar vLLM engines' weights views of one "
                              f"buffer of the trainer's; it needs {why} (got placement={self.placement}, backend="
                              f"{self.backend}, quantization={self.quantization}, tensor_parallel_size="
                              f"{self.tensor_parallel_size}, lora_sync={self.lora_sync}): change that or use "
                              "--rollout.weight_transport own")

    def check(self) -> None:
        self._check_vllm_options()
        self._check_shared_weights()
        self._check_lora_sync()
        self._check_quantization()
        if self.sidecar_engines > 1 and self.placement != "sidecar":
            raise ConfigError(f"rollout.sidecar_engines={self.sidecar_engines} splits the batch over vLLM processes on "
                              f"the training GPU; it needs --rollout.placement sidecar (got {self.placement!r})")
        self._check_sm_split()
        if self.partial_tokens and self.partial_tokens >= self.max_new_tokens:
            raise ConfigError(f"rollout.partial_tokens={self.partial_tokens} is not below rollout.max_new_tokens="
                              f"{self.max_new_tokens}: every sample finishes in one call, so nothing is carried over; "
                              f"pick a smaller value (e.g. {max(1, self.max_new_tokens // 4)}) or 0")
        if self.weight_transport == "vllm" and (self.placement == "colocated" or self.backend == "hf"):
            raise ConfigError(f"rollout.weight_transport=vllm moves weights with vLLM's weight-transfer engine into a "
                              f"vLLM server process (got rollout.placement={self.placement}, rollout.backend="
                              f"{self.backend}): use --rollout.placement sidecar or disaggregated, or "
                              "--rollout.weight_transport own")


def fp8_fp32_refusal(where: str) -> str:
    """The line that refuses FP8 rollouts from fp32 engine weights (`where`: the settings that ask for them): vLLM's
    online FP8 methods take bf16 or fp16 weights only (`get_supported_act_dtypes`)."""
    return (f"{where}: vLLM's online FP8 quantizes bf16 or fp16 engine weights only; use --rollout.dtype bf16 (the "
            "trainer keeps model.dtype) or --rollout.quantization none")


@dataclass
class DPOConfig:
    beta: float = opt(0.1, gt=0)  # DPO: the reward scale beta (IPO: the regularisation tau); rewards = beta * log-ratio
    loss: str = opt("sigmoid", choices="dpo_loss")  # DPO loss on the log-ratio difference (docs/DPO.md)
    label_smoothing: float = opt(0.0, ge=0, lt=0.5)  # DPO loss sigmoid: cDPO's share of flipped labels; 0 = DPO
    margin: float = opt(0.0, ge=0)  # DPO loss sigmoid: SimPO's target reward margin gamma; 0 = DPO
    length_norm: bool = False  # DPO: per-token average log-probs of each response instead of sums (SimPO-style)
    reference: bool = True  # DPO: log-ratios against the starting model; false = reference-free (SimPO: + length_norm)
    precompute_ref: bool = False  # DPO: the reference's log-probs of every row once at the start, then free it

    def check(self) -> None:
        if self.loss == "ipo" and (self.label_smoothing > 0 or self.margin > 0):
            raise ConfigError(f"dpo.loss=ipo takes no dpo.label_smoothing ({self.label_smoothing}) or dpo.margin "
                              f"({self.margin}): they apply to dpo.loss=sigmoid; set them to 0 or use sigmoid")
        if self.precompute_ref and not self.reference:
            raise ConfigError("dpo.precompute_ref=true precomputes the reference's log-probs, but dpo.reference=false "
                              "runs without a reference: drop one of them")


@dataclass
class RunConfig:
    output_dir: str = "runs/latest"
    steps: int = opt(20, ge=0)  # RL steps, or optimizer steps for SFT/RM (0 = run `epochs`)
    epochs: int = opt(1, ge=1)
    save_every: int = opt(0, ge=0)  # 0 = only at the end
    eval_every: int = opt(0, ge=0)  # evaluate every N steps (SFT/RM: the eval split; RL: data.eval); 0 = off
    eval_before_train: bool = False  # RL: also evaluate before the first step (logged at step 0)
    sample_log_every: int = opt(0, ge=0)  # RL: log sample rollouts (samples.jsonl, TensorBoard, wandb) every N steps
    sample_log_k: int = opt(4, ge=1)  # RL: rollouts per sample log
    keep_last: int = opt(2, ge=0)  # complete checkpoints kept (>= 1; 0 = keep all); the newest is never deleted
    resume: str = ""  # "" | latest | path to a checkpoint directory
    overwrite: bool = False  # start fresh in a run directory that holds another run's checkpoints (deletes them)
    resume_fallback: bool = False  # if the newest checkpoint fails verification, resume from the newest valid one
    seed: int = opt(0, ge=0, le=2**32 - 1)  # numpy's (and vLLM's engine) seed range: 0 .. 2**32 - 1
    # two runs of the same command on the same machine give bit-identical metrics and weights: deterministic torch
    # kernels, vLLM's batch-invariant mode (CUDA), a sampling seed per request; turns off rollout.async_generation
    # and rollout.overlap_sync (docs/OPERATOR_TOOLS.md, "Deterministic mode")
    deterministic: bool = False  # bit-identical reruns on the same machine (slower; see docs/OPERATOR_TOOLS.md)
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "ds_rlhf"
    export_hf: bool = True
    export_every: int = opt(0, ge=0)  # RL: also export the actor (HF) every N steps to export/step_XXXXXXXX; 0 = off
    progress: bool = True  # a progress bar when stderr is a terminal
    log_every: int = opt(0, ge=0)  # a one-line summary every N steps; 0: every step when no progress bar is drawn
    metrics_port: int = opt(0, ge=0, le=65535)  # serve live Prometheus metrics on this port (0 = off)
    # "" = $DS_RLHF_METRICS_ADDR, else 127.0.0.1 (this host only); 0.0.0.0 = every interface (other hosts scrape)
    metrics_host: str = ""  # bind address of the metrics endpoint ("": 127.0.0.1 unless $DS_RLHF_METRICS_ADDR)
    profile_memory: bool = False  # RL: peak memory per phase against the `ds-rlhf memory` plan (memory/* metrics)
    health_warnings: bool = True  # warn in the log when a step is slower, under-utilises the GPU, ... (with the cause)
    health_collapse_steps: int = opt(5, ge=0)  # RL: warn once when every group's rewards stay equal this long (0 off)
    dist_timeout_minutes: float = opt(30.0, gt=0)  # a collective waiting longer fails the run (lost rank/node)
    # cap per GPU for trainer + vLLM, plan checked before loading; 0 = off. RL: picks rollout.gpu_memory_utilization,
    # data.micro_batch_tokens, model.gradient_checkpointing (and fewer rollout.sidecar_engines if needed) unless set
    # (docs/LOW_MEMORY.md)
    max_gpu_memory_gb: float = opt(0.0, ge=0)  # per-GPU cap, trainer+vLLM (0 off); picks unset vLLM share, micro-batch
