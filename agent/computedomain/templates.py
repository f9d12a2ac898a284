"""The ResourceClaimTemplate a ComputeDomain names, as NVIDIA's controller makes it, without I/O.

One request `channel` of the default-channel class, with the domain's ComputeDomainChannelConfig (its UID and
allocation mode) as opaque config for the driver, and (beyond NVIDIA's) a selector naming the clique the controller
picked for the domain (agent.computedomain.cliques), also kept in an annotation. The template carries NVIDIA's
labels and is owned by the domain, so deleting the domain deletes it (the controller also deletes it itself, and
removes its finalizer).
"""

from __future__ import annotations

from agent.computedomain import cliques
from agent.computedomain.channels import CHANNEL_CONFIG
from agent.computedomain.model import (
    API_VERSION,
    CHANNEL_CLASS,
    DRIVER,
    FINALIZER,
    KIND,
    LABEL,
    TARGET_LABEL,
    ComputeDomain,
)
from agent.jsontypes import Json

WORKLOAD = "workload"


def channel_template(domain: ComputeDomain, clique: str | None = None) -> Json:
    """`clique`: the domain's pick (cliques.NONE: none fits, no channel matches); None: no selector."""
    request: Json = {"deviceClassName": CHANNEL_CLASS}
    annotations: Json = {}
    if clique is not None:
        request["selectors"] = [{"cel": {"expression": cliques.selector(clique)}}]
        annotations[cliques.ANNOTATION] = clique
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": domain.template_name,
            "namespace": domain.namespace,
            "labels": {LABEL: domain.uid, TARGET_LABEL: WORKLOAD},
            **({"annotations": annotations} if annotations else {}),
            "finalizers": [FINALIZER],
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": KIND,
                    "name": domain.name,
                    "uid": domain.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "spec": {
                "devices": {
                    "requests": [{"name": "channel", "exactly": request}],
                    "config": [
                        {
                            "requests": ["channel"],
                            "opaque": {
                                "driver": DRIVER,
                                "parameters": {
                                    "apiVersion": API_VERSION,
                                    "kind": CHANNEL_CONFIG,
                                    "domainID": domain.uid,
                                    "allocationMode": domain.allocation_mode,
                                },
                            },
                        }
                    ],
                }
            }
        },
    }


def belongs_to(template: Json, domain_uid: str) -> bool:
    return bool(((template.get("metadata") or {}).get("labels") or {}).get(LABEL) == domain_uid)
