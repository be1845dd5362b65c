"""The child process that compiles one rank's engine (builder/targets/tensorrt/compile.py's compile_rank).

Reads a JSON request on stdin, writes the serialized engine to request["out"] and one JSON line on stdout:
the record of the compile, or {"error": "..."} and exit status 1.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from builder.errors import KilnError
from builder.targets.tensorrt.compile import Profile, find_toolchain, logger, model_dims, rank_model
from builder.targets.tensorrt.onnx_attention import OP
from runtime.format.engine_format import TENSORRT_RTX_TARGETS as RTX_TARGETS
from runtime.trt_plugin import load

_KEEP: list = []  # arrays behind the network's constants, alive until the engine is built


def compile_request(request: dict) -> dict:
    started = time.perf_counter()
    directory = Path(request["directory"])
    cc, tp = request["compute_capability"], request["tp"]
    chain = find_toolchain(cc)
    trt = chain.module
    log = logger(trt)
    builder = trt.Builder(log)  # before the plugin library: the registry reports through the builder's logger

    load(Path(request["plugin"]), trt)
    doc = json.loads((directory / "program.json").read_text())
    model, collectives, _ = rank_model(directory, doc)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, log)
    # the path locates the external weights (weights.bin beside the segments)
    if not parser.parse(model.SerializeToString(), str(directory / "rank.onnx")):
        errors = "; ".join(str(parser.get_error(i).desc()) for i in range(parser.num_errors))
        raise KilnError(f"the parser refused the rank's ONNX: {errors[:400]}")
    attention_nodes = sum(n.op_type == OP for n in model.graph.node)
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    plugins = [layer for layer in layers if layer.type == trt.LayerType.PLUGIN_V3]
    if len(plugins) != attention_nodes:
        raise KilnError(f"{len(plugins)} of {attention_nodes} {OP} nodes became the plugin; the rest would compile "
                        "their reference body")
    for item in collectives:
        _join_collective(trt, network, item, tp)
    config = builder.create_builder_config()
    if chain.targets is not None:
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(trt.ComputeCapability, RTX_TARGETS[cc]), 0)
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)  # pools written in place
    cache_path = Path(request["timing_cache"]) if request.get("timing_cache") else None
    timing = None
    if chain.flavour == "tensorrt" and cache_path is not None:  # TensorRT-RTX's timing-cache calls are no-ops
        timing = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
        config.set_timing_cache(timing, ignore_mismatch=False)
    profile = Profile(**request["profile"])
    optimization = builder.create_optimization_profile()
    dims = model_dims(model)
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        optimization.set_shape(tensor.name, *profile.shape(dims[tensor.name]))
    config.add_optimization_profile(optimization)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise KilnError("; ".join(log.errors[-3:]) or "no message")
    Path(request["out"]).write_bytes(bytes(serialized))
    if timing is not None:
        cache_path.write_bytes(bytes(timing.serialize()))
    aliases = {plugin.get_output(n).name: plugin.get_input(i).name for plugin in plugins for n, i in ((1, 5), (2, 6))}
    return {"seconds": time.perf_counter() - started, "activation_bytes": log.activation_bytes,
            "plugin_layers": len(plugins), "collectives": len(collectives),
            "inputs": [network.get_input(i).name for i in range(network.num_inputs)],
            "outputs": [network.get_output(i).name for i in range(network.num_outputs)], "aliases": aliases}


def _join_collective(trt, network, item: dict, tp: int) -> None:
    """Replace the Identity standing for a collective by TensorRT's collective of the same input: its readers
    read the collective's result instead (the Identity, unread, is dropped by the builder)."""
    tensors = _tensors(network)
    source, standin = tensors[item["input"]], tensors[item["output"]]
    if item["exchange"] == "all_reduce":
        layer = network.add_dist_collective(source, trt.CollectiveOperation.ALL_REDUCE, trt.ReduceOperation.SUM,
                                            -1, [])
        layer.num_ranks = tp
        result = layer.get_output(0)
    else:
        result = _all_gather_last(trt, network, source, item["input_dims"][-1], item["attrs"]["sizes"], tp)
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        for j in range(layer.num_inputs):
            t = layer.get_input(j)
            if t is not None and t.name == standin.name and layer.get_output(0).name != result.name:
                layer.set_input(j, result)
    if standin.is_network_output:  # a result of the program (the gathered logits): the collective's is
        network.unmark_output(standin)
        standin.name = f"{item['output']}.standin"
        result.name = item["output"]
        network.mark_output(result)


def _tensors(network) -> dict:
    """Every tensor of the network by name: inputs and layer outputs."""
    found = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        for j in range(layer.num_outputs):
            found[layer.get_output(j).name] = layer.get_output(j)
    return found


def _all_gather_last(trt, network, x, width: int, sizes: list[int], tp: int):
    """[N, sizes[rank]] on every rank -> [N, sum(sizes)]: TensorRT gathers along the first dimension, so each
    rank's piece is padded to the widest, gathered to [tp * N, M], laid side by side, and the padding dropped."""
    widest = max(sizes)
    if width != widest:  # this rank's piece [N, width]
        x = network.add_padding_nd(x, (0, 0), (0, widest - width)).get_output(0)
    layer = network.add_dist_collective(x, trt.CollectiveOperation.ALL_GATHER, trt.ReduceOperation.NONE, -1, [])
    layer.num_ranks = tp
    split = network.add_shuffle(layer.get_output(0))
    split.reshape_dims = (tp, -1, widest)
    split.second_transpose = (1, 0, 2)
    joined = network.add_shuffle(split.get_output(0))
    joined.reshape_dims = (-1, tp * widest)
    out = joined.get_output(0)
    if any(s != widest for s in sizes):
        import numpy as np

        keep = np.concatenate([np.arange(r * widest, r * widest + s) for r, s in enumerate(sizes)]).astype(np.int32)
        _KEEP.append(keep)
        index = network.add_constant(keep.shape, trt.Weights(keep)).get_output(0)
        out = network.add_gather(out, index, 1).get_output(0)
    return out


def main() -> int:
    request = json.loads(sys.stdin.read())
    try:
        print(json.dumps(compile_request(request)))
    except KilnError as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
