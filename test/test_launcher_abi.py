"""The torch bindings (cuda/*_op.cpp) reach their kernels' launchers through extern "C" declarations, which the
linker matches by name alone: a launcher whose parameters changed in a kernel source but not in the binding (or in
the CUDA source but not its HIP port) still links, and then reads its arguments wrongly (on ROCm, where nothing runs
in CI, silently). Each declaration must match the definitions in the CUDA source and in the HIP port."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# binding -> the kernel sources it is linked with (infer/ops: CUDA_SOURCES, HIP_SOURCES)
BINDINGS = {
    "rwkv7_fused_op.cpp": ("cuda/rwkv7_fused.cu", "hip/rwkv7_fused.hip"),
    "wkv7_slots_op.cpp": ("cuda/wkv7_slots.cu", "hip/wkv7_slots.hip"),
    "sampler_op.cpp": ("cuda/sampler.cu", "hip/sampler.hip"),
    "w8a16_gemm_op.cpp": ("cuda/w8a16_gemm.cu", "hip/w8a16_gemm.hip"),
    "rwkv7_step_op.cpp": ("cuda/rwkv7_step.cu",),  # CUDA only (infer/ops/persistent.py)
}
# extern "C" RESULT NAME(PARAMETERS) followed by ';' (a declaration) or '{' (a definition)
EXTERN_C = re.compile(r'extern "C"\s+([\w\s*]+?)\s*\b(\w+)\s*\(([^)]*)\)\s*([;{])')
NAMED = re.compile(r"^(.*[\s*&])(\w+)$")  # a parameter's type and name
TYPE_WORDS = {"int", "char", "short", "long", "unsigned", "signed", "float", "double", "bool", "void", "int64_t",
              "int32_t", "uint32_t", "uint64_t", "size_t"}  # a last word that is one of these is no name


def signature(result: str, parameters: str) -> tuple[str, ...]:
    """(result type, parameter types...) with names dropped (the HIP port's stubs leave them out) and spacing
    normalized."""
    def norm(text: str) -> str:
        return re.sub(r"\s*\*\s*", "* ", " ".join(text.split())).strip()

    types = []
    for parameter in filter(None, (p.strip() for p in parameters.split(","))):
        named = NAMED.match(parameter)
        types.append(norm(named.group(1) if named and named.group(2) not in TYPE_WORDS else parameter))
    return (norm(result), *types)


def externs(path: Path, kind: str) -> dict[str, tuple[str, ...]]:
    """The extern "C" declarations (kind ';') or definitions (kind '{') in ``path``, by name."""
    found = {}
    text = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S))  # comments out
    for result, name, parameters, end in EXTERN_C.findall(text):
        if end == kind:
            assert name not in found, f"{path.name}: {name} twice"
            found[name] = signature(result, parameters)
    return found


@pytest.mark.parametrize("binding", BINDINGS)
def test_launcher_declarations_match_both_sources(binding):
    declared = externs(ROOT / "cuda" / binding, ";")
    assert declared, f"{binding}: no launcher declarations found"
    for source in BINDINGS[binding]:
        defined = externs(ROOT / source, "{")
        for name, want in declared.items():
            assert name in defined, f"{source} does not define {name}, which {binding} calls"
            assert defined[name] == want, f"{name}: {binding} declares {want}, {source} defines {defined[name]}"


def test_signature_parsing_sees_a_changed_type():
    """The comparison is of types, not text: names and spacing may differ, a type may not."""
    assert signature("int", "int device, const void* const* w") == signature("int ", "int d,const void *const *ws")
    assert signature("int", "int device, int64_t n, const void* p") == signature("int", "int, int64_t, const void*")
    assert signature("int", "int device, int64_t n") != signature("int", "int device, int n")
    assert signature("int", "const void* x") != signature("int", "void* x")
