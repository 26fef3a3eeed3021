"""What will sglang run? Its own argument resolution, run in the TARGET's interpreter.

This file runs as `<python> -c <this text>` (or `<python> probe.py`) in the interpreter
that serves sglang, with the server's environment; it uses the standard library and the
target's own packages, never sm120kit (the target need not have it). It reads one JSON
object on stdin:

    {"argvs": [["--model-path", "/models/glm5", "--tp", "8", ...], ...],   sglang's flags, each
                                                                          a launch to resolve
     "capability": "12.0",                                                the node presented
     "gpus": 8, "memory_mib": 97887, "name": "NVIDIA RTX PRO 6000 Blackwell ...",
     "fields": ["attention_backend", ...]}                   what to answer (absent: every field)

and answers in lines of MARKER + JSON on stdout (everything sglang prints goes to stderr),
each written as soon as it is known. sglang is imported once; each launch is resolved on a
fresh record, with the environment restored between them (sglang's resolution sets
variables of its own):

    {"protocol": 2, "ok": true, "sglang": "0.5.23", "import_seconds": 7.1}    imported
    {"protocol": 2, "index": 0, "ok": true, "how": "resolve_once",            one per launch
     "resolved": {"attention_backend": "...", ...},   the fields asked for
     "notes": ["TensorRT-LLM MLA only supports ..."], sglang's warnings
     "seconds": 0.9}
    {"protocol": 2, "index": 1, "ok": false, "stage": "argv|resolve", "error": "sglang's message"}
    {"protocol": 2, "ok": false, "stage": "import|probe", "error": "..."}      or, instead

Presenting the node: sglang reads the compute capability through torch.cuda, NVML (pynvml)
and nvidia-smi, and several of its helpers are cached, so all three answer for the
presented node before sglang is imported: torch.cuda's query functions are replaced (no
CUDA context is made, nothing is allocated), pynvml is a module of this file's, and a
`nvidia-smi` of this file's is first on PATH. sgl_kernel's compiled ops load only beside
the CUDA they were built for; the resolution imports it and reads names but calls none of
it, so sgl_kernel and its submodules are inert modules here.
"""

import io
import json
import logging
import os
import stat
import sys
import tempfile
import time
import types

MARKER = "SM120KIT-RESOLUTION "
PROTOCOL = 2
INERT_PACKAGES = ("sgl_kernel",)


class Inert(types.ModuleType):
    """A module, a class, a function and a value at once: every attribute is another."""

    def __init__(self, name):
        super().__init__(name)
        self.__path__ = []  # a package, so that `import sgl_kernel.x` finds its submodules here

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = Inert(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        return Inert(f"{self.__name__}()")

    def __mro_entries__(self, bases):
        return (object,)

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return True


class InertFinder:
    """Answers the packages of `versions` (INERT_PACKAGES, and what stand_in adds) and their
    submodules with Inert modules."""

    versions = dict.fromkeys(INERT_PACKAGES, "0.0.0")

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] not in cls.versions:
            return None
        import importlib.machinery

        return importlib.machinery.ModuleSpec(name, cls, is_package=True)

    @classmethod
    def create_module(cls, spec):
        module = Inert(spec.name)
        module.__version__ = cls.versions[spec.name.split(".")[0]]
        return module

    @staticmethod
    def exec_module(module):
        return None


def stand_in(name, version, spec):
    """Make the package `name` (being imported from `spec`) inert at `version`: how
    scripts/resolution_envs.py stands in for the GPU packages of a recording environment
    (flashinfer) that sglang looks for and imports from but never calls there."""
    InertFinder.versions[name] = version
    if InertFinder not in sys.meta_path:
        sys.meta_path.insert(0, InertFinder)
    module = Inert(name)
    module.__version__ = version
    module.__spec__ = spec  # importlib.util.find_spec(name) reads it once imported
    sys.modules[name] = module


