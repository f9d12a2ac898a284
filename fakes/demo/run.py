"""`python -m fakes.demo` (`make demo`): the driver end to end against the fakes, in a temporary directory.

The demo drives the product from the test world (the fakes stand in for GPUs, the API server, the kubelet and
the scheduler), so it lives here and never ships in the product's wheel or image.


API server fake, Nodes and DeviceClasses, the real node agent as a subprocess per fake machine, the kubelet
fake, claims from daemonset/examples allocated by the fake scheduler and prepared through the kubelet, then
unprepared, and the agents stopped with SIGTERM. Claims that cannot all fit at once run in rounds: what
does not fit waits for the next round; what fits in no round is reported unsatisfiable. Then the queue scene
(fakes.demo.queues): a gang admitted across two nodes by the arbiter, a burst over quota, and a reclaim when
the other team arrives.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

import fakes.apiserver
from agent.claims import cdi
from agent.claims.types import ClaimRef, PrepareResult
from agent.jsontypes import Json
from fakes.demo import mig, report
from fakes.demo.computedomains import run_compute_domain_scene
from fakes.demo.kubectl import Kubectl, KubectlError
from fakes.demo.node import DRIVER, DemoError, DemoNode
from fakes.demo.queues import run_queue_scene
from fakes.demo.shares import run_share_scene
from fakes.kubelet import KubeletError
from fakes.nvml.binaries import install_driver_root
from fakes.scheduler import FakeScheduler, Unsatisfiable

NAMESPACE = "default"
DEFAULT_MACHINES = ("dgx-h100", "mixed-mig")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fakes.demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--machine",
        action="append",
        help=f"fake NVML machine to run a node on; repeat for more nodes (default: {', '.join(DEFAULT_MACHINES)})",
    )
    p.add_argument(
        "--manifests", type=Path, default=None, help="daemonset/ directory (base/deviceclasses.yaml and examples/)"
    )
    p.add_argument("--workdir", type=Path, default=None, help="directory to work in (default: a fresh temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (agent logs, state) afterwards")
    p.add_argument("--verbose", action="store_true", help="let the agents log to this terminal instead of files")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    manifests: Path = args.manifests or Path(__file__).resolve().parents[2] / "daemonset"
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-dra-demo-"))
    ok = False
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        with ExitStack() as stack:
            Demo(stack, manifests, workdir, tuple(args.machine or DEFAULT_MACHINES), args.verbose).run()
        ok = True
    except (DemoError, KubectlError, KubeletError, OSError) as exc:
        print(f"\ndemo: {exc}", file=sys.stderr)
    finally:
        if ok and not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
            where = "work directory removed; --keep keeps it"
        else:
            where = f"work directory kept: {workdir}"
        print(f"\n{'done' if ok else 'FAILED'} in {time.monotonic() - started:.1f}s ({where})")
    return 0 if ok else 1


def _say(*lines: str) -> None:
    print(*lines, sep="\n", flush=True)


class Demo:
    def _heading(self, title: str) -> str:
        """`== N. title`, numbered in the order the sections run."""
        return f"== {next(self._sections)}. {title}"

    def __init__(
        self, stack: ExitStack, manifests: Path, workdir: Path, machines: Sequence[str], verbose: bool
    ) -> None:
        self.stack = stack
        self._sections = itertools.count(1)
        self.manifests = manifests
        self.workdir = workdir
        self.machines = machines
        self.verbose = verbose
        self.nodes: dict[str, DemoNode] = {}

    def run(self) -> None:
        server = fakes.apiserver.start()
        self.stack.callback(server.stop)
        kubeconfig = server.write_kubeconfig(self.workdir / "kubeconfig")
        kubectl = Kubectl(server.url)
        self.scheduler = FakeScheduler(server.rest())
        classes = self._apply_device_classes(kubectl)
        _say(
            f"gpu-dra-agent, the demo (work directory {self.workdir})",
            "",
            self._heading("Cluster"),
            f"  API server fake  {server.url}",
            f"  DeviceClasses    {', '.join(classes)}  (from {self.manifests / 'base' / 'deviceclasses.yaml'})",
        )
        driver_root = self.workdir / "driver-root"
        install_driver_root(driver_root)  # fake nvidia-smi and nvidia-cuda-mps-control for TimeSlicing and MPS
        for i, machine in enumerate(self.machines):
            name = f"node-{i}-{machine}"
            kubectl.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
            node = DemoNode(
                name, machine, self.workdir / name, kubeconfig, driver_root=driver_root, verbose=self.verbose
            )
            self.stack.callback(node.close)  # kill the agent whatever happens below
            self.nodes[name] = node
            node.start()

        _say("", self._heading("Node agents (gpu-dra-agent node, one subprocess per node)"))
        for node in self.nodes.values():
            t0 = time.monotonic()
            plugin = node.wait_registered()
            node.wait_for(lambda: self._slices(kubectl, node.name) or None, f"slices of {node.name}", 30.0)  # noqa: B023
            logs = "this terminal" if self.verbose else str(node.log_path)
            _say(
                f"  {node.name}: fake:{node.machine}, pid {node.process.pid if node.process else '-'},"
                f" registered as {plugin.driver} ({plugin.api}) in {time.monotonic() - t0:.1f}s; logs: {logs}"
            )

        _say("", self._heading("Devices published as ResourceSlices"))
        for node in self.nodes.values():
            slices = self._slices(kubectl, node.name)
            pool = slices[0]["spec"]["pool"]
            devices = report.device_rows(slices)
            _say(
                f"  {node.name}: {len(devices)} devices in {len(slices)} slice(s), pool {pool['name']}"
                f" generation {pool['generation']}"
            )
            _say(
                *report.table(
                    ["DEVICE", "TYPE", "PRODUCT / PROFILE", "MEMORY", "NVLINK DOMAIN"], devices, indent="    "
                )
            )

        claims = self._create_claims(kubectl)
        names = ", ".join(c["metadata"]["name"] for c in claims)
        _say("", self._heading(f"Claims from {self.manifests / 'examples'}: {names}"))
        self._rounds(claims)
        self._device_plugin_style_pods(kubectl)
        self._shared_gpus(kubectl, kubeconfig, driver_root)

        first = next(iter(self.nodes.values()))
        _say(
            "",
            self._heading(
                f"MIG layout from the node label (mig-parted configs, the GPU Operator's default), {first.name}"
            ),
        )
        for value in ("all-1g.10gb", "all-disabled"):
            _say(*mig.relabel(kubectl, first.name, value, lambda: self._slices(kubectl, first.name)))

        _say("", self._heading("Stopping the agents with SIGTERM"))
        for node in self.nodes.values():
            code = node.terminate()
            left = [str(s) for s in node.sockets if s.exists()]
            if code != 0 or left:
                raise DemoError(f"agent on {node.name} exited with {code}; sockets left: {left or 'none'}")
            _say(f"  {node.name}: exited 0; sockets removed: {', '.join(s.name for s in node.sockets)}")

        _say("", self._heading("Queues: two teams share two 8-GPU nodes through the arbiter"))
        run_queue_scene()

        _say("", self._heading("Multi-node NVLink: a ComputeDomain forms on a fake GB200 NVL72 rack"))
        run_compute_domain_scene(_say)

    # --- steps -------------------------------------------------------------------------------------------

    def _shared_gpus(self, kubectl: Kubectl, kubeconfig: Path, driver_root: Path) -> None:
        """A node of its own with --consumable-shares memory: ten 8Gi inference claims, nine on one H100."""
        name = "node-shared-dgx-h100"
        kubectl.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        node = DemoNode(
            name,
            "dgx-h100",
            self.workdir / name,
            kubeconfig,
            driver_root=driver_root,
            verbose=self.verbose,
            extra_args=("--consumable-shares", "memory"),
        )
        self.stack.callback(node.close)
        node.start()
        node.wait_registered()
        node.wait_for(lambda: self._slices(kubectl, name) or None, f"slices of {name}", 30.0)
        _say(
            "",
            self._heading(
                f"Shared GPUs (consumable capacity, --consumable-shares=memory) on {name}: ten "
                "inference claims of memory: 8Gi"
            ),
        )
        run_share_scene(kubectl, self.scheduler, node, _say)
        if node.terminate() != 0:
            raise DemoError(f"agent on {name} did not exit cleanly")

    def _apply_device_classes(self, kubectl: Kubectl) -> list[str]:
        path = self.manifests / "base" / "deviceclasses.yaml"
        if not path.exists():
            raise DemoError(f"no {path}: pass --manifests with the daemonset/ directory")
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "DeviceClass"]
        return [kubectl.create(d)["metadata"]["name"] for d in docs]

    def _create_claims(self, kubectl: Kubectl) -> list[Json]:
        """One ResourceClaim per ResourceClaimTemplate, as the claim controller makes one for a pod."""
        templates = [
            d
            for f in sorted((self.manifests / "examples").glob("*.yaml"))
            for d in yaml.safe_load_all(f.read_text())
            if d and d.get("kind") == "ResourceClaimTemplate"
        ]
        if not templates:
            raise DemoError(f"no ResourceClaimTemplates in {self.manifests / 'examples'}")
        templates.sort(key=_devices_wanted)  # small claims first, so they share the nodes in one round
        return [
            kubectl.create(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {"name": t["metadata"]["name"], "namespace": NAMESPACE},
                    "spec": t["spec"]["spec"],
                }
            )
            for t in templates
        ]

    def _rounds(self, claims: list[Json]) -> None:
        pending, round_number, shown_cdi = claims, 0, False
        while pending:
            round_number += 1
            placed: list[Json] = []
            waiting: list[tuple[Json, str]] = []
            for claim in pending:
                try:
                    placed.append(self.scheduler.allocate(NAMESPACE, claim["metadata"]["name"]))
                except Unsatisfiable as e:
                    if not e.in_use:
                        _say("", f"  {claim['metadata']['name']}: unsatisfiable: {e}")
                    else:
                        waiting.append((claim, str(e)))
            if not placed:
                if waiting:  # devices in use, yet nothing holds any: only a scheduler bug gets here
                    raise DemoError(f"claims wait for devices nobody holds: {waiting}")
                return
            _say("", f"  round {round_number}: allocated by the fake scheduler, prepared through the kubelet fake")
            results = self._prepare(placed)
            for claim in placed:
                _say(*report.prepared_claim(claim, results[claim["metadata"]["uid"]]))
                self._show_sharing(claim, results[claim["metadata"]["uid"]])
            for claim, why in waiting:
                _say(f"  {claim['metadata']['name']}: waits for the next round: {why}")
            failed = [c["metadata"]["name"] for c in placed if results[c["metadata"]["uid"]].error]
            if failed:
                raise DemoError(f"prepare failed for {', '.join(failed)}")
            if not shown_cdi:
                self._show_cdi(placed[0])
                shown_cdi = True
            self._release(placed)
            pending = [c for c, _ in waiting]

    def _device_plugin_style_pods(self, kubectl: Kubectl) -> None:
        """Pods asking for `nvidia.com/gpu`: the fake scheduler makes, allocates and reserves their special claim
        (DRAExtendedResource), the kubelet prepares it; then the pod and its claim are deleted."""
        pods = [
            d
            for f in sorted((self.manifests / "examples").glob("*.yaml"))
            for d in yaml.safe_load_all(f.read_text())
            if d and d.get("kind") == "Pod" and not d["spec"].get("resourceClaims")
        ]
        if not pods:
            return
        _say(
            "",
            self._heading(
                "Device-plugin-style pods: extended resources through DRA (DeviceClass extendedResourceName)"
            ),
        )
        for manifest in pods:
            pod = kubectl.create({**manifest, "metadata": {**manifest["metadata"], "namespace": NAMESPACE}})
            name = pod["metadata"]["name"]
            asked = ", ".join(
                f"{r}: {q}"
                for c in pod["spec"]["containers"]
                for r, q in ((c.get("resources") or {}).get("limits") or {}).items()
            )
            claim = None
            for candidate in self.nodes:
                try:
                    claim = self.scheduler.schedule_extended_resources(NAMESPACE, name, candidate)
                except Unsatisfiable:
                    continue
                if claim is not None:
                    break
            if claim is None:
                raise DemoError(f"pod {name} ({asked}) got no extended resource claim on any node")
            node = self.nodes[report.node_of(claim)]
            result = node.kubelet.prepare(DRIVER, [_ref(claim)])[claim["metadata"]["uid"]]
            if result.error:
                raise DemoError(f"prepare of {claim['metadata']['name']} failed: {result.error}")
            mapping = kubectl.get("Pod", name, NAMESPACE)["status"]["extendedResourceClaimStatus"]
            _say(
                f"  pod {name} ({asked}) bound to {node.name}; claim {claim['metadata']['name']} made by the scheduler",
                *(
                    f"      {m['containerName']}: {m['resourceName']} -> request {m['requestName']}"
                    for m in mapping["requestMappings"]
                ),
                *report.table(
                    ["DEVICE", "REQUEST", "CDI DEVICE IDS"],
                    [[d.device_name, ", ".join(d.request_names), " ".join(d.cdi_device_ids)] for d in result.devices],
                    indent="      ",
                ),
            )
            errors = node.kubelet.unprepare(DRIVER, [_ref(claim)])
            if any(errors.values()):
                raise DemoError(f"unprepare of {claim['metadata']['name']} failed: {errors}")
            self.scheduler.deallocate(NAMESPACE, claim["metadata"]["name"])
            _say(f"  pod {name} done: claim unprepared and deallocated")

    def _prepare(self, claims: list[Json]) -> dict[str, PrepareResult]:
        """One NodePrepareResources per claim, as for one pod each, on the claim's node."""
        results: dict[str, PrepareResult] = {}
        for claim in claims:
            node = self.nodes[report.node_of(claim)]
            results.update(node.kubelet.prepare(DRIVER, [_ref(claim)]))
        return results

    def _show_sharing(self, claim: Json, result: PrepareResult) -> None:
        """For a claim with a sharing config: what is in force on the node now (not what was asked)."""
        if result.error or not report.sharing(claim):
            return
        node = self.nodes[report.node_of(claim)]
        lines = node.sharing_report(claim["metadata"]["uid"], [d.device_name for d in result.devices])
        _say("      on the node:", *(f"        {line}" for line in lines))

    def _show_cdi(self, claim: Json) -> None:
        node = self.nodes[report.node_of(claim)]
        path = node.cdi_root / cdi.spec_file_name(claim["metadata"]["uid"])
        _say("", self._heading(f"CDI spec of claim {claim['metadata']['name']}: {path}"))
        spec = yaml.safe_load(path.read_text())
        _say(*("    " + line for line in yaml.safe_dump(spec, sort_keys=False, width=110).splitlines()))

    def _release(self, claims: list[Json]) -> None:
        """Unprepare (the pods are gone), deallocate (the claims are done), and show the CDI specs went too."""
        for claim in claims:
            node = self.nodes[report.node_of(claim)]
            errors = node.kubelet.unprepare(DRIVER, [_ref(claim)])
            if any(errors.values()):
                raise DemoError(f"unprepare of {claim['metadata']['name']} failed: {errors}")
            if report.sharing(claim):
                devices = [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]
                lines = node.sharing_report(claim["metadata"]["uid"], devices)
                _say(f"  {claim['metadata']['name']} unprepared; on the node:", *(f"    {line}" for line in lines))
            self.scheduler.deallocate(NAMESPACE, claim["metadata"]["name"])
        left = {n.name: sorted(p.name for p in n.cdi_root.iterdir()) for n in self.nodes.values()}
        names = ", ".join(c["metadata"]["name"] for c in claims)
        _say("", f"  unprepared and deallocated {names}")
        for name, files in left.items():
            _say(f"    CDI dir of {name}: {', '.join(files) if files else 'empty'}")
        if any(left.values()):
            raise DemoError(f"CDI specs left after unprepare: {left}")

    def _slices(self, kubectl: Kubectl, node: str) -> list[Json]:
        return kubectl.list("ResourceSlice", field_selector=f"spec.nodeName={node}")


def _ref(claim: Json) -> ClaimRef:
    meta = claim["metadata"]
    return ClaimRef(meta["namespace"], meta["uid"], meta["name"])


def _devices_wanted(template: Json) -> int:
    requests: list[dict[str, Any]] = template["spec"]["spec"]["devices"].get("requests", [])
    total = 0
    for r in requests:
        exactly = r.get("exactly") or (r.get("firstAvailable") or [{}])[0]
        total += 1_000 if exactly.get("allocationMode") == "All" else int(exactly.get("count", 1))
    return total
