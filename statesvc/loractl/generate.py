"""`loractl generate`: one completion from a replica, on an adapter or on the base model, by
token ids or by text through the base model's tokenizer."""
from __future__ import annotations

from pathlib import Path

import click

from shared.client import ControlClient
from shared.config import MAX_SEED, MAX_SEQ
from shared.endpoints import click_address
from shared.replica_protocol import GENERATE, GENERATE_DEFAULTS, generate_args
from statesvc.console import JSON_OPT, emit, handles_errors, keys_of, out, terminal_safe
from statesvc.loractl.options import TEXT, Finite, parse_ids


@click.command()
@click.option("--replica", required=True, envvar="LORAPLANE_REPLICA", callback=click_address,
              help="A replica's listen address, e.g. tcp://127.0.0.1:7200 (env LORAPLANE_REPLICA).")
@click.option("--adapter", type=TEXT, default=None,
              help="Adapter name; without it, the base model.")
@click.option("--input-ids", default=None, help="Prompt token ids, comma-separated.")
@click.option("--prompt", type=TEXT, default=None,
              help="Prompt text instead of --input-ids, tokenized with --model's tokenizer; "
                   "the output is shown as text too.")
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help="The base model dir whose tokenizer.json --prompt uses.")
@click.option("--max-new-tokens", type=click.IntRange(1, MAX_SEQ),
              default=GENERATE_DEFAULTS["max_new_tokens"], show_default=True)
@click.option("--temperature", type=Finite(0, 100), default=GENERATE_DEFAULTS["temperature"],
              show_default=True, help="0 is greedy.")
@click.option("--top-p", type=Finite(0, 1, min_open=True),
              default=GENERATE_DEFAULTS["top_p"], show_default=True)
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=GENERATE_DEFAULTS["seed"],
              show_default=True)
@click.option("--stop-token-ids", default="", help="Comma-separated ids that end the output.")
@click.option("--min-seq", type=click.IntRange(0, MAX_SEQ),
              default=GENERATE_DEFAULTS["min_seq"],
              show_default=True,
              help="Wait until the replica has applied this seq (read your own load).")
@click.option("--replica-server-key", envvar="LORAPLANE_REPLICA_SERVER_KEY", default=None,
              help="CURVE: the replica's public key file, when it runs with --auth "
                   "(env LORAPLANE_REPLICA_SERVER_KEY); your key is --key.")
@JSON_OPT
@click.pass_context
@handles_errors
def generate(ctx: click.Context, replica: str, adapter: str | None, input_ids: str | None,
             prompt: str | None, model: Path | None, max_new_tokens: int, temperature: float,
             top_p: float, seed: int, stop_token_ids: str, min_seq: int,
             replica_server_key: str | None, as_json: bool) -> None:
    """Ask a replica for a completion, on an adapter or on the base model."""
    if (input_ids is None) == (prompt is None):
        raise click.UsageError("give the prompt as --input-ids or as --prompt (one of them)")
    codec = None
    if prompt is not None:
        if model is None:
            raise click.UsageError("--prompt needs --model DIR, the base model whose "
                                   "tokenizer.json turns text into token ids")
        from shared.text import NoTokenizer, TextCodec
        try:
            codec = TextCodec.load(model)
        except NoTokenizer as exc:
            raise click.UsageError(str(exc))
        ids = codec.encode(prompt)
        if not ids:
            raise click.BadParameter("the prompt is empty", param_hint="--prompt")
    else:
        assert input_ids is not None
        ids = parse_ids(input_ids, "--input-ids")
    args = generate_args(ids, adapter=adapter, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, seed=seed,
                         stop_token_ids=(parse_ids(stop_token_ids, "--stop-token-ids")
                                         if stop_token_ids else []),
                         min_seq=min_seq)
    keys_ = keys_of(ctx.obj["key"], replica_server_key) if replica_server_key else None
    with ControlClient(replica, timeout_s=max(ctx.obj["timeout"], 60.0), retries=0,
                       keys=keys_) as c:
        res = c.call(GENERATE, args)
    if codec is not None:
        res["text"] = codec.decode(res["output_ids"])
    if as_json:
        emit(res)
        return
    who = (f"{res['adapter']['name']} v{res['adapter']['version']}" if res["adapter"]
           else "base model")
    out.print(terminal_safe(f"{who} (replica at seq {res['seq']}): "
                            f"{','.join(map(str, res['output_ids']))}"))
    if codec is not None:
        out.print(terminal_safe(res["text"]))
    t = res["timings"]
    out.print("[dim]" + terminal_safe(f"queue {t['queue_ms']:.1f} ms, prefill "
                                      f"{t['prefill_ms']:.1f} ms, decode {t['decode_ms']:.1f} "
                                      f"ms, total {t['total_ms']:.1f} ms") + "[/]")