def present_pynvml(node):
    """A pynvml module that answers for the presented node."""
    major, minor = node["major"], node["minor"]
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    memory = types.SimpleNamespace(total=node["memory_mib"] << 20, free=node["memory_mib"] << 20, used=0)
    answers = {
        "nvmlInit": None,
        "nvmlShutdown": None,
        "nvmlDeviceGetCount": node["gpus"],
        "nvmlDeviceGetCudaComputeCapability": (major, minor),
        "nvmlDeviceGetName": node["name"],
        "nvmlDeviceGetMemoryInfo": memory,
        "nvmlSystemGetDriverVersion": "580.0",
        "nvmlSystemGetCudaDriverVersion": 13000,
        "nvmlDeviceGetP2PStatus": 0,
    }
    for name, value in answers.items():
        setattr(nvml, name, lambda *a, _value=value, **k: _value)
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.NVMLError = NVMLError
    nvml.NVML_P2P_STATUS_OK = 0
    nvml.NVML_P2P_CAPS_INDEX_READ = 0
    nvml.__version__ = "0.0.0"
    sys.modules["pynvml"] = nvml


def present_nvidia_smi(node):
    """A nvidia-smi first on PATH that answers the --query-gpu questions sglang asks."""
    folder = tempfile.mkdtemp(prefix="sm120kit-resolution-")
    answers = {
        "memory.total": str(node["memory_mib"]),
        "compute_cap": f"{node['major']}.{node['minor']}",
        "name": node["name"],
        "driver_version": "580.0",
    }
    script = os.path.join(folder, "nvidia-smi")
    with open(script, "w") as fh:
        fh.write(
            "#!/bin/sh\n"
            "# sm120kit's resolution: answers for the presented node\n"
            'for a in "$@"; do case "$a" in\n'
            + "".join(
                f"  --query-gpu={key}) i=0; while [ $i -lt {node['gpus']} ]; do echo '{value}'; i=$((i+1)); done;;\n"
                for key, value in answers.items()
            )
            + "esac; done\n"
        )
    os.chmod(script, stat.S_IRWXU)
    os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


def present_torch(node):
    import torch

    major, minor, memory = node["major"], node["minor"], node["memory_mib"] << 20
    properties = types.SimpleNamespace(
        name=node["name"],
        major=major,
        minor=minor,
        total_memory=memory,
        multi_processor_count=node.get("sms", 188),
        shared_memory_per_block_optin=node.get("smem_optin", 101376),
        shared_memory_per_multiprocessor=node.get("smem_sm", 102400),
        L2_cache_size=128 << 20,
        is_integrated=False,
        uuid="GPU-sm120kit-resolution",
        warp_size=32,
    )
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: node["gpus"]
    cuda.get_device_capability = lambda device=None: (major, minor)
    cuda.get_device_name = lambda device=None: node["name"]
    cuda.get_device_properties = lambda device=None: properties
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.mem_get_info = lambda device=None: (memory, memory)
    cuda.is_bf16_supported = lambda *a, **k: True
    cuda.get_arch_list = lambda: [f"sm_{major}{minor}"]
    cuda._get_nvml_device_index = lambda index: index
    # The inert sgl_kernel defines no torch ops, and sglang registers fake kernels for some
    # of them at import (0.5.9: sgl_kernel::sgl_per_token_group_quant_8bit): a no-op there.
    library = getattr(torch, "library", None)
    register_fake = getattr(library, "register_fake", None)
    if register_fake is None:  # an older torch: nothing to make lenient
        return torch

    def lenient_register_fake(op, func=None, /, *args, **kwargs):
        if isinstance(op, str) and op.split("::")[0] in INERT_PACKAGES:
            return func if func is not None else (lambda f: f)
        return register_fake(op, func, *args, **kwargs)

    library.register_fake = lenient_register_fake
    return torch


