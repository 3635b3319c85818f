#!/usr/bin/env python3
"""How far each matmul precision's logits are from transformers' float32 logits on the embedded Gemma 3 270M, with
llama.cpp's own logits for the same token ids beside them: the numerics table of `--matmul-precision int8`.

Not a test (tests/model_worker/test_gemma3_numerics.py holds the bound): prints one row per path over the long
test text (948 tokens: ours as 940 prompt-chunk positions and 8 cached decode steps; llama.cpp as one prompt
batch): max and mean |Δlogit|, mean KL(reference || path) of the next-token distributions, and the share of
positions with the reference's argmax among those whose top-2 gap exceeds 0.5.

    .venv/bin/python benchmarks/q8_numerics.py            # llama.cpp too when benchmarks/llama_cpp_server.sh
                                                          # has built it (`benchmarks/llama_cpp_server.sh build`)
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from model_worker.numerics.xla_options import INVARIANT_CPU_FLAGS, add_xla_flags  # noqa: E402

add_xla_flags(*INVARIANT_CPU_FLAGS)

import numpy as np  # noqa: E402

LLAMA = HERE / ".llama.cpp"
LLAMA_VERSION = "0.3.36"


def llama_tool() -> pathlib.Path | None:
    """benchmarks/llama_logits.cpp built against the llama.cpp of benchmarks/llama_cpp_server.sh (None when that
    build is missing)."""
    src = LLAMA / f"llama_cpp_python-{LLAMA_VERSION}" / "vendor" / "llama.cpp"
    build = LLAMA / f"build-{LLAMA_VERSION}"
    tool = build / "llama_logits"
    libs = [build / "src/libllama.a", build / "ggml/src/libggml.a", build / "ggml/src/libggml-cpu.a",
            build / "ggml/src/libggml-base.a"]
    if not all(p.exists() for p in libs):
        return None
    if not tool.exists() or tool.stat().st_mtime < (HERE / "llama_logits.cpp").stat().st_mtime:
        subprocess.run(["g++", "-O2", "-std=c++17", f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}",
                        str(HERE / "llama_logits.cpp"), *map(str, libs), "-fopenmp", "-lpthread", "-ldl", "-o",
                        str(tool)], check=True)
    return tool


def llama_logits(tool: pathlib.Path, gguf: pathlib.Path, ids: np.ndarray, vocab: int) -> np.ndarray:
    """llama.cpp's float32 logits [T, V] for `ids` (2 threads)."""
    with tempfile.TemporaryDirectory() as tmp:
        (pathlib.Path(tmp) / "ids.bin").write_bytes(np.asarray(ids, np.int32).tobytes())
        subprocess.run([str(tool), str(gguf), f"{tmp}/ids.bin", f"{tmp}/out.bin", "2"], check=True,
                       capture_output=True)
        return np.fromfile(f"{tmp}/out.bin", np.float32).reshape(len(ids), vocab)


def main() -> None:
    """Print the table."""
    import jax.numpy as jnp
    import torch
    import transformers
    from safetensors.numpy import load_file

    from common import families, preparation
    from model_worker.modeling.config import config_from_dict
    from model_worker.modeling.params import for_matmul_precision, to_device
    from model_worker.server.main import PREPARE_PARTS
    from tests.conftest import hf_gemma3_float32_dir
    from tests.model_worker import test_gemma3_numerics as t
    from tokenizer_svc.chat_template import tokenizer_part
    from tokenizer_svc.tokenizer import TextTokenizer

    cache = preparation.default_cache_dir()
    cache = cache / "test" if (cache / "test").is_dir() else cache  # the test session's reference copy, if any
    prepared = preparation.prepare("embedded", cache, PREPARE_PARTS)
    gguf = preparation.embedded_gguf(cache)
    tok = TextTokenizer.from_prepared(prepared.dir, tokenizer_part(families.by_name("gemma3")).template_facts.end_of_turn)
    ids = np.asarray(tok.encode(t.LONG, add_bos=True), np.int32)
    cfg = config_from_dict(json.loads((prepared.dir / "config.json").read_text()))
    params = to_device(cfg, load_file(str(prepared.dir / "model.safetensors")), jnp.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_gemma3_float32_dir(gguf)), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None].astype(np.int64))).logits[0].float().numpy()
    del hf
    top2 = t._top2(ref)
    clear = (top2[:, 1] - top2[:, 0]) > 0.5
    print(f"{len(ids)} positions, {int(clear.sum())} with a top-2 gap > 0.5; reference: transformers float32")
    print(f"{'path':34s} {'max|Δ|':>8s} {'mean|Δ|':>8s} {'mean KL':>9s} {'argmax':>9s}")

    def row(name: str, logits: np.ndarray) -> None:
        d = t.divergence(logits, ref)
        agree = (logits.argmax(-1)[clear] == ref.argmax(-1)[clear]).mean()
        print(f"{name:34s} {d['max']:8.3f} {d['mean']:8.4f} {d['kl']:9.2e} {agree:9.1%}", flush=True)

    for precision, invariant in (("float32", False), ("bfloat16", True), ("int8", True)):
        c, p = for_matmul_precision(cfg, params, precision, invariant)
        row(f"ours, {precision}{' (batch-invariant)' if invariant else ''}", t.prompt_then_decode_logits(c, p, ids))
    tool = llama_tool()
    if tool is None:
        print("llama.cpp: not built (benchmarks/llama_cpp_server.sh build)")
    else:
        row("llama.cpp (its Q8 activations)", llama_logits(tool, gguf, ids, ref.shape[1]))


if __name__ == "__main__":
    main()
