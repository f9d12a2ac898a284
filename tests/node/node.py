"""A real node beside a ControlPlane: containerd + runc + kubelet 1.37, and the agent as a host process.

    with ControlPlane(cp_build.build()).start() as cp, RealNode(cp, node_build.build()).start() as node:
        node.core.create_namespaced_pod(...)

What this machine's kind needs (VMs where we are root, cgroup v1 controllers beside a cgroup2 `unified`
mount, the memory controller already used by the machine's process manager), and what was chosen:
- kubelet: `failCgroupV1: false` (1.35+ refuses v1 otherwise), `cgroupDriver: cgroupfs` (no systemd here),
  `cgroupsPerQOS: true` with `cgroupRoot` a fresh cgroup beneath the test's own: the kubelet then names every
  pod's cgroup parent itself (`<root>/kubepods/...`) and hands it to containerd through CRI, so nothing the
  node makes lands outside the test's cgroup. (With `cgroupsPerQOS: false` the kubelet passes no parent and
  containerd falls back to `/k8s.io/<id>` at the top of every hierarchy.) `enforceNodeAllocatable: []`: no
  limits on the machine's memory. The kubelet logs that it cannot set its own oom_score_adj and carries on.
- containerd: `restrict_oom_score_adj` (root here lacks CAP_SYS_RESOURCE: runc's "failed to update
  /proc/self/oom_score_adj" for the sandbox's -998), the `native` snapshotter (no overlay mounts to leak),
  CDI on with this node's spec directory, AppArmor off, the sandbox image pinned to the local pause image.
- runc built with seccomp (containerd's CRI gives every container its default profile).
- Pods use `hostNetwork` (no bridge on a shared machine); the CNI plugins are installed and configured so
  the runtime reports its network ready, which the kubelet needs before the node turns Ready.
- GPU device nodes: stand-ins (`mknod` copies of /dev/null) under a dev root the node owns; the agent's
  `--dev-root` points its CDI specs' hostPath there. The host's /dev/nvidia* are never touched.
Only one real node runs on a machine at a time: start() waits for ~/.cache/gpu-dra-agent/real-node.lock and
stop() lets it go (re-entrant within a process, so a test module may hold it across several nodes).
On stop, every pod sandbox is removed through CRI, the daemons stop, whatever is left in the node's cgroups is
killed and the cgroups removed, and mounts left under the node's directory are lazily unmounted.

Three host paths are fixed in the binaries, whatever the flags: the kubelet's device-plugin socket
(/var/lib/kubelet/device-plugins/kubelet.sock), its container log links (/var/log/containers) and the shim
sockets (/run/containerd/s). Stop removes what this node put there, and the directories if it made them.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.claims import cdi
from fakes.nvml import persist
from fakes.nvml.binaries import install_driver_root
from fakes.nvml.machines import get_machine
from tests.controlplane import build as cp_build
from tests.controlplane import cluster
from tests.controlplane.cluster import Component, ControlPlane, ControlPlaneError, free_port, wait_for
from tests.integration.test_node_support import Daemon

from . import images

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Fixed in kubelet and containerd whatever their flags; see the module docstring.
DEVICE_PLUGIN_SOCKET = Path("/var/lib/kubelet/device-plugins/kubelet.sock")
CONTAINER_LOG_LINKS = Path("/var/log/containers")
SHIM_SOCKETS = Path("/run/containerd/s")
HOST_PATHS = (DEVICE_PLUGIN_SOCKET, CONTAINER_LOG_LINKS, SHIM_SOCKETS)
# None needed: DRA, ResourceHealthStatus (beta since 1.36) and device taints are on by default in 1.37.
KUBELET_FEATURE_GATES: dict[str, bool] = {}


_held: list[IO[str]] = []  # the lock file, once per level this process holds the real-node lock


def _lock_path() -> Path:
    return cp_build.cache_root().parent / "real-node.lock"


def acquire_node_lock() -> None:
    """Wait for the machine's one real node slot (the kubelet's device-plugin socket path is fixed); a
    process that holds it already just counts one more level."""
    if _held:
        _held.append(_held[0])
        return
    path = _lock_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(path, "w")  # noqa: SIM115 -- held until release_node_lock
    fcntl.flock(lock, fcntl.LOCK_EX)
    _held.append(lock)


def release_node_lock() -> None:
    lock = _held.pop()
    if not _held:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


@contextlib.contextmanager
def real_node_lock() -> Iterator[None]:
    acquire_node_lock()
    try:
        yield
    finally:
        release_node_lock()


class NodeError(ControlPlaneError):
    """The node stack did not start or misbehaved; the message carries the tail of the relevant log."""


def own_cgroup() -> str:
    """The cgroup this process runs in, as the memory controller (v1) or the unified hierarchy (v2) sees it:
    the one the machine's process manager watches, so the node's cgroups go beneath it."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
    for line in lines:
        if line.startswith("0::"):
            return line[3:]
    raise NodeError("no memory or unified cgroup in /proc/self/cgroup")


def hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, the named systemd one, the unified one)."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():  # pure v2
        return [CGROUP_ROOT]
    return sorted(p for p in CGROUP_ROOT.iterdir() if p.is_dir() and not p.is_symlink())


def _first_missing(path: Path) -> Path | None:
    """The topmost ancestor of `path` (or itself) that does not exist yet; None if it all exists."""
    missing = None
    for candidate in (path, *path.parents):
        if candidate.exists():
            break
        missing = candidate
    return missing


def _kubelet_credentials(cp: ControlPlane, directory: Path, node: str) -> tuple[Path, Path]:
    """A client certificate for `system:node:<node>` in `system:nodes`, signed by the control plane's CA."""
    assert cp.pki is not None
    ca_key = serialization.load_pem_private_key(cp.pki.ca_key.read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca = x509.load_pem_x509_certificate(cp.pki.ca_cert.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = time.time()
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}"),
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                ]
            )
        )
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(datetime.datetime.fromtimestamp(now - 300, datetime.UTC))
        .not_valid_after(datetime.datetime.fromtimestamp(now + 2 * 86400, datetime.UTC))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "kubelet-client.crt", directory / "kubelet-client.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    return cert_path, key_path


class RealNode:
    def __init__(
        self,
        cp: ControlPlane,
        binaries: Path,
        root: Path | None = None,
        *,
        name: str = "node-r",
        machine: str = "mixed-mig",
        cdi_hook: Path | None = None,
        host_agent: bool = True,
        agent_args: tuple[str, ...] = (),
    ) -> None:
        """`host_agent`: run the agent as a host process once the node is Ready; False leaves the node to the
        agent's DaemonSet (the product as deployed: tests/integration/test_deployed.py). `agent_args`: more flags
        for that agent (paths beneath `root` to name them before start)."""
        self.cp = cp
        self.binaries = binaries
        self._own_root = root is None
        self.root = root or Path(tempfile.mkdtemp(prefix="rn-", dir="/tmp"))  # unix sockets: keep paths short
        self.name = name
        self.machine = machine
        self.cdi_hook = cdi_hook  # nvidia-cdi-hook for the specs' hooks (ldcache, symlinks); None: specs run none
        self.host_agent = host_agent
        self.agent_args = agent_args
        self.logs = self.root / "logs"
        self.containerd_sock = self.root / "containerd" / "containerd.sock"
        self.kubelet_root = self.root / "kubelet"  # the kubelet's --root-dir: plugins/, plugins_registry/
        self.cdi_root = self.root / "cdi"
        self.dev_root = self.root / "devroot"  # stand-in /dev/nvidia* beneath it
        self.gpu_state = self.root / "gpus.json"
        self.driver_root = self.root / "driver-root"  # the fake driver's (the host agent's --driver-root)
        self.cgroup = f"{own_cgroup().rstrip('/')}/gpu-dra-node-{os.getpid()}-{self.root.name}"
        # Per hierarchy, the ancestors of the node's cgroup that existed before it: the rest is ours to remove.
        self._existing_ancestors = {h: {p for p in self._ancestors(h) if p.is_dir()} for h in hierarchies()}
        # The host paths' first missing ancestor before start: what stop may remove again.
        self._made_on_host = [_first_missing(p) for p in HOST_PATHS]
        self.components: dict[str, Component] = {}
        self._shared = False  # the root bind-mounted on itself, shared (see _share_mounts)
        self.agent: Daemon | None = None
        self.startup_seconds: dict[str, float] = {}
        self._locked = False

    # -- what tests use ------------------------------------------------------------------------------------

    def crictl(self, *args: str, check: bool = True) -> str:
        endpoint = f"unix://{self.containerd_sock}"
        done = subprocess.run(
            [str(self.binaries / "crictl"), "--runtime-endpoint", endpoint, "--timeout", "20s", *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and done.returncode != 0:
            raise NodeError(f"crictl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def ctr(self, *args: str) -> str:
        done = subprocess.run(
            [str(self.binaries / "ctr"), "--address", str(self.containerd_sock), "-n", "k8s.io", *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def node_object(self) -> dict[str, Any]:
        return dict(self.cp.request("GET", f"/api/v1/nodes/{self.name}"))

    def restart_kubelet(self) -> None:
        self.components.pop("kubelet").stop()
        self._start_kubelet()

    def kill_agent(self) -> None:
        """kill -9, as an OOM kill or a crash would."""
        assert self.agent is not None and self.agent.proc is not None
        self.agent.proc.send_signal(signal.SIGKILL)
        self.agent.proc.wait()

    def start_agent(self) -> Daemon:
        kubeconfig = self.cp.write_kubeconfig(self.root / "admin.kubeconfig")
        # the fake driver: nvidia-smi and MPS control for sharing, real ELF libraries for the specs' mounts; a
        # host process sees the root where the runtime does, so both roots are the same path
        driver_root = install_driver_root(self.driver_root).parents[1]
        hook = ("--nvidia-cdi-hook-path", str(self.cdi_hook)) if self.cdi_hook else ()
        self.agent = Daemon(
            self.root,
            kubeconfig,
            self.name,
            env={persist.ENV: str(self.gpu_state)},
            machine=f"fake:{self.machine}",
            extra_args=(
                "--driver-root",
                str(driver_root),
                "--host-driver-root",
                str(driver_root),
                "--dev-root",
                str(self.dev_root),
                *hook,
                *self.agent_args,
            ),
        ).start()
        self.agent.wait_for_log("registered with the kubelet", timeout=60)
        return self.agent

    def check_running(self) -> None:
        for component in self.components.values():
            component.check_running()

    # -- start and stop ------------------------------------------------------------------------------------

    def start(self) -> RealNode:
        acquire_node_lock()
        self._locked = True
        try:
            started = time.monotonic()
            self._share_mounts()
            self._make_cgroup()
            self._make_devices()
            self._start_containerd()
            self.startup_seconds["containerd"] = time.monotonic() - started
            self._start_kubelet()
            self._wait_ready()
            self.startup_seconds["kubelet"] = time.monotonic() - started
            if self.host_agent:
                self.start_agent()
            self.startup_seconds["all"] = time.monotonic() - started
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> RealNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        kubelet = self.components.pop("kubelet", None)
        if kubelet is not None:
            kubelet.stop()
        if "containerd" in self.components:
            with contextlib.suppress(Exception):  # every pod sandbox, its containers with it
                for pod in self.crictl("pods", "-q", check=False).split():
                    self.crictl("stopp", pod, check=False)
                    self.crictl("rmp", "-f", pod, check=False)
            self.components.pop("containerd").stop()
        self._remove_cgroup()
        self._unmount_below(self.root)
        if self._shared:
            subprocess.run(["umount", "-l", str(self.root)], check=False, capture_output=True)
        self._clean_host_paths()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
        if self._locked:
            self._locked = False
            release_node_lock()

    # -- mounts --------------------------------------------------------------------------------------------

    def _share_mounts(self) -> None:
        """The node's root bind-mounted on itself as a shared mount: the agent pod's plugin directory is
        mounted Bidirectional and its driver root HostToContainer, which containerd refuses on a private
        mount (this machine's / is one). What the kubelet and runc mount below it then propagates, as on a
        real node's /var/lib/kubelet."""
        for argv in (["mount", "--bind", str(self.root), str(self.root)], ["mount", "--make-rshared", str(self.root)]):
            done = subprocess.run(argv, check=False, capture_output=True, text=True)
            if done.returncode != 0:
                raise NodeError(f"{' '.join(argv)}: {done.stderr.strip()}")
            self._shared = True

    # -- cgroups -------------------------------------------------------------------------------------------

    def _make_cgroup(self) -> None:
        """The kubelet's cgroupRoot, in every hierarchy (the kubelet checks it exists in each controller)."""
        relative = self.cgroup.lstrip("/")
        for hierarchy in hierarchies():
            if hierarchy.name == "unified":
                continue  # runc makes what it needs there
            path = hierarchy
            for part in relative.split("/"):
                path = path / part
                if path.is_dir():
                    continue
                path.mkdir()
                if hierarchy.name == "cpuset":  # a new cpuset is empty: give it the parent's cpus and mems
                    for knob in ("cpuset.cpus", "cpuset.mems"):
                        (path / knob).write_text((path.parent / knob).read_text())

    def _ancestors(self, hierarchy: Path) -> list[Path]:
        """The node's cgroup and the directories above it in `hierarchy`, deepest first."""
        path = hierarchy / self.cgroup.lstrip("/")
        return [path, *[p for p in path.parents if p.is_relative_to(hierarchy) and p != hierarchy]]

    def _remove_cgroup(self) -> None:
        relative = self.cgroup.lstrip("/")
        for hierarchy in hierarchies():
            top = hierarchy / relative
            self._remove_tree(top)
            for ancestor in self._ancestors(hierarchy)[1:]:  # made by us or by runc on the way down
                if ancestor not in self._existing_ancestors.get(hierarchy, set()):
                    with contextlib.suppress(OSError):
                        ancestor.rmdir()

    @staticmethod
    def _remove_tree(top: Path) -> None:
        if top.is_dir():
            for _ in range(50):
                leaves = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]
                for directory in leaves:
                    with contextlib.suppress(OSError):
                        for pid in (directory / "cgroup.procs").read_text().split():
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(int(pid), signal.SIGKILL)  # a container of ours that outlived its runtime
                    with contextlib.suppress(OSError):
                        directory.rmdir()
                if not top.exists():
                    break
                time.sleep(0.1)

    def _clean_host_paths(self) -> None:
        """Our log links and the kubelet's device-plugin socket go; directories we made go once empty. Nothing
        else is unlinked: another node on this machine may have live shim sockets there."""
        pod_logs = str(self.root / "pod-logs")
        with contextlib.suppress(OSError):
            for link in CONTAINER_LOG_LINKS.iterdir():
                if link.is_symlink() and os.readlink(link).startswith(pod_logs):
                    link.unlink()
        with contextlib.suppress(OSError):
            DEVICE_PLUGIN_SOCKET.unlink()  # the kubelet makes it afresh at every start
        for made in self._made_on_host:
            if made is not None and made.is_dir():
                for directory in sorted((p for p in made.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                    with contextlib.suppress(OSError):
                        directory.rmdir()
                with contextlib.suppress(OSError):
                    made.rmdir()

    @staticmethod
    def _unmount_below(root: Path) -> None:
        prefix = str(root.resolve()) + "/"
        with contextlib.suppress(OSError):
            mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
            for mount in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
                subprocess.run(["umount", "-l", mount], check=False, capture_output=True)

    # -- device nodes --------------------------------------------------------------------------------------

    def _make_devices(self) -> None:
        """Stand-ins for every node a spec of this machine can name: copies of /dev/null (char 1:3)."""
        dev = self.dev_root / "dev"
        (dev / "nvidia-caps").mkdir(parents=True, exist_ok=True)
        null = os.stat("/dev/null").st_rdev
        machine = get_machine(self.machine)
        names = [p.lstrip("/").removeprefix("dev/") for p in cdi.CONTROL_NODES]
        for minor in range(len(machine.gpus)):
            names.append(f"nvidia{minor}")
            for gi in range(15):
                names.append(f"nvidia-caps/nvidia-cap{cdi.default_mig_minor(minor, gi)}")
                names += [f"nvidia-caps/nvidia-cap{cdi.default_mig_minor(minor, gi, ci)}" for ci in range(8)]
        for name in names:
            with contextlib.suppress(FileExistsError):
                os.mknod(dev / name, 0o666 | 0o020000, null)

    # -- containerd ----------------------------------------------------------------------------------------

    def _containerd_config(self) -> str:
        base = self.root / "containerd"
        cni = self.root / "cni"
        runtime = 'plugins."io.containerd.cri.v1.runtime"'
        return f"""version = 3
root = "{base / "root"}"
state = "{base / "state"}"
temp = "{base / "tmp"}"

[grpc]
  address = "{self.containerd_sock}"

[ttrpc]
  address = "{base / "ttrpc.sock"}"

[debug]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{base / "opt"}"

[plugins."io.containerd.nri.v1.nri"]
  disable = true

[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "native"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{images.PAUSE_IMAGE}"

[{runtime}]
  cdi_spec_dirs = ["{self.cdi_root}"]
  restrict_oom_score_adj = true
  disable_apparmor = true
  disable_hugetlb_controller = true
  [{runtime}.containerd]
    default_runtime_name = "runc"
    [{runtime}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{runtime}.containerd.runtimes.runc.options]
        BinaryName = "{self.binaries / "runc"}"
        Root = "{base / "runc"}"
        SystemdCgroup = false
  [{runtime}.cni]
    bin_dirs = ["{cni / "bin"}"]
    conf_dir = "{cni / "conf"}"
"""

    def _start_containerd(self) -> None:
        base = self.root / "containerd"
        for d in (base, self.logs, self.cdi_root, self.root / "cni" / "conf", self.root / "cni" / "bin"):
            d.mkdir(parents=True, exist_ok=True)
        for plugin in ("bridge", "host-local", "loopback", "portmap"):
            target = self.root / "cni" / "bin" / plugin
            if not target.exists():
                target.symlink_to(self.binaries / plugin)
        (self.root / "cni" / "conf" / "10-test.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "test",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": "cni-test0",
                            "isGateway": True,
                            "ipMasq": False,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": "10.244.77.0/24"}]],
                                "dataDir": str(self.root / "cni" / "ipam"),
                            },
                        },
                        {"type": "portmap", "capabilities": {"portMappings": True}},
                    ],
                }
            )
        )
        config = base / "config.toml"
        config.write_text(self._containerd_config())
        env = {**os.environ, "PATH": f"{self.binaries}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        component = self._spawn("containerd", [str(self.binaries / "containerd"), "--config", str(config)], env)
        wait_for(
            "containerd's socket", lambda: self.containerd_sock.exists() or None, 60, component.check_running, NodeError
        )
        archives = images.make_images(self.root / "images")
        for archive in archives.values():
            self.ctr("images", "import", "--snapshotter", "native", "--local", str(archive))
        listed = self.ctr("images", "ls", "-q")
        missing = [name for name in archives if name not in listed.split()]
        if missing:
            raise NodeError(f"images not imported: {missing}; ctr images ls:\n{listed}")

    # -- kubelet -------------------------------------------------------------------------------------------

    def _kubelet_config(self) -> dict[str, Any]:
        assert self.cp.pki is not None
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": True,
            "cgroupRoot": self.cgroup,
            "enforceNodeAllocatable": [],
            "failSwapOn": False,
            "address": "127.0.0.1",
            "port": free_port(),
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(self.cp.pki.ca_cert)},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "containerRuntimeEndpoint": f"unix://{self.containerd_sock}",
            "podLogsDir": str(self.root / "pod-logs"),
            "resolvConf": "",
            "evictionHard": {
                "memory.available": "1Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "nodeStatusUpdateFrequency": "2s",
            "nodeStatusReportFrequency": "10s",
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
            "featureGates": KUBELET_FEATURE_GATES,
            "registerNode": True,
        }

    def _start_kubelet(self) -> None:
        pki = self.root / "pki"
        cert, key = _kubelet_credentials(self.cp, pki, self.name)
        assert self.cp.pki is not None
        kubeconfig = self.root / "kubelet.kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "real",
                            "cluster": {"server": self.cp.url, "certificate-authority": str(self.cp.pki.ca_cert)},
                        }
                    ],
                    "users": [{"name": "kubelet", "user": {"client-certificate": str(cert), "client-key": str(key)}}],
                    "contexts": [{"name": "real", "context": {"cluster": "real", "user": "kubelet"}}],
                    "current-context": "real",
                }
            )
        )
        self._grant_node_role()
        self.healthz_port = free_port()
        config = self.root / "kubelet.yaml"
        config.write_text(yaml.safe_dump(self._kubelet_config()))
        self.kubelet_root.mkdir(parents=True, exist_ok=True)
        self._spawn(
            "kubelet",
            [
                str(self.binaries / "kubelet"),
                f"--config={config}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={self.kubelet_root}",
                f"--cert-dir={pki}",
                f"--hostname-override={self.name}",
                # The node's addresses are set by the test, as a cloud controller manager would (_wait_ready): the
                # kubelet refuses a loopback --node-ip, and any other address of this machine is off limits.
                "--cloud-provider=external",
                "--v=4",
            ],
            {**os.environ, "PATH": f"{self.binaries}:{os.environ.get('PATH', '/usr/bin:/bin')}"},
        )

    def _grant_node_role(self) -> None:
        """The kubelet's rights: this control plane authorises with RBAC alone (no Node authorizer), so bind
        the `system:node` ClusterRole to the `system:nodes` group, as clusters without that authorizer do."""
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "gpu-dra-agent-test:nodes"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:nodes"}],
        }
        try:
            self.cp.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", binding)
        except urllib.error.HTTPError as error:
            if error.code != 409:
                raise

    def _wait_ready(self) -> None:
        kubelet = self.components["kubelet"]

        def ready() -> dict[str, Any] | None:
            try:
                node = self.node_object()
            except urllib.error.HTTPError:
                return None
            conditions = {c["type"]: c for c in node.get("status", {}).get("conditions", [])}
            return node if conditions.get("Ready", {}).get("status") == "True" else None

        try:
            node = wait_for(f"Node {self.name} to be Ready", ready, 120, kubelet.check_running, NodeError)
        except NodeError as error:
            raise NodeError(f"{error}\nkubelet log:\n{kubelet.tail(40)}") from None
        # The cloud controller manager's part: the node's InternalIP is 127.0.0.1, where the API server reaches
        # the kubelet (`kubectl logs`) and hostNetwork pods have their IP (probes, status.hostIP).
        node["status"]["addresses"] = [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": self.name},
        ]
        node = self.cp.request("PUT", f"/api/v1/nodes/{self.name}/status", node)
        # Admission gave the new Node the not-ready taint, the kubelet the uninitialized one; the node-lifecycle
        # controller and the cloud controller manager that lift them do not run in this control plane. Do their part.
        taints = node["spec"].get("taints", [])
        lifted = ("node.kubernetes.io/not-ready", "node.cloudprovider.kubernetes.io/uninitialized")
        kept = [t for t in taints if t["key"] not in lifted]
        if kept != taints:
            node["spec"]["taints"] = kept
            self.cp.request("PUT", f"/api/v1/nodes/{self.name}", node)

    # -- processes -----------------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> Component:
        log = self.logs / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=cluster._die_with_parent,  # noqa: PLW1509
            )
        component = Component(name, process, log)
        self.components[name] = component
        return component


