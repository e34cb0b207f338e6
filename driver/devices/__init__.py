"""Device discovery: what accelerators this node has, in vendor-neutral terms (`model`).
GPUs and MIG through NVML (`nvml`, `migdynamic`, the driver's files in `nvlibs`), FPGAs and
NICs through sysfs (`fpga`, `net`, `pci`, `sysread`), all of it combined by `discovery`;
`fingerprint` tells cheaply whether anything changed, `problems` collects what could not be
read. `mock/` builds the same sysfs and NVML from a profile, so mock mode runs this code.

Imports only `driver.kube` (the names devices may have) and the instruments: everything
above it (publishing, preparing, the service) reads devices, never the other way."""
