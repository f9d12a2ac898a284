"""Build the agent's OCI image here, without a registry, from Debian's packages and PyPI alone.

    python daemonset/image/build.py [--out DIR] [--tag TAG]      (what `make image` runs; root, Debian/Ubuntu)
    python daemonset/image/build.py --lock                        (re-pin daemonset/image/requirements.lock)

Layers, bottom up:
1. Debian: mmdebstrap's `extract` variant of bookworm with python3 and libc-bin only (their dependencies, no
   maintainer scripts: no shell, no apt, no compiler), docs, man pages and locales left out, the standard
   library compiled to .pyc, a dpkg status listing every package shipped (what image scanners read).
2. The pinned dependencies: requirements.lock (hashes) installed by pip, from wheels only, with the image's own
   python; pip itself (pip.lock) runs from its wheel and is not installed.
3. The project's wheel, with the arbiter core compiled by mypyc (native/compile.py) as package data.
The test image adds exactly one more layer: the NVML fake (fakes/__init__.py and fakes/nvml).

Reproducible: every tar entry sorted, owned by 0:0, its mtime clamped to SOURCE_DATE_EPOCH (the last commit's
time unless set), gzip without a timestamp, .pyc in unchecked-hash mode (no mtimes in them), JSON with sorted
keys. The Debian layer is cached by its recipe and the wheels by the lock's hash under
~/.cache/gpu-dra-agent/image (GPU_DRA_AGENT_CACHE moves it), so the same tree gives the same digest again.
Standard library only apart from what the steps run (mmdebstrap, chroot, pip, mypyc from the venv).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
LOCK = HERE / "requirements.lock"
PIP_LOCK = HERE / "pip.lock"
PIP_TOOLS = "pip-tools==7.6.2"

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# libc-bin: ldconfig, run once to write /etc/ld.so.cache; libstdc++6: grpcio's compiled core links it
DEBIAN_PACKAGES = ("python3", "libc-bin", "libstdc++6")
# The Debian and dependency layers' files keep their packaged times up to this instant and later ones are clamped
# to it, so those layers do not change with each commit (2026-01-01T00:00:00Z); the project's layer takes
# SOURCE_DATE_EPOCH.
BASE_EPOCH = 1767225600
PYTHON = "python3.11"
SITE = f"usr/local/lib/{PYTHON}/dist-packages"
# Left out of the Debian layer: what only a package manager or a person at a terminal reads.
DEBIAN_DROP = (
    "etc/apt",
    "etc/cron.daily",
    "etc/logrotate.d",
    "etc/resolv.conf",
    "etc/hostname",
    "etc/dpkg",
    "var/cache",
    "var/log",
    "var/lib/apt",
    "var/lib/dpkg",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    "usr/share/doc-base",
    "usr/share/bug",
    "usr/share/applications",
    "usr/share/pixmaps",
    "usr/share/polkit-1",
    "usr/share/binfmts",
    "usr/lib/valgrind",
    "usr/lib/binfmt.d",
    "usr/lib/x86_64-linux-gnu/gconv",  # iconv's charsets: python has its own
    "usr/lib/python3.11/pydoc_data",  # help()'s topics, for a person at a prompt
    "usr/bin/dpkg",
    "usr/bin/dpkg-deb",
    "usr/bin/dpkg-divert",
    "usr/bin/dpkg-maintscript-helper",
    "usr/bin/dpkg-query",
    "usr/bin/dpkg-realpath",
    "usr/bin/dpkg-split",
    "usr/bin/dpkg-statoverride",
    "usr/bin/dpkg-trigger",
    "usr/bin/update-alternatives",
    "usr/libexec/dpkg",
    "usr/share/dpkg",
)
DPKG_EXCLUDES = (
    "/usr/share/doc/*",
    "/usr/share/man/*",
    "/usr/share/info/*",
    "/usr/share/locale/*",
    "/usr/share/lintian/*",
)
PASSWD = b"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
GROUP = b"root:x:0:\nnonroot:x:65532:\n"

# Inside the copy of the root being built (not the host's /tmp): wheels, lock, and one `pip --root` per layer.
STAGE = "/tmp/stage"  # noqa: S108

MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


class ImageError(RuntimeError):
    """A step failed or a tool is missing; the message says which and what to install."""


# ---------------------------------------------------------------------------------------------------------- steps


def cache_root() -> Path:
    base = os.environ.get("GPU_DRA_AGENT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpu-dra-agent"
    )
    return Path(base) / "image"


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One build at a time per cache entry: parallel sessions share the cache."""
    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _cached(target: Path, make: Callable[[Path], None]) -> Path:
    """The cache entry `target`, made by `make(staging)` on first use under the entry's lock (parallel sessions
    share the cache), in a staging directory renamed to `target` whole: a killed build leaves no half entry."""
    if (target / "done").exists():
        return target
    with _locked(target.name):
        if not (target / "done").exists():
            shutil.rmtree(target, ignore_errors=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache_root()))
            try:
                make(staging)
                (staging / "done").write_text("")
                staging.rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target


