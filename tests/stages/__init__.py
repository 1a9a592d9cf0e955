"""Tests of the stage types (stages), through the real server and the official SDKs."""
