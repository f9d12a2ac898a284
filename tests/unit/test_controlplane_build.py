"""The control-plane build's bookkeeping and the credentials the harness makes, without Go or a server."""

from __future__ import annotations

import datetime
import shutil
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.controlplane import build
from tests.controlplane.pki import make_pki


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the Go modules and an empty cache, so edits here touch neither the checkout nor ~/.cache."""
    copy = tmp_path / "controlplane"
    shutil.copytree(build.MODULE_DIR, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(build, "MODULE_DIR", copy)
    monkeypatch.setattr(build, "ETCD_MODULE_DIR", copy / "etcd")
    monkeypatch.setattr(build, "INPUTS", tuple(copy / p for p in ("go.mod", "go.sum", "etcd/go.mod", "etcd/go.sum")))
    monkeypatch.setenv("GPU_DRA_AGENT_CACHE", str(tmp_path / "cache"))
    return copy


def test_pinned_versions_are_the_issue_s() -> None:
    assert build.kubernetes_version().startswith("v1.37.")
    assert build.etcd_version().startswith("v3.6.")
    go_mod = (build.MODULE_DIR / "go.mod").read_text()
    # every staging module points at the tag matching k8s.io/kubernetes (v1.37.x -> v0.37.x)
    staging = build.kubernetes_version().replace("v1.", "v0.", 1)
    assert f"k8s.io/api => k8s.io/api {staging}" in go_mod
    assert f"k8s.io/dynamic-resource-allocation => k8s.io/dynamic-resource-allocation {staging}" in go_mod


def test_binary_dir_is_named_after_versions_and_changes_with_go_sum(modules: Path) -> None:
    before = build.binary_dir()
    assert before.name.startswith(f"kubernetes-{build.kubernetes_version()}-etcd-{build.etcd_version()}-")
    assert build.binary_dir() == before  # stable while nothing changes
    with open(modules / "go.sum", "a") as f:
        f.write("example.com/m v1.0.0 h1:AAAA=\n")
    assert build.binary_dir() != before


def test_built_needs_all_four_binaries(modules: Path) -> None:
    target = build.binary_dir()
    target.mkdir(parents=True)
    for name in build.BINARIES[:-1]:
        (target / name).write_text("")
    assert build.built() is None
    (target / build.BINARIES[-1]).write_text("")
    assert build.built() == target
    assert build.build() == target  # warm: no Go needed, nothing rebuilt


def test_without_go_the_build_says_so(modules: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(build.BuildError, match=r"`go` is not on PATH.*Go 1\.26"):
        build.build()
    assert not build.binary_dir().exists()


def test_a_failed_build_leaves_no_half_directory(
    modules: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_go = tmp_path / "bin" / "go"
    fake_go.parent.mkdir()
    fake_go.write_text("#!/bin/sh\necho 'compile: out of memory' >&2\nexit 2\n")
    fake_go.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake_go.parent))
    log = tmp_path / "build.log"
    with pytest.raises(build.BuildError, match="failed with exit 2"):
        build.build(log)
    assert "out of memory" in log.read_text()
    assert not build.binary_dir().exists()
    assert [p.name for p in build.binary_dir().parent.iterdir() if p.name.startswith(".building")] == []


def test_pki_chain_names_and_key_modes(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    serving = x509.load_pem_x509_certificate(pki.serving_cert.read_bytes())
    admin = x509.load_pem_x509_certificate(pki.admin_cert.read_bytes())
    for cert in (serving, admin):
        cert.verify_directly_issued_by(ca)
        assert cert.not_valid_after_utc > datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=12)
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in sans.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)][0] == "127.0.0.1"
    assert ExtendedKeyUsageOID.SERVER_AUTH in serving.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    # kube-apiserver maps O to groups: system:masters is what makes the kubeconfig an admin one
    assert [a.value for a in admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)] == ["system:masters"]
    for key in (pki.serving_key, pki.admin_key, pki.service_account_key):
        assert key.stat().st_mode & 0o777 == 0o600
    assert b"PUBLIC KEY" in pki.service_account_pub.read_bytes()
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)


def test_a_build_over_its_budget_is_stopped_with_its_compilers(
    modules: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `go` that never finishes (and has a child, as go has its compilers): stopped at the budget, all of it."""
    pidfile = tmp_path / "child.pid"
    fake_go = tmp_path / "bin" / "go"
    fake_go.parent.mkdir()
    fake_go.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {pidfile}\nwait\n")
    fake_go.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_go.parent}:/usr/bin:/bin")
    started = time.monotonic()
    with pytest.raises(build.BuildTimeout, match="within its 1s budget"):
        build.build(tmp_path / "build.log", budget_s=1)
    assert time.monotonic() - started < 10
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the killed child may linger a moment as a zombie of init
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    assert not build.binary_dir().exists()
