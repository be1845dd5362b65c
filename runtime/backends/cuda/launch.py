"""How the cuda backend launches its Triton kernels: one call site, three launchers.

A kernel is a plain Python function in runtime/backends/cuda/kernels/, written in Triton and registered with
`@kernel(...)`. Host code calls `launcher.launch(kernel, grid, args, **constexprs)`; what happens then is the
launcher's choice:

- `CubinLauncher` (a GPU host): looks the variant up among the cubins `engine-build` compiled into the engine
  and launches it through the CUDA driver (cuda-python). No compiler is needed at serving time.
- `InterpreterLauncher` (any host, TRITON_INTERPRET-style): runs the same function on CPU tensors with Triton's
  interpreter. CI runs the kernels and the whole backend this way.
- `RecordingLauncher` (the build): runs nothing and records each variant asked for, over `meta` tensors, so the
  build compiles exactly the variants the executor will launch.

A variant is a kernel with its constexprs and the types of its other arguments (tensor dtypes, int, float);
`Variant.key` names it in the engine's kernel index. Every pointer is compiled as 16-byte aligned and every
launcher checks that, so a misaligned view fails in CI rather than on the GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

POINTER_TYPES = {
    torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float8_e4m3fn: "*fp8e4nv",
    torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8", torch.int8: "*i8", torch.int16: "*i16",
}
ALIGNMENT = 16  # bytes; pointers are compiled with this divisibility


class KernelError(RuntimeError):
    """A kernel cannot be launched here (a variant the engine lacks, a misaligned tensor, no GPU runtime)."""


class MissingVariant(KernelError):
    """The engine holds no compiled form of a kernel variant asked for (it was built without it)."""


@dataclass(frozen=True)
class Kernel:
    """A Triton kernel: its Python function (never decorated, so it can be compiled or interpreted) and launch
    options."""

    fn: Callable
    num_warps: int = 4
    num_stages: int = 2

    @property
    def name(self) -> str:
        return self.fn.__name__

    @property
    def module(self) -> str:
        return self.fn.__module__

    def arg_names(self) -> list[str]:
        return list(self._params)

    @functools.cached_property
    def _params(self) -> tuple[str, ...]:
        code = self.fn.__code__
        return code.co_varnames[:code.co_argcount]


def kernel(num_warps: int = 4, num_stages: int = 2) -> Callable[[Callable], Kernel]:
    """Register a Triton kernel function (see the module doc); its constexpr parameters are annotated
    `tl.constexpr` and passed to launch() by keyword."""
    return lambda fn: Kernel(fn, num_warps, num_stages)


@dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel: constexprs fixed, argument types fixed."""

    module: str
    name: str
    constexprs: tuple[tuple[str, object], ...]   # (name, value), in the function's order
    signature: tuple[tuple[str, str], ...]       # (name, Triton type) of the runtime arguments, in order
    num_warps: int
    num_stages: int

    @functools.cached_property
    def key(self) -> str:
        """A stable, readable name for the index: kernel + a digest of everything that shapes the binary."""
        doc = json.dumps([self.module, self.name, self.constexprs, self.signature, self.num_warps, self.num_stages])
        return f"{self.name}.{hashlib.sha256(doc.encode()).hexdigest()[:16]}"

    def to_dict(self) -> dict:
        return {"module": self.module, "name": self.name, "constexprs": [list(c) for c in self.constexprs],
                "signature": [list(s) for s in self.signature], "num_warps": self.num_warps,
                "num_stages": self.num_stages}

    @staticmethod
    def from_dict(doc: dict) -> Variant:
        return Variant(doc["module"], doc["name"], tuple((k, v) for k, v in doc["constexprs"]),
                       tuple((k, t) for k, t in doc["signature"]), int(doc["num_warps"]), int(doc["num_stages"]))


def arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        if value.dtype not in POINTER_TYPES:
            raise KernelError(f"no kernel pointer type for {value.dtype}")
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise KernelError(f"kernel argument of type {type(value).__name__} ({value!r}) is not a tensor, int or float")


_VARIANTS: dict[tuple, Variant] = {}  # (kernel, argument types, constexprs as given) -> its variant


def variant_of(k: Kernel, args: Sequence, constexprs: dict) -> Variant:
    """The variant a launch asks for. Memoized: an eager step launches a few hundred kernels, and working the
    variant (and its key's digest) out again each time cost about 40 us a launch on the host."""
    types = tuple(arg_type(a) for a in args)
    memo = (k, types, tuple(constexprs.items()))
    v = _VARIANTS.get(memo)
    if v is None:
        v = _VARIANTS[memo] = _variant(k, types, constexprs)
    return v


def _variant(k: Kernel, types: tuple[str, ...], constexprs: dict) -> Variant:
    names = k.arg_names()
    runtime = [n for n in names if n not in constexprs]
    if len(runtime) != len(types):
        raise KernelError(f"{k.name}: {len(types)} arguments given, the kernel takes {len(runtime)} "
                          f"({', '.join(runtime)}) besides the constexprs")
    unknown = set(constexprs) - set(names)
    if unknown:
        raise KernelError(f"{k.name}: no parameter named {', '.join(sorted(unknown))}")
    return Variant(k.module, k.name, tuple((n, _plain(constexprs[n])) for n in names if n in constexprs),
                   tuple(zip(runtime, types)), k.num_warps, k.num_stages)


