"""BOS (and EOS) around raw prompts, as the model's tokenizer defines them, in every entry point.

Two tiny checkpoints: a Gemma-style one whose tokenizer_config says add_bos_token (and whose chat template
writes `{{ bos_token }}` itself) and a Llama-style one whose tokenizer adds nothing. For each, a raw
prompt through the offline API, `engine-run generate` and `/v1/completions` must give transformers'
`generate` text for the same prompt tokenized as transformers does, and a chat prompt gets exactly one BOS.
"""

import json
import subprocess
import sys

import httpx
import pytest
import torch
from conftest import CHAT_TEMPLATE, SPECIAL_TOKENS, make_tiny_llama
from test_server import REPO, ServerProcess

from runtime.core.engine import EngineOptions, LLMEngine
from runtime.core.sampling import SamplingParams

PROMPT = "The quick brown fox"
MAX_TOKENS = 8
BOS_CHAT_TEMPLATE = "{{ bos_token }}" + CHAT_TEMPLATE
BOS_ID = SPECIAL_TOKENS.index("<|endoftext|>")  # the Gemma-style checkpoint's BOS (its template uses the others)
EOS_ID = SPECIAL_TOKENS.index("<|im_end|>")


def _with_bos(model_dir):
    """The checkpoint's tokenizer made Gemma's: BOS before every text (the post-processor and the config's
    flag, as Gemma's files both say it) and a chat template that writes the BOS itself."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = SPECIAL_TOKENS[BOS_ID]
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                             special_tokens=[(bos, BOS_ID)])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(add_bos_token=True, bos_token=bos, chat_template=BOS_CHAT_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return model_dir


@pytest.fixture(scope="module", params=["gemma3-bos", "llama-plain"])
def case(request, tmp_path_factory, build_tiny_engine):
    """(model dir, engine dir, whether the tokenizer adds BOS)."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3-bos":
        model_dir = _with_bos(make_tiny_llama(root, seed=21, family="gemma3", sliding_window=8, num_hidden_layers=2,
                                              tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                                              layer_types=["sliding_attention", "full_attention"]))
    else:
        model_dir = make_tiny_llama(root, seed=22)
    return model_dir, build_tiny_engine(model_dir, request.param), request.param == "gemma3-bos"


def _transformers_greedy(model_dir, text: str | None = None, ids: list[int] | None = None):
    """(the prompt ids transformers' tokenizer makes of `text`, or `ids`; its greedy tokens up to EOS or
    MAX_TOKENS, from whole-sequence forwards; their text)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(text)["input_ids"] if ids is None else ids
    out = []
    with torch.inference_mode():
        while len(out) < MAX_TOKENS and EOS_ID not in out:
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return ids, out, tokenizer.decode(out, skip_special_tokens=True)


def test_the_manifest_records_what_the_tokenizer_adds(case):
    model_dir, engine_dir, adds_bos = case
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    assert manifest["model"]["special_tokens"] == {"prefix": [BOS_ID] if adds_bos else [], "suffix": []}


def test_raw_prompt_is_transformers_text_through_api_cli_and_server(case, tmp_path):
    model_dir, engine_dir, adds_bos = case
    expected_ids, expected_tokens, expected = _transformers_greedy(model_dir, PROMPT)
    assert (expected_ids[0] == BOS_ID) == adds_bos and BOS_ID not in expected_ids[1:]  # transformers agrees

    llm = LLMEngine.from_dir(engine_dir, EngineOptions(num_threads=1))
    assert llm.encode(PROMPT) == expected_ids
    [offline] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert offline.token_ids == expected_tokens

    cli = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", str(engine_dir), "--prompt", PROMPT,
                          "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--threads", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == expected.strip()

    server = ServerProcess(engine_dir, tmp_path / "server.log")
    try:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["text"] == expected
        assert reply["usage"]["prompt_tokens"] == len(expected_ids)
    finally:
        server.stop()


@pytest.mark.parametrize("case", ["gemma3-bos"], indirect=True)
def test_chat_template_that_writes_bos_gets_exactly_one(case, tmp_path):
    model_dir, engine_dir, _ = case
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": PROMPT}]
    # transformers' own chat tokenization (the template writes the BOS; nothing is added to it)
    expected_ids = list(AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert expected_ids[0] == BOS_ID and BOS_ID not in expected_ids[1:]
    llm = LLMEngine.from_dir(engine_dir, EngineOptions(num_threads=1))
    assert llm.encode(llm.apply_chat_template(messages)) == expected_ids
    _, expected_tokens, expected = _transformers_greedy(model_dir, ids=expected_ids)
    [out] = llm.generate([expected_ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert out.token_ids == expected_tokens

    server = ServerProcess(engine_dir, tmp_path / "server.log")
    try:
        body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
        assert reply["usage"]["prompt_tokens"] == len(expected_ids)
        assert reply["choices"][0]["message"]["content"] == expected
    finally:
        server.stop()
