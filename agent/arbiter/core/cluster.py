"""Per-node capacity in two layers, and where a pod fits.

`now` is what pods hold at this moment (running, releasing, just bound); `after` is what they will hold once
pending releases finish (running, just bound, pipelined). Binding needs room in both layers; pipelining, i.e.
promising resources still being released, needs room only `after`. GPUs are tracked one by one in milli-GPUs,
so fractional pods share a device and whole-GPU pods take devices that are empty in the needed layers.

Nodes are bucketed by how many whole GPUs they can bind, so finding a node for a whole-GPU pod walks buckets
(binpack: fewest free first; spread: most) instead of scanning every node; inside a bucket, by node name. Under
`fgd` (the default) nodes are also grouped by shape (fragments.py) and a find scores each shape once, then walks
the best-scoring nodes by name. A pod coming or going updates the counters behind the buckets GPU by GPU, never
by rescanning its node: actions try (and undo) tens of thousands of moves per cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from agent.arbiter.core.fragments import NO_FIT, Shape, ShapeScores, workload_mix
from agent.arbiter.core.model import MILLI, NodeSpec, Placement, PodSpec


class Seat:
    """Where a pod sits: a node and the GPU indices it uses (one index for a fractional pod). A plain class, not
    a NamedTuple: a compiled core builds one natively, where a NamedTuple's constructor runs as Python."""

    __slots__ = ("gpus", "node")

    def __init__(self, node: int, gpus: tuple[int, ...]) -> None:
        self.node = node
        self.gpus = gpus


class NodeSet:
    """A set of node indices iterated in index order, which is node-name order (the cluster numbers its nodes
    by name): equally scored nodes are tried in node-name order, as KAI does, whatever order they came and
    went in. A bit mask: adding, removing and finding the next member are a few machine words per 64 nodes."""

    __slots__ = ("bits",)

    def __init__(self, bits: int = 0) -> None:
        self.bits = bits

    def add(self, i: int) -> None:
        self.bits |= 1 << i

    def discard(self, i: int) -> None:
        self.bits &= ~(1 << i)

    def __contains__(self, i: int) -> bool:
        return bool(self.bits >> i & 1)

    def __len__(self) -> int:
        return self.bits.bit_count()

    def __bool__(self) -> bool:
        return self.bits != 0

    def __iter__(self) -> Iterator[int]:
        bits = self.bits  # a snapshot: members may come and go while the caller walks
        while bits:
            low = bits & -bits
            yield low.bit_length() - 1
            bits ^= low


class Node:
    __slots__ = (
        "after_free",
        "bit",
        "cpu_after",
        "cpu_now",
        "domains",
        "gpu_after",
        "gpu_now",
        "index",
        "mem_after",
        "mem_now",
        "other_after",
        "other_now",
        "partial",
        "releases",
        "shape_id",
        "spec",
        "unbit",
        "whole_free",
    )

    def __init__(self, spec: NodeSpec, index: int) -> None:
        self.spec = spec
        self.index = index
        # its bit in a NodeSet, and every bit but it: made once, as the sets change at every pod that comes or
        # goes, and on a large cluster each is a many-word integer
        self.bit = 1 << index
        self.unbit = ~self.bit
        self.cpu_now = self.cpu_after = spec.cpu_milli
        self.mem_now = self.mem_after = spec.mem_bytes
        self.other_now = dict(spec.other)
        self.other_after = dict(spec.other)
        self.gpu_now = [0] * spec.gpus  # milli-GPUs used, per device
        self.gpu_after = [0] * spec.gpus
        listed = {i for d in spec.nvlink_domains for i in d}
        self.domains = list(spec.nvlink_domains) + [(i,) for i in range(spec.gpus) if i not in listed]
        self.releases = 0  # pods on this node whose release is pending (releasing or evicted this cycle)
        # counters kept up to date GPU by GPU as pods come and go, so no change rescans the node (set by
        # `Cluster.index` once the pods placed before the cycle are loaded)
        self.whole_free = 0  # GPUs empty now and after: bindable whole
        self.after_free = 0  # GPUs empty after pending releases: promisable whole
        self.partial = 0  # (GPU, layer) pairs partly used: the node has room for fractional pods
        self.shape_id = -1  # fgd: its shape (milli used per GPU after pending releases, sorted) in `Cluster.shapes`

    def selects(self, pod: PodSpec) -> bool:
        allowed = pod.allowed_nodes
        return allowed is None or self.spec.name in allowed