def _plain(value):
    """A constexpr as JSON keeps it (a torch dtype or a Triton dtype is refused: pass a string or int)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise KernelError(f"constexpr value {value!r} must be a bool, int, float or string")


def _check_aligned(k: Kernel, args: Sequence) -> None:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.device.type != "meta" and a.numel() and a.data_ptr() % ALIGNMENT:
            raise KernelError(f"{k.name}: argument {k.arg_names()[i]} is not {ALIGNMENT}-byte aligned "
                              f"(a view at an odd offset); the compiled kernels assume it")


Grid = tuple[int, ...]


class Launcher:
    """launch(kernel, grid, args, **constexprs): runs one kernel over a grid of programs."""

    device: torch.device
    allowed: set[str] | None = None   # variant keys the engine holds (None: any)

    def launch(self, k: Kernel, grid: Grid, args: Sequence, **constexprs) -> None:
        raise NotImplementedError

    def _checked(self, k: Kernel, grid: Grid, args: Sequence, constexprs: dict) -> Variant | None:
        """The variant, after the checks every launcher makes; None when the grid is empty."""
        v = variant_of(k, args, constexprs)
        _check_aligned(k, args)
        if self.allowed is not None and v.key not in self.allowed:
            raise MissingVariant(f"kernel {v.name} ({dict(v.constexprs)}, {[t for _, t in v.signature]}) is not among "
                              "the engine's compiled kernels; rebuild the engine with this Kiln")
        if any(g <= 0 for g in grid):
            return None
        return v


@dataclass
class RecordingLauncher(Launcher):
    """Records the variants asked for and runs nothing (the build's dry run over meta tensors)."""

    device: torch.device = torch.device("meta")
    seen: dict[str, Variant] = field(default_factory=dict)
    kernels: dict[str, Kernel] = field(default_factory=dict)

    def launch(self, k: Kernel, grid: Grid, args: Sequence, **constexprs) -> None:
        v = variant_of(k, args, constexprs)
        self.seen.setdefault(v.key, v)
        self.kernels.setdefault(v.key, k)


@dataclass
class InterpreterLauncher(Launcher):
    """Runs kernels on CPU tensors with Triton's interpreter (needs the `gpu` extra's triton)."""

    device: torch.device = torch.device("cpu")
    allowed: set[str] | None = None
    launched: dict[str, int] = field(default_factory=dict)   # variant key -> launches
    _fns: dict[Callable, object] = field(default_factory=dict)

    def launch(self, k: Kernel, grid: Grid, args: Sequence, **constexprs) -> None:
        v = self._checked(k, grid, args, constexprs)
        if v is None:
            return
        fn = self._fns.get(k.fn)
        if fn is None:
            from triton.runtime.interpreter import InterpretedFunction

            fn = self._fns[k.fn] = InterpretedFunction(k.fn)
        self.launched[v.key] = self.launched.get(v.key, 0) + 1
        with _language_restored(), _interpreted_library():
            fn[tuple(grid)](*args, **constexprs, num_warps=k.num_warps)


@contextlib.contextmanager
def _language_restored():
    """Undo every change the interpreter makes to triton.language while a kernel runs.

    The interpreter swaps the language's functions for interpreted ones during a launch, and a call from one jit
    function into another swaps them again without putting them back: a kernel compiled later in the same process
    (a build after an interpreted run: the tests, benchmarks/moe_check.py --interpret) then failed to compile."""
    import triton.language as tl

    objects = {id(o): o for o in (tl, tl.core, tl.math, tl.tensor, tl.core.tensor, tl.core.tensor_descriptor_base)}
    saved = [(o, dict(vars(o))) for o in objects.values()]
    try:
        yield
    finally:
        for obj, before in saved:
            now = dict(vars(obj))
            for name in now.keys() - before.keys():
                delattr(obj, name)
            for name, value in before.items():
                if now.get(name, before) is not value:
                    setattr(obj, name, value)


@contextlib.contextmanager
def _interpreted_library():
    """Let an interpreted kernel call Triton's own library functions (tl.sum, tl.max, ...).

    Triton decides at import whether `@triton.jit` functions are compiled or interpreted (TRITON_INTERPRET); Kiln
    imports it for compiling, so its library functions are JITFunctions, which refuse calls from Python. While a
    kernel is interpreted here they run as interpreted functions instead, so one process can both compile kernels
    (a build) and interpret them (its checks, the tests). Also works around two interpreter faults the GPU does
    not have: its bf16 dot (widened_dot) and its float narrowing (rounded).
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    original, dot, convert = JITFunction.__call__, interpreter.InterpreterBuilder.create_dot, interpreter._convert_float
    floats = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
              tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    bits = {32: torch.int32, 16: torch.int16, 8: torch.uint8}

    def rounded(data, src, dst, rounding_mode):
        """Float to float as the GPU's cvt.rn does it (round to nearest even, carrying into the exponent); the
        interpreter's own conversion truncates to bf16 and loses fp8 carries (124.0 -> 64)."""
        if src not in floats or dst not in floats:
            return convert(data, src, dst, rounding_mode)
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.dtype(f"u{src.primitive_bitwidth // 8}")).copy())
        value = raw.view(bits[src.primitive_bitwidth]).view(floats[src])
        out = value.to(floats[dst]).view(bits[dst.primitive_bitwidth]).numpy()
        return out.view(np.dtype(f"u{dst.primitive_bitwidth // 8}"))

    def widened_dot(self, a, b, *rest):
        """Triton 3.9's interpreter keeps bf16 as uint16 and multiplies those raw bits in tl.dot; widen them to f32
        first (exact: a bf16 is an f32's top half), as the GPU's bf16 MMA computes."""
        a, b = (interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
                if h.dtype == tl.bfloat16 else h for h in (a, b))
        return dot(self, a, b, *rest)

    def call(self, *args, **kwargs):
        interpreted = _INTERPRETED.get(self.fn)
        if interpreted is None:
            interpreted = _INTERPRETED[self.fn] = InterpretedFunction(self.fn)
        return interpreted(*args, **kwargs)

    JITFunction.__call__, interpreter.InterpreterBuilder.create_dot, interpreter._convert_float = (
        call, widened_dot, rounded)
    try:
        yield
    finally:
        JITFunction.__call__, interpreter.InterpreterBuilder.create_dot, interpreter._convert_float = (
            original, dot, convert)


