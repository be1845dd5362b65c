"""Kiln builder: model sources, tracing to the IR, the pass pipeline driver and engine emission."""