class Cluster:
    """Built in two steps: the pods placed before the cycle are `load`ed into the layers, then `index` builds the
    counters and node sets from them at once (a pod at a time, a 4,000-node cluster's 24,000 pods would each
    move their node between sets)."""

    def __init__(self, nodes: Sequence[NodeSpec], placement: Placement, workload: Iterable[int] = ()) -> None:
        """`workload`: every pod's GPU milli, what fgd measures fragmentation against (read only under fgd)."""
        self.nodes = [Node(spec, i) for i, spec in enumerate(sorted(nodes, key=lambda n: n.name))]
        self.by_name = {n.spec.name: n.index for n in self.nodes}
        self.placement = placement
        self.scores = ShapeScores(workload_mix(workload)) if placement.gpu == "fgd" else None
        # fgd only: every shape seen, numbered; the nodes of each shape present; and shape changes, one GPU's
        # milli from old to new, as (shape, old, new) -> shape, so a change looks up one integer
        self.shapes: list[Shape] = []
        self._shape_ids: dict[Shape, int] = {}
        self._steps: dict[int, int] = {}
        self.by_shape: dict[int, NodeSet] = {}
        top = max((n.spec.gpus for n in self.nodes), default=0)
        self.buckets = [NodeSet() for _ in range(top + 1)]  # by whole_free
        self.shared = NodeSet()  # nodes with a partly used GPU
        self.releasing = NodeSet()  # nodes with pending releases: room for pipelining
        self.releasing_buckets = [NodeSet() for _ in range(top + 1)]  # by after_free
        self.gpu_after_free = 0

    def load(self, pod: PodSpec, seat: Seat, running: bool) -> None:
        """A pod placed before the cycle takes its seat: now, and after releases too when it keeps running."""
        node = self.nodes[seat.node]
        share = _share(pod)
        node.cpu_now -= pod.cpu_milli
        node.mem_now -= pod.mem_bytes
        if pod.other:
            _take(node.other_now, pod.other, 1)
            if running:
                _take(node.other_after, pod.other, 1)
        if running:
            node.cpu_after -= pod.cpu_milli
            node.mem_after -= pod.mem_bytes
        for g in seat.gpus:
            node.gpu_now[g] += share
            if running:
                node.gpu_after[g] += share

    def index(self) -> None:
        """The counters and node sets, from the layers as loaded."""
        for node in self.nodes:
            self.index_node(node)

    def index_node(self, node: Node) -> None:
        """One node's counters, and its place in the node sets, from its layers as loaded."""
        bit = node.bit
        pairs = list(zip(node.gpu_now, node.gpu_after, strict=True))
        node.whole_free = sum(1 for a, b in pairs if a == 0 and b == 0)
        node.after_free = node.gpu_after.count(0)
        node.partial = sum((0 < a < MILLI) + (0 < b < MILLI) for a, b in pairs)
        self.buckets[node.whole_free].bits |= bit
        if node.partial:
            self.shared.bits |= bit
        if self.scores is not None:
            node.shape_id = self._shape_id(tuple(sorted(node.gpu_after)))
            members = self.by_shape.setdefault(node.shape_id, NodeSet())
            members.bits |= bit
        self.gpu_after_free += node.spec.gpus * MILLI - sum(node.gpu_after)

    def empty(self, node: Node) -> None:
        """Take every pod off the node, and the node out of the node sets, so its pods can be loaded again."""
        unbit = node.unbit
        self.buckets[node.whole_free].bits &= unbit
        self.shared.bits &= unbit
        self.releasing.bits &= unbit
        self.releasing_buckets[node.after_free].bits &= unbit
        if node.shape_id >= 0:
            members = self.by_shape[node.shape_id]
            members.bits &= unbit
            if not members.bits:
                del self.by_shape[node.shape_id]
        self.gpu_after_free -= node.spec.gpus * MILLI - sum(node.gpu_after)
        spec = node.spec
        node.cpu_now = node.cpu_after = spec.cpu_milli
        node.mem_now = node.mem_after = spec.mem_bytes
        node.other_now = dict(spec.other)
        node.other_after = dict(spec.other)
        node.gpu_now = [0] * spec.gpus
        node.gpu_after = [0] * spec.gpus
        node.releases = 0
        node.whole_free = node.after_free = node.partial = 0
        node.shape_id = -1

    # -- accounting -------------------------------------------------------------------------------------

    def occupy(self, pod: PodSpec, seat: Seat, now: bool, after: bool, sign: int) -> None:
        """Take (sign 1) or give back (sign -1) a pod's resources in the given layers."""
        node = self.nodes[seat.node]
        share = sign * _share(pod)
        if now:
            node.cpu_now -= sign * pod.cpu_milli
            node.mem_now -= sign * pod.mem_bytes
            if pod.other:
                _take(node.other_now, pod.other, sign)
        if after:
            node.cpu_after -= sign * pod.cpu_milli
            node.mem_after -= sign * pod.mem_bytes
            if pod.other:
                _take(node.other_after, pod.other, sign)
            self.gpu_after_free -= share * len(seat.gpus)
        gpu_now, gpu_after = node.gpu_now, node.gpu_after
        whole = node.whole_free
        after_free = node.after_free
        partial = node.partial
        for g in seat.gpus:
            a, b = gpu_now[g], gpu_after[g]
            # take this GPU's part out of the counters, change it, put it back
            whole -= a == 0 and b == 0
            after_free -= b == 0
            partial -= (0 < a < MILLI) + (0 < b < MILLI)
            if now:
                a += share
                gpu_now[g] = a
            if after:
                b += share
                gpu_after[g] = b
            whole += a == 0 and b == 0
            after_free += b == 0
            partial += (0 < a < MILLI) + (0 < b < MILLI)
        self._reindex(node, whole, after_free, partial)
        if after and self.scores is not None:
            self._reshape(node, seat.gpus, share)

    def mark_release(self, node_index: int, sign: int) -> None:
        node = self.nodes[node_index]
        node.releases += sign
        if node.releases > 0:
            self.releasing.bits |= node.bit
            self.releasing_buckets[node.after_free].bits |= node.bit
        else:
            self.releasing.bits &= node.unbit
            self.releasing_buckets[node.after_free].bits &= node.unbit

    def _reindex(self, node: Node, whole: int, after_free: int, partial: int) -> None:
        # the node sets' bits are flipped in place: this runs for every pod that comes or goes
        bit, unbit = node.bit, node.unbit
        if whole != node.whole_free:
            self.buckets[node.whole_free].bits &= unbit
            self.buckets[whole].bits |= bit
            node.whole_free = whole
        if after_free != node.after_free:
            if node.releases > 0:
                self.releasing_buckets[node.after_free].bits &= unbit
                self.releasing_buckets[after_free].bits |= bit
            node.after_free = after_free
        if (partial > 0) != (node.partial > 0):
            if partial:
                self.shared.bits |= bit
            else:
                self.shared.bits &= unbit
        node.partial = partial

    def _reshape(self, node: Node, gpus: tuple[int, ...], share: int) -> None:
        """The node's `gpus` changed by `share` milli after releases: its shape, and the shape's node set, follow."""
        sid = node.shape_id
        after = node.gpu_after
        for g in gpus:
            sid = self._step(sid, after[g] - share, after[g])
        if sid != node.shape_id:
            by_shape = self.by_shape
            old = by_shape[node.shape_id]
            old.bits &= node.unbit
            if not old.bits:
                del by_shape[node.shape_id]
            members = by_shape.get(sid)
            if members is None:
                by_shape[sid] = NodeSet(node.bit)
            else:
                members.bits |= node.bit
            node.shape_id = sid

    def _step(self, sid: int, old: int, new: int) -> int:
        """The shape `sid` with one GPU's milli changed from `old` to `new`."""
        cacheable = 0 <= old <= MILLI and 0 <= new <= MILLI  # so the key names one change only
        key = (sid * _SPAN + old) * _SPAN + new
        step = self._steps.get(key) if cacheable else None
        if step is None:
            shape = list(self.shapes[sid])
            shape[shape.index(old)] = new
            shape.sort()
            step = self._shape_id(tuple(shape))
            if cacheable:
                self._steps[key] = step
        return step

    def _shape_id(self, shape: Shape) -> int:
        sid = self._shape_ids.get(shape)
        if sid is None:
            sid = self._shape_ids[shape] = len(self.shapes)
            self.shapes.append(shape)
        return sid

    # -- finding room -----------------------------------------------------------------------------------

    def find(
        self, pod: PodSpec, bind: bool, held: Mapping[int, Iterable[int]], exclude: int = -1, gang_gpus: int = 0
    ) -> Seat | None:
        """A seat for `pod`: bindable now (`bind`) or promised after releases. `held`: node -> GPUs its gang
        already uses there, and `gang_gpus`: whole GPUs the gang still needs with this pod (both to keep a gang
        inside one NVLink domain)."""
        if pod.gpu_milli == 0:
            return self._find_cpu_only(pod, bind, exclude)
        if pod.fractional:
            return self._find_shared(pod, bind, exclude)
        return self._find_whole(pod, pod.gpu_milli // MILLI, bind, held, exclude=exclude, gang_gpus=gang_gpus)

    def _find_whole(
        self, pod: PodSpec, count: int, bind: bool, held: Mapping[int, Iterable[int]], *, exclude: int, gang_gpus: int
    ) -> Seat | None:
        """`count` whole GPUs for `pod` (whose own GPU request is not looked at: a fractional pod may ask for a
        fresh device)."""
        if self.scores is not None:
            return self._find_whole_fgd(pod, count, bind, held, exclude=exclude, gang_gpus=gang_gpus)
        buckets = self.buckets if bind else self.releasing_buckets
        order = range(count, len(buckets))
        if self.placement.gpu == "spread":
            order = range(len(buckets) - 1, count - 1, -1)
        nodes = self.nodes
        for free in order:
            for i in buckets[free]:
                if i != exclude:
                    seat = self._seat_whole(nodes[i], pod, count, bind, held.get(i, ()), gang_gpus=gang_gpus)
                    if seat is not None:
                        return seat
        return None

    def _find_whole_fgd(
        self, pod: PodSpec, count: int, bind: bool, held: Mapping[int, Iterable[int]], *, exclude: int, gang_gpus: int
    ) -> Seat | None:
        scores = self.scores
        assert scores is not None
        nodes = self.nodes
        # only nodes with `count` GPUs empty in the needed layers: any other would fail `_seat_whole`, and on a
        # busy cluster binding tries would otherwise walk every node that is free only once releases finish
        pool = 0
        for members in (self.buckets if bind else self.releasing_buckets)[count:]:
            pool |= members.bits
        if not pool:
            return None
        for i in self._by_score(lambda shape: scores.whole(shape, count), pool):
            if i != exclude:
                seat = self._seat_whole(nodes[i], pod, count, bind, held.get(i, ()), gang_gpus=gang_gpus)
                if seat is not None:
                    return seat
        return None

    def _by_score(self, score_of: Callable[[Shape], int], pool: int) -> Iterator[int]:
        """Node indices among `pool` (bits), best-scoring shape first and equal scores in node-name order: each
        shape present is scored once and the nodes of equally scored shapes are merged as bit masks."""
        ranked: dict[int, int] = {}  # score -> the nodes (bits) of every shape scoring so
        shapes = self.shapes
        for sid, members in self.by_shape.items():
            bits = members.bits & pool
            if bits:
                score = score_of(shapes[sid])
                if score != NO_FIT:
                    ranked[score] = ranked.get(score, 0) | bits
        for score in sorted(ranked, reverse=True):
            yield from NodeSet(ranked[score])

    def fits_node(self, node: Node, pod: PodSpec, bind: bool) -> bool:
        """Whether the node has room for the pod beside GPUs (CPU, memory, its other resources: after pending
        releases, and now as well to bind) and the pod may run there."""
        if node.cpu_after < pod.cpu_milli or node.mem_after < pod.mem_bytes:
            return False
        if bind and (node.cpu_now < pod.cpu_milli or node.mem_now < pod.mem_bytes):
            return False
        if pod.other and not (_has(node.other_after, pod.other) and (not bind or _has(node.other_now, pod.other))):
            return False
        return node.selects(pod)

    def seat_free(self, pod: PodSpec, seat: Seat, bind: bool) -> bool:
        """Whether `seat` (a pod's old place) is still free enough for it."""
        node = self.nodes[seat.node]
        if not self.fits_node(node, pod, bind):
            return False
        need = pod.gpu_milli if pod.fractional else MILLI
        layers = (node.gpu_now, node.gpu_after) if bind else (node.gpu_after,)
        return all(layer[g] + need <= MILLI for layer in layers for g in seat.gpus)

    def _seat_whole(
        self, node: Node, pod: PodSpec, count: int, bind: bool, held: Iterable[int], *, gang_gpus: int
    ) -> Seat | None:
        if not self.fits_node(node, pod, bind):
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
                # (binpack, fgd) or roomiest (spread) domain
                room = -len(mine) if self.placement.gpu == "spread" else len(mine)
                rest_fits = len(mine) >= min(gang_gpus, len(domain))
                options.append((not held_set.intersection(domain), not rest_fits, room, mine[:count]))
        if options:
            return Seat(node.index, tuple(min(options)[3]))
        return Seat(node.index, tuple(free[:count]))

    def _find_shared(self, pod: PodSpec, bind: bool, exclude: int) -> Seat | None:
        if self.scores is not None:
            return self._find_shared_fgd(pod, bind, exclude)
        binpack = self.placement.gpu == "binpack"
        best: Seat | None = None
        best_used = -1
        for i in self.shared:
            node = self.nodes[i]
            if i == exclude or not self.fits_node(node, pod, bind):
                continue
            for g, used in enumerate(node.gpu_after):
                fits = used > 0 and used + pod.gpu_milli <= MILLI
                fits = fits and (not bind or node.gpu_now[g] + pod.gpu_milli <= MILLI)
                if fits and (best is None or (used > best_used) == binpack):
                    best, best_used = Seat(i, (g,)), used
        if best is not None and binpack:
            return best
        whole = self._find_whole(pod, 1, bind, {}, exclude=exclude, gang_gpus=0)  # a fresh GPU
        if whole is not None:
            return whole
        return best if best is not None else self._find_shared_anywhere(pod, bind, exclude)

    def _find_shared_fgd(self, pod: PodSpec, bind: bool, exclude: int) -> Seat | None:
        scores = self.scores
        assert scores is not None
        milli = pod.gpu_milli
        nodes = self.nodes
        pool = -1 if bind else self.releasing.bits  # pipelining: only onto nodes with releases pending
        for i in self._by_score(lambda shape: scores.shared(shape, milli)[0], pool):
            node = nodes[i]
            if i == exclude or not self.fits_node(node, pod, bind):
                continue
            # the GPU the shape's score chose (used milli `want`), else the fullest that fits both layers
            want = scores.shared(self.shapes[node.shape_id], milli)[1]
            best = -1
            for g, used in enumerate(node.gpu_after):
                if used + milli <= MILLI and (not bind or node.gpu_now[g] + milli <= MILLI):
                    if used == want:
                        return Seat(i, (g,))
                    if best < 0 or used > node.gpu_after[best]:
                        best = g
            if best >= 0:
                return Seat(i, (best,))
        return None

    def _find_shared_anywhere(self, pod: PodSpec, bind: bool, exclude: int) -> Seat | None:
        # a partly released GPU: only reachable by pipelining onto a releasing node
        if bind:
            return None
        for i in self.releasing:
            node = self.nodes[i]
            if i != exclude and self.fits_node(node, pod, False):
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
            if i != exclude and self.fits_node(node, pod, bind):
                free = node.cpu_after
                if best is None or (free < best_free) == binpack:
                    best, best_free = Seat(i, ()), free
        return best


_SPAN = MILLI + 1  # the values one GPU's milli takes: 0..MILLI


def _take(free: dict[str, float], asked: Mapping[str, float], sign: int) -> None:
    for name, amount in asked.items():
        free[name] = free.get(name, 0.0) - sign * amount


def _has(free: Mapping[str, float], asked: Mapping[str, float]) -> bool:
    return all(free.get(name, 0.0) >= amount for name, amount in asked.items())


def _share(pod: PodSpec) -> int:
    """The milli a pod takes on each GPU of its seat: a whole-GPU pod fills each of its devices."""
    milli = pod.gpu_milli
    return milli if 0 < milli < MILLI else MILLI
