"""Tests of the framework core (flow/graph)."""