def main() -> None:
    """`python -m tests.node.node [MACHINE]`: a control plane and one real node for trying things by hand.

    Builds what is missing (control plane, node stack), starts both and the agent on the fake machine
    (default mixed-mig), writes ./node.kubeconfig, prints how to reach containerd; Ctrl-C stops and cleans up.
    """
    import sys

    from tests.controlplane import build as cp_build

    from . import build as node_build

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwind through stop(): cgroups and temp dirs go too
    machine = sys.argv[1] if len(sys.argv) > 1 else "mixed-mig"
    with ControlPlane(cp_build.build()).start() as cp:
        classes = Path(__file__).parents[2] / "daemonset" / "base" / "deviceclasses.yaml"
        for doc in yaml.safe_load_all(classes.read_text()):
            cp.request("POST", "/apis/resource.k8s.io/v1/deviceclasses", doc)
        with RealNode(cp, node_build.build(), machine=machine).start() as node:
            path = cp.kubeconfig_path  # admin credentials stay in the control plane's directory, removed with it
            print(
                f"node {node.name} Ready ({machine}) in {node.startup_seconds['all']:.1f}s; KUBECONFIG={path}\n"
                f"  logs: {node.logs} and {node.root / 'agent.log'}\n"
                f"  crictl: {node.binaries / 'crictl'} --runtime-endpoint unix://{node.containerd_sock} ps\n"
                f"  pods: image {images.WORKLOAD_IMAGE}, imagePullPolicy Never, hostNetwork true",
                flush=True,
            )
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()


if __name__ == "__main__":
    main()
