"""`gpu-dra-agent arbiter --uninstall`: hand the pods that wait for the arbiter back to kube-scheduler.

Removed, in the order that lets nothing put them back: the arbiter's Deployment (a running arbiter restores
its fence), then, once no arbiter holds the Lease, the admission policies that gate new pods and protect new
claims, the fence (the DeviceTaintRule), the scheduling gate of every waiting pod, and the Lease (the node
agents then stop telling pods about an absent arbiter). The Queues, their CRD and the arbiter's RBAC stay:
`kubectl apply -k daemonset/overlays/arbiter` installs it again with the same Queues. An arbiter that still
holds the Lease (one run outside the Deployment) stops it with nothing else removed (agent.kube.uninstall).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from agent.jsontypes import Json
from agent.kube.errors import ApiError, Conflict, NotFound
from agent.kube.rest import DEVICE_TAINT_RULES, PODS, Resource, Rest
from agent.kube.uninstall import Controller, delete
from agent.names import COMPONENT, FENCE_RULE, GATE
from agent.objects.read import is_gated, meta, pod_key

log = logging.getLogger(__name__)

DEPLOYMENT = "gpu-dra-agent-arbiter"  # daemonset/overlays/arbiter/arbiter.yaml
GATE_POLICY = "gpu-dra-agent-arbiter-gate"  # daemonset/overlays/arbiter/admission-gate.yaml
CLAIM_POLICY = "gpu-dra-agent-claim-protection"  # daemonset/overlays/arbiter/claim-protection.yaml
# v1 from Kubernetes 1.36; the README tells 1.34-1.35 users to apply the policies as v1beta1
POLICY_RESOURCES = tuple(
    (kind, Resource("admissionregistration.k8s.io", version, plural, False))
    for version in ("v1", "v1beta1")
    for kind, plural in (
        ("MutatingAdmissionPolicyBinding", "mutatingadmissionpolicybindings"),
        ("MutatingAdmissionPolicy", "mutatingadmissionpolicies"),
    )
)


def _ungate(rest: Rest, pod: Json) -> bool:
    """Remove our gate, nothing else, from one pod; re-read on a conflict. False when it is gone or ungated."""
    m = meta(pod)
    namespace, name = str(m.get("namespace")), str(m.get("name"))
    for _ in range(5):
        if not is_gated(pod):
            return False
        rest_gates = [g for g in (pod.get("spec") or {}).get("schedulingGates") or () if g.get("name") != GATE]
        try:
            rest.patch(
                PODS,
                namespace,
                name,
                {
                    "metadata": {"resourceVersion": meta(pod).get("resourceVersion")},
                    "spec": {"schedulingGates": rest_gates or None},
                },
            )
            return True
        except Conflict:
            try:
                pod = rest.get(PODS, namespace, name)
            except NotFound:
                return False
    raise ApiError(409, f"pod {namespace}/{name} kept changing; run --uninstall again")


def _release(rest: Rest, say: Callable[[str], None]) -> str:
    """The arbiter's hold on pods, let go once no arbiter runs (one still running would put the fence back)."""
    for name, effect in (
        (GATE_POLICY, "new pods are not gated"),
        (CLAIM_POLICY, "new claims get their finalizer as kube-scheduler allocates them"),
    ):
        for kind, resource in POLICY_RESOURCES:
            if delete(rest, resource, None, name):
                say(f"deleted {kind} {name} ({resource.api_version}): {effect}")
    if delete(rest, DEVICE_TAINT_RULES, None, FENCE_RULE):
        say(f"deleted DeviceTaintRule {FENCE_RULE}: kube-scheduler allocates the driver's devices again")
    ungated = 0
    for pod in rest.list(PODS).get("items") or []:
        if _ungate(rest, pod):
            ungated += 1
            say(f"ungated pod {pod_key(pod)}")
    return (
        f"{ungated} pod(s) handed to kube-scheduler; the Queues and the arbiter's RBAC stay "
        f"(kubectl apply -k daemonset/overlays/arbiter installs the arbiter again)"
    )


ARBITER = Controller(DEPLOYMENT, COMPONENT, _release)  # agent.kube.uninstall runs it
