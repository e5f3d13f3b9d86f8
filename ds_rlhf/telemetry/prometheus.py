"""Live metrics for Prometheus: an HTTP endpoint on rank 0 (`run.metrics_port` > 0) fed with each step's metrics.

    --run.metrics_port 9410   ->   http://127.0.0.1:9410/metrics

The endpoint binds 127.0.0.1 (this host only) unless asked otherwise: `--run.metrics_host 0.0.0.0` (every
interface, for a Prometheus server on another host) or $DS_RLHF_METRICS_ADDR when `run.metrics_host` is empty.

Every name starts with `ds_rlhf_`, and the GPU series use dcgm-exporter's label `gpu` (the NVML index), so this
endpoint runs beside dcgm-exporter (whose default port is 9400: give this one another) without a clash, and a
dashboard can join the two on `gpu`:
    ds_rlhf_step                               steps finished (the `step` of the last record)
    ds_rlhf_total_steps                        steps planned (0 = unknown)
    ds_rlhf_last_step_timestamp_seconds        unix time of the last record (alert on a stalled run)
    ds_rlhf_step_seconds                       wall time of the last step (`time/wall`)
    ds_rlhf_phase_seconds{phase}               seconds of the last step per phase (`time/<phase>`: data, rollout,
                                               reward, old_logp, reference, critic, train, sync)
    ds_rlhf_tokens_per_second                  `throughput/tokens_per_s` (per rank)
    ds_rlhf_completions_per_second             `throughput/completions_per_s` (per rank, RL)
    ds_rlhf_rollout_staleness                  `rollout/staleness`: updates between a batch's weights and its
                                               training (0 synchronous, 1 with rollout.async_generation)
    ds_rlhf_reward_mean                        `reward/mean`
    ds_rlhf_kl_mean                            `kl/mean` (with a reference model)
    ds_rlhf_health_warnings_active             health warnings active at the last step (`health/warnings`)
    ds_rlhf_health_warnings_total{kind}        warnings raised so far, by kind (step_time, throughput, gpu_util,
                                               no_signal, policy_collapse, flat_rewards, rollouts_trail)
    ds_rlhf_metric{key}                        every other numeric metric of the last record, by its key
    ds_rlhf_gpu_utilization_percent{gpu}       NVML, read at scrape time (every GPU of rank 0's node)
    ds_rlhf_gpu_memory_used_bytes{gpu}         NVML, at scrape time
    ds_rlhf_gpu_memory_total_bytes{gpu}        NVML, at scrape time
    ds_rlhf_torch_memory_allocated_bytes       rank 0's PyTorch allocator at the last step (`sys/gpu_mem_allocated_gb`)
    ds_rlhf_torch_memory_peak_bytes            its peak (`sys/gpu_mem_peak_gb`)

The exporter never stops a run: prometheus_client missing or the port taken is one warning, then no endpoint.
Each exporter has its own registry, so several runs (or tests) in one process do not collide.
"""

from __future__ import annotations

import math
import os
import sys
import threading

from ds_rlhf.telemetry.system import nvml_module

PREFIX = "ds_rlhf_"
ADDR_ENV = "DS_RLHF_METRICS_ADDR"
DEFAULT_ADDR = "127.0.0.1"
# metrics key -> (gauge name without the prefix, help)
GAUGES = {
    "time/wall": ("step_seconds", "Wall time of the last step (time/wall)"),
    "throughput/tokens_per_s": ("tokens_per_second", "Tokens per second of the last step, per rank"),
    "throughput/completions_per_s": ("completions_per_second", "Completions per second of the last step, per rank"),
    "rollout/staleness": ("rollout_staleness", "Updates between the weights that generated the batch and its training"),
    "reward/mean": ("reward_mean", "Mean sequence reward of the last step"),
    "kl/mean": ("kl_mean", "Mean KL to the reference policy of the last step"),
    "health/warnings": ("health_warnings_active", "Health warnings active at the last step"),
}
BYTES = {"sys/gpu_mem_allocated_gb": ("torch_memory_allocated_bytes", "PyTorch allocated GPU memory on rank 0"),
         "sys/gpu_mem_peak_gb": ("torch_memory_peak_bytes", "PyTorch peak allocated GPU memory on rank 0")}
NOT_PHASES = ("time/wall", "time/step")


