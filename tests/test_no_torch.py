"""No torch in any runtime path: import the three services, load the model and tokenizer, check sys.modules."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow


def test_services_and_model_load_without_torch(prepared):
    script = textwrap.dedent(
        f"""
        import json, pathlib, sys
        import gemma_serve.cli, gemma_serve.launcher, gemma_serve.models
        import gateway.api.app, gateway.main, gateway.api.grpc_service
        import tokenizer_svc.main, tokenizer_svc.service
        import model_worker.server.main, model_worker.server.service, model_worker.engine.engine
        from gemma_serve.models import PreparedModel
        from tokenizer_svc.tokenizer import TextTokenizer
        import jax.numpy as jnp
        from safetensors.numpy import load_file
        from model_worker.modeling.config import config_from_dict
        from model_worker.modeling.params import to_device
        d = pathlib.Path({str(prepared.dir)!r})
        TextTokenizer.from_prepared(d, ("<end_of_turn>",))
        cfg = config_from_dict(json.loads((d / "config.json").read_text()))
        to_device(cfg, load_file(str(d / "model.safetensors")), jnp.float32)
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
        assert not heavy, heavy
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
