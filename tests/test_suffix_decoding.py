"""Suffix decoding (vLLM's "suffix" method, services/worker/suffix.py): its config as vLLM takes it,
the suffix trees (built whole or token by token alike, removed without a trace), what it drafts
(the request's own repeats, earlier requests' outputs, longer drafts for longer matches), and tokens
equal to the same engine's without speculation, with drafts accepted."""

from __future__ import annotations

import pytest

from services.worker.sequence import SeqState
from services.worker.suffix import SuffixProposer, SuffixTree
from shared.checks import ConfigError
from shared.speculative import parse_speculative_config
from shared.wire.messages import NewSeq, SamplingParams
from tests.test_speculative import _plain, _run, prompts  # noqa: F401  (the fixture)

SPEC = {"method": "suffix", "num_speculative_tokens": 8}


def _paths(node, prefix=()) -> dict:
    out = {}
    for token, child in node.children.items():
        out[(*prefix, token)] = child.count
        out |= _paths(child, (*prefix, token))
    return out


def test_the_config_takes_vllms_keys_and_defaults():
    config = parse_speculative_config({"method": "suffix"})
    assert (config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob) == (24, 10000, 1.0, 0.1)
    assert config.num_speculative_tokens == 16  # the tree's depth, capped at the lookahead a row may have
    assert config.max_batch == 8  # its own crossover (docs/speculative_decoding.md)
    assert parse_speculative_config({**SPEC, "suffix_decoding_max_tree_depth": 6}).num_speculative_tokens == 8


@pytest.mark.parametrize(("value", "message"), [
    ({"method": "suffix", "model": "/m"}, "takes no \"model\""),
    ({"method": "suffix", "prompt_lookup_max": 3}, "no prompt_lookup_min/max"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob must be in"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "max_tree_depth must be 2 or more"),
    ({"method": "ngram", "num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 2.0},
     "suffix_decoding_max_spec_factor is the suffix method's"),
])
def test_a_config_that_cannot_run_is_refused_naming_why(value, message):
    with pytest.raises(ConfigError, match=message):
        parse_speculative_config(value)


def test_a_tree_built_token_by_token_is_the_tree_built_whole_and_removal_leaves_nothing():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 5, 5, 1]
    whole, grown = SuffixTree(4), SuffixTree(4)
    whole.add(tokens)
    grown.add(tokens[:3])
    for n in range(4, len(tokens) + 1):
        grown.extend(tokens[:n], n - 1)
    assert _paths(grown.root) == _paths(whole.root)
    windowed, tail = SuffixTree(4), SuffixTree(4)  # a tree of the tokens from index 5 on, grown in place
    windowed.add(tokens[5:8])
    windowed.extend(tokens, 8, first=5)
    tail.add(tokens[5:])
    assert _paths(windowed.root) == _paths(tail.root)
    assert _paths(whole.root)[(1, 2)] == 3 and _paths(whole.root)[(1, 2, 3)] == 2
    assert grown.num_nodes == whole.num_nodes == len(_paths(whole.root))  # what the memory bound counts
    whole.add(tokens, sign=-1)
    assert whole.root.children == {} and whole.num_nodes == 0


def _seq(request_id: str, tokens: list[int], num_prompt: int | None = None) -> SeqState:
    n = len(tokens) if num_prompt is None else num_prompt
    return SeqState.from_new(NewSeq(request_id=request_id, token_ids=list(tokens), num_prompt_tokens=n,
                                    num_computed_tokens=0, num_new_tokens=n, block_ids=[0],
                                    sampling=SamplingParams(max_tokens=64), reply_to=""))


def test_it_drafts_the_requests_own_repeat_as_far_as_its_match_is_long():
    proposer = SuffixProposer(parse_speculative_config(SPEC))
    text = [10, 11, 12, 13, 14, 15, 16, 17, 9, 10, 11]
    assert proposer.propose(_seq("a", text), 8) == [12, 13]  # two tokens matched: two drafts (max_spec_factor 1)
    seq = proposer.requests["a"][0]
    seq.token_ids += [12, 13, 14]  # the request went on as drafted: its tree grows by those tokens
    assert proposer.propose(seq, 8) == [15, 16, 17, 9, 10]
    assert proposer.propose(seq, 3) == [15, 16, 17]  # within the row's room
    assert proposer.propose(_seq("b", [1, 2, 3, 4]), 8) == []  # nothing repeats


def test_a_finished_requests_output_is_drafted_for_the_next_and_the_cache_is_bounded():
    proposer = SuffixProposer(parse_speculative_config({**SPEC, "suffix_decoding_max_cached_requests": 1}))
    answer = [50, 51, 52, 53, 54, 55]
    first = _seq("a", [1, 2, 3] + answer, num_prompt=3)
    proposer.propose(first, 4)
    proposer.observe(None, [], [], live={})  # "a" left the worker: its output joins the cache
    assert proposer.propose(_seq("b", [7, 8, 50, 51, 52], num_prompt=2), 8) == [53, 54, 55]
    proposer.observe(None, [], [], live={})
    assert list(proposer.cached) == ["b"]  # one kept: "a"'s output left the tree with it
    assert proposer.propose(_seq("c", [9, 50, 51, 52]), 8) == []


def test_the_outputs_tree_keeps_under_its_node_budget_and_a_request_tree_under_its_window(monkeypatch):
    from services.worker import suffix

    monkeypatch.setattr(suffix, "OUTPUT_NODES", 200)
    monkeypatch.setattr(suffix, "REQUEST_WINDOW", 32)
    proposer = SuffixProposer(parse_speculative_config(SPEC))
    for i in range(10):  # ten outputs of 20 distinct tokens: ~20 x 20 nodes each
        proposer.propose(_seq(f"r{i}", [1] + list(range(100 * i, 100 * i + 20)), num_prompt=1), 4)
        proposer.observe(None, [], [], live={})
        assert proposer.outputs.num_nodes <= 200 or len(proposer.cached) == 1
    assert list(proposer.cached) == ["r9"]  # the oldest went first
    long = _seq("long", list(range(5000, 5100)))
    proposer.propose(long, 4)
    assert proposer.requests["long"][1].num_nodes <= 32 * 24  # its last 32 tokens' suffixes alone


def test_an_ambiguous_continuation_stops_below_min_token_prob():
    proposer = SuffixProposer(parse_speculative_config({**SPEC, "suffix_decoding_min_token_prob": 0.5}))
    text = [1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3, 9, 1, 2, 3]  # "1 2 3" went on three ways
    assert proposer.propose(_seq("a", text), 8) == []
    loose = SuffixProposer(parse_speculative_config({**SPEC, "suffix_decoding_min_token_prob": 0.1}))
    assert len(loose.propose(_seq("a", text), 8)) >= 1


@pytest.mark.parametrize("case", ["greedy", "seeded", "small-pool"])
def test_suffix_decoding_gives_the_tokens_of_the_engine_without_it(served_model, prompts, case):  # noqa: F811
    """On the path `make run` serves (the C kernels)."""
    sampling = {"seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 11}}.get(case, {})
    kwargs = {"small-pool": {"num_blocks": 14}}.get(case, {})
    plain = _plain(served_model, prompts, **kwargs, **sampling)
    spec, engine = _run(served_model, prompts, SPEC, **kwargs, **sampling)
    assert spec == plain
    assert sum(d.num_accepted for d in engine.drafts) > 0  # drafts were verified and some kept
    if case == "small-pool":
        assert engine.scheduler.num_preemptions > 0
