"""The `tokenmill` command line."""

import argparse
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory, GGUF file, or preset (with --load-format dummy); "
                   "default: the embedded smollm2-135m-instruct")
    p.add_argument("--load-format", default="auto", choices=["auto", "hf", "gguf", "dummy"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)


def cmd_generate(args) -> int:
    # Until the engine lands: load the model and show its most likely next tokens for the prompt.
    import torch

    from tokenmill.layers.forward_context import AttentionMetadata, forward_context
    from tokenmill.loader import load_model

    loaded = load_model(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format)
    ids = loaded.tokenizer(args.prompt)["input_ids"]
    n, bs = len(ids), 16
    blocks = -(-n // bs)
    for layer in loaded.model.model.layers:
        attn = layer.self_attn.attn
        attn.k_cache = torch.zeros(blocks, bs, attn.num_kv_heads, attn.head_dim, dtype=loaded.dtype)
        attn.v_cache = torch.zeros_like(attn.k_cache)
    meta = AttentionMetadata(torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                             torch.arange(blocks, dtype=torch.int32)[None], torch.arange(n), n, n)
    with torch.no_grad(), forward_context(meta):
        logits = loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(n)))[-1]
    probs = logits.softmax(-1)
    top = probs.topk(5)
    print(f"{loaded.source.name}: most likely next tokens after {args.prompt!r}")
    for p, i in zip(top.values.tolist(), top.indices.tolist()):
        print(f"  {loaded.tokenizer.decode([i])!r:20} {p:.3f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill", description="A compact, fast LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt")
    _add_model_args(gen)
    args = parser.parse_args(argv)
    return {"generate": cmd_generate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
