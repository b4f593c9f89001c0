"""The GPU peaks table (``engine.device_peaks.GPU_PEAKS``) by the names torch gives the devices."""

from __future__ import annotations

import pytest

from engine.device_peaks import gpu_table_peaks


@pytest.mark.parametrize(("name", "gbs", "tflops"), [
    ("NVIDIA H200", 4800, 989),
    ("NVIDIA H200 NVL", 4800, 835),
    ("NVIDIA H100 80GB HBM3", 3350, 989),
    ("NVIDIA H100 PCIe", 2000, 756),
    ("NVIDIA H100 NVL", 3900, 835),
    ("NVIDIA A100-SXM4-80GB", 2039, 312),
    ("NVIDIA A100 80GB PCIe", 1935, 312),
    ("NVIDIA A100-SXM4-40GB", 1555, 312),
    ("NVIDIA A100-PCIE-40GB", 1555, 312),
    ("NVIDIA L40S", 864, 362),
    ("NVIDIA L4", 300, 121),
    ("NVIDIA A10G", 600, 70),
    ("NVIDIA A10", 600, 125),
])  # fmt: skip
def test_a_known_gpu_gets_its_datasheet_peaks(name, gbs, tflops):
    assert gpu_table_peaks(name) == (gbs * 1e9, tflops * 1e12)


@pytest.mark.parametrize("name", ["NVIDIA GH200 480GB", "NVIDIA GeForce RTX 4090", "Tesla T4"])
def test_an_unknown_gpu_gets_none_so_the_probes_measure_it(name):
    assert gpu_table_peaks(name) is None
