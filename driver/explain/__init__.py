"""`dra-driver explain`: why a ResourceClaim is pending, device by device.

- `world`: what the scheduler sees (ResourceSlices of every driver, DeviceClasses, the
  allocations of other claims, namespace labels, DeviceTaintRules) as plain data.
- `sources`: where that comes from (a cluster through a kubeconfig, files, a mock node)
  and where the claim comes from.
- `engine`: each request against each device, the first reason it is out; then counts,
  constraints and counters per node; a verdict per node.
- `verdicts`: what the engine finds, as data (device, alternative, node, explanation).
- `suggest`: the obvious fixes (units, typos in attribute names, non-semver versions).
- `render`: a table for people, JSON for tools.
- `configs`: opaque configs checked with the driver's own decoder; `command`: the CLI.
- `blocking` (`--blocking`): per node, the smallest set of allocated claims whose removal
  lets the request fit, found by running the engine; `blocking_request`: `--request SPEC`;
  `blocking_render`: its table, JSON and YAML.
- `capacity` (`dra-driver capacity`): per node, the largest request of each kind that the
  engine still allocates, and the cluster's fragmentation; `capacity_inputs`: mock nodes
  and one world per node; `capacity_render`, `capacity_command`.

Imports run command → configs/render → engine → suggest → verdicts/world; the scheduler's
model comes from `driver.scheduling`, the claims of the demo from `driver.demo`.
"""
