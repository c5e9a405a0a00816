"""Environments share identical files by hard links (`kvprobe shadow share`, an install's last step) —
driven with small hand-made environments in a temporary cache (no network, no engine)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

from kvprobe.cli.main import main
from kvprobe.targets.shadow import disk, envs, share
from tests.shadow_env.test_envs import cache  # noqa: F401  (fixture)

SITE = "lib/python3.11/site-packages"
BIG = b"\x7fELF" + bytes(range(256)) * 400  # ~100 kB, a shared library's stand-in


def _dist(site, name: str, files: dict[str, bytes], installer: str) -> None:
    """A distribution under `site`: its files, INSTALLER, and a RECORD naming them (as pip writes it)."""
    info = f"{name}-1.0.dist-info"
    for rel, data in {**files, f"{info}/INSTALLER": f"{installer}\n".encode()}.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    rows = [*files, f"{info}/INSTALLER", f"{info}/RECORD", "../../../bin/tool"]
    (site / info / "RECORD").write_text("".join(f"{r},,\n" for r in rows))


def _env(cache, name: str, *, digest: str = "0123456789abcdef", differs: bytes = b"a" * 5000, **extra):  # noqa: F811
    """A complete environment as the share sees it: bin/python, a marker naming the folder's digest,
    pip-installed files (one identical in every env, one whose bytes differ, one .py), a plugin that
    kvprobe wrote, and the venv's own files."""
    root = cache / "envs" / f"{name}-{digest}"
    site = root / SITE
    site.mkdir(parents=True)
    _dist(site, "torch", {"torch/lib/libtorch.so": BIG, "torch/version.txt": differs,
                          "torch/nn.py": b"x = 1\n" * 300, **extra}, "pip")
    _dist(site, "kvprobe_shadow", {"kvprobe_plugin_data.txt": b"p" * 5000}, "kvprobe")
    (root / "bin").mkdir()
    (root / "bin" / "python").write_bytes(b"#!" + b"p" * 5000)
    (root / "pyvenv.cfg").write_bytes(b"home = /usr\n" * 400)
    (root / envs.MARKER).write_text(json.dumps({"engine": name, "version": "1", "digest": digest}))
    return root


def _ino(root, rel):
    return os.stat(root / rel).st_ino


def test_only_identical_pip_files_are_linked_and_a_second_run_does_nothing(cache):  # noqa: F811
    a = _env(cache, "eng-1")
    b = _env(cache, "eng-2", differs=b"b" * 5000)
    c = _env(cache, "eng-3")
    before = disk.disk_bytes(cache / "envs")
    done = dict(disk.share_all(log=lambda _: None))
    lib = f"{SITE}/torch/lib/libtorch.so"
    assert _ino(a, lib) == _ino(b, lib) == _ino(c, lib) and os.stat(a / lib).st_nlink == 3
    assert (b / lib).read_bytes() == BIG
    # same size, other bytes: each keeps its own; a and c hold the same bytes and are linked
    version = f"{SITE}/torch/version.txt"
    assert _ino(a, version) == _ino(c, version) != _ino(b, version) and (b / version).read_bytes() == b"b" * 5000
    # never linked: sources, what kvprobe wrote, the venv's bin/ and pyvenv.cfg, the marker, dist-info INSTALLER
    # of a kvprobe distribution
    for rel in [f"{SITE}/torch/nn.py", f"{SITE}/kvprobe_plugin_data.txt", "bin/python", "pyvenv.cfg", envs.MARKER,
                f"{SITE}/kvprobe_shadow-1.0.dist-info/RECORD"]:
        assert len({_ino(a, rel), _ino(b, rel), _ino(c, rel)}) == 3, rel
    assert sum(s.files for s in done.values()) > 0
    assert before - disk.disk_bytes(cache / "envs") >= 2 * len(BIG)
    # a second run links nothing and moves no file
    inodes = {p: p.stat().st_ino for p in (cache / "envs").rglob("*") if p.is_file()}
    assert all(s.files == 0 for _, s in disk.share_all(log=lambda _: None))
    assert inodes == {p: p.stat().st_ino for p in (cache / "envs").rglob("*") if p.is_file()}


def test_a_file_whose_mode_differs_stays_apart(cache):  # noqa: F811
    a, b = _env(cache, "eng-1"), _env(cache, "eng-2")
    lib = f"{SITE}/torch/lib/libtorch.so"
    os.chmod(b / lib, 0o755)
    disk.share_all(log=lambda _: None)
    assert _ino(a, lib) != _ino(b, lib) and os.stat(b / lib).st_mode & 0o777 == 0o755


