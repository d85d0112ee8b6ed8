"""Peer servers for the benchmarks: llama.cpp's `llama-server` and Kestrel's own server, as
context managers, plus the weights to give llama.cpp and a memory sampler.

`llama_server_binary()` finds `llama-server`: `$KESTREL_LLAMA_SERVER` (a binary) if set, else the
last stdout line of the build script `shared/bench/peers/llama_server.sh` (next to the repository,
or `$KESTREL_PEERS_SCRIPT`), which builds llama.cpp into a cache folder the first time (10-15
minutes on 2 cores) and prints the binary's path.

`gguf_in_precision(src, "bf16" | "f32")` writes, once, a copy of a GGUF file with every tensor
dequantized: 2-D tensors (the token embedding included) in the target precision, 1-D tensors
(norms) in f32 as llama.cpp's converter does. Tensor names, order and data layout are the source's
(llama's q/k rows stay in llama.cpp's permuted order); every metadata key/value is copied
unchanged except `general.file_type` (MOSTLY_BF16 / ALL_F32). The copy is cached under
`~/.cache/kestrel/peers/` (or `$KESTREL_CACHE_DIR/peers`), keyed by the source's name, size and
mtime and the precision, and written atomically. `"q4_1"` / `"native"` return the source itself.
Same-precision weights make the fairest pair of engines (WORKLOADS.md).

`LlamaServer(gguf, parallel=..., ctx_per_slot=...)` runs
`llama-server -m FILE --host 127.0.0.1 --port P -np N -c N*CTX -t T -tb T --cache-ram 0 --no-webui
-fa on` (plus `--cont-batching` where the binary knows the flag; flash attention on, as its users run
it), its output in a temp log file, and waits for `GET /health` to answer 200. `KestrelServer(engine_flags)` runs
`python -m kestrel.entrypoints.cli serve --port P ...` the same way. Both expose `.base_url`
(the OpenAI API root, `http://127.0.0.1:P/v1`), `.pid` and `.label`, and on exit send SIGTERM,
then SIGKILL to the process group after a grace period.

`RssSampler(pid)` samples the summed RSS of a process and its descendants every 0.2 s in a thread;
`.peak` is the largest sum seen, in bytes. `rss_of_tree(pid)` is one such sample.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import psutil

import kestrel
from kestrel import envs

LLAMA_SERVER_ENV = "KESTREL_LLAMA_SERVER"
PEERS_SCRIPT_ENV = "KESTREL_PEERS_SCRIPT"
REPO_ROOT = Path(kestrel.__file__).resolve().parent.parent
DEFAULT_PEERS_SCRIPT = REPO_ROOT.parent / "shared" / "bench" / "peers" / "llama_server.sh"

NATIVE_PRECISIONS = ("native", "q4_1")
CONVERTED_PRECISIONS = ("bf16", "f32", "q8_0")
_PRECISION_ALIASES = {"bfloat16": "bf16", "float32": "f32", "fp32": "f32"}

LLAMA_HEALTH_TIMEOUT_S = 300.0
KESTREL_HEALTH_TIMEOUT_S = 600.0
STOP_GRACE_S = 10.0
KESTREL_STOP_GRACE_S = 15.0  # ends in-flight streams and its engine-core process first
RSS_SAMPLE_INTERVAL_S = 0.2
LOG_TAIL_LINES = 40


# ---- llama-server binary ------------------------------------------------------------------------

def llama_server_binary() -> Path:
    """The path of llama.cpp's `llama-server`: `$KESTREL_LLAMA_SERVER` if set, else what the build
    script (`$KESTREL_PEERS_SCRIPT`, default `<repo>/../shared/bench/peers/llama_server.sh`) prints
    on its last stdout line. The script builds llama.cpp the first time (10-15 minutes); its
    progress goes to this process's stderr. RuntimeError if neither gives an executable."""
    env_binary = envs.KESTREL_LLAMA_SERVER
    if env_binary:
        path = Path(env_binary).expanduser()
        if not _is_executable_file(path):
            raise RuntimeError(f"${LLAMA_SERVER_ENV}={env_binary} is not an executable file")
        return path.resolve()

    script = Path(envs.KESTREL_PEERS_SCRIPT or DEFAULT_PEERS_SCRIPT).expanduser()
    how = (f"set ${LLAMA_SERVER_ENV} to a llama-server binary, or provide the build script "
           f"{DEFAULT_PEERS_SCRIPT} (or set ${PEERS_SCRIPT_ENV} to it)")
    if not script.is_file():
        raise RuntimeError(f"llama-server not found: ${LLAMA_SERVER_ENV} is not set and the build "
                           f"script {script} does not exist; {how}")
    proc = subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, text=True)  # stderr: build log
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"llama-server not found: the build script {script} failed (exit status "
                           f"{proc.returncode}, its log is above); {how}")
    path = Path(lines[-1]).expanduser()
    if not _is_executable_file(path):
        raise RuntimeError(f"llama-server not found: the build script {script} printed {lines[-1]!r}, "
                           f"which is not an executable file; {how}")
    return path.resolve()


