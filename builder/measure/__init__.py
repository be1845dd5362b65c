"""builder/measure"""
