"""docs/grafana_dashboard.json queries only series the exporter serves, and none of dcgm-exporter's."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from ds_rlhf.distributed import free_port
from ds_rlhf.telemetry.prometheus import PrometheusExporter

pytest.importorskip("prometheus_client")
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana_dashboard.json"


def test_dashboard_uses_the_exporters_names():
    from tests.telemetry.test_prometheus import STEP, FakeNVML

    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    used = {n for e in exprs for n in re.findall(r"\bds_rlhf_\w+", e)}
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]) and len(used) >= 15
    assert not any("DCGM_" in e for e in exprs)
    port = free_port()
    exporter = PrometheusExporter(port, addr="127.0.0.1", total_steps=5, nvml=FakeNVML())
    try:
        exporter.update(1, STEP)
        exporter.count_warnings(["gpu_util"])
        text = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
    finally:
        exporter.close()
    served = set(re.findall(r"^(ds_rlhf_\w+)", text, flags=re.M))
    assert used <= served, used - served
