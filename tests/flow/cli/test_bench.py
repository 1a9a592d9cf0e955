"""``flow bench``: raw mlx-lm and the server side by side, the server read by a client in its own process."""

from __future__ import annotations

from flow.cli.bench import markdown, run_bench


def test_bench_measures_raw_and_served_decode_on_a_tiny_model() -> None:
    result = run_bench("tiny:tiny-qwen3", max_tokens=24, rounds=1)
    (detail,) = result["rounds_detail"]
    assert 2 <= detail["raw_tokens"] <= 24 and 2 <= detail["server_tokens"] <= 24  # the usage the client read
    assert result["raw_decode_tps"] > 0 and result["server_decode_tps"] > 0 and detail["server_ttft_ms"] > 0
    # the ratio is of the unrounded rates (one round: its own), not of the rates as printed to one decimal
    assert result["ratio_server_to_raw"] == round(detail["server_decode_tps"] / detail["raw_decode_tps"], 3)
    assert "| raw mlx-lm decode tok/s |" in markdown(result)
