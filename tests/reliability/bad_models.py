"""Model factories that break the contract in one way each, for the reliability suite (tests/reliability)."""

from __future__ import annotations

import sys

import torch
import torch.nn as nn


def interrupted():
    raise KeyboardInterrupt


def exits():
    sys.exit(7)


def no_parameters():
    return nn.Sequential(nn.ReLU(), nn.ReLU(), nn.ReLU(), nn.ReLU())


def wrong_width(hidden):
    return nn.Sequential(nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden + 3, hidden),
                         nn.Linear(hidden, hidden))


class _Pair(nn.Module):
    def forward(self, x):
        return (x, x)


class _ToInt(nn.Module):
    def forward(self, x):
        return x.long()


class _ToComplex(nn.Module):
    def forward(self, x):
        return torch.complex(x, x)


def tuple_output(hidden):
    return nn.Sequential(nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), _Pair(), nn.Linear(hidden, hidden))


def int64_output(hidden):
    return nn.Sequential(nn.Linear(hidden, hidden), _ToInt(), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden))


def complex_output(hidden):
    return nn.Sequential(nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden),
                         _ToComplex())


# Token feeds (--data bad_models:<feed>) that break the contract in one way each.
def _feed(kind, vocab_size):
    def fill(inputs, labels, iteration, global_mb):
        ids = torch.arange(inputs.numel()).reshape(inputs.shape) % vocab_size
        if kind == "returns floats":
            return torch.rand(inputs.shape) * vocab_size
        if kind == "floats in place":
            ids = torch.rand(inputs.shape) * vocab_size
        if kind == "out of range":
            ids = ids + vocab_size
        inputs.copy_(ids)
        labels.copy_(ids)
        return None
    return fill


def feed_returns_floats(vocab_size):
    return _feed("returns floats", vocab_size)


def feed_floats_in_place(vocab_size):
    return _feed("floats in place", vocab_size)


def feed_out_of_range(vocab_size):
    return _feed("out of range", vocab_size)


# Issue 31: a builder that raises on the rank that holds it, a weight shared by two stages, losses training cannot use.
def builder_raises(hidden):
    def layer():
        return nn.Linear(hidden, hidden)

    def broken():
        raise ValueError("no weights for layer 3")
    return [layer, layer, layer, broken]


def shared_across_stages(hidden):
    first, last = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
    last.weight = first.weight
    return nn.Sequential(first, nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), last)


def vector_loss(output, target):
    return ((output - target) ** 2).mean(dim=-1)


def int_loss(output, target):
    return ((output - target) ** 2).mean().long()
