"""The live Prometheus endpoint: fed with a step's metrics dict, scraped over loopback, stopped at close."""

from __future__ import annotations

import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from ds_rlhf.distributed import free_port
from ds_rlhf.telemetry.prometheus import PREFIX, PrometheusExporter

pytest.importorskip("prometheus_client")


def scrape(url: str) -> dict[str, float]:
    """`name{labels}` -> value of every sample on the page."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class FakeNVML:
    """Two GPUs, as pynvml would report them."""

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=40 + 10 * handle)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=(handle + 1) * 2**30, total=80 * 2**30)


STEP = {"time/rollout": 2.5, "time/train": 1.25, "time/sync": 0.25, "time/data": 0.01, "time/step": 4.01,
        "time/wall": 4.2, "throughput/tokens_per_s": 1234.0, "throughput/completions_per_s": 30.5,
        "rollout/staleness": 1.0, "reward/mean": 0.625, "kl/mean": 0.03125, "health/warnings": 1.0,
        "actor/loss": -0.5, "sys/gpu_mem_allocated_gb": 2.0, "eval/note": "text is skipped", "bad": float("nan")}


def test_step_metrics_are_served_and_the_server_stops_at_close():
    port = free_port()
    exporter = PrometheusExporter(port, addr="127.0.0.1", total_steps=10, nvml=FakeNVML())
    assert exporter.active and exporter.url == f"http://127.0.0.1:{port}/metrics"
    try:
        exporter.update(3, STEP)
        exporter.count_warnings(["step_time", "step_time", "gpu_util"])
        got = scrape(exporter.url)
    finally:
        exporter.close()
    p = PREFIX
    assert got[p + "step"] == 3 and got[p + "total_steps"] == 10
    assert got[p + 'phase_seconds{phase="rollout"}'] == 2.5 and got[p + 'phase_seconds{phase="data"}'] == 0.01
    assert got[p + "step_seconds"] == 4.2 and 'phase_seconds{phase="wall"}' not in "".join(got)
    assert got[p + "tokens_per_second"] == 1234.0 and got[p + "completions_per_second"] == 30.5
    assert got[p + "rollout_staleness"] == 1.0 and got[p + "reward_mean"] == 0.625 and got[p + "kl_mean"] == 0.03125
    assert got[p + "health_warnings_active"] == 1.0
    assert got[p + 'health_warnings_total{kind="step_time"}'] == 2
    assert got[p + 'metric{key="actor/loss"}'] == -0.5
    assert got[p + "torch_memory_allocated_bytes"] == 2 * 2**30
    assert got[p + 'gpu_utilization_percent{gpu="1"}'] == 50 and got[p + 'gpu_memory_used_bytes{gpu="0"}'] == 2**30
    assert got[p + 'gpu_memory_total_bytes{gpu="1"}'] == 80 * 2**30
    assert not any("bad" in k or "eval/note" in k for k in got)
    # every series is ours (dcgm-exporter's DCGM_* names never appear), labels gpu / phase / kind / key only
    assert all(k.startswith(p) for k in got)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(exporter.url, timeout=2)


def test_a_taken_port_is_a_warning_not_a_crash(capsys):
    port = free_port()
    first = PrometheusExporter(port, addr="127.0.0.1", nvml=False)
    try:
        second = PrometheusExporter(port, addr="127.0.0.1", nvml=False)
        assert first.active and not second.active
        second.update(1, STEP)  # inactive: nothing happens
        second.close()
    finally:
        first.close()
    assert "cannot serve metrics" in capsys.readouterr().err


def test_no_gpu_means_no_gpu_series():
    port = free_port()
    exporter = PrometheusExporter(port, addr="127.0.0.1", nvml=False)
    try:
        exporter.update(1, {"reward/mean": 0.5})
        got = scrape(exporter.url)
    finally:
        exporter.close()
    assert got[PREFIX + "reward_mean"] == 0.5 and not any("gpu_" in k for k in got)


def test_the_endpoint_binds_loopback_unless_asked(monkeypatch):
    monkeypatch.delenv("DS_RLHF_METRICS_ADDR", raising=False)
    exporter = PrometheusExporter(free_port(), nvml=False)
    try:
        assert exporter.active and exporter._server.server_address[0] == "127.0.0.1"
    finally:
        exporter.close()
    monkeypatch.setenv("DS_RLHF_METRICS_ADDR", "0.0.0.0")
    exporter = PrometheusExporter(free_port(), nvml=False)
    try:
        assert exporter._server.server_address[0] == "0.0.0.0"
    finally:
        exporter.close()
