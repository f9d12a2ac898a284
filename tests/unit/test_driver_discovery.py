"""Driver discovery over fake driver roots: both layouts, the root's own ld.so.cache (read as glibc writes
it), missing files, symlinks resolved inside the root, and a root of another driver version refused."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess

import pytest

from agent.driver import discovery, elf, ldcache
from agent.driver.discovery import DriverVersionMismatch, discover, find_hook
from fakes.nvml.binaries import install_driver_root
from fakes.nvml.driver_files import LIBRARIES, VERSION, elf_shared_object, ld_so_cache

COMPUTE = {
    "libcuda",
    "libcudadebugger",
    "libnvidia-ml",
    "libnvidia-ptxjitcompiler",
    "libnvidia-nvvm",
    "libnvidia-opencl",
    "libnvidia-gpucomp",
    "libnvidia-cfg",
    "libnvidia-allocator",
}


def fake_root(tmp_path: pathlib.Path, layout: str = "host", version: str = VERSION) -> pathlib.Path:
    root = tmp_path / f"root-{layout}"
    install_driver_root(root, version=version, layout=layout)
    return root


def names(paths: object) -> set[str]:
    return {p.rsplit("/", 1)[-1] for p in paths}  # type: ignore[attr-defined]


def test_host_layout_finds_every_file_of_the_version(tmp_path: pathlib.Path) -> None:
    files = discover(fake_root(tmp_path), VERSION, kernel_release="6.1.0", firmware_class_path="")
    lib_dir = "usr/lib/x86_64-linux-gnu" if os.uname().machine == "x86_64" else "usr/lib/aarch64-linux-gnu"
    assert {lib.path for lib in files.libraries} == {f"{lib_dir}/{stem}.so.{VERSION}" for stem in LIBRARIES}
    cuda = next(lib for lib in files.libraries if lib.name.startswith("libcuda.so"))
    assert (cuda.soname, cuda.soname_link, cuda.dev_link) == ("libcuda.so.1", True, True)
    gpucomp = next(lib for lib in files.libraries if lib.name.startswith("libnvidia-gpucomp"))
    assert gpucomp.soname == gpucomp.name and not gpucomp.soname_link  # its SONAME is the versioned name
    assert [b.path for b in files.binaries] == [
        "usr/bin/nvidia-smi",
        "usr/bin/nvidia-debugdump",
        "usr/bin/nvidia-persistenced",
        "usr/bin/nvidia-cuda-mps-control",
        "usr/bin/nvidia-cuda-mps-server",
    ]
    assert [f.path for f in files.firmware] == [
        f"lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
        f"lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin",
    ]
    assert files.missing == ()


def test_driver_folder_layout_is_found_through_the_roots_ld_so_cache(tmp_path: pathlib.Path) -> None:
    """lib64/ under a driver folder (/usr/local/nvidia), which only the root's ld.so.conf.d and cache name."""
    root = fake_root(tmp_path, "driver-folder")
    files = discover(root, VERSION, kernel_release="6.1.0", firmware_class_path="")
    assert {lib.directory for lib in files.libraries} == {"usr/local/nvidia/lib64"}
    assert {lib.name.split(".so")[0] for lib in files.libraries} >= COMPUTE
    assert "usr/local/nvidia/bin/nvidia-debugdump" in [b.path for b in files.binaries]
    # the same folder under another name no standard folder matches: only the cache leads there
    (root / "usr/local/nvidia").rename(root / "opt-driver")
    (root / "etc/ld.so.cache").write_bytes(
        ld_so_cache([(f"{stem}.so.1", f"/opt-driver/lib64/{stem}.so.1") for stem in ("libcuda", "libnvidia-ml")])
    )
    found = discover(root, VERSION, kernel_release="6.1.0", firmware_class_path="")
    assert {lib.directory for lib in found.libraries} == {"opt-driver/lib64"}
    assert {lib.name.split(".so")[0] for lib in found.libraries} >= COMPUTE  # the folder's other files too


def test_without_a_cache_the_standard_folders_are_searched(tmp_path: pathlib.Path) -> None:
    root = fake_root(tmp_path)
    (root / "etc/ld.so.cache").unlink()
    lib64 = root / "usr/lib64"
    shutil.move(root / "usr/lib" / os.listdir(root / "usr/lib")[0], lib64)  # a RHEL-style driver container
    files = discover(root, VERSION, firmware_class_path="")
    assert {lib.directory for lib in files.libraries} == {"usr/lib64"}
    assert files.missing == ()


