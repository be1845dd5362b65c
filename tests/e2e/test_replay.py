"""Step tapes: C kernel calls recorded once and replayed on new inputs, in isolation and in the engine."""

import threading

import pytest
import torch
from conftest import exact_plan

from builder.build import build_engine
from runtime.ops import linear as ql
from runtime.ops import rowops, tape
from runtime.weights import int8
from runtime.core.engine import EngineOptions, LLMEngine
from runtime.backends import open_engine
from runtime.backends.cpu.executor import CpuExecutor
from runtime.core.sampling import SamplingParams


def test_a_tape_replays_its_calls_on_what_the_buffers_hold_now():
    g = torch.Generator().manual_seed(0)
    weight, x, residual = torch.randn(64, generator=g), torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    norm = rowops.bind_add_rms_norm(weight, 1e-5, reuse=True)
    silu = rowops.bind_silu_mul(32, reuse=True)
    with tape.Recording() as recording:
        out, total = norm(x, residual)
        act = silu(out)
    assert tape.tape_size(recording.tape) == 2
    x.copy_(torch.randn(3, 64, generator=g))  # a new step's input, in place
    tape.replay(recording.tape)
    fresh_out, fresh_total = rowops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(out, fresh_out) and torch.equal(total, fresh_total)
    assert torch.equal(act, rowops.bind_silu_mul(32)(fresh_out))


def test_a_tape_recorded_with_its_token_count_replays_another():
    """Row counts that follow the tokens (rows, rows x heads) are rewritten; the logits rows' count is kept.
    Every output is a kept buffer of REUSE_ROWS rows (4 rows a token here: up to 16 tokens)."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-128, 128, (32, 64), dtype=torch.int8, generator=g)
    weight, packed = torch.randn(64, generator=g), int8.pack(codes, torch.rand(32, generator=g) * 1e-2, None)
    norm, heads = rowops.bind_rms_norm(weight, 1e-5, reuse=True), rowops.bind_rms_norm(weight[:16], 1e-5, reuse=True)
    linear = ql.bind_linear({"quant": "int8", "layout": int8.LAYOUT, "out_features": 32, "in_features": 64},
                            packed, reuse=True)
    x = torch.empty(tape.REUSE_ROWS, 64)
    rows = torch.tensor([0, 0])

    def step(tokens: int) -> torch.Tensor:
        rows[1] = tokens - 1
        per_head = heads(norm(x[:tokens]).view(-1, 16))
        return rowops.gather_rows(linear(per_head.view(tokens, 64)), rows)

    x.normal_(generator=g)
    with tape.Recording(tokens=9) as recording:
        logits = step(9)
    assert tape.tape_tokens(recording.tape) == 9
    for tokens in (5, 16, 3, 9):
        x.normal_(generator=g)
        rows[1] = tokens - 1
        tape.replay(recording.tape, tokens)
        replayed = logits.clone()
        assert logits.shape == (2, 32) and torch.equal(replayed, step(tokens)), tokens
    with tape.Recording() as untold:  # no count given: it replays its own only
        kept = step(3)  # noqa: F841 (a tape writes its buffers: they must live)
    tape.replay(untold.tape)
    with pytest.raises(ValueError, match="this tape runs 0 tokens, 0 sequences and 0 logits rows only, not 4"):
        tape.replay(untold.tape, 4)


def test_calls_after_the_logits_gather_follow_the_logits_rows():
    """A tape recorded with its tokens, sequences and logits rows replays any mix of them: the calls before the
    gather of the logits rows run on the step's tokens, the calls after it on its logits rows."""
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(-128, 128, (32, 64), dtype=torch.int8, generator=g)
    packed = int8.pack(codes, torch.rand(32, generator=g) * 1e-2, None)
    weight = torch.randn(64, generator=g)
    norm, final = rowops.bind_rms_norm(weight, 1e-5, reuse=True), rowops.bind_rms_norm(weight, 1e-5, reuse=True)
    head = ql.bind_linear({"quant": "int8", "layout": int8.LAYOUT, "out_features": 32, "in_features": 64},
                          packed, reuse=True)
    gathered = tape.Outputs((64,), reuse=True)
    x, rows = torch.empty(tape.REUSE_ROWS, 64), torch.zeros(tape.REUSE_ROWS, dtype=torch.int64)

    def step(tokens: int, logits: int) -> torch.Tensor:
        picked = rowops.gather_rows(norm(x[:tokens]), rows[:logits], out=gathered.for_rows(logits), logits=True)
        return head(final(picked))

    x.normal_(generator=g)
    rows[:3] = torch.tensor([1, 4, 8])
    with tape.Recording(tokens=9, seqs=3, logits=3) as recording:
        logits = step(9, 3)
    for tokens, count in ((5, 1), (16, 7), (2, 2), (40, 40), (9, 3)):
        x.normal_(generator=g)
        rows[:count] = torch.randperm(tokens, generator=g)[:count]
        tape.replay(recording.tape, tokens, 3, count)
        replayed = logits.as_strided((count, 32), logits.stride()).clone()
        assert torch.equal(replayed, step(tokens, count)), (tokens, count)
    with tape.Recording(tokens=9) as untold:  # its sequences and logits rows not given: it keeps them
        step(9, 3)
    tape.replay(untold.tape, 12)
    with pytest.raises(ValueError, match="recorded without its logits rows count"):
        tape.replay(untold.tape, 12, -1, 4)


