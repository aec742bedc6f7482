"""Run fla-core's chunk_rwkv7 on the CPU through Triton's interpreter and compare FlaWKV with TorchWKV.

Used by test/test_wkv_fla.py in a subprocess (the interpreter must be switched on before Triton
compiles anything, and the patches below are process-wide). Prints one JSON line: per case, the
max |diff| of y and of the final states, relative to the reference's max |value|. (bf16 is left
out: under the interpreter its dots overflow in numpy and give garbage; bf16 is checked on a GPU.)

Three test-only patches make fla 0.6.0 run under ``TRITON_INTERPRET=1`` (Triton 3.9):
- the autotuner benchmarks configs through a GPU driver: keep the first config only;
- ``fla.ops.utils.op.gather`` is a bare alias of ``tl.gather``, which the interpreter does not
  patch in other modules: wrap it in a ``@triton.jit`` function;
- the interpreter leaves ``for i in range(n)`` loop variables as Python ints, but fla calls
  ``i_t.to(tl.int64)``: convert loop variables to interpreter tensors.
None of them changes what a kernel computes.

    TRITON_INTERPRET=1 python test/fla_interpret.py
"""
from __future__ import annotations

import ast
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore", message="Triton is not supported on current platform")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _gather(src, index, axis: tl.constexpr):
    return tl.gather(src, index, axis)


def enable_interpreter() -> None:
    import triton.runtime.autotuner as autotuner
    from triton.runtime import interpreter

    prune = autotuner.Autotuner.prune_configs

    def first_config(self, kwargs, *args, **kw):
        return prune(self, kwargs, *args, **kw)[:1]

    autotuner.Autotuner.prune_configs = first_config

    class LoopVarsAsTensors(interpreter.ASTTransformer):
        def visit_For(self, node):
            self.generic_visit(node)
            if isinstance(node.target, ast.Name):
                name = node.target.id
                to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                          attr="to_tensor", ctx=ast.Load())
                node.body.insert(0, ast.Assign(
                    targets=[ast.Name(id=name, ctx=ast.Store())],
                    value=ast.Call(func=to_tensor, args=[ast.Name(id=name, ctx=ast.Load()), ast.Constant(False)],
                                   keywords=[])))
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopVarsAsTensors()

    import fla.ops.generalized_delta_rule.dplr.chunk_A_fwd as chunk_a_fwd
    import fla.ops.generalized_delta_rule.dplr.wy_fast_fwd as wy_fast_fwd
    for module in (chunk_a_fwd, wy_fast_fwd):
        if module.gather is tl.gather:
            module.gather = _gather


def case(name: str, wkv, lens, H: int, act: torch.dtype, state_dtype: torch.dtype, seed: int,
         w_low: float = 0.545) -> dict:
    from infer.batch import PackedBatch
    from infer.ops.wkv import TorchWKV

    gen = torch.Generator().manual_seed(seed)
    N, T = 64, sum(lens)
    C = H * N
    slots = list(range(len(lens)))[::-1]                    # reversed: slot order != row order
    num_slots = len(lens) + 2                               # two slots outside the batch
    batch = PackedBatch.from_rows([[0] * n for n in lens], slots, "cpu")
    r, k, v = (torch.randn(T, C, generator=gen) for _ in range(3))
    w = w_low + (1 - w_low) * torch.rand(T, C, generator=gen)
    kk = F.normalize(torch.randn(T, H, N, generator=gen), dim=-1).view(T, C)
    gate = torch.rand(T, C, generator=gen)
    inputs = [r.to(act), w, k.to(act), v.to(act), (-kk).to(act), (kk * gate).to(act)]
    pool = (torch.randn(num_slots, H, N, N, generator=gen) * 0.3).to(state_dtype)
    ref_pool, got_pool = pool.clone(), pool.clone()
    ref_y = TorchWKV()(ref_pool, batch, *inputs)
    start = time.perf_counter()
    with torch.inference_mode():                            # as the model calls it
        got_y = wkv(got_pool, batch, *inputs)
    seconds = time.perf_counter() - start
    used = torch.tensor(slots)
    untouched = [s for s in range(num_slots) if s not in slots]
    return {
        "case": name, "seconds": round(seconds, 2), "y_dtype": str(got_y.dtype),
        "y_rel": ((got_y - ref_y).abs().max() / ref_y.abs().max()).item(),
        "state_rel": ((got_pool[used].float() - ref_pool[used].float()).abs().max()
                      / ref_pool[used].float().abs().max()).item(),
        "untouched_equal": bool(torch.equal(got_pool[untouched], pool[untouched])),
        "finite": bool(torch.isfinite(got_y).all() and torch.isfinite(got_pool).all()),
    }


def main() -> None:
    enable_interpreter()
    from infer.ops.wkv_fla import FlaWKV

    lens = [1, 17, 64, 100, 3, 16, 65]       # 1, exact chunk sizes, and lengths that are neither
    results = [
        case("fp32-chunk64", FlaWKV(chunk_size=64), lens, 2, torch.float32, torch.float32, seed=1),
        case("fp32-chunk16", FlaWKV(chunk_size=16), lens, 2, torch.float32, torch.float32, seed=2),
        case("fp32-chunk64-state16", FlaWKV(chunk_size=64), [40, 1, 70], 2, torch.float32, torch.float16, seed=3),
        case("fp16-chunk64", FlaWKV(chunk_size=64), lens, 2, torch.float16, torch.float32, seed=7),
        case("fp32-chunk64-onerow", FlaWKV(chunk_size=64), [130], 1, torch.float32, torch.float32, seed=4),
        # strong decays down to exp(LOG_DECAY_FLOOR) (fla's bound): still exact, still finite
        case("fp32-chunk64-strongdecay", FlaWKV(chunk_size=64), [70, 5], 1, torch.float32, torch.float32,
             seed=5, w_low=0.083),
        case("fp32-chunk16-strongdecay", FlaWKV(chunk_size=16), [70, 5], 1, torch.float32, torch.float32,
             seed=6, w_low=0.083),
    ]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
