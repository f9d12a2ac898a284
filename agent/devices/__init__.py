"""The node's devices as pure data: inventory model, canonical names and MIG geometry.

Nothing in this package does I/O: discovery (agent.nvml) builds these values, everything else reads them.
"""