def test_a_replay_checks_indices_again_before_computing():
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    indices = torch.tensor([3, 0])
    with tape.Recording() as recording:
        out = rowops.gather_rows(x, indices)
    assert out.tolist() == [[9, 10, 11], [0, 1, 2]]
    indices[1] = 2
    tape.replay(recording.tape)
    assert out.tolist() == [[9, 10, 11], [6, 7, 8]]
    indices[0] = 4
    with pytest.raises(ValueError, match=r"gather_rows: indices\[0\] = 4 is outside x's 4 rows"):
        tape.replay(recording.tape)
    assert out.tolist() == [[9, 10, 11], [6, 7, 8]]  # nothing ran


def test_work_outside_the_c_calls_leaves_no_tape():
    add = rowops.bind_add()
    with tape.Recording() as recording:
        add(torch.ones(2, 4), torch.ones(4))  # broadcasting goes to torch.add, which no tape records
    assert recording.tape is None
    with pytest.raises(RuntimeError, match="boom"), tape.Recording() as recording:
        add(torch.ones(2, 4), torch.ones(2, 4))
        raise RuntimeError("boom")
    assert recording.tape is None
    with tape.Recording() as recording:  # a new recording may start after either
        add(torch.ones(2, 4), torch.ones(2, 4))
    assert tape.tape_size(recording.tape) == 1


def test_a_tape_records_only_the_calls_of_its_own_thread():
    add, a = rowops.bind_add(), torch.ones(2, 4)
    seen = []

    def other_thread():
        add(a, a)  # runs, but is not part of the recording thread's step
        with tape.Recording() as inner:  # one recording at a time: this one runs unrecorded
            add(a, a)
        seen.append((inner.recording, inner.tape))

    with tape.Recording() as recording:
        add(a, a)
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert tape.tape_size(recording.tape) == 1 and seen == [(False, None)]


@pytest.fixture(scope="module", params=["f32", "int8"])
def replay_engine_dir(request, tiny_llama_dir, build_tiny_engine):
    """Every weight quantized, so that every op runs in C: int8 weights with float32 activations, and
    int4 with int8 activations (the default plan's path)."""
    if request.param == "f32":
        return build_tiny_engine(tiny_llama_dir, "tiny-replay-exact", method="int8", exclude=[])
    return build_tiny_engine(tiny_llama_dir, "tiny-replay-int8", method="int4", activations="int8", exclude=[])


