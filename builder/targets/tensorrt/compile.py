"""Compile a rank's ONNX segments into TensorRT engines, ahead of time, with no GPU needed.

Datacenter TensorRT (`import tensorrt`) is used where it is importable; otherwise TensorRT for RTX
(`import tensorrt_rtx_bindings`, PyPI tensorrt-rtx-cu13-*), which compiles for the compute
capabilities it lists (7.5, 8.0, 8.6, 8.9, 12.0, 12.1) on a machine without a CUDA device. A plan
whose GPU no installed TensorRT can target stops with one line naming what to install; `--onnx-only`
then writes the verified ONNX, and `engine-build compile DIR` finishes the build on a GPU host.

Every segment is parsed by TensorRT's ONNX parser into a strongly typed network (the ONNX types are
the engine's types), given one optimization profile from the plan's limits, and built with a timing
cache shared by the build's segments (datacenter TensorRT; TensorRT-RTX has none).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from builder.errors import KilnError
from runtime.engine_format import TENSORRT_RTX_TARGETS as RTX_TARGETS


@dataclass(frozen=True)
class Toolchain:
    flavour: str       # "tensorrt" or "tensorrt-rtx"
    version: str
    module: object
    targets: tuple[str, ...] | None  # compute capabilities it compiles for without a GPU (None: the local GPU's)

    def record(self) -> dict:
        return {"flavour": self.flavour, "version": self.version}


def find_toolchain(compute_capability: str) -> Toolchain:
    """The installed TensorRT that can build for `compute_capability`, or a KilnError naming what to install."""
    found = []
    try:
        import tensorrt
        found.append(Toolchain("tensorrt", tensorrt.__version__, tensorrt, None))
    except ImportError:
        pass
    try:
        import tensorrt_rtx_bindings
        found.append(Toolchain("tensorrt-rtx", tensorrt_rtx_bindings.__version__, tensorrt_rtx_bindings,
                               tuple(RTX_TARGETS)))
    except ImportError:
        pass
    for chain in found:
        if chain.targets is None or compute_capability in chain.targets:
            return chain
    have = ", ".join(f"{c.flavour} {c.version}" for c in found) or "no TensorRT"
    wanted = ("TensorRT-RTX: pip install -e \".[tensorrt]\"" if compute_capability in RTX_TARGETS
              else "datacenter TensorRT (pip install tensorrt-cu13 on a host with NVIDIA's index and a GPU)")
    raise KilnError(f"tensorrt: compute capability {compute_capability} cannot be compiled here ({have} installed); "
                    f"install {wanted}, or pass --onnx-only and run `engine-build compile DIR` on a GPU host")


@dataclass(frozen=True)
class Profile:
    """The dimensions a step may have (min, opt, max), from the plan's limits."""

    max_num_tokens: int
    max_batch_size: int
    max_seq_len: int
    block_size: int
    max_blocks: int   # KV blocks a pool may hold

    def shape(self, dims: list) -> tuple[tuple, tuple, tuple]:
        bounds = {"T": (1, min(64, self.max_num_tokens), self.max_num_tokens),
                  "N": (1, min(8, self.max_batch_size), self.max_batch_size),
                  "S": (1, min(8, self.max_batch_size), self.max_batch_size),
                  "S1": (2, min(9, self.max_batch_size + 1), self.max_batch_size + 1),
                  "B": (1, 8, math.ceil(self.max_seq_len / self.block_size)),
                  "blocks": (1, self.max_blocks, self.max_blocks)}
        picks = [bounds[d] if isinstance(d, str) else (d, d, d) for d in dims]
        return tuple(tuple(p[i] for p in picks) for i in range(3))


def compile_segments(onnx_dir: Path, segments: list[str], chain: Toolchain, compute_capability: str,
                     profile: Profile, timing_cache: Path | None = None) -> tuple[list[bytes], list[float]]:
    """Serialized engines of the segments (in order) and each one's build time in seconds."""
    trt = chain.module
    logger = _logger(trt)
    builder = trt.Builder(logger)
    cache_bytes = timing_cache.read_bytes() if timing_cache and timing_cache.is_file() else b""
    engines, seconds = [], []
    config_cache = None
    for name in segments:
        started = time.perf_counter()
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(onnx_dir / name)):
            errors = "; ".join(str(parser.get_error(i).desc()) for i in range(parser.num_errors))
            raise KilnError(f"tensorrt: {chain.flavour} {chain.version} cannot parse {onnx_dir / name}: {errors}")
        config = builder.create_builder_config()
        if chain.targets is not None:
            config.num_compute_capabilities = 1
            config.set_compute_capability(getattr(trt.ComputeCapability, RTX_TARGETS[compute_capability]), 0)
        if chain.flavour == "tensorrt":  # TensorRT-RTX has no timing cache (its calls are no-ops since 1.2)
            if config_cache is None:
                config_cache = config.create_timing_cache(cache_bytes)
            config.set_timing_cache(config_cache, ignore_mismatch=False)
        optimization = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            dims = _dims(onnx_dir / name, tensor.name)
            optimization.set_shape(tensor.name, *profile.shape(dims))
        config.add_optimization_profile(optimization)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            said = "; ".join(logger.errors[-3:]) or "no message"
            raise KilnError(f"tensorrt: {chain.flavour} {chain.version} could not build {onnx_dir / name} for "
                            f"compute capability {compute_capability}: {said}")
        engines.append(bytes(serialized))
        seconds.append(time.perf_counter() - started)
    if timing_cache is not None and config_cache is not None:
        timing_cache.write_bytes(bytes(config_cache.serialize()))
    return engines, seconds


def _logger(trt):
    """TensorRT's messages of error severity, kept for the one-line error; its complaint that no CUDA
    driver is present is expected when compiling ahead of time and dropped."""

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, message):
            if severity <= trt.ILogger.Severity.ERROR and "CUDA driver version is insufficient" not in message:
                self.errors.append(" ".join(message.split())[:300])

    return Logger()


def _dims(path: Path, name: str) -> list:
    """The ONNX dims of a graph input: ints, or the symbols the lowering uses (T, N, S, S1, B, blocks)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for value in model.graph.input:
        if value.name == name:
            return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
    raise KilnError(f"tensorrt: {path} has no input {name!r}")
