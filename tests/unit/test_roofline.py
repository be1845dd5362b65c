"""The roofline's arithmetic and the machine's measured peaks."""

import math

import pytest

from runtime.measure.bench import LevelResult, annotate, table
from runtime.measure.roofline import Peaks, linear_parameters, measure_peaks, roofline

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3,
           "head_dim": 64, "vocab_size": 49152}


def test_linear_parameters_count_every_multiply_add_of_a_token():
    layers, head = linear_parameters(SMOLLM2)
    per_layer = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536  # qkv, o, gate + up + down
    assert (layers, head) == (30 * per_layer, 576 * 49152)
    assert 134e6 < layers + head < 135e6  # SmolLM2-135M, less its embedding lookup and norms


def test_the_larger_share_is_the_limit():
    peaks = Peaks(threads=2, read_gbs=20.0, f32_gflops=100.0, int8_gops=400.0, int16_gops=200.0)
    assert roofline(10.0, 20.0, peaks, "f32") == (0.5, 0.2, "memory")
    assert roofline(2.0, 80.0, peaks, "f32") == (0.1, 0.8, "f32")
    assert roofline(2.0, 80.0, peaks, "int8") == (0.1, 0.2, "int8")
    assert roofline(2.0, 80.0, peaks, "int16") == (0.1, 0.4, "int16")  # held to its own instruction's peak


def test_a_table_without_peaks_shows_dashes_and_with_them_the_shares():
    level = LevelResult(concurrency=1, requests=1, prompt_len=8, output_len=4, elapsed_s=1.0, steps=4,
                        output_tok_s=4.0, prefill_tok_s=8.0, ttft_p50_ms=1.0, ttft_p99_ms=1.0, itl_p50_ms=1.0,
                        itl_p99_ms=1.0, weight_gbs=5.0, tokens_per_step=2.75, gops=30.0)
    assert math.isnan(level.memory_pct) and table([level]).splitlines()[1].split()[-1] == "-"
    annotate([level], Peaks(threads=2, read_gbs=20.0, f32_gflops=100.0, int8_gops=400.0, int16_gops=200.0), "f32")
    assert (level.memory_pct, level.compute_pct, level.limit) == (pytest.approx(25.0), pytest.approx(30.0), "f32")
    assert table([level]).splitlines()[1].split()[-3:] == ["30.0", "30", "f32"]


def test_measured_peaks_are_positive_and_keep_the_thread_count():
    import torch

    before = torch.get_num_threads()
    peaks = measure_peaks(1)
    assert peaks.threads == 1 and torch.get_num_threads() == before
    assert peaks.read_gbs > 0.5 and min(peaks.f32_gflops, peaks.int8_gops, peaks.int16_gops) > 1
    # each integer instruction does more operations than the FMA (AVX2's int16 pairs: as many)
    assert peaks.int8_gops > peaks.f32_gflops and peaks.int16_gops > 0.7 * peaks.f32_gflops
