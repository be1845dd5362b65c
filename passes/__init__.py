"""Compiler passes: pure functions (Graph, PassContext) -> Graph, one per file."""
