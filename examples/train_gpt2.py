"""Train a tiny GPT-2 (random init, synthetic tokens) with and without remat.convert.

    python examples/train_gpt2.py                       # CPU, a few steps, tiny model
    python examples/train_gpt2.py --device cuda --steps 50 --hidden 768 --layers 12 --seq 1024 --batch 8

Both runs start from the same weights and see the same batches, so their loss curves must track
(they differ by float rounding only). Printed: the two loss curves side by side, tokens/s, and the
activation memory: peak GPU memory on CUDA, the bytes autograd saves for one step on CPU.
Needs transformers (pip install 'remat[hf]'). On CPU without a GPU the remat kernels run their
PyTorch reference (set TRITON_INTERPRET=1 to run the Triton kernels in the slow interpreter).
"""

import argparse
import copy
import time

import torch

from remat.saved import saved_bytes


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def build_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(config)


def batches(args):
    """Synthetic next-token data with structure to learn: each sequence counts up from a random start."""
    generator = torch.Generator().manual_seed(args.seed + 1)
    for _ in range(args.steps):
        start = torch.randint(0, args.vocab, (args.batch, 1), generator=generator)
        ids = (start + torch.arange(args.seq)) % args.vocab
        noise = torch.rand(ids.shape, generator=generator) < 0.1  # 10 % random tokens
        ids = torch.where(noise, torch.randint(0, args.vocab, ids.shape, generator=generator), ids)
        yield ids.to(args.device)


def saved_activation_bytes(model, ids):
    """Bytes of the unique storages autograd keeps for one forward (parameters left out)."""
    return saved_bytes(lambda: model(input_ids=ids, labels=ids), exclude=list(model.parameters()))


def train(model, args):
    """(losses, tokens/s, memory figure)."""
    model.to(args.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    losses, tokens, start = [], 0, None
    for step, ids in enumerate(batches(args)):
        if step == 1:  # leave out the first step (allocations, kernel compilation)
            if cuda:
                torch.cuda.synchronize()
            start, tokens = time.perf_counter(), 0
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += ids.numel()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start if start else float("nan")
    if cuda:
        memory = f"peak {(torch.cuda.max_memory_allocated() - base) / 2**20:.1f} MiB above the weights"
    else:
        memory = f"{saved_activation_bytes(model, next(iter(batches(args)))) / 2**10:.1f} KiB saved activations/step"
    return losses, tokens / elapsed if start else float("nan"), memory


def main():
    from remat.convert import convert

    args = parse_args()
    stock = build_model(args)
    converted, report = convert(copy.deepcopy(stock), report=True)
    print(report, end="\n\n")
    results = {"torch": train(stock, args), "remat": train(converted, args)}

    print(f"{'step':>4}  {'torch loss':>10}  {'remat loss':>10}  {'diff':>8}")
    for step, (a, b) in enumerate(zip(results["torch"][0], results["remat"][0], strict=True)):
        print(f"{step:>4}  {a:>10.4f}  {b:>10.4f}  {b - a:>8.1e}")
    print()
    for name, (_, tokens_per_s, memory) in results.items():
        print(f"{name:>6}: {tokens_per_s:>10.0f} tokens/s, {memory}")


if __name__ == "__main__":
    main()
