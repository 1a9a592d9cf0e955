"""Tests of the renderers and the console (viz)."""
