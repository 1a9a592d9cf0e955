"""Tests of the HTTP shell (flow/serve): routes, limits, stop, reload, observability."""
