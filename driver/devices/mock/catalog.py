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
class GiProfile:
    """A GPU instance profile as NVML reports it (nvmlDeviceGetGpuInstanceProfileInfoV and
    ...PossiblePlacements_v2): `index` is the NVML_GPU_INSTANCE_PROFILE_* value a caller
    passes, `id` what the info struct returns; a placement is (start, memory_slices) in
    the GPU's eight memory slices. `instances`: how many can exist at once where that is
    fewer than the placements (a `+me` profile: seven placements, one instance, since the
    GPU has one set of the media engines it takes); 0: one per placement."""

    name: str
    index: int
    id: int
    compute_slices: int
    memory_slices: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpegs: int
    ofas: int
    starts: tuple[int, ...]
    instances: int = 0

    @property
    def max_instances(self) -> int:
        return self.instances or len(self.starts)


def _gi_table(rows: list[tuple]) -> tuple[GiProfile, ...]:
    return tuple(GiProfile(*row) for row in rows)


# Where each column comes from. NVIDIA's MIG User Guide ("Supported MIG Profiles", R580)
# gives, per model, the profile names, the fraction of memory (here memory slices of 8),
# the fraction of SMs (compute slices of 7), the NVDEC / JPEG / OFA counts, the copy
# engines and the number of instances, `+me` profiles included; its "Getting Started"
# gives the A100's profile ids and placements (`nvidia-smi mig -lgipp`: ids 19, 20, 15, 14,
# 9, 5, 0; the +me profile id 20 placed at {0..6}:1, one instance). The NVML_GPU_INSTANCE_
# PROFILE_* indices are nvml.h's: 1_SLICE 0, 2_SLICE 1, 3_SLICE 2, 4_SLICE 3, 7_SLICE 4,
# 1_SLICE_REV1 7 (the 1g +me variant), 1_SLICE_REV2 9 (one compute slice, two memory
# slices). The guide gives no SM counts and no absolute memory sizes:
#   SM    A100 14 per compute slice, as published `nvidia-smi mig -lgip` outputs of
#         A100s show. H100 16 / 16 / 26 / 32 / 60 / 64 / 132,
#         as `nvidia-smi mig -lgip` on H100 80GB prints them (Google Cloud's A3 MIG page
#         shows 16, 16, 26, 32 and 60; 4g and 7g from operators' published outputs): note
#         the 1g.20gb's 26, more than 1g.10gb's 16. H200: assumed the H100's (the same
#         GH100 die and slice layout); no H200 output was found.
#   MiB   no primary source gives memorySizeMB for any profile below; every MiB figure
#         says so or where it was read. A100 and H100 figures are multiples of 128 MiB
#         near the GiB that published `nvidia-smi mig -lgip` outputs show (those differ by
#         driver: H100 1g.10gb 9.62 or 9.75 GiB; NVIDIA's go-nvml mock has yet others, such
#         as 9856 for the A100-40GB 2g.10gb); the H100 3g.40gb's 40192 MiB is the MIG
#         device total that Google Cloud's A3 page shows (R525). H200 figures are derived:
#         the profile's memory fraction of the H200's 143771 MiB times the share of the same
#         fraction the H100 figures keep (0.9668 for 1/8, 0.9856 for 2/8 and 4/8, 0.9919
#         for the whole GPU), rounded down to 128 MiB.
_A100_40GB_GI = _gi_table([
    # name         idx id cs ms  MiB    SM CE dec enc jpg ofa starts                 instances
    ("1g.5gb",     0, 19, 1, 1,  4864,  14, 1, 0, 0, 0, 0, (0, 1, 2, 3, 4, 5, 6)),     # MiB: no primary source
    ("1g.5gb+me",  7, 20, 1, 1,  4864,  14, 1, 1, 0, 1, 1, (0, 1, 2, 3, 4, 5, 6), 1),  # MiB: no primary source
    ("1g.10gb",    9, 15, 1, 2,  9856,  14, 1, 1, 0, 0, 0, (0, 2, 4, 6)),              # MiB: no primary source
    ("2g.10gb",    1, 14, 2, 2,  9984,  28, 2, 1, 0, 0, 0, (0, 2, 4)),                 # MiB: no primary source
    ("3g.20gb",    2,  9, 3, 4, 19968,  42, 3, 2, 0, 0, 0, (0, 4)),                    # MiB: no primary source
    ("4g.20gb",    3,  5, 4, 4, 19968,  56, 4, 2, 0, 0, 0, (0,)),                      # MiB: no primary source
    ("7g.40gb",    4,  0, 7, 8, 40192,  98, 7, 5, 0, 1, 1, (0,)),                      # MiB: no primary source
])
# A100-SXM4-80GB: the 40GB's table with the names the guide gives for the larger memory.
_A100_80GB_GI = _gi_table([
    ("1g.10gb",    0, 19, 1, 1,  9728,  14, 1, 0, 0, 0, 0, (0, 1, 2, 3, 4, 5, 6)),     # MiB: no primary source
    ("1g.10gb+me", 7, 20, 1, 1,  9728,  14, 1, 1, 0, 1, 1, (0, 1, 2, 3, 4, 5, 6), 1),  # MiB: no primary source
    ("1g.20gb",    9, 15, 1, 2, 19968,  14, 1, 1, 0, 0, 0, (0, 2, 4, 6)),              # MiB: no primary source
    ("2g.20gb",    1, 14, 2, 2, 19968,  28, 2, 1, 0, 0, 0, (0, 2, 4)),                 # MiB: no primary source
    ("3g.40gb",    2,  9, 3, 4, 40192,  42, 3, 2, 0, 0, 0, (0, 4)),                    # MiB: no primary source
    ("4g.40gb",    3,  5, 4, 4, 40192,  56, 4, 2, 0, 0, 0, (0,)),                      # MiB: no primary source
    ("7g.80gb",    4,  0, 7, 8, 80896,  98, 7, 5, 0, 1, 1, (0,)),                      # MiB: no primary source
])
_H100_80GB_GI = _gi_table([
    ("1g.10gb",    0, 19, 1, 1,  9856,  16, 1, 1, 0, 1, 0, (0, 1, 2, 3, 4, 5, 6)),     # MiB: no primary source
    ("1g.10gb+me", 7, 20, 1, 1,  9856,  16, 1, 1, 0, 1, 1, (0, 1, 2, 3, 4, 5, 6), 1),  # MiB: no primary source
    ("1g.20gb",    9, 15, 1, 2, 20096,  26, 1, 1, 0, 1, 0, (0, 2, 4, 6)),              # MiB: no primary source
    ("2g.20gb",    1, 14, 2, 2, 20096,  32, 2, 2, 0, 2, 0, (0, 2, 4)),                 # MiB: no primary source
    ("3g.40gb",    2,  9, 3, 4, 40192,  60, 3, 3, 0, 3, 0, (0, 4)),                    # MiB: Google Cloud A3 page
    ("4g.40gb",    3,  5, 4, 4, 40192,  64, 4, 4, 0, 4, 0, (0,)),                      # MiB: no primary source
    ("7g.80gb",    4,  0, 7, 8, 80896, 132, 8, 7, 0, 7, 1, (0,)),                      # MiB: no primary source
])
# H200 141GB: the guide's table (1g.18gb x7, 1g.18gb+me x1, 1g.35gb x4, 2g.35gb x3,
# 3g.71gb x2, 4g.71gb x1, 7g.141gb x1; memory 1/8, 1/8, 1/4, 2/8, 4/8, 4/8, full) on the
# H100's slice layout and engines.
_H200_GI = _gi_table([
    ("1g.18gb",    0, 19, 1, 1, 17280,  16, 1, 1, 0, 1, 0, (0, 1, 2, 3, 4, 5, 6)),     # MiB: derived, no primary source
    ("1g.18gb+me", 7, 20, 1, 1, 17280,  16, 1, 1, 0, 1, 1, (0, 1, 2, 3, 4, 5, 6), 1),  # MiB: derived, no primary source
    ("1g.35gb",    9, 15, 1, 2, 35328,  26, 1, 1, 0, 1, 0, (0, 2, 4, 6)),              # MiB: derived, no primary source
    ("2g.35gb",    1, 14, 2, 2, 35328,  32, 2, 2, 0, 2, 0, (0, 2, 4)),                 # MiB: derived, no primary source
    ("3g.71gb",    2,  9, 3, 4, 70784,  60, 3, 3, 0, 3, 0, (0, 4)),                    # MiB: derived, no primary source
    ("4g.71gb",    3,  5, 4, 4, 70784,  64, 4, 4, 0, 4, 0, (0,)),                      # MiB: derived, no primary source
    ("7g.141gb",   4,  0, 7, 8, 142592, 132, 8, 7, 0, 7, 1, (0,)),                     # MiB: derived, no primary source
])


