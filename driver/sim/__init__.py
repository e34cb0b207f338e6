"""Stand-ins for the cluster side, for the demo, the tests and the benchmarks: an HTTP API
server emulator, a fake kubelet speaking the real gRPC protocols, and a CEL evaluator for
DeviceClass and claim selectors. None of this runs in `dra-driver run`."""
