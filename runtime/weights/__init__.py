"""The weight formats' registry: FORMATS maps an IR quant name to its WeightFormat (packing, checks, kernel).

One module per format holds its math, its packing into the kernels' panel layout (runtime/weights/panels.py)
and the checks its kernel binds with; builder and passes import them from here.
"""

from __future__ import annotations

from runtime.weights import bf16, fp8, int4, int5, int6, int8
from runtime.weights.format import WeightFormat

FORMATS: dict[str, WeightFormat] = {f.name: f for f in (int4.FORMAT, int5.FORMAT, int6.FORMAT, int8.FORMAT, fp8.FORMAT,
                                                        bf16.FORMAT)}
# the formats with logical operands: those quantization or a GGUF's blocks rewrite a float weight to
QUANTIZED_FORMATS: dict[str, WeightFormat] = {name: f for name, f in FORMATS.items() if f.roles}
