"""`ostinato generate`, `ostinato chat` and `ostinato serve`."""

import argparse
import logging
import sys

from ostinato.config import EngineArgs
from ostinato.sampling_params import SamplingParams


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="most new tokens per reply")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="seed for this run's sampling")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          min_p=ns.min_p, seed=ns.sampling_seed, stop=ns.stop)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ostinato", description="Ostinato LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts (positional, or one per stdin line)")
    gen.add_argument("prompts", nargs="*", help="prompt texts")
    chat = sub.add_parser("chat", help="chat through the model's chat template")
    chat.add_argument("message", nargs="*", help="one-shot message(s); interactive when none")
    chat.add_argument("--system", default=None, help="system prompt")
    for p in (gen, chat):
        EngineArgs.add_cli_args(p)
        _add_sampling_args(p)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (the engine runs in its own process)")
    from ostinato.entrypoints.openai.cli_args import add_serve_args

    add_serve_args(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    if ns.command == "serve":
        from ostinato.entrypoints.openai.api_server import run_server

        try:
            return run_server(ns)
        except ValueError as e:
            print(f"ostinato: error: {e}", file=sys.stderr)
            return 2
    from ostinato.entrypoints.llm import LLM

    try:
        sp = _sampling(ns)
        llm = LLM(**{k: v for k, v in vars(EngineArgs.from_cli_args(ns)).items()})
        if ns.command == "generate":
            prompts = ns.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
            for out in llm.generate(prompts, sp, use_tqdm=len(prompts) > 1):
                print(f"{out.prompt}{out.outputs[0].text}")
            return 0
        return _chat(llm, ns, sp)
    except ValueError as e:
        print(f"ostinato: error: {e}", file=sys.stderr)
        return 2


def _chat(llm, ns: argparse.Namespace, sp: SamplingParams) -> int:
    history = [{"role": "system", "content": ns.system}] if ns.system else []
    one_shot = bool(ns.message)
    queue = list(ns.message)
    while True:
        if one_shot:
            if not queue:
                return 0
            text = queue.pop(0)
        else:
            try:
                text = input("you> ")
            except EOFError:
                return 0
            if text.strip() in ("/exit", "/quit"):
                return 0
        history.append({"role": "user", "content": text})
        reply = llm.chat(history, sp, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        print(reply if one_shot else f"assistant> {reply}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
