"""The prepare side: an allocated claim becomes CDI devices on this node, the devices are
set up for how the claim shares them, and the claim's status says so.

  claims       reading a claim and its allocation results for this driver and node
  opaque       the strict decoder of our opaque configs (claim- and class-level)
  preparer     NodePrepare/NodeUnprepare per claim: checks, CDI spec, checkpoint record
  committer    the group commit of the checkpoint's records for a batch of claims
  cdi          CDI spec files; `edits`: the container edits each device kind gets
  metadata     the device metadata files a container can read
  claimstatus  writing `status.devices` and conditions with server-side apply
  status       what the status of a prepared device says
  shares       consumable-capacity shares: limits from consumedCapacity, capacity checks
  setup        what a claim asks of a GPU (time-slicing, MPS) and when two claims conflict
  devicestate  the checkpoint of what we changed on a device, written before the change
  gpucontrol   compute mode (NVML) and time slice (nvidia-smi compute-policy)
  mps          one MPS control daemon per GPU, as a pod that outlives the driver;
               `mps_daemon` is the entry point that pod runs, `mpsusers` the UIDs it serves
  mig          dynamic MIG instances created at prepare and destroyed at unprepare

May import `driver.kube`, `driver.devices`, `driver.state` and `driver.publish` (slice
and pool names); never monitoring, the kubelet service or the plugin above it.
"""
