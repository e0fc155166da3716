"""Structured outputs (xgrammar): on the tiny random checkpoint, whose text is noise, only the mask
makes the outputs valid; a mixed batch under preemption keeps every row correct."""

import json
import re

import numpy as np
import pytest

from nanovllm import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.cpu_suite

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
        "size": {"enum": ["small", "large", 3]},
        "score": {"type": "number", "minimum": -5, "maximum": 5},
        "point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                   "tags": {"type": "array", "maxItems": 2,
                                                            "items": {"type": "boolean"}}},
                  "required": ["x", "tags"], "additionalProperties": False},
        "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                   "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "size", "point", "values"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-\d{1,3}(\.[xy])?"
CHOICES = ["yes", "no", "maybe so"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=128, max_model_len=320,
             max_num_seqs=64) as llm:
        yield llm


def structured(**spec) -> StructuredOutputsParams:
    return StructuredOutputsParams(**spec)


def test_params_follow_vllms_one_of_rule():
    with pytest.raises(ValueError, match="only use one kind"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="none are specified"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="whitespace_pattern is not supported"):
        StructuredOutputsParams(json_object=True, whitespace_pattern=r"\s")
    with pytest.raises(TypeError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})
    assert SamplingParams(structured_outputs=structured(choice=["a"])).uses_only_temperature


def test_json_schema_samples_validate(llm):
    spec = structured(json=SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=160, structured_outputs=spec)
    outputs = llm.generate(["json: "] * 50, params, use_tqdm=False)
    completions = [c for o in outputs for c in o.outputs]
    assert len(completions) == 200
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert len(stopped) >= 100, [c.finish_reason for c in completions]
    for completion in stopped:
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    for completion in completions:  # the EOS that ended it is the last token
        assert completion.finish_reason in ("stop", "length")


def test_regex_choice_and_json_object(llm):
    params = [SamplingParams(max_tokens=40, structured_outputs=structured(regex=REGEX)),
              SamplingParams(max_tokens=40, structured_outputs=structured(choice=CHOICES)),
              SamplingParams(max_tokens=120, structured_outputs=structured(
                  json_object=True, disable_any_whitespace=True))]
    outputs = llm.generate(["a"] * 30, params * 10, use_tqdm=False)
    by_kind = [[o.outputs[0] for o in outputs[k::3]] for k in range(3)]
    for completion in by_kind[0]:
        assert completion.finish_reason == "stop" and re.fullmatch(REGEX, completion.text)
    for completion in by_kind[1]:
        assert completion.finish_reason == "stop" and completion.text in CHOICES
    for completion in by_kind[2]:
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)