LLAMA_QUANTIZE_ENV = "KESTREL_LLAMA_QUANTIZE"
PEER_CACHE_ENV = "KESTREL_PEER_CACHE"


def llama_quantize_binary() -> Path:
    """llama.cpp's `llama-quantize`: `$KESTREL_LLAMA_QUANTIZE` if set, else the one built beside
    `llama_server_binary()` (the build script builds both)."""
    env_binary = envs.KESTREL_LLAMA_QUANTIZE
    path = Path(env_binary).expanduser() if env_binary else llama_server_binary().parent / "llama-quantize"
    if not _is_executable_file(path):
        raise RuntimeError(f"llama-quantize not found at {path}; set ${LLAMA_QUANTIZE_ENV} to the binary")
    return path.resolve()


def built_llama_tool(name: str) -> Path | None:
    """`name` ("llama-server", "llama-quantize") where it is already built, without building it: beside
    `$KESTREL_LLAMA_SERVER`, else in the build script's cache folder (`$KESTREL_PEER_CACHE`, default
    ~/.cache/kestrel-peers); None if neither has it. For tests that skip where llama.cpp is not built."""
    env_binary = envs.KESTREL_LLAMA_SERVER
    if env_binary:
        candidates = [Path(env_binary).expanduser().parent / name]
    else:
        cache = Path(envs.KESTREL_PEER_CACHE or Path.home() / ".cache" / "kestrel-peers")
        candidates = sorted(cache.glob(f"llama_cpp_python-*/vendor/llama.cpp/build/bin/{name}"))
    return next((p.resolve() for p in reversed(candidates) if _is_executable_file(p)), None)


