"""Every KESTREL_* environment variable the product reads, in one place: its type, its default and what
it does. Code reads them as attributes of this module, which parse the environment at each access, so
a test's `monkeypatch.setenv` (and a value a parent process sets for its children) takes effect at
once:

    from kestrel import envs
    if envs.KESTREL_DISABLE_CPU_KERNELS: ...

A process that sets one for its children writes os.environ under the variable's name (`VARIABLES`
lists them); nothing reads os.environ for a KESTREL_* variable anywhere else. Variables marked "test hook"
exist for the tests (fault injection, strict builds) and change nothing unless set.

Names that look like variables but are not: KESTREL_VEC_AVX512 / KESTREL_VEC_AVX2 (and the other
KESTREL_* macros in kestrel/ops/*.cpp, *.h) are C++ preprocessor macros set by the build's -D flags;
KESTREL_WEIGHTS, KESTREL_HEALTH_TIMEOUT_S and KESTREL_STOP_GRACE_S in kestrel/bench are Python
constants. KESTREL_ARGS, KESTREL_SOAK_* and KESTREL_DASHBOARD_SCREENSHOT are read by tests only.

A shared leaf module: it imports only the standard library.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

_TRUE = ("1", "true", "yes", "on")


def _flag(name: str) -> bool:
    """A boolean: on for 1 / true / yes / on (any case), off when unset, empty or anything else."""
    return os.environ.get(name, "").strip().lower() in _TRUE


def _str(name: str, default: str | None = None) -> str | None:
    """A string; unset or empty gives `default`."""
    return os.environ.get(name) or default


def _path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = (os.environ.get(name) or default).strip().lower()
    if value not in choices:
        raise ValueError(f"{name} must be {' or '.join(repr(c) for c in choices)}, not {value!r}")
    return value


def _int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, not {value!r}") from None


def _float(name: str, default: float) -> float:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number, not {value!r}") from None


def _pid(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


@dataclass(frozen=True)
class EnvVar:
    """One variable: `read()` parses its current value (its default where unset)."""
    name: str
    type: str
    default: Any
    meaning: str
    read: Callable[[], Any]
    test_hook: bool = False
    component: str = "engine"  # "engine", or "bench" (read by kestrel/bench only)


def _declare(*variables: EnvVar) -> dict[str, EnvVar]:
    return {v.name: v for v in variables}


VARIABLES: dict[str, EnvVar] = _declare(
    # ---- kernels and the CPU (kestrel/ops) ------------------------------------------------------
    EnvVar("KESTREL_DISABLE_CPU_KERNELS", "bool", False,
           "Never build or load the hand-written C++ kernels: every op takes its PyTorch reference.",
           lambda: _flag("KESTREL_DISABLE_CPU_KERNELS")),
    EnvVar("KESTREL_CPU_KERNELS", "'auto' | 'avx2'", "auto",
           "Which build of the CPU kernels: 'auto' takes AVX-512 where the CPU has it, else AVX2 + FMA; "
           "'avx2' takes the AVX2 build on an AVX-512 CPU too (the laptop path, run on a server).",
           lambda: _choice("KESTREL_CPU_KERNELS", "auto", ("auto", "avx2"))),
    EnvVar("KESTREL_DISABLE_AMX", "bool", False,
           "Every AMX kernel off (the bf16 and int8 matmuls, prefill attention); AVX-512 ones run instead.",
           lambda: _flag("KESTREL_DISABLE_AMX")),
    EnvVar("KESTREL_KERNEL_CACHE", "path | None", None,
           "Where compiled kernels are cached (default ~/.cache/kestrel/kernels).",
           lambda: _path("KESTREL_KERNEL_CACHE")),
    EnvVar("KESTREL_KERNEL_BUILD_WAIT_S", "float", 900.0,
           "Seconds a process waits for another one's kernel build (a first build takes ~100 s on 2 "
           "cores) before giving up on the kernel.",
           lambda: _float("KESTREL_KERNEL_BUILD_WAIT_S", 900.0)),
    EnvVar("KESTREL_STRICT_KERNELS", "bool", False,
           "A kernel the CPU supports that fails to build raises, with the compiler's message, instead "
           "of falling back to PyTorch (so that a test of the kernels cannot pass on the reference).",
           lambda: _flag("KESTREL_STRICT_KERNELS"), test_hook=True),
    EnvVar("KESTREL_DISABLE_HUGE_PAGES", "bool", False,
           "Weights and KV cache in ordinary pages, not transparent huge pages (for comparisons).",
           lambda: _flag("KESTREL_DISABLE_HUGE_PAGES")),
    # ---- processes, logging, parallelism --------------------------------------------------------
    EnvVar("KESTREL_LOGGING_LEVEL", "str | None", None,
           "The level of Kestrel's log lines on stderr. The `kestrel` program sets INFO where unset and "
           "its engine-core and worker processes inherit it; unset in a library's processes: no handler.",
           lambda: _str("KESTREL_LOGGING_LEVEL")),
    EnvVar("KESTREL_FRONTEND_PID", "int | None", None,
           "The pid of the process that started the engine (set by it, inherited by its children): the "
           "thread governor counts that process tree as Kestrel's own.",
           lambda: _pid("KESTREL_FRONTEND_PID")),
    EnvVar("KESTREL_CPU_ALL_REDUCE", "'shm' | 'gloo'", "shm",
           "Tensor-parallel all-reduce on one host: 'shm' (shared memory), or 'gloo' to keep gloo's. "
           "Ranks on several hosts always use gloo.",
           lambda: _choice("KESTREL_CPU_ALL_REDUCE", "shm", ("shm", "gloo"))),
    # ---- serving and models ---------------------------------------------------------------------
    EnvVar("KESTREL_API_KEY", "str | None", None,
           "The key the OpenAI server requires ('Authorization: Bearer KEY') on /v1/* when --api-key is "
           "not given; unset or empty: none.",
           lambda: _str("KESTREL_API_KEY")),
    EnvVar("KESTREL_CACHE_DIR", "path", "~/.cache/kestrel",
           "Kestrel's cache folder (GGUF files dequantised or converted for loading).",
           lambda: _path("KESTREL_CACHE_DIR") or Path.home() / ".cache" / "kestrel"),
    # ---- test hooks -----------------------------------------------------------------------------
    EnvVar("KESTREL_TEST_FAULT_AT_STEP", "int", 0,
           "N > 0: the engine core's N-th step (from 1) raises, as a failing model would.",
           lambda: _int("KESTREL_TEST_FAULT_AT_STEP", 0), test_hook=True),
    EnvVar("KESTREL_TEST_HOLD_FILE", "str | None", None,
           "A path: the engine core runs no step while that file exists.",
           lambda: _str("KESTREL_TEST_HOLD_FILE"), test_hook=True),
    # ---- benchmarks (kestrel/bench) -------------------------------------------------------------
    EnvVar("KESTREL_LLAMA_NP", "int | None", None,
           "llama-server's slot count (-np) in the benchmarks, instead of the swept best.",
           lambda: _int("KESTREL_LLAMA_NP", None), component="bench"),
    EnvVar("KESTREL_LLAMA_SERVER", "str (a path) | None", None,
           "A llama-server binary for the benchmarks, instead of building one.",
           lambda: _str("KESTREL_LLAMA_SERVER"), component="bench"),
    EnvVar("KESTREL_LLAMA_QUANTIZE", "str (a path) | None", None,
           "A llama-quantize binary (default: the one beside llama-server).",
           lambda: _str("KESTREL_LLAMA_QUANTIZE"), component="bench"),
    EnvVar("KESTREL_PEERS_SCRIPT", "str (a path) | None", None,
           "The script that builds llama.cpp for the benchmarks (default "
           "<repo>/../shared/bench/peers/llama_server.sh).",
           lambda: _str("KESTREL_PEERS_SCRIPT"), component="bench"),
    EnvVar("KESTREL_PEER_CACHE", "str (a path) | None", None,
           "Where that script builds llama.cpp (default ~/.cache/kestrel-peers).",
           lambda: _str("KESTREL_PEER_CACHE"), component="bench"),
)

# vLLM's shape: name -> a function that reads the variable now.
environment_variables: dict[str, Callable[[], Any]] = {name: v.read for name, v in VARIABLES.items()}

if TYPE_CHECKING:  # what each attribute returns, for type checkers and readers
    KESTREL_DISABLE_CPU_KERNELS: bool
    KESTREL_CPU_KERNELS: str
    KESTREL_DISABLE_AMX: bool
    KESTREL_KERNEL_CACHE: Path | None
    KESTREL_KERNEL_BUILD_WAIT_S: float
    KESTREL_STRICT_KERNELS: bool
    KESTREL_DISABLE_HUGE_PAGES: bool
    KESTREL_LOGGING_LEVEL: str | None
    KESTREL_FRONTEND_PID: int | None
    KESTREL_CPU_ALL_REDUCE: str
    KESTREL_API_KEY: str | None
    KESTREL_CACHE_DIR: Path
    KESTREL_TEST_FAULT_AT_STEP: int
    KESTREL_TEST_HOLD_FILE: str | None
    KESTREL_LLAMA_NP: int | None
    KESTREL_LLAMA_SERVER: str | None
    KESTREL_LLAMA_QUANTIZE: str | None
    KESTREL_PEERS_SCRIPT: str | None
    KESTREL_PEER_CACHE: str | None


def __getattr__(name: str) -> Any:
    """`envs.KESTREL_X`: the variable's value now (parsed; its default where unset)."""
    variable = VARIABLES.get(name)
    if variable is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return variable.read()


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


def is_set(name: str) -> bool:
    """Whether the declared variable `name` is set (to anything, even empty) in this process."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a declared Kestrel environment variable")
    return name in os.environ


def describe() -> str:
    """A table of every variable: name, type, default, meaning (`python -c 'from kestrel import envs;
    print(envs.describe())'`)."""
    lines = []
    for v in VARIABLES.values():
        tags = ", ".join(t for t in ("test hook" if v.test_hook else "",
                                     "bench" if v.component == "bench" else "") if t)
        lines.append(f"{v.name} ({v.type}, default {v.default!r}{', ' + tags if tags else ''}): {v.meaning}")
    return "\n".join(lines)
