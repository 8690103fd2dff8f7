"""Token data for the engine: int64 ids [B, T] into the first stage, next-token labels [B, T] on the last.

`token_data(cfg)` resolves `--data` on every rank before any process group exists (a bad path or feed fails on
every rank alike): text (the default corpus) or a PATH (a folder of text files, one text file, or a .bin token
file) become a memory-mapped TokenFile read by a TokenSampler; 'pkg.module:fn' is a user feed. Either way the
result is one `fill(inputs, labels, iteration, global_mb)` and the vocabulary. Opening a token file reads no tokens:
only the ranks that hold the first or last stage call `fill`, and text is tokenized once (the cache has a lock).

A user feed: `fn` is called with the keyword arguments it names of seq, micro_batch_size, seed, vocab_size, and
returns a function `fill(inputs, labels, iteration, global_mb)` or an object with that method (and optionally
`vocab`, its vocabulary size). fill writes int64 [micro_batch_size, seq] ids into `inputs` and `labels` in place,
as a pure function of (iteration, global_mb), so every rank and the single-process run see the same tokens. Its
first batch is checked at start-up and every batch's ids against the vocabulary (data/feed_check.py), so a bad feed
is one line naming it.

`TokenFeed` has engine.DataFeed's interface. Each microbatch is filled into a pinned host slot and copied
non-blocking into the static device buffers on the current (main) stream, so the host does not wait for the GPU
and a captured graph reads fresh tokens from the same addresses. Two generations of host slots: the host fills
one load's slots while the previous load's copies may still run, and waits only on the event of a slot's copy
from two loads ago (never on the device).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from peerline.distributed.config import ConfigError, RunConfig, is_spec
from peerline.distributed.data.corpus import DEFAULT_CORPUS
from peerline.distributed.data.feed_check import check_first_batch, checked_fill
from peerline.distributed.data.token_file import TokenFile, sidecar_path
from peerline.distributed.model import call_with_wanted, load_spec

Fill = Callable[[torch.Tensor, torch.Tensor, int, int], None]
SYNTHETIC_VOCAB = 4096  # the vocabulary a model gets when the data does not fix one
HOST_GENERATIONS = 2


@dataclass(frozen=True)
class TokenData:
    """A resolved token source: its fill function, its vocabulary and a name for the start line."""

    fill: Fill
    vocab: int
    name: str


def token_data(cfg: RunConfig) -> TokenData:
    """Resolve --data (token sources only) into a fill function and a vocabulary."""
    if is_spec(cfg.data) and not Path(cfg.data).exists():
        return _user_feed(cfg)
    from peerline.distributed.data.sampler import TokenSampler
    from peerline.distributed.data.tokenizer import DEFAULT_VOCAB_SIZE, text_tokens

    cache = Path(cfg.data_cache).expanduser() if cfg.data_cache else None
    tokens = text_tokens(cfg.data, vocab_size=cfg.vocab or DEFAULT_VOCAB_SIZE, cache_root=cache, vocab=cfg.vocab)
    sampler = TokenSampler(tokens.tokens, seq=cfg.seq, micro_batch_size=cfg.micro_batch_size, seed=cfg.seed)
    fill = sampler.fill
    if not tokens.verified:  # a sidecar's max_id too large a file to check at open: checked batch by batch
        fill = checked_fill(fill, tokens.vocab, f"token file {tokens.path} gave",
                            f"; its sidecar {sidecar_path(tokens.path)} states a smaller max_id")
    return TokenData(fill=fill, vocab=tokens.vocab, name=source_name(cfg.data, tokens))


def source_name(data: str, tokens: TokenFile) -> str:
    """The token source for the start line: what the text is and where its tokens are."""
    if data == DEFAULT_CORPUS:
        return f"text (the Python standard library's source; {len(tokens):,} tokens in {tokens.path})"
    if Path(data).suffix == ".bin":
        return f"token file {tokens.path} ({len(tokens):,} ids)"
    return f"text {data} ({len(tokens):,} tokens in {tokens.path})"


def _user_feed(cfg: RunConfig) -> TokenData:
    factory = load_spec(cfg.data, "data feed")
    wanted = {"seq": cfg.seq, "micro_batch_size": cfg.micro_batch_size, "seed": cfg.seed,
              "vocab_size": cfg.vocab or SYNTHETIC_VOCAB}
    try:
        made, _ = call_with_wanted(factory, wanted)
    except Exception as exc:  # noqa: BLE001 - any failure of user code is reported as one line
        raise ConfigError(f"data feed {cfg.data!r} failed: {type(exc).__name__}: {exc}") from None
    fill = getattr(made, "fill", made)
    if not callable(fill):
        raise ConfigError(f"data feed {cfg.data!r} returned {type(made).__name__}: neither a function "
                          "fill(inputs, labels, iteration, global_mb) nor an object with that method")
    vocab = int(cfg.vocab or getattr(made, "vocab", None) or SYNTHETIC_VOCAB)
    name = f"data feed {cfg.data!r}"
    check_first_batch(fill, name, (cfg.micro_batch_size, cfg.seq), vocab, _vocab_hint(cfg, made))
    return TokenData(fill=checked_fill(fill, vocab, f"{name} wrote", _vocab_hint(cfg, made)), vocab=vocab,
                     name=f"feed {cfg.data}")


def _vocab_hint(cfg: RunConfig, made: object) -> str:
    """Where a user feed's vocabulary came from, when neither --vocab nor the feed set it."""
    if cfg.vocab or getattr(made, "vocab", None):
        return ""
    return " by default: pass --vocab, or give the feed object a `vocab` attribute"


