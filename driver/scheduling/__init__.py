"""Our model of the Kubernetes scheduler's device allocation, shipped to users by
`dra-driver explain` and the demo: the DRA CEL environment (`cel`), the structured allocator
(`allocator`), device taints and tolerations (`taints`) and the API server's limits the
scheduler relies on (`k8s_limits`). Checked against the real allocator by
`hack/allocator-oracle` (docs/testing.md).

May import `driver.kube` (names, quantities) and `driver.devices.model`; the emulators of
`driver.sim`, the demo and explain import it, never the other way."""