def run_mixed(path) -> tuple[list[list[int]], LLMEngine]:
    """Staggered greedy and seeded requests of different lengths, one of them past 300 positions
    (where the rope table grew at 256 and the block tables widened), and a 9-token batch of 9 sequences.
    llm.steps_taken: the steps it ran."""
    llm = LLMEngine.from_dir(path, EngineOptions(kv_cache_gib=0.02))
    step, llm.steps_taken = llm.step, 0

    def counted():
        llm.steps_taken += 1
        return step()

    llm.step = counted
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (9,), generator=g)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=20 + 7 * i, ignore_eos=True)
              for i in range(9)]
    params[4] = SamplingParams(temperature=0.0, max_tokens=320, ignore_eos=True)
    outputs = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        llm.add_request(prompt, p, request_id=str(i))
        for _ in range(3):
            outputs.update((o.request_id, o.token_ids) for o in llm.step() if o.finished)
    while llm.has_unfinished():
        outputs.update((o.request_id, o.token_ids) for o in llm.step() if o.finished)
    return [outputs[str(i)] for i in range(9)], llm


def test_replayed_steps_give_the_tokens_of_steps_run_op_by_op(replay_engine_dir, monkeypatch):
    """The batches' mixes of prompt chunks and decodes change from step to step (sequences and logits rows): one
    tape follows them all, recorded once: its rope and block tables are as long as the engine's sequences."""
    replayed, llm = run_mixed(replay_engine_dir)
    executor = llm.executor
    assert executor.replay and executor.recorded_steps == 1
    assert executor.replayed_steps >= llm.steps_taken - 1  # the last step finds nothing to run
    monkeypatch.setenv("KILN_STEP_REPLAY", "0")
    expected, llm = run_mixed(replay_engine_dir)
    assert not llm.executor.replay and llm.executor.replayed_steps == 0
    assert replayed == expected


def test_a_prompt_length_seen_for_the_first_time_replays(replay_engine_dir, monkeypatch):
    """One tape serves every prefill length up to REPLAY_MAX_TOKENS, and the decodes: after the first prompt's
    prefill, every step replays, and answers as steps run op by op do."""
    def answers(llm):
        g = torch.Generator().manual_seed(9)
        out = []
        for length in (12, 5, 23, 64, 2, 40):
            prompt = torch.randint(3, 250, (length,), generator=g).tolist()
            out.append(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0].token_ids)
        return out

    llm = LLMEngine.from_dir(replay_engine_dir, EngineOptions(kv_cache_gib=0.02, enable_prefix_caching=False))
    replayed = answers(llm)
    tapes = llm.executor.tapes
    assert list(tapes) == [(0, 0, 1)]
    assert llm.executor.replayed_steps == 6 * 3 - 1  # a prefill and two decodes a prompt
    monkeypatch.setenv("KILN_STEP_REPLAY", "0")
    expected = answers(LLMEngine.from_dir(replay_engine_dir, EngineOptions(kv_cache_gib=0.02,
                                                                           enable_prefix_caching=False)))
    assert replayed == expected


def test_values_alive_at_once_never_share_a_buffer(replay_engine_dir):
    """Program gives kept outputs whose lives do not overlap one buffer (tape.Slot); checked here against the
    calls' order: a value lives from its call to the last call that reads it or reads a view made of it."""
    program = LLMEngine.from_dir(replay_engine_dir, EngineOptions(kv_cache_gib=0.02)).executor.program
    made_at, end = {}, {}
    own = {name for name, _ in program.shared}
    for i, call in enumerate(program.calls):
        made_at.update((name, i) for name in call.outputs)
        end.update((name, i) for name in call.outputs)
    for i, call in enumerate(program.calls):
        for name in call.inputs:
            end[name] = max(end.get(name, i), i)
    for name in program.outputs:
        end[name] = len(program.calls)
    for call in reversed(program.calls):  # a view of an input keeps the input alive as long as itself
        if not set(call.outputs) <= own:
            for name in call.inputs:
                if name in end:
                    end[name] = max([end[name]] + [end[out] for out in call.outputs])
    by_slot = {}
    for name, slot in program.shared:
        by_slot.setdefault(id(slot), []).append(name)
    assert len(by_slot) < len(program.shared) / 2  # values do share
    for names in by_slot.values():
        lives = sorted((made_at[n], end[n], n) for n in names)
        for (_, first_end, a), (second_start, _, b) in zip(lives, lives[1:]):
            assert first_end < second_start, f"{a} and {b} are alive at once in one buffer"