def test_a_broken_cache_falls_back_to_the_folders(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    root = fake_root(tmp_path)
    (root / "etc/ld.so.cache").write_bytes(b"not a cache at all")
    files = discover(root, VERSION, firmware_class_path="")
    assert len(files.libraries) == len(LIBRARIES)
    assert "ld.so.cache is unreadable" in caplog.text


def test_missing_files_are_named_never_an_error(tmp_path: pathlib.Path) -> None:
    root = fake_root(tmp_path)
    lib_dir = next(lib.directory for lib in discover(root, VERSION).libraries)
    (root / lib_dir / f"libcudadebugger.so.{VERSION}").unlink()
    (root / "usr/bin/nvidia-debugdump").unlink()
    shutil.rmtree(root / "lib/firmware")
    files = discover(root, VERSION, firmware_class_path="")
    assert files.missing == (f"libcudadebugger.so.{VERSION}", "nvidia-debugdump", f"firmware/nvidia/{VERSION}/gsp*.bin")
    assert len(files.libraries) == len(LIBRARIES) - 1


def test_an_empty_root_finds_nothing(tmp_path: pathlib.Path) -> None:
    files = discover(tmp_path, VERSION, firmware_class_path="")
    assert (files.libraries, files.binaries, files.firmware, files.sockets) == ((), (), (), ())
    assert f"libcuda.so.{VERSION}" in files.missing and "nvidia-smi" in files.missing


def test_a_root_of_another_driver_version_is_refused(tmp_path: pathlib.Path) -> None:
    root = fake_root(tmp_path, version="535.104.05")
    with pytest.raises(DriverVersionMismatch, match=r"libcuda.so.535.104.05.*NVML reports driver 550.54.15"):
        discover(root, VERSION)


def test_only_the_reported_version_is_taken_where_two_are_installed(tmp_path: pathlib.Path) -> None:
    root = fake_root(tmp_path)
    lib_dir = next(lib.directory for lib in discover(root, VERSION).libraries)
    (root / lib_dir / "libcuda.so.535.104.05").write_bytes(elf_shared_object("libcuda.so.1"))
    files = discover(root, VERSION)
    assert all(lib.name.endswith(f".so.{VERSION}") for lib in files.libraries)  # never mixed


def test_absolute_symlinks_resolve_inside_the_root(tmp_path: pathlib.Path) -> None:
    """A driver container's links point at /usr/...: the root's, never the agent's own /usr."""
    root = tmp_path / "root"
    real = root / "opt/nvidia-580/lib"
    real.mkdir(parents=True)
    (real / f"libcuda.so.{VERSION}").write_bytes(elf_shared_object("libcuda.so.1"))
    (root / "usr/lib").mkdir(parents=True)
    os.symlink("/opt/nvidia-580/lib", root / "usr/lib64")  # absolute: inside the root
    os.symlink(f"../../opt/nvidia-580/lib/libcuda.so.{VERSION}", root / "usr/lib/libcuda.so.1")
    fs = discovery.DriverRootFs(root)
    assert fs.resolve(f"/usr/lib64/libcuda.so.{VERSION}") == f"opt/nvidia-580/lib/libcuda.so.{VERSION}"
    assert fs.resolve("usr/lib/libcuda.so.1") == f"opt/nvidia-580/lib/libcuda.so.{VERSION}"
    (root / "etc").mkdir()
    assert fs.resolve("usr/lib64/../../../../etc") == "etc"  # `..` stops at the root, as in a chroot
    os.symlink("loop-b", root / "loop-a")
    os.symlink("loop-a", root / "loop-b")
    assert fs.resolve("loop-a") is None
    files = discover(root, VERSION)
    assert [lib.path for lib in files.libraries] == [f"opt/nvidia-580/lib/libcuda.so.{VERSION}"]


def test_ipc_sockets_that_exist_are_found(tmp_path: pathlib.Path) -> None:
    root = fake_root(tmp_path)
    (root / "run/nvidia-persistenced").mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(root / "run/nvidia-persistenced/socket"))
        files = discover(root, VERSION)
    assert [s.path for s in files.sockets] == ["run/nvidia-persistenced/socket"]


