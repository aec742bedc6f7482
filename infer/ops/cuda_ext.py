"""Building the CUDA/HIP torch extensions of ``cuda/`` and ``hip/`` just in time, with a build cache.

An extension is compiled on first use with ``torch.utils.cpp_extension.load`` and cached under
``$RWKV_SERVER_HOME/torch_extensions/<torch>-<cuda>`` (else ``~/.cache/rwkv7-server/...``), so later
starts reuse the build. Callers ask :func:`why_unavailable` first and fall back to torch code when it
gives a reason.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Generic, Iterator, TypeVar

import torch

log = logging.getLogger(__name__)

T = TypeVar("T")


def env_int(name: str, default: int) -> int:
    """An environment knob for measurements: decimal digits only, else ``default`` (a value that is set but
    not such a number is logged and ignored; the kernels' own env_int in cuda/rwkv7_fused.cu reads the same)."""
    value = os.environ.get(name, "")
    if not value:
        return default
    if value.isascii() and value.isdigit():
        return int(value)
    log.warning("%s=%r is not a whole number >= 0: using %d", name, value, default)
    return default


def env_flag(name: str, default: bool) -> bool:
    """A switch among the knobs: off at 0, on at any other whole number, else ``default``."""
    return env_int(name, int(default)) != 0


def build_directory() -> Path:
    """Where the compiled extension is cached: one folder per torch and CUDA/HIP version."""
    base = os.environ.get("RWKV_SERVER_HOME")
    if base:
        root = Path(base) / "torch_extensions"
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        root = Path(cache) / "rwkv7-server" / "torch_extensions"
    accel = f"hip{torch.version.hip}" if torch.version.hip else f"cu{torch.version.cuda}"
    return root / f"{torch.__version__}-{accel}".replace("+", "_")


def why_unavailable() -> str | None:
    """A reason an extension cannot be built here, without trying to build it."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if torch.version.cuda is None and torch.version.hip is None:
        return "this torch build has no CUDA or HIP support"
    from torch.utils import cpp_extension
    if torch.version.hip is None and cpp_extension.CUDA_HOME is None:
        return "the CUDA toolkit (nvcc) was not found; set CUDA_HOME or put nvcc on PATH"
    if torch.version.hip is not None and getattr(cpp_extension, "ROCM_HOME", None) is None:
        return "the ROCm toolkit (hipcc) was not found; set ROCM_HOME"
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed (pip install ninja)"
    return None


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold an OS file lock on ``directory`` for a build, and clear torch's own lock file there if a
    dead process left it.

    torch's JIT loader marks a build in progress with a plain ``lock`` file and, in every later
    process, waits for that file to disappear, with no timeout. A build killed half-way (Ctrl-C,
    OOM, a timeout) therefore made every later start hang forever (seen on the H200). The ``fcntl``
    lock taken here is released by the OS when its holder dies, so while holding it, a ``lock``
    file can only be a dead build's leftover.
    """
    import fcntl
    with open(directory / ".rwkv7-build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("removing %s left by an interrupted build", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compile_extension(name: str, sources: list[Path], cuda_flags: list[str], what: str):
    """Build (or load the cached build of) extension ``name``; raises on a missing source or a failed build."""
    from torch.utils.cpp_extension import load
    for src in sources:
        if not src.is_file():
            raise FileNotFoundError(f"kernel source {src} is missing")
    directory = build_directory() / name  # one folder per extension: a build never waits on another's
    directory.mkdir(parents=True, exist_ok=True)
    log.info("compiling %s in %s; the first time takes a minute", what, directory)
    with build_lock(directory):
        return load(name=name, sources=[str(s) for s in sources], extra_cflags=["-O3"],
                    extra_cuda_cflags=cuda_flags, extra_include_paths=[str(s.parent) for s in sources],
                    build_directory=str(directory), verbose=False)


CUDA_FLAGS = ["-O3", "--use_fast_math", "-lineinfo"]
HIP_FLAGS = ["-O3"]


def compile_kernels(name: str, cuda_sources: list[Path], hip_sources: list[Path], what: str,
                    cuda_flags: list[str] = CUDA_FLAGS, hip_flags: list[str] = HIP_FLAGS):
    """:func:`compile_extension` of the CUDA sources, or of their HIP ports (cached as ``name_hip``) on a
    ROCm build of torch."""
    hip = torch.version.hip is not None
    return compile_extension(name + ("_hip" if hip else ""), hip_sources if hip else cuda_sources,
                             list(hip_flags if hip else cuda_flags), f"{what} ({'HIP' if hip else 'CUDA'})")


class BuildOnce(Generic[T]):
    """A process-wide object backed by a compiled extension: built (and self-tested) on first use,
    or, from then on, None with the reason in :attr:`error`. Never raises."""

    def __init__(self, what: str):
        self._what = what
        self._lock = threading.Lock()
        self._value: T | None = None
        self.error: str | None = None  # why the object is unavailable, once a build was tried

    def get(self, build: Callable[[], tuple[T | None, str | None]]) -> T | None:
        """``build`` returns (object, None) or (None, reason); an exception counts as a failed build."""
        with self._lock:
            if self._value is not None or self.error is not None:
                return self._value
            reason = why_unavailable()
            if reason is None:
                try:
                    self._value, reason = build()
                except Exception as exc:  # noqa: BLE001 - any build/load problem means "use the fallback"
                    reason = f"building the extension failed: {type(exc).__name__}: {str(exc).strip()[-2000:]}"
            if self._value is None:
                self.error = reason or "unknown reason"
                log.warning("%s unavailable: %s", self._what, self.error)
            return self._value

    def load(self, make: Callable[[], T], self_test: Callable[[T], str | None] | None = None) -> T | None:
        """:meth:`get` for the common case: build with ``make``; keep the object only if ``self_test``
        (when given) returns no reason."""
        def build() -> tuple[T | None, str | None]:
            value = make()
            reason = self_test(value) if self_test is not None else None
            return (None, reason) if reason else (value, None)
        return self.get(build)
