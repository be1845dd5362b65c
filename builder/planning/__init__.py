"""builder/planning"""
