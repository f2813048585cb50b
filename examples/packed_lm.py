"""Train a tiny causal LM on packed batches with document masking, and resume mid-epoch.

    BATCHD_TARGET=unix:///path/batchd.sock torchrun --standalone --nproc-per-node 2 \\
        examples/packed_lm.py --dataset web --stop-after-steps 3 --ckpt ckpt.pt --losses a.txt
    BATCHD_TARGET=unix:///path/batchd.sock torchrun --standalone --nproc-per-node 2 \\
        examples/packed_lm.py --dataset web --resume ckpt.pt --losses a.txt

Each batch is ``batch_size`` rows of ``seq_len`` tokens packed by the server
(``batchd.Pack``): several documents per row, each with its own ``segment_ids`` value. The
attention mask is block-diagonal and causal: a token sees the earlier tokens of its own
document only (``segment_ids`` equal, position not after its own), so packing changes
nothing a document's tokens can see; PyTorch's ``scaled_dot_product_attention`` takes it as
a boolean mask. The loss predicts each next token inside the same document (never across a
boundary, never on padding), averaged over both ranks' tokens.

Every rank's Loader serves its own rows (rank and world size from ``torch.distributed``,
gloo on the CPU). The checkpoint holds the model, the optimizer and ``loader.state_dict()``
(the same on every rank), so a resumed run continues at exactly the next batch: its loss
curve is bitwise the one of a run never interrupted (``--losses`` appends each step's loss
as ``float.hex``; ``tests/e2e/test_packed_lm.py`` compares them).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import batchd


class Block(nn.Module):
    """One pre-norm transformer block whose attention takes a boolean mask."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None]
        )
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(seq_len, width)
        self.block = Block(width, heads)
        self.head = nn.Linear(width, vocab)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor
    ) -> torch.Tensor:
        # Block-diagonal causal: query i sees key j of the same segment with j <= i. Padding
        # (segment 0, always after a row's documents) sees only padding: no row is all
        # masked, so no NaN, and the loss ignores it.
        t = ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        mask = (segments[:, :, None] == segments[:, None, :]) & causal
        x = self.embed(ids % self.vocab) + self.position(
            positions.clamp(max=self.position.num_embeddings - 1)
        )
        return self.head(self.block(x, mask))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--target", default=None, help="server address (default $BATCHD_TARGET)")
    add("--dataset", default="web")
    add("--seq-len", type=int, default=128)
    add("--batch-size", type=int, default=2, help="rows per rank per step")
    add("--max-len", type=int, default=8192, help="Tokens max_len: longer documents are cut")
    add("--dtype", default="uint16", help="how the token files are stored")
    add("--method", default="best_fit", choices=("best_fit", "first_fit", "concat"))
    add("--vocab", type=int, default=512)
    add("--epochs", type=int, default=1)
    add("--stop-after-steps", type=int, default=-1, help="save --ckpt and stop (a crash)")
    add("--ckpt", type=Path, default=Path("packed_lm.pt"))
    add("--resume", type=Path, default=None, help="a checkpoint to resume from")
    add("--losses", type=Path, default=None, help="rank 0 appends 'step loss.hex()' here")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the same reductions in every run, and cores for the server
    torch.use_deterministic_algorithms(True)
    model = nn.parallel.DistributedDataParallel(TinyLM(args.vocab, 32, 2, args.seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = batchd.Loader(
        args.target or os.environ.get("BATCHD_TARGET"),
        dataset=args.dataset,
        batch_size=args.batch_size,
        pipeline=batchd.Tokens(max_len=args.max_len, dtype=args.dtype),
        pack=batchd.Pack(seq_len=args.seq_len, method=args.method),
        device="cpu",
        seed=0,
    )
    step = 0
    if args.resume is not None:
        saved = torch.load(args.resume, weights_only=False)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])
        step = saved["step"]
    with loader:
        for epoch in range(loader.epoch, args.epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                total, count = loss_of(model, batch)
                # Both ranks' tokens weigh the same: the mean over all of them.
                together = torch.stack([total.detach(), count.to(total.dtype)])
                dist.all_reduce(together)
                loss = total * dist.get_world_size() / together[1].clamp(min=1)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if rank == 0 and args.losses is not None:
                    mean = float(together[0] / together[1].clamp(min=1))
                    with args.losses.open("a", encoding="utf-8") as out:
                        out.write(f"{step} {mean.hex()}\n")
                step += 1
                if step == args.stop_after_steps:
                    if rank == 0:
                        state = {
                            "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "loader": loader.state_dict(),
                            "step": step,
                        }
                        torch.save(state, args.ckpt)
                    dist.barrier()
                    dist.destroy_process_group()
                    return
    dist.destroy_process_group()


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed next-token loss inside documents (never across a boundary, never on
    padding), and how many tokens it covers."""
    ids = batch["input_ids"].long()
    segments = batch["segment_ids"]
    logits = model(ids, batch["position_ids"].long(), segments)
    vocab = logits.shape[-1]
    same_document = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    targets = (ids[:, 1:] % vocab).masked_fill(~same_document, -100)
    total = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), targets.reshape(-1), reduction="sum")
    return total, same_document.sum()


if __name__ == "__main__":
    main()
