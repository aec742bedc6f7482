"""Builds a kernel source file for the CPU emulation of this folder (see emu_device.h) as a shared
library that ctypes loads.

The kernel file is compiled as it is, with two textual adaptations of host-side or clang-only code:
- it is cut before its first ``extern "C"`` (the launchers: the harness launches the kernels itself,
  one block after another with threadIdx/blockIdx set per block);
- a ``kernel<<<grid, block, smem, stream>>>(args)`` launch in a helper above that point becomes a call
  of ``emu::no_launch(grid, block, smem, stream, kernel, args)`` (g++ cannot parse ``<<<``), and clang's
  ``typedef unsigned int X __attribute__((ext_vector_type(4)))`` becomes ``typedef emu::u32x4 X``.
Everything else (the kernels, the device helpers, cuda/wkv7_state.cuh) is compiled unchanged.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

EMU = Path(__file__).resolve().parent
ROOT = EMU.parent.parent

LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;()]*>)?)<<<(.*?)>>>\(", re.S)
EXT_VECTOR = re.compile(r"typedef\s+unsigned\s+int\s+(\w+)\s+__attribute__\(\(ext_vector_type\(4\)\)\);")
CXX_FLAGS = ["-std=c++20", "-O2", "-shared", "-fPIC", "-fno-strict-aliasing", "-fvisibility=hidden", "-Wall",
             "-Wno-unknown-pragmas", "-Wno-unused-function", "-Wno-unused-variable"]


def compiler() -> str | None:
    return shutil.which("g++")


def usable(work: Path) -> str | None:
    """None when g++ with C++20 and <ucontext.h> is there, else why not."""
    cxx = compiler()
    if cxx is None:
        return "g++ not found"
    probe = work / "probe.cpp"
    probe.write_text("#include <ucontext.h>\nint main() { ucontext_t c; return getcontext(&c); }\n")
    if subprocess.run([cxx, "-std=c++20", str(probe), "-o", str(work / "probe")], capture_output=True).returncode:
        return "g++ without C++20 or <ucontext.h>"
    return None


def kernel_text(source: str) -> str:
    """The kernel file ``source`` (relative to the repository) as the emulation compiles it."""
    text = (ROOT / source).read_text()
    text = text[:text.index('extern "C"')]
    text = LAUNCH.sub(lambda m: f"emu::no_launch({m.group(2)}, {m.group(1)}, ", text)
    if "ext_vector_type" in text:
        text, n = EXT_VECTOR.subn(r"typedef emu::u32x4 \1;", text)
        assert n and "ext_vector_type" not in text, f"{source}: an ext_vector_type the emulation does not know"
    return text


def build_command(source: str, harness: str, warp: int, work: Path, name: str, defines=()) -> tuple[list[str], Path]:
    """Writes the adapted source of ``source`` into ``work``; the g++ command that builds it with the
    harness ``harness`` (a file of this folder) into ``work/name.so``."""
    part = work / f"{name}.inc"
    part.write_text(kernel_text(source))
    lib = work / f"{name}.so"
    include_dir = (ROOT / source).parent  # for the kernel file's own "..." includes (cuda/wkv7_state.cuh)
    cmd = [compiler(), *CXX_FLAGS, f"-I{EMU}", f"-I{include_dir}", f"-DEMU_WARP={warp}",
           f'-DKERNEL_SOURCE="{part}"', *[f"-D{d}" for d in defines], str(EMU / harness), "-o", str(lib)]
    return cmd, lib


def build_all(jobs: dict[str, tuple[list[str], Path]]) -> dict[str, Path]:
    """Runs the build commands concurrently; AssertionError with the compiler's output on a failure."""
    procs = {name: (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), lib)
             for name, (cmd, lib) in jobs.items()}
    out = {}
    for name, (proc, lib) in procs.items():
        log, _ = proc.communicate()
        assert proc.returncode == 0, f"emulation build of {name} failed:\n{log[-6000:]}"
        out[name] = lib
    return out
