"""The GPU architectures Kiln's Triton kernels compile for: compute capability -> Triton's target name."""

ARCHES = {"8.0": "sm_80", "8.6": "sm_86", "8.9": "sm_89", "9.0": "sm_90a", "10.0": "sm_100a", "12.0": "sm_120"}
