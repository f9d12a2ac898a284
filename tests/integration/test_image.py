"""The agent's OCI image as `make image` builds it (daemonset/image/build.py): from Debian's packages and PyPI
alone, reproducible, small, with no fakes in the product, and loadable by podman.

Tried: the same tree built twice (one snapshot of the checkout, one SOURCE_DATE_EPOCH) must give the same
digests; the product's layers unpacked and run with chroot (`gpu-dra-agent --version`, an `inventory` that
must fail for want of the NVML fake); the test image's one extra layer holds the fake and nothing else, and
the same inventory then works; `podman load` names the image. Needs root and mmdebstrap (`make test` installs
it); the Debian root and the wheels are cached under ~/.cache/gpu-dra-agent/image, so only a cold cache
downloads (about 20 MB from Debian, 30 MB from PyPI).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tests.node.images import builder

REPO = Path(__file__).resolve().parents[2]
EPOCH = "1764000000"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(os.geteuid() != 0, reason="the image is built as root (mmdebstrap, chroot)"),
    pytest.mark.skipif(
        shutil.which("mmdebstrap") is None,
        reason="mmdebstrap is not installed (apt-get install mmdebstrap; `make test` does)",
    ),
]


def _snapshot(into: Path) -> Path:
    """What the build reads, copied once: other work may change the checkout between the two builds."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, into / name)
    for name in ("agent", "native", "fakes"):
        shutil.copytree(REPO / name, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    return into


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    build = builder()
    tree = _snapshot(tmp_path_factory.mktemp("tree"))
    os.environ["SOURCE_DATE_EPOCH"] = EPOCH
    try:
        first = build.build(tree, tmp_path_factory.mktemp("first"))
        second = build.build(tree, tmp_path_factory.mktemp("second"))
    finally:
        del os.environ["SOURCE_DATE_EPOCH"]
    return {"first": first, "second": second}


def _unpack(archive: Path, into: Path) -> dict[str, Any]:
    """The image's layers applied in order under `into` (no whiteouts: ours has none); its config."""
    with tarfile.open(archive) as outer:
        docker = json.loads(outer.extractfile("manifest.json").read())[0]  # type: ignore[union-attr]
        config = json.loads(outer.extractfile(docker["Config"]).read())  # type: ignore[union-attr]
        for layer in docker["Layers"]:
            data = outer.extractfile(layer).read()  # type: ignore[union-attr]
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
                assert not [m.name for m in tar.getmembers() if os.path.basename(m.name).startswith(".wh.")]
                tar.extractall(into, filter="tar")
    return config


def _layer_names(archive: Path, index: int) -> list[str]:
    with tarfile.open(archive) as outer:
        docker = json.loads(outer.extractfile("manifest.json").read())[0]  # type: ignore[union-attr]
        data = outer.extractfile(docker["Layers"][index]).read()  # type: ignore[union-attr]
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return [m.name for m in tar.getmembers() if not m.isdir()]


def _chroot(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    return subprocess.run([chroot, str(root), *argv], capture_output=True, text=True, env=env, timeout=120, check=False)


def test_the_same_tree_builds_the_same_image_twice(built: dict[str, Any]) -> None:
    first, second = built["first"], built["second"]
    for a, b in zip(first, second, strict=True):
        print(f"{a.name} {a.digest} {a.size / 1e6:.1f} MB uncompressed, {a.compressed / 1e6:.1f} MB compressed")
        assert a.digest == b.digest
        assert a.path.read_bytes() == b.path.read_bytes()


def test_the_product_image_is_small_and_holds_no_compiler_tests_or_fakes(built: dict[str, Any], tmp_path: Path) -> None:
    product, _ = built["first"]
    assert product.size < 150e6, f"{product.size / 1e6:.1f} MB uncompressed"
    root = tmp_path / "root"
    config = _unpack(product.path, root)
    assert config["config"]["Entrypoint"] == ["gpu-dra-agent", "node"]
    for tool in ("gcc", "cc", "ld", "as", "make", "pip", "pip3", "apt", "apt-get", "dpkg", "sh", "bash"):
        assert not [p for p in ("usr/bin", "usr/sbin", "usr/local/bin") if (root / p / tool).exists()], tool
    site = root / "usr/local/lib/python3.11/dist-packages"
    assert (site / "agent").is_dir() and not (site / "fakes").exists() and not (site / "tests").exists()
    assert list((site / "agent/arbiter/core").glob("*.cpython-311-x86_64-linux-gnu.so")), "no compiled core"
    assert not [p for p in root.rglob("*") if p.name in ("apt", "man") and p.parent.name in ("lib", "share")]
    packages = (root / "var/lib/dpkg/status").read_text()
    assert "Package: python3.11-minimal" in packages and "Package: gcc\n" not in packages

    version = _chroot(root, "gpu-dra-agent", "--version")
    assert version.returncode == 0, version.stderr
    assert "0.1.0" in version.stdout + version.stderr
    compiled = _chroot(root, "python3", "-c", "import agent.arbiter.core.cycle as c; print(c.__file__)")
    assert compiled.stdout.strip().endswith(".so"), compiled
    no_fake = _chroot(root, "gpu-dra-agent", "inventory", "--nvml", "fake:dgx-h100")
    assert no_fake.returncode != 0 and "not installed" in no_fake.stderr, no_fake


def test_the_test_image_is_the_product_plus_the_nvml_fake_alone(built: dict[str, Any], tmp_path: Path) -> None:
    product, test = built["first"]
    with tarfile.open(product.path) as p, tarfile.open(test.path) as t:
        product_layers = json.loads(p.extractfile("manifest.json").read())[0]["Layers"]  # type: ignore[union-attr]
        test_layers = json.loads(t.extractfile("manifest.json").read())[0]["Layers"]  # type: ignore[union-attr]
    assert test_layers[:-1] == product_layers and len(test_layers) == len(product_layers) + 1
    added = _layer_names(test.path, -1)
    site = "usr/local/lib/python3.11/dist-packages/"
    assert all(
        n.startswith((site + "fakes/nvml/", site + "fakes/__init__.py", site + "fakes/__pycache__/__init__"))
        for n in added
    ), added
    root = tmp_path / "root"
    _unpack(test.path, root)
    inventory = _chroot(root, "gpu-dra-agent", "inventory", "--nvml", "fake:dgx-h100", "--output", "json")
    assert inventory.returncode == 0, inventory.stderr
    assert "H100" in inventory.stdout


@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed (`make test` installs it)")
def test_podman_loads_the_archive(built: dict[str, Any]) -> None:
    product, _ = built["first"]
    loaded = subprocess.run(
        ["podman", "load", "-i", str(product.path)], capture_output=True, text=True, timeout=300, check=False
    )
    assert loaded.returncode == 0, loaded.stderr
    try:
        inspect = subprocess.run(
            ["podman", "image", "inspect", product.name], capture_output=True, text=True, timeout=60, check=True
        )
        (image,) = json.loads(inspect.stdout)
        assert image["Digest"] == product.digest
        assert image["Config"]["Entrypoint"] == ["gpu-dra-agent", "node"]
    finally:
        subprocess.run(["podman", "rmi", "-f", product.name], capture_output=True, timeout=120, check=False)
