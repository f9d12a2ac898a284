"""The queue arbiter: who goes next (queues, quota, fair share, gangs, reclaim, preemption).

`core` is the pure decision logic; `world` turns what the API says into the core's snapshot; `controller` runs
the cycle against the API and `commit` carries out an admitted gang, whole or not at all, through the nodes'
reservations (agent.reservation) and the API. `metrics` names what the arbiter exports; `fence` and
`uninstall` are how it becomes, and stops being, the only allocator of its driver's devices.
"""
