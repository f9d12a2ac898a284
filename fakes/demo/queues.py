"""The demo's queue scene: two teams share two 8-GPU nodes through the queue arbiter.

A gang of 2 x 8 GPUs is admitted across both nodes; team A bursts over its quota while team B is idle; team B
arrives and the arbiter reclaims team A's share above quota (evicting through the Eviction API), admitting
team B once the victims' claims are released. Everything runs against the fakes: the API server, the node
agents' reservation API over fake DGX H100s, and the controller stand-ins (fakes.cluster).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agent.kube.rest import EVENTS, PODS, QUEUES, RESOURCE_CLAIMS
from agent.names import GATE
from fakes.cluster import FakeCluster, wait_for
from fakes.demo import report


def _say(*lines: str) -> None:
    print(*lines, sep="\n", flush=True)


class QueueScene:
    def __init__(self, cluster: FakeCluster) -> None:
        self.c = cluster
        self.t0 = time.monotonic()

    def run(self) -> None:
        c = self.c
        c.queue("research")
        c.queue("team-a", parent="research", gpu_quota=8)
        c.queue("team-b", parent="research", gpu_quota=8)
        c.arbiter()
        _say(
            "  nodes      gpu-node-0, gpu-node-1: fake DGX H100, 8 GPUs each, agents serving reservations",
            "  queues     research -> team-a (quota 8 GPUs), team-b (quota 8 GPUs); over quota: weight 1 each",
            "  arbiter    gpu-dra-agent's Arbiter, with the stand-ins for kube-controller-manager and kube-scheduler",
        )
        self._queues()

        _say("", "  -- team-a submits llm-train: a PodGroup of 2 pods x 8 GPUs (minCount 2)")
        c.gang("team-a", "llm-train", "team-a", pods=2, gpus=8)
        self._until(lambda: len(self._bound("team-a", "llm-train-")) == 2, "llm-train admitted")
        wait_for(lambda: self._allocated_gpus("team-a") == 16, timeout=30, what="queue status")
        self._pods("team-a", "llm-train-")
        _say("     both pods admitted together, one per node: claims allocated, reserved for the pod, gate removed")
        self._queues()

        _say("", "  -- llm-train finishes (its pods are deleted): its claims are deallocated, the GPUs free")
        for p in self._bound("team-a", "llm-train-"):
            c.rest.delete(PODS, "team-a", p["metadata"]["name"])
        self._until(lambda: not self._allocated(), "GPUs freed")

        _say("", "  -- team-a bursts: 4 jobs x 4 GPUs while team-b is idle (work-conserving: over quota is fine)")
        for i in range(4):
            c.gang("team-a", f"sweep-{i}", "team-a", pods=1, gpus=4)
        self._until(lambda: len(self._bound("team-a", "sweep-")) == 4, "burst admitted")
        wait_for(lambda: self._allocated_gpus("team-a") == 16, timeout=30, what="queue status")
        self._pods("team-a", "sweep-")
        self._queues()

        _say("", "  -- team-b arrives: eval, a PodGroup of 2 pods x 4 GPUs; the cluster is full")
        c.gang("team-b", "eval", "team-b", pods=2, gpus=4)
        self._until(lambda: len(self._bound("team-b", "eval-")) == 2, "reclaim and admission")
        wait_for(lambda: len(self._events("team-a", "Evicted")) == 2, timeout=30, what="eviction events")
        for event in self._events("team-a", "Evicted"):
            _say(f"     event  {event['involvedObject']['name']}: {event['message']}")
        self._pods("team-b", "eval-")
        self._pods("team-a", "sweep-")
        _say("     team-a is back at its quota; team-b got its fair share once the victims' claims were released")
        wait_for(
            lambda: self._allocated_gpus("team-b") == 8 and self._allocated_gpus("team-a") == 8,
            timeout=30,
            what="queue status",
        )
        self._queues()

    # -- views --------------------------------------------------------------------------------------------

    def _until(self, check: Callable[[], Any], what: str) -> None:
        start = time.monotonic()
        wait_for(check, timeout=60, what=what)
        _say(f"     ({what} after {time.monotonic() - start:.1f}s)")

    def _bound(self, namespace: str, prefix: str) -> list[dict[str, Any]]:
        return [
            p
            for p in self.c.pods(namespace)
            if p["metadata"]["name"].startswith(prefix)
            and p["spec"].get("nodeName")
            and not p["metadata"].get("deletionTimestamp")
        ]

    def _allocated(self) -> list[Any]:
        return [c for c in self.c.rest.list(RESOURCE_CLAIMS)["items"] if (c.get("status") or {}).get("allocation")]

    def _events(self, namespace: str, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.c.rest.list(EVENTS, namespace)["items"] if e["reason"] == reason]

    def _pods(self, namespace: str, prefix: str) -> None:
        claims = {
            o["name"]: c
            for c in self.c.rest.list(RESOURCE_CLAIMS, namespace)["items"]
            for o in c["metadata"].get("ownerReferences") or ()
        }
        rows = []
        for p in sorted(self.c.pods(namespace), key=lambda p: p["metadata"]["name"]):
            name = p["metadata"]["name"]
            if not name.startswith(prefix):
                continue
            gated = any(g.get("name") == GATE for g in p["spec"].get("schedulingGates") or ())
            results = (
                ((claims.get(name, {}).get("status") or {}).get("allocation") or {})
                .get("devices", {})
                .get("results", [])
            )
            devices = ",".join(r["device"].removeprefix("gpu-") for r in results)
            state = "gated" if gated else ("terminating" if p["metadata"].get("deletionTimestamp") else "admitted")
            rows.append([name, state, p["spec"].get("nodeName") or "-", f"gpu {devices}" if devices else "-"])
        _say(*report.table(["POD", "STATE", "NODE", "DEVICES"], rows, indent="     "))

    def _allocated_gpus(self, queue: str) -> float:
        status = self.c.rest.get(QUEUES, None, queue).get("status") or {}
        return float((status.get("allocated") or {}).get("gpu", 0))

    def _queues(self) -> None:
        rows = []
        for q in self.c.rest.list(QUEUES)["items"]:
            status = q.get("status") or {}
            rows.append(
                [
                    q["metadata"]["name"],
                    q["spec"].get("parentQueue") or "-",
                    f"{q['spec']['resources']['gpu']['quota']:g}",
                    f"{(status.get('allocated') or {}).get('gpu', 0):g}",
                    f"{(status.get('fairShare') or {}).get('gpu', 0):g}",
                    f"{(status.get('requested') or {}).get('gpu', 0):g}",
                ]
            )
        _say(
            *report.table(
                ["QUEUE", "PARENT", "GPU QUOTA", "ALLOCATED", "FAIR SHARE", "REQUESTED"], rows, indent="     "
            )
        )


def run_queue_scene() -> None:
    with FakeCluster(nodes=2) as cluster:
        QueueScene(cluster).run()
