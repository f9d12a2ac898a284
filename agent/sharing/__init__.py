"""Sharing applied on the node: TimeSlicing and MPS for prepared claims, through NVIDIA's binaries.

`plan` (pure) turns a claim's devices and configs into what to set; `commands` is the one seam that runs
binaries (argv lists, found under the driver root, never a shell string); `smi` and `mps` speak to
nvidia-smi and nvidia-cuda-mps-control; `control` applies, undoes and adopts, crash-safely.
"""