def test_invalid_specs_raise_at_submission(llm):
    engine = llm.llm_engine
    for spec, words in ((structured(regex="[a-"), "regex"),
                        (structured(json={"type": "objec"}), "json"),
                        (structured(grammar="root ::= missing"), "grammar")):
        with pytest.raises(ValueError, match=words):
            llm.generate(["a", "b"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert engine.scheduler.is_finished()


def test_grammar_compiled_once_per_spec(llm):
    grammars = llm.llm_engine.grammars
    spec = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    params = SamplingParams(max_tokens=30, structured_outputs=structured(json=dict(spec)))
    llm.generate(["a"] * 3, params, use_tqdm=False)
    before = len(grammars.compiled)
    again = SamplingParams(structured_outputs=structured(json=json.dumps(spec, sort_keys=True)))
    first = grammars.compile(params.structured_outputs)
    assert grammars.compile(again.structured_outputs) is first
    assert len(grammars.compiled) == before


def test_a_serialized_grammar_loads_as_the_compiled_one(llm):
    """The server sends its compile to the engine's process as JSON (grammar.serialize): the
    engine's Grammars caches what it reads, and its matchers allow what the compiled one's do."""
    from nanovllm.engine.grammar import Grammars, serialize

    grammars = llm.llm_engine.grammars
    spec = structured(regex=r"[a-c]{3}\d")
    compiled = grammars.compile(spec)
    other = Grammars(grammars.tokenizer, grammars.vocab_size, set(grammars.eos_token_ids))
    loaded = other.load(spec, serialize(compiled))
    assert other.load(spec, "not read: the spec is cached") is loaded
    states = [grammars.matcher(compiled), other.matcher(loaded)]
    for _ in range(5):  # three letters, a digit, then only the end
        masks = [grammars.filler.fill([state], grammars.vocab_size) for state in states]
        assert np.array_equal(masks[0], masks[1])
        allowed = np.flatnonzero(np.unpackbits(masks[0].view(np.uint8), bitorder="little"))
        assert 0 < len(allowed) < grammars.vocab_size
        assert all(state.accept(int(allowed[0])) for state in states)
    assert all(state.is_terminated for state in states)


def _rows_at_different_states(grammars, num_rows: int):
    """Matchers of REGEX, row r having accepted r % 4 tokens (each its first allowed one)."""
    compiled = grammars.compile(structured(regex=REGEX))
    states = [grammars.matcher(compiled) for _ in range(num_rows)]
    for row, state in enumerate(states):
        for _ in range(row % 4):
            mask = grammars.filler.fill([state], grammars.vocab_size)
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
            assert state.accept(int(allowed[0]))
    return states


class _FillRecorder:
    """A matcher's stand-in recording which thread fills its row. On the calling thread, every
    row after the first waits until a helper has filled one, so helpers surely take part."""

    def __init__(self, matcher, filled_by: dict, helper_filled):
        self.matcher, self.filled_by, self.helper_filled = matcher, filled_by, helper_filled

    def fill_next_token_bitmask(self, bitmask, row: int):
        import threading

        caller = threading.current_thread() is threading.main_thread()
        if caller and self.filled_by:
            assert self.helper_filled.wait(timeout=60), "no helper claimed a row"
        self.filled_by[row] = "caller" if caller else "helper"
        if not caller:
            self.helper_filled.set()
        self.matcher.fill_next_token_bitmask(bitmask, row)


@pytest.mark.parametrize("spill", ["at once", "never"])
def test_mask_filler_fills_each_row_as_its_matcher_does(llm, spill, monkeypatch):
    """Helpers claiming rows (spilled after the first) or none (never spilled): each row is its
    own matcher's mask, once; a None row allows everything; cheap rows start no thread."""
    import threading

    import torch

    from nanovllm.engine.grammar import MaskFiller, bitmask_words

    grammars = llm.llm_engine.grammars
    words = bitmask_words(grammars.vocab_size)
    states = _rows_at_different_states(grammars, 24)
    states[5] = states[17] = None
    expected = np.full((24, words), -1, dtype=np.int32)
    for row, state in enumerate(states):
        if state is not None:
            state.matcher.fill_next_token_bitmask(torch.from_numpy(expected), row)
    assert len({expected[row].tobytes() for row in range(24)}) == 4  # four distinct states
    monkeypatch.setattr(MaskFiller, "SPILL_SECONDS_A_ROW", 0.0 if spill == "at once" else 1e9)
    filler = MaskFiller(num_helpers=3)
    try:
        for _ in range(2):  # helpers, once started, serve the later fills
            filled_by, helper_filled = {}, threading.Event()
            if spill == "at once":
                for state in states:
                    if state is not None:
                        state.matcher = _FillRecorder(state.matcher, filled_by, helper_filled)
            assert np.array_equal(filler.fill(states, grammars.vocab_size), expected)
            if spill == "at once":
                assert sorted(filled_by) == [row for row in range(24) if row not in (5, 17)]
                assert filled_by[0] == "caller" and "helper" in filled_by.values()
                for state in states:
                    if state is not None:
                        state.matcher = state.matcher.matcher
        assert (filler._pool is not None) == (spill == "at once")
    finally:
        filler.close()
    assert filler._pool is None
