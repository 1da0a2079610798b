"""Structured output (mlxinfer.grammar): JSON schemas, any JSON object, Lark/GBNF grammars and regexes
enforced by token masks, on numpy and on MLX (its CPU device; the mask unpacked there), in `generate`,
`generate_batch` and `stream`.

A random synthetic model writes whatever the mask leaves it, so every output is checked against its
grammar (jsonschema, re.fullmatch): a schema with bounded sizes ends within max_tokens. A masked
sequence's tokens depend only on its own logits row, its mask (its own tokens) and its own random state:
alone or beside other sequences (constrained or not) it gives the same tokens, bit for bit, and so do
its neighbours with or without it."""

import json
import re

import numpy as np
import pytest

import mlxinfer
from mlxinfer.errors import RequestError
from mlxinfer.grammar import mask_words, token_bytes, unpack_numpy
from mlxinfer.loop import FinishEvent

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SHAPE = dict(arch="qwen3", n_layers=2, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=320,
             context_length=256, tied_output=False, seed=11)
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
}, "required": ["name", "age", "tags"], "additionalProperties": False}
AS_PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
PROMPTS = [[10, 11], [5, 6, 7], [3], [40, 41, 42, 43]]


@pytest.fixture(scope="module", params=["cpu", "mlx"])
def engine(request, synthetic):
    return mlxinfer.load(synthetic(**SHAPE), backend=request.param, kv="paged")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_schema_output_validates(engine, temperature):
    for seed in range(4):
        g = engine.generate(PROMPTS[seed], max_tokens=80, temperature=temperature, seed=seed,
                            response_format=AS_PERSON)
        assert g.finish_reason == "stop"
        jsonschema.validate(json.loads(g.text), PERSON)


def test_json_object_regex_and_grammar(engine):
    g = engine.generate([10, 11], max_tokens=60, temperature=0.9, seed=3, response_format={"type": "json_object"})
    assert isinstance(json.loads(g.text), dict)
    g = engine.generate([10, 11], max_tokens=30, temperature=0.9, seed=3, regex=r"[0-9]{3}-[a-z]{2,5}")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", g.text) and g.finish_reason == "stop"
    gbnf = 'root ::= answer " " answer\nanswer ::= "yes" | "no"'
    lark = 'start: answer " " answer\nanswer: "yes" | "no"'
    for grammar in (gbnf, lark):
        g = engine.generate([10, 11], max_tokens=20, temperature=1.0, seed=4, grammar=grammar)
        assert re.fullmatch(r"(yes|no) (yes|no)", g.text) and g.finish_reason == "stop"


def test_the_end_of_text_comes_only_where_the_grammar_accepts(engine):
    """A complete grammar finishes the sequence ("stop", no end token in its tokens); where max_tokens
    comes first, the text is a prefix the grammar could go on from ("length")."""
    g = engine.generate([10, 11], max_tokens=40, temperature=0.9, seed=1, regex="[a-z]{12}")
    assert re.fullmatch("[a-z]{12}", g.text) and g.finish_reason == "stop"
    assert not set(g.token_ids) & engine.tokenizer.eog_ids
    g = engine.generate([10, 11], max_tokens=5, temperature=0.9, seed=1, regex="[a-z]{40}")
    assert g.finish_reason == "length" and re.fullmatch("[a-z]+", g.text) and len(g.text) < 40


