"""The what-if simulator and the trace replay: research tools beside the product, behind the `simulation` extra.

`rounds` runs the arbiter's pure core for several cycles on a snapshot document (`snapshot/`), `nodes` commits
each round through in-process node allocators over the reservation protocol, and `replay` with
`trace_policies` replays a GPU cluster trace under placement policies. Neither the node agent nor the running
arbiter imports this package.
"""
