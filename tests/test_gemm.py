"""Shape-dependent matmul efficiency (jaxmp.plan.gemm): wider weight matmuls run nearer the
device's ceiling, activation x activation matmuls and a config's flat efficiency do not."""

import pytest

from jaxmp.cost.traffic import LinearTraffic
from jaxmp.devices import profile_for
from jaxmp.plan.gemm import compute_seconds, matmul_efficiency, weight_matmuls

H100 = profile_for("H100", measure_cpu=False)


def test_efficiency_rises_with_width_toward_the_ceiling():
    es = [matmul_efficiency(w, H100) for w in (256, 1024, 4096, 16384, 1e9)]
    assert es == sorted(es) and es[-1] < H100.matmul_ceiling + 1e-9
    assert abs(es[-1] - H100.matmul_ceiling) < 1e-4


def test_slower_memory_needs_wider_matrices():
    """The knee scales with the ridge point: the HBM2e H100 (2.4 TB/s) is below the HBM3 one."""
    slow = profile_for("H100-96GB", measure_cpu=False)
    assert matmul_efficiency(4096, slow) < matmul_efficiency(4096, H100)


def test_weight_matmuls_are_the_dots_with_constant_bytes():
    weights = ((0.0, 2 * 4096 * 4096), (2 * 4096 * 4096, 2 * 2 * 4096))  # M x K @ K x N
    scores = ((0.0, 2 * 128 * 2048), (0.0, 4 * 128 + 2 * 2048))  # activation x activation
    f, b = weight_matmuls(LinearTraffic((0.0, 0.0), (weights, scores)))
    assert f == 2 * 4096 * 4096 and f / b == 2048  # N K / (N + K) per item, bf16


def test_flat_efficiency_override_times_all_compute():
    """A config's ``[device] efficiency`` turns the curve off: every FLOP at that number."""
    flat = profile_for("H100", measure_cpu=False, overrides={"efficiency": 0.5})
    assert flat.matmul_ceiling == 0.0 and H100.matmul_ceiling > 0
    traffic = LinearTraffic((0.0, 0.0), (((0.0, 1e12), (1e7, 1e8)),))
    rate = flat.peak_flops * 0.5
    assert compute_seconds(1e12, traffic, 1.0, 1, flat, flat.peak_flops, rate) == pytest.approx(1e12 / rate)
    curved = compute_seconds(1e12, traffic, 1.0, 1, H100, H100.peak_flops, rate)
    assert curved == pytest.approx(1e12 / (H100.peak_flops * matmul_efficiency(1e4, H100)))
