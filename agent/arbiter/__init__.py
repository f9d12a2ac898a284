"""The queue arbiter: who goes next (queues, quota, fair share, gangs, reclaim, preemption).

`agent.arbiter.core` is the pure decision logic and the cluster simulator it runs on; `metrics` names what the
arbiter exports. The Kubernetes wiring and the reservation protocol live beside them.
"""