def _is_executable_file(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


@functools.lru_cache(maxsize=8)
def _llama_help_text(binary: Path) -> str:
    proc = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    return proc.stdout + proc.stderr


def flash_attention_args(help_text: str) -> list[str]:
    """Flash attention on, as llama.cpp's users run it: `-fa on` where the flag takes a value
    (`--flash-attn [on|off|auto]`, newer builds), the bare `-fa` switch on older ones."""
    if "--flash-attn" not in help_text:
        return []
    takes_value = re.search(r"--flash-attn\s+\[?(on|FA)", help_text) is not None
    return ["-fa", "on"] if takes_value else ["-fa"]


@functools.lru_cache(maxsize=8)
def llama_server_version(binary: Path) -> str:
    """What `llama-server --version` says after "version: ", e.g. "0.5.0-dev (build 1, commit
    0c1e570)" or, from older builds, "6810 (a1b2c3d)"; "unknown" if it says nothing of the kind."""
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    match = re.search(r"^version:\s*(.+?)\s*$", proc.stdout + proc.stderr, re.MULTILINE)
    return match.group(1) if match else "unknown"


def _llama_build_name(binary: Path, version: str) -> str:
    """A short build name for labels: llama.cpp's version ("b6810" for a bare build number), plus
    the llama-cpp-python release whose vendored sources it was built from, when the path says so
    (a build from the sdist has no git history, so its build number and commit mean nothing)."""
    head = version.split()[0] if version != "unknown" else "unknown"
    name = f"b{head}" if head.isdigit() else head
    match = re.search(r"llama_cpp_python-([0-9][\w.]*)", str(binary))
    return f"{name} (llama-cpp-python {match.group(1)})" if match else name


# ---- weights in another precision ---------------------------------------------------------------

def gguf_in_precision(src: Path, precision: str, cache_dir: Path | None = None) -> Path:
    """A GGUF file like `src` with every tensor dequantized to `precision` ("bf16" or "f32", or
    requantized to "q8_0", llama.cpp's int8 with a scale per 32 values; 1-D tensors stay f32), written
    once into `cache_dir` (default ~/.cache/kestrel/peers). "native" and "q4_1" return `src` unchanged
    ("q4_1" checks that `src` is a Q4_1 file)."""
    import gguf

    from kestrel.model.gguf_loader import kestrel_cache_dir, read_gguf_header

    src = Path(src).expanduser().resolve()
    precision = _PRECISION_ALIASES.get(precision.lower(), precision.lower())
    if precision in NATIVE_PRECISIONS:
        if precision == "q4_1":
            file_type = read_gguf_header(src).metadata.get("general.file_type")
            if file_type != gguf.LlamaFileType.MOSTLY_Q4_1:
                raise ValueError(f"{src} is not a Q4_1 file (general.file_type={file_type}); "
                                 "ask for 'native' to use it as it is")
        return src
    if precision not in CONVERTED_PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of "
                         f"{', '.join(CONVERTED_PRECISIONS + NATIVE_PRECISIONS)}")

    st = src.stat()
    key = hashlib.sha256(f"{src.name}|{st.st_size}|{st.st_mtime_ns}|{precision}".encode()).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir is not None else kestrel_cache_dir() / "peers"
    target = folder / f"{src.name.removesuffix('.gguf')}.{precision.upper()}-{key}.gguf"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        _write_dequantized_gguf(src, tmp, precision)
        os.replace(tmp, target)  # atomic: readers see the whole file or none
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _write_dequantized_gguf(src: Path, dst: Path, precision: str) -> None:
    """`src` with its metadata copied key by key (types and order kept, general.file_type set) and its
    tensors decoded (kestrel's torch decode, bit for bit gguf's) then written in `precision`. The
    header is read by kestrel's parser: gguf.GGUFReader took ~5 s a file for the vocabulary's views."""
    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import quantize

    from kestrel.model.gguf_loader import dequantize_tensor, read_gguf_header

    header = read_gguf_header(src)
    file_bytes = np.memmap(src, dtype=np.uint8, mode="c")  # copy-on-write: torch may view it; never written
    target_type, file_type = {"bf16": (QT.BF16, LlamaFileType.MOSTLY_BF16), "f32": (QT.F32, LlamaFileType.ALL_F32),
                              "q8_0": (QT.Q8_0, LlamaFileType.MOSTLY_Q8_0)}[precision]
    integer_types = {QT.I8: np.int8, QT.I16: np.int16, QT.I32: np.int32, QT.I64: np.int64}

    writer = GGUFWriter(dst, arch=header.architecture)
    writer.kv_data[0].clear()  # the writer pre-adds general.architecture; copy the source's order instead
    if "general.alignment" in header.metadata:
        writer.data_alignment = int(header.metadata["general.alignment"])

    for key, value in header.metadata.items():
        value_type, item_type = header.value_types[key]
        if key == "general.file_type":
            writer.add_key_value(key, int(file_type), value_type)
        elif item_type == GGUFValueType.ARRAY:
            raise ValueError(f"metadata key {key!r}: nested arrays are not supported")
        else:
            writer.add_key_value(key, value, value_type, item_type)
    if "general.file_type" not in header.metadata:
        writer.add_key_value("general.file_type", int(file_type), GGUFValueType.UINT32)

    # Plan every tensor first (the header needs all sizes), then stream the data one tensor at a time.
    plan: list[tuple[Any, QT]] = []
    for info in header.tensors.values():
        if info.qtype in integer_types:
            out_type = info.qtype
            writer.add_tensor_info(info.name, info.shape, np.dtype(integer_types[out_type]), info.n_bytes)
        else:
            out_type = QT.F32 if len(info.shape) <= 1 else target_type
            n_elements = int(np.prod(info.shape, dtype=np.int64))
            block, block_bytes = gguf.GGML_QUANT_SIZES[out_type]  # (1, 4) for F32, (32, 34) for Q8_0
            writer.add_tensor_info(info.name, info.shape, np.dtype(np.float32), n_elements // block * block_bytes,
                                   raw_dtype=out_type)
        plan.append((info, out_type))

    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for info, out_type in plan:
            if out_type in integer_types:  # copied as it is
                raw = file_bytes[info.offset : info.offset + info.n_bytes]
                writer.write_tensor_data(np.ascontiguousarray(raw).view(integer_types[out_type]).reshape(info.shape))
                continue
            values = dequantize_tensor(file_bytes, info)  # float32, numpy order
            if out_type == QT.F32:
                data = np.ascontiguousarray(values, dtype=np.float32)
            else:
                data = quantize(values, out_type)  # uint8 bytes: round-to-nearest-even bf16, or Q8_0 blocks
            writer.write_tensor_data(data)
        writer.flush()
    finally:
        writer.close()


