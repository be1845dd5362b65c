"""The parallel matrix: every plan shape the README offers, built from the shipped model (and from tiny checkpoints of
a windowed family and a mixture) and run as a user runs it, through `engine-run generate` with real rank processes,
answers greedy chat prompts with the text of the same build at tp=1.

SmolLM2 is the case the tiny float checkpoints miss: a tied Q8_0 embedding that both the lookup and the logits read,
GGUF int4 blocks, and 9 query / 3 KV heads that split unevenly. Its default-plan engines are built once per session
(tp=1, tp=2, pp=2 and tp=2 x pp=2) and each runs on the f32 and the int16 activation path (both allowed by the
build's gate; --activations picks one rather than the host's timing), with step replay on and off."""

import os
import subprocess
import sys

import pytest
from conftest import make_tiny_llama

from builder.build import build_engine
from builder.planning.plan import load_plan

CHAT = ["Write one sentence about the sea.", "What is the capital of France?", "List three colors."]
SHAPES = [(2, 1), (1, 2), (2, 2)]  # (tp, pp) beside tp=1
PATHS = ["f32", "int16"]


def generate(engine, replay: bool = True, prompts=CHAT, activations: str | None = None) -> str:
    """What `engine-run generate --chat` prints for the prompts, greedy, 32 tokens each."""
    args = [sys.executable, "-m", "runtime.cli", "generate", str(engine), "--chat", "--max-tokens", "32",
            "--temperature", "0", "--rank-timeout", "60", *(["--activations", activations] if activations else [])]
    for prompt in prompts:
        args += ["--prompt", prompt]
    env = dict(os.environ, KILN_STEP_REPLAY="1" if replay else "0")
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, f"engine-run generate {engine.name} failed: {done.stderr.strip()[-1500:]}"
    assert done.stdout.count("--- [") == len(prompts)
    return done.stdout


@pytest.fixture(scope="session")
def smollm2_answers(smollm2_engines):
    """path -> tp=1's printed answers on it (step replay on, as served)."""
    answers = {}

    def get(path: str) -> str:
        if path not in answers:
            answers[path] = generate(smollm2_engines(), activations=path)
        return answers[path]

    return get


@pytest.mark.parametrize("path", PATHS)
def test_smollm2_at_tp1_answers_the_prompts_and_replay_changes_nothing(path, smollm2_engines, smollm2_answers):
    expected = smollm2_answers(path)
    assert "The capital of France is Paris." in expected
    assert generate(smollm2_engines(), replay=False, activations=path) == expected


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "op-by-op"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tp,pp", SHAPES, ids=[f"tp{tp}pp{pp}" for tp, pp in SHAPES])
def test_smollm2_sharded_answers_with_the_text_of_one_rank(tp, pp, path, replay, smollm2_engines, smollm2_answers):
    assert generate(smollm2_engines(tp, pp), replay, activations=path) == smollm2_answers(path)


# ---------------------------------------------------------------------------- a windowed family and a mixture

TINY = {  # name -> the shapes (tp, pp, ep) it runs beside tp=1
    "gemma3": [(2, 1, 1)],             # conftest's tiny_gemma3_dir: sliding-window layers beside a global one
    "mixtral": [(2, 1, 1), (1, 1, 2)],  # 5 experts: tp=2 splits each expert's columns, ep=2 the experts 2 + 3
}
TINY_QUANT = {"default": {}, "int8": {"method": "int8", "exclude": [], "activations": "int16"}}  # int8: packed tables
TINY_CASES = [(name, quant, *shape) for name, shapes in TINY.items() for shape in shapes for quant in TINY_QUANT]


@pytest.fixture(scope="module")
def tiny_engines(tmp_path_factory, tiny_gemma3_dir):
    """engine(name, quant, tp, pp, ep) -> an engine of TINY[name]'s checkpoint with TINY_QUANT[quant]."""
    root, built = tmp_path_factory.mktemp("parallel-tiny"), {}
    dirs = {"gemma3": tiny_gemma3_dir,
            "mixtral": make_tiny_llama(root / "mixtral", family="mixtral", seed=11, num_local_experts=5,
                                       num_experts_per_tok=2)}

    def engine(name: str, quant: str, tp: int = 1, pp: int = 1, ep: int = 1):
        if (name, quant, tp, pp, ep) not in built:
            plan = load_plan().with_overrides("quant", **TINY_QUANT[quant]).with_overrides(tp=tp, pp=pp, ep=ep)
            out = root / f"{name}-{quant}-tp{tp}pp{pp}ep{ep}"
            build_engine(str(dirs[name]), plan, out, show_progress=False)
            built[name, quant, tp, pp, ep] = out
        return built[name, quant, tp, pp, ep]

    return engine


@pytest.fixture(scope="module")
def tiny_answers(tiny_engines):
    """(name, quant) -> tp=1's printed answers."""
    answers = {}

    def get(name: str, quant: str) -> str:
        if (name, quant) not in answers:
            answers[name, quant] = generate(tiny_engines(name, quant))
        return answers[name, quant]

    return get


@pytest.mark.parametrize("name,quant,tp,pp,ep", TINY_CASES,
                         ids=[f"{n}-{q}-tp{t}pp{p}ep{e}" for n, q, t, p, e in TINY_CASES])
def test_tiny_families_sharded_answer_with_the_text_of_one_rank(name, quant, tp, pp, ep, tiny_engines, tiny_answers):
    expected = tiny_answers(name, quant)
    assert generate(tiny_engines(name, quant, tp, pp, ep)) == expected
    assert generate(tiny_engines(name, quant, tp, pp, ep), replay=False) == expected
