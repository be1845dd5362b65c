"""Sliding-window layers hold only their window in the paged cache, with the outputs unchanged.

A Mistral-style engine (every layer windowed, window 8) and a Gemma 3 one (windowed and full layers) built
with blocks of 4 tokens, so that a sequence of ~70 tokens spans many windows: while it decodes, its windowed
blocks (read from the block manager after every step) are at most the window's plus one, a full layer keeps
every block, and the greedy tokens are transformers' on the same checkpoint.
"""

import json

import pytest
import torch
from conftest import exact_plan, transformers_greedy

from builder.build import build_engine
from runtime.core.engine import EngineOptions, LLMEngine
from runtime.core.sampling import SamplingParams

BLOCK = 4
WINDOW = 8  # both tiny checkpoints' sliding window
PROMPT = [5, 9, 2, 77, 31, 8, 120, 41, 7, 3]
NEW_TOKENS = 60


def _engine(model_dir, tmp_path_factory, name):
    plan = exact_plan().with_overrides("kv_cache", block_size=BLOCK)
    out = tmp_path_factory.mktemp(name) / "engine"
    build_engine(str(model_dir), plan, out, show_progress=False)
    return out


@pytest.fixture(scope="module")
def mistral_engine(tiny_mistral_dir, tmp_path_factory):
    return _engine(tiny_mistral_dir, tmp_path_factory, "mistral")


@pytest.fixture(scope="module")
def gemma3_engine(tiny_gemma3_dir, tmp_path_factory):
    return _engine(tiny_gemma3_dir, tmp_path_factory, "gemma3")


def _generate_watching_blocks(engine_dir):
    """Greedy tokens of PROMPT, and after each decode step the blocks each KV group's table holds."""
    llm = LLMEngine.from_dir(engine_dir, EngineOptions(num_threads=1))
    request = llm.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    seq = llm.scheduler.requests[request]
    held = []
    tokens = None
    while tokens is None:
        for out in llm.step():
            if out.finished:
                tokens = out.token_ids
        if tokens is None and seq.num_computed_tokens >= len(PROMPT):  # decoding
            held.append([sum(b >= 0 for b in table) for table in llm.scheduler.block_manager.tables(seq)])
    return llm, tokens, held


def test_every_layer_windowed_holds_the_window_and_one_block(mistral_engine, tiny_mistral_dir):
    from transformers import AutoModelForCausalLM

    llm, tokens, held = _generate_watching_blocks(mistral_engine)
    assert llm.kv_groups.windows == (WINDOW,)
    assert max(h[0] for h in held) <= WINDOW // BLOCK + 1 and len(held) >= NEW_TOKENS - 2
    model = AutoModelForCausalLM.from_pretrained(tiny_mistral_dir, dtype=torch.float32).eval()
    assert tokens == transformers_greedy(model, PROMPT, NEW_TOKENS)


def test_full_layers_keep_their_blocks_beside_windowed_ones(gemma3_engine, tiny_gemma3_dir):
    from transformers import AutoModelForCausalLM

    llm, tokens, held = _generate_watching_blocks(gemma3_engine)
    assert llm.kv_groups.windows == (0, WINDOW)
    total = len(PROMPT) + NEW_TOKENS
    assert max(h[1] for h in held) <= WINDOW // BLOCK + 1
    # before its last step the full layers' table holds every token computed (all but the newest two)
    assert held[-1][0] == -(-(total - 2) // BLOCK)
    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    assert tokens == transformers_greedy(model, PROMPT, NEW_TOKENS)


def test_the_memory_plan_prices_windowed_layers_by_their_window(gemma3_engine):
    manifest = json.loads((gemma3_engine / "manifest.json").read_text())
    limits, [rank] = manifest["plan"]["limits"], manifest["memory"]["ranks"]
    per_sequence = min(-(-limits["max_seq_len"] // BLOCK), -(-(WINDOW - 1 + limits["max_num_tokens"]) // BLOCK) + 1)
    assert rank["kv_window_blocks"] == limits["max_batch_size"] * per_sequence
    assert 0 < rank["kv_window_bytes_per_token"] < rank["kv_bytes_per_token"]
    llm = LLMEngine.from_dir(gemma3_engine, EngineOptions(num_threads=1))
    assert llm.kv_groups.num_blocks == (rank["kv_blocks"], rank["kv_window_blocks"])
