"""Tests of the resource types (flow/resources), through the real server."""
