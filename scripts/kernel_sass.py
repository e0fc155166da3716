"""The SASS of a Triton kernel for an H100/H200 (sm_90), built on a machine without a GPU: registers,
stack (spills), shared memory and a histogram of instructions. It answers "are the loads 16 bytes wide,
which matrix instructions run, did anything spill" before any device time is spent.

    python scripts/kernel_sass.py                                    # list the configurations
    python scripts/kernel_sass.py "decode fp8" --num-warps 4 --num-stages 2 [--sass FILE]
    python scripts/kernel_sass.py "decode fp8" --set BLOCK_N=64 --loops  # a constexpr changed; per-iteration counts
    python scripts/kernel_sass.py "decode fp8, from qkv" --maxnreg 128 --no-fp-fusion  # launched as the engine does
    python scripts/kernel_sass.py "decode fp8" --shared       # its shared-memory buffers and their swizzles

The configurations are those of tests/test_kernels_compile_for_gpu.py. Arguments get the
specializations the runtime gives them: pointers and strides divisible by 16 (aligned tensors,
strides that are multiples of 16), and a stride of 1 where the configuration says so; integer
arguments only when named (--divisible K,k_per_split: the skinny GEMM at the Qwen3 shapes, whose
loads and pipelining look scalar without them). Without these the SASS misleads. The local Triton
may not be the device's (3.6 there), so confirm what matters with a GPU run. To build with the device's
Triton here: `pip download --no-deps triton==3.6.0 -d /tmp/t36 && pip install --no-deps --target
/tmp/t36env /tmp/t36/*.whl`, then run this script (or tests/test_kernels_compile_for_gpu.py) with
PYTHONPATH=/tmp/t36env:. (Triton 3.9 accepted a string constexpr with a default that 3.6 rejects:
BENCHMARKS.md, twenty-sixth session). Reading the fp8 decode kernel this way found V fetched from
shared memory byte by byte (128 `LDS.U8` per thread per tile; BENCHMARKS.md, seventh session).
`--loops` counts what one iteration of each loop issues: the fp8 decode kernel's 905 instructions a
warp per 128-key tile included 160 register moves that assembled q's MMA operand (seventeenth session;
the kernel now multiplies K q^T instead).
"""

import argparse
import ast
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not for the interpreter
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: tests/

from tests.test_kernels_compile_for_gpu import configurations, kernel_source  # noqa: E402

OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")
ADDRESSED = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")
BACKWARD = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?BRA\s+(?:`?\(?)(0x[0-9a-f]+)")


def compile_for_sm90(config: tuple, num_warps: int, num_stages: int, divisible: tuple[str, ...] = (),
                     maxnreg: int | None = None, fp_fusion: bool = True):
    import triton
    from triton.backends.compiler import GPUTarget

    options = dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=fp_fusion)
    options |= {"maxnreg": maxnreg} if maxnreg else {}
    return triton.compile(kernel_source(*config, aligned=True, divisible=divisible), target=GPUTarget("cuda", 90, 32),
                          options=options)


def cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="a configuration name (none: list them)")
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--top", type=int, default=30, help="instructions to list")
    parser.add_argument("--sass", help="also write the whole SASS to this file")
    parser.add_argument("--divisible", default="", help="integer arguments that are multiples of 16 at run time, "
                        "comma-separated (e.g. K,k_per_split for the skinny GEMM): without them its loads look scalar")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override a constexpr of the configuration (a Python literal), e.g. --set BLOCK_N=64")
    parser.add_argument("--no-fp-fusion", action="store_true",
                        help="no FMA contraction, as the q/k norm + RoPE kernel and the from-qkv decode kernel launch")
    parser.add_argument("--maxnreg", type=int, help="registers a thread may use, as a launch's maxnreg (the fp8 "
                        "decode kernel launches with triton_decode.FP8_MAX_REGISTERS)")
    parser.add_argument("--loops", action="store_true",
                        help="also histogram the instructions of each loop body (a backward branch's range)")
    parser.add_argument("--shared", action="store_true",
                        help="also list the kernel's shared-memory buffers and their layouts (swizzle), from its TTGIR")
    args = parser.parse_args()
    configs = configurations()
    if args.config not in configs:
        print("configurations:\n  " + "\n  ".join(configs))
        return
    divisible = tuple(name for name in args.divisible.split(",") if name)
    module, kernel, pointers, floats, constexprs = configs[args.config]
    for assignment in args.set:
        name, value = assignment.split("=", 1)
        constexprs = {**constexprs, name: ast.literal_eval(value)}
    compiled = compile_for_sm90((module, kernel, pointers, floats, constexprs), args.num_warps, args.num_stages,
                                divisible, args.maxnreg, fp_fusion=not args.no_fp_fusion)
    sass = cuobjdump(compiled.asm["cubin"], "-sass")
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)
    usage = re.search(r"REG:\d+ STACK:\d+", cuobjdump(compiled.asm["cubin"], "-res-usage"))
    opcodes = collections.Counter(OPCODE.findall(sass))
    print(f"{args.config}: {usage.group(0) if usage else '?'} shared {compiled.metadata.shared} bytes, "
          f"{sum(opcodes.values())} instructions (num_warps {args.num_warps}, num_stages {args.num_stages})")
    for opcode, count in opcodes.most_common(args.top):
        print(f"{count:6d}  {opcode}")
    if args.shared:
        for shape, layout in shared_buffers(compiled.asm["ttgir"]):
            print(f"shared buffer {shape}: {layout}")
    if args.loops:
        for start, end, body in loop_bodies(sass):
            print(f"loop {start:#x}..{end:#x}: {len(body)} instructions an iteration")
            for opcode, count in collections.Counter(body).most_common(args.top):
                print(f"{count:6d}  {opcode}")


def shared_buffers(ttgir: str) -> list[tuple[str, str]]:
    """(shape and dtype, layout) of each buffer the TTGIR allocates in shared memory. An MMA operand read from an
    unswizzled buffer (vec = 1, maxPhase = 1) can conflict on the banks at every read: a V cache loaded as a 3-D
    tile got one, and the fp8 decode kernel ran 1.5x slower (BENCHMARKS.md, thirtieth session)."""
    layouts = dict(re.findall(r"^(#shared\d*) = (.*)$", ttgir, re.M))
    buffers = re.findall(r"ttg\.local_alloc[^\n]*?!ttg\.memdesc<([0-9x]+[a-zA-Z0-9]+), (#shared\d*)", ttgir)
    return [(shape, layouts.get(name, name)) for shape, name in buffers]


def loop_bodies(sass: str) -> list[tuple[int, int, list[str]]]:
    """(start, end, opcodes) of each backward branch's range: a loop body, as the SASS lays it out."""
    instructions = [(int(address, 16), opcode) for address, opcode in ADDRESSED.findall(sass)]
    loops = []
    for address, target in BACKWARD.findall(sass):
        start, end = int(target, 16), int(address, 16)
        if start < end:
            loops.append((start, end, [opcode for at, opcode in instructions if start <= at <= end]))
    return loops


if __name__ == "__main__":
    main()
