"""Test drafters for tree drafting: :class:`OracleTree` knows the reference output and hides it
on a random root-to-leaf path of its tree, so steps accept deep, off-first-branch paths. Shared by
the CPU tree tests and the GPU (CUDA-graph) ones: this module sets no Triton environment."""

from __future__ import annotations

import torch

from specdec.drafters import Drafter
from specdec.tree import MEDUSA_63, TreeSpec, make_tree

#: a 10-node tree of depth 3 (3 heads) with branches off the top-1 chain at every depth
SMALL_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0]]
#: Medusa's 64-node tree plus three depth-4 branches off the top-1 chain
ORACLE_TREE = [list(p) for p in MEDUSA_63] + [[1, 0, 0, 0], [0, 1, 0, 0], [2, 0, 0, 0]]


class OracleTree(Drafter):
    """A tree drafter that knows the reference output: each step, a random root-to-leaf path of
    ``tree`` (cut at a random depth) holds the right tokens and every other node a wrong one, so
    steps accept deep paths that are not the first branch (exercises the path compaction)."""

    wants_hidden_states = False

    def __init__(self, reference_rows, vocab, tree=ORACLE_TREE, num_heads=4, seed=0):
        self.ref = reference_rows  # list of LongTensors: each row's prompt (no padding) + reference continuation
        self.vocab = vocab
        self.tree = make_tree(tree, num_heads)
        self.g = torch.Generator().manual_seed(seed)
        self.off_chain = 0

    def propose(self, input_ids, lengths, num_speculative_tokens):
        raise AssertionError("a tree drafter is called through propose_tree")

    def propose_tree(self, input_ids, lengths, spec: TreeSpec):
        tt = spec.tensors("cpu")
        B, N = input_ids.shape[0], spec.num_nodes
        out = torch.empty(B, N - 1, dtype=torch.long)
        leaves = tt["leaves"]
        for b in range(B):
            L, row = int(lengths[b]), self.ref[b]
            right = [int(row[L + d - 1]) if L + d - 1 < len(row) else 3 for d in range(spec.max_depth + 1)]
            for j in range(1, N):
                out[b, j - 1] = (right[spec.depth[j]] + 1 + j) % self.vocab  # wrong
            if bool(torch.rand(1, generator=self.g) < 0.5):  # a deepest leaf, all right
                deep = [p for p in leaves if len(p) == spec.max_depth + 1]
                leaf = deep[int(torch.randint(len(deep), (1,), generator=self.g))]
                cut = len(leaf)
            else:  # any leaf, right up to a random depth
                leaf = leaves[int(torch.randint(len(leaves), (1,), generator=self.g))]
                cut = int(torch.randint(1, len(leaf) + 1, (1,), generator=self.g))
            for j in leaf[1:cut].tolist():
                out[b, j - 1] = right[spec.depth[j]]
                self.off_chain += int(spec.paths[j - 1] != (0,) * spec.depth[j])
        return out


def reference_rows(out, ids, mask):
    """Per row, the prompt without its padding and then the row's new tokens of ``out``
    (``generate()``'s output for the left-padded prompts ``ids``, ``mask``): what
    :class:`OracleTree` takes as ``reference_rows``."""
    L = ids.shape[1]
    return [torch.cat([ids[b][mask[b].bool()], out[b, L:]]) for b in range(ids.shape[0])]