def gguf_precision_name(path: Path) -> str:
    """The precision a GGUF file's `general.file_type` names: "bf16", "f32", "q4_1", ... ("?" if
    unknown)."""
    from gguf import LlamaFileType

    from kestrel.model.gguf_loader import read_gguf_header

    file_type = read_gguf_header(path).metadata.get("general.file_type")
    try:
        name = LlamaFileType(file_type).name
    except ValueError:
        return "?"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


# ---- servers ------------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ServerProcess:
    """A server child process with its output in a temp log file: started on __enter__ (which
    returns once GET /health answers 200), stopped on __exit__."""

    label: str
    health_timeout_s: float
    stop_grace_s: float = STOP_GRACE_S
    log_prefix: str

    def __init__(self, port: int | None) -> None:
        self.port = port if port is not None else free_port()
        self.host = "127.0.0.1"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        """The server's root, e.g. http://127.0.0.1:8123."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI API root, e.g. http://127.0.0.1:8123/v1."""
        return f"{self.url}/v1"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.label} server is not running")
        return self.proc.pid

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        """The child's environment; None: this process's."""
        return None

    def cwd(self) -> str | None:
        """The child's working directory; None: this process's."""
        return None

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError(f"{self.label} server already started")
        cmd = self.command()
        fd, log_name = tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")
        self.log_path = Path(log_name)
        with os.fdopen(fd, "wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            # Own session: a last-resort SIGKILL reaches the server's children too.
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=self.env(), cwd=self.cwd())
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.health_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} server exited with status {self.proc.returncode} before it "
                                   f"was ready{self.exit_hint(self.proc.returncode)}; log {self.log_path}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while loading
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.label} server not healthy after {self.health_timeout_s:.0f} s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.25)

    def exit_hint(self, returncode: int) -> str:
        """Words to add to the error for an early exit with this status ("" for none)."""
        return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM, then SIGKILL to the whole process group after `grace_s` (default: the class's
        `stop_grace_s`); the exit status (negative: the signal that ended it)."""
        proc = self.proc
        if proc is None:
            return None
        grace_s = self.stop_grace_s if grace_s is None else grace_s
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        # Children left behind after the leader exited (the group id is the leader's pid).
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return proc.returncode

    def __enter__(self) -> _ServerProcess:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
        if exc_type is None and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)  # kept (named in the error) when something failed


class LlamaServer(_ServerProcess):
    """llama.cpp's `llama-server` on `gguf`, with `parallel` slots of `ctx_per_slot` tokens each,
    `threads` threads for both decode and batch (default: every CPU), no host-memory prompt cache
    and no web UI. `.label` is e.g. "llama.cpp 0.5.0-dev (llama-cpp-python 0.3.36) bf16", `.version`
    what `llama-server --version` says.

    Seen on the shared 2-core AMX machines: a native Q4_1 file dies with SIGILL in warm-up, in
    ggml's AMX kernel for repacked Q4_1 weights (`tilezero`; the sandbox does not grant AMX tile
    state); `extra_args=["--no-repack"]` avoids it. bf16/f32 files run as they are."""

    health_timeout_s = LLAMA_HEALTH_TIMEOUT_S
    log_prefix = "llama-server-"

    def __init__(self, gguf: Path, *, parallel: int, ctx_per_slot: int, threads: int | None = None,
                 port: int | None = None, extra_args: Sequence[str] = (), binary: Path | None = None) -> None:
        super().__init__(port)
        if parallel < 1 or ctx_per_slot < 1:
            raise ValueError("parallel and ctx_per_slot must be positive")
        self.gguf = Path(gguf)
        if not self.gguf.is_file():
            raise FileNotFoundError(f"GGUF file {self.gguf} does not exist")
        self.parallel = parallel
        self.ctx_per_slot = ctx_per_slot
        self.threads = threads if threads is not None else (os.cpu_count() or 1)
        self.extra_args = list(extra_args)
        self.binary = Path(binary) if binary is not None else llama_server_binary()
        self.version = llama_server_version(self.binary)
        self.precision = gguf_precision_name(self.gguf)
        settings = " ".join([f"-np {parallel}", *flash_attention_args(_llama_help_text(self.binary))])
        self.label = f"llama.cpp {_llama_build_name(self.binary, self.version)} {self.precision} ({settings})"

    def exit_hint(self, returncode: int) -> str:
        if returncode == -signal.SIGILL:
            return (" (SIGILL: an instruction this machine refuses; llama.cpp's AMX kernels for repacked "
                    "quantized weights trap where the OS does not grant AMX tiles: try "
                    "extra_args=['--no-repack'])")
        return ""

    def command(self) -> list[str]:
        cmd = [str(self.binary), "-m", str(self.gguf), "--host", self.host, "--port", str(self.port),
               "-np", str(self.parallel), "-c", str(self.parallel * self.ctx_per_slot),
               "-t", str(self.threads), "-tb", str(self.threads), "--cache-ram", "0", "--no-webui"]
        help_text = _llama_help_text(self.binary)
        if "--cont-batching" in help_text:
            cmd.append("--cont-batching")
        return cmd + flash_attention_args(help_text) + self.extra_args

    def __enter__(self) -> LlamaServer:
        self.start()
        return self


class KestrelServer(_ServerProcess):
    """`kestrel serve` (this interpreter, `-m kestrel.entrypoints.cli serve --port P *engine_flags`)."""

    health_timeout_s = KESTREL_HEALTH_TIMEOUT_S
    stop_grace_s = KESTREL_STOP_GRACE_S
    log_prefix = "kestrel-serve-"

    def __init__(self, engine_flags: Sequence[str] = (), port: int | None = None, checkout: Path | None = None) -> None:
        super().__init__(port)
        self.engine_flags = list(engine_flags)
        self.checkout = checkout   # another checkout's kestrel (its source on PYTHONPATH), for before/after
        self.label = "kestrel" if checkout is None else f"kestrel@{checkout}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "kestrel.entrypoints.cli", "serve", "--port", str(self.port),
                *self.engine_flags]

    def env(self) -> dict[str, str] | None:
        return None if self.checkout is None else {**os.environ, "PYTHONPATH": str(self.checkout)}

    def cwd(self) -> str | None:
        # `python -m` puts the working directory first on sys.path: the checkout's, so its kestrel runs.
        return None if self.checkout is None else str(self.checkout)

    def __enter__(self) -> KestrelServer:
        self.start()
        return self


# ---- memory -------------------------------------------------------------------------------------

def _sum_over_tree(pid: int, measure) -> float:
    """measure(process) summed over a process and its live descendants; 0 if it is gone (a child that
    exits between the listing and its measure counts nothing)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        try:
            total += measure(proc)
        except psutil.Error:
            pass
    return total