class Notes(logging.Handler):
    """sglang's warnings during the resolution, in order."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        try:
            self.lines.append(record.getMessage()[:500])
        except Exception:  # a record whose arguments do not format: its template
            self.lines.append(str(record.msg)[:500])


def scalar_fields(record):
    """The record's fields that JSON can carry (values, lists of values)."""
    out = {}
    for key, value in record.items():
        if key.startswith("_"):
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
            out[key] = list(value)
        elif hasattr(value, "value") and isinstance(value.value, (int, str)):  # an enum
            out[key] = value.value
    return out


def present(request):
    """Present the node at every seam sglang reads it; import sglang's entry point.
    (sglang's version, prepare_server_args)."""
    major, minor = (int(x) for x in request["capability"].split("."))
    node = {
        "major": major,
        "minor": minor,
        "gpus": int(request.get("gpus") or 8),
        "memory_mib": int(request.get("memory_mib") or 97887),
        "name": request.get("name") or "NVIDIA RTX PRO 6000 Blackwell Server Edition",
    }
    if InertFinder not in sys.meta_path:
        sys.meta_path.insert(0, InertFinder)
    present_pynvml(node)
    present_nvidia_smi(node)
    present_torch(node)
    import importlib.metadata

    version = importlib.metadata.version("sglang")
    from sglang.srt.server_args import prepare_server_args

    return version, prepare_server_args


def resolve_one(prepare_server_args, argv, notes, fields):
    """One launch: sglang's resolved record, or sglang's refusal."""
    started = time.monotonic()
    stderr, captured = sys.stderr, io.StringIO()
    environ = dict(os.environ)
    del notes.lines[:]
    try:
        sys.stderr = captured  # argparse writes its usage and message here before it exits
        args = prepare_server_args(list(argv))
        how = "__post_init__"
        if hasattr(args, "resolve_once"):  # 0.5.20 on: the pipeline runs on request
            how = "resolve_once"
            args.resolve_once()
            record = args.resolved_dict()
        else:
            record = dict(vars(args))
    except SystemExit:
        lines = [line for line in captured.getvalue().splitlines() if line.strip()]
        return {"ok": False, "stage": "argv", "error": lines[-1] if lines else "argparse exited"}
    except BaseException as exc:  # sglang's own refusal, whatever it raises
        return {"ok": False, "stage": "resolve", "error": f"{type(exc).__name__}: {exc}"}
    finally:
        sys.stderr = stderr
        stderr.write(captured.getvalue())
        os.environ.clear()
        os.environ.update(environ)
    return {
        "ok": True,
        "how": how,
        "resolved": scalar_fields({k: v for k, v in record.items() if fields is None or k in fields}),
        "notes": notes.lines[-50:],
        "seconds": round(time.monotonic() - started, 3),
    }


def resolve(request, say):
    """Import once, then resolve each launch; say(doc) writes one line of the answer as soon
    as it is known, so that a launch that ends the process leaves the answers before it."""
    started = time.monotonic()
    notes = Notes()
    # On sglang's logger, not the root's: from 0.5.11 prepare_server_args resets the root's
    # handlers (logging.basicConfig(force=True)) before it resolves.
    logging.getLogger("sglang").addHandler(notes)
    try:
        version, prepare_server_args = present(request)
    except BaseException as exc:  # an import that fails is the answer, whatever it raises
        say({"ok": False, "stage": "import", "error": f"{type(exc).__name__}: {exc}"})
        return
    fields = set(request["fields"]) if request.get("fields") is not None else None
    say({"ok": True, "sglang": version, "import_seconds": round(time.monotonic() - started, 3)})
    for index, argv in enumerate(request["argvs"]):
        say({"index": index, **resolve_one(prepare_server_args, argv, notes, fields)})


def main():
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever sglang prints is not our answer

    def say(doc):
        out.write(MARKER + json.dumps({"protocol": PROTOCOL, **doc}, default=str) + "\n")
        out.flush()

    try:
        resolve(json.loads(sys.stdin.read()), say)
    except BaseException as exc:  # the protocol's last word, never a bare traceback
        say({"ok": False, "stage": "probe", "error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main()
