"""Per-node capacity in two layers, and where a pod fits.

`now` is what pods hold at this moment (running, releasing, just bound); `after` is what they will hold once
pending releases finish (running, just bound, pipelined). Binding needs room in both layers; pipelining, i.e.
promising resources still being released, needs room only `after`. GPUs are tracked one by one in milli-GPUs,
so fractional pods share a device and whole-GPU pods take devices that are empty in the needed layers.

Nodes are bucketed by how many whole GPUs they can bind, so finding a node for a whole-GPU pod walks buckets
(binpack: fewest free first; spread: most) instead of scanning every node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from agent.arbiter.core.model import MILLI, NodeSpec, Placement, PodSpec


@dataclass(frozen=True, slots=True)
class Seat:
    """Where a pod sits: a node and the GPU indices it uses (one index for a fractional pod)."""

    node: int
    gpus: tuple[int, ...]


class Node:
    __slots__ = ("after_free", "cpu_after", "cpu_now", "domains", "gpu_after", "gpu_now", "index", "mem_after",
                 "mem_now", "releases", "spec", "whole_free")

    def __init__(self, spec: NodeSpec, index: int) -> None:
        self.spec = spec
        self.index = index
        self.cpu_now = self.cpu_after = spec.cpu_milli
        self.mem_now = self.mem_after = spec.mem_bytes
        self.gpu_now = [0] * spec.gpus  # milli-GPUs used, per device
        self.gpu_after = [0] * spec.gpus
        listed = {i for d in spec.nvlink_domains for i in d}
        self.domains = list(spec.nvlink_domains) + [(i,) for i in range(spec.gpus) if i not in listed]
        self.releases = 0  # pods on this node whose release is pending (releasing or evicted this cycle)
        self.whole_free = spec.gpus  # GPUs empty now and after: bindable whole
        self.after_free = spec.gpus  # GPUs empty after pending releases: promisable whole

    def count_whole_free(self) -> int:
        return sum(1 for a, b in zip(self.gpu_now, self.gpu_after, strict=True) if a == 0 and b == 0)

    def selects(self, pod: PodSpec) -> bool:
        if not pod.node_selector:
            return True
        labels = self.spec.labels
        return all(labels.get(k) == v for k, v in pod.node_selector.items())


class Cluster:
    def __init__(self, nodes: Sequence[NodeSpec], placement: Placement) -> None:
        self.nodes = [Node(spec, i) for i, spec in enumerate(nodes)]
        self.by_name = {n.spec.name: n.index for n in self.nodes}
        self.placement = placement
        top = max((n.spec.gpus for n in self.nodes), default=0)
        self.buckets: list[dict[int, None]] = [{} for _ in range(top + 1)]
        for n in self.nodes:
            self.buckets[n.whole_free][n.index] = None
        self.shared: dict[int, None] = {}  # nodes with a partly used GPU
        self.releasing: dict[int, None] = {}  # nodes with pending releases: room for pipelining
        self.releasing_buckets: list[dict[int, None]] = [{} for _ in range(top + 1)]  # by after_free
        self.gpu_after_free = sum(n.spec.gpus for n in self.nodes) * MILLI

    # -- accounting -------------------------------------------------------------------------------------

    def occupy(self, pod: PodSpec, seat: Seat, now: bool, after: bool, sign: int) -> None:
        """Take (sign 1) or give back (sign -1) a pod's resources in the given layers."""
        node = self.nodes[seat.node]
        share = pod.gpu_milli if pod.fractional else MILLI
        if now:
            node.cpu_now -= sign * pod.cpu_milli
            node.mem_now -= sign * pod.mem_bytes
            for g in seat.gpus:
                node.gpu_now[g] += sign * share
        if after:
            node.cpu_after -= sign * pod.cpu_milli
            node.mem_after -= sign * pod.mem_bytes
            for g in seat.gpus:
                node.gpu_after[g] += sign * share
            self.gpu_after_free -= sign * share * len(seat.gpus)
        self._reindex(node)

    def mark_release(self, node_index: int, sign: int) -> None:
        node = self.nodes[node_index]
        node.releases += sign
        if node.releases > 0:
            self.releasing[node_index] = None
            self.releasing_buckets[node.after_free][node_index] = None
        else:
            self.releasing.pop(node_index, None)
            self.releasing_buckets[node.after_free].pop(node_index, None)

    def _reindex(self, node: Node) -> None:
        free = node.count_whole_free()
        if free != node.whole_free:
            del self.buckets[node.whole_free][node.index]
            self.buckets[free][node.index] = None
            node.whole_free = free
        after = node.gpu_after.count(0)
        if after != node.after_free:
            if node.releases > 0:
                del self.releasing_buckets[node.after_free][node.index]
                self.releasing_buckets[after][node.index] = None
            node.after_free = after
        if any(0 < u < MILLI for u in node.gpu_now) or any(0 < u < MILLI for u in node.gpu_after):
            self.shared[node.index] = None
        else:
            self.shared.pop(node.index, None)

    # -- finding room -----------------------------------------------------------------------------------

    def find(self, pod: PodSpec, bind: bool, held: Mapping[int, Iterable[int]], exclude: int = -1,
             gang_gpus: int = 0) -> Seat | None:
        """A seat for `pod`: bindable now (`bind`) or promised after releases. `held`: node -> GPUs its gang
        already uses there, and `gang_gpus`: whole GPUs the gang still needs with this pod (both to keep a gang
        inside one NVLink domain)."""
        if pod.gpu_milli == 0:
            return self._find_cpu_only(pod, bind, exclude)
        if pod.fractional:
            return self._find_shared(pod, bind, exclude)
        count = pod.gpu_milli // MILLI
        buckets = self.buckets if bind else self.releasing_buckets
        order = range(count, len(buckets))
        if self.placement.gpu == "spread":
            order = range(len(buckets) - 1, count - 1, -1)
        for free in order:
            for i in buckets[free]:
                if i != exclude:
                    seat = self._seat_whole(self.nodes[i], pod, count, bind, held.get(i, ()), gang_gpus=gang_gpus)
                    if seat is not None:
                        return seat
        return None

    def fits_cpu_mem(self, node: Node, pod: PodSpec, bind: bool) -> bool:
        if node.cpu_after < pod.cpu_milli or node.mem_after < pod.mem_bytes:
            return False
        if bind and (node.cpu_now < pod.cpu_milli or node.mem_now < pod.mem_bytes):
            return False
        return node.selects(pod)

    def seat_free(self, pod: PodSpec, seat: Seat, bind: bool) -> bool:
        """Whether `seat` (a pod's old place) is still free enough for it."""
        node = self.nodes[seat.node]
        if not self.fits_cpu_mem(node, pod, bind):
            return False
        need = pod.gpu_milli if pod.fractional else MILLI
        layers = (node.gpu_now, node.gpu_after) if bind else (node.gpu_after,)
        return all(layer[g] + need <= MILLI for layer in layers for g in seat.gpus)

    def _seat_whole(
        self, node: Node, pod: PodSpec, count: int, bind: bool, held: Iterable[int], *, gang_gpus: int = 0
    ) -> Seat | None:
        if not self.fits_cpu_mem(node, pod, bind):
            return None
        now, after = node.gpu_now, node.gpu_after
        free = [g for g in range(node.spec.gpus) if after[g] == 0 and (not bind or now[g] == 0)]
        if len(free) < count:
            return None
        if len(node.domains) == 1:
            return Seat(node.index, tuple(free[:count]))
        free_set = set(free)
        held_set = set(held)
        options = []
        for domain in node.domains:
            mine = [g for g in domain if g in free_set]
            if len(mine) >= count:
                # the gang's own domain first, then one that holds the rest of the gang, then the tightest
                # (binpack) or roomiest (spread) domain
                room = len(mine) if self.placement.gpu == "binpack" else -len(mine)
                rest_fits = len(mine) >= min(gang_gpus, len(domain))
                options.append((not held_set.intersection(domain), not rest_fits, room, mine[:count]))
        if options:
            return Seat(node.index, tuple(min(options)[3]))
        return Seat(node.index, tuple(free[:count]))

    def _find_shared(self, pod: PodSpec, bind: bool, exclude: int) -> Seat | None:
        binpack = self.placement.gpu == "binpack"
        best: Seat | None = None
        best_used = -1
        for i in self.shared:
            node = self.nodes[i]
            if i == exclude or not self.fits_cpu_mem(node, pod, bind):
                continue
            for g, used in enumerate(node.gpu_after):
                fits = used > 0 and used + pod.gpu_milli <= MILLI
                fits = fits and (not bind or node.gpu_now[g] + pod.gpu_milli <= MILLI)
                if fits and (best is None or (used > best_used) == binpack):
                    best, best_used = Seat(i, (g,)), used
        if best is not None and binpack:
            return best
        whole = self.find(_one_gpu(pod), bind, {}, exclude)
        if whole is not None:
            return whole
        return best if best is not None else self._find_shared_anywhere(pod, bind, exclude)

    def _find_shared_anywhere(self, pod: PodSpec, bind: bool, exclude: int) -> Seat | None:
        # a partly released GPU: only reachable by pipelining onto a releasing node
        if bind:
            return None
        for i in self.releasing:
            node = self.nodes[i]
            if i != exclude and self.fits_cpu_mem(node, pod, False):
                for g, used in enumerate(node.gpu_after):
                    if used + pod.gpu_milli <= MILLI:
                        return Seat(i, (g,))
        return None

    def _find_cpu_only(self, pod: PodSpec, bind: bool, exclude: int) -> Seat | None:
        binpack = self.placement.cpu == "binpack"
        best: Seat | None = None
        best_free = 0.0
        candidates = range(len(self.nodes)) if bind else self.releasing
        for i in candidates:
            node = self.nodes[i]
            if i != exclude and self.fits_cpu_mem(node, pod, bind):
                free = node.cpu_after
                if best is None or (free < best_free) == binpack:
                    best, best_free = Seat(i, ()), free
        return best


def _one_gpu(pod: PodSpec) -> PodSpec:
    """The same pod asking for a whole device: where a fractional pod opens a fresh GPU."""
    return replace(pod, gpu_milli=MILLI)
