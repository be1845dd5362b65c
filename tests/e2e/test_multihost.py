"""Across hosts, on hosts made on this machine (benchmarks/hosts.py: network namespaces on one bridge, 1 Gbit/s
links): the shipped model's tp=2 and pp=2 engines split over two hosts with `engine-run generate --nnodes 2`, the
second host given only the engine's URL (served over HTTP by the first), answer greedy chat prompts with the
one-host engine's exact text; a corrupted copy on that host is refused in one line; a host lost mid-run ends the group in
one line within the rank timeout instead of hanging; two Ray Serve replicas spread over a Ray cluster of two
hosts answer as one host does, and keep answering when one host is lost; a disaggregated engine's prefill worker on
one host and decode worker on another answer as one host does, the K/V of each prompt crossing the link; a tp=2
replica whose ranks Ray places on two hosts answers as one host does. The hosts share this machine's CPUs and
files: each host keeps its own Kiln cache folder, so a host given a URL really fetches and checks the engine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from hosts import RAY_ENV, Hosts, available, ray_cluster, ray_join  # noqa: E402

CHAT = ["What is the capital of France?", "List three colors."]
PORT = 29640


@pytest.fixture(scope="module")
def hosts():
    why = available()
    if why:
        pytest.skip(f"no hosts on this machine: {why}")
    with Hosts(3, rate="1gbit") as made:
        yield made


@pytest.fixture(scope="module")
def served(hosts, smollm2_engines):
    """The tp=2 engine, and its URL: a static file server on host 0 over the folder that holds it."""
    engine = smollm2_engines(2, 1)
    server = hosts.popen(0, [sys.executable, "-m", "http.server", "8480", "--bind", hosts.address(0), "--directory",
                             str(engine.parent)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    assert server.poll() is None
    return engine, f"http://{hosts.address(0)}:8480/{engine.name}"


def generate(engine, *extra: str, max_tokens: int = 24) -> list[str]:
    args = [sys.executable, "-m", "runtime.cli", "generate", str(engine), "--chat", "--max-tokens", str(max_tokens),
            "--temperature", "0", "--threads", "1", *extra]
    for prompt in CHAT:
        args += ["--prompt", prompt]
    return args


def group(hosts, served, tmp_path, command=generate, rank_timeout: str = "60"):
    """Host 0 (node 0, the engine's own folder) and host 2 (node 1, the URL, its own cache): both processes."""
    engine, url = served
    nodes = ["--nnodes", "2", "--master-addr", hosts.address(0), "--master-port", str(PORT),
             "--rank-timeout", rank_timeout]
    env = dict(os.environ, KILN_CACHE_DIR=str(tmp_path / "host2-cache"))
    worker = hosts.popen(2, command(url, *nodes, "--node-rank", "1"), cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    leader = hosts.popen(0, command(engine, *nodes, "--node-rank", "0"), cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return leader, worker


def long_bench(engine, *extra: str) -> list[str]:
    """One request of 1,500 tokens (EOS ignored): minutes of steps, for a host to be lost during them."""
    return [sys.executable, "-m", "runtime.cli", "bench", str(engine), "-c", "1", "--requests", "1", "--prompt-len",
            "16", "--output-len", "1500", "--no-roofline", "--threads", "1", *extra]


def test_tp2_over_two_hosts_answers_as_one_host_with_the_engine_fetched(hosts, served, tmp_path):
    engine, _ = served
    alone = subprocess.run(generate(engine), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-2000:]
    leader, worker = group(hosts, served, tmp_path)
    out, err = leader.communicate(timeout=300)
    assert leader.returncode == 0, err[-2000:]
    assert worker.wait(timeout=60) == 0, worker.stderr.read()[-2000:]
    assert out == alone.stdout and out.count("--- [") == len(CHAT)
    cached = list((tmp_path / "host2-cache" / "engines").iterdir())
    assert [p.name for p in cached] == [json.loads((engine / "manifest.json").read_text())["build_id"]]

    # the copy corrupted on host 2: refused there in one line, before any rank starts
    rank1 = cached[0] / "rank1.engine"
    data = bytearray(rank1.read_bytes()[:4096])
    with open(rank1, "r+b") as f:
        f.seek(4000)
        f.write(bytes([data[4000] ^ 0x40]))
    _, url = served
    env = dict(os.environ, KILN_CACHE_DIR=str(tmp_path / "host2-cache"))
    refused = subprocess.run(hosts.command(2, generate(url, "--nnodes", "2", "--node-rank", "1", "--master-addr",
                                                       hosts.address(0), "--master-port", str(PORT + 1))),
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank1.engine" in lines[0] and "corrupt or partial" in lines[0], refused.stderr


def test_pp2_over_two_hosts_answers_as_one_host(hosts, served, smollm2_engines, tmp_path):
    """The pipeline's two stages on hosts 0 and 2 (the second given the URL): each step's hidden states cross the
    link once, and the text is the one-host engine's."""
    engine = smollm2_engines(1, 2)
    assert engine.parent == served[0].parent  # host 0's file server has it too
    alone = subprocess.run(generate(engine), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-2000:]
    leader, worker = group(hosts, (engine, served[1].rsplit("/", 1)[0] + "/" + engine.name), tmp_path)
    out, err = leader.communicate(timeout=300)
    assert leader.returncode == 0, err[-2000:]
    assert worker.wait(timeout=60) == 0, worker.stderr.read()[-2000:]
    assert out == alone.stdout and out.count("--- [") == len(CHAT)


def test_a_host_lost_mid_run_ends_the_group_in_one_line(hosts, served, tmp_path):
    leader, worker = group(hosts, served, tmp_path, command=long_bench, rank_timeout="10")
    fetched = tmp_path / "host2-cache" / "engines"
    deadline = time.monotonic() + 120
    while not fetched.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(12.0)  # the ranks have joined and step
    assert leader.poll() is None and worker.poll() is None, (leader.stderr.read(), worker.stderr.read())
    lost = time.monotonic()
    hosts.kill(2)
    _, err = leader.communicate(timeout=120)
    assert leader.returncode != 0
    assert time.monotonic() - lost < 60  # the rank timeout (10 s) and the group's teardown, not a hang
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("engine-run: error:") and "rank 1" in lines[-1], err[-2000:]


def in_host(hosts, host: int, code: str, timeout: float = 120) -> str:
    """Python run on `host` (the test's own namespace reaches none of them): its stdout, failing on an error."""
    done = subprocess.run(hosts.command(host, [sys.executable, "-c", code]), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


ASK = """
import httpx, json, sys, time
url, prompts, deadline = {url!r}, {prompts!r}, time.monotonic() + {patience}
answers = []
for prompt in prompts:
    while True:
        try:
            r = httpx.post(url + "/v1/chat/completions", timeout=30, json={{"model": "smollm2", "max_tokens": 24,
                           "temperature": 0, "messages": [{{"role": "user", "content": prompt}}]}})
            if r.status_code == 200:
                answers.append(r.json()["choices"][0]["message"]["content"])
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "no answer in time"
        time.sleep(1)
print(json.dumps(answers))
"""

METRICS = """
import httpx, json, sys, time
url, wanted, deadline = {url!r}, {wanted!r}, time.monotonic() + 30
while True:  # the replicas report their figures about once a second
    text = httpx.get(url + "/metrics", timeout=10).text
    rows = [line.split() for line in text.splitlines() if line.startswith("kiln_replica_")]
    figures = {{}}
    for name, value in rows:
        key, replica = name.split("{{")[0][len("kiln_replica_"):], name.split('replica="')[1].split('"')[0]
        figures.setdefault(replica, {{}})[key] = float(value)
    if sum(f.get("kv_handoffs", 0) for f in figures.values()) >= wanted or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps(figures))
"""


@pytest.fixture(scope="module")
def cluster(hosts, tmp_path_factory):
    """A Ray cluster of hosts 0 (the head, with the kiln_prefill resource) and 1 (kiln_decode), each with its own
    Kiln cache folder: (its address, the cache folders)."""
    caches = [tmp_path_factory.mktemp(f"ray-cache{host}") for host in (0, 1)]
    with ray_cluster(hosts, [0, 1], caches, [{"kiln_prefill": 1}, {"kiln_decode": 1}]) as address:
        yield address, caches


def serve_on(hosts, cluster, url: str, *args: str) -> subprocess.Popen:
    address, caches = cluster
    return hosts.popen(0, [sys.executable, "-m", "runtime.cli", "serve", url, "--model-name", "smollm2", *args,
                           "--ray-address", address, "--host", hosts.address(0), "--port", "8000", "--threads", "1"],
                       cwd=REPO, env=dict(os.environ, **RAY_ENV, KILN_CACHE_DIR=str(caches[0])),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop(serve: subprocess.Popen) -> None:
    """SIGTERM: the server shuts its Serve application down, leaving the cluster for the next test."""
    serve.terminate()
    try:
        serve.wait(timeout=90)
    except subprocess.TimeoutExpired:
        serve.kill()


def titles(hosts, host: int) -> list[bytes]:
    """The command lines (Ray's process titles) of the processes in a host's namespace."""
    pids = subprocess.run(["ip", "netns", "pids", hosts.names[host]], capture_output=True, text=True).stdout.split()
    return [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in pids if Path(f"/proc/{pid}/cmdline").exists()]


def one_host_answers(engine) -> list[str]:
    alone = subprocess.run(generate(engine), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-2000:]
    return [part.split("\n", 1)[1].strip() for part in alone.stdout.split("--- [")[1:]]


@pytest.fixture(scope="module")
def engine_url(hosts, smollm2_default_engine):
    """The one-rank engine's URL: a static file server on host 0 over the folder that holds it."""
    engine = smollm2_default_engine
    files = hosts.popen(0, [sys.executable, "-m", "http.server", "8481", "--bind", hosts.address(0), "--directory",
                            str(engine.parent)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    assert files.poll() is None
    yield f"http://{hosts.address(0)}:8481/{engine.name}"
    files.kill()


def test_disaggregated_prefill_and_decode_on_two_hosts(hosts, cluster, engine_url, smollm2_default_engine):
    """`engine-run serve URL --disaggregate 1:1 --ray-address` on the cluster: the prefill worker on host 0 (the
    kiln_prefill node), the decode worker on host 1 (kiln_decode), each prompt's K/V handed over the 1 Gbit/s link;
    greedy answers equal one host's, and /metrics counts every hand-over with the prompt's K/V bytes."""
    engine = smollm2_default_engine
    serve = serve_on(hosts, cluster, engine_url, "--disaggregate", "1:1")
    try:
        base = f"http://{hosts.address(0)}:8000"
        answers = json.loads(in_host(hosts, 0, ASK.format(url=base, prompts=CHAT, patience=240), timeout=300))
        assert answers == one_host_answers(engine)
        figures = json.loads(in_host(hosts, 0, METRICS.format(url=base, wanted=len(CHAT))))
        decode = [f for f in figures.values() if f.get("kv_handoffs")]
        assert len(figures) == 2 and len(decode) == 1 and decode[0]["kv_handoffs"] == len(CHAT), figures
        per_token = json.loads((engine / "manifest.json").read_text())["memory"]["ranks"][0]["kv_bytes_per_token"]
        prompt_tokens = decode[0]["kv_handoff_bytes"] / per_token
        assert prompt_tokens == int(prompt_tokens) and 20 * len(CHAT) < prompt_tokens < 100 * len(CHAT), figures
        assert 0 < decode[0]["kv_handoff_seconds"] < 30
        pids = [set(map(int, subprocess.run(["ip", "netns", "pids", hosts.names[host]], capture_output=True,
                                            text=True).stdout.split())) for host in (0, 1)]
        prefill = next(f for f in figures.values() if f is not decode[0])
        assert int(prefill["pid"]) in pids[0] and int(decode[0]["pid"]) in pids[1], (figures, pids)
    finally:
        stop(serve)
        # the decode worker's host fetched the engine by URL: cleared, for the next test's host 1 to fetch it again
        shutil.rmtree(cluster[1][1] / "engines", ignore_errors=True)




FAILS = """
import httpx, json, time
url, deadline = {url!r}, time.monotonic() + 120
while time.monotonic() < deadline:  # until a request is answered with an error
    r = httpx.post(url + "/v1/chat/completions", timeout=90, json={{"model": "smollm2", "max_tokens": 8,
                   "messages": [{{"role": "user", "content": "Hi"}}]}})
    if r.status_code != 200:
        print(json.dumps({{"status": r.status_code, "message": r.json()["error"]["message"]}}))
        break
    time.sleep(1)
"""


def test_a_replica_whose_ranks_ray_places_on_two_hosts(hosts, cluster, served):
    """`engine-run serve TP2_URL --nnodes 2 --ray-address`: Serve places the replica in a placement group of two
    bundles on separate nodes, the replica on one host and a rank host actor on the other (host 1 fetching the
    engine by URL), and the greedy answers equal one host's. Where the rank host is on host 1 (Ray picks the way
    round), host 1 is lost: requests end in a one-line error within the rank timeout, nothing hangs, and the server
    stays up (Serve cannot place a new group on one node); host 1 then rejoins the cluster."""
    engine, url = served
    serve = serve_on(hosts, cluster, url, "--nnodes", "2", "--rank-timeout", "10")
    base = f"http://{hosts.address(0)}:8000"
    try:
        answers = json.loads(in_host(hosts, 0, ASK.format(url=base, prompts=CHAT, patience=240), timeout=300))
        assert answers == one_host_answers(engine)
        build_id = json.loads((engine / "manifest.json").read_text())["build_id"]
        assert [p.name for p in (cluster[1][1] / "engines").iterdir()] == [build_id]  # host 1's part fetched it
        # the group's two bundles on the two hosts, either way round: the replica (host 0 of the group) on one,
        # the rank host actor on the other (Ray titles its workers by the actor they run)
        roles = [{role for role in (b"KilnReplica", b"RankHost") if any(role in title for title in titles(hosts, h))}
                 for h in (0, 1)]
        assert sorted(roles, key=sorted) == sorted([{b"KilnReplica"}, {b"RankHost"}], key=sorted), roles

        if roles[1] == {b"RankHost"}:  # the group's second host is host 1, which can be lost (host 0 holds the
            hosts.kill(1)              # endpoint and Ray's head): its rank gone, requests fail in one line
            lost = time.monotonic()
            said = json.loads(in_host(hosts, 0, FAILS.format(url=base), timeout=150))
            assert said["status"] in (500, 503) and "\n" not in said["message"], said
            assert time.monotonic() - lost < 100 and serve.poll() is None
    finally:
        stop(serve)
        ray_join(hosts, 1, cluster[0], cluster[1][1], {"kiln_decode": 1})  # back for the next test
        shutil.rmtree(cluster[1][1] / "engines", ignore_errors=True)


def test_two_replicas_on_two_hosts_answer_and_survive_a_host_lost(hosts, cluster, engine_url,
                                                                  smollm2_default_engine):
    """`engine-run serve URL --replicas 2 --spread --ray-address` on the cluster of hosts 0 and 1: one replica a
    host, each fetching the engine by URL; greedy answers equal one host's; all of host 1's processes killed, the
    endpoint keeps answering from host 0."""
    engine = smollm2_default_engine
    serve = serve_on(hosts, cluster, engine_url, "--replicas", "2", "--spread", "--routing", "round-robin")
    try:
        base = f"http://{hosts.address(0)}:8000"
        prompts = [CHAT[0]] * 4 + [CHAT[1]] * 4
        answers = json.loads(in_host(hosts, 0, ASK.format(url=base, prompts=prompts, patience=240), timeout=300))
        expected = one_host_answers(engine)
        assert answers[:4] == [expected[0]] * 4 and answers[4:] == [expected[1]] * 4, (answers, expected)
        # --spread puts at most one replica on a node, so with two nodes each has one: host 1's fetched its copy
        assert [p.name for p in (cluster[1][1] / "engines").iterdir()] == [
            json.loads((engine / "manifest.json").read_text())["build_id"]]

        hosts.kill(1)  # host 1 lost: its raylet, its replica, its rank
        # a request routed to the lost replica before Ray marks its node dead may wait out its 30 s: it is retried
        after = json.loads(in_host(hosts, 0, ASK.format(url=base, prompts=CHAT, patience=200), timeout=260))
        assert after == expected
        assert serve.poll() is None
    finally:
        serve.kill()
