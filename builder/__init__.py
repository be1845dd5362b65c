"""Kiln builder: model sources, tracing to the IR, the pass pipeline driver and engine emission."""

import runtime as _runtime  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads)