class TokenFeed:
    """engine.DataFeed's interface over a token fill: static int64 [B, T] `inputs` (first stage's rank) and
    `targets` (last stage's rank), one per microbatch, refilled in place by `load(iteration)`."""

    def __init__(self, *, fill: Fill, seed: int, replica: int, microbatches: int, shape: tuple[int, int],
                 inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        self.fill, self.seed, self.replica, self.microbatches = fill, seed, replica, microbatches
        self.inputs, self.targets = inputs, targets
        device = (inputs or targets)[0].device if (inputs or targets) else torch.device("cpu")
        self.on_gpu = device.type == "cuda"
        needed = bool(inputs or targets)  # a middle stage's rank reads no tokens
        self._host = [[torch.empty((2, *shape), dtype=torch.int64, pin_memory=self.on_gpu)
                       for _ in range(microbatches)] for _ in range(HOST_GENERATIONS if needed else 0)]
        self._copied: list[list[torch.cuda.Event | None]] = [[None] * microbatches for _ in self._host]
        self._generation = 0

    def load(self, iteration: int) -> None:
        self.load_into(iteration, self.inputs, self.targets)

    def load_into(self, iteration: int, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        """Fill `inputs` / `targets` (shaped like the static buffers) with the tokens of `iteration`, through
        pinned host slots, on the current stream."""
        if not inputs and not targets:
            return
        g = self._generation
        self._generation = (g + 1) % len(self._host)
        for mb in range(len(inputs or targets)):
            host, done = self._host[g][mb], self._copied[g][mb]
            if done is not None:
                done.synchronize()  # the copy that read this slot two loads ago (usually long finished)
            self.fill(host[0], host[1], iteration, self.replica * self.microbatches + mb)
            if inputs:
                inputs[mb].copy_(host[0], non_blocking=self.on_gpu)
            if targets:
                targets[mb].copy_(host[1], non_blocking=self.on_gpu)
            if self.on_gpu:
                self._copied[g][mb] = torch.cuda.Event()
                self._copied[g][mb].record()

    def buffers(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]
                ) -> Iterator[tuple[torch.Tensor, int, int]]:
        """(buffer, global microbatch, stream) of every input (stream 0) and label (stream 1), as DataFeed's."""
        for stream_id, bufs in ((0, inputs), (1, targets)):
            for mb, buf in enumerate(bufs):
                yield buf, self.replica * self.microbatches + mb, stream_id


def make_token_feed(data: TokenData, *, seed: int, replica: int, microbatches: int, micro_batch_size: int,
                    seq: int, device: torch.device, holds_first: bool, holds_last: bool) -> TokenFeed:
    """The static int64 buffers this rank needs (inputs on the first stage's, labels on the last's) and their
    feed. torch.empty launches nothing: load() writes every element before an iteration reads it."""
    shape = (micro_batch_size, seq)

    def buffers(needed: bool) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=torch.int64, device=device) for _ in range(microbatches)] if needed else []

    return TokenFeed(fill=data.fill, seed=seed, replica=replica, microbatches=microbatches, shape=shape,
                     inputs=buffers(holds_first), targets=buffers(holds_last))
