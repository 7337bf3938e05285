"""Suffix decoding (vLLM's "suffix" speculative method, after Arctic Inference's): draft the most
frequent continuation of the context's longest suffix found in a suffix tree of this request's own
tokens, or in one of earlier requests' outputs; more drafts the longer the match."""

from __future__ import annotations

from collections import OrderedDict

from services.worker.sequence import SeqState
from shared.speculative import SpeculativeConfig

# what the trees may hold (a node is ~270 bytes in Python): a request's tree covers its last
# REQUEST_WINDOW tokens (built again from them once it has grown past twice that), and the outputs'
# tree is kept under OUTPUT_NODES by evicting the oldest outputs (docs/speculative_decoding.md)
REQUEST_WINDOW = 2048
OUTPUT_NODES = 2**20


class _Node:
    __slots__ = ("children", "count")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.count = 0  # occurrences of the path from the root to here


def _size(node: _Node) -> int:
    stack, n = [node], 0
    while stack:
        n += 1
        stack.extend(stack.pop().children.values())
    return n


class SuffixTree:
    """Every suffix of the sequences added, cut at `depth` tokens, as counted paths from the root."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()
        self.num_nodes = 0

    def add(self, tokens: list[int], sign: int = 1) -> None:
        """Counts the sequence's suffixes in (sign -1: out, dropping paths no longer seen)."""
        for start in range(len(tokens)):
            self._walk(tokens[start:start + self.depth], sign)

    def _walk(self, path: list[int], sign: int) -> None:
        node = self.root
        for token in path:
            child = node.children.get(token)
            if child is None:
                if sign < 0:
                    return
                child = node.children[token] = _Node()
                self.num_nodes += 1
            child.count += sign
            if child.count <= 0:  # no sequence left passes here: the subtree goes
                self.num_nodes -= _size(node.children.pop(token))
                return
            node = child

    def extend(self, tokens: list[int], new_from: int, first: int = 0) -> None:
        """The sequence (counted from index `first`) grew: count the suffix paths of each token from
        index `new_from` on."""
        for end in range(new_from, len(tokens)):  # each suffix path that now ends at token `end`
            for start in range(max(first, end - self.depth + 1), end + 1):
                self._step(tokens[start:end], tokens[end])

    def _step(self, prefix: list[int], token: int) -> None:
        node = self.root
        for t in prefix:
            node = node.children[t]
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node()
            self.num_nodes += 1
        child.count += 1

    def matches(self, context: list[int]):
        """Each suffix of the context (at most depth - 1 tokens) found in the tree: (its node, its length)."""
        for start in range(max(0, len(context) - self.depth + 1), len(context)):
            node = self.root
            for token in context[start:]:
                node = node.children.get(token)
                if node is None:
                    break
            else:
                yield node, len(context) - start

    @staticmethod
    def continue_from(node: _Node, limit: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent path below the node, up to `limit` tokens while its estimated
        probability (the product of each child's share of its parent's count) stays >= min_prob;
        and its score, the sum of those probabilities (the drafts expected to be kept)."""
        out, prob, score = [], 1.0, 0.0
        while len(out) < limit and node.children:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / node.count
            if prob < min_prob:
                break
            out.append(token)
            score += prob
            node = child
        return out, score


class SuffixProposer:
    """A tree of each running request's prompt and output so far, and one of the outputs of the
    last max_cached_requests that finished here (a request's finish is seen at the next step)."""

    def __init__(self, config: SpeculativeConfig):
        self.num_speculative_tokens = config.num_speculative_tokens
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.max_cached = config.suffix_decoding_max_cached_requests
        # each request's: (its state, its tree, the first and the end of the tokens it counts)
        self.requests: dict[str, tuple[SeqState, SuffixTree, int, int]] = {}
        self.cached: OrderedDict[str, list[int]] = OrderedDict()  # finished requests' outputs, oldest first
        self.outputs = SuffixTree(self.depth)

    def propose_rows(self, backend, rows: list[tuple[SeqState, int]]) -> None:
        for seq, room in rows:
            seq.draft_ids = self.propose(seq, room)

    def observe(self, backend, batch, starts, live) -> None:
        """Requests gone from the worker (finished, aborted, preempted): their outputs join the cache."""
        for request_id in [r for r in self.requests if r not in live]:
            seq = self.requests.pop(request_id)[0]
            self._cache(request_id, seq.token_ids[seq.num_prompt_tokens:])

    def propose(self, seq: SeqState, max_drafts: int) -> list[int]:
        if max_drafts <= 0:
            return []
        tokens = seq.token_ids
        entry = self.requests.get(seq.request_id)
        if entry is None or entry[0] is not seq or len(tokens) - entry[2] > 2 * REQUEST_WINDOW:
            first = max(0, len(tokens) - REQUEST_WINDOW)
            tree = SuffixTree(self.depth)
            tree.add(tokens[first:])
        else:
            _, tree, first, counted = entry
            tree.extend(tokens, counted, first)  # the new tokens alone: no copy of the window
        self.requests[seq.request_id] = (seq, tree, first, len(tokens))
        context = tokens[-(self.depth - 1):]
        best, best_score = [], 0.0
        for source in (tree, self.outputs):  # every match length: a longer one may have no continuation yet
            for node, length in source.matches(context):
                limit = min(max_drafts, self.num_speculative_tokens, int(self.max_spec_factor * length))
                drafts, score = source.continue_from(node, limit, self.min_token_prob)
                if score > best_score:
                    best, best_score = drafts, score
        return best

    def _cache(self, request_id: str, output: list[int]) -> None:
        if self.max_cached <= 0 or not output:
            return
        if request_id in self.cached:
            self.outputs.add(self.cached.pop(request_id), sign=-1)
        self.cached[request_id] = output
        self.outputs.add(output)
        while len(self.cached) > self.max_cached or (self.outputs.num_nodes > OUTPUT_NODES and len(self.cached) > 1):
            self.outputs.add(self.cached.popitem(last=False)[1], sign=-1)
