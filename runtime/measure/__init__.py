"""runtime/measure"""
