"""Tests of the flow command (flow/cli)."""
