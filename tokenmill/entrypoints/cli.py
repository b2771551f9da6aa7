"""The `tokenmill` command line: generate, chat (and serve, bench when installed)."""

import argparse
import sys
from typing import Optional


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="HF directory, GGUF file, or preset with --load-format dummy (default: the embedded "
                        "smollm2-135m-instruct)")
    g.add_argument("--load-format", default="auto", choices=["auto", "hf", "gguf", "dummy"])
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None,
                   help="prompt tokens a step may take while it runs decodes (bounds inter-token latency)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-async-scheduling", action="store_true")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    g.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=2048,
                   help="CUDA: prefill / mixed steps of up to this many tokens replay piecewise CUDA graphs "
                        "(attention eager between them); 0: eager")
    g.add_argument("--no-fused-small-batch-linear", action="store_true",
                   help="CUDA: batch-1 decode steps use cuBLAS and separate norm/activation kernels")
    g.add_argument("--engine-seed", type=int, default=0, help="seeds dummy weights and unseeded requests")


def engine_from_args(args):
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    config = EngineConfig(
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching, async_scheduling=not args.no_async_scheduling,
        enforce_eager=args.enforce_eager, seed=args.engine_seed,
        max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
        fused_small_batch_linear=not args.no_fused_small_batch_linear,
        piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
    )
    return LLMEngine(args.model, config, dtype=args.dtype, device=args.device, load_format=args.load_format)


def _add_sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=temperature)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", dest="sample_seed", type=int, default=None, help="sampling seed")


def _sampling_params(args):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sample_seed)


def stream_completion(engine, prompt_ids: list[int], params, out=sys.stdout) -> str:
    """Run one request, writing its text as it is generated; returns the full text."""
    request_id = engine.add_request(None, params, prompt_ids=prompt_ids)
    shown, text = 0, ""
    try:
        while True:
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                text = output.outputs[0].text
                out.write(text[shown:])
                out.flush()
                shown = len(text)
                if output.finished:
                    return text
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
        raise


def _render(engine, conversation: list[dict]) -> list[int]:
    tok = engine.tokenizer
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return engine.tokenize(text, add_special_tokens=False)


def cmd_generate(args) -> int:
    engine = engine_from_args(args)
    params = _sampling_params(args)
    use_template = not args.raw and engine.tokenizer is not None and getattr(engine.tokenizer, "chat_template", None)
    if use_template:
        ids = _render(engine, [{"role": "user", "content": args.prompt}])
    else:
        ids = engine.tokenize(args.prompt)
    stream_completion(engine, ids, params)
    print()
    return 0


def cmd_chat(args) -> int:
    engine = engine_from_args(args)
    if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
        print("this model has no chat template", file=sys.stderr)
        return 2
    params = _sampling_params(args)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print(f"chatting with {engine.model_name}; /reset clears the conversation, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = stream_completion(engine, _render(engine, history), params)
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            history.pop()
            continue
        print()
        history.append({"role": "assistant", "content": reply})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="A compact, fast LLM inference engine.")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default) or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer one prompt, printing tokens as they come")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    add_engine_args(gen)
    _add_sampling_args(gen, temperature=0.0)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat")
    chat.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(chat)
    _add_sampling_args(chat, temperature=0.7)
    chat.set_defaults(func=cmd_chat)

    for extra in ("tokenmill.entrypoints.serve_cli", "tokenmill.bench.cli"):
        try:
            module = __import__(extra, fromlist=["register"])
        except ImportError:
            continue
        module.register(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    import os

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.log_level:
        os.environ["TOKENMILL_LOG_LEVEL"] = args.log_level
    from tokenmill.errors import TokenmillError

    try:
        return args.func(args)
    except TokenmillError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
