#!/usr/bin/env python3
"""Build the environments in which sglang's own argument resolution runs without a GPU
(sm120kit/resolution/probe.py presents the node): each release's pure-Python import chain
beside an interpreter that has torch (the PyPI wheel; it imports on a CPU).

    python scripts/resolution_envs.py --python /path/torchenv/bin/python --dir DIR [RELEASE ...]

DIR/common holds the packages every release imports at the same version; DIR/<release>
holds sglang==<release> and what it pins (transformers and its tokenizers above all: a
release imports only with its own), each `pip install --no-deps --target`, never torch, CUDA
or a compiled GPU package. sglang's resolution looks for flashinfer (importlib.util.find_spec
decides the default attention backend) and imports names from it without calling them, so
DIR/<release> also holds an inert stand-in for flashinfer at the version the release pins
(sgl_kernel is the probe's own stand-in). Each release is rebuilt from scratch, DIR/common
when its pins change. With no RELEASE, every release below. Prints, per release:

    <release> PYTHONPATH=DIR/<release>:DIR/common

to run the probe under (with HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parent.parent / "sm120kit" / "resolution" / "probe.py"

# Every release imports these at one version (pure Python, or CPU-only wheels).
COMMON = """
aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-types==0.8.0 anyio==4.16.0
attrs==26.1.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 click==8.5.1
compressed-tensors==0.18.0 dill==0.4.1 distro==1.9.0 einops==0.8.2 frozenlist==1.8.0 gguf==0.19.0
h11==0.16.0 hf-xet==1.8.0 httpcore==1.0.9 httpx==0.29.0 huggingface-hub==1.33.0 idna==3.21
ipython==9.19.1 jiter==0.19.0 loguru==0.7.3 markdown-it-py==4.3.0 mdurl==0.1.2 msgspec==0.23.0
multidict==7.2.1 numpy==2.4.6 orjson==3.13.0 packaging==26.4 partial-json-parser==0.2.1.1.post7
pillow==13.0.0 propcache==0.5.4 psutil==7.2.2 pybase64==1.5.1 pydantic==2.14.4
pydantic-core==2.50.5 pygments==2.21.0 pyyaml==6.0.4 pyzmq==27.3.0 regex==2026.12.2
requests==2.34.2 rich==15.0.0 safetensors==0.8.0 sentencepiece==0.2.1 setproctitle==1.3.8
shellingham==1.5.4 sniffio==1.3.1 starlette==1.10.0 torchvision==0.26.0 tqdm==4.70.1
traitlets==5.16.1 typer==0.29.2 typing-extensions==4.16.0 typing-inspection==0.4.5 urllib3==2.8.0
uvloop==0.23.0 yarl==1.25.1
""".split()  # noqa: SIM905 (torchvision 0.26.0 is torch 2.11's: match the interpreter's torch)

# What each release pins in its METADATA, of what its resolution imports. 0.5.9's
# transformers 4.57 needs huggingface-hub < 1; xgrammar is imported at server_args import
# from 0.5.16 to 0.5.20 only.
_TF53 = ["transformers==5.3.0", "tokenizers==0.22.2", "openai==2.6.1", "apache-tvm-ffi==0.1.11"]
_TF56 = ["transformers==5.6.0", "tokenizers==0.22.2", "openai==2.6.1", "apache-tvm-ffi==0.1.9"]
_TF58 = ["transformers==5.8.1", "tokenizers==0.22.2", "openai==2.6.1", "apache-tvm-ffi==0.1.9"]
_TF512 = ["transformers==5.12.1", "tokenizers==0.22.2", "openai==2.6.1", "apache-tvm-ffi==0.1.11"]
_TF519 = ["transformers==5.19.0", "tokenizers==0.23.2", "apache-tvm-ffi==0.1.11"]
RELEASES = {  # release: (its packages, the flashinfer-python it pins)
    "0.5.9": (
        [
            "transformers==4.57.1",
            "tokenizers==0.22.2",
            "huggingface-hub==0.36.2",
            "openai==2.6.1",
            "apache-tvm-ffi==0.1.11",
        ],
        "0.6.3",
    ),
    "0.5.10": (_TF53, "0.6.7.post2"),
    "0.5.10.post1": (_TF53, "0.6.7.post3"),
    "0.5.11": (["transformers==5.6.0", "tokenizers==0.22.2", "openai==2.6.1", "apache-tvm-ffi==0.1.11"], "0.6.8.post1"),
    "0.5.12": (_TF56, "0.6.11.post1"),
    "0.5.12.post1": (_TF56, "0.6.11.post1"),
    "0.5.13": (_TF58, "0.6.12"),
    "0.5.13.post1": (_TF58, "0.6.12"),
    "0.5.14": (_TF58, "0.6.12"),
    "0.5.15": (_TF512, "0.6.12"),
    "0.5.15.post1": (_TF512, "0.6.12"),
    "0.5.16": ([*_TF512, "xgrammar==0.2.1"], "0.6.14"),
    "0.5.17": ([*_TF512, "xgrammar==0.2.1"], "0.6.15.post1"),
    "0.5.18": ([*_TF512, "xgrammar==0.2.1"], "0.6.17"),
    "0.5.19": ([*_TF512, "xgrammar==0.2.1"], "0.6.18"),
    "0.5.20": ([*_TF512, "xgrammar==0.2.1"], "0.6.18"),
    "0.5.21": (_TF512, "0.6.18"),
    "0.5.22": ([*_TF519, "openai==2.6.1"], "0.7.1"),
    "0.5.23": ([*_TF519, "openai==2.8.0"], "0.7.2"),
}


def pip(python: str, target: Path, requirements: list[str]) -> None:
    command = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), *requirements]
    subprocess.run(command, check=True)


def write_standin(target: Path, module: str, dist: str, version: str) -> None:
    """`module` importable from `target` as an inert package (the probe's stand_in, the probe
    copied beside it as _sm120kit_standin.py); `dist` at `version` for importlib.metadata."""
    shutil.copyfile(PROBE, target / "_sm120kit_standin.py")
    (target / module).mkdir(exist_ok=True)
    (target / module / "__init__.py").write_text(
        f'"""A stand-in for {dist}=={version} (see _sm120kit_standin)."""\n'
        f"from _sm120kit_standin import stand_in\n\nstand_in(__name__, {version!r}, __spec__)\n"
    )
    info = target / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "RECORD").write_text("")


def build_common(python: str, root: Path) -> None:
    common, stamp = root / "common", root / "common" / "SM120KIT-PINS.txt"
    wanted = "\n".join(COMMON) + "\n"
    if stamp.is_file() and stamp.read_text() == wanted:
        return
    shutil.rmtree(common, ignore_errors=True)
    pip(python, common, COMMON)
    stamp.write_text(wanted)


def build_release(python: str, root: Path, release: str) -> Path:
    packages, flashinfer = RELEASES[release]
    target = root / release
    shutil.rmtree(target, ignore_errors=True)
    pip(python, target, [f"sglang=={release}", *packages])
    write_standin(target, "flashinfer", "flashinfer-python", flashinfer)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="an interpreter with torch and pip")
    parser.add_argument("--dir", type=Path, required=True, help="where the environments go")
    parser.add_argument("releases", nargs="*", help=f"default: all of {', '.join(RELEASES)}")
    args = parser.parse_args()
    unknown = [r for r in args.releases if r not in RELEASES]
    if unknown:
        parser.error(f"no dependency list for {', '.join(unknown)} (known: {', '.join(RELEASES)})")
    if subprocess.run([args.python, "-c", "import torch"], capture_output=True).returncode != 0:
        parser.error(f"{args.python} cannot import torch")
    root = args.dir.resolve()
    build_common(args.python, root)
    for release in args.releases or list(RELEASES):
        target = build_release(args.python, root, release)
        print(f"{release} PYTHONPATH={target}:{root / 'common'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
