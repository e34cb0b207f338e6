"""The prepare side: an allocated claim becomes CDI devices, and the devices are set up
for how the claim shares them.

  preparer     NodePrepare/NodeUnprepare per claim: checks, CDI spec, checkpoint record
  shares       consumable-capacity shares: limits from consumedCapacity, capacity checks
  setup        what a claim asks of a GPU (time-slicing, MPS) and when two claims conflict
  devicestate  the checkpoint of what we changed on a device, written before the change
  gpucontrol   compute mode (NVML) and time slice (nvidia-smi compute-policy)
  mps          one MPS control daemon per GPU, as a pod that outlives the driver
  sharing      applies, reconciles and undoes device setups
"""

from driver.prepare.preparer import PrepareOutcome, Preparer, base_request

__all__ = ["PrepareOutcome", "Preparer", "base_request"]
