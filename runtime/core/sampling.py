"""SamplingParams: how one request picks its tokens and when it stops, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20  # alternatives a position may return (OpenAI's limit)
# generation_config.json's sampling keys a request may leave to the model -> the value when the model sets none
GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def generation_defaults(generation_config: dict) -> dict:
    """The sampling defaults a model's generation_config.json sets (numbers only; do_sample is not read, as in
    vLLM: a request that wants greedy asks for temperature 0)."""
    return {key: value for key, value in (generation_config or {}).items()
            if key in GENERATION_DEFAULTS and isinstance(value, (int, float)) and not isinstance(value, bool)}


class Logprob(float):
    """A chosen token's log-probability (a float wherever one is read), with `top`: the position's most likely
    tokens as (token id, log-prob), most likely first, ties to the lower id, when top_logprobs was asked."""

    top: tuple[tuple[int, float], ...]

    def __new__(cls, value: float, top=()) -> Logprob:
        self = super().__new__(cls, value)
        self.top = tuple(top)
        return self

    def __reduce__(self):  # pickled as itself, top included (rank processes, Ray replicas)
        return Logprob, (float(self), self.top)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature 0 is greedy (argmax, ties to the lowest token id). top_k -1 or 0 and top_p 1.0
    are off. A request stops on a token in stop_token_ids, on the model's EOS (unless
    ignore_eos), after max_tokens generated tokens, or on a stop string (checked by the engine).
    ignore_eos only ignores the model's EOS tokens; stop_token_ids always stop (as in vLLM).
    min_tokens holds back the tokens that would stop the request (stop_token_ids, and eos_token_ids
    unless ignore_eos) until that many tokens are generated; stop strings still stop it.
    eos_token_ids are the model's EOS ids (LLMEngine.add_request fills them in): only min_tokens reads them,
    as the scheduler stops on EOS by itself.
    Penalties change the logits before greedy or sampling, as in vLLM: repetition_penalty (1 = off)
    divides a positive logit and multiplies a negative one of every token in the prompt or output;
    presence_penalty subtracts from each token already generated, frequency_penalty that times its
    count (OpenAI's, in [-2, 2]; 0 = off).
    logprobs=True returns the log-probability of each chosen token under the raw logits; top_logprobs k > 0
    (at most MAX_TOP_LOGPROBS; it implies logprobs) also the k most likely tokens of each position, with theirs.
    prompt_logprobs k (None = off; 0 to MAX_TOP_LOGPROBS) returns the log-probability of every prompt token after
    the first, under the raw logits, with the k most likely tokens of each position; such a request computes its
    whole prompt (no prefix-cache hit), so every position has its logits.
    min_p (0 = off) drops, after temperature, every token less likely than min_p times the most likely one.
    logit_bias adds its value (in [-100, 100], OpenAI's range) to its token's logit before everything else,
    greedy included; it is given as a mapping or pairs of (token id, bias) and stored as sorted pairs.
    grammar (an llguidance grammar spec: runtime/core/constraints.py) constrains every output token to what it
    allows; the request ends when the grammar is complete.
    speculative=False keeps the request out of speculative decoding where the engine runs it (it then
    decodes one token per step); its tokens are the same either way for greedy requests.
    stop and stop_token_ids accept any sequence and are stored as tuples so the params stay immutable.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    min_tokens: int = 0
    eos_token_ids: tuple[int, ...] = field(default=())
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    grammar: str | None = None
    speculative: bool = True

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not self.temperature >= 0.0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 or 0 (off) or an integer >= 1, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.stop, str):
            raise ValueError(f"stop must be a list of strings, got the string {self.stop!r} (wrap it in a list)")
        stop = tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must hold non-empty strings, got {list(stop)!r}")
        stop_token_ids, eos_token_ids = tuple(self.stop_token_ids), tuple(self.eos_token_ids)
        for name, ids in (("stop_token_ids", stop_token_ids), ("eos_token_ids", eos_token_ids)):
            if not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"{name} must hold integers >= 0, got {list(ids)!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be a bool, got {self.logprobs!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((token, value) for token, value in bias))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        if not all(_is_int(t) and t >= 0 and _is_number(v) and -100.0 <= v <= 100.0 for t, v in bias):
            raise ValueError(f"logit_bias must map token ids >= 0 to numbers in [-100, 100], got {dict(bias)!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"grammar must be a grammar spec (a string), got {type(self.grammar).__name__}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a bool, got {self.speculative!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        object.__setattr__(self, "eos_token_ids", eos_token_ids)
        object.__setattr__(self, "logit_bias", bias)
        if self.top_logprobs:
            object.__setattr__(self, "logprobs", True)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k >= 1

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0

    @property
    def uses_min_p(self) -> bool:
        return self.min_p > 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Its logits change before greedy or sampling (penalties, logit_bias, a grammar's mask): no device greedy,
        no guesses."""
        return self.uses_penalties or bool(self.logit_bias) or self.grammar is not None

    def held_back_token_ids(self, num_output_tokens: int) -> tuple[int, ...]:
        """The token ids the next token may not be, after num_output_tokens: those that would stop it early."""
        if num_output_tokens >= self.min_tokens:
            return ()
        return self.stop_token_ids + (() if self.ignore_eos else self.eos_token_ids)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
