"""User-facing sampling parameters: the one type that travels from the gateway (which
builds it from an OpenAI body) over the wire (`to_dict`) to the engine (`from_dict`),
validated on construction on both sides. Torch-free."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from common.structured_limits import limit_error

MAX_LOGPROBS = 20
MAX_TOKEN_ID_LIST = 1024  # stop_token_ids and logit_bias entries: a request is no place for a vocabulary
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
GRAMMAR_DIALECTS = ("lark", "gbnf")  # a grammar's "dialect", decided by the gateway
MAX_TEMPERATURE = 2.0  # OpenAI's bound
MAX_TOP_K = 1 << 20
MAX_LENGTH_PENALTY = 10.0
MAX_REPETITION_PENALTY = 1e6
GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy (argmax), as vLLM does
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1  # what msgpack can carry


class ParamError(ValueError):
    """An invalid sampling parameter; `param` names it and `code` says how (`invalid_type` or
    `invalid_value`): the gateway's 400 carries both, the engine's admission refuses with it."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


# The fields an OpenAI request body carries under their own names (vLLM's extensions included),
# passed to SamplingParams as they come: the gateway reads no rule of theirs. The other fields
# (n, best_of, max_tokens, logprobs, logit_bias, prompt_logprobs, structured_output) depend on the
# endpoint or need translating (`gateway.api.validation`).
BODY_FIELDS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "seed", "min_tokens", "stop_token_ids",
               "ignore_eos", "use_beam_search", "length_penalty", "presence_penalty", "frequency_penalty",
               "repetition_penalty")