def _run(command: list[str], log: Path | None = None, **kwargs: Any) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    if log is not None:
        with open(log, "a") as out:
            out.write(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}")
    if done.returncode != 0:
        raise ImageError(f"`{' '.join(command)}` failed ({done.returncode}): {(done.stderr or done.stdout)[-2000:]}")
    return done.stdout


def source_date_epoch(tree: Path) -> int:
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return int(os.environ["SOURCE_DATE_EPOCH"])
    try:
        return int(_run(["git", "-C", str(tree), "log", "-1", "--format=%ct"]).strip())
    except (ImageError, ValueError, OSError) as error:
        raise ImageError(f"no SOURCE_DATE_EPOCH and no git history in {tree} to take it from") from error


def _recipe_key(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]


def debian_root(log: Path) -> Path:
    """The cached Debian root (a directory), made by mmdebstrap on first use (about 20 s and 20 MB of downloads),
    with its layer compressed once beside it."""
    key = _recipe_key(SUITE, MIRROR, DEBIAN_PACKAGES, DPKG_EXCLUDES, DEBIAN_DROP, PASSWD, GROUP, "v2")
    return _cached(cache_root() / f"debian-{SUITE}-{key}", lambda entry: _make_debian(entry, log)) / "root"


def _make_debian(entry: Path, log: Path) -> None:
    if shutil.which("mmdebstrap") is None:
        raise ImageError("mmdebstrap is needed for the image's Debian root: apt-get install mmdebstrap")
    if os.geteuid() != 0:
        raise ImageError("the image is built as root (mmdebstrap's root mode, chroot)")
    root = entry / "root"
    # Before apt's cache is cleaned: one dpkg status paragraph per package shipped, from the .debs themselves.
    status_hook = (
        'mkdir -p "$1/var/lib/dpkg-image" && for deb in "$1"/var/cache/apt/archives/*.deb; do '
        'dpkg-deb -f "$deb" Package Version Architecture Source Maintainer Installed-Size Depends '
        'Pre-Depends Homepage Description; echo "Status: install ok installed"; echo; '
        'done > "$1/var/lib/dpkg-image/status"'
    )
    command = [
        "mmdebstrap",
        "--mode=root",
        "--variant=extract",
        f"--include={','.join(DEBIAN_PACKAGES)}",
        "--format=directory",
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        *(f"--dpkgopt=path-exclude={p}" for p in DPKG_EXCLUDES),
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        f"--extract-hook={status_hook}",
        SUITE,
        str(root),
        MIRROR,
    ]
    _run(command, log, env={**os.environ, "SOURCE_DATE_EPOCH": str(BASE_EPOCH)})
    for name in DEBIAN_DROP:
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    (root / "var/lib/dpkg").mkdir(parents=True)
    (root / "var/lib/dpkg-image/status").rename(root / "var/lib/dpkg/status")
    (root / "var/lib/dpkg-image").rmdir()
    (root / "etc/passwd").write_bytes(PASSWD)
    (root / "etc/group").write_bytes(GROUP)
    for home in ("root", "home/nonroot"):
        (root / home).mkdir(parents=True, exist_ok=True)
    os.chown(root / "home/nonroot", 65532, 65532)
    _chroot(root, ["/sbin/ldconfig"], log)
    _compile_all(root, [f"/usr/lib/{PYTHON}", "/usr/lib/python3/dist-packages"], log)
    layer = Layer.of(layer_tar(root, BASE_EPOCH, skip=("dev/",)), f"mmdebstrap {SUITE}: {' '.join(DEBIAN_PACKAGES)}")
    (entry / "layer.tar.gz").write_bytes(layer.blob.data)
    (entry / "layer.json").write_text(
        json.dumps({"diff_id": layer.diff_id, "size": layer.size, "comment": layer.comment})
    )


