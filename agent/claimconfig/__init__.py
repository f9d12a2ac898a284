"""What a claim asks of its devices beyond allocation: the opaque configs (`resource.nvidia.com/v1beta1`
GpuConfig, MigDeviceConfig: sharing, MPS, time slicing), parsed and resolved per device. Pure.

The floor beneath both agent.sharing (which plans and applies those configs) and agent.claims (which prepares
claims and calls sharing): devices -> claims config -> sharing -> claims state -> kubelet.
"""
