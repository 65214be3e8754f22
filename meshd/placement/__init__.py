"""Placement decisions (pure, clock-injected): where to load, which copy serves, copy scaling.

The mesh issue fills this in; the single-instance path needs none of it yet, and the
simulator (sim/) will drive exactly this code.
"""