def _finite(value) -> float | None:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class GpuCollector:
    """NVML per GPU at scrape time (nothing when NVML or a GPU is missing). `nvml`: the pynvml module, or a
    stand-in with the same functions (tests); default: `telemetry.system`'s NVML handle."""

    def __init__(self, nvml=None):
        self._nvml = nvml

    def _handle(self):
        if self._nvml is None:
            self._nvml = nvml_module()
        return self._nvml

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        util = GaugeMetricFamily(PREFIX + "gpu_utilization_percent", "GPU utilisation (NVML)", labels=["gpu"])
        used = GaugeMetricFamily(PREFIX + "gpu_memory_used_bytes", "GPU memory used (NVML)", labels=["gpu"])
        total = GaugeMetricFamily(PREFIX + "gpu_memory_total_bytes", "GPU memory total (NVML)", labels=["gpu"])
        nvml = self._handle()
        if nvml:
            try:
                for i in range(nvml.nvmlDeviceGetCount()):
                    handle = nvml.nvmlDeviceGetHandleByIndex(i)
                    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                    util.add_metric([str(i)], float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
                    used.add_metric([str(i)], float(mem.used))
                    total.add_metric([str(i)], float(mem.total))
            except Exception as exc:  # noqa: BLE001 - a scrape never raises into the server thread
                print(f"[telemetry] NVML read failed: {exc}", file=sys.stderr)
        yield from (util, used, total)


class PrometheusExporter:
    """`update(step, metrics)` after each step; `close()` stops the HTTP server. `active` is False when the
    endpoint could not start (the reason was printed). `addr`: the bind address (default $DS_RLHF_METRICS_ADDR,
    else 127.0.0.1)."""

    def __init__(self, port: int, *, addr: str | None = None, total_steps: int = 0, nvml=None):
        self.port, self.addr = int(port), addr or os.environ.get(ADDR_ENV) or DEFAULT_ADDR
        self.active = False
        self._server = self._thread = None
        self._lock = threading.Lock()
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
        except ImportError as exc:
            print(f"[telemetry] run.metrics_port={port} but prometheus_client is missing ({exc}): no live metrics",
                  file=sys.stderr)
            return
        self.registry = reg = CollectorRegistry()
        self._step = Gauge(PREFIX + "step", "Steps finished", registry=reg)
        self._total = Gauge(PREFIX + "total_steps", "Steps planned (0 = unknown)", registry=reg)
        self._stamp = Gauge(PREFIX + "last_step_timestamp_seconds", "Unix time of the last step's record",
                            registry=reg)
        self._phase = Gauge(PREFIX + "phase_seconds", "Seconds of the last step per phase (time/<phase>)", ["phase"],
                            registry=reg)
        self._gauges = {k: Gauge(PREFIX + name, doc, registry=reg) for k, (name, doc) in {**GAUGES, **BYTES}.items()}
        self._other = Gauge(PREFIX + "metric", "Any other numeric metric of the last step, by key", ["key"],
                            registry=reg)
        self._warned = Counter(PREFIX + "health_warnings", "Health warnings raised, by kind", ["kind"], registry=reg)
        reg.register(GpuCollector(nvml))
        self._total.set(total_steps)
        try:
            self._server, self._thread = start_http_server(self.port, self.addr, registry=reg)
        except OSError as exc:
            print(f"[telemetry] cannot serve metrics on {self.addr}:{self.port} ({exc}): no live metrics",
                  file=sys.stderr)
            return
        self.active = True

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.addr in ("0.0.0.0", "", "::") else self.addr
        return f"http://{host}:{self.port}/metrics"

    def update(self, step: int, metrics: dict, *, timestamp: float | None = None) -> None:
        """Set the gauges from one step's metrics dict (the one the MetricsLogger logs)."""
        if not self.active:
            return
        import time

        with self._lock:
            self._step.set(step)
            self._stamp.set(time.time() if timestamp is None else timestamp)
            for key, raw in metrics.items():
                value = _finite(raw)
                if value is None:
                    continue
                if key in self._gauges:
                    self._gauges[key].set(value * (2**30 if key in BYTES else 1))
                elif key.startswith("time/") and key not in NOT_PHASES:
                    self._phase.labels(phase=key.removeprefix("time/")).set(value)
                else:
                    self._other.labels(key=key).set(value)

    def count_warnings(self, kinds: list[str]) -> None:
        if self.active:
            for kind in kinds:
                self._warned.labels(kind=kind).inc()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = self._thread = None
        self.active = False


__all__ = ["DEFAULT_ADDR", "GAUGES", "GpuCollector", "PREFIX", "PrometheusExporter"]
