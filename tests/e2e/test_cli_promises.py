"""What the README and `--help` promise exists: `engine-run bench` measures and plots, `serve` refuses a
corrupt engine or a taken port before it listens, and every command and flag the README names is in
the `--help` of the command it belongs to."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_server import free_port

README = Path(__file__).resolve().parents[2] / "README.md"
CLIS = {"engine-build": "builder.cli", "engine-run": "runtime.cli"}


def cli(program: str, *args, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", CLIS[program], *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(proc, program: str, pattern: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{program}: error: ") and re.search(pattern, lines[0]), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def tiny_engine_dir(tiny_llama_dir, build_tiny_engine):
    return build_tiny_engine(tiny_llama_dir, "tiny")


# ------------------------------------------------------------------------------------- bench

def test_bench_measures_each_level_and_draws_them(tiny_engine_dir, tmp_path):
    figures, picture = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = cli("engine-run", "bench", tiny_engine_dir, "-c", "1", "-c", "3", "--requests", "4", "--prompt-len", "9",
               "--output-len", "5", "--threads", "1", "--json", figures, "--plot", picture)
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.strip().splitlines()
    assert header.split()[:3] == ["conc", "out", "tok/s"] and [row.split()[0] for row in rows] == ["1", "3"]
    doc = json.loads(figures.read_text())
    assert (doc["prompt_len"], doc["output_len"]) == (9, 5) and doc["weight_bytes_per_rank"] > 0
    for level in doc["levels"]:
        assert level["requests"] == 4 and level["output_tok_s"] > 0 and level["weight_gbs"] > 0
        # every request's 5 tokens came from at least 5 steps; 3 at a time take fewer steps than 1 at a time
        assert level["steps"] >= 5 and level["ttft_p50_ms"] <= level["ttft_p99_ms"]
    assert doc["levels"][1]["steps"] < doc["levels"][0]["steps"]
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
    # the roofline: the machine's peaks measured on the run's threads, each level's shares of them
    peaks = doc["peaks"]
    assert peaks["threads"] == 1 and min(peaks["read_gbs"], peaks["f32_gflops"], peaks["int8_gops"],
                                         peaks["int16_gops"]) > 0
    for level in doc["levels"]:
        assert level["limit"] in ("memory", "f32") and 0 < level["memory_pct"] and 0 < level["compute_pct"]
        assert level["memory_pct"] == pytest.approx(100 * level["weight_gbs"] / peaks["read_gbs"])
    assert doc["levels"][1]["tokens_per_step"] > doc["levels"][0]["tokens_per_step"]
    assert "% read BW" in header and "% compute" in header and header.split()[-1] == "limit"
    assert f"peaks on 1 threads: read {peaks['read_gbs']:.1f} GB/s" in proc.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a busy loop beside the engine needs two CPUs")
def test_bench_runs_the_levels_again_beside_busy_cores(tiny_engine_dir, tmp_path):
    figures = tmp_path / "bench.json"
    proc = cli("engine-run", "bench", tiny_engine_dir, "-c", "1", "-c", "2", "--requests", "2", "--prompt-len", "9",
               "--output-len", "4", "--no-roofline", "--busy-cores", "1", "--json", figures)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(figures.read_text())
    assert doc["busy_cores"] == sorted(os.sched_getaffinity(0))[-1:]
    assert [level["concurrency"] for level in doc["busy_levels"]] == [1, 2]
    assert all(level["output_tok_s"] > 0 for level in doc["busy_levels"])
    slowdown = proc.stdout.strip().splitlines()[-3:]
    assert slowdown[0].split()[:4] == ["conc", "quiet", "tok/s", "busy"]
    for row, quiet, busy in zip(slowdown[1:], doc["levels"], doc["busy_levels"]):
        share = f"{100 * busy['output_tok_s'] / quiet['output_tok_s']:.0f}%"
        assert row.split()[:4] == [str(quiet["concurrency"]), f"{quiet['output_tok_s']:.1f}",
                                   f"{busy['output_tok_s']:.1f}", share]
    # the busy loops are gone with the run
    leftover = subprocess.run(["pgrep", "-f", "while True: pass"], capture_output=True, text=True,
                              check=False).stdout.split()
    assert leftover == []


def test_bench_refuses_more_busy_cores_than_it_may_use(tiny_engine_dir):
    cpus = len(os.sched_getaffinity(0))
    proc = cli("engine-run", "bench", tiny_engine_dir, "--busy-cores", str(cpus + 1))
    assert_one_line_error(proc, "engine-run", rf"--busy-cores {cpus + 1}: this process may use {cpus} CPUs")


def test_bench_refuses_lengths_the_engine_cannot_hold(tiny_engine_dir):
    proc = cli("engine-run", "bench", tiny_engine_dir, "--prompt-len", "100000")
    assert_one_line_error(proc, "engine-run", r"--prompt-len 100000 \+ --output-len 128 exceeds the engine's max_seq_len")


def test_a_negative_prefill_chunk_is_one_line_error(tiny_engine_dir):
    proc = cli("engine-run", "generate", tiny_engine_dir, "-p", "hi", "--prefill-chunk", "-1")
    assert_one_line_error(proc, "engine-run", r"--prefill-chunk must be >= 0")


def test_generate_lifts_the_prefill_cap_for_a_batch_it_does_not_stream(tiny_engine_dir, monkeypatch):
    """Several prompts: nothing streams, so no decode waits on a step and the cap beside decodes is lifted.
    One prompt (streamed to the terminal) keeps the server's default, and --prefill-chunk always wins."""
    from typer.testing import CliRunner

    import runtime.launcher as launcher
    from runtime import cli as engine_run
    from runtime.core.engine import DEFAULT_PREFILL_CHUNK

    chunks, real = [], launcher.open_llm_engine

    def opened_with(engine, options, nodes=None):  # the real engine runs; only the options it was opened with are kept
        chunks.append(options.prefill_chunk)
        return real(engine, options, nodes)

    monkeypatch.setattr(launcher, "open_llm_engine", opened_with)
    for prompts in (["-p", "a", "-p", "b"], ["-p", "a"], ["-p", "a", "-p", "b", "--prefill-chunk", "16"]):
        result = CliRunner().invoke(engine_run.app, ["generate", str(tiny_engine_dir), *prompts, "--max-tokens", "3"])
        assert result.exit_code == 0, result.output
    assert chunks == [None, DEFAULT_PREFILL_CHUNK, 16]