@dataclass(frozen=True)
class GpuModel:
    product: str
    pci_device: int
    architecture: int  # NVML_DEVICE_ARCH_*
    compute_capability: tuple[int, int]
    memory_mib: int
    brand: int = 14  # NVML_BRAND_NVIDIA
    mig: dict[str, MigProfile] = field(default_factory=dict)
    # Every GPU instance profile NVML offers (dynamic MIG); empty: not MIG-capable.
    gi_profiles: tuple[GiProfile, ...] = ()
    # Ampere changes MIG mode only with a GPU reset; Hopper and newer on demand.
    mig_mode_needs_reset: bool = False


@dataclass(frozen=True)
class NicModel:
    vendor: int
    pci_device: int
    vf_device: int | None
    driver: str
    speed_mbps: int
    rdma_prefix: str | None  # ib device name prefix ("mlx5_"), None: no RDMA
    total_vfs: int = 0
    pci_name: str = ""  # as pci.ids lists the PF (and the VF) device
    vf_name: str = ""
    # The interface's own driver when a bus sits between it and the PCI function (virtio:
    # the PCI function has virtio-pci, the virtio device under it has virtio_net).
    net_driver: str | None = None


@dataclass(frozen=True)
class AlveoModel:
    mgmt_device: int
    user_device: int
    vbnv: str
    part: str
    interface_uuid: str
    pci_name: str = ""


