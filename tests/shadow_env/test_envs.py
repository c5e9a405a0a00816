"""Engine environments: recipes, markers, errors — driven with a stand-in engine (no network)."""

from __future__ import annotations

import json

import pytest

from kvprobe.errors import ConfigError
from kvprobe.releases import DEFAULT_VERSIONS, version_tuple
from kvprobe.targets.shadow import envs
from kvprobe.targets.shadow.sglang import env as sglang_env
from kvprobe.targets.shadow.vllm import env as vllm_env


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(envs.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _write_engine(version: str, *, broken: bool = False):
    def write(env: envs.EngineEnv) -> None:
        pkg = env.site_packages / "fakeengine"
        pkg.mkdir(parents=True)
        body = "raise ImportError('needs libcuda.so.1')\n" if broken else f"__version__ = {version!r}\n"
        (pkg / "__init__.py").write_text(body)
    return write


@pytest.fixture
def fake_recipe(monkeypatch):
    def make(version="1.2.3", *, written="1.2.3", broken=False, revision="1"):
        rec = envs.Recipe(engine="fakeengine", version=version, module="fakeengine",
                          steps=(envs.Call("write fakeengine", _write_engine(written, broken=broken), revision),))
        monkeypatch.setitem(envs.RECIPES, ("fakeengine", version), rec)
        return rec
    return make


def test_install_writes_marker_last_and_is_found(cache, fake_recipe):
    rec = fake_recipe()
    assert envs.find("fakeengine", "1.2.3") is None
    lines = []
    env = envs.install("fakeengine", "1.2.3", log=lines.append)
    mark = json.loads((env.root / envs.MARKER).read_text())
    assert mark["digest"] == rec.digest and mark["engine_version"] == "1.2.3"
    assert env.root.is_relative_to(cache)
    assert envs.find("fakeengine", "1.2.3") == env
    assert any("[1/1] write fakeengine" in ln for ln in lines)
    # a second install is a no-op that says so
    lines.clear()
    envs.ensure("fakeengine", "1.2.3", log=lines.append)
    assert lines == [] and envs.find("fakeengine", "1.2.3") == env


def test_changed_recipe_makes_the_env_outdated(cache, fake_recipe):
    fake_recipe()
    envs.install("fakeengine", "1.2.3", log=lambda _: None)
    fake_recipe(revision="2")
    assert envs.find("fakeengine", "1.2.3") is None
    with pytest.raises(envs.EnvError, match=r"out of date .*kvprobe shadow install fakeengine==1\.2\.3"):
        envs.require("fakeengine", "1.2.3")
    envs.install("fakeengine", "1.2.3", log=lambda _: None)  # rebuilt from scratch
    assert envs.find("fakeengine", "1.2.3") is not None


def test_missing_env_names_the_command(cache, fake_recipe):
    fake_recipe()
    with pytest.raises(envs.EnvError, match=r"not installed .*run `kvprobe shadow install fakeengine==1\.2\.3`"):
        envs.require("fakeengine", "1.2.3")


def test_engine_that_does_not_import_leaves_no_marker(cache, fake_recipe):
    fake_recipe(broken=True)
    with pytest.raises(envs.EnvError, match="fakeengine does not import .*needs libcuda.so.1"):
        envs.install("fakeengine", "1.2.3", log=lambda _: None)
    assert not (envs.env_for("fakeengine", "1.2.3").root / envs.MARKER).exists()


def test_wrong_engine_version_is_refused(cache, fake_recipe):
    fake_recipe(written="1.2.4")
    with pytest.raises(envs.EnvError, match="holds fakeengine 1.2.4, expected 1.2.3"):
        envs.install("fakeengine", "1.2.3", log=lambda _: None)


def test_unknown_version_lists_known_ones():
    with pytest.raises(ConfigError, match=r"no pinned install list for vllm 9\.9\.9: .*vllm==0\.33\.0"):
        envs.recipe("vllm", "9.9.9")


@pytest.mark.parametrize(("spec", "expected"), [("vllm==0.33.0", ("vllm", "0.33.0")),
                                                 ("vllm==0.18.1", ("vllm", "0.18.1")), ("VLLM", ("vllm", "0.33.0"))])
def test_parse_spec(spec, expected):
    assert envs.parse_spec(spec) == expected


def test_parse_spec_unknown_engine():
    with pytest.raises(ConfigError, match="unknown engine 'tgi'"):
        envs.parse_spec("tgi==1.0")


def test_console_install_of_unknown_version_creates_nothing(cache, capsys):
    from kvprobe.cli.main import main

    assert main(["shadow", "install", "vllm==9.9.9"]) == 2
    assert "no pinned install list for vllm 9.9.9" in capsys.readouterr().err
    assert not (cache / "envs").exists()


def test_a_new_recipe_builds_beside_the_old_and_prunes_it(cache, fake_recipe):
    fake_recipe()
    old = envs.install("fakeengine", "1.2.3", log=lambda _: None)
    fake_recipe(revision="2")
    new = envs.env_for("fakeengine", "1.2.3")
    assert new.root != old.root and old.root.exists()  # the old one serves whoever runs it meanwhile
    lines = []
    envs.install("fakeengine", "1.2.3", log=lines.append)
    assert envs.find("fakeengine", "1.2.3") == new
    assert not old.root.exists()
    assert any(f"older recipe at {old.root}" in ln for ln in lines)


def _venv(root):
    import venv

    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    return envs.EngineEnv("vllm", "0.0.0", root)


@pytest.mark.parametrize("module", [vllm_env, sglang_env])
def test_a_plugin_distribution_replaces_the_old_and_its_entry_point_is_seen(tmp_path, module):
    """The SGLang plugin's and vLLM 0.18.1's CPU-platform entry points, written into a bare venv: an older
    version's dist-info goes, the entry point is visible from the env's python (the check is the recipe's
    own, minus importing the engine)."""
    env = _venv(tmp_path / "env")
    stale = env.site_packages / f"{module.DIST_NAME}-0.0.1.dist-info"
    stale.mkdir(parents=True)
    (stale / "METADATA").write_text("Name: x\n")
    files = module.files("9.9")
    check = ("from importlib.metadata import entry_points\n"
             f"eps = [ep.value for ep in entry_points(group={module.PLUGIN_GROUP!r})]\n"
             f"assert eps == [{module.PLUGIN_TARGET!r}], eps\n")
    envs.write_distribution(env, module.DIST_NAME, files, check=check, what="entry point not seen")
    assert not stale.exists()
    with pytest.raises(envs.EnvError, match="entry point not seen in .*: AssertionError"):
        envs.write_distribution(env, module.DIST_NAME, files, check="assert False", what="entry point not seen")


# vLLM releases with a recipe in `kvprobe.targets.shadow.vllm.env` (no install): the pins each wheel's
# METADATA sets that its list follows (`pip download vllm==X --no-deps`, vllm-X.dist-info/METADATA:
# compressed-tensors is the one `==` pin among what the shadow imports that moves between them).
VLLM_WHEEL_PINS = {"0.18.1": {"compressed-tensors": "0.13.0"}, "0.19.1": {"compressed-tensors": "0.15.0.1"},
                   **{v: {"compressed-tensors": "0.15.0.1"} for v in ("0.20.2", "0.21.0", "0.22.1")},
                   **{v: {"compressed-tensors": "0.17.0"} for v in ("0.23.0", "0.24.0", "0.25.1")}}


def _vllm_pins(version: str) -> dict[str, str]:
    return envs.pinned(f"vllm-{version}.txt")


RELEASE_RECIPES = [*(pytest.param("vllm", v, vllm_env.RECIPES, id=f"vllm-{v}") for v in sorted(vllm_env.RELEASES)),
                   *(pytest.param("sglang", v, sglang_env.RECIPES, id=f"sglang-{v}")
                     for v in sorted(sglang_env.TORCH_NOTES))]


@pytest.mark.parametrize(("engine", "version", "registered"), RELEASE_RECIPES)
def test_each_release_has_its_recipe_and_pins_its_engine_and_a_cpu_torch(engine, version, registered):
    rec = envs.recipe(engine, version)
    assert rec is registered[version] and rec.module == engine
    assert rec.steps[0] == envs.Pip(pins=f"{engine}-{version}.txt")
    pins = envs.pinned(f"{engine}-{version}.txt")
    assert pins[engine] == version
    assert pins["torch"] == "2.13.0", "the CPU build of torch (a CUDA one pulls ~2.2 GB of nvidia wheels)"


@pytest.mark.parametrize("version", sorted(VLLM_WHEEL_PINS))
def test_each_vllm_release_pins_what_its_wheel_does(version):
    pins = _vllm_pins(version)
    assert {name: pins[name] for name in VLLM_WHEEL_PINS[version]} == VLLM_WHEEL_PINS[version]


def test_pin_lists_are_read_strictly(monkeypatch):
    monkeypatch.setattr(envs, "pins_text", lambda name: "# a list\nfoo_bar==1.0\nFoo.Bar==2.0\n")
    with pytest.raises(ValueError, match="line 3: Foo.Bar pinned twice"):
        envs.pinned("x.txt")
    monkeypatch.setattr(envs, "pins_text", lambda name: "foo>=1.0\n")
    with pytest.raises(ValueError, match="line 1: expected NAME==VERSION"):
        envs.pinned("x.txt")


def test_the_vllm_releases_share_the_plugin_step_and_build_apart(tmp_path, monkeypatch):
    monkeypatch.setenv(envs.CACHE_ENV, str(tmp_path))
    old, new = vllm_env.RECIPES["0.18.1"], vllm_env.RECIPES["0.19.1"]
    assert old.steps[1] == new.steps[1] and old.extra_checks == new.extra_checks  # one recipe, data apart
    assert old.digest != new.digest
    recipes = vllm_env.RECIPES.values()  # 0.18.1-0.27.1: the same plugin step; all: the same checks, one build each
    assert {r.steps[1] for r in recipes if len(r.steps) > 1} == {old.steps[1]}
    assert {r.extra_checks for r in recipes} == {old.extra_checks}
    assert len({r.digest for r in recipes}) == len(vllm_env.RELEASES)
    assert envs.env_for("vllm", "0.19.1").root.name.startswith("vllm-0.19.1-")
    assert {"0.18.1", "0.19.1", "0.33.0"} <= set(envs.known_versions("vllm"))
    # an engine alone is the default release (releases.py), not the newest recipe (0.34.0 has one)
    assert max(envs.known_versions("vllm"), key=version_tuple) == "0.34.0"
    assert envs.parse_spec("vllm") == ("vllm", DEFAULT_VERSIONS["vllm"]) == ("vllm", "0.33.0")


def test_vllm_0_19_1_pins_differ_from_0_18_1_only_where_its_wheel_does():
    old, new = _vllm_pins("0.18.1"), _vllm_pins("0.19.1")
    assert old.keys() == new.keys()
    assert {name for name in old if old[name] != new[name]} == {"vllm", "compressed-tensors"}


# 0.26.0-0.32.0: 0.33.0's list but the pins each wheel's METADATA moves (the pin file's header names the lines)
VLLM_FROM_0_33 = {
    "0.26.0": {"apache-tvm-ffi": "0.1.10", "openai-harmony": "0.0.8", "xgrammar": "0.2.7"},
    "0.27.1": {"openai-harmony": "0.0.8"},
    "0.28.0": {"openai-harmony": "0.0.8"},
    "0.29.0": {"openai-harmony": "0.0.8"},
    "0.30.0": {"openai-harmony": "0.0.8"},
    "0.31.0": {"transformers": "5.17.0", "huggingface-hub": "1.33.0", "xgrammar": "0.2.7", "httpx": "0.29.0",
               "httpcore": "1.0.9"},
    "0.32.0": {"transformers": "5.19.0"},
}


@pytest.mark.parametrize("version", sorted(VLLM_FROM_0_33))
def test_vllm_0_26_to_0_32_pins_differ_from_0_33_only_where_their_wheels_do(version):
    base, pins = _vllm_pins("0.33.0"), _vllm_pins(version)
    moved = {name: v for name, v in pins.items() if base.get(name) != v and name != "vllm"}
    assert moved == VLLM_FROM_0_33[version]
    # openai-harmony takes oss-harmony's place up to 0.30.0 (entrypoints/chat_utils.py imports it)
    assert set(base) - set(pins) == ({"oss-harmony"} if "openai-harmony" in pins else set())


def test_only_releases_before_0_28_get_the_cpu_platform_plugin():
    """0.28.0's platforms/__init__.py picks the CPU platform for VLLM_TARGET_DEVICE=cpu (env.py)."""
    with_plugin = {v for v, rec in vllm_env.RECIPES.items() if len(rec.steps) == 2}
    assert with_plugin == {v for v in vllm_env.RELEASES if vllm_env.version_tuple(v) < (0, 28)}
    assert {"0.18.1", "0.27.1"} <= with_plugin and not with_plugin & {"0.28.0", "0.32.0"}
    assert all(rec.steps[1] == vllm_env.RECIPES["0.18.1"].steps[1] for v, rec in vllm_env.RECIPES.items()
               if v in with_plugin)
