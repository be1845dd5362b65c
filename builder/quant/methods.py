"""The [quant] methods a plan can name, one record each: the one place that says what a method is.

`none` keeps the source's float weights; `source` keeps a GGUF's blocks as they are (Kiln's int4/int5/int6/int8
formats, bit for bit); the others requantize every float weight the plan does not exclude, to the runtime weight
format they name (runtime/weights). Plans, the pipeline, the build budget, the accuracy measure and the
targets read these records instead of spelling the methods out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantMethod:
    name: str
    weight_format: str | None  # the runtime weight format its requantized linears take (None: it requantizes none)
    grouped: bool = False      # scales per group of input channels ([quant] group_size applies)
    calibrated: bool = False   # AWQ scales and GPTQ rounding from calibration text ([quant] rounding applies)

    @property
    def requantizes(self) -> bool:
        """It rounds the source's float weights itself (so its accuracy is measured against the float model)."""
        return self.weight_format is not None


METHODS: dict[str, QuantMethod] = {m.name: m for m in (
    QuantMethod("none", None),
    QuantMethod("source", None),
    QuantMethod("int8", "int8"),
    QuantMethod("int4", "int4", grouped=True),
    QuantMethod("int4-awq", "int4", grouped=True, calibrated=True),
    QuantMethod("fp8", "fp8"),
)}
NAMES = tuple(METHODS)
REQUANTIZING = {name: m.weight_format for name, m in METHODS.items() if m.requantizes}  # method -> weight format


def method(name: str) -> QuantMethod:
    """The record of `name` (KeyError for an unknown one: plans are validated before anything asks)."""
    return METHODS[name]


def taking(formats: set[str]) -> tuple[str, ...]:
    """The methods a target whose kernels take weight `formats` builds: the ones that keep weights as they come
    (`none`, `source`) and those requantizing to one of `formats`."""
    return tuple(name for name, m in METHODS.items() if not m.requantizes or m.weight_format in formats)
