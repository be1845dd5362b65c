"""Jinja2 templates rendered by the builder (report.md)."""