def _chroot(root: Path, argv: list[str], log: Path) -> str:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    return _run(["chroot", str(root), *argv], log, env=env)


def _compile_all(root: Path, directories: list[str], log: Path, strip: str | None = None) -> None:
    """.pyc beside every module, by the image's own python, in unchecked-hash mode: no source mtime inside, and
    never rewritten (the image is immutable)."""
    for directory in directories:
        if not (root / directory.lstrip("/")).is_dir():
            continue
        args = ["-s", strip, "-p", "/"] if strip else []
        _chroot(
            root,
            [
                "/usr/bin/python3",
                "-m",
                "compileall",
                "-q",
                "-j",
                "1",
                "-x",
                r"/(test|tests|idlelib)/",
                "--invalidation-mode",
                "unchecked-hash",
                *args,
                directory,
            ],
            log,
        )


def lock_key() -> str:
    return hashlib.sha256(LOCK.read_bytes() + PIP_LOCK.read_bytes()).hexdigest()[:12]


def wheels(log: Path) -> Path:
    """The lock's wheels (and pip's) with their hashes checked, downloaded once per lock into the cache."""
    return _cached(cache_root() / f"wheels-{lock_key()}", lambda entry: _download_wheels(entry, log))


def _download_wheels(entry: Path, log: Path) -> None:
    # wheels for the image's python (cp311, glibc 2.36), whatever python runs this
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "any"]
    for lock in (LOCK, PIP_LOCK):
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--require-hashes",
                "--only-binary=:all:",
                "--python-version",
                "3.11",
                "--implementation",
                "cp",
                *(f"--platform={p}" for p in platforms),
                "-d",
                str(entry),
                "-r",
                str(lock),
            ],
            log,
        )


def agent_wheel(tree: Path, out: Path, log: Path, epoch: int) -> Path:
    """The project's wheel with the compiled arbiter core, built from a copy of `tree` at a fixed path (the
    path would otherwise reach the compiled modules)."""
    source = cache_root() / "source"
    # one fixed path: two builds at once (a test beside `make image`, two checkouts) take turns
    with _locked("source"):
        shutil.rmtree(source, ignore_errors=True)
        for name in ("pyproject.toml", "README.md"):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(tree / name, source / name)
        for name in ("agent", "native"):
            shutil.copytree(tree / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        env = {**os.environ, "SOURCE_DATE_EPOCH": str(epoch), "CFLAGS": "-g0"}  # no debug info: no build paths
        _run([sys.executable, "native/compile.py"], log, cwd=source, env=env)
        if not list((source / "agent/arbiter/core").glob("*.so")):
            raise ImageError("mypyc compiled no arbiter core module (see the log)")
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "-w",
                str(out),
                str(source),
            ],
            log,
            env=env,
        )
    (built,) = out.glob("gpu_dra_agent-*.whl")
    return built


# ---------------------------------------------------------------------------------------------------------- layers


