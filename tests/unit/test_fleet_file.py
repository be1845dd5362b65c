"""Fleet files and per-key limits without a server: what a fleet file may say and the one-line errors for what it
gets wrong; the keys' names and limits; the sliding window's 429s and their Retry-After."""

import pytest

from runtime.serving.auth import ApiKeys, KeyFileError, parse_key
from runtime.serving.fleet import ReplicaPlan, TierSpec, load_fleet
from runtime.serving.metrics import FrontMetrics
from runtime.serving.protocol import APIError
from runtime.serving.quotas import KeyQuotas


def fleet_file(tmp_path, text: str):
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return path


def test_a_fleet_file_names_models_their_plans_and_tiers(tmp_path):
    fleet = load_fleet(fleet_file(tmp_path, """
[[models]]
name = "fast"
engine = "engines/fast"
replicas = 2
routing = "round-robin"
threads = 1

[[models]]
name = "strong"
engine = "/abs/strong"
disaggregate = "1:2"

[tiers.auto]
models = ["fast", "strong"]
probe_tokens = 4
min_mean_logprob = -0.5
max_prompt_tokens = 900
confidence = "min"
"""))
    fast, strong = fleet.models
    assert fast.engine == (tmp_path / "engines/fast").resolve() and str(strong.engine) == "/abs/strong"
    assert fast.plan == ReplicaPlan(replicas=2, routing="round-robin") and fast.threads == 1
    assert strong.plan.prefill_replicas == 1 and strong.plan.replicas == 2 and fleet.on_ray
    assert fleet.tiers == (TierSpec("auto", ("fast", "strong"), 4, -0.5, 900, "min"),)


@pytest.mark.parametrize("text, says", [
    ("[[models]]\nname = 'a'\n", "engine = DIR is required"),
    ("[[models]]\nname = 'a'\nengine = 'x'\nreplica = 2\n", "unknown key(s) replica"),
    ("[[models]]\nname = 'a'\nengine = 'x'\n[[models]]\nname = 'a'\nengine = 'y'\n", "given to two engines"),
    ("[[models]]\nname = 'a'\nengine = 'x'\nreplicas = 0\n", "--replicas must be >= 1"),
    ("[[models]]\nname = 'a'\nengine = 'x'\n[tiers.auto]\nmodels = ['a', 'b']\n", "names 'b', not served here"),
    ("[[models]]\nname = 'a'\nengine = 'x'\n[tiers.a]\nmodels = ['a', 'a']\n", "two or more different"),
    ("[[models]]\nname = 'a'\nengine = 'x'\n[[models]]\nname = 'b'\nengine = 'y'\n"
     "[tiers.t]\nmodels = ['a', 'b']\nmin_mean_logprob = 0.5\n", "must be a log-probability"),
    ("[[models]]\nname = 'a'\nengine = 'x'\n[[models]]\nname = 'b'\nengine = 'y'\n[tiers.a]\nmodels = ['a', 'b']\n",
     "has the name of a model"),
    ("[[models]]\nname = 'a'\nengine = 'x'\n[[models]]\nname = 'b'\nengine = 'y'\n"
     "[tiers.t]\nmodels = ['a', 'b']\nconfidence = 'median'\n", "confidence must be one of mean, min"),
    ("models = 3\n", "expected [[models]]"),
    ("[[models]\n", "not TOML"),
])
def test_a_bad_fleet_file_gets_one_line_naming_it(tmp_path, text, says):
    with pytest.raises(ValueError) as error:
        load_fleet(fleet_file(tmp_path, text))
    assert says in str(error.value) and str(tmp_path) in str(error.value) and "\n" not in str(error.value)


def test_keys_carry_names_and_limits_and_errors_never_show_the_key(tmp_path):
    key = parse_key("sk-123 name=alice rpm=5", rpm=100, tpm=9000)
    assert (key.secret, key.name, key.rpm, key.tpm) == (b"sk-123", "alice", 5, 9000)
    unnamed = parse_key("sk-456 tpm=0", rpm=100)
    assert unnamed.name.startswith("key-") and "456" not in unnamed.name and unnamed.tpm is None
    key_file = tmp_path / "keys"
    key_file.write_text("sk-good\nsk-secret-value rpm=lots\n")
    with pytest.raises(KeyFileError) as error:
        ApiKeys(key_file=key_file, environ={})
    assert "line 2" in str(error.value) and "sk-secret-value" not in str(error.value)
    keys = ApiKeys(["flag name=f"], environ={"KILN_API_KEY": "env"})
    assert keys.accepts(b"flag").name == "f" and keys.accepts(b"env") is not None and keys.accepts(b"fla") is None


def test_an_emptied_key_file_refuses_everyone_rather_than_opening_the_server(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("sk-a\n")
    keys = ApiKeys(key_file=key_file, environ={})
    key_file.write_text("# nobody\n")
    keys.reload()
    assert keys.enabled and keys.accepts(b"sk-a") is None


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_slide_and_say_when_to_retry():
    clock = Clock()
    quotas = KeyQuotas(FrontMetrics({}), clock)
    bob, alice = parse_key("b name=bob rpm=2"), parse_key("a name=alice")
    quotas.admit_request(bob)
    clock.now += 10
    quotas.admit_request(bob)
    clock.now += 5
    with pytest.raises(APIError) as refused:
        quotas.admit_request(bob)
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "45"  # the first leaves at 60 s
    for _ in range(50):
        quotas.admit_request(alice)  # another key, no limit
    clock.now += 45
    quotas.admit_request(bob)


def test_tokens_per_minute_count_prompts_and_answers():
    clock = Clock()
    quotas = KeyQuotas(FrontMetrics({}), clock)
    key = parse_key("k name=k tpm=100")
    quotas.admit_prompt(key, 150)  # an empty window takes a prompt over the budget
    with pytest.raises(APIError) as refused:
        quotas.admit_prompt(key, 1)
    assert refused.value.headers["Retry-After"] == "60"
    clock.now += 60
    quotas.admit_prompt(key, 30)
    clock.now += 20
    quotas.generated(key, 50)
    quotas.admit_prompt(key, 20)  # 30 + 50 + 20 = 100: at the limit, not over
    clock.now += 1
    with pytest.raises(APIError) as refused:
        quotas.admit_prompt(key, 10)
    assert refused.value.headers["Retry-After"] == "39"  # the 30-token prompt leaves 39 s from now
