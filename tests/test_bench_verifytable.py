"""specdecode bench --verify-table: the report's arithmetic and its refusals (no model is loaded here)."""

from __future__ import annotations

import pytest

from specdecode.bench import verifytable
from specdecode.errors import SpecDecodeError


def _result(peer: bool) -> dict:
    env = {"cpu_model": "Test CPU", "cpu_flags": ["avx2", "fma", "f16c", "sse4_2", "aes"], "date": "2026-12-04"}
    row = {"model": "m", "gguf": "m.gguf", "depth": 256, "step_bytes": 100e6,
           "ours_s": {"1": 0.010, "2": 0.012, "4": 0.020}, "llama_s": {}}
    if peer:
        row["llama_s"] = {"1": 0.011, "2": 0.018, "4": 0.030}
        row["llama_decode_s"] = 0.0105
    return {"environment": env, "kernel": "avx2 kernel", "threads": 2, "bandwidth_bytes_s": 20e9,
            "load_at_start": (0.5, 0.5, 0.5), "load_at_end": (0.6, 0.6, 0.6), "repeats": 3, "models": [row]}


def test_the_report_gives_ratios_and_the_byte_limit():
    text = verifytable.render(_result(peer=True))
    assert "ours beside llama.cpp" in text and "interleaved k by k" in text
    assert "| ours T(k)/T(1) | 1.00 | 1.20 | 2.00 |" in text
    assert "| llama.cpp T(k)/T(1) | 1.00 | 1.64 | 2.73 |" in text
    assert "| llama.cpp / ours (time) | 1.10 | 1.50 | 1.50 |" in text
    assert "50% of the byte limit" in text  # 100 MB / 20 GB/s = 5 ms of a 10 ms step
    assert "avx2 fma f16c sse4_2" in text and "aes" not in text.split("SIMD flags:")[1].split("\n")[0]


def test_the_byte_limit_uses_the_bandwidth_read_beside_the_row():
    """Each row's byte limit divides by the bandwidth measured just before its timings (the VM drifts
    between hours), not by the run's first figure."""
    result = _result(peer=False)
    result["models"][0]["bandwidth_bytes_s"] = 10e9  # 100 MB / 10 GB/s = 10 ms: the whole 10 ms step
    text = verifytable.render(result)
    assert "100% of the byte limit" in text and "at 10.0 GB/s, read just before these timings" in text
    assert "above 100%" not in text
    result["models"][0]["bandwidth_bytes_s"] = 5e9  # 20 ms of bytes in a 10 ms step: the sum read slowly
    assert "200% of the byte limit" in verifytable.render(result) and "above 100%" in verifytable.render(result)


def test_without_llama_cpp_the_report_does_not_claim_it():
    text = verifytable.render(_result(peer=False))
    assert "llama" not in text


def test_an_output_that_cannot_be_created_is_refused_before_anything_loads():
    with pytest.raises(SpecDecodeError, match="--output /proc/nonexistent/x: cannot write there"):
        verifytable.run_table(["smollm2-135m"], __import__("pathlib").Path("/proc/nonexistent/x"), peer=False)
