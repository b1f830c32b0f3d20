"""The native model families: one module per family, its config reading and its decoder
block, built from the shared layers. models/registry.py lists them (FAMILIES).
"""
