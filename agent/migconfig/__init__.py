"""MIG reconfiguration from the node label `nvidia.com/mig.config`, as NVIDIA's mig-manager does it.

Pure: `spec` (mig-parted v1 files), `desired` (a config's layout per GPU), `plan` (steps from the current
layout to the wanted one). I/O at the edges: `files` (reading the config), `applying` (NVML steps),
`reconciler` (the label flow: pending, withdraw, wait for claims, apply, republish, success or failed).
"""
