"""builder/graph"""
