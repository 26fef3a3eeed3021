"""`render docker --out DIR` writes a build context that builds (issue 31, item 12): the
Dockerfile, compose.yaml and sm120kit's own wheel, which the Dockerfile copies and installs
(no package index serves sm120kit, and `docker build - < Dockerfile` has no context).

No docker daemon, buildah or kaniko runs here (only docker's client is installed), and the
base image could not be pulled: the Dockerfile is interpreted step by step as BuildKit's
parser reads it. FROM stands for a scratch environment built as the base image's is: a
Python environment with the real sglang release (and its flashinfer) unpacked from the
wheel cache, and sm120kit's dependencies (an sglang image carries them). COPY copies from
the context into a scratch directory that stands for the image's file system; RUN runs its
line with `sh -c` in that environment, the image's paths read under that directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import dockerfile
import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from support.paths import ROOT
from support.sites import WINDOW, install
from support.tree import tree_snapshot

from sm120kit import __version__
from sm120kit.profiles.loader import load_profile

IMAGE = "registry.example/sglang:v0.5.23"
RELEASE = WINDOW[-1]
WHEEL = f"sm120kit-{__version__}-py3-none-any.whl"


@pytest.fixture(autouse=True)
def no_user_paths(monkeypatch):
    monkeypatch.delenv("SM120KIT_PROFILE_PATH", raising=False)
    monkeypatch.delenv("SM120KIT_PATCH_PATH", raising=False)


def base_image(tmp_path: Path) -> tuple[Path, Path]:
    """(the environment's directory, its site-packages): what FROM stands for."""
    env = tmp_path / "image-python"
    subprocess.run([sys.executable, "-m", "venv", env], check=True)
    python = env / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([python, "-c", purelib], capture_output=True, text=True, check=True).stdout.strip())
    install(site, RELEASE)
    # sm120kit's dependencies at the releases this interpreter has (pip's cache has them):
    # an sglang image carries them, so the Dockerfile's own pip install fetches only the wheel.
    needed = [Requirement(r) for r in metadata.requires("sm120kit") or []]
    pins = [f"{r.name}=={metadata.version(r.name)}" for r in needed if not r.marker or r.marker.evaluate()]
    seeded = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *pins],
        capture_output=True,
        text=True,
    )  # (pip notes that the unpacked sglang lacks its own dependencies: it is read, never run)
    assert seeded.returncode == 0, seeded.stderr
    return env, site


