"""The reservation protocol that the node agent and the arbiter both speak, beneath both of them.

`protocol` is the protocol itself, independent of the transport: the node's reservation book over the pure
allocator, and the arbiter's client interface. `transport` carries it over gRPC with TLS; `auth` is who may
speak it (the arbiter's service-account token, checked by TokenReview). `node_service` is the node's server
over its slices and claims; `selector_worker` evaluates a Reserve's CEL selectors within a budget.
"""