# ------------------------------------------------------------------------------------- serve

def test_serve_refuses_a_corrupt_engine_before_it_listens(tiny_engine_dir, tmp_path):
    import shutil

    engine = shutil.copytree(tiny_engine_dir, tmp_path / "corrupt")
    data = bytearray((engine / "rank0.engine").read_bytes())
    data[-100] ^= 0xFF
    (engine / "rank0.engine").write_bytes(data)
    proc = cli("engine-run", "serve", engine, "--port", str(free_port()), timeout=60)
    assert_one_line_error(proc, "engine-run", r"rank0\.engine.*sha256")
    assert "Uvicorn" not in proc.stdout + proc.stderr and "serving" not in proc.stdout


def test_serve_refuses_a_taken_port_before_loading(tiny_engine_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = cli("engine-run", "serve", tiny_engine_dir, "--port", str(port), timeout=60)
    assert_one_line_error(proc, "engine-run", rf"cannot listen on 127\.0\.0\.1:{port}: .*--port")


# --------------------------------------------------------------- README and docs against --help and the tree

DOCS = [README, *sorted((README.parent / "docs").glob("*.md"))]
SCRIPTS = README.parent / "benchmarks"


def console_lines(page: Path) -> list[str]:
    """The commands of a page's ```console blocks, continuation lines joined, comments dropped."""
    lines, inside, held = [], False, ""
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```console"
            continue
        if not inside:
            continue
        held += line.rstrip()
        if held.endswith("\\"):
            held = held[:-1] + " "
            continue
        command = " ".join(re.sub(r"(^|\s)#.*$", "", held).split())
        held = ""
        if command:
            lines.append(command)
    return lines


def doc_commands(pages=DOCS) -> list[tuple[str, str, str | None, set[str]]]:
    """(page, program, subcommand or None, flags) for every engine-build / engine-run command in console blocks."""
    found = []
    for page in pages:
        for line in console_lines(page):
            for match in re.finditer(r"(?:^|&&\s*|\|\s*)(engine-build|engine-run)\b([^&|]*)", line):
                words = match.group(2).split()
                sub = words[0] if words and re.fullmatch(r"[a-z]+", words[0]) else None
                flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", match.group(2)))
                found.append((page.name, match.group(1), sub, flags))
    return found


def help_text(program: str, sub: str | None) -> str:
    proc = cli(program, *([sub] if sub else []), "--help", timeout=60)
    assert proc.returncode == 0, f"{program} {sub} --help: {proc.stderr}"
    return proc.stdout


def test_every_command_the_docs_show_names_a_real_subcommand_and_flags():
    commands = doc_commands()
    assert {("engine-build", "build"), ("engine-run", "serve"), ("engine-run", "bench")} <= \
        {(program, sub) for page, program, sub, _ in commands if page == "README.md"}
    helps: dict[tuple, str] = {}
    missing = []
    for page, program, sub, flags in commands:
        if (program, sub) not in helps:  # once a subcommand: each --help starts a Python (1-2 s)
            helps[program, sub] = help_text(program, sub)
        text = helps[program, sub]
        missing += [f"{page}: `{program} {sub or ''} {flag}`" for flag in sorted(flags)
                    if not re.search(rf"{flag}\b", text)]
    assert not missing, f"flags no --help has: {missing}"


def test_every_benchmark_command_the_docs_show_takes_its_flags():
    scripts: dict[str, set[str]] = {}
    for page in DOCS:
        for line in console_lines(page):
            for match in re.finditer(r"python3? (benchmarks/\w+\.py)([^&|]*)", line):
                scripts.setdefault(match.group(1), set()).update(
                    re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", match.group(2)))
    assert "benchmarks/bench_runtime.py" in scripts
    missing = []
    for script, flags in sorted(scripts.items()):
        assert (README.parent / script).is_file(), f"the docs run {script}, which does not exist"
        if not flags:
            continue
        proc = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120,
                              cwd=README.parent)
        assert proc.returncode == 0, f"{script} --help: {proc.stderr[-500:]}"
        missing += [f"{script} {flag}" for flag in sorted(flags) if not re.search(rf"{flag}\b", proc.stdout)]
    assert not missing, f"flags the scripts do not take: {missing}"


def slug(heading: str) -> str:
    """The anchor a Markdown renderer (GitHub's rule) gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for page in DOCS:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code are not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and resolved.suffix == ".md":
                headings = re.findall(r"^#+\s+(.+)$", resolved.read_text(), flags=re.M)
                if anchor not in {slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, f"links that lead nowhere: {broken}"


def test_the_readme_is_a_guide():
    text = README.read_text()
    assert len(text.splitlines()) <= 400
    for page in DOCS:
        narrative = re.findall(r"(?i)\b(this release|releases? before|the previous release)\b", page.read_text())
        assert not narrative, f"{page.name} narrates releases ({narrative}): history belongs in CHANGELOG.md"


def test_the_checks_above_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See [x](missing.md) and [y](#nowhere).\n\n## Real heading\n\n```console\n"
                    "engine-run serve --no-such-flag \\\n  --port 1   # a comment --ignored\n```\n")
    assert console_lines(page) == ["engine-run serve --no-such-flag --port 1"]
    assert doc_commands([page]) == [("page.md", "engine-run", "serve", {"--no-such-flag", "--port"})]
    assert slug("Real heading") == "real-heading" and slug("`--rank`: one rank, alone") == "--rank-one-rank-alone"


def test_every_flag_the_readme_names_exists_somewhere():
    """Flags in the README's prose (`--flag`) belong to some command's --help."""
    prose = set(re.findall(r"`(--[a-z][a-z0-9-]*)", README.read_text())) - {"--no-deps"}  # pip's own
    everything = "".join(help_text(program, sub) for program, sub in
                         [("engine-build", s) for s in ("build", "plan", "verify", "inspect", "compile")] +
                         [("engine-run", s) for s in ("generate", "serve", "bench")])
    missing = sorted(f for f in prose if not re.search(rf"{f}\b", everything))
    assert not missing, f"the README names flags no command has: {missing}"
