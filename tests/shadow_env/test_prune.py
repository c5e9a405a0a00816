"""`kvprobe shadow list` shows the disk each environment takes; `kvprobe shadow prune` removes what
is not kept — driven with stand-in engines in a temporary cache (no network, no real engine)."""

from __future__ import annotations

import os

from kvprobe.cli.main import main
from kvprobe.targets.shadow import disk, envs
from tests.shadow_env.test_envs import cache, fake_recipe  # noqa: F401  (fixtures)


def _quiet(_line: str) -> None:
    return None


def test_disk_bytes_counts_a_hard_linked_file_once(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100_000)
    one = disk.disk_bytes(tmp_path)
    os.link(tmp_path / "a", tmp_path / "b")
    assert one >= 100_000 and disk.disk_bytes(tmp_path) == one
    (tmp_path / "c").write_bytes(b"y" * 100_000)
    assert disk.disk_bytes(tmp_path) >= 2 * one - 8192


def test_prune_keeps_the_named_removes_the_rest(cache, fake_recipe, capsys):  # noqa: F811
    fake_recipe("1.2.3")
    fake_recipe("2.0.0", written="2.0.0")
    kept = envs.install("fakeengine", "1.2.3", log=_quiet)
    other = envs.install("fakeengine", "2.0.0", log=_quiet)
    partial = cache / "envs" / "fakeengine-9.9.9-0123456789abcdef"
    (partial / "lib").mkdir(parents=True)
    (partial / "lib" / "half.whl").write_bytes(b"z" * 50_000)

    assert main(["shadow", "prune", "--keep", "fakeengine==1.2.3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would remove {other.root}" in out and f"would remove {partial}" in out and str(kept.root) not in out
    assert other.root.is_dir() and partial.is_dir()  # a dry run removes nothing

    assert main(["shadow", "prune", "--keep", "fakeengine==1.2.3"]) == 0
    assert "removed 2 environment(s)" in capsys.readouterr().out
    assert kept.root.is_dir() and not other.root.exists() and not partial.exists()
    assert envs.find("fakeengine", "1.2.3") == kept


def test_an_outdated_recipes_environment_is_pruned(cache, fake_recipe):  # noqa: F811
    fake_recipe("1.2.3")
    old = envs.install("fakeengine", "1.2.3", log=_quiet)
    fake_recipe("1.2.3", revision="2")  # the recipe changed: the built folder is no longer current
    removed = disk.prune([("fakeengine", "1.2.3")])
    assert [f.path for f, _ in removed] == [old.root] and not old.root.exists()


def test_an_environment_being_installed_is_left_alone(cache, fake_recipe):  # noqa: F811
    import fcntl

    busy = cache / "envs" / "fakeengine-3.0.0-0123456789abcdef"
    busy.mkdir(parents=True)
    with open(busy.with_name(busy.name + ".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        assert disk.prune([]) == [] and busy.is_dir()
    assert [f.path for f, _ in disk.prune([])] == [busy]


def test_list_shows_each_environments_disk(cache, fake_recipe, capsys):  # noqa: F811
    fake_recipe("1.2.3")
    env = envs.install("fakeengine", "1.2.3", log=_quiet)
    (cache / "envs" / "fakeengine-0.0.1").mkdir()
    assert main(["shadow", "list"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("fakeengine==1.2.3"))
    assert "installed" in row and env.root.name in row and "B" in row.split("installed")[1]
    assert any("prune removes it" in line and "fakeengine-0.0.1" in line for line in out.splitlines())


def test_a_kept_release_kvprobe_cannot_build_is_bad_input(cache, capsys):  # noqa: F811
    assert main(["shadow", "prune", "--keep", "vllm==0.0.1"]) == 2
    assert "no pinned install list for vllm 0.0.1" in capsys.readouterr().err


def test_prune_keeps_by_default_only_what_make_test_runs():
    """The releases added for `make matrix` (vLLM 0.19.1, SGLang 0.5.21 and 0.5.22, installed by `kvprobe diff
    --install`) are not kept by default: the suite does not install them."""
    assert disk.SUITE_RELEASES == (("vllm", "0.33.0"), ("vllm", "0.18.1"), ("sglang", "0.5.23"),
                                   ("sglang-router", "0.3.2"))
