"""Utilization: NVML/sysfs samples (`sampler`) joined with the claims prepared on each
device (`monitor`), idle timers (`idle`) and the Idle Events and condition on claims
(`events`). `dra-driver status` shows it through `driver.service.nodeview`."""
