"""Shape-dependent matmul efficiency: a weight matmul runs nearer the device's peak the wider it is.

cuBLAS's bf16 GEMM throughput rises with the matrix size toward a ceiling below the datasheet
peak (NVIDIA's "Matrix Multiplication Background" guide: a GEMM is memory-bound until its
arithmetic intensity passes the device's FLOP/byte ratio, and reaches its plateau only well
above it; its H100 / A100 throughput-vs-size plots saturate near 4k-8k-wide matrices). The
published bf16 runs show the same: the 175B (d 12288) reaches 0.61 of the H100's peak, the
Nemotron 15B (d 6144) 0.54, torchtitan's 8B (d 4096, on the HBM2e H100) below 0.45
(docs/planner.md §7 "Stop 32").

The size a layer's weight matmuls run at is their arithmetic intensity at large batch —
FLOPs over the bytes of their activations in and out, per row, ``N K / (N + K)`` per item
for an ``M x K @ K x N`` product, independent of M — read from the traced program
(:class:`jaxmp.cost.traffic.LinearTraffic`: a weight matmul is a dot with a constant part of
its bytes, the weights). The efficiency follows a saturating curve in it,
``e = ceiling x w / (w + KNEE x peak / memory_bw)``: the knee scales with the device's
ridge point, since a device with more FLOPs per byte needs wider matrices to fill. Matmuls
between activations (attention's S x S products) and the non-matmul FLOPs stay at the flat
``DeviceProfile.efficiency`` (with their roofline, jaxmp.cost.traffic).
"""

from __future__ import annotations

from jaxmp.cost.traffic import LinearTraffic
from jaxmp.devices import DeviceProfile

# The knee in units of the device's ridge point (peak FLOP/s / memory bytes/s): fitted once
# over every device kind on the published bf16 rows (docs/planner.md §7 "Stop 32 (Me2)").
KNEE = 5.0


def matmul_efficiency(width: float, profile: DeviceProfile) -> float:
    """The fraction of ``peak_flops`` a weight matmul of intensity ``width`` (FLOP/byte) reaches."""
    knee = KNEE * profile.peak_flops / profile.memory_bw
    return profile.matmul_ceiling * width / (width + knee)


def weight_matmuls(traffic: LinearTraffic) -> tuple[float, float]:
    """(per-row FLOPs, per-row bytes) of the weight matmuls: the dots whose bytes have a
    constant part (their weights; attention's activation x activation products have none)."""
    flops = nbytes = 0.0
    for (_, f_row), (b_const, b_row) in traffic.dots:
        if b_row > 0 and b_const > 0.01 * b_row:
            flops += f_row
            nbytes += b_row
    return flops, nbytes


def compute_seconds(flops: float, traffic: LinearTraffic | None, rows: float, split: float,
                    profile: DeviceProfile, peak: float, rate: float) -> float:
    """Seconds for a layer's ``flops`` (per device, at ``rows`` rows, tensor ``split``): its
    weight matmuls at their shape's efficiency of ``peak``, the rest at the flat ``rate``. Without a
    ceiling (``[device] efficiency`` set, or a CPU) or a traced program: all at ``rate``."""
    if not profile.matmul_ceiling or not profile.memory_bw or traffic is None:
        return flops / rate
    f_row, b_row = weight_matmuls(traffic)
    if not f_row:
        return flops / rate
    mm = min(flops, f_row * rows / split)
    e = matmul_efficiency(f_row / b_row, profile)
    return mm / (peak * e) + (flops - mm) / rate