@dataclass(frozen=True)
class DflModel:
    pci_device: int
    compat_id: str
    bitstream_id: str
    pci_name: str = ""


GPUS: dict[str, GpuModel] = {
    "h100-sxm5-80gb": GpuModel(
        "NVIDIA H100 80GB HBM3", 0x2330, 9, (9, 0), 81559,
        mig={
            "1g.10gb": MigProfile(1, 9856, 16, 1, 1),
            "2g.20gb": MigProfile(2, 20096, 32, 2, 2),
            "3g.40gb": MigProfile(3, 40192, 60, 3, 3),
            "7g.80gb": MigProfile(7, 80896, 132, 8, 7),
        },
        gi_profiles=_H100_80GB_GI,
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
        gi_profiles=_A100_40GB_GI, mig_mode_needs_reset=True,
    ),
    "a100-sxm4-80gb": GpuModel(
        "NVIDIA A100-SXM4-80GB", 0x20B2, 7, (8, 0), 81920,
        gi_profiles=_A100_80GB_GI, mig_mode_needs_reset=True,
    ),
    "l4": GpuModel("NVIDIA L4", 0x27B8, 8, (8, 9), 23034),
    "h200": GpuModel("NVIDIA H200", 0x2335, 9, (9, 0), 143771, gi_profiles=_H200_GI),
}

NICS: dict[str, NicModel] = {
    "connectx-7": NicModel(0x15B3, 0x1021, 0x101E, "mlx5_core", 400000, "mlx5_", 16,
                           "MT2910 Family [ConnectX-7]", "ConnectX Family mlx5Gen Virtual Function"),
    "connectx-6dx": NicModel(0x15B3, 0x101D, 0x101E, "mlx5_core", 100000, "mlx5_", 127,
                             "MT2892 Family [ConnectX-6 Dx]", "ConnectX Family mlx5Gen Virtual Function"),
    "e810": NicModel(0x8086, 0x1592, 0x1889, "ice", 100000, "irdma", 128,
                     "Ethernet Controller E810-C for QSFP", "Ethernet Adaptive Virtual Function"),
    "i350": NicModel(0x8086, 0x1521, 0x1520, "igb", 1000, None, 7,
                     "I350 Gigabit Network Connection", "I350 Ethernet Controller Virtual Function"),
    "virtio-net": NicModel(0x1AF4, 0x1041, None, "virtio-pci", 0, None, 0,
                           "Virtio 1.0 network device", net_driver="virtio_net"),
}

