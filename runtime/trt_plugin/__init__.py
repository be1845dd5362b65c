"""Kiln's TensorRT plugin library: kiln::PagedAttention, built from kiln_trt_plugins.cpp with g++.

The build compiles the library into the engine directory (`plugins/`, hashed in the manifest) and hands it to
TensorRT's plugin registry before parsing, so each attention node becomes the plugin rather than its reference
body. The runtime loads the engine's copy, registers the engine's compiled kernels with it
(`register_kernels`), then deserializes the engine.

TensorRT for RTX 1.7's ONNX parser opens `libtensorrt_rtx.so` by that name when it meets a plugin node, and
the wheel ships only `libtensorrt_rtx.so.1`: without a file of that name on the library path the parser
aborts the process. `shim_dir()` holds a link of that name; a process that parses plugin nodes must start
with it on LD_LIBRARY_PATH (the build compiles in such a subprocess).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (HERE / "kiln_trt_plugins.cpp", HERE / "kiln_trt_abi.h")
LIBRARY = "libkiln_trt_plugins.so"
FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-static-libstdc++", "-static-libgcc",
         "-Wl,--build-id=none")
# The letter the plugin reads each runtime argument as, from a Triton signature type.
ARG_LETTERS = {"i32": "i", "i64": "l", "fp32": "f"}


class PluginError(RuntimeError):
    pass


def source_digest() -> str:
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for path in SOURCES:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def build_library(out_dir: Path) -> Path:
    """Compile the plugin library into out_dir (g++); its path. A PluginError in one line if it cannot."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / LIBRARY
    cxx = os.environ.get("CXX", "g++")
    command = [cxx, *FLAGS, "-o", str(target), str(SOURCES[0]), "-ldl"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        raise PluginError(f"the tensorrt target compiles its plugin with a C++ compiler and {cxx} is not "
                          "installed (apt install g++, or set CXX)") from None
    if done.returncode != 0:
        first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:300])
        raise PluginError(f"compiling the TensorRT plugin failed: {first}")
    return target


def shim_dir() -> Path | None:
    """A directory holding `libtensorrt_rtx.so`, a link to TensorRT for RTX's library (None without it)."""
    try:
        import tensorrt_rtx_libs
    except ImportError:
        return None
    real = Path(tensorrt_rtx_libs.__file__).parent / "libtensorrt_rtx.so.1"
    if not real.is_file():
        return None
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kiln" / "trt-shim"
    root.mkdir(parents=True, exist_ok=True)
    link = root / "libtensorrt_rtx.so"
    if not link.exists() or link.resolve() != real.resolve():
        tmp = root / f".link.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(real)
        tmp.replace(link)
    return root


def shim_env(env: dict | None = None) -> dict:
    """The environment of a process that parses or runs plugin nodes with TensorRT for RTX."""
    env = dict(os.environ if env is None else env)
    shim = shim_dir()
    if shim is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(shim), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def load(library: Path, trt) -> ctypes.CDLL:
    """Load the library into this process and TensorRT's plugin registry; the ctypes handle."""
    handle = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    if not trt.get_plugin_registry().load_library(str(library)):
        raise PluginError(f"TensorRT could not load the plugin library {library}")
    handle.kiln_register_kernel.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int,
                                            ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    handle.kiln_register_kernel.restype = ctypes.c_int
    handle.kiln_last_error.restype = ctypes.c_char_p
    return handle


def arg_letters(signature) -> str:
    """The plugin's argument letters for a variant's runtime signature: p for a pointer, else by type."""
    return "".join("p" if t.startswith("*") else ARG_LETTERS[t] for _, t in signature)


def register_kernels(handle: ctypes.CDLL, compiled: dict) -> None:
    """Hand every compiled kernel (variant key -> CompiledKernel) to the plugins."""
    for key, ck in compiled.items():
        if ck.global_scratch:
            raise PluginError(f"kernel {key} needs Triton's global scratch, which the plugin does not provide")
        handle.kiln_register_kernel(key.encode(), ck.function.encode(), ck.num_warps, ck.shared, ck.num_params,
                                    arg_letters(ck.variant.signature).encode(), ck.cubin, len(ck.cubin))
