"""A tiny causal transformer with random weights (fixed seed), attention heads split across
TP ranks, reading and writing a paged KV cache per rank — enough to check that KV restored
through kvsidecar gives the same greedy tokens as a cold recompute."""

from __future__ import annotations

import torch

VOCAB, D, HEADS, HD, LAYERS, TP = 97, 32, 4, 8, 2, 2
HPR = HEADS // TP  # heads per rank


class TinyModel:
    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
        self.emb = r(VOCAB, D)
        self.layers = [dict(wq=r(D, HEADS * HD), wk=r(D, HEADS * HD), wv=r(D, HEADS * HD), wo=r(HEADS * HD, D),
                            w1=r(D, 2 * D), w2=r(2 * D, D)) for _ in range(LAYERS)]
        self.head = r(D, VOCAB)

    def forward(self, tokens: list, start: int, caches: list, page_table: list, T: int) -> torch.Tensor:
        """Run positions [start, len(tokens)), reading positions [0, start) from the paged caches
        (``caches[rank][layer] = (K, V)`` of shape [pages, T, HPR, HD]) and writing the new ones.
        Returns the logits of the last position."""
        x = self.emb[torch.tensor(tokens[start:])]
        n = len(tokens)
        pos = torch.arange(start, n)
        for li, w in enumerate(self.layers):
            h = _norm(x)
            q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
            out = torch.zeros_like(x)
            for rank in range(TP):  # each rank: its heads, then its share of the output projection
                sl = slice(rank * HPR * HD, (rank + 1) * HPR * HD)
                K, V = caches[rank][li]
                for i, p in enumerate(range(start, n)):  # write the new positions' K/V into pages
                    K[page_table[p // T], p % T] = k[i, sl].view(HPR, HD)
                    V[page_table[p // T], p % T] = v[i, sl].view(HPR, HD)
                keys = torch.stack([K[page_table[p // T], p % T] for p in range(n)])  # [n, HPR, HD]
                vals = torch.stack([V[page_table[p // T], p % T] for p in range(n)])
                qh = q[:, sl].view(-1, HPR, HD)
                att = torch.einsum("qhd,khd->hqk", qh, keys) / HD ** 0.5
                mask = torch.arange(n)[None, :] > pos[:, None]
                att = att.masked_fill(mask[None], float("-inf")).softmax(-1)
                o = torch.einsum("hqk,khd->qhd", att, vals).reshape(-1, HPR * HD)
                out = out + o @ w["wo"][sl]  # the TP all-reduce
            x = x + out
            x = x + torch.relu(_norm(x) @ w["w1"]) @ w["w2"]
        return _norm(x[-1]) @ self.head


def _norm(x):
    return x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()


def greedy(model: TinyModel, tokens: list, restored: int, caches, page_table: list, T: int, steps: int) -> list:
    """Prefill from position ``restored`` (earlier positions come from the cache), then decode."""
    toks = list(tokens)
    logits = model.forward(toks, restored, caches, page_table, T)
    out = []
    for _ in range(steps):
        nxt = int(logits.argmax())
        out.append(nxt)
        toks.append(nxt)
        logits = model.forward(toks, len(toks) - 1, caches, page_table, T)
    return out