def test_each_thread_learns_only_the_outputs_its_own_binders_made():
    """Engines open side by side (a fleet's engine threads): Program's record of which binder made which
    kept buffers (tape.made_by) is per thread, so one engine's values never get another's slots."""
    barrier, seen = threading.Barrier(2), {}

    def bind(name: str):
        with tape.made_by() as made:
            barrier.wait()
            mine = [tape.Outputs((8,), reuse=True) for _ in range(3)]
            barrier.wait()
            tape.Outputs((8,), reuse=False)  # not kept: not recorded
        seen[name] = (made, mine)

    threads = [threading.Thread(target=bind, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for made, mine in seen.values():
        assert made == mine
    tape.Outputs((8,), reuse=True)  # outside a block: nowhere to record, no error


def test_a_step_of_more_than_64_tokens_replays(replay_engine_dir, monkeypatch):
    """Steps up to REUSE_ROWS tokens replay (the buffers are shared, so they hold that many rows): a long
    prompt seen for the first time replays the tape another long prompt recorded, with the same tokens."""
    def answers():
        llm = LLMEngine.from_dir(replay_engine_dir, EngineOptions(kv_cache_gib=0.05, enable_prefix_caching=False))
        g = torch.Generator().manual_seed(11)
        out = [llm.generate([torch.randint(3, 250, (n,), generator=g).tolist()],
                            SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids for n in (150, 97, 200)]
        return out, llm

    assert tape.REUSE_ROWS >= 200
    replayed, llm = answers()
    # every step but the first prefill: 3 prompts of a prefill and 3 decodes
    assert list(llm.executor.tapes) == [(0, 0, 1)] and llm.executor.replayed_steps == 3 * 4 - 1
    monkeypatch.setenv("KILN_STEP_REPLAY", "0")
    assert answers()[0] == replayed


def test_one_tape_replays_a_sequence_as_it_grows(replay_engine_dir, monkeypatch):
    """The tape recorded on a 20-token prompt keeps replaying its decodes past 256 positions (where the rope
    table grew before) and past twice the prompt's block-table columns: the rope and block tables a tape reads
    are as long as the engine's sequences (up to TAPE_SEQ_LEN) from the start, so nothing records again."""
    def answer():
        llm = LLMEngine.from_dir(replay_engine_dir, EngineOptions(kv_cache_gib=0.05, enable_prefix_caching=False))
        prompt = torch.randint(3, 250, (20,), generator=torch.Generator().manual_seed(4)).tolist()
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
        return out[0].token_ids, llm.executor

    tokens, executor = answer()
    assert len(tokens) == 300 and executor.recorded_steps == 1 and executor.replayed_steps == 299
    monkeypatch.setenv("KILN_STEP_REPLAY", "0")
    assert answer()[0] == tokens


def test_a_step_past_the_kept_buffers_holds_only_the_values_still_to_be_read(replay_engine_dir):
    """A step of more tokens than the kept buffers hold runs op by op on fresh buffers: each value leaves the
    step once its last reader has run (Program.run's release), so the step holds a few values, not all it made."""
    llm = LLMEngine.from_dir(replay_engine_dir, EngineOptions(kv_cache_gib=0.05, enable_prefix_caching=False))
    program, run = llm.executor.program, llm.executor.program.run
    held, made, runs = [], {}, []

    def storages(values) -> dict[int, int]:
        return {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in values
                if isinstance(v, torch.Tensor)}

    def watched(env, observer=None, release=False):
        runs.append((env, release))
        return run(env, observer, release)

    def watch(call):
        def fn(*args):
            held.append(sum(storages(runs[-1][0].values()).values()))
            out = inner(*args)
            made.update(storages(out if isinstance(out, (tuple, list)) else [out]))
            return out
        inner, call.fn = call.fn, fn

    program.run = watched
    for call in program.calls:
        watch(call)
    prompt = torch.randint(3, 250, (tape.REUSE_ROWS + 40,), generator=torch.Generator().manual_seed(3)).tolist()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    env, release = runs[0]
    assert release and set(env) == set(program.outputs)
    assert max(held[:len(program.calls)]) < sum(made.values()) / 2


@pytest.mark.parametrize("replay", ["1", "0"])
def test_a_binder_that_returns_another_buffer_fails_the_first_step(replay_engine_dir, monkeypatch, replay):
    """Program checks, on its first step, that every kept value is in the buffer its node was given, whether the
    step keeps its values (a recording) or drops each after its last reader (op by op, replay off)."""
    from runtime.ops import program as program_module

    original = program_module.BINDERS["silu_mul"]

    def cloned(site):
        fn = original(site)
        run = lambda *args: fn(*args).clone()  # noqa: E731
        run.recordable = getattr(fn, "recordable", False)
        return run

    monkeypatch.setitem(program_module.BINDERS, "silu_mul", cloned)
    monkeypatch.setenv("KILN_STEP_REPLAY", replay)
    llm = LLMEngine.from_dir(replay_engine_dir, EngineOptions(kv_cache_gib=0.02))
    assert llm.executor.replay == (replay == "1")
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert out.finish_reason == "error" and "is not in the buffer its node was given" in out.error


@pytest.fixture(scope="module")
def gemma3_replay_engine_dir(tiny_gemma3_dir, build_tiny_engine):
    """Gemma 3 with every weight int8 (the scaled embedding and the tied logits too), float32 activations."""
    return build_tiny_engine(tiny_gemma3_dir, "tiny-gemma3-replay", method="int8", exclude=[])


def test_every_call_of_a_gemma3_program_is_recordable(gemma3_replay_engine_dir):
    """The q/k norms and rope run inside the fused attention call, GeGLU and the embedding scale in C."""
    program = CpuExecutor(open_engine(gemma3_replay_engine_dir).load_rank(0), 8, 16).program  # 8 blocks of 16
    assert [call.name for call in program.calls if not call.recordable] == []
    nodes = program.doc["nodes"]
    layers = sum(node["op"] == "attention" for node in nodes)
    assert layers == 3 and len(program.calls) == len(nodes) - 4 * layers  # split, norms and rope folded in


def test_gemma3_replayed_steps_give_the_tokens_of_steps_run_op_by_op(gemma3_replay_engine_dir, monkeypatch):
    replayed, llm = run_mixed(gemma3_replay_engine_dir)
    assert llm.executor.replay and llm.executor.replayed_steps > 250
    monkeypatch.setenv("KILN_STEP_REPLAY", "0")
    expected, llm = run_mixed(gemma3_replay_engine_dir)
    assert not llm.executor.replay and llm.executor.replayed_steps == 0
    assert replayed == expected


def test_a_gemma3_gguf_whose_q_k_and_v_differ_in_format_replays(tiny_gemma3_dir, tmp_path, monkeypatch):
    """Gemma 3 270M's own mix: q and k in Q5_0, v in Q8_0, so fuse_qkv leaves three projections; the fused
    attention call reads them as they are, and the source build's decode steps replay like the rest."""
    from gguf_export import write_gguf

    from builder.sources import load_model

    types = {"*.attn_q.weight": "Q5_0", "*.attn_k.weight": "Q5_0", "*.weight": "Q8_0"}
    gguf = write_gguf(tmp_path / "mixed.gguf", load_model(str(tiny_gemma3_dir)), "gemma3", types,
                      tokenizer_dir=tiny_gemma3_dir)
    engine = tmp_path / "engine"
    build_engine(str(gguf), exact_plan(), engine, show_progress=False)
    program = CpuExecutor(open_engine(engine).load_rank(0), 8, 16).program
    assert not any(node["op"] == "split" for node in program.doc["nodes"])  # q, k and v stayed apart
    assert [call.name for call in program.calls if not call.recordable] == []
    replayed, llm = run_mixed(engine)
    assert llm.executor.replay and llm.executor.replayed_steps > 250
    monkeypatch.setenv("KILN_STEP_REPLAY", "0")
    expected, _ = run_mixed(engine)
    assert replayed == expected
