"""runtime/core"""