def layer_tar(directory: Path, epoch: int, skip: tuple[str, ...] = ()) -> bytes:
    """`directory` as an uncompressed layer: sorted, 0:0, mtimes clamped to `epoch`; device nodes, sockets and
    fifos left out (the runtime makes /dev)."""
    out = io.BytesIO()
    inodes: dict[tuple[int, int], str] = {}
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(_walk(directory), key=lambda p: p.relative_to(directory).as_posix()):
            name = path.relative_to(directory).as_posix()
            if name.startswith(skip):
                continue
            st = path.lstat()
            info = tarfile.TarInfo(name)
            info.mode = stat.S_IMODE(st.st_mode)
            info.mtime = min(int(st.st_mtime), epoch)
            info.uid = info.gid = st.st_uid if st.st_uid == 65532 else 0
            info.uname = info.gname = ""
            data = None
            if stat.S_ISLNK(st.st_mode):
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
            elif stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
            elif stat.S_ISREG(st.st_mode):
                if st.st_nlink > 1 and (st.st_dev, st.st_ino) in inodes:
                    info.type, info.linkname = tarfile.LNKTYPE, inodes[(st.st_dev, st.st_ino)]
                else:
                    inodes[(st.st_dev, st.st_ino)] = name
                    data = path.read_bytes()
                    info.size = len(data)
            else:
                continue
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def _walk(top: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(top):
        for name in (*dirnames, *filenames):
            yield Path(dirpath, name)


@dataclass(frozen=True)
class Blob:
    media_type: str
    data: bytes

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.data).hexdigest()

    def descriptor(self, **extra: Any) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data), **extra}


@dataclass(frozen=True)
class Layer:
    blob: Blob  # gzip
    diff_id: str  # sha256 of the uncompressed tar
    size: int  # uncompressed
    comment: str

    @classmethod
    def of(cls, tar: bytes, comment: str) -> Layer:
        return cls(
            Blob(MEDIA_LAYER, gzip.compress(tar, compresslevel=6, mtime=0)),
            "sha256:" + hashlib.sha256(tar).hexdigest(),
            len(tar),
            comment,
        )


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Image:
    name: str
    path: Path
    digest: str  # the manifest's
    size: int  # the layers, uncompressed
    compressed: int


def image_config(layers: list[Layer], epoch: int, version: str) -> dict[str, Any]:
    """The agent's image config: its entrypoint, environment and labels, the layers' diff_ids and history."""
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": {
            "Entrypoint": ["gpu-dra-agent", "node"],
            "Env": [
                "PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
                "LANG=C.UTF-8",
                "PYTHONDONTWRITEBYTECODE=1",
            ],
            "WorkingDir": "/",
            "Labels": {
                "org.opencontainers.image.title": "gpu-dra-agent",
                "org.opencontainers.image.version": version,
                "org.opencontainers.image.created": created,
            },
        },
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created": created, "created_by": layer.comment} for layer in layers],
    }


def write_archive(path: Path, name: str, config: dict[str, Any], layers: list[Blob], epoch: int) -> str:
    """An OCI image layout in a tar (index.json named for containerd and podman) with docker's manifest.json:
    `config` (whose rootfs lists the diff_ids of `layers`, the compressed blobs), every entry's mtime `epoch`.
    Returns the manifest's digest. The tests' node images are written by it too (tests/node/images.py)."""
    config_blob = Blob(MEDIA_CONFIG, _json(config))
    manifest = Blob(
        MEDIA_MANIFEST,
        _json(
            {
                "schemaVersion": 2,
                "mediaType": MEDIA_MANIFEST,
                "config": config_blob.descriptor(),
                "layers": [layer.descriptor() for layer in layers],
            }
        ),
    )
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            manifest.descriptor(
                annotations={"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name}
            )
        ],
    }
    short = name.removeprefix("docker.io/library/")
    docker = [
        {
            "Config": f"blobs/sha256/{config_blob.digest[7:]}",
            "RepoTags": [short],
            "Layers": [f"blobs/sha256/{layer.digest[7:]}" for layer in layers],
        }
    ]
    files = {
        "oci-layout": _json({"imageLayoutVersion": "1.0.0"}),
        "index.json": _json(index),
        "manifest.json": _json(docker),
    }
    for blob in (*layers, config_blob, manifest):
        files[f"blobs/sha256/{blob.digest[7:]}"] = blob.data
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, epoch
            tar.addfile(info)
        for entry, data in sorted(files.items()):
            info = tarfile.TarInfo(entry)
            info.size, info.mode, info.mtime = len(data), 0o644, epoch
            tar.addfile(info, io.BytesIO(data))
    return manifest.digest