def test_firmware_follows_the_kernels_custom_path(tmp_path: pathlib.Path) -> None:
    root = fake_root(tmp_path)
    shutil.move(root / "lib/firmware", root / "usr/local/nvidia-firmware")
    assert discover(root, VERSION, firmware_class_path="").firmware == ()
    files = discover(root, VERSION, firmware_class_path="/usr/local/nvidia-firmware")
    assert [f.path for f in files.firmware][0] == f"usr/local/nvidia-firmware/nvidia/{VERSION}/gsp_ga10x.bin"


def test_the_hook_is_looked_for_through_the_driver_root(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "driver-root"
    (root / "usr/bin").mkdir(parents=True)
    assert find_hook(root, "/", None) is None
    hook = root / "usr/bin/nvidia-cdi-hook"
    hook.write_text("#!/bin/sh\n")
    hook.chmod(0o755)
    assert find_hook(root, "/", None) == "/usr/bin/nvidia-cdi-hook"  # a host path, for the spec
    assert find_hook(root, "/run/nvidia/driver", "/run/nvidia/driver/usr/bin/nvidia-cdi-hook") == (
        "/run/nvidia/driver/usr/bin/nvidia-cdi-hook"
    )
    assert find_hook(root, "/", "/opt/elsewhere/nvidia-cdi-hook") is None


# --- the two formats, against glibc's own tools ---------------------------------------------------------


def test_the_machines_own_ld_so_cache_reads_as_ldconfig_prints_it() -> None:
    cache = pathlib.Path("/etc/ld.so.cache")
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    if not cache.is_file() or not os.access(ldconfig, os.X_OK):
        pytest.skip("no ld.so.cache or ldconfig on this machine")
    printed = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, check=True).stdout
    expected = [line.split(" => ")[1].strip() for line in printed.splitlines()[1:] if " => " in line]
    entries = ldcache.parse(cache.read_bytes())
    assert [e.path for e in entries] == expected
    assert any(e.name == "libc.so.6" and e.is_64bit_elf for e in entries)


@pytest.mark.parametrize("form", ["new", "compat"])
def test_caches_glibc_writes_in_either_format_are_read(tmp_path: pathlib.Path, form: str) -> None:
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    if not os.access(ldconfig, os.X_OK):
        pytest.skip("no ldconfig on this machine")
    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / f"libcuda.so.{VERSION}").write_bytes(elf_shared_object("libcuda.so.1"))
    (tmp_path / "ld.so.conf").write_text(f"{libs}\n")
    cache = tmp_path / "ld.so.cache"
    done = subprocess.run(
        [ldconfig, "-c", form, "-C", str(cache), "-f", str(tmp_path / "ld.so.conf")],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"ldconfig -c {form} refused here: {done.stderr.strip()}")
    data = cache.read_bytes()
    assert data.startswith(ldcache.OLD_MAGIC if form == "compat" else ldcache.NEW_MAGIC)
    entries = ldcache.parse(data)
    ours = [e for e in entries if e.name == "libcuda.so.1"]
    assert [(e.path, e.is_64bit_elf) for e in ours] == [(f"{libs}/libcuda.so.1", True)]
    assert (libs / "libcuda.so.1").is_symlink()  # ldconfig made the soname link: the fake library is real ELF


def test_the_fakes_cache_is_read_by_glibcs_ldconfig(tmp_path: pathlib.Path) -> None:
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    if not os.access(ldconfig, os.X_OK):
        pytest.skip("no ldconfig on this machine")
    cache = tmp_path / "cache"
    cache.write_bytes(ld_so_cache([("libcuda.so.1", "/usr/lib64/libcuda.so.1")]))
    printed = subprocess.run([ldconfig, "-p", "-C", str(cache)], capture_output=True, text=True, check=True).stdout
    assert "libcuda.so.1 (libc6," in printed and "=> /usr/lib64/libcuda.so.1" in printed


def test_broken_caches_are_refused() -> None:
    for data in (b"", b"glibc-ld.so.cache1.1", ldcache.OLD_MAGIC + b"\0" + b"\xff" * 8):
        with pytest.raises(ldcache.LdCacheError):
            ldcache.parse(data)


def test_sonames_of_real_libraries_match_readelf() -> None:
    libc = next(
        (
            p
            for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/lib/aarch64-linux-gnu/libc.so.6", "/lib64/libc.so.6")
            if os.path.isfile(p)
        ),
        None,
    )
    if libc is None:
        pytest.skip("no libc.so.6 at a known path")
    data = pathlib.Path(libc).read_bytes()
    info = elf.read_info(elf.from_bytes(data))
    assert (info.bits, info.soname) == (64, "libc.so.6")
    assert elf.read_info(elf.from_bytes(elf_shared_object("libnvidia-ml.so.1"))).soname == "libnvidia-ml.so.1"
    with pytest.raises(elf.ElfError):
        elf.read_info(elf.from_bytes(b"#!/bin/sh\n" + bytes(100)))


