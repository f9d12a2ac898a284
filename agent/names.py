"""Names users and other components depend on (DESIGN section 4): fixed, never renamed."""

GPU_CLASS = "gpu.nvidia.com"  # the DeviceClasses, as NVIDIA's driver names them
MIG_CLASS = "mig.nvidia.com"
GATE = "scheduling.gpu-dra-agent.io/arbiter"  # the scheduling gate that hands a pod to the arbiter
QUEUE_LABEL = "scheduling.gpu-dra-agent.io/queue"  # on a pod or its PodGroup: the leaf Queue it waits in
# on a Node: where its agent serves the reservation API (host:port), written by the agent itself
ADDRESS_ANNOTATION = "scheduling.gpu-dra-agent.io/reservation-address"
# beside it: the SHA-256 (hex, of the DER bytes) of the TLS certificate the agent made at start; the arbiter
# connects only to a server showing exactly that certificate
FINGERPRINT_ANNOTATION = "scheduling.gpu-dra-agent.io/reservation-certificate-sha256"
# on a pod the arbiter admitted: when (RFC 3339); min-runtime protections count from it
ADMITTED_ANNOTATION = "scheduling.gpu-dra-agent.io/admitted-at"
# the finalizer kube-scheduler (and KAI's binder) put on a claim they allocate; kube-controller-manager removes
# it once it has deallocated the claim
DELETE_PROTECTION = "resource.kubernetes.io/delete-protection"
QUEUE_GROUP = "scheduling.gpu-dra-agent.io"
COMPONENT = "gpu-dra-arbiter"  # Events' reportingComponent and the Lease's name
# the NoSchedule device taint the arbiter puts on every device of its driver (a DeviceTaintRule of this name):
# kube-scheduler then never allocates them, so the arbiter is their only allocator (DESIGN.md, issue 18)
FENCE_TAINT = "scheduling.gpu-dra-agent.io/arbiter"
FENCE_RULE = "gpu-dra-agent-arbiter"
DEFAULT_QUEUE = "default"  # where a gated pod that names no queue waits (the arbiter creates it when missing)
# the audience of the service-account token the arbiter presents to the node agents, and whose token it must
# be (the node agents check both through TokenReview)
RESERVATION_AUDIENCE = "gpu-dra-agent-reservations"
ARBITER_USER = "system:serviceaccount:gpu-dra-agent:gpu-dra-agent-arbiter"