def test_an_optional_end_lets_the_model_choose_to_stop(engine):
    """Where the grammar accepts and could go on ("a+"), the end-of-generation tokens are allowed: the
    mask sets their bits and no other token outside the grammar's."""
    params = engine.sampling_params(regex="a+")
    m = params.constraint.matcher()
    row = np.zeros(mask_words(engine.args.vocab_size), dtype=np.int32)
    m.mask_into(row)
    allowed = set(np.nonzero(unpack_numpy(row[None], engine.args.vocab_size)[0])[0].tolist())
    assert not allowed & engine.tokenizer.eog_ids  # nothing yet: "a+" needs one a
    assert all(set(token_bytes(engine.tokenizer, t)) == {ord("a")} for t in allowed)
    assert m.advance(engine.tokenizer.encode("a")[0]) is None
    m.mask_into(row)
    allowed = set(np.nonzero(unpack_numpy(row[None], engine.args.vocab_size)[0])[0].tolist())
    assert engine.tokenizer.eog_ids <= allowed


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_masked_sequence_does_not_depend_on_its_neighbours(engine, temperature):
    """Each prompt alone, then all four in one batch (two under a schema, one under a regex, one free):
    the same tokens and logprob bits for each."""
    options = [dict(response_format=AS_PERSON), dict(regex="[a-z ]{5,30}"), dict(), dict(response_format=AS_PERSON)]
    alone = [engine.generate(p, max_tokens=60, temperature=temperature, seed=7, **o) for p, o in zip(PROMPTS, options)]
    loop = engine.new_loop()
    seqs = [loop.admit(engine.encode_prompt(p), engine.sampling_params(temperature=temperature, seed=7, **o), 60)
            for p, o in zip(PROMPTS, options)]
    done = {}
    while loop.busy:
        for s, ev in loop.step():
            if isinstance(ev, FinishEvent):
                done[id(s)] = ev.generation
    together = [done[id(s)] for s in seqs]
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert np.array_equal(np.float32(a.logprobs), np.float32(b.logprobs))
    jsonschema.validate(json.loads(together[0].text), PERSON)
    assert re.fullmatch("[a-z ]{5,30}", together[1].text)


def test_the_masked_token_is_the_best_allowed_one(engine):
    """Greedy under a mask takes the allowed token of the largest logit: the first token of "[0-9]+" is
    the argmax of the logits over the ten digits' tokens."""
    digits = [engine.tokenizer.encode(str(d))[0] for d in range(10)]
    logits = engine.logits([10, 11])[-1]
    g = engine.generate([10, 11], max_tokens=1, regex="[0-9]+")
    assert g.token_ids[0] == digits[int(np.argmax(logits[digits]))]


def test_stream_and_batch_take_the_constraint(engine):
    events = list(engine.stream([5, 6, 7], max_tokens=60, temperature=0.5, seed=2, response_format=AS_PERSON))
    assert isinstance(events[-1], FinishEvent)
    jsonschema.validate(json.loads("".join(e.text for e in events)), PERSON)
    gens = engine.generate_batch(PROMPTS, max_tokens=60, temperature=0.8, seed=9, response_format=AS_PERSON)
    for g in gens:
        jsonschema.validate(json.loads(g.text), PERSON)


@pytest.mark.parametrize("options, fragment", [
    (dict(response_format={"type": "json_schema"}), "json_schema needs"),
    (dict(response_format={"type": "xml"}), "response_format is"),
    (dict(response_format="json"), "response_format is"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "{not json"}}),
     "not JSON"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}), "is an object"),
    (dict(grammar="root ::= ("), "bad grammar"),
    (dict(grammar="   "), "non-empty text"),
    (dict(regex="[a-"), "bad regex"),
    (dict(regex="a", grammar='root ::= "a"'), "one constraint per request"),
    (dict(regex="a" * 200_001), "limit"),
])
def test_bad_constraints_are_one_line_request_errors(engine, options, fragment):
    with pytest.raises(RequestError, match=re.escape(fragment)) as e:
        engine.generate([1, 2], max_tokens=4, **options)
    assert "\n" not in str(e.value)


def test_cli_generate_takes_a_schema_a_grammar_or_a_regex(synthetic, tmp_path, capsys):
    from mlxinfer.cli import main

    path = synthetic(**SHAPE)
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    grammar = tmp_path / "yesno.gbnf"
    grammar.write_text('root ::= "yes" | "no"')
    base = ["generate", "-m", path, "--backend", "cpu", "--raw", "--quiet", "-n", "80", "--temp", "0.7", "--seed", "3"]
    assert main(base + ["--json-schema", str(schema), "hi"]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), PERSON)
    assert main(base + ["--json", "hi"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), dict)
    assert main(base + ["--grammar", str(grammar), "hi"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    assert main(base + ["--regex", "[0-9]{3}", "hi"]) == 0
    assert re.fullmatch("[0-9]{3}", capsys.readouterr().out.strip())
    for extra, fragment in ((["--json", "--regex", "a"], "not both"),
                            (["--grammar", str(tmp_path / "none")], "cannot read"), (["--regex", "[a-"], "bad regex")):
        assert main(base + extra + ["hi"]) == 1
        err = capsys.readouterr().err
        assert fragment in err and err.count("\n") == 1
