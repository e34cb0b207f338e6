"""`dra-driver explain`: why a ResourceClaim is pending, device by device.

- `world`: what the scheduler sees (ResourceSlices of every driver, DeviceClasses, the
  allocations of other claims, namespace labels, DeviceTaintRules) as plain data.
- `sources`: where that comes from (a cluster through a kubeconfig, files, a mock node)
  and where the claim comes from.
- `engine`: each request against each device, the first reason it is out; then counts,
  constraints and counters per node; a verdict per node.
- `suggest`: the obvious fixes (units, typos in attribute names, non-semver versions).
- `render`: a table for people, JSON for tools.
"""