def stable_seed(request_id: str) -> int:
    """The seed of an unseeded random request: derived from its id, so every engine that
    runs it (after a preemption, or resuming it after another engine died) draws the same."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") >> 1


@dataclass(slots=True)
class SamplingParams:
    """How to pick the next tokens of one request (vLLM / OpenAI semantics).

    `top_k` of 0 or -1 means off; `typical_p` < 1 keeps the locally typical tokens (those whose
    surprisal is nearest the distribution's entropy, until their mass reaches typical_p; Meister
    et al. 2022), applied after top-k, top-p and min-p. `logprobs` None returns none, 0 the sampled token's
    logprob, k > 0 also the k most likely alternatives. `best_of` defaults to `n`; with
    beam search it is the beam width. `early_stopping` is False, True or "never" (the
    Hugging Face beam-search stopping rules).

    Penalties: `presence_penalty` and `frequency_penalty` (OpenAI, -2..2) subtract from the
    logits of tokens already generated (once, and once per occurrence); `repetition_penalty`
    (HF/vLLM, > 0) divides positive and multiplies negative logits of tokens seen in the
    prompt or the output; `logit_bias` adds its value (-100..100) to a token's logit.
    `structured_output` constrains the output: ``{"kind": K, "spec": S}`` with K one of
    STRUCTURED_KINDS: json_schema (S the schema as JSON text), json_object (S None), regex (S a
    regular expression), grammar (S a Lark/EBNF grammar, with "dialect": one of GRAMMAR_DIALECTS;
    without it, `grammar_dialect`'s old rule), choice (S a list of strings).
    `prompt_logprobs` None returns none, k the prompt tokens' logprobs with k alternatives."""

    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    typical_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_output: dict[str, Any] | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every rule of the request, in one place (the gateway's 400s and the engine's admission
        both come from here): each field's type and range, then the combinations. Integral
        numbers are taken for integers (JSON may write 2 as 2.0) and numbers for floats, so the
        fields hold ints and floats after it. Raises ParamError naming the field."""
        self._check_counts()
        self._check_randomness()
        self._check_lengths()
        self._check_beam_search()
        self._check_logit_processing()

    @property
    def is_greedy(self) -> bool:
        """True when the sampler should take the argmax (temperature ~ 0, no beam search)."""
        return self.temperature < GREEDY_EPS and not self.use_beam_search

    def with_default_seed(self, request_id: str) -> SamplingParams:
        """These parameters, with `stable_seed(request_id)` when random and unseeded."""
        if self.seed is not None or self.is_greedy:
            return self
        return replace(self, seed=stable_seed(request_id))

    @property
    def num_candidates(self) -> int:
        """Sequences generated per request: `best_of` (the beam width for beam search) or `n`."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def resumes_in_place(self) -> bool:
        """One sequence, no beams: a request taken over from a dead engine continues after the
        tokens its client already has. Others (n > 1, best_of, beam search) restart from the
        prompt; their seeded draws repeat and the gateway drops what it already has."""
        return self.num_candidates == 1 and not self.use_beam_search

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, ready for msgpack."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["logit_bias"] = dict(self.logit_bias)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Inverse of `to_dict`; unknown keys are ignored (newer senders), values validated."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if isinstance(kwargs.get("stop_token_ids"), tuple):
            kwargs["stop_token_ids"] = list(kwargs["stop_token_ids"])
        if isinstance(kwargs.get("logit_bias"), dict):
            kwargs["logit_bias"] = dict(kwargs["logit_bias"])
        return cls(**kwargs)

    @property
    def token_ids_to_check(self) -> set[int]:
        """Every token id the request names (the engine checks them against its vocabulary)."""
        return set(self.stop_token_ids) | set(self.logit_bias)

    def _check_counts(self) -> None:
        self.n = _int("n", self.n)
        if self.n < 1:
            raise ParamError(f"n must be at least 1, got {self.n}", "n")
        if self.best_of is not None:
            self.best_of = _int("best_of", self.best_of)
            if self.best_of < self.n:
                raise ParamError(f"best_of must be >= n (got best_of={self.best_of}, n={self.n})", "best_of")
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ParamError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}", "logprobs")

    def _check_randomness(self) -> None:
        self.temperature = _real("temperature", self.temperature)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ParamError(f"temperature must be a finite number >= 0 and at most {MAX_TEMPERATURE}, "
                             f"got {self.temperature!r}", "temperature")
        for name in ("top_p", "typical_p"):  # a probability mass kept: (0, 1], 1 is off
            value = _real(name, getattr(self, name))
            setattr(self, name, value)
            if not 0 < value <= 1:
                raise ParamError(f"{name} must be in (0, 1], got {value!r}", name)
        self.top_k = _int("top_k", self.top_k)
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise ParamError(f"top_k must be -1 or 0 (off) or a positive count up to {MAX_TOP_K}, got {self.top_k}",
                             "top_k")
        self.min_p = _real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ParamError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
            if not _INT64_MIN <= self.seed <= _UINT64_MAX:
                raise ParamError(f"seed must fit in 64 bits, got {self.seed}", "seed")

    def _check_lengths(self) -> None:
        self.max_tokens = _int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ParamError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        self.min_tokens = _int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ParamError(
                f"min_tokens must be between 0 and max_tokens={self.max_tokens}, got {self.min_tokens}", "min_tokens"
            )
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ParamError("stop_token_ids must be a list of token ids", "stop_token_ids", "invalid_type")
        if len(self.stop_token_ids) > MAX_TOKEN_ID_LIST:
            raise ParamError(f"stop_token_ids accepts at most {MAX_TOKEN_ID_LIST} ids", "stop_token_ids")
        self.stop_token_ids = [_int("stop_token_ids entries", t) for t in self.stop_token_ids]
        for token_id in self.stop_token_ids:
            if token_id < 0:
                raise ParamError(f"stop_token_ids must be non-negative token ids, got {token_id}", "stop_token_ids")
        _require_bool("ignore_eos", self.ignore_eos)

    def _check_beam_search(self) -> None:
        _require_bool("use_beam_search", self.use_beam_search)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ParamError(f'early_stopping must be true, false or "never", got {self.early_stopping!r}',
                             "early_stopping")
        self.length_penalty = _real("length_penalty", self.length_penalty)
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            raise ParamError(f"length_penalty must be in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], "
                             f"got {self.length_penalty!r}", "length_penalty")
        if not self.use_beam_search:
            if self.early_stopping is not False:
                raise ParamError("early_stopping only applies to beam search; set use_beam_search=true",
                                 "early_stopping")
            if self.length_penalty != 1.0:
                raise ParamError("length_penalty only applies to beam search; set use_beam_search=true",
                                 "length_penalty")
            return
        if self.temperature > GREEDY_EPS:
            raise ParamError(
                f"beam search is deterministic and needs temperature=0, got temperature={self.temperature}",
                "temperature")
        used = [name for name, on in (("top_p", self.top_p != 1.0), ("top_k", self.top_k not in (-1, 0)),
                                      ("min_p", self.min_p != 0.0), ("typical_p", self.typical_p != 1.0)) if on]
        if used:
            raise ParamError("beam search does not use top_p, top_k, min_p or typical_p; leave them at their "
                             "defaults", used[0])

    def _check_logit_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            setattr(self, name, value)
            if not -2.0 <= value <= 2.0:
                raise ParamError(f"{name} must be in [-2, 2], got {value!r}", name)
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ParamError(f"repetition_penalty must be > 0 and at most {MAX_REPETITION_PENALTY:g}, "
                             f"got {self.repetition_penalty!r}", "repetition_penalty")
        self._check_logit_bias()
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ParamError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}", "prompt_logprobs")
        if self.structured_output is not None:
            _check_structured(self.structured_output)
        if self.use_beam_search:
            if self.structured_output is not None:
                raise ParamError("structured output does not combine with beam search", "structured_output")
            if (self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0):
                raise ParamError("penalties and logit_bias do not apply to beam search", "use_beam_search")

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise ParamError("logit_bias must map token ids to numbers", "logit_bias", "invalid_type")
        if len(self.logit_bias) > MAX_TOKEN_ID_LIST:
            raise ParamError(f"logit_bias accepts at most {MAX_TOKEN_ID_LIST} entries", "logit_bias")
        checked: dict[int, float] = {}
        for token_id, bias in self.logit_bias.items():
            key = _int("logit_bias keys", token_id)
            if key < 0:
                raise ParamError(f"logit_bias keys must be non-negative token ids, got {key}", "logit_bias")
            value = _real("logit_bias values", bias)
            if not -100.0 <= value <= 100.0:
                raise ParamError(f"logit_bias values must be in [-100, 100], got {bias!r}", "logit_bias")
            checked[key] = value
        self.logit_bias = checked


