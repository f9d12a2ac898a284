"""Multi-node NVLink: NVIDIA's ComputeDomain API, IMEX channels and IMEX daemons (driver compute-domain.nvidia.com).

Pure: `model` (the ComputeDomain object, status.nodes, readiness), `channels` (devices, opaque configs, CDI specs,
/proc/devices), `imexconfig` (the IMEX daemon's config files), `templates` (the channel ResourceClaimTemplate).
I/O at the edges: `controller` (the ComputeDomain controller), `plugin` (the node agent's second kubelet plugin),
`checkpoint` (its prepared channels), `daemon` (the IMEX daemon of a domain on this node), `status` (this node's
entry of status.nodes).
"""