def cpu_seconds_of_tree(pid: int) -> float:
    """The CPU time (user + system, seconds) a process and its live descendants have used; 0 if gone."""
    return _sum_over_tree(pid, lambda proc: sum(proc.cpu_times()[:2]))


def wait_until_quiet(pids: Sequence[int], *, below_cores: float = 0.1, window_s: float = 1.0,
                     timeout_s: float = 60.0) -> float:
    """Wait until the servers `pids` together use under `below_cores` cores over a `window_s` window
    (at most `timeout_s`); returns the seconds waited. An engine that keeps its threads spinning after
    a run would otherwise take the cores from the next engine's run in an interleaved round."""
    start = time.monotonic()
    while True:
        before = sum(cpu_seconds_of_tree(pid) for pid in pids)
        time.sleep(window_s)
        used = sum(cpu_seconds_of_tree(pid) for pid in pids) - before
        waited = time.monotonic() - start
        if used < below_cores * window_s or waited >= timeout_s:
            return waited


def rss_of_tree(pid: int) -> int:
    """The summed resident memory (bytes) of a process and all its descendants now; 0 if gone."""
    return int(_sum_over_tree(pid, lambda proc: proc.memory_info().rss))


class RssSampler:
    """Samples `rss_of_tree(pid)` every `interval_s` in a daemon thread while in use (a context
    manager, or start()/stop()); `.peak` is the largest sample, in bytes."""

    def __init__(self, pid: int, interval_s: float = RSS_SAMPLE_INTERVAL_S) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        rss = rss_of_tree(self.pid)
        self.peak = max(self.peak, rss)
        self.samples += 1
        return rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("RssSampler already started")
        self.sample()
        self._thread = threading.Thread(target=self._run, name=f"rss-sampler-{self.pid}", daemon=True)
        self._thread.start()

    def stop(self) -> int:
        """Stop sampling (after one last sample); the peak in bytes."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sample()
        return self.peak

    def __enter__(self) -> RssSampler:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