def build(context: Path, image_root: Path, env: Path) -> list[str]:
    """docker build CONTEXT, interpreted: each instruction as it is read, in order."""
    shell = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}  # the image has none
    shell.update(PATH=f"{env / 'bin'}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(env))
    copied: dict[str, str] = {}
    ran = []
    for step in dockerfile.parse_file(str(context / "Dockerfile")):
        assert not step.flags, step.original
        if step.cmd == "FROM":
            assert step.value == (IMAGE,)
        elif step.cmd == "COPY":
            *sources, dest = step.value
            assert dest.startswith("/") and dest.endswith("/"), "into a directory of the image"
            here = image_root / dest.lstrip("/")
            here.mkdir(parents=True, exist_ok=True)
            for source in sources:
                assert (context / source).is_file(), f"COPY {source}: not in the context"
                shutil.copy2(context / source, here / Path(source).name)
            copied[dest] = f"{here}/"
        elif step.cmd == "RUN":
            line = step.value[0]
            for inside, here in copied.items():
                line = line.replace(inside, here)
            done = subprocess.run(["sh", "-c", line], env=shell, cwd=image_root, capture_output=True, text=True)
            assert done.returncode == 0, f"RUN {step.value[0]}\n{done.stdout}\n{done.stderr}"
            ran.append(step.value[0])
        else:
            pytest.fail(f"{step.cmd}: an instruction this interpreter does not know")
    return ran


@pytest.mark.slow
def test_the_rendered_context_builds_and_proves_the_patches(cli, tmp_path):
    """HEAD: `pip install sm120kit==0.1.0` (no index serves it) and no context to copy a
    wheel from (render has no --out)."""
    env, site = base_image(tmp_path)
    context = tmp_path / "context"
    code, out, err = cli("render", "docker", "glm5-nvfp4", "--image", IMAGE, "--site", site, "--out", context)
    assert code == 0, err
    wheel = WHEEL
    assert sorted(p.name for p in context.iterdir()) == ["Dockerfile", "compose.yaml", wheel]
    assert str(context) in out and "docker compose up -d --build" in out
    compose = yaml.safe_load((context / "compose.yaml").read_text())
    [service] = compose["services"].values()
    assert service["build"]["context"] == "."  # the compose file's own directory: the context
    assert service["build"]["dockerfile_inline"] == (context / "Dockerfile").read_text().replace("$", "$$")

    ran = build(context, tmp_path / "image-root", env)
    assert ran[0].startswith("pip install") and ran[0].endswith(f"/{wheel}")
    assert ran[1].startswith("sm120kit patch --verify")

    # the image's sm120kit is the wheel's, installed in the image's environment
    where = subprocess.run(
        [env / "bin" / "python", "-c", "import sm120kit; print(sm120kit.__file__)"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        cwd=tmp_path,  # not the checkout: its sm120kit/ is no part of the image
        check=True,
    ).stdout
    assert Path(where.strip()).is_relative_to(site)
    # the build left its ledger in the image's site: the container's own patch step proves it, changing nothing
    before = tree_snapshot(site)
    only = [w for p in load_profile("glm5-nvfp4").patches for w in ("--only", p)]
    code, out, err = cli("patch", "--verify", "--site", site, *only)
    assert code == 0, out + err
    assert tree_snapshot(site) == before


@pytest.mark.slow
def test_the_wheel_is_built_once_from_the_kits_source(cli, tmp_path, monkeypatch):
    """The kit runs from its checkout here (an editable install): its wheel is built with
    `pip wheel --no-deps` and cached by the digest of its sources; a second render builds nothing."""
    from sm120kit.deploy import own_wheel

    argv = ["render", "docker", "glm5-nvfp4", "--image", IMAGE]
    assert cli(*argv, "--out", tmp_path / "one")[0] == 0
    built = tmp_path / "one" / WHEEL
    import zipfile

    names = zipfile.ZipFile(built).namelist()
    assert "sm120kit/_shipped/profiles/glm5-nvfp4.toml" in names and "sm120kit/deploy/docker.py" in names

    def no_build(*args, **kwargs):
        raise AssertionError(f"built again: {args}")

    monkeypatch.setattr(own_wheel.subprocess, "run", no_build)
    assert cli(*argv, "--out", tmp_path / "two")[0] == 0
    assert (tmp_path / "two" / built.name).read_bytes() == built.read_bytes()
    assert cli(*argv, "--out", tmp_path / "one")[0] == 0  # an earlier --out is written again


def test_the_digest_covers_what_the_wheel_is_built_from():
    """own_wheel.WHEEL_SOURCES names what pyproject.toml's wheel target takes."""
    from sm120kit.deploy import own_wheel

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wheel = project["tool"]["hatch"]["build"]["targets"]["wheel"]
    taken = {*wheel["packages"], *wheel["force-include"], "pyproject.toml", project["project"]["readme"]}
    assert taken | {"LICENSE"} == set(own_wheel.WHEEL_SOURCES)


@pytest.mark.parametrize(
    ("make", "extra", "said"),
    [
        (lambda d: (d.mkdir(), (d / "notes.txt").write_text("mine\n")), [], "holds notes.txt"),
        (lambda d: d.write_text("a file\n"), [], "not a directory"),
        (lambda d: None, ["--dockerfile"], "not both"),
    ],
)
def test_a_bad_out_is_one_line_exit_2_and_writes_nothing(cli, tmp_path, make, extra, said, monkeypatch):
    out = tmp_path / "context"
    make(out)
    before = (sorted(tmp_path.rglob("*")), tree_snapshot(tmp_path))

    def no_build(*args, **kwargs):
        raise AssertionError("the wheel is not built for bad input")

    monkeypatch.setattr("sm120kit.deploy.own_wheel.own_wheel", no_build, raising=False)
    code, stdout, err = cli("render", "docker", "glm5-nvfp4", "--image", IMAGE, "--out", out, *extra)
    assert (code, stdout) == (2, "") and said in err and "Traceback" not in err
    assert "next:" in err
    assert (sorted(tmp_path.rglob("*")), tree_snapshot(tmp_path)) == before


def test_out_is_for_docker_alone(cli, tmp_path):
    code, out, err = cli("render", "systemd", "glm5-nvfp4", "--out", tmp_path / "x")
    assert (code, out) == (2, "") and "--out" in err and not (tmp_path / "x").exists()


class Installed:
    """A distribution's metadata as importlib reads it: its PEP 610 direct_url.json."""

    def __init__(self, direct_url: dict | None) -> None:
        self.direct_url = direct_url

    def read_text(self, name: str) -> str | None:
        assert name == "direct_url.json"
        return None if self.direct_url is None else json.dumps(self.direct_url)


def test_the_wheel_it_was_installed_from_is_copied_and_an_index_install_is_refused(tmp_path, monkeypatch):
    from sm120kit.deploy import own_wheel
    from sm120kit.errors import UserError

    wheel = tmp_path / WHEEL
    wheel.write_bytes(b"PK\x05\x06" + bytes(18))
    monkeypatch.setattr(own_wheel.metadata, "distribution", lambda name: Installed({"url": wheel.as_uri()}))
    assert own_wheel.own_wheel() == wheel
    monkeypatch.setattr(own_wheel.metadata, "distribution", lambda name: Installed(None))  # from an index
    with pytest.raises(UserError, match="package index") as raised:
        own_wheel.own_wheel()
    assert "pip install -e CHECKOUT" in str(raised.value)
    gone = {"url": (tmp_path / "gone.whl").as_uri(), "archive_info": {}}
    monkeypatch.setattr(own_wheel.metadata, "distribution", lambda name: Installed(gone))
    with pytest.raises(UserError, match=r"gone\.whl"):
        own_wheel.own_wheel()
