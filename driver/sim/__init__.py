"""Emulators of the cluster side, for the demo, the fast tests and the benchmarks: an HTTP
API server (`apiserver`, with its claim-status and Events behaviour in `claimstatus` and
`events`), a fake kubelet speaking the real gRPC protocols (`kubelet`) and a pod runner
(`pods`). None of this runs in `dra-driver run`; the scheduler's model they use lives in
`driver.scheduling`. The real components are the judge: where hack/local-cluster shows a
difference, these change (docs/testing.md lists each)."""
