"""Hardware the mock can fake: the identities real cards report (PCI ids, NVML values).

Figures are what such cards report on real nodes (NVML memory totals, PCI device ids,
MIG profile sizes), so that selectors written against the mock also make sense on hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20


@dataclass(frozen=True)
class MigProfile:
    slices: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int = 0


@dataclass(frozen=True)
class GpuModel:
    product: str
    pci_device: int
    architecture: int  # NVML_DEVICE_ARCH_*
    compute_capability: tuple[int, int]
    memory_mib: int
    brand: int = 14  # NVML_BRAND_NVIDIA
    mig: dict[str, MigProfile] = field(default_factory=dict)


@dataclass(frozen=True)
class NicModel:
    vendor: int
    pci_device: int
    vf_device: int | None
    driver: str
    speed_mbps: int
    rdma_prefix: str | None  # ib device name prefix ("mlx5_"), None: no RDMA
    total_vfs: int = 0


@dataclass(frozen=True)
class AlveoModel:
    mgmt_device: int
    user_device: int
    vbnv: str
    part: str
    interface_uuid: str


@dataclass(frozen=True)
class DflModel:
    pci_device: int
    compat_id: str
    bitstream_id: str


GPUS: dict[str, GpuModel] = {
    "h100-sxm5-80gb": GpuModel(
        "NVIDIA H100 80GB HBM3", 0x2330, 9, (9, 0), 81559,
        mig={
            "1g.10gb": MigProfile(1, 9856, 16, 1, 1),
            "2g.20gb": MigProfile(2, 20096, 32, 2, 2),
            "3g.40gb": MigProfile(3, 40192, 60, 3, 3),
            "7g.80gb": MigProfile(7, 80896, 132, 8, 7),
        },
    ),
    "a100-sxm4-40gb": GpuModel(
        "NVIDIA A100-SXM4-40GB", 0x20B0, 7, (8, 0), 40960,
        mig={
            "1g.5gb": MigProfile(1, 4864, 14, 1, 0),
            "2g.10gb": MigProfile(2, 9984, 28, 2, 1),
            "3g.20gb": MigProfile(3, 19968, 42, 3, 2),
            "4g.20gb": MigProfile(4, 19968, 56, 4, 2),
            "7g.40gb": MigProfile(7, 40192, 98, 7, 5),
        },
    ),
    "l4": GpuModel("NVIDIA L4", 0x27B8, 8, (8, 9), 23034),
    "h200": GpuModel("NVIDIA H200", 0x2335, 9, (9, 0), 143771),
}

NICS: dict[str, NicModel] = {
    "connectx-7": NicModel(0x15B3, 0x1021, 0x101E, "mlx5_core", 400000, "mlx5_", 16),
    "connectx-6dx": NicModel(0x15B3, 0x101D, 0x101E, "mlx5_core", 100000, "mlx5_", 127),
    "e810": NicModel(0x8086, 0x1592, 0x1889, "ice", 100000, "irdma", 128),
    "i350": NicModel(0x8086, 0x1521, 0x1520, "igb", 1000, None, 7),
}

ALVEO: dict[str, AlveoModel] = {
    "u250": AlveoModel(
        0x5004, 0x5005, "xilinx_u250_gen3x16_xdma_shell_4_1", "xcu250-figd2104-2L-e",
        "1a2b3c4d-5e6f-4a1b-8c2d-3e4f5a6b7c8d",
    ),
    "u55c": AlveoModel(
        0x505C, 0x505D, "xilinx_u55c_gen3x16_xdma_base_3", "xcu55c-fsvh2892-2L-e",
        "97088961-feae-da91-52a2-1d9dfd63ccef",
    ),
}

DFL: dict[str, DflModel] = {
    "d5005": DflModel(0x0B2B, "f3c9941350f55b4a896ba05c1c5d6c42", "0x23000410010309"),
    "n3000": DflModel(0x0B30, "9346116d-a52d-5ca8-b06a-a9a389ef7c8d".replace("-", ""),
                      "0x231000200000136"),
}