VENDORS = {0x10DE: "NVIDIA Corporation", 0x10EE: "Xilinx Corporation", 0x8086: "Intel Corporation",
           0x15B3: "Mellanox Technologies", 0x1AF4: "Red Hat, Inc."}

ALVEO: dict[str, AlveoModel] = {
    "u250": AlveoModel(
        0x5004, 0x5005, "xilinx_u250_gen3x16_xdma_shell_4_1", "xcu250-figd2104-2L-e",
        "1a2b3c4d-5e6f-4a1b-8c2d-3e4f5a6b7c8d", "Alveo U250",
    ),
    "u55c": AlveoModel(
        0x505C, 0x505D, "xilinx_u55c_gen3x16_xdma_base_3", "xcu55c-fsvh2892-2L-e",
        "97088961-feae-da91-52a2-1d9dfd63ccef", "Alveo U55C",
    ),
}

DFL: dict[str, DflModel] = {
    "d5005": DflModel(0x0B2B, "f3c9941350f55b4a896ba05c1c5d6c42", "0x23000410010309",
                      "FPGA Programmable Acceleration Card D5005"),
    "n3000": DflModel(0x0B30, "9346116d-a52d-5ca8-b06a-a9a389ef7c8d".replace("-", ""),
                      "0x231000200000136", "FPGA Programmable Acceleration Card N3000"),
}


def pci_ids() -> str:
    """A pci.ids database for the mock node: the catalog's devices, in the real file's format
    (the driver reads it with the same code as /usr/share/misc/pci.ids)."""
    devices: dict[int, dict[int, str]] = {}
    for gpu in GPUS.values():
        devices.setdefault(0x10DE, {})[gpu.pci_device] = gpu.product
    for nic in NICS.values():
        devices.setdefault(nic.vendor, {})[nic.pci_device] = nic.pci_name
        if nic.vf_device and nic.vf_name:
            devices[nic.vendor][nic.vf_device] = nic.vf_name
    for alveo in ALVEO.values():
        devices.setdefault(0x10EE, {})[alveo.mgmt_device] = f"{alveo.pci_name} (management)"
        devices[0x10EE][alveo.user_device] = alveo.pci_name
    for dfl in DFL.values():
        devices.setdefault(0x8086, {})[dfl.pci_device] = dfl.pci_name
    lines = ["# pci.ids of the mock node (driver/devices/mock/catalog.py)", "#"]
    for vendor in sorted(devices):
        lines.append(f"{vendor:04x}  {VENDORS[vendor]}")
        lines += [f"\t{device:04x}  {name}" for device, name in sorted(devices[vendor].items())]
    lines += ["C 02  Network controller", "\t00  Ethernet controller"]
    return "\n".join(lines) + "\n"


def markdown_table() -> str:
    """The models a profile may name, as documented in docs/mock-profiles.md (a test keeps
    the two equal)."""
    rows = ["| type | model | what it is |", "|---|---|---|"]
    for name, gpu in GPUS.items():
        mig = f"; MIG: {', '.join(gpu.mig)}" if gpu.mig else ""
        if gpu.gi_profiles:
            mig += f"; dynamic MIG: {', '.join(p.name for p in gpu.gi_profiles)}"
        rows.append(f"| `gpu` | `{name}` | {gpu.product}, {gpu.memory_mib} MiB{mig} |")
    for name, nic in NICS.items():
        extra = [f"{nic.speed_mbps // 1000} Gb/s", f"driver {nic.driver}"]
        if nic.total_vfs:
            extra.append(f"up to {nic.total_vfs} VFs")
        if nic.rdma_prefix:
            extra.append("RDMA")
        rows.append(f"| `nic` | `{name}` | PCI {nic.vendor:04x}:{nic.pci_device:04x}, {', '.join(extra)} |")
    for name, alveo in ALVEO.items():
        rows.append(f"| `alveo` | `{name}` | {alveo.vbnv} (interface {alveo.interface_uuid}) |")
    for name, dfl in DFL.items():
        rows.append(f"| `dfl` | `{name}` | Intel FPGA, PCI 8086:{dfl.pci_device:04x}, compat_id {dfl.compat_id} |")
    return "\n".join(rows) + "\n"
