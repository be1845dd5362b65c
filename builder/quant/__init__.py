"""Build-time calibrations of the weight formats (AWQ, GPTQ); each format's own math is in runtime.weights."""
