"""The images a real node runs, made without a registry: OCI image archives for `ctr images import`.

Both come from one layer: Debian's static busybox (package busybox-static) with the applets the tests use
linked in /bin, plus the host's static /sbin/ldconfig when there is one (`ldconfig -p` lists the driver
libraries a CDI spec mounts). The sandbox ("pause") image only differs in its entrypoint: a shell that
waits for SIGTERM. The archives are written by the agent's own image builder (daemonset/image/build.py,
`builder()`), byte-for-byte reproducible, so their digests stay put between runs.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import sys
import tarfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]

BUSYBOX_CANDIDATES = (Path("/bin/busybox"), Path("/usr/bin/busybox"))
LDCONFIG = Path("/sbin/ldconfig")
APPLETS = ("sh", "ls", "env", "cat", "sleep", "echo", "test", "grep", "stat", "true", "ps", "id", "head", "wc")
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.1"  # the name containerd 2.4 pins for sandboxes by default
WORKLOAD_IMAGE = "localhost/gpu-dra-agent/workload:test"
# PID 1 in the pod: exits on SIGTERM/SIGINT as upstream's pause does, so a sandbox stops without a SIGKILL.
PAUSE_ENTRYPOINT = ["/bin/sh", "-c", 'trap "exit 0" TERM INT; while :; do sleep 3600 & wait $!; done']


@functools.cache
def builder() -> ModuleType:
    """daemonset/image/build.py (`make image`, a script, not a package) as a module: the agent's image and
    the OCI archive writer these images share."""
    spec = importlib.util.spec_from_file_location("image_build", REPO / "daemonset/image/build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["image_build"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class ImageError(RuntimeError):
    """What the images are made from is missing here; the message names the Debian package."""


def busybox() -> Path:
    for candidate in BUSYBOX_CANDIDATES:
        if candidate.is_file() and _is_static(candidate):
            return candidate
    raise ImageError(
        "a static busybox is needed (the node tier's images, the CDI container tests' root): "
        "apt-get install busybox-static"
    )


def _is_static(path: Path) -> bool:
    """An ELF without a PT_INTERP program header needs no dynamic loader inside the image."""
    data = path.read_bytes()[:4096]
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit only
        return False
    phoff = int.from_bytes(data[0x20:0x28], "little")
    phentsize = int.from_bytes(data[0x36:0x38], "little")
    phnum = int.from_bytes(data[0x38:0x3A], "little")
    for i in range(phnum):
        start = phoff + i * phentsize
        if start + 4 <= len(data) and int.from_bytes(data[start : start + 4], "little") == 3:  # PT_INTERP
            return False
    return True


def _add(
    tar: tarfile.TarFile, name: str, *, data: bytes | None = None, mode: int = 0o755, link: str | None = None
) -> None:
    """A file (data), a symlink (link) or else a directory, owned by root, mtime 0."""
    info = tarfile.TarInfo(name)
    info.mtime, info.mode = 0, mode
    if data is not None:
        info.size = len(data)
    elif link is not None:
        info.type, info.linkname = tarfile.SYMTYPE, link
    else:
        info.type = tarfile.DIRTYPE
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def root_layer() -> bytes:
    """The uncompressed layer tar: /bin/busybox, applet links, /sbin/ldconfig, the empty mount points."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("bin", "dev", "etc", "proc", "sbin", "sys", "tmp", "var"):
            _add(tar, directory, mode=0o1777 if directory == "tmp" else 0o755)
        _add(tar, "bin/busybox", data=busybox().read_bytes())
        for applet in APPLETS:
            _add(tar, f"bin/{applet}", link="busybox")
        if LDCONFIG.is_file() and _is_static(LDCONFIG):
            _add(tar, "sbin/ldconfig", data=LDCONFIG.read_bytes())
        _add(tar, "etc/passwd", data=b"root:x:0:0:root:/:/bin/sh\n", mode=0o644)
        _add(tar, "etc/group", data=b"root:x:0:\n", mode=0o644)
    return out.getvalue()


def write_archive(path: Path, name: str, entrypoint: list[str], layer: bytes) -> Path:
    """One image of the one uncompressed `layer` as an OCI layout in a tar, named for containerd."""
    build = builder()
    compressed = build.Layer.of(layer, "busybox")
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/bin:/sbin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [compressed.diff_id]},
    }
    build.write_archive(path, name, config, [compressed.blob], 0)
    return path


def make_images(directory: Path) -> dict[str, Path]:
    """The pause and workload archives under `directory`: {image name: archive}."""
    layer = root_layer()
    return {
        PAUSE_IMAGE: write_archive(directory / "pause.tar", PAUSE_IMAGE, PAUSE_ENTRYPOINT, layer),
        WORKLOAD_IMAGE: write_archive(directory / "workload.tar", WORKLOAD_IMAGE, ["/bin/sh"], layer),
    }


def available() -> str | None:
    """Why the images cannot be made here, or None."""
    try:
        busybox()
    except ImageError as error:
        return str(error)
    return None
