"""Train sparse-input models on MPS through torch's own sparse API (torch_sparse_metal's Metal kernels underneath):
a two-layer graph convolution (Kipf & Welling) on a generated community graph, whose normalised adjacency is a torch
CSR tensor, and a linear classifier over generated bag-of-words features held as a CSR matrix.

On a Mac: ``python examples/sparse_mps_train.py`` (MPS when available); in CI ``--device cpu --steps 5``.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
import torch.nn.functional as F

import torch_sparse_metal  # noqa: F401  (registers torch's sparse CSR products on MPS)

warnings.filterwarnings("ignore", message="Sparse (CSR tensor support is in beta|invariant checks)")


def community_graph(nodes: int, communities: int, p_in: float, p_out: float, g: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A stochastic block model: the symmetric-normalised adjacency with self loops ``D^-1/2 (A + I) D^-1/2`` as a
    CSR tensor on the CPU, and each node's community."""
    labels = torch.randint(communities, (nodes,), generator=g)
    same = labels[:, None] == labels[None, :]
    upper = torch.rand(nodes, nodes, generator=g) < torch.where(same, p_in, p_out)
    adj = torch.triu(upper, 1)
    adj = (adj | adj.T | torch.eye(nodes, dtype=torch.bool)).float()
    d = adj.sum(1).rsqrt()
    return (d[:, None] * adj * d[None, :]).to_sparse_csr(), labels


def train_gcn(device: str, steps: int, nodes: int = 600, seed: int = 0) -> float:
    """Train the GCN on the graph's community labels (half the nodes labelled); returns held-out accuracy."""
    g = torch.Generator().manual_seed(seed)
    adj, labels = community_graph(nodes, 4, 0.05, 0.005, g)
    feats = torch.randn(nodes, 16, generator=g) + F.one_hot(labels, 16).float() * 0.5
    adj, feats, labels = adj.to(device), feats.to(device), labels.to(device)
    train = torch.arange(nodes, device=device) % 2 == 0
    w1 = torch.nn.Parameter(torch.randn(16, 32, generator=g).to(device) * 0.3)
    w2 = torch.nn.Parameter(torch.randn(32, 4, generator=g).to(device) * 0.3)
    opt = torch.optim.Adam([w1, w2], lr=0.02)
    for _ in range(steps):
        h = torch.relu(torch.sparse.mm(adj, feats @ w1))  # A_hat X W1 on the sparse adjacency
        logits = adj @ (h @ w2)
        loss = F.cross_entropy(logits[train], labels[train])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        logits = adj @ (torch.relu(adj @ (feats @ w1)) @ w2)
        return (logits.argmax(1)[~train] == labels[~train]).float().mean().item()


def train_bag_of_words(device: str, steps: int, docs: int = 256, vocab: int = 20_000, seed: int = 0) -> float:
    """A linear classifier over sparse bag-of-words counts (CSR input, ``F.linear``-style ``X @ W``)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(2, (docs,), generator=g)
    topic_words = torch.randint(vocab, (2, 50), generator=g)
    rows, cols = [], []
    for i in range(docs):
        words = torch.cat([torch.randint(vocab, (20,), generator=g), topic_words[labels[i]][torch.randint(50, (5,),
                                                                                                 generator=g)]])
        rows.append(torch.full_like(words, i))
        cols.append(words)
    counts = torch.sparse_coo_tensor(torch.stack([torch.cat(rows), torch.cat(cols)]),
                                     torch.ones(docs * 25), (docs, vocab)).coalesce()
    x = counts.to_sparse_csr().to(device)
    labels = labels.to(device)
    w = torch.nn.Parameter(torch.zeros(vocab, 2, device=device))
    opt = torch.optim.SGD([w], lr=0.5)
    for _ in range(steps):
        loss = F.cross_entropy(torch.mm(x, w), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return (torch.mm(x, w).argmax(1) == labels).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="mps" if torch.backends.mps.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    print(f"GCN on a generated community graph ({args.device}): held-out accuracy "
          f"{train_gcn(args.device, args.steps):.3f}")
    print(f"bag-of-words classifier ({args.device}): training accuracy "
          f"{train_bag_of_words(args.device, args.steps):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
