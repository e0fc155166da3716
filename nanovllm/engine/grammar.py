"""Structured outputs with xgrammar (an optional dependency: the `structured` extra). One compiler
per engine over the tokenizer's vocabulary; a grammar compiled once per distinct spec, at
submission; a matcher per sequence, advanced by each of its tokens as they become known; a step's
masks filled by MaskFiller."""

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from nanovllm.sampling_params import StructuredOutputsParams

INSTALL_HINT = "structured outputs need xgrammar: pip install 'nanovllm[structured]'"


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a row's bitmask: a bit per token, 1 = allowed."""
    return (vocab_size + 31) // 32


class Grammars:
    """The engine's grammar compiler (built at the first structured request) and its cache of
    compiled grammars, keyed by spec. Thread-safe: callers compile in their own threads."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.compiled: dict[tuple, object] = {}
        self.filler = MaskFiller()  # the engine's steps' masks
        self._compiler = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec` (cached); ValueError naming what is wrong with it."""
        key = spec_key(spec)
        with self._lock:
            if key in self.compiled:
                return self.compiled[key]
            compiler = self._compiler or self._make_compiler()
        try:
            compiled = _compile(compiler, spec)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors
            raise ValueError(f"invalid structured_outputs.{key[0]}: {_message(e)}") from None
        with self._lock:
            return self.compiled.setdefault(key, compiled)

    def load(self, spec: StructuredOutputsParams, serialized: str):
        """The compiled grammar of `spec`: cached, else read from another process's compile
        (serialize); reading takes a few ms where compiling takes tens."""
        key = spec_key(spec)
        with self._lock:
            if key in self.compiled:
                return self.compiled[key]
            if self._compiler is None:
                self._make_compiler()
        import xgrammar as xgr

        compiled = xgr.CompiledGrammar.deserialize_json(serialized, self._info)
        with self._lock:
            return self.compiled.setdefault(key, compiled)

    def matcher(self, compiled) -> "GrammarState":
        return GrammarState(compiled, self.eos_token_ids, self.vocab_size)

    def _make_compiler(self):
        try:
            import xgrammar as xgr
        except ImportError:
            raise ValueError(INSTALL_HINT) from None
        if not hasattr(self.tokenizer, "convert_ids_to_tokens"):
            raise ValueError("structured outputs need the model's tokenizer (the engine was "
                             "started with skip_tokenizer_init=True)")
        self._info = self._tokenizer_info(xgr)
        self._compiler = xgr.GrammarCompiler(self._info)
        return self._compiler

    def _tokenizer_info(self, xgr):
        """The vocabulary as raw bytes, special tokens empty (never allowed: their text would not
        be detokenized), ids past the tokenizer's up to the model's vocab_size masked."""
        hf_info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                     stop_token_ids=self.eos_token_ids)
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        for token_id, added in getattr(self.tokenizer, "added_tokens_decoder", {}).items():
            if getattr(added, "special", False):
                special.add(token_id)
        vocab = [b"" if token_id in special else token
                 for token_id, token in enumerate(hf_info.decoded_vocab)]
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                 stop_token_ids=self.eos_token_ids)


def _message(error: Exception) -> str:
    """xgrammar's error without its C++ source location ("[time] file.cc:line: ")."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0])


def serialize(compiled) -> str:
    """A compiled grammar as JSON, for Grammars.load in another process (it does not pickle)."""
    return compiled.serialize_json()


def spec_key(spec: StructuredOutputsParams) -> tuple:
    """What identifies a spec's grammar: the cache's key."""
    if spec.json is not None:
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json, sort_keys=True)
        return ("json", schema, spec.disable_any_whitespace, spec.disable_additional_properties)
    if spec.regex is not None:
        return ("regex", spec.regex)
    if spec.choice is not None:
        return ("choice", tuple(spec.choice))
    if spec.grammar is not None:
        return ("grammar", spec.grammar)
    return ("json_object", spec.disable_any_whitespace)


def _compile(compiler, spec: StructuredOutputsParams):
    kind = spec_key(spec)[0]
    any_whitespace = not spec.disable_any_whitespace
    if kind == "json":
        schema = json.loads(spec.json) if isinstance(spec.json, str) else dict(spec.json)
        if spec.disable_additional_properties:
            schema = _no_additional_properties(schema)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "choice":
        return compiler.compile_grammar(
            "root ::= " + " | ".join(json.dumps(choice) for choice in spec.choice))
    if kind == "grammar":
        return compiler.compile_grammar(spec.grammar)
    return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)


def _no_additional_properties(schema):
    """The schema with additionalProperties false in every object that does not say otherwise."""
    if isinstance(schema, list):
        return [_no_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _no_additional_properties(value) for key, value in schema.items()}
    if schema.get("type") == "object" or "properties" in schema:
        schema.setdefault("additionalProperties", False)
    return schema


class GrammarState:
    """One sequence's matcher. It has accepted exactly the sequence's known output tokens (the
    engine fills a step's masks once the tokens before it are known), and a preempted sequence
    keeps its tokens (recompute), so its matcher needs no rollback."""

    def __init__(self, compiled, eos_token_ids: list[int], vocab_size: int):
        import xgrammar as xgr

        # Without EOS ids the grammar ends where it completes; else it ends by EOS, which the
        # mask allows exactly where the grammar may end.
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=eos_token_ids or None,
                                          terminate_without_stop_token=not eos_token_ids)
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False: the grammar rejects it (the mask left nothing)."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted a stop token)."""
        return self.matcher.is_terminated()


class MaskFiller:
    """Fills a step's masks. The calling thread fills the rows in order; once they prove dear (past
    SPILL_SECONDS_A_ROW on average), helper threads claim rows from the same queue. A fill releases
    the interpreter's lock, so dear rows (a bounded repetition's) spread over the cores, while cheap
    ones (a character class's: microseconds) never wake a thread or contend for the lock. The
    helpers live as long as the filler: starting threads every step costs more than cheap rows."""

    SPILL_SECONDS_A_ROW = 50e-6  # docs/architecture.md "Structured outputs and the overlap"

    def __init__(self, num_helpers: int | None = None):
        if num_helpers is None:  # half the cores fill, as xgrammar's own batch matcher does
            num_helpers = max(len(os.sched_getaffinity(0)) // 2 - 1, 0)
        self.num_helpers = num_helpers
        self._pool = None

    def fill(self, states: list[GrammarState | None], vocab_size: int) -> np.ndarray:
        """[len(states), words] int32: each state's allowed next tokens, a bit per token; a None
        state (a finished sequence, whose token is discarded) allows every token."""
        import torch  # xgrammar fills a tensor

        bitmask = np.full((len(states), bitmask_words(vocab_size)), -1, dtype=np.int32)
        tensor = torch.from_numpy(bitmask)
        rows = iter([row for row, state in enumerate(states) if state is not None])

        def fill_rows():  # next() on a list iterator is atomic: each row is filled once
            for row in rows:
                states[row].matcher.fill_next_token_bitmask(tensor, row)

        helpers, start = [], time.perf_counter()
        for num_filled, row in enumerate(rows, 1):
            states[row].matcher.fill_next_token_bitmask(tensor, row)
            if (self.num_helpers and not helpers
                    and time.perf_counter() - start > self.SPILL_SECONDS_A_ROW * num_filled):
                helpers = [self._helpers().submit(fill_rows) for _ in range(self.num_helpers)]
        for helper in helpers:
            if not helper.cancel():  # one that started may be filling a row: wait for it
                helper.result()
        return bitmask

    def _helpers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_helpers, thread_name_prefix="nanovllm-mask")
        return self._pool

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