def test_start_up_says_once_what_is_missing_and_that_the_hook_is_absent(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    from agent.driver.startup import log_setup, set_up

    root = fake_root(tmp_path)
    (root / "usr/bin/nvidia-persistenced").unlink()
    setup = set_up(root, "/", VERSION, None)
    caplog.set_level("INFO")
    log_setup(setup)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2
    assert warnings[0].endswith(": nvidia-persistenced")
    assert "nvidia-cdi-hook not found" in warnings[1] and "ldconfig itself" in warnings[1]
    assert setup.edits["mounts"] and "hooks" not in setup.edits  # the mounts stay without the hook


def test_the_old_format_alone_is_read() -> None:
    """glibc < 2.2's layout (no ldconfig here writes it any more): offsets count from the end of the table."""
    import struct

    strings = b"libcuda.so.1\0/usr/lib64/libcuda.so.1\0"
    data = b"ld.so-1.7.0\0" + struct.pack("<I", 1) + struct.pack("<iII", 0x0303, 0, 13) + strings
    [entry] = ldcache.parse(data)
    assert (entry.name, entry.path, entry.is_64bit_elf) == ("libcuda.so.1", "/usr/lib64/libcuda.so.1", True)


def test_the_drivers_elf_binary_wins_over_a_wrapper_script_earlier_in_the_folders(tmp_path: pathlib.Path) -> None:
    # Seen on a GPU machine (H200): /usr/bin/nvidia-smi was a sandbox's shell wrapper, the driver's own binary
    # sat in /usr/local/nvidia/bin. Mounted into a container without /bin/sh, the wrapper cannot run.
    root = fake_root(tmp_path)
    driver_bin = root / "usr/local/nvidia/bin"
    driver_bin.mkdir(parents=True)
    shutil.copy("/bin/true", driver_bin / "nvidia-smi")  # an ELF executable stands in for the driver's
    files = discover(root, VERSION)
    smi = next(b for b in files.binaries if b.name == "nvidia-smi")
    assert smi.path == "usr/local/nvidia/bin/nvidia-smi"
    # with no ELF one anywhere, the first executable is still taken (the rest of the fake's are scripts)
    assert next(b for b in files.binaries if b.name == "nvidia-debugdump").path == "usr/bin/nvidia-debugdump"


def test_world_writable_files_are_named_and_names_the_hook_cannot_carry_are_left_out(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Tried: a library and a binary chmod o+w, and libraries named with '::', ',' and a newline. Before, all were
    mounted without a word, and the odd names went into `--link a::b` arguments the hook splits differently."""
    from agent.driver.startup import log_setup, set_up

    root = fake_root(tmp_path)
    files = discover(root, VERSION, kernel_release="6.1.0", firmware_class_path="")
    cuda = next(lib for lib in files.libraries if lib.name.startswith("libcuda.so"))
    (root / cuda.path).chmod(0o666)
    (root / "usr/bin/nvidia-smi").chmod(0o777)
    odd = ["libnvidia-odd::x.so", "libnvidia-odd,y.so", "libnvidia-odd\nz.so"]
    for name in odd:
        shutil.copy(root / cuda.path, root / cuda.directory / f"{name}.{VERSION}")
    setup = set_up(root, "/", VERSION, None)
    assert setup.files.world_writable == (cuda.path, "usr/bin/nvidia-smi")
    assert sorted(setup.files.left_out) == sorted(f"{cuda.directory}/{n}.{VERSION}" for n in odd)
    mounted = [m["containerPath"] for m in setup.edits["mounts"]]
    assert f"/{cuda.path}" in mounted and "/usr/bin/nvidia-smi" in mounted  # still mounted: a warning, not a refusal
    assert not any("odd" in p for p in mounted)
    caplog.set_level("INFO")
    log_setup(setup)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("writable by every user on the host" in w and cuda.path in w for w in warnings)
    assert any(
        "left out of the CDI specs" in w and "'" + f"{cuda.directory}/libnvidia-odd\\nz.so" in w for w in warnings
    )
