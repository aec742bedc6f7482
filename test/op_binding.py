"""A kernel extension's real torch binding (cuda/*_op.cpp) built for the CPU, its CUDA launchers stubbed, so that
tests on the CPU check the Python that calls the ops against the binding's argument types: pybind refuses a call it
cannot convert with a TypeError (a default it cannot pass back, a list where it takes a tensor), which ops faked in
Python accept. The bindings refuse CPU tensors with a RuntimeError once their arguments have converted."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# extern "C" RETURN NAME(PARAMETERS);  (the launchers' plain C interface)
LAUNCHER_DECLARATION = re.compile(r'extern "C"\s+([\w\s*]+?)\s*\b(\w+)\s*\(([^;]*?)\)\s*;', re.S)


def launcher_stubs(binding_source: str) -> str:
    """Definitions of every launcher ``binding_source`` declares, each returning 0 (or an empty message)."""
    stubs = ["#include <cstdint>"]
    for result, name, parameters in LAUNCHER_DECLARATION.findall(binding_source):
        value = '""' if "char" in result else "0"
        stubs.append(f'extern "C" {result} {name}({parameters}) {{ return {value}; }}')
    if len(stubs) == 1:
        raise ValueError("no launcher declarations found")
    return "\n".join(stubs) + "\n"


def build_cpu_binding(binding: Path, directory: Path):
    """Compile ``binding`` with stubbed launchers into ``directory`` (needs a C++ compiler and ninja)."""
    from torch.utils.cpp_extension import load
    stubs = directory / f"{binding.stem}_launcher_stubs.cpp"
    stubs.write_text(launcher_stubs(binding.read_text()))
    return load(name=f"{binding.stem}_cpu", sources=[str(binding), str(stubs)], extra_cflags=["-O0"],
                build_directory=str(directory), verbose=False)


class BindingCheckedOps:
    """Ops faked in Python, each call first made on the CPU-built binding: a TypeError there (arguments the real
    op does not take) fails the caller; the binding's RuntimeError on CPU tensors is expected."""

    def __init__(self, fake: Any, binding: Any) -> None:
        self._fake, self._binding = fake, binding

    def __getattr__(self, name: str):
        fake_op, bound_op = getattr(self._fake, name), getattr(self._binding, name)

        def call(*args, **kwargs):
            try:
                bound_op(*args, **kwargs)
            except RuntimeError:
                pass  # converted; the op's own checks refuse CPU tensors
            return fake_op(*args, **kwargs)

        return call
