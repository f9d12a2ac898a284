"""Pure arbiter logic: no I/O, no clock; time and ids come in as arguments.

- `model`: the snapshot as frozen data (nodes, queues, jobs, pods).
- `snapshot`: parse and validate a snapshot document into the model.
- `fairshare`: KAI-style fair share per queue and resource.
- `cluster`: per-node free capacity (now and after pending releases) with placement policies.
- `session`: one cycle's mutable state, queue/job ordering and undoable statements.
- `allocate`, `consolidate`, `evict`: the actions.
- `cycle`: one cycle (a round) of actions, and rounds of cycles.
"""
