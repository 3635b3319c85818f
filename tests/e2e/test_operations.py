"""Operational basics on the real stack: Prometheus metrics move as expected, a client disconnect frees the
slot, and nothing compiles after warm-up."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def scrape(read) -> dict[str, float]:
    """Prometheus text (what `read()` returns) -> {name{labels}: value}."""
    out = {}
    for line in read().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metric(values: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in values.items() if k.startswith(prefix))


@pytest.fixture(scope="module")
def readers(stack):
    """Readers of the gateway's and the worker's Prometheus text."""

    def gateway() -> str:
        with stack.http(timeout=10) as http:
            return http.get("/metrics").text

    return gateway, lambda: stack.worker_metrics(timeout=10)


def test_metrics_move_after_requests(stack, readers):
    gw0, wk0 = scrape(readers[0]), scrape(readers[1])
    client = stack.openai()
    prompt = "Metrics check: the quick brown fox jumps over the lazy dog."
    for _ in range(2):
        client.completions.create(model="gemma-3-270m", prompt=prompt, max_tokens=4, temperature=0)
    gw1, wk1 = scrape(readers[0]), scrape(readers[1])
    assert metric(gw1, "gemma_serve:gateway_time_to_first_token_seconds_count") - \
        metric(gw0, "gemma_serve:gateway_time_to_first_token_seconds_count") == 2
    assert metric(gw1, 'gemma_serve:gateway_requests_total{path="/v1/completions",status="200"}') - \
        metric(gw0, 'gemma_serve:gateway_requests_total{path="/v1/completions",status="200"}') == 2
    assert metric(wk1, "gemma_serve:generation_tokens_total") - metric(wk0, "gemma_serve:generation_tokens_total") == 8
    assert metric(wk1, "gemma_serve:prefix_cache_queries_total") - metric(wk0, "gemma_serve:prefix_cache_queries_total") == 2
    assert metric(wk1, "gemma_serve:prefix_cache_hits_total") - metric(wk0, "gemma_serve:prefix_cache_hits_total") >= 1
    assert metric(wk1, "gemma_serve:inter_token_latency_seconds_count") > metric(wk0, "gemma_serve:inter_token_latency_seconds_count")
    assert metric(wk1, "gemma_serve:compiled_programs") > 0
    assert metric(wk1, "gemma_serve:compilations_total") == metric(wk0, "gemma_serve:compilations_total"), \
        "a request triggered a compilation"
    assert wk1["gemma_serve:num_requests_running"] == 0


def test_client_disconnect_frees_the_slot(stack, readers):
    with stack.http(timeout=300) as http, http.stream(
            "POST", "/v1/completions", json={"prompt": "Write a very long story about the sea.", "max_tokens": 500,
                                             "temperature": 0, "stream": True, "ignore_eos": True}) as response:
        lines = response.iter_lines()
        chunks = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in chunks)
        assert scrape(readers[1])["gemma_serve:num_requests_running"] == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and scrape(readers[1])["gemma_serve:num_requests_running"] != 0:
        time.sleep(0.1)
    assert scrape(readers[1])["gemma_serve:num_requests_running"] == 0, "the disconnected request still holds a slot"


def test_non_streamed_disconnect_aborts_too(stack, readers):
    with pytest.raises(httpx.ReadTimeout), stack.http(timeout=1.0) as http:
        http.post("/v1/completions", json={"prompt": "Another long story.", "max_tokens": 500, "temperature": 0,
                                           "ignore_eos": True})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and scrape(readers[1])["gemma_serve:num_requests_running"] != 0:
        time.sleep(0.1)
    assert scrape(readers[1])["gemma_serve:num_requests_running"] == 0
