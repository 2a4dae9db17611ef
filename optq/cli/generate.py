"""``optq generate``: text from a quantized checkpoint (or any model), with its speed and memory."""

from __future__ import annotations

import argparse
import sys
import time

from . import CliError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand."""
    p = subparsers.add_parser(
        "generate",
        help="generate text from a checkpoint and print its speed and memory",
        description="Load a model (an optq checkpoint folder, any Hugging Face folder, a built-in name "
        "such as smollm2-135m, or a .gguf file), continue PROMPT, and print the text as it is generated, "
        "then prefill and decode tokens/s, the model's resident memory and the peak RSS.",
    )
    p.add_argument("model", help="checkpoint folder, model folder, built-in name or .gguf file")
    p.add_argument("prompt", help="the text to continue")
    p.add_argument("-n", "--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.8, help="with --sample (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="with --sample: nucleus mass (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="with --sample: random seed (default 0)")
    p.add_argument(
        "--embeddings",
        choices=("model", "bfloat16", "int8"),
        default=None,
        help="store the embedding table and float head in bfloat16 (default for checkpoints), int8, or the "
        "model's dtype (default for float models)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the model's float parts (norms, activations, KV cache; default float32); bfloat16 "
        "uses less memory and prefills faster (see docs/serving.md)",
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="quantized layers run the exact float32 reference path instead of the fast CPU kernels",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the decoding step with torch.compile and a static KV cache: faster tokens after a "
        "warm-up of tens of seconds, done (and timed) before the printed text",
    )
    p.add_argument(
        "--aot",
        action="store_true",
        help="decode with the step compiled ahead of time (AOTInductor) by a child process, cached under "
        "$OPTQ_CACHE/aot (tens of seconds the first time): compiled speed without the compiler's memory",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load, generate (streaming the text to stdout), print the measurements."""
    import torch
    from transformers import TextStreamer

    from optq.core.memory import release_host_memory
    from optq.data.zoo import ModelNotInstalledError, load_model
    from optq.eval.speed import TokenClock, compiled_decoding, peak_rss_mb, rss_mb
    from optq.formats.qlinear import QuantLinear

    if args.max_new_tokens < 1:
        raise CliError("--max-new-tokens must be at least 1")
    if args.aot and args.compile:
        raise CliError("--aot and --compile are two ways to compile the decoding step: choose one")
    if args.aot and args.reference:
        raise CliError("--aot compiles the fast path; --reference runs the exact one: choose one")
    if args.sample and not (args.temperature > 0 and 0 < args.top_p <= 1):
        raise CliError("--temperature must be > 0 and --top-p in (0, 1]")
    if args.threads is not None:
        if args.threads < 1:
            raise CliError("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    base = rss_mb()
    started = time.perf_counter()
    try:
        model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), embeddings=args.embeddings)
    except (ModelNotInstalledError, FileNotFoundError, ValueError, RuntimeError) as exc:
        raise CliError(str(exc)) from exc
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for q in quantized:
        q.use_fast_path = not args.reference
    fast = sum(q.build_fast_path() for q in quantized)  # part of loading, not of the first token
    load_s = time.perf_counter() - started
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise CliError("the prompt is empty after tokenization")
    clock = TokenClock(TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
    options: dict = {"max_new_tokens": args.max_new_tokens, "streamer": clock, "pad_token_id": tokenizer.eos_token_id}
    if args.sample:
        options.update(do_sample=True, temperature=args.temperature, top_p=args.top_p)
    else:
        options.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    warmup = ""
    if args.aot:
        from optq.eval.aot import AotDecoder, cache_length, manifest_path, package_path

        started = time.perf_counter()
        load = {"dtype": args.dtype, "embeddings": args.embeddings}
        try:
            length = cache_length(ids.shape[1] + args.max_new_tokens)
            if not manifest_path(package_path(model, length)).exists():
                print("compiling the decoding step ahead of time (once: cached for later runs) ...", file=sys.stderr)
            decoder = AotDecoder.for_model(model, args.model, length, load=load)
        except (ValueError, RuntimeError) as exc:
            raise CliError(str(exc)) from exc
        options.update(decoder.options())
        warmup = f"; ahead-of-time step ready in {time.perf_counter() - started:.1f} s"
    with torch.inference_mode():
        if args.compile:
            options.update(compiled_decoding())
            print("compiling the decoding step ...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            quiet = {**options, "streamer": None, "min_new_tokens": args.max_new_tokens}
            model.generate(ids, attention_mask=torch.ones_like(ids), **quiet)  # the same shapes: compiles once
            release_host_memory()  # the compiler's freed work memory, which glibc would keep
            warmup = f"; compiled in {time.perf_counter() - started:.1f} s"
        if args.sample:
            torch.manual_seed(args.seed)  # here: a compiling warm-up draws from the generator too
        print(args.prompt, end="", flush=True)
        clock.restart()
        model.generate(ids, attention_mask=torch.ones_like(ids), **options)
    print()
    if quantized:
        what = f"{len(quantized)} quantized layers: {fast} on the fast CPU kernels, {len(quantized) - fast} exact"
    else:
        what = "no quantized layers"
    storage = args.embeddings or ("bfloat16" if quantized else "model")
    print(f"\n{what}; {args.dtype}, embeddings: {storage}; load {load_s:.1f} s{warmup}", file=sys.stderr)
    print(clock.summary(ids.shape[1]), file=sys.stderr)
    if args.aot:
        print(f"decoding steps run ahead-of-time compiled: {decoder.steps}", file=sys.stderr)
    grown, peak = rss_mb() - base, peak_rss_mb()
    print(f"memory: {grown:.0f} MB resident for the model and its run, peak RSS {peak:.0f} MB", file=sys.stderr)
    return 0
