"""`sm120kit bench` with sglang's REAL benchmark client, against the sglang stand-in server
(tests/fixtures/sglang_standin.py, a test fixture: the real server needs GPUs) capped at
a total token rate, so that a plateau appears. Proves that the numbers sm120kit reports
are the ones the client itself wrote.

The client imports torch, transformers, datasets and more (sglang's
`benchmark/serving.py` reaches `srt/disaggregation/utils.py`), which CI cannot install.
Give this script an interpreter that has them (torch for CPU is enough):

    python scripts/bench_client_proof.py --client-python /path/to/venv/bin/python [--version 0.5.23]

The script installs the sglang release from its wheel into a scratch site directory, builds
a word-level tokenizer with `tokenizers` (nothing is downloaded: HF_HUB_OFFLINE=1, and
--tokenizer / --model point at it), starts the stand-in, runs the sweep, and compares.
The scratch directory (some 130 MB: the unpacked wheel, the tokenizer, the results) is
removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sm120kit import wheels

ROOT = Path(__file__).resolve().parent.parent

MAKE_TOKENIZER = """
import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
vocab = {f"w{i}": i for i in range(1000)}
vocab.update({"<unk>": 1000, "<s>": 1001})
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##")
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>").save_pretrained(sys.argv[1])
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--client-python",
        required=True,
        help="an interpreter with sglang's client dependencies (torch, transformers, datasets, ...)",
    )
    parser.add_argument("--version", default="0.5.23", help="the sglang release whose client runs")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument(
        "--tokens-per-s", type=float, default=400.0, help="the stand-in's capacity (output tokens per second)"
    )
    parser.add_argument("--request-tokens-per-s", type=float, default=40.0, help="the most one request gets")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory and print its path")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-client-proof-"))
    try:
        return prove(args, work)
    finally:
        if args.keep:
            print(f"scratch directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def prove(args: argparse.Namespace, work: Path) -> int:
    """Install, start the stand-in, sweep, compare; everything it writes is under `work`."""
    site = work / "site-packages"
    wheels.install(site, "sglang", args.version)
    path = [str(site)]
    if subprocess.run([args.client_python, "-c", "import torchvision"], capture_output=True).returncode != 0:
        # sglang's import chain names torchvision (srt/multimodal/internvl_utils.py, for a VL
        # config) but the client never calls it; a CPU torch may have no matching build.
        for mod in ("torchvision/__init__.py", "torchvision/transforms/__init__.py"):
            (work / "placeholders" / mod).parent.mkdir(parents=True, exist_ok=True)
            (work / "placeholders" / mod).write_text(
                '"""Placeholder: imported by sglang\'s import chain, never called by the client."""\n'
            )
        path.append(str(work / "placeholders"))
        print(
            "torchvision is not importable there: a placeholder package stands in for the import "
            "(the client does not call it)"
        )
    python = work / "python"  # the serving environment: the client's interpreter with this sglang
    python.write_text(
        f"#!/bin/sh\nexport PYTHONPATH={':'.join(path)} HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES=\n"
        f'exec {args.client_python} "$@"\n'
    )
    python.chmod(0o755)
    tokenizer = work / "tokenizer"
    subprocess.run([str(python), "-c", MAKE_TOKENIZER, str(tokenizer)], check=True)

    port = free_port()
    faults = {
        "load_s": 0.1,
        "warmup_s": 0.1,
        "tokens_per_s": args.tokens_per_s,
        "request_tokens_per_s": args.request_tokens_per_s,
    }
    server = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "fixtures" / "sglang_standin.py"),
            "--port",
            str(port),
            "--model-path",
            str(tokenizer),
        ],
        env={**os.environ, "SGLANG_STANDIN": json.dumps(faults)},
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    out = work / "results"
    try:
        time.sleep(1.0)
        began = time.monotonic()
        bench = subprocess.run(
            [
                sys.executable,
                "-m",
                "sm120kit",
                "bench",
                "--url",
                f"http://127.0.0.1:{port}",
                "--python",
                str(python),
                "--tokenizer",
                str(tokenizer),
                "--model",
                str(tokenizer),
                "--concurrency",
                args.concurrency,
                "--input-len",
                "32",
                "--output-len",
                "32",
                "--prompts-per-level",
                "2",
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
        )
        seconds = time.monotonic() - began
    finally:
        server.terminate()
        server.wait()
    print(bench.stdout)
    if bench.returncode != 0:
        print(bench.stderr, file=sys.stderr)
        for log in sorted(out.glob("c*.log")):
            print(f"--- {log.name}\n" + log.read_text()[-2000:], file=sys.stderr)
        return 1
    run = json.loads((out / "run.json").read_text())
    problems = []
    for level in run["levels"]:
        written = json.loads((out / f"c{level['concurrency']}.jsonl").read_text().splitlines()[-1])
        if level["figures"] != written:
            problems.append(f"concurrency {level['concurrency']}: run.json differs from the client's own line")
        if f"total {written['total_throughput']:,.1f} tok/s" not in bench.stdout:
            problems.append(
                f"concurrency {level['concurrency']}: the printed total is not the client's "
                f"{written['total_throughput']}"
            )
    print(
        json.dumps(
            {
                "client": run["client"],
                "sglang": run["versions"]["sglang"],
                "sweep_seconds": round(seconds, 1),
                "output_tok_s": {
                    lv["concurrency"]: round(lv["figures"]["output_throughput"], 1) for lv in run["levels"]
                },
                "verdict": run["verdict"],
                "problems": problems,
                "scratch": str(work) if args.keep else None,
            },
            indent=2,
        )
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
