"""What the driver watches once devices are in use: device health (`health`: XIDs, lost
GPUs, links down → taints and the kubelet's health stream), per-device metric series
(`devicemetrics`), liveness and readiness (`probes`) and utilization with idle detection
(`utilization/`).

Sits above `driver.prepare` (it joins devices with the claims prepared on them) and below the
kubelet service and the plugin that start it. The instruments it builds on
(`driver.logs`, `driver.metrics`) stay at the bottom so that every layer can use them."""