def test_an_environment_whose_lock_is_held_is_neither_linked_nor_linked_to(cache):  # noqa: F811
    a, b = _env(cache, "eng-1"), _env(cache, "eng-2")
    lib = f"{SITE}/torch/lib/libtorch.so"
    with open(b.with_name(b.name + ".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        disk.share_all(log=lambda _: None)
        assert _ino(a, lib) != _ino(b, lib)
    disk.share_all(log=lambda _: None)
    assert _ino(a, lib) == _ino(b, lib)


def test_an_unfinished_install_is_left_alone(cache):  # noqa: F811
    a, b = _env(cache, "eng-1"), _env(cache, "eng-2")
    (b / envs.MARKER).unlink()  # the marker is written last: no marker, no complete install
    disk.share_all(log=lambda _: None)
    lib = f"{SITE}/torch/lib/libtorch.so"
    assert _ino(a, lib) != _ino(b, lib)


def test_replacing_a_linked_file_in_one_environment_leaves_the_others(cache):  # noqa: F811
    """pip writes a new file after unlinking the old one (wheel.py save()), and uninstalls by moving
    files to a stash it deletes: neither reaches the other environment's name for the file."""
    a, b = _env(cache, "eng-1"), _env(cache, "eng-2")
    disk.share_all(log=lambda _: None)
    lib, version = a / SITE / "torch/lib/libtorch.so", a / SITE / "torch/version.txt"
    assert _ino(a, lib.relative_to(a)) == _ino(b, lib.relative_to(a))
    lib.unlink()
    lib.write_bytes(b"an upgraded torch")
    os.rename(version, a / "stash")  # an uninstall's stash
    (a / "stash").unlink()
    assert (b / SITE / "torch/lib/libtorch.so").read_bytes() == BIG
    assert (b / SITE / "torch/version.txt").read_bytes() == b"a" * 5000


def test_on_another_filesystem_nothing_is_linked(cache, monkeypatch):  # noqa: F811
    a, b = _env(cache, "eng-1"), _env(cache, "eng-2")

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(share.os, "link", cross_device)
    done = disk.share_all(log=lambda _: None)
    lib = f"{SITE}/torch/lib/libtorch.so"
    assert _ino(a, lib) != _ino(b, lib) and (a / lib).read_bytes() == BIG
    assert all(s.files == 0 and s.cross_device == 1 for _, s in done)
    assert not list((a / SITE / "torch/lib").glob(".*"))  # no temporary name left behind


def test_a_file_changed_after_it_was_hashed_is_not_replaced(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.write_bytes(BIG)
    two.write_bytes(BIG)
    old = os.lstat(two)
    two.unlink()
    two.write_bytes(b"y" * len(BIG))  # replaced between the hash and the link
    assert not share._replace(one, os.lstat(one), two, old)
    assert one.read_bytes() == BIG and os.stat(one).st_nlink == 1 and sorted(tmp_path.iterdir()) == [one, two]


def test_pip_files_are_what_pip_recorded_but_sources(tmp_path):
    _dist(tmp_path, "torch", {"torch/a.so": b"1", "torch/b.py": b"2", "torch/__pycache__/b.cpython-311.pyc": b"3"},
          "pip")
    _dist(tmp_path, "plugin", {"plugin.txt": b"4"}, "kvprobe")
    (tmp_path / "stray.txt").write_bytes(b"5")
    assert share.pip_files(tmp_path) == ["torch-1.0.dist-info/INSTALLER", "torch-1.0.dist-info/RECORD", "torch/a.so"]


SOURCE = b"def where():\n    return where.__code__.co_filename\n" + b"# padding\n" * 200
PYC = "torch/__pycache__/hub.cpython-311.pyc"


def _env_with_source(cache, name: str, *, mtime: int) -> Path:  # noqa: F811
    """An environment whose torch ships hub.py and the bytecode pip compiled from it (holding this
    environment's path and the source's mtime), both in torch's RECORD."""
    root = _env(cache, name, **{"torch/hub.py": SOURCE})
    site = root / SITE
    os.utime(site / "torch/hub.py", (mtime, mtime))
    py_compile.compile(str(site / "torch/hub.py"), cfile=str(site / PYC), doraise=True)
    record = site / "torch-1.0.dist-info/RECORD"
    record.write_text(record.read_text() + f"{PYC},,\n")
    return root


def _import_where(root: Path) -> subprocess.CompletedProcess:
    """Import torch.hub from `root`'s site-packages as the engine would (no bytecode written), verbose."""
    code = "import torch.hub as h; print(h.where())"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(root / SITE)}
    return subprocess.run([sys.executable, "-v", "-c", code], capture_output=True, text=True, env=env, timeout=60)


def test_a_source_and_its_bytecode_are_linked_together_and_load_as_this_environments(cache):  # noqa: F811
    a = _env_with_source(cache, "eng-1", mtime=1_700_000_000)
    b = _env_with_source(cache, "eng-2", mtime=1_700_000_999)
    assert (a / SITE / PYC).read_bytes() != (b / SITE / PYC).read_bytes()  # each holds its own path and mtime
    disk.share_all(log=lambda _: None)
    for rel in (f"{SITE}/torch/hub.py", f"{SITE}/{PYC}"):
        assert _ino(a, rel) == _ino(b, rel), rel
    for root in (a, b):
        run = _import_where(root)
        assert run.returncode == 0, run.stderr[-2000:]
        # read from the shared bytecode (not compiled again), and naming this environment's source
        assert f"code object from '{root / SITE / PYC}'" in run.stderr, run.stderr[-2000:]
        assert run.stdout.strip() == str(root / SITE / "torch/hub.py")


def test_a_bytecode_stale_for_its_own_source_is_not_linked_nor_its_source(cache):  # noqa: F811
    a = _env_with_source(cache, "eng-1", mtime=1_700_000_000)
    b = _env_with_source(cache, "eng-2", mtime=1_700_000_999)
    for root in (a, b):  # each source touched after pip compiled it: no bytecode fits its source
        os.utime(root / SITE / "torch/hub.py", (1_800_000_000, 1_800_000_000))
    disk.share_all(log=lambda _: None)
    for rel in (f"{SITE}/torch/hub.py", f"{SITE}/{PYC}"):
        assert _ino(a, rel) != _ino(b, rel), rel
    assert not share.bytecode_fits(a / SITE / PYC, os.stat(a / SITE / "torch/hub.py"))


def test_source_pairs_are_the_recorded_sources_with_recorded_bytecode(tmp_path):
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    _dist(site, "torch", {"torch/b.py": b"2", "torch/__pycache__/b.cpython-311.pyc": b"3", "torch/c.py": b"4",
                          "torch/__pycache__/d.cpython-310.pyc": b"5", "torch/d.py": b"6"}, "pip")
    assert share.source_pairs(site) == [("torch/b.py", "torch/__pycache__/b.cpython-311.pyc")]


def _install_pip_dist(env: envs.EngineEnv) -> None:
    pkg = env.site_packages / "fakeengine"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {env.version!r}\n")
    _dist(env.site_packages, "fakeengine_data", {"fakeengine_data/lib.so": BIG}, "pip")


def test_an_install_links_itself_last_and_list_shows_shared_bytes(cache, monkeypatch, capsys):  # noqa: F811
    for version in ("1.2.3", "2.0.0"):
        monkeypatch.setitem(envs.RECIPES, ("fakeengine", version), envs.Recipe(
            engine="fakeengine", version=version, module="fakeengine",
            steps=(envs.Call("write fakeengine", _install_pip_dist, "1"),)))
    first = envs.install("fakeengine", "1.2.3", log=lambda _: None)
    lines: list[str] = []
    second = envs.install("fakeengine", "2.0.0", log=lines.append)
    assert any("files are now links to identical ones in other environments" in ln for ln in lines), lines
    lib = "fakeengine_data/lib.so"
    assert os.stat(first.site_packages / lib).st_ino == os.stat(second.site_packages / lib).st_ino
    assert json.loads((second.root / envs.MARKER).read_text())["digest"] == envs.recipe("fakeengine", "2.0.0").digest

    assert main(["shadow", "list"]) == 0
    out = capsys.readouterr().out
    for version in ("1.2.3", "2.0.0"):
        row = next(ln for ln in out.splitlines() if ln.startswith(f"fakeengine=={version}"))
        own, shared = row.split("installed")[1].split()[0:4:2]
        assert shared != "0" and own != "0", row
    assert "on disk, each file once:" in out