_INTERPRETED: dict[Callable, object] = {}


@dataclass(frozen=True)
class CompiledKernel:
    """A cubin of one variant, as the engine stores it (runtime/backends/cuda/kernel_index.py reads them)."""

    variant: Variant
    function: str            # the entry point's name in the cubin
    num_warps: int
    shared: int              # dynamic shared memory, bytes
    num_params: int          # the entry point's parameters: the runtime arguments, then Triton's scratch pointers
    global_scratch: int      # bytes per program, 0 for none
    cubin: bytes


class CubinLauncher(Launcher):
    """Launches an engine's cubins on the current CUDA device through the driver API (cuda-python)."""

    def __init__(self, compiled: dict[str, CompiledKernel], device: torch.device):
        try:
            from cuda.bindings import driver
        except ImportError:
            raise KernelError("the cuda backend needs cuda-python on the serving host: "
                              "pip install 'kiln[gpu]'") from None
        if device.type == "cuda" and device.index is None:  # tensors report cuda:N, never bare cuda
            device = torch.device("cuda", torch.cuda.current_device())
        self.driver, self.device, self.compiled = driver, device, compiled
        self.allowed = set(compiled)
        self._functions: dict[str, object] = {}
        self._modules: list = []

    def _function(self, key: str):
        f = self._functions.get(key)
        if f is None:
            ck = self.compiled[key]
            torch.cuda.init()  # the primary context torch uses is current on this thread
            module = self._call("cuModuleLoadData", ck.cubin)
            self._modules.append(module)
            f = self._call("cuModuleGetFunction", module, ck.function.encode())
            if ck.shared > 48 * 1024:
                attr = self.driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                self._call("cuFuncSetAttribute", f, attr, ck.shared)
            self._functions[key] = f
        return f

    def _call(self, name: str, *args):
        result = getattr(self.driver, name)(*args)
        err, rest = result[0], result[1:]
        if err != self.driver.CUresult.CUDA_SUCCESS:
            raise KernelError(f"CUDA driver {name} failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    def launch(self, k: Kernel, grid: Grid, args: Sequence, **constexprs) -> None:
        v = self._checked(k, grid, args, constexprs)
        if v is None:
            return
        ck = self.compiled[v.key]
        values, types = [], []
        for a, (_, t) in zip(args, v.signature):
            if isinstance(a, torch.Tensor):
                if a.device != self.device:
                    raise KernelError(f"{k.name}: a tensor on {a.device}, the kernel runs on {self.device}")
                values.append(a.data_ptr()), types.append(ctypes.c_void_p)
            elif t == "fp32":
                values.append(a), types.append(ctypes.c_float)
            elif t == "i64":
                values.append(a), types.append(ctypes.c_int64)
            else:
                values.append(int(a)), types.append(ctypes.c_int32)
        scratch = None
        extra = ck.num_params - len(values)
        if ck.global_scratch:
            scratch = torch.empty(ck.global_scratch * math.prod(grid), dtype=torch.uint8, device=self.device)
        for i in range(extra):
            values.append(scratch.data_ptr() if (i == 0 and scratch is not None) else 0)  # NULL: cuda-bindings 13 takes no None
            types.append(ctypes.c_void_p)
        g = tuple(grid) + (1,) * (3 - len(grid))
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._call("cuLaunchKernel", self._function(v.key), *g, 32 * ck.num_warps, 1, 1, ck.shared, stream,
                   (tuple(values), tuple(types)), 0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