def check_limits(params: SamplingParams, max_n: int, max_tokens: int, max_logprobs: int) -> None:
    """A server's caps (the gateway's --max-n, --max-tokens-limit, --max-top-logprobs) on
    parameters that `SamplingParams.validate` already accepted; ParamError naming the field."""
    caps = (("n", params.n, max_n), ("best_of", params.best_of, max_n), ("max_tokens", params.max_tokens, max_tokens),
            ("logprobs", params.logprobs, max_logprobs),
            ("prompt_logprobs", params.prompt_logprobs, max_logprobs))
    for name, value, cap in caps:
        if value is not None and value > cap:
            raise ParamError(f"{name} must be at most {cap} on this server, got {value}", name)


def _check_structured(spec: Any) -> None:
    """``{"kind": K, "spec": S}`` with S of the type K needs."""
    if not isinstance(spec, dict) or spec.get("kind") not in STRUCTURED_KINDS:
        raise ParamError(f"structured_output must be {{'kind': one of {list(STRUCTURED_KINDS)}, 'spec': ...}}",
                         "structured_output")
    kind, value = spec["kind"], spec.get("spec")
    if kind == "json_object":
        ok = value is None
    elif kind == "choice":
        ok = isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)
    else:
        ok = isinstance(value, str) and bool(value)
    if not ok:
        raise ParamError(f"structured_output of kind {kind!r} has a spec of the wrong type", "structured_output")
    dialect = spec.get("dialect")
    if dialect is not None and (kind != "grammar" or dialect not in GRAMMAR_DIALECTS):
        raise ParamError(f"structured_output dialect must be one of {list(GRAMMAR_DIALECTS)} on a grammar",
                         "structured_output")
    too_large = limit_error(kind, value, "structured_output")
    if too_large:
        raise ParamError(too_large, "structured_output")

def grammar_dialect(structured: dict[str, Any]) -> str:
    """The dialect of a grammar constraint: the one the gateway carried, else (a request from
    before the field) the old rule, GBNF when the text contains `::=`."""
    dialect = structured.get("dialect")
    if dialect in GRAMMAR_DIALECTS:
        return str(dialect)
    return "gbnf" if "::=" in str(structured.get("spec") or "") else "lark"


def _real(name: str, value: Any) -> float:
    """A finite number (not a bool), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ParamError(f"{name} must be a finite number, got {value!r}"[:200], name.split()[0], "invalid_type")
    return float(value)


def _int(name: str, value: Any) -> int:
    """An integer (not a bool); an integral float (JSON's 2.0) counts."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ParamError(f"{name} must be an integer, got {value!r}"[:200], name.split()[0], "invalid_type")
    return value


def _require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ParamError(f"{name} must be true or false, got {value!r}"[:200], name, "invalid_type")
