"""runtime/format"""
