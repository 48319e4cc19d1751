"""The constraint engine of structured output: grammars compiled by llguidance, cached, checked
within a time limit, and one matcher per constrained sequence.

Why llguidance (``guidance-ai/llguidance``): a self-contained wheel with no dependencies (xgrammar
pulls torch, triton and transformers), it takes JSON Schema, regexes, choices and Lark grammars
(its own dialect, with ``%json {...}`` embedding a schema), and it computes a token mask in tens
of microseconds with no precomputation per grammar, so compiling a schema costs about a
millisecond (``bench/structured.py`` has the figures). vLLM's ``backend_guidance.py`` is the
reference for the calls used here.

A :class:`GrammarCache` per tokenizer (:func:`cache_for`) holds llguidance's tokenizer (built once:
~0.3 s for SmolLM2's 49,152 tokens) and an LRU of compiled grammars keyed by the
:class:`~models.step_io.Constraint`; a sequence gets a ``deep_copy`` of the cached matcher
(microseconds). JSON is compiled without free whitespace between tokens (llguidance's
``whitespace_flexible: false``): the output is compact JSON, and a small model cannot loop on
blank lines.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import llguidance
import llguidance.hf

from models.errors import ModelError
from models.step_io import Constraint, ConstraintKind

T = TypeVar("T")

# llguidance's options for every JSON Schema (a schema's own ``x-guidance`` takes precedence).
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}


class ConstraintError(ModelError):
    """A constraint that cannot be used: it does not compile, uses a JSON Schema keyword
    llguidance does not support, or took longer than the configured time to compile.

    Attributes:
        param: the request field it came from (the gateway's 400 names it).
        message: what is wrong, as llguidance reports it.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass
class StructuredSettings:
    """The ``structured_output:`` config section as the engine reads it (:func:`configure`).

    Fields:
        grammar_cache_size: compiled grammars kept per tokenizer (least recently used dropped).
        compile_timeout_s: seconds :func:`check_constraint` waits for a compile.
    """

    grammar_cache_size: int = 256
    compile_timeout_s: float = 10.0


SETTINGS = StructuredSettings()


def configure(grammar_cache_size: int, compile_timeout_s: float) -> None:
    """Set the engine's settings (the gateway calls it at start, from its config); the size
    bound applies to every cache at its next insertion."""
    SETTINGS.grammar_cache_size = grammar_cache_size
    SETTINGS.compile_timeout_s = compile_timeout_s


def grammar_of(constraint: Constraint) -> str:
    """llguidance's grammar text (its JSON grammar format) for ``constraint``.

    Raises:
        ValueError: the value is not what its kind needs (a schema or choice list that is not JSON).
    """
    if constraint.kind is ConstraintKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.value, defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
    if constraint.kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
    if constraint.kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(constraint.value)
    if constraint.kind is ConstraintKind.CHOICE:
        choices = json.loads(constraint.value)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    return llguidance.LLMatcher.grammar_from_lark(constraint.value)


class GrammarCache:
    """llguidance's view of one Hugging Face tokenizer and an LRU of the grammars compiled for it.

    Args:
        tokenizer: a fast Hugging Face tokenizer (its end-of-sequence token ends a grammar).

    Thread-safe: the gateway's checks and the buckets' worker threads share it.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def vocab_size(self) -> int:
        """Tokens llguidance knows (a mask's width in bits); logits may have more columns."""
        return int(self.ll_tokenizer.vocab_size)

    def __len__(self) -> int:
        return len(self._compiled)

    def matcher(self, constraint: Constraint, param: str = "constraint") -> llguidance.LLMatcher:
        """A fresh matcher for ``constraint`` in its start state (a copy of the cached one,
        compiled on a miss and cached).

        Raises:
            ConstraintError: the grammar does not compile (named ``param``); a failed compile is
                not cached.
        """
        with self._lock:
            cached = self._compiled.get(constraint)
            if cached is not None:
                self._compiled.move_to_end(constraint)
                self.hits += 1
                return cached.deep_copy()
            self.misses += 1
        compiled = self._compile(constraint, param)
        with self._lock:
            self._compiled[constraint] = compiled
            self._compiled.move_to_end(constraint)
            while len(self._compiled) > SETTINGS.grammar_cache_size:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def _compile(self, constraint: Constraint, param: str) -> llguidance.LLMatcher:
        try:
            grammar = grammar_of(constraint)
        except ValueError as exc:
            raise ConstraintError(param, str(exc)) from None
        compiled = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise ConstraintError(param, compiled.get_error())
        return compiled


_CACHES: weakref.WeakKeyDictionary[Any, GrammarCache] = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def cache_for(tokenizer: Any) -> GrammarCache:
    """The :class:`GrammarCache` of ``tokenizer`` (built at the first call, then shared: the
    gateway's check and the bucket's runner of one loaded model use the same one)."""
    with _CACHES_LOCK:
        cache = _CACHES.get(tokenizer)
        if cache is None:
            cache = _CACHES[tokenizer] = GrammarCache(tokenizer)
        return cache


def run_within(work: Callable[[], T], timeout_s: float, what: str, param: str) -> T:
    """``work()`` on a thread of its own, waited for at most ``timeout_s`` seconds.

    Raises:
        ConstraintError: ``work`` did not finish in time (named ``param``; the thread runs on and
            its result is dropped), or the error ``work`` raised.
    """
    outcome: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            failure.append(exc)

    thread = threading.Thread(target=target, name="grammar-compile", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ConstraintError(param, f"{what} took longer than {timeout_s:g} s to compile")
    if failure:
        raise failure[0]
    return outcome[0]


def check_constraint(constraint: Constraint, tokenizer: Any, param: str) -> None:
    """Compile ``constraint`` for ``tokenizer`` through its cache (so the runner's matcher is a
    cache hit), within ``compile_timeout_s``. Blocking: call it from a worker thread
    (``asyncio.to_thread``) in async code.

    Raises:
        ConstraintError: named ``param``: the grammar does not compile, or not in time.
    """
    cache = cache_for(tokenizer)
    run_within(lambda: cache.matcher(constraint, param), SETTINGS.compile_timeout_s, f"the {constraint.kind.value}", param)