def _image(path: Path, name: str, layers: list[Layer], epoch: int, version: str) -> Image:
    """The agent's image (`layers` under its config) written to `path`."""
    digest = write_archive(path, name, image_config(layers, epoch, version), [layer.blob for layer in layers], epoch)
    return Image(name, path, digest, sum(layer.size for layer in layers), sum(len(layer.blob.data) for layer in layers))


def _debian_layer(root: Path) -> Layer:
    """The Debian layer, compressed when its root was made (debian_root)."""
    info = json.loads((root.parent / "layer.json").read_text())
    data = (root.parent / "layer.tar.gz").read_bytes()
    return Layer(Blob(MEDIA_LAYER, data), info["diff_id"], info["size"], info["comment"])


def project_version(tree: Path) -> str:
    import tomllib

    return str(tomllib.loads((tree / "pyproject.toml").read_text())["project"]["version"])


def build(
    tree: Path = REPO, out: Path | None = None, tag: str | None = None, log: Path | None = None
) -> tuple[Image, Image]:
    """(the product image, the test image: the product plus the NVML fake), as archives under `out`."""
    out = out or tree / "build" / "image"
    out.mkdir(parents=True, exist_ok=True)
    log = log or out / "build.log"
    log.write_text("")
    epoch = source_date_epoch(tree)
    version = project_version(tree)
    tag = tag or version
    root = debian_root(log)
    wheel_dir = wheels(log)
    with tempfile.TemporaryDirectory(prefix="gpu-dra-agent-image-") as scratch:
        work = Path(scratch) / "root"
        _run(["cp", "-a", str(root), str(work)], log)  # a copy: the cached root stays as Debian made it
        _check_abi(work, log)
        (pip_wheel,) = wheel_dir.glob("pip-*.whl")
        stage = work / STAGE.lstrip("/")
        (stage / "wheels").mkdir(parents=True)
        for wheel in wheel_dir.glob("*.whl"):
            shutil.copy(wheel, stage / "wheels")
        shutil.copy(LOCK, stage / "requirements.lock")
        agent_wheel(tree, stage / "dist", log, epoch)
        pip = [
            "/usr/bin/python3",
            f"{STAGE}/wheels/{pip_wheel.name}/pip",
            "install",
            "-q",
            "--no-index",
            "--no-compile",
            "--no-deps",
            "--only-binary=:all:",
            "--break-system-packages",
            "--disable-pip-version-check",
            "--no-cache-dir",
            "--root-user-action=ignore",
        ]
        _chroot(
            work,
            [
                *pip,
                "--require-hashes",
                "--find-links",
                f"{STAGE}/wheels",
                "--root",
                f"{STAGE}/deps",
                "-r",
                f"{STAGE}/requirements.lock",
            ],
            log,
        )
        _chroot(
            work, [*pip, "--find-links", f"{STAGE}/dist", "--root", f"{STAGE}/agent", f"gpu-dra-agent=={version}"], log
        )
        fake = stage / "fake" / SITE / "fakes"
        fake.mkdir(parents=True)
        shutil.copy(tree / "fakes/__init__.py", fake / "__init__.py")
        shutil.copytree(tree / "fakes/nvml", fake / "nvml", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for part in ("deps", "agent", "fake"):
            _compile_all(work, [f"{STAGE}/{part}/{SITE}"], log, strip=f"{STAGE}/{part}")
        _check_imports(work, log)
        layers = [_debian_layer(root)]
        layers.append(Layer.of(layer_tar(stage / "deps", BASE_EPOCH), f"pip install --require-hashes -r {LOCK.name}"))
        layers.append(Layer.of(layer_tar(stage / "agent", epoch), f"pip install gpu-dra-agent=={version}"))
        fake_layer = Layer.of(layer_tar(stage / "fake", epoch), "the NVML fake: fakes/__init__.py, fakes/nvml")
    product = _image(
        out / f"gpu-dra-agent-{tag}.oci.tar", f"docker.io/library/gpu-dra-agent:{tag}", layers, epoch, version
    )
    test = _image(
        out / f"gpu-dra-agent-{tag}-nvml-fake.oci.tar",
        f"docker.io/library/gpu-dra-agent:{tag}-nvml-fake",
        [*layers, fake_layer],
        epoch,
        version,
    )
    return product, test


def _check_abi(root: Path, log: Path) -> None:
    """The core is compiled by the python running this: it must be the image's python's ABI."""
    import sysconfig

    suffix = "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"
    theirs = _chroot(root, ["/usr/bin/python3", "-c", suffix], log).strip()
    ours = sysconfig.get_config_var("EXT_SUFFIX")
    if theirs != ours:
        raise ImageError(
            f"the image's python loads {theirs} modules, this python builds {ours}: run the build "
            f"with a {PYTHON} (the venv of a Debian {SUITE} host, as `make image` does)"
        )


def _check_imports(root: Path, log: Path) -> None:
    """What the agent's commands load, compiled extensions and the libraries they link included, loads in the
    image's root: a shared library missing from the Debian layer fails the build, not the first pod."""
    paths = [f"{STAGE}/{part}/{SITE}" for part in ("deps", "agent")]
    code = (
        f"import sys; sys.path[:0] = {paths!r}; import grpc._cython.cygrpc, agent.commands.node, "
        "agent.commands.arbiter, agent.arbiter.core"
    )
    try:
        _chroot(root, ["/usr/bin/python3", "-c", code], log)
    except ImageError as error:
        raise ImageError(f"the agent does not load in the image's root: {error}") from None


def relock() -> None:
    """requirements.lock from pyproject.toml's dependencies, every file's hash pinned, by a pinned pip-tools."""
    venv = cache_root() / "pip-tools"
    if not (venv / "bin/pip-compile").exists():
        _run([sys.executable, "-m", "venv", str(venv)])
        _run([str(venv / "bin/pip"), "install", "-q", PIP_TOOLS])
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copy(REPO / "pyproject.toml", scratch)
        shutil.copy(REPO / "README.md", scratch)
        (Path(scratch) / "agent").mkdir()
        (Path(scratch) / "agent/__init__.py").write_text("")
        env = {**os.environ, "CUSTOM_COMPILE_COMMAND": "python daemonset/image/build.py --lock"}
        env.pop("PIP_FIND_LINKS", None)
        _run(
            [
                str(venv / "bin/pip-compile"),
                "-q",
                "--generate-hashes",
                "--strip-extras",
                "--no-emit-index-url",
                "--no-emit-find-links",
                "--output-file",
                str(LOCK),
                "pyproject.toml",
            ],
            cwd=scratch,
            env=env,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where the archives go (default build/image)")
    parser.add_argument("--tag", help="the image tag (default the project's version)")
    parser.add_argument("--lock", action="store_true", help="re-pin requirements.lock with pip-tools and exit")
    args = parser.parse_args(argv)
    try:
        if args.lock:
            relock()
            print(LOCK)
            return 0
        started = time.monotonic()
        product, test = build(out=args.out, tag=args.tag)
    except ImageError as error:
        print(f"image: {error}", file=sys.stderr)
        return 1
    for image in (product, test):
        print(
            f"{image.path}\n  {image.name}  {image.digest}\n  {image.size / 1e6:.1f} MB uncompressed, "
            f"{image.compressed / 1e6:.1f} MB compressed"
        )
    print(
        f"built in {time.monotonic() - started:.0f}s; load with `ctr -n k8s.io images import`, `podman load -i` "
        "or `docker load -i`"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
