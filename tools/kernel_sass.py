"""A Triton kernel's sm_90 SASS, built without a GPU: registers, spills, shared memory, opcodes.

    python -m tools.kernel_sass                                   # list the configurations
    python -m tools.kernel_sass "decode fp8" --num-warps 4 --num-stages 2 [--sass FILE]
    python -m tools.kernel_sass "decode fp8" --set BLOCK_N=64 --loops   # a constexpr changed
    python -m tools.kernel_sass "decode fp8, from qkv" --maxnreg 128 --no-fp-fusion
    python -m tools.kernel_sass "decode fp8" --shared      # shared-memory buffers and swizzles"""

import argparse
import ast
import collections
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not for the interpreter

OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")
ADDRESSED = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")
BACKWARD = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?BRA\s+(?:`?\(?)(0x[0-9a-f]+)")


def compile_for_sm90(config: tuple, num_warps: int, num_stages: int,
                     divisible: tuple[str, ...] = (), maxnreg: int | None = None,
                     fp_fusion: bool = True):
    """Pointers and strides get the runtime's alignment specializations, as do the integer
    arguments named in `divisible`: without them the SASS misleads."""
    import triton
    from triton.backends.compiler import GPUTarget

    from tests.kernels.test_kernels_compile_for_gpu import kernel_source

    options = dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=fp_fusion)
    options |= {"maxnreg": maxnreg} if maxnreg else {}
    source = kernel_source(*config, aligned=True, divisible=divisible)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="a configuration name (none: list them)")
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--top", type=int, default=30, help="instructions to list")
    parser.add_argument("--sass", help="also write the whole SASS to this file")
    parser.add_argument("--divisible", default="",
                        help="integer arguments that are multiples of 16 at run time, "
                             "comma-separated (e.g. K,k_per_split for the skinny GEMM)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override a constexpr of the configuration (a Python literal)")
    parser.add_argument("--no-fp-fusion", action="store_true",
                        help="no FMA contraction, as the q/k norm + RoPE and from-qkv decode "
                             "kernels launch")
    parser.add_argument("--maxnreg", type=int,
                        help="registers a thread may use (the fp8 decode kernel launches with "
                             "decode.FP8_MAX_REGISTERS)")
    parser.add_argument("--loops", action="store_true",
                        help="also histogram each loop body (a backward branch's range)")
    parser.add_argument("--shared", action="store_true",
                        help="also list the shared-memory buffers and their layouts, from TTGIR")
    return parser.parse_args()


def print_histogram(opcodes, top: int):
    for opcode, count in collections.Counter(opcodes).most_common(top):
        print(f"{count:6d}  {opcode}")


def main():
    args = parse_args()
    from tests.kernels.test_kernels_compile_for_gpu import configurations

    configs = configurations()
    if args.config not in configs:
        print("configurations:\n  " + "\n  ".join(configs))
        return
    divisible = tuple(name for name in args.divisible.split(",") if name)
    module, kernel, pointers, floats, constexprs = configs[args.config]
    for assignment in args.set:
        name, value = assignment.split("=", 1)
        constexprs = {**constexprs, name: ast.literal_eval(value)}
    compiled = compile_for_sm90((module, kernel, pointers, floats, constexprs), args.num_warps,
                                args.num_stages, divisible, args.maxnreg,
                                fp_fusion=not args.no_fp_fusion)
    sass = cuobjdump(compiled.asm["cubin"], "-sass")
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)
    usage = re.search(r"REG:\d+ STACK:\d+", cuobjdump(compiled.asm["cubin"], "-res-usage"))
    opcodes = OPCODE.findall(sass)
    print(f"{args.config}: {usage.group(0) if usage else '?'} shared {compiled.metadata.shared} "
          f"bytes, {len(opcodes)} instructions (num_warps {args.num_warps}, "
          f"num_stages {args.num_stages})")
    print_histogram(opcodes, args.top)
    if args.shared:
        for shape, layout in shared_buffers(compiled.asm["ttgir"]):
            print(f"shared buffer {shape}: {layout}")
    if args.loops:
        for start, end, body in loop_bodies(sass):
            print(f"loop {start:#x}..{end:#x}: {len(body)} instructions an iteration")
            print_histogram(body, args.top)


def shared_buffers(ttgir: str) -> list[tuple[str, str]]:
    """(shape and dtype, layout) of each shared-memory buffer the TTGIR allocates. An unswizzled
    buffer (vec = 1, maxPhase = 1) read as an MMA operand may conflict on the banks."""
    layouts = dict(re.findall(r"^(#shared\d*) = (.*)$", ttgir, re.M))
    alloc = r"ttg\.local_alloc[^\n]*?!ttg\.memdesc<([0-9x]+[a-zA-Z0-9]+), (#shared\d*)"
    buffers = re.findall(alloc, ttgir)
    return [(shape, layouts.get(name, name)) for shape, name in buffers]


def loop_bodies(sass: str) -> list[tuple[int, int, list[str]]]:
    """(start, end, opcodes) of each backward branch's range: a loop body."""
    instructions = [(int(address, 16), opcode) for address, opcode in ADDRESSED.findall(sass)]
    loops = []
    for address, target in BACKWARD.findall(sass):
        start, end = int(target, 16), int(address, 16)
        if start < end:
            loops.append((start, end, [op for at, op in instructions if start <= at <= end]))
    return loops


if __name__ == "__main__":
    main()
