"""Process lifecycle shared by the engine core and worker processes."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading

from kestrel import envs


def exit_with_parent() -> None:
    """End this process when the process that started it dies, even by SIGKILL: no orphans."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def freeze_startup_heap() -> None:
    """Move what start-up built (imported modules, the model, the tokenizer) out of the collector's
    reach, as vLLM does: those objects live until exit, yet every full collection walked them (~0.2 s
    each on two cores), during serving and again as the interpreter exits, where they made up most of
    a ~1.5 s shutdown. For processes Kestrel owns (`kestrel serve`, engine core, workers), never a
    library user's."""
    gc.collect()
    gc.freeze()


LOGGING_LEVEL_ENV = "KESTREL_LOGGING_LEVEL"
LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
LOG_DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_program_logging() -> None:
    """Kestrel's log lines on stderr at $KESTREL_LOGGING_LEVEL (default INFO), for a program (the
    `kestrel` command); the level is left in the environment, so that the engine-core and worker
    processes it spawns log the same way (`inherit_program_logging`). A library never calls this."""
    os.environ.setdefault(LOGGING_LEVEL_ENV, "INFO")
    inherit_program_logging()


def inherit_program_logging() -> None:
    """In a spawned engine-core or worker process: log as the program that started it does, if it
    is one that logs (else nothing, as a library's processes)."""
    level = envs.KESTREL_LOGGING_LEVEL
    kestrel_logger = logging.getLogger("kestrel")
    if level is None or kestrel_logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))
    kestrel_logger.addHandler(handler)
    kestrel_logger.setLevel(level.upper())


def allow_child_processes() -> None:
    """Let this process start worker processes even though it runs as a daemonic child (the engine
    core does, so that it dies with its front end). `multiprocessing` refuses children to daemonic
    processes only so that they are not orphaned when it is terminated; workers watch their parent
    (`exit_with_parent`) and end with it, so the rule's reason is covered."""
    process = multiprocessing.current_process()
    if multiprocessing.parent_process() is not None and process.daemon:
        process.daemon = False


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port free at the time of asking (for a rendezvous address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
