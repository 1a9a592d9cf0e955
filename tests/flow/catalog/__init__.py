"""Tests of what flow knows before loading a model (flow/catalog)."""
