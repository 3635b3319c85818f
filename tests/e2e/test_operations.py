"""Operational basics on the real stack: Prometheus metrics move as expected, a client disconnect frees the
slot, and nothing compiles after warm-up."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}."""
    out = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metric(values: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in values.items() if k.startswith(prefix))


@pytest.fixture(scope="module")
def urls(stack):
    return stack.base_url + "/metrics", f"http://127.0.0.1:{stack.ports['metrics']}/metrics"


def test_metrics_move_after_requests(stack, urls):
    gw0, wk0 = scrape(urls[0]), scrape(urls[1])
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    prompt = "Metrics check: the quick brown fox jumps over the lazy dog."
    for _ in range(2):
        client.completions.create(model="gemma-3-270m", prompt=prompt, max_tokens=4, temperature=0)
    gw1, wk1 = scrape(urls[0]), scrape(urls[1])
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


def test_client_disconnect_frees_the_slot(stack, urls):
    with httpx.stream("POST", stack.base_url + "/v1/completions", timeout=300,
                      json={"prompt": "Write a very long story about the sea.", "max_tokens": 500,
                            "temperature": 0, "stream": True, "ignore_eos": True}) as response:
        lines = response.iter_lines()
        chunks = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in chunks)
        assert scrape(urls[1])["gemma_serve:num_requests_running"] == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and scrape(urls[1])["gemma_serve:num_requests_running"] != 0:
        time.sleep(0.1)
    assert scrape(urls[1])["gemma_serve:num_requests_running"] == 0, "the disconnected request still holds a slot"


def test_non_streamed_disconnect_aborts_too(stack, urls):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.base_url + "/v1/completions", timeout=1.0,
                   json={"prompt": "Another long story.", "max_tokens": 500, "temperature": 0,
                         "ignore_eos": True})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and scrape(urls[1])["gemma_serve:num_requests_running"] != 0:
        time.sleep(0.1)
    assert scrape(urls[1])["gemma_serve:num_requests_running"] == 0
